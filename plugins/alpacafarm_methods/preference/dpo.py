"""``dpo``: Direct Preference Optimization of the SFT model on pairwise preferences, with TRL's DPOTrainer.

Paper Section 3.4 and Appendix A.1, Eq. (1): maximise
``log sigmoid(beta * log p(y_w|x)/p_SFT(y_w|x) - beta * log p(y_l|x)/p_SFT(y_l|x))`` over the preference pairs,
the reference ``p_SFT`` being the frozen SFT model. With full fine-tuning the reference is a second, frozen copy
of the SFT model; with LoRA/QLoRA in the model block no copy is made: TRL computes the reference with the
adapters disabled, which is exactly the SFT model (see :mod:`alpacafarm.kit`). With
``precompute_ref_log_probs: true`` the reference log-probabilities are computed once before training, and no
copy is kept either.

TRL logs the implicit rewards (``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``rewards/accuracies``) with the loss; they are in ``metrics.json``'s ``log_history``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl import DPOConfig

from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, Ranks, StageContext
from alpacafarm.model_loading import load_merged_causal_lm
from alpacafarm.training import (
    TrainingDefaults,
    fp32_master_weights,
    limit,
    resume_checkpoint,
    save_policy,
    stage_training_args,
    train_summary,
)
from alpacafarm.training_progress import training_progress
from alpacafarm_methods.pairs import preference_rows, split_pairs

#: Implicit-reward statistics TRL logs; their last logged values go into the stage's metrics.
REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


@dataclass
class DPOMethodConfig(TrainingDefaults, DPOConfig):
    """Every ``trl.DPOConfig`` / ``TrainingArguments`` field, plus how many pairs to use and hold out.

    Defaults are those of AlpacaFarm's released DPO script: ``beta`` 0.1, ``learning_rate`` 1e-6, 2 epochs,
    cosine schedule with 3% warmup, sequences of at most 512 tokens. (Appendix B.3 reports a different run on
    the noisy simulated preferences: 1 epoch, peak rate 1e-5, linear decay, batch 64; ``recipes/dpo.yaml``
    uses those.) ``bf16`` and gradient checkpointing are automatic (see ``alpacafarm.training``);
    ``output_dir`` is always the stage folder.
    """

    max_examples: int | None = field(default=None, metadata={"help": "use the first N usable pairs only"})
    eval_fraction: float = field(
        default=0.0, metadata={"help": "share of the pairs held out for eval reward metrics"}
    )

    beta: float = 0.1
    learning_rate: float = 1e-6
    num_train_epochs: float = 2.0
    lr_scheduler_type: str = "cosine"
    warmup_steps: float = 0.03
    max_length: int | None = 512

    def __post_init__(self) -> None:
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError("max_examples must be at least 1")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError("eval_fraction must be in [0, 1)")
        super().__post_init__()


def build_dpo_trainer(
    config: DPOMethodConfig,
    spec: Any,
    model_path: str,
    rows: list[dict[str, str]],
    eval_rows: list[dict[str, str]] | None = None,
    *,
    callbacks: list[Any] | None = None,
    reference_path: str | None = None,
) -> Any:
    """A ready ``DPOTrainer`` on prompt/chosen/rejected ``rows``, policy and reference from the SFT model.

    The reference is passed explicitly (loaded like the policy, so dtype, device and quantization agree)
    only for full fine-tuning without precomputed reference log-probabilities; otherwise ``ref_model`` is
    None and TRL keeps no second model. ``reference_path`` (default: ``model_path``) names another model as the
    reference (online DPO: the policy continues from a later round while the reference stays the SFT model); it
    is then always loaded, as neither the adapters-off policy nor the policy's own log-probabilities are it.
    """
    from datasets import Dataset
    from transformers import set_seed
    from trl import DPOTrainer

    from alpacafarm.model_loading import load_tokenizer, lora_config

    if not rows:
        raise UserError("there is nothing to train on: no preference pair has a usable preference")
    peft_config = lora_config(spec)
    set_seed(config.seed)  # fresh LoRA adapters are drawn before the Trainer seeds itself
    ref_model = None
    if reference_path not in (None, model_path):
        ref_model = load_merged_causal_lm(spec, reference_path)
    elif peft_config is None and not config.precompute_ref_log_probs:
        ref_model = load_merged_causal_lm(spec, model_path)
    trainer = DPOTrainer(
        model=load_merged_causal_lm(spec, model_path, trainable=True),
        ref_model=ref_model,
        args=config,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(eval_rows) if eval_rows else None,
        processing_class=load_tokenizer(spec, model_path),
        peft_config=peft_config,
        callbacks=callbacks,
    )
    fp32_master_weights(trainer.model)
    return trainer


def last_logged(log_history: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, float]:
    """The last logged value of each of ``keys`` (training entries only)."""
    found: dict[str, float] = {}
    for entry in log_history:
        for key in keys:
            if key in entry:
                found[key] = round(float(entry[key]), 6)
    return found


class DPO(Method):
    """DPO from the SFT model on pairwise preferences; writes ``model/`` and ``metrics.json``."""

    config_class = DPOMethodConfig
    requires = ("sft_model", "preferences")
    provides = "policy_model"
    ranks = Ranks.ALL  # TRL's trainer distributes through accelerate; the main process saves

    def run(self, context: StageContext) -> Artifact:
        from alpacafarm.data import write_json
        from alpacafarm.model_loading import load_tokenizer

        spec = context.recipe.model
        args = stage_training_args(self.config, context)
        model_path = context.input("sft_model").path
        records = context.records("preferences", "preferences")
        rows, dropped = preference_rows(
            records, style=spec.prompt_format, tokenizer=load_tokenizer(spec, model_path)
        )
        rows = limit(rows, args.max_examples)
        if not rows:
            raise UserError(
                f"stage {context.stage}: none of the {len(records)} preference records has a usable "
                "preference (1 or 2)"
            )
        train_rows, eval_rows = split_pairs(rows, args.eval_fraction, context.seed)
        trainer = build_dpo_trainer(args, spec, model_path, train_rows, eval_rows)
        if not len(trainer.train_dataset):  # TRL dropped every row (e.g. prompts longer than max_length)
            raise UserError(f"stage {context.stage}: no training pair is left of the {len(train_rows)} given to "
                            f"DPO (max_length {args.max_length}: raise it)")
        reference = (
            "adapters disabled" if spec.lora else "precomputed" if args.precompute_ref_log_probs else "copy"
        )
        context.logger.info(
            "stage %s: DPO on %d pairs (%d held out, %d without a preference), beta %g, reference: %s",
            context.stage,
            len(trainer.train_dataset),
            len(eval_rows),
            dropped,
            args.beta,
            reference,
        )
        with training_progress(trainer, context, "training (DPO)"):
            result = trainer.train(resume_from_checkpoint=resume_checkpoint(context))
        model_dir = Path(context.stage_dir) / "model"
        # every rank (ZeRO-3 gathers the weights); the main process writes them (evaluate() below is collective too)
        merged = save_policy(trainer, spec, model_path, model_dir, context.logger)
        metrics: dict[str, Any] = {
            **train_summary(trainer, result),
            **last_logged(trainer.state.log_history, REWARD_METRICS),
            "beta": args.beta,
            "n_pairs": len(rows),
            "n_train": len(train_rows),
            "n_train_kept": len(trainer.train_dataset),  # TRL drops pairs whose prompt fills max_length
            "n_eval": len(eval_rows),
            "n_dropped_no_preference": dropped,
            "reference": reference,
            "lora": spec.lora is not None,
            "merged": merged,
        }
        if eval_rows:
            evaluation = trainer.evaluate()
            metrics.update(
                {
                    k: round(float(v), 6)
                    for k, v in evaluation.items()
                    if k.startswith("eval_rewards/") or k == "eval_loss"
                }
            )
        if context.is_main:
            write_json(
                Path(context.stage_dir) / "metrics.json", {**metrics, "log_history": trainer.state.log_history}
            )
        return Artifact("model", str(model_dir), metrics)
