"""The records that flow between annotators, methods and evaluators. Plain dataclasses; no pandas here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

#: A preference: 1 = output_1 is better, 2 = output_2 is better, 0 = tie, None = no label (never guessed).
Preference = int | None

#: What became of one annotation request (see :class:`Annotation`).
Outcome = Literal["labelled", "tie", "unparsed", "failed"]
OUTCOMES: tuple[str, ...] = ("labelled", "tie", "unparsed", "failed")


@dataclass(frozen=True)
class Pair:
    """Two outputs for one instruction (and optional input), to be compared."""

    instruction: str
    output_1: str
    output_2: str
    input: str = ""

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Pair:
        missing = [k for k in ("instruction", "output_1", "output_2") if not isinstance(record.get(k), str)]
        if missing:
            raise ValueError(f"a pair needs string fields {', '.join(missing)}")
        return cls(record["instruction"], record["output_1"], record["output_2"], str(record.get("input") or ""))

    def swapped(self) -> Pair:
        return Pair(self.instruction, self.output_2, self.output_1, self.input)


@dataclass
class Annotation:
    """One pair's label with its provenance and cost.

    ``outcome`` says what became of the pair: ``labelled`` (1 or 2, or a continuous preference), ``tie`` (0),
    ``unparsed`` (the judge answered, was asked again and its answer still could not be read: ``preference``
    None, a paid answer of this judge) or ``failed`` (no answer: transport error, HTTP error, budget, a claim
    that never resolved; ``preference`` None, never cached, asked again on the next run). Left out, it follows
    from ``preference`` (None reads as ``unparsed``: what a None meant before outcomes existed). A failure
    carries ``metadata["error"]`` and, for an endpoint, ``metadata["endpoint"]`` (its base URL, never a key).
    ``acceptable``: a pointwise verdict on each output (``output_1``, ``output_2``: acceptable or not), from an
    annotator that gives one besides the preference (the gold annotator's ``acceptable_above``); the binary
    feedback KTO learns from. None when the annotator gives none.
    """

    preference: Preference
    annotator: str
    raw_completion: str | None = None
    tokens_in: int = 0
    tokens_out: int = 0
    price_usd: float = 0.0
    latency_s: float = 0.0
    cached: bool = False
    swapped: bool = False
    noise: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    outcome: Outcome | None = None
    acceptable: tuple[bool, bool] | None = None

    def __post_init__(self) -> None:
        if self.outcome is None:
            self.outcome = outcome_of(self.preference)
        elif self.outcome not in OUTCOMES:
            raise ValueError(f"unknown annotation outcome {self.outcome!r} (known: {', '.join(OUTCOMES)})")

    @property
    def has_label(self) -> bool:
        """A label a method or an evaluator can use: a preference or a tie (not unparsed, not failed)."""
        return self.outcome in ("labelled", "tie")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def outcome_of(preference: Preference) -> Outcome:
    """The outcome a preference stands for when nothing else is known (None: unparsed)."""
    if preference is None:
        return "unparsed"
    return "tie" if preference == 0 else "labelled"


def flip(preference: Preference) -> Preference:
    """The same judgment with the two outputs' order exchanged (1 ↔ 2; ties and None unchanged)."""
    return {1: 2, 2: 1}.get(preference, preference) if preference is not None else None
