"""A toy method: answer each instruction with the longest sentence of its reference output."""

from __future__ import annotations

import re
from dataclasses import dataclass

from alpacafarm.data import write_jsonl
from alpacafarm.method import Artifact, Method, StageContext


@dataclass
class EchoLongestConfig:
    """``max_chars``: truncate answers to this many characters."""

    max_chars: int = 200


class EchoLongest(Method):
    config_class = EchoLongestConfig
    requires = ("instructions",)
    provides = "policy_outputs"

    def run(self, context: StageContext) -> Artifact:
        rows = []
        for record in context.records("instructions"):
            sentences = re.split(r"(?<=[.!?])\s+", str(record.get("reference", "")).strip())
            answer = max(sentences, key=len)[: self.config.max_chars]
            rows.append({"instruction": record["instruction"], "input": record.get("input", ""), "output": answer})
        path = context.stage_dir / "outputs.jsonl"
        write_jsonl(path, rows)
        return Artifact("outputs", str(path), {"n": len(rows)})
