"""``reward_judge``: prefers the output a fixed reward model scores higher; ties when the scores are equal."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from alpacafarm.annotation import Annotator, ProgressCallback, identical_tie
from alpacafarm.types import Annotation, Pair


@dataclass
class RewardJudgeConfig:
    #: the reward-model folder that scores both outputs
    model: str = ""
    prompt_format: str = "chat_template"

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model is required: a reward-model folder")


class RewardJudge(Annotator):
    """Deterministic and order-independent: the label depends only on the two outputs' reward scores."""

    config_class = RewardJudgeConfig

    def __init__(self, config: RewardJudgeConfig) -> None:
        self.config = config
        self.name = "reward_judge"
        self._scorer = None

    def scorer(self):
        if self._scorer is None:
            from alpacafarm.recipe import ModelSpec
            from alpacafarm.rewards import RewardScorer

            spec = ModelSpec(name=self.config.model, dtype="float32", device="cpu",
                             prompt_format=self.config.prompt_format)
            self._scorer = RewardScorer.from_path(self.config.model, spec, batch_size=32)
        return self._scorer

    @staticmethod
    def decide(score_1: float, score_2: float) -> int:
        return 0 if score_1 == score_2 else (1 if score_1 > score_2 else 2)

    async def aannotate(self, pairs: Sequence[Pair], progress: ProgressCallback | None = None) -> list[Annotation]:
        records = [{"instruction": p.instruction, "input": p.input} for p in pairs]
        first = self.scorer()(records, [p.output_1 for p in pairs])
        second = self.scorer()(records, [p.output_2 for p in pairs])
        annotations = []
        for pair, a, b in zip(pairs, first, second, strict=True):
            annotation = identical_tie(pair, self.name)
            annotations.append(annotation or Annotation(self.decide(a, b), self.name,
                                                        metadata={"scores": [a, b]}))
        if progress is not None:
            progress(len(pairs), 0.0)
        return annotations
