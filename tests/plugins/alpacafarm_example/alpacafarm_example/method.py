"""``echo_longest``: a toy method answering each instruction with the longest sentence of its reference.

A method subclasses :class:`alpacafarm.method.Method`, declares its config class and its inputs, and
implements ``run(context) -> Artifact``. It writes its files under ``context.stage_dir`` only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from alpacafarm.data import write_jsonl
from alpacafarm.method import Artifact, Method, StageContext


@dataclass
class EchoLongestConfig:
    """The stage's ``config:`` block, validated once when the recipe loads (errors name the YAML line)."""

    #: truncate answers to this many characters
    max_chars: int = 200

    def __post_init__(self) -> None:
        if self.max_chars < 1:
            raise ValueError(f"max_chars must be at least 1, got {self.max_chars}")


class EchoLongest(Method):
    """Writes ``outputs.jsonl`` (instruction, input, output): an outputs file any evaluator can evaluate."""

    config_class = EchoLongestConfig
    requires = ("instructions",)  # a recipe data source (or an earlier stage) named "instructions"
    provides = "policy_outputs"  # what later stages may require; the evaluation reads it as its "policy"

    def run(self, context: StageContext) -> Artifact:
        config: EchoLongestConfig = self.config
        records = context.records("instructions")
        rows = []
        with context.progress("echo_longest", len(records)) as advance:
            for record in records:
                sentences = re.split(r"(?<=[.!?])\s+", str(record.get("reference", "")).strip())
                answer = max(sentences, key=len)[: config.max_chars]
                rows.append({"instruction": record["instruction"], "input": record.get("input", ""),
                             "output": answer})
                advance()
        path = context.stage_dir / "outputs.jsonl"
        write_jsonl(path, rows)
        return Artifact("outputs", str(path), {"n_outputs": len(rows)})
