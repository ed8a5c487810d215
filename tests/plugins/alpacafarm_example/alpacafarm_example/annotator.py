"""``prefer_longer``: a pairwise judge that prefers the longer output (the classic length-bias baseline).

An annotator subclasses :class:`alpacafarm.annotation.Annotator` and implements the async ``aannotate``: one
:class:`~alpacafarm.types.Annotation` per pair, in order, with preference 1 (``output_1`` is better), 2
(``output_2`` is better), 0 (tie) or None (no verdict). Evaluation and ``alpacafarm annotate`` call the
synchronous ``annotate(pairs, progress)`` that the base class provides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from alpacafarm.annotation import Annotator, ProgressCallback, identical_tie
from alpacafarm.types import Annotation, Pair


@dataclass
class PreferLongerConfig:
    """The annotator's config block (a recipe's ``annotator.config``, or ``--set KEY=VALUE``)."""

    #: outputs whose lengths (in characters, surrounding whitespace ignored) differ by at most this much tie
    tie_margin: int = 0

    def __post_init__(self) -> None:
        if self.tie_margin < 0:
            raise ValueError(f"tie_margin must be at least 0, got {self.tie_margin}")


class PreferLonger(Annotator):
    """Prefers the longer output; identical outputs, and lengths within ``tie_margin`` characters, tie."""

    config_class = PreferLongerConfig

    def __init__(self, config: PreferLongerConfig) -> None:
        self.config = config
        self.name = "prefer_longer"

    async def aannotate(self, pairs: Sequence[Pair],
                        progress: ProgressCallback | None = None) -> list[Annotation]:
        annotations = []
        for pair in pairs:
            annotation = identical_tie(pair, self.name)
            if annotation is None:
                difference = len(pair.output_1.strip()) - len(pair.output_2.strip())
                preference = 0 if abs(difference) <= self.config.tie_margin else (1 if difference > 0 else 2)
                annotation = Annotation(preference, self.name, metadata={"length_difference": difference})
            annotations.append(annotation)
        if progress is not None:
            progress(len(pairs), 0.0)  # n annotated, cost in USD
        return annotations
