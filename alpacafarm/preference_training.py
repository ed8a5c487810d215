"""Training a policy on preference pairs with a TRL trainer: the stage the direct-alignment methods share.

Part of the method helpers (with :mod:`alpacafarm.policy_training`, its counterpart for SFT-style methods, and
:mod:`alpacafarm.preference_rows`): public, so that a plugin's DPO variant subclasses :class:`DirectAlignment` and
:class:`DPOMethodConfig` here instead of copying a built-in (``alpacafarm plugin new NAME --kind direct-alignment``
writes one).

``dpo``, ``ipo``, ``simpo``, ``orpo`` and ``kto`` differ in their loss (a TRL trainer and its config) and in the
rows that trainer reads. The rest is :meth:`DirectAlignment.run`: read the preference records, turn them into rows
grouped by record (:meth:`DirectAlignment.examples`), keep the first ``max_examples`` records, hold out
``eval_fraction`` of them (by record, so a held-out instruction is never trained on), build the trainer, train
(resuming an interrupted attempt: :func:`alpacafarm.training.resume_checkpoint`), save ``model/``
(:func:`alpacafarm.model_loading.save_model`) and write ``metrics.json``: the training summary, the last logged value of
each statistic the method names (:attr:`DirectAlignment.logged_metrics`), their held-out values when pairs were
held out, and the full ``log_history``.

Every trainer is built the same way (:func:`build_preference_trainer`): the policy from the SFT model with float32
master weights, LoRA/QLoRA from the model block, the SFT model's tokenizer. The methods with a reference model
(``dpo``, ``ipo``, ``kto``) keep a frozen copy of the SFT model only for full fine-tuning without precomputed
reference log-probabilities (:func:`frozen_reference`): with LoRA the reference is the policy with its adapters
disabled, which is the SFT model (see :mod:`alpacafarm.policy_training`). Their configs start with the mixins
:class:`PreferenceExamples` (``max_examples``, ``eval_fraction``) and, where the method keeps ``dpo``'s
optimisation settings, :class:`ReleasedDPOSchedule`; :class:`DPOMethodConfig` is ``dpo``'s whole config and
:func:`build_dpo_trainer` its trainer; :func:`trl_experimental` imports the trainers TRL keeps in
``trl.experimental``.

Heavy imports (torch, transformers, datasets) happen inside functions; TRL's ``DPOConfig`` is imported here for
:class:`DPOMethodConfig`, so a hook module names its method as a lazy ``"module:attr"`` target (as every plugin does).
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from trl import DPOConfig

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, Ranks, StageContext
from alpacafarm.model_loading import load_merged_causal_lm, save_model
from alpacafarm.preference_rows import preference_rows, split_pairs
from alpacafarm.training import (
    TrainingDefaults,
    fp32_master_weights,
    limit,
    resume_checkpoint,
    stage_training_args,
    train_summary,
)
from alpacafarm.training_progress import training_progress

#: Implicit-reward statistics TRL's pairwise trainers log; their last logged values go into the stage's metrics.
REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def trl_experimental(name: str) -> Any:
    """``trl.experimental.<name>`` (where TRL keeps ``CPOTrainer`` and ``ORPOTrainer``: an API it may change between
    releases), imported without its "unstable API" notice on every run; ``tests/test_direct_alignment.py`` trains
    with both, so a change in a new TRL release fails there rather than in a user's run."""
    from trl.import_utils import TRLExperimentalWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TRLExperimentalWarning)
        return importlib.import_module(f"trl.experimental.{name}")


@dataclass
class ReleasedDPOSchedule:
    """Config mixin: the optimisation settings of AlpacaFarm's released DPO script (learning rate 1e-6, 2 epochs,
    cosine schedule with 3% warmup, sequences of at most 512 tokens), the defaults of ``dpo`` and of the methods
    compared with it from the same start."""

    learning_rate: float = 1e-6
    num_train_epochs: float = 2.0
    lr_scheduler_type: str = "cosine"
    warmup_steps: float = 0.03
    max_length: int | None = 512


@dataclass
class PreferenceExamples:
    """Config mixin (first in the bases): how many preference records to use and how many to hold out."""

    max_examples: int | None = field(default=None, metadata={"help": "use the first N usable pairs only"})
    eval_fraction: float = field(
        default=0.0, metadata={"help": "share of the pairs held out for eval reward metrics"}
    )

    def __post_init__(self) -> None:
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError("max_examples must be at least 1")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError("eval_fraction must be in [0, 1)")
        super().__post_init__()  # type: ignore[misc]  # TrainingDefaults, then TRL's config


def frozen_reference(config: Any, spec: Any, model_path: str) -> Any:
    """A frozen copy of the SFT model as the reference, or None where TRL needs none: with LoRA (the reference is
    the policy with its adapters disabled) and with precomputed reference log-probabilities."""
    if spec.lora is not None or config.precompute_ref_log_probs:
        return None
    return load_merged_causal_lm(spec, model_path)


