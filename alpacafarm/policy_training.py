"""Training a policy on rows with TRL's ``SFTTrainer``, and saving it: the common ending of SFT-style methods.

Part of the method helpers (with :mod:`alpacafarm.training_rows` and :mod:`alpacafarm.reward_selection`): what the
built-in methods call themselves, public so that a plugin imports these, never a built-in.

:func:`build_sft_trainer_on_rows` — a TRL ``SFTTrainer`` on rows, starting from the SFT model (LoRA and quantization
from the model block, fp32 master weights); :func:`train_and_save_policy` — train (resuming an interrupted attempt),
save ``model/`` with :func:`alpacafarm.model_loading.save_model`, write ``metrics.json``. The rest of what
trainer-based methods share is :mod:`alpacafarm.training` (config defaults, stage arguments).

An SFT stage trained with LoRA and ``merge_adapters: false`` leaves an *adapter folder*. Loading such a folder with
``load_causal_lm`` attaches the adapters through transformers' peft integration, and a trainer given a
``peft_config`` then replaces them with fresh (zero) adapters: training would silently start from the base model
instead of the SFT model. :func:`alpacafarm.model_loading.load_merged_causal_lm` merges the SFT adapters first, so new
adapters sit on top of the SFT weights, and TRL's DPO reference (the model with its adapters disabled) is the SFT
model; :func:`alpacafarm.model_loading.save_model` saves adapters trained that way merged, so the folder reloads as the
model that was trained (policies and reward models alike).

Heavy imports (torch, transformers, TRL, datasets) happen inside functions: importing this module is cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.model_loading import load_merged_causal_lm
from alpacafarm.prompts import PromptConditioning
from alpacafarm.training import fp32_master_weights


def build_sft_trainer_on_rows(
    config: Any, spec: Any, model_path: str, rows: list[dict[str, Any]], *, callbacks: list[Any] | None = None
) -> Any:
    """A ready TRL ``SFTTrainer`` on rows built by the caller, starting from the SFT model in ``model_path``.

    Rows are ``{"prompt", "completion"}`` texts (TRL tokenizes them; loss on the completion only) or already
    tokenized ``{"input_ids", "labels"}`` (expert iteration, which decides itself where EOS goes). Like
    the built-in ``sft`` method: the same LoRA and quantization from the model block, and the
    trainable weights as float32 master copies.
    """
    from datasets import Dataset
    from transformers import set_seed
    from trl import SFTTrainer

    from alpacafarm.model_loading import load_tokenizer, lora_config

    if not rows:
        raise UserError("there is nothing to train on: no training rows")
    set_seed(config.seed)  # fresh LoRA adapters are drawn before the Trainer seeds itself
    trainer = SFTTrainer(
        model=load_merged_causal_lm(spec, model_path, trainable=True),
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=load_tokenizer(spec, model_path),
        peft_config=lora_config(spec),
        callbacks=callbacks,
    )
    fp32_master_weights(trainer.model)
    return trainer


def train_and_save_policy(context: Any, trainer: Any, spec: Any, model_path: str, dropped: int,
                          extra: dict[str, Any] | None = None,
                          conditioning: PromptConditioning | None = None) -> Any:
    """Train ``trainer`` (resuming an interrupted attempt), save the policy to ``model/``, write ``metrics.json``.

    The common ending of the SFT-style pairwise methods (binary FeedME, reward conditioning). ``conditioning``: the
    prompt conditioning the policy was trained behind, saved with it (:func:`~alpacafarm.model_loading.save_model`).
    Under several processes every rank trains (accelerate) and only the main process saves and writes.
    """
    from alpacafarm.data import write_json
    from alpacafarm.method import Artifact
    from alpacafarm.model_loading import save_model
    from alpacafarm.training import resume_checkpoint, train_summary
    from alpacafarm.training_progress import training_progress

    with training_progress(trainer, context):
        result = trainer.train(resume_from_checkpoint=resume_checkpoint(context))
    model_dir = Path(context.stage_dir) / "model"
    merged = save_model(trainer.model, trainer.processing_class, model_dir, spec, start_from=model_path,
                        conditioning=conditioning, logger=context.logger)  # every rank; the main one writes
    if not context.is_main:
        return Artifact("model", str(model_dir))
    metrics = {**train_summary(trainer, result), "n_examples": len(trainer.train_dataset),
               "n_dropped_no_preference": dropped, **(extra or {}), "lora": spec.lora is not None, "merged": merged}
    write_json(Path(context.stage_dir) / "metrics.json", {**metrics, "log_history": trainer.state.log_history})
    return Artifact("model", str(model_dir), metrics)
