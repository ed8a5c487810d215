"""``sft``: supervised fine-tuning of the base model on instruction/response demonstrations with TRL's SFTTrainer.

This is the paper's "SFT 10k" step (Section 3.4): LLaMA-7B fine-tuned on the 10k ``sft`` split of the Alpaca
data, the starting point of every pairwise-feedback method. Examples are given to TRL in prompt/completion form
(:func:`alpacafarm.training_rows.prompt_completion_rows`), so the loss covers the response tokens only.

This module imports TRL at import time (its config subclasses ``trl.SFTConfig``); the plugin registers it as a
lazy target, so only a recipe that names ``sft`` pays for the import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl import SFTConfig

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, Ranks, StageContext
from alpacafarm.model_loading import save_model
from alpacafarm.policy_training import build_sft_trainer_on_rows
from alpacafarm.training import (
    TrainingDefaults,
    limit,
    resume_checkpoint,
    stage_training_args,
    train_summary,
)
from alpacafarm.training_progress import training_progress
from alpacafarm.training_rows import prompt_completion_rows


@dataclass
class SFTMethodConfig(TrainingDefaults, SFTConfig):
    """Every ``trl.SFTConfig`` / ``TrainingArguments`` field, plus where the data comes from.

    Defaults differ from TRL's where the paper or the machine says so: ``learning_rate`` 2e-5, 3 epochs,
    cosine schedule with 3% warmup, ``max_length`` 512 (Appendix B); ``bf16`` and gradient checkpointing
    are automatic (on with a suitable GPU, off on a CPU); ``report_to`` none; ``output_dir`` is always the
    stage folder.
    """

    train_split: str = field(default="train", metadata={"help": "file (or named file) of a dataset stage's output"})
    max_examples: int | None = field(default=None, metadata={"help": "train on the first N demonstrations only"})
    response_field: str = field(default="output", metadata={"help": "record field holding the answer"})

    num_train_epochs: float = 3.0
    lr_scheduler_type: str = "cosine"
    warmup_steps: float = 0.03
    max_length: int | None = 512

    def __post_init__(self) -> None:
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError("max_examples must be at least 1")
        super().__post_init__()


def build_sft_trainer(config: SFTMethodConfig, spec: Any, model_path: str, records: list[dict[str, Any]],
                      *, callbacks: list[Any] | None = None) -> Any:
    """A ready ``SFTTrainer`` for ``records`` with the model block's loading, LoRA and quantization.

    ``config`` must already carry its final ``output_dir`` (see :func:`stage_training_args`). The model in
    ``model_path`` may be an adapter folder (a LoRA SFT stage): its adapters are merged first, so training
    continues from it (see :mod:`alpacafarm.policy_training`). Shared by the methods and the overhead benchmark.
    """
    from alpacafarm.model_loading import load_tokenizer

    tokenizer = load_tokenizer(spec, model_path)
    rows = prompt_completion_rows(limit(records, config.max_examples), response_field=config.response_field,
                                  style=spec.prompt_format, tokenizer=tokenizer)
    if not rows:
        raise UserError("the SFT data is empty")
    return build_sft_trainer_on_rows(config, spec, model_path, rows, callbacks=callbacks)


class SFT(Method):
    """Fine-tunes the recipe's base model on demonstrations; writes ``model/`` (weights or adapters + tokenizer)."""

    config_class = SFTMethodConfig
    requires = (ArtifactName.BASE_MODEL, ArtifactName.SFT_DATA)
    provides = ArtifactName.SFT_MODEL
    ranks = Ranks.ALL  # TRL's trainer distributes through accelerate; the main process saves

    def run(self, context: StageContext) -> Artifact:
        from alpacafarm.data import write_json
        spec = context.recipe.model
        args = stage_training_args(self.config, context)
        records = context.records("sft_data", args.train_split)
        trainer = build_sft_trainer(args, spec, context.input("base_model").path, records)
        context.logger.info("stage %s: SFT on %d examples", context.stage, len(trainer.train_dataset))
        with training_progress(trainer, context, "training (SFT)"):
            result = trainer.train(resume_from_checkpoint=resume_checkpoint(context))
        model_dir = Path(context.stage_dir) / "model"
        merged = save_model(trainer.model, trainer.processing_class, model_dir, spec,  # all ranks
                            start_from=context.input("base_model").path, logger=context.logger)
        metrics = {**train_summary(trainer, result), "n_examples": len(trainer.train_dataset),
                   "lora": spec.lora is not None, "merged": merged}
        if not context.is_main:  # the main process wrote it
            return Artifact("model", str(model_dir), metrics)
        write_json(Path(context.stage_dir) / "metrics.json", {**metrics, "log_history": trainer.state.log_history})
        return Artifact("model", str(model_dir), metrics)
