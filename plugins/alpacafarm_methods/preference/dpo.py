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
split, training, saving, metrics) is :class:`~alpacafarm.preference_training.DirectAlignment`'s, shared with
``ipo``, ``simpo``, ``orpo`` and ``kto``; its config (:class:`~alpacafarm.preference_training.DPOMethodConfig`) and
trainer (:func:`~alpacafarm.preference_training.build_dpo_trainer`) are public there too, for DPO variants.
"""

from __future__ import annotations

from typing import Any

from alpacafarm.preference_training import DirectAlignment, DPOMethodConfig, build_dpo_trainer, reference_kind


class DPO(DirectAlignment):
    """DPO from the SFT model on pairwise preferences; writes ``model/`` and ``metrics.json``."""

    config_class = DPOMethodConfig
    label = "DPO"

    def build_trainer(self, args: Any, spec: Any, model_path: str, rows: list[dict[str, Any]],
                      eval_rows: list[dict[str, Any]]) -> Any:
        return build_dpo_trainer(args, spec, model_path, rows, eval_rows)

    def describe(self, args: Any, spec: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"beta": args.beta, "reference": reference_kind(args, spec)}
