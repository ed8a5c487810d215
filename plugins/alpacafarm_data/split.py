"""``split_instructions``: deduplicate instruction records and split them into train and held-out eval files."""

from __future__ import annotations

import random
from collections import Counter

from pydantic import BaseModel, ConfigDict, Field

from alpacafarm.data import write_jsonl
from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, StageContext


class SplitInstructionsConfig(BaseModel):
    """How to split: the held-out fraction (or count), and an optional cap on the train split."""

    model_config = ConfigDict(extra="forbid")

    eval_fraction: float = Field(0.25, gt=0.0, lt=1.0, description="share of instructions held out for evaluation")
    eval_size: int | None = Field(None, ge=1, description="exact number held out (overrides eval_fraction)")
    max_train: int | None = Field(None, ge=1, description="keep at most this many training instructions")


class SplitInstructions(Method):
    """Reads the ``instructions`` data source, drops duplicate (instruction, input) pairs, shuffles with the
    stage seed and writes ``train.jsonl`` and ``eval.jsonl``. Train and eval never share an instruction."""

    config_class = SplitInstructionsConfig
    requires = ("instructions",)
    provides = "instruction_splits"

    def run(self, context: StageContext) -> Artifact:
        config: SplitInstructionsConfig = self.config
        records = context.records("instructions")
        missing = [i for i, r in enumerate(records) if not str(r.get("instruction", "")).strip()]
        if missing:
            raise UserError(f"instruction data: record {missing[0]} has no 'instruction' ({len(missing)} such records)")
        unique: dict[tuple[str, str], dict] = {}
        for record in records:
            unique.setdefault((record["instruction"].strip(), str(record.get("input") or "").strip()), record)
        rows = list(unique.values())
        random.Random(context.seed).shuffle(rows)
        n_eval = config.eval_size or max(1, round(len(rows) * config.eval_fraction))
        if n_eval >= len(rows):
            raise UserError(f"split_instructions: {len(rows)} unique instructions cannot hold out {n_eval}")
        eval_rows, train_rows = rows[:n_eval], rows[n_eval:]
        if config.max_train:
            train_rows = train_rows[: config.max_train]
        write_jsonl(context.stage_dir / "train.jsonl", train_rows)
        write_jsonl(context.stage_dir / "eval.jsonl", eval_rows)
        sources = Counter(str(r.get("dataset", "?")) for r in eval_rows)
        context.logger.info("split %d unique of %d records: %d train, %d eval", len(rows), len(records),
                            len(train_rows), len(eval_rows))
        return Artifact(
            "dataset",
            str(context.stage_dir),
            {"train": "train.jsonl", "eval": "eval.jsonl", "n_records": len(records), "n_unique": len(rows),
             "n_train": len(train_rows), "n_eval": len(eval_rows), "eval_sources": dict(sources)},
        )
