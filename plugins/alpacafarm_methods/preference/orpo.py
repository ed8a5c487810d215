"""``orpo``: Odds Ratio Preference Optimization (Hong, Lee and Thorne 2024, "ORPO: Monolithic Preference Optimization
without Reference Model", arXiv:2403.07691), with TRL's ``ORPOTrainer``.

ORPO adds to the SFT loss on the chosen output a penalty on the log odds ratio of the two outputs, with no
reference model: minimise ``NLL(y_w|x) - lambda * log sigmoid(log odds(y_w|x) - log odds(y_l|x))``, where
``odds(y|x) = p(y|x) / (1 - p(y|x))`` on the average per-token likelihood. ``beta`` is the paper's ``lambda``.

The paper trains the *base* model this way, without a separate SFT stage; here ``orpo`` starts from the recipe's
``sft_model`` input like every other method (so it compares with ``dpo`` from the same start). A recipe without an
``sft`` stage, or with ``inputs: {sft_model: base_model}``, runs it as the paper does.

TRL keeps ``ORPOTrainer`` in ``trl.experimental``, an API it may change between releases (see
:func:`~alpacafarm.preference_training.trl_experimental`).
TRL logs ``rewards/*`` (beta times the average log-probability), ``log_odds_ratio``, ``log_odds_chosen`` and
``nll_loss``; their last values are in ``metrics.json``. The stage is
:class:`~alpacafarm.preference_training.DirectAlignment`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from alpacafarm.preference_training import (
    REWARD_METRICS,
    DirectAlignment,
    PreferenceExamples,
    ReleasedDPOSchedule,
    build_preference_trainer,
    trl_experimental,
)
from alpacafarm.training import TrainingDefaults

orpo = trl_experimental("orpo")


@dataclass
class ORPOMethodConfig(PreferenceExamples, ReleasedDPOSchedule, TrainingDefaults, orpo.ORPOConfig):
    """Every ``trl.experimental.orpo.ORPOConfig`` / ``TrainingArguments`` field, plus how many pairs to use and
    hold out.

    Defaults: ``beta`` (the paper's lambda) 0.1, TRL's default and the ORPO authors' value for Mistral-ORPO-beta
    (``xfactlab/orpo``, ``scripts/run_mistral_orpo_beta.sh``: ``--alpha 0.1``), learning rate 5e-6 from the same
    script. The schedule is ``dpo``'s (AlpacaFarm's released DPO script: 2 epochs, cosine with 3% warmup, 512
    tokens), since here ORPO continues from the SFT model rather than training the base model for 5 epochs.
    """

    beta: float = 0.1
    learning_rate: float = 5e-6
    remove_unused_columns: bool = False  # TRL's pair collator needs the tokenized columns (it would reset it)


class ORPO(DirectAlignment):
    """ORPO from the SFT model on pairwise preferences (no reference model); writes ``model/`` and ``metrics.json``."""

    config_class = ORPOMethodConfig
    label = "ORPO"
    logged_metrics = (*REWARD_METRICS, "log_odds_ratio", "log_odds_chosen", "nll_loss")

    def build_trainer(self, args: Any, spec: Any, model_path: str, rows: list[dict[str, Any]],
                      eval_rows: list[dict[str, Any]]) -> Any:
        return build_preference_trainer(orpo.ORPOTrainer, args, spec, model_path, rows, eval_rows)

    def describe(self, args: Any, spec: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"beta": args.beta, "reference": "none"}
