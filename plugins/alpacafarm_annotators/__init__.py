"""Built-in plugin: simulated annotators — API judges and the AlpacaFarm pools, the offline judge, local judges.

Only names are registered here (no pydantic, no openai): the CLI lists them without importing anything heavy.
"""

from pathlib import Path

from alpacafarm import hookimpl

CONFIG_DIR = Path(__file__).parent / "configs"


@hookimpl
def register_annotators(register):
    for path in sorted(CONFIG_DIR.glob("*.yaml")):  # annotators defined as data, one file each
        register(path.stem, f"alpacafarm_annotators.presets:{path.stem}", description=f"configs/{path.name}")
    register("offline", "alpacafarm_annotators.offline:OfflineAnnotator",
             description="offline judge: MiniLM + text features, no network, $0, order-independent")
    register("local_judge", "alpacafarm_annotators.local_judge:LocalJudge",
             description="a local causal LM's log-probabilities of the answer labels, both orders averaged")


@hookimpl
def register_commands(register):
    register("annotate", "alpacafarm_annotators.cli:main", description="annotate pairs of outputs with an annotator")
