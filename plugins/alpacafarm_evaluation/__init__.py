"""Built-in plugin: evaluation by win-rate against reference outputs, leaderboards."""

from alpacafarm import hookimpl


@hookimpl
def register_evaluators(register):
    register("win_rate", "alpacafarm_evaluation.evaluator:WinRateEvaluator",
             description="win-rate of a system's outputs against reference outputs, with standard error")


@hookimpl
def register_commands(register):
    register("evaluate", "alpacafarm_evaluation.cli:main",
             description="win-rate metrics from recorded annotations, or annotate an outputs file and score it")
    register("leaderboard", "alpacafarm_evaluation.cli:leaderboard_main",
             description="gather evaluation results into one table (CSV, JSON) and a bar plot")
    register("bench", "alpacafarm_evaluation.bench:main",
             description="CI gate: run a benchmark recipe, compare each system with a committed baseline "
                         "(PASS/FAIL/INCONCLUSIVE/STALE)")
    register("ordering", "alpacafarm_evaluation.ordering:main",
             description="rank correlation of a run's method gains with the paper's (Table 2), bootstrapped over "
                         "instructions, and the pairs that swap")
