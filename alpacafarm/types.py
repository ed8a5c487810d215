"""The records that flow between annotators, methods and evaluators. Plain dataclasses; no pandas here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: A preference: 1 = output_1 is better, 2 = output_2 is better, 0 = tie, None = unparsed (never guessed).
Preference = int | None


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
    """One pair's label with its provenance and cost."""

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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def flip(preference: Preference) -> Preference:
    """The same judgment with the two outputs' order exchanged (1 ↔ 2; ties and None unchanged)."""
    return {1: 2, 2: 1}.get(preference, preference) if preference is not None else None
