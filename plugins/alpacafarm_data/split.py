"""``split_instructions``: deduplicate instruction records and split them into train and held-out eval files."""

from __future__ import annotations

import random
from collections import Counter
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.data import write_jsonl
from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, StageContext


class SplitInstructionsConfig(BaseModel):
    """How to split: the held-out fraction (or count), and an optional cap on the train split."""

    model_config = ConfigDict(extra="forbid")

    eval_fraction: float = Field(0.25, gt=0.0, lt=1.0, description="share of instructions held out for evaluation")
    eval_size: int | None = Field(None, ge=1, description="exact number held out (overrides eval_fraction)")
    max_train: int | None = Field(None, ge=1, description="keep at most this many training instructions")
    validation_size: int = Field(0, ge=0, description=(
        "instructions carved from the training split into validation.jsonl, for tuning without touching the "
        "held-out evaluation instructions"))
    evaluate_on: Literal["test", "validation"] = Field("test", description=(
        "what eval.jsonl holds: 'test' = the held-out instructions; 'validation' = the validation instructions "
        "(a tuning run: every stage that reads the eval split then sees only training-side instructions)"))

    @model_validator(mode="after")
    def _validation_needs_a_size(self) -> SplitInstructionsConfig:
        if self.evaluate_on == "validation" and not self.validation_size:
            raise ValueError("evaluate_on: validation needs validation_size > 0")
        return self


class SplitInstructions(Method):
    """Reads the ``instructions`` data source, drops duplicate (instruction, input) pairs, shuffles with the
    stage seed and writes ``train.jsonl`` and ``eval.jsonl``. Train and eval never share an instruction.

    With ``validation_size``, that many training instructions go to ``validation.jsonl`` instead (and
    ``test.jsonl`` keeps the held-out ones). ``evaluate_on: validation`` makes ``eval.jsonl`` the validation
    instructions: a tuning run of a recipe then never samples, trains or evaluates on the held-out instructions,
    and the same recipe evaluates on them once its settings are chosen. Which instructions land where depends only
    on the seed and the sizes, not on ``evaluate_on``."""

    config_class = SplitInstructionsConfig
    requires = (ArtifactName.INSTRUCTIONS,)
    provides = ArtifactName.INSTRUCTION_SPLITS
    produces = ("files",)  # train, eval (and validation, test): context.records("instruction_splits", "train")

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
        n_held = n_eval + config.validation_size
        if n_held >= len(rows):
            raise UserError(f"split_instructions: {len(rows)} unique instructions cannot hold out {n_eval} for "
                            f"evaluation and {config.validation_size} for validation")
        test_rows = rows[:n_eval]
        validation_rows, train_rows = rows[n_eval:n_held], rows[n_held:]
        if config.max_train:
            train_rows = train_rows[: config.max_train]
        eval_rows = validation_rows if config.evaluate_on == "validation" else test_rows
        splits = {"train": train_rows, "eval": eval_rows}
        if config.validation_size:
            splits.update(validation=validation_rows, test=test_rows)
        files: dict[str, str] = {}
        for split, split_rows in splits.items():
            files[split] = str(context.stage_dir / f"{split}.jsonl")
            write_jsonl(context.stage_dir / f"{split}.jsonl", split_rows)
        sources = Counter(str(r.get("dataset", "?")) for r in eval_rows)
        context.logger.info("split %d unique of %d records: %d train, %d validation, %d held out; eval.jsonl = %s",
                            len(rows), len(records), len(train_rows), len(validation_rows), len(test_rows),
                            config.evaluate_on)
        return Artifact(
            "dataset",
            str(context.stage_dir),
            {"n_records": len(records), "n_unique": len(rows), "n_train": len(train_rows),
             "n_eval": len(eval_rows), "n_validation": len(validation_rows), "evaluate_on": config.evaluate_on,
             "eval_sources": dict(sources)},
            files=files,
        )
