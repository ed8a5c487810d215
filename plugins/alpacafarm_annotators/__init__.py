"""Built-in plugin: simulated annotators — API judges and the AlpacaFarm pools, the offline judge, local judges."""

from alpacafarm import hookimpl
from alpacafarm_annotators.config import builtin_annotator_names


@hookimpl
def register_annotators(register):
    for name in builtin_annotator_names():
        register(name, f"alpacafarm_annotators.presets:{name}", description=f"configs/{name}.yaml")
    register("offline", "alpacafarm_annotators.offline:OfflineAnnotator",
             description="offline judge: MiniLM + text features, no network, $0, order-independent")
    register("local_judge", "alpacafarm_annotators.local_judge:LocalJudge",
             description="a local causal LM's log-probabilities of the answer labels, both orders averaged")


@hookimpl
def register_commands(register):
    register("annotate", "alpacafarm_annotators.cli:main", description="annotate pairs of outputs with an annotator")