def reference_kind(config: Any, spec: Any) -> str:
    """How a method with a reference model gets it, in words for the log and ``metrics.json``."""
    return "adapters disabled" if spec.lora else "precomputed" if config.precompute_ref_log_probs else "copy"


def build_preference_trainer(
    trainer_class: Any,
    config: Any,
    spec: Any,
    model_path: str,
    rows: list[dict[str, Any]],
    eval_rows: list[dict[str, Any]] | None = None,
    *,
    callbacks: list[Any] | None = None,
    **trainer_kwargs: Any,
) -> Any:
    """A ready TRL ``trainer_class`` on ``rows``, the policy starting from the SFT model in ``model_path``.

    LoRA/QLoRA from the model block (fresh adapters on top of the SFT weights), the SFT model's tokenizer, the
    trainable weights as float32 master copies. ``trainer_kwargs`` go to the trainer as they are (``ref_model``).
    """
    from datasets import Dataset
    from transformers import set_seed

    from alpacafarm.model_loading import load_tokenizer, lora_config

    if not rows:
        raise UserError("there is nothing to train on: no preference pair has a usable preference")
    peft_config = lora_config(spec)
    set_seed(config.seed)  # fresh LoRA adapters are drawn before the Trainer seeds itself
    trainer = trainer_class(
        model=load_merged_causal_lm(spec, model_path, trainable=True),
        args=config,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(eval_rows) if eval_rows else None,
        processing_class=load_tokenizer(spec, model_path),
        peft_config=peft_config,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    fp32_master_weights(trainer.model)
    return trainer


@dataclass
class DPOMethodConfig(PreferenceExamples, ReleasedDPOSchedule, TrainingDefaults, DPOConfig):
    """Every ``trl.DPOConfig`` / ``TrainingArguments`` field, plus how many pairs to use and hold out.

    Defaults are those of AlpacaFarm's released DPO script: ``beta`` 0.1, ``learning_rate`` 1e-6, 2 epochs,
    cosine schedule with 3% warmup, sequences of at most 512 tokens. (Appendix B.3 reports a different run on
    the noisy simulated preferences: 1 epoch, peak rate 1e-5, linear decay, batch 64; ``recipes/dpo.yaml``
    uses those.) ``bf16`` and gradient checkpointing are automatic (see ``alpacafarm.training``);
    ``output_dir`` is always the stage folder.
    """

    beta: float = 0.1


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
    from trl import DPOTrainer

    if reference_path not in (None, model_path):
        ref_model = load_merged_causal_lm(spec, reference_path)
    else:
        ref_model = frozen_reference(config, spec, model_path)
    return build_preference_trainer(DPOTrainer, config, spec, model_path, rows, eval_rows, callbacks=callbacks,
                                    ref_model=ref_model)


def last_logged(log_history: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, float]:
    """The last logged value of each of ``keys`` (training entries only)."""
    found: dict[str, float] = {}
    for entry in log_history:
        for key in keys:
            if key in entry:
                found[key] = round(float(entry[key]), 6)
    return found


def prompt_length(prompt: str, tokenizer: Any) -> int:
    """How many tokens a formatted prompt takes in a TRL preference trainer: its tokens, plus the BOS those
    trainers put first when the tokenizer has one and the prompt does not start with it."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return len(ids) + (1 if bos is not None and (not ids or ids[0] != bos) else 0)


def rows_with_room(groups: list[list[dict[str, Any]]], tokenizer: Any,
                   max_length: int | None) -> tuple[list[list[dict[str, Any]]], int]:
    """The groups without the rows whose prompt alone fills ``max_length`` (groups left empty go too), and how many
    rows went.

    TRL's ``DPOTrainer`` drops such rows itself; its ``CPOTrainer`` (SimPO) and ``ORPOTrainer`` truncate the answer
    to nothing and keep the row, and a loss over the answer's *average* log-probability is then 0/0: NaN, which
    spreads to every weight at the first step, at any learning rate. Every direct-alignment stage drops them here,
    with a count, so all of them train on the same rows.
    """
    if max_length is None:
        return groups, 0
    fits: dict[str, bool] = {}
    kept, dropped = [], 0
    for group in groups:
        rows = []
        for row in group:
            if row["prompt"] not in fits:
                fits[row["prompt"]] = prompt_length(row["prompt"], tokenizer) < max_length
            if fits[row["prompt"]]:
                rows.append(row)
            else:
                dropped += 1
        if rows:
            kept.append(rows)
    return kept, dropped


class DirectAlignment(Method):
    """A direct-alignment stage: the SFT model trained on preference rows by one TRL trainer.

    Subclasses set ``config_class``, :attr:`label` and :attr:`logged_metrics`, and implement
    :meth:`build_trainer`; :meth:`examples` (pairs by default) and :meth:`describe` may be overridden.
    """

    requires = (ArtifactName.SFT_MODEL, ArtifactName.PREFERENCES)
    provides = ArtifactName.POLICY_MODEL
    ranks = Ranks.ALL  # TRL's trainers distribute through accelerate; the main process saves

    #: the method's name in the log and on the progress line
    label: ClassVar[str] = ""
    #: statistics the trainer logs whose last values (and held-out values, ``eval_`` + key) go into the metrics
    logged_metrics: ClassVar[tuple[str, ...]] = REWARD_METRICS
    #: what a usable record carries, for the error when none does
    usable: ClassVar[str] = "a usable preference (1 or 2)"

    def examples(self, records: list[dict[str, Any]], spec: Any, tokenizer: Any) -> tuple[list[list[dict]], int]:
        """The trainer's rows grouped by record (a group stays on one side of the train/eval split), and how many
        records gave none: here one ``{"prompt", "chosen", "rejected"}`` row per ranked pair."""
        rows, dropped = preference_rows(records, style=spec.prompt_format, tokenizer=tokenizer)
        return [[row] for row in rows], dropped

    def build_trainer(self, args: Any, spec: Any, model_path: str, rows: list[dict[str, Any]],
                      eval_rows: list[dict[str, Any]]) -> Any:
        """The ready TRL trainer on the training rows (and held-out rows, possibly none)."""
        raise NotImplementedError(f"{type(self).__name__}.build_trainer")

    def describe(self, args: Any, spec: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """What the log line and ``metrics.json`` say about this run's loss (its parameters, the reference)."""
        return {"beta": args.beta}

    def run(self, context: StageContext) -> Artifact:
        from alpacafarm.data import write_json
        from alpacafarm.model_loading import load_tokenizer

        spec = context.recipe.model
        args = stage_training_args(self.config, context)
        model_path = context.input("sft_model").path
        records = context.records("preferences", "preferences")
        tokenizer = load_tokenizer(spec, model_path)
        groups, dropped = self.examples(records, spec, tokenizer)
        if not groups:
            raise UserError(f"stage {context.stage}: none of the {len(records)} preference records has {self.usable}")
        groups, too_long = rows_with_room(groups, tokenizer, args.max_length)
        if too_long:
            context.logger.warning("stage %s: %d of %d rows left out: the prompt alone fills max_length %d, which "
                                   "would leave an empty answer (raise max_length to keep them)", context.stage,
                                   too_long, too_long + sum(map(len, groups)), args.max_length)
        if not groups:
            raise UserError(f"stage {context.stage}: every prompt fills max_length {args.max_length} on its own: "
                            f"raise max_length")
        groups = limit(groups, args.max_examples)
        train_groups, eval_groups = split_pairs(groups, args.eval_fraction, context.seed)
        train_rows = [row for group in train_groups for row in group]
        eval_rows = [row for group in eval_groups for row in group]
        trainer = self.build_trainer(args, spec, model_path, train_rows, eval_rows)
        if not len(trainer.train_dataset):  # TRL dropped every row (e.g. prompts longer than max_length)
            raise UserError(f"stage {context.stage}: no training row is left of the {len(train_rows)} given to "
                            f"{self.label} (max_length {args.max_length}: raise it)")
        described = self.describe(args, spec, train_rows)
        context.logger.info(
            "stage %s: %s on %d rows of %d records (%d held out, %d without a preference), %s", context.stage,
            self.label, len(trainer.train_dataset), len(train_groups), len(eval_groups), dropped,
            ", ".join(f"{key} {value}" for key, value in described.items()),
        )
        with training_progress(trainer, context, f"training ({self.label})"):
            result = trainer.train(resume_from_checkpoint=resume_checkpoint(context))
        model_dir = Path(context.stage_dir) / "model"
        # every rank (ZeRO-3 gathers the weights); the main process writes them (evaluate() below is collective too)
        merged = save_model(trainer.model, trainer.processing_class, model_dir, spec, start_from=model_path,
                            logger=context.logger)
        metrics: dict[str, Any] = {
            **train_summary(trainer, result),
            **last_logged(trainer.state.log_history, self.logged_metrics),
            **described,
            "n_pairs": len(groups),
            "n_train": len(train_rows),
            "n_train_kept": len(trainer.train_dataset),  # TRL drops rows whose prompt fills max_length
            "n_eval": len(eval_rows),
            "n_dropped_no_preference": dropped,
            "n_dropped_prompt_fills_max_length": too_long,
            "lora": spec.lora is not None,
            "merged": merged,
        }
        if eval_rows:
            evaluation = trainer.evaluate()
            metrics.update({key: round(float(value), 6) for key, value in evaluation.items()
                            if key == "eval_loss" or key.removeprefix("eval_") in self.logged_metrics})
        if context.is_main:
            write_json(
                Path(context.stage_dir) / "metrics.json", {**metrics, "log_history": trainer.state.log_history}
            )
        return Artifact("model", str(model_dir), metrics)
