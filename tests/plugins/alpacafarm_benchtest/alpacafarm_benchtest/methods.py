"""A regressed and a refactored best-of-n, and a stage that hands a fixed reward-model folder on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from alpacafarm.method import Artifact, Method, StageContext
from alpacafarm_methods.sampling.best_of_n import BestOfN


class WorstOfN(BestOfN):
    """Best-of-n with the reward negated: the "best" sample is the one the reward model likes least."""

    def run(self, context: StageContext) -> Artifact:
        real = context.reward_function

        def negated(**kwargs: Any) -> Any:
            scorer = real(**kwargs)
            return lambda records, completions: [-score for score in scorer(records, completions)]

        context.reward_function = negated  # this stage's context only
        return super().run(context)


class RefactoredBestOfN(BestOfN):
    """The built-in best-of-n, renamed: a neutral refactor."""


@dataclass
class FixedRewardModelConfig:
    #: a reward-model folder (a sequence classifier with one output and its tokenizer)
    path: str = ""
    #: raise instead (a planted bug: the gate must report a crash, not a verdict)
    crash: bool = False

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path is required: a reward-model folder")


class FixedRewardModel(Method):
    """Provides ``reward_model``: the folder of its config, as it is."""

    config_class = FixedRewardModelConfig
    provides = "reward_model"

    def run(self, context: StageContext) -> Artifact:
        if self.config.crash:
            raise RuntimeError("planted crash")
        return Artifact("model", self.config.path, {"fixed": True})
