"""What the TRL-backed methods share at run time: per-stage trainer arguments, resume, training summaries.

Config defaults for the machine live in :mod:`alpacafarm_trl.base_config`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("alpacafarm")

#: TrainingArguments' own default seed; a config still holding it gets the stage's seed instead.
DEFAULT_TRAINER_SEED = 42


def stage_training_args(config: Any, context: Any, **overrides: Any) -> Any:
    """A copy of the method's config for this stage: ``output_dir`` is the stage folder, the seed the stage's.

    ``output_dir`` is always the stage directory (checkpoints must live where the pipeline can resume them);
    a user-given one is ignored with a note. A ``seed`` left at the trainer default takes the stage seed,
    which the pipeline derives from the recipe seed and the stage name.
    """
    stage_dir = str(context.stage_dir)
    if config.output_dir not in (None, "trainer_output", stage_dir):
        context.logger.warning("stage %s: output_dir %r ignored; checkpoints go to the stage folder %s",
                               context.stage, config.output_dir, stage_dir)
    for note in getattr(config, "device_notes", ()):
        context.logger.warning("stage %s: %s", context.stage, note)
    seed = context.seed if config.seed == DEFAULT_TRAINER_SEED else config.seed
    # dataclasses.replace re-runs __post_init__ on already-normalised values, which TrainingArguments accepts;
    # the recipe's config object itself stays untouched (it is part of the stage fingerprint).
    return dataclasses.replace(config, output_dir=stage_dir, seed=seed, **overrides)


def resume_checkpoint(context: Any) -> str | None:
    """The last ``checkpoint-N`` folder of an interrupted attempt of this stage, if any."""
    if not context.resuming:
        return None
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(context.stage_dir)) if Path(context.stage_dir).is_dir() else None
    if last:
        context.logger.info("stage %s: resuming from %s", context.stage, last)
    return last


def train_summary(trainer: Any, result: Any) -> dict[str, Any]:
    """Loss and step count of a finished ``trainer.train()`` (plus the last logged loss, which is per-step)."""
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "train_loss": round(float(result.training_loss), 6),
        "final_logged_loss": losses[-1] if losses else None,
        "steps": int(trainer.state.global_step),
        "epochs": round(float(trainer.state.epoch or 0.0), 4),
        "train_runtime_s": round(float(result.metrics.get("train_runtime", 0.0)), 3),
    }


def limit(records: list[dict[str, Any]], max_examples: int | None) -> list[dict[str, Any]]:
    """The first ``max_examples`` records (all of them when ``None``)."""
    return records if max_examples is None else records[:max_examples]
