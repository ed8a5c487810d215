"""The ``offline`` annotator: the offline judge (no network, no key, $0, deterministic, order-independent).

It is reference-guided when it can be: ``references`` names records with ``instruction``, optional ``input``
and a strong model's answer (``reference`` or ``output``); for a pair whose instruction has one, both outputs are
scored against it. A reference equal to one of the two outputs is never used (a system is never its own
reference); without one the judge falls back to its reference-free weights.

``continuous: true`` asks for AlpacaEval 2's weighted preferences instead of hard labels: the preference is
``1 + P(output_2 beats output_1)`` in [1, 2] (1.5 is a tie), with ``P = sigmoid(score_2 - score_1)`` the
judge's Bradley-Terry probability (its head was fitted with exactly this link). Win-rates computed from them are
weighted win-rates, free of the coin-flip variance of a hard label on a close pair, so paired comparisons of two
systems need fewer instructions for the same standard error. The probabilities mirror exactly (``p(a, b) =
1 - p(b, a)``); the option is part of the recipe's annotator config, so a stage that switches it is judged again
and hard and soft labels never mix in one run or one baseline.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from alpacafarm.annotation import Annotator, ProgressCallback, identical_tie
from alpacafarm.recipe import DataSource
from alpacafarm.types import Annotation, Pair


class OfflineAnnotatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    references: DataSource | None = Field(None, description="records with instruction, input, reference/output")
    batch_size: int = Field(32, ge=1, description="texts embedded per forward pass")
    continuous: bool = Field(False, description="preference 1 + P(output_2 wins) in [1, 2] (AlpacaEval 2's "
                             "weighted win-rate) instead of a hard 1/2 label")


class OfflineAnnotator(Annotator):
    config_class = OfflineAnnotatorConfig
    accepts_replicate = True  # deterministic: every replicate is the same label, its true variance of 0

    def __init__(self, config: OfflineAnnotatorConfig) -> None:
        from alpacafarm_annotators.offline_judge.judge import OfflineJudge

        self.config = config
        self.name = "offline"
        self.judge = OfflineJudge(batch_size=self.config.batch_size)
        self._references: dict[tuple[str, str], str] | None = None

    def references(self) -> dict[tuple[str, str], str]:
        if self._references is None:
            from alpacafarm.data import load_source

            self._references = {}
            if self.config.references is not None:
                for record in load_source(self.config.references):
                    text = record.get("reference", record.get("output"))
                    if isinstance(text, str) and text.strip():
                        self._references[(record["instruction"], str(record.get("input") or ""))] = text
        return self._references

    def reference_for(self, pair: Pair) -> str | None:
        reference = self.references().get((pair.instruction, pair.input))
        if reference is None or reference.strip() in (pair.output_1.strip(), pair.output_2.strip()):
            return None
        return reference

    async def aannotate(self, pairs: Sequence[Pair], progress: ProgressCallback | None = None, *,
                        replicate: int = 0) -> list[Annotation]:
        """``replicate`` is accepted and ignored: the judge is deterministic, so every replicate is the same label
        (a variance of 0). A pool with label noise around it (``offline_ann``) has a variance."""
        results: list[Annotation | None] = [identical_tie(p, self.name) for p in pairs]
        todo = [i for i, r in enumerate(results) if r is None]
        instructions = [f"{pairs[i].instruction}\n\n{pairs[i].input}" if pairs[i].input else pairs[i].instruction
                        for i in todo]
        references = [self.reference_for(pairs[i]) for i in todo]
        judged = [(text, pairs[i].output_1, pairs[i].output_2, reference)
                  for text, i, reference in zip(instructions, todo, references, strict=True)]
        labels: Sequence[float | int] = self.probabilities(judged) if self.config.continuous else \
            self.judge.judge(judged)
        for i, label, reference in zip(todo, labels, references, strict=True):
            results[i] = Annotation(label, self.name, metadata={"reference": reference is not None})
        if progress:
            progress(len(pairs), 0.0)
        return [r for r in results if r is not None]

    def probabilities(self, pairs: Sequence[tuple[str, str, str, str | None]]) -> list[float]:
        """``1 + P(output_2 beats output_1)`` for (instruction, output_1, output_2, reference) tuples: the judge's
        :meth:`~OfflineJudge.win_probability` of the swapped pair, so swapping the outputs gives exactly ``1 - P``
        and equal scores give 1.5 (a tie)."""
        swapped = [(instruction, out_2, out_1, reference) for instruction, out_1, out_2, reference in pairs]
        return [1.0 + p for p in self.judge.win_probability(swapped)]
