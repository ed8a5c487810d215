"""Built-in plugin: simulated annotators — API judges and the AlpacaFarm pools, the offline judge, local judges.

Only names are registered here (no pydantic, no openai): the CLI lists them without importing anything heavy.
"""

from pathlib import Path

from alpacafarm import hookimpl

CONFIG_DIR = Path(__file__).parent / "configs"


@hookimpl
def register_annotators(register):
    for path in sorted(CONFIG_DIR.glob("*.yaml")):  # annotators defined as data, one file each
        register(path.stem, "alpacafarm_annotators.presets:preset", args=(path.stem,),
                 runtime=("registry", "cache", "budget"), description=f"configs/{path.name}",
                 identity="alpacafarm_annotators.presets:members_identity")
    for name in alpaca_eval_configs():  # AlpacaEval's evaluator configs through this engine (extra: alpaca-eval)
        register(f"alpaca_eval:{name}", "alpacafarm_annotators.alpaca_eval_source:AlpacaEvalSource", args=(name,),
                 runtime=("cache", "budget"),
                 description=f"AlpacaEval's evaluators_configs/{name}, run by this engine (extra: alpaca-eval)")
    register("offline", "alpacafarm_annotators.offline_judge.annotator:OfflineAnnotator",
             description="offline judge: a head on a small LM's reading, MiniLM and text features; no network, $0",
             identity="alpacafarm_annotators.offline_judge.weights:weights_identity")
    register("gold", "alpacafarm_annotators.gold:GoldAnnotator",
             description="a known gold score as the simulated human: Bradley-Terry preferences plus label noise")
    register("local_judge", "alpacafarm_annotators.local_judge:LocalJudge",
             description="a local causal LM's log-probabilities of the answer labels, both orders averaged")


#: registered even without the extra, so that naming them says which extra to install
ALPACA_EVAL_KNOWN = ("alpaca_farm", "alpaca_farm_greedy_gpt4", "weighted_alpaca_eval_gpt4_turbo")


def alpaca_eval_configs() -> list[str]:
    """The installed alpaca_eval package's evaluator configs (found without importing it), plus ALPACA_EVAL_KNOWN."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("alpaca_eval")
    except (ImportError, ValueError):
        spec = None
    found = set(ALPACA_EVAL_KNOWN)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        found.update(p.parent.name for p in Path(folder, "evaluators_configs").glob("*/configs.yaml"))
    return sorted(found)


@hookimpl
def register_commands(register):
    register("annotate", "alpacafarm_annotators.cli:main", description="annotate pairs of outputs with an annotator")
