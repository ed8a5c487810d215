"""Built-in plugin: validating the simulator against human data (rank correlations, annotator agreement)."""

from alpacafarm import hookimpl


@hookimpl
def register_validators(register):
    register("rank_correlation", "alpacafarm_validation.correlations:RankCorrelationValidator",
             description="Spearman, Pearson, Kendall, R² between two win-rate columns, bootstrap intervals")
    register("agreement", "alpacafarm_validation.agreement:AgreementValidator",
             description="leave-one-out agreement, bias, variance (from replicates), P(prefer longer), P(prefer first)")


@hookimpl
def register_commands(register):
    register("compare", "alpacafarm_validation.cli:main",
             description="validate the simulator: correlate two win-rate columns, annotator agreement or variance")
    register("label", "alpacafarm_validation.label_cli:main",
             description="people label pairs in a browser (serve), export their labels, report simulator agreement")
