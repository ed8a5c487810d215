"""A toy annotator: prefers the longer output (1 or 2), ties on equal length (0)."""

from __future__ import annotations


class PreferLonger:
    def __init__(self, config: dict | None = None) -> None:
        self.config = dict(config or {})

    def annotate(self, pairs: list[dict]) -> list[int]:
        out = []
        for pair in pairs:
            a, b = len(pair["output_1"]), len(pair["output_2"])
            out.append(0 if a == b else (1 if a > b else 2))
        return out
