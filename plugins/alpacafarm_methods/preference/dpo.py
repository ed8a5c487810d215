"""``dpo``: Direct Preference Optimization of the SFT model on pairwise preferences, with TRL's DPOTrainer.

Paper Section 3.4 and Appendix A.1, Eq. (1): maximise
``log sigmoid(beta * log p(y_w|x)/p_SFT(y_w|x) - beta * log p(y_l|x)/p_SFT(y_l|x))`` over the preference pairs,
the reference ``p_SFT`` being the frozen SFT model. With full fine-tuning the reference is a second, frozen copy
of the SFT model; with LoRA/QLoRA in the model block no copy is made: TRL computes the reference with the
adapters disabled, which is exactly the SFT model (see :mod:`alpacafarm.policy_training`). With
``precompute_ref_log_probs: true`` the reference log-probabilities are computed once before training, and no
copy is kept either.

TRL logs the implicit rewards (``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``rewards/accuracies``) with the loss; they are in ``metrics.json``'s ``log_history``. The stage itself (rows,
split, training, saving, metrics) is :class:`~alpacafarm_methods.preference.direct_alignment.DirectAlignment`'s,
shared with ``ipo``, ``simpo``, ``orpo`` and ``kto``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trl import DPOConfig

from alpacafarm.model_loading import load_merged_causal_lm
from alpacafarm.training import TrainingDefaults
from alpacafarm_methods.preference.direct_alignment import (
    DirectAlignment,
    PreferenceExamples,
    ReleasedDPOSchedule,
    build_preference_trainer,
    frozen_reference,
    reference_kind,
)


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


class DPO(DirectAlignment):
    """DPO from the SFT model on pairwise preferences; writes ``model/`` and ``metrics.json``."""

    config_class = DPOMethodConfig
    label = "DPO"

    def build_trainer(self, args: Any, spec: Any, model_path: str, rows: list[dict[str, Any]],
                      eval_rows: list[dict[str, Any]]) -> Any:
        return build_dpo_trainer(args, spec, model_path, rows, eval_rows)

    def describe(self, args: Any, spec: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"beta": args.beta, "reference": reference_kind(args, spec)}
