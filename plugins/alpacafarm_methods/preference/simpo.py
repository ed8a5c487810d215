"""``simpo``: Simple Preference Optimization (Meng, Xia and Chen 2024, "SimPO: Simple Preference Optimization with a
Reference-Free Reward", arXiv:2405.14734), with TRL's ``CPOTrainer`` and ``loss_type: simpo``, ``cpo_alpha: 0``.

SimPO's implicit reward is the policy's *average* per-token log-probability of a completion, scaled by ``beta``; no
reference model is kept. It minimises ``-log sigmoid(beta/|y_w| log p(y_w|x) - beta/|y_l| log p(y_l|x) - gamma)``
over the preference pairs: the length-normalised margin must exceed a target ``gamma`` (here
``gamma_beta_ratio * beta``). ``cpo_alpha > 0`` adds CPO's NLL term on the chosen outputs (CPO-SimPO; TRL's docs).

TRL keeps ``CPOTrainer`` in ``trl.experimental``, an API it may change between releases (see
:func:`~alpacafarm.preference_training.trl_experimental`). TRL logs ``rewards/*`` (beta times
the average log-probability) and ``nll_loss``; they are in ``metrics.json``. The stage is
:class:`~alpacafarm.preference_training.DirectAlignment`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from alpacafarm.preference_training import (
    DirectAlignment,
    PreferenceExamples,
    build_preference_trainer,
    trl_experimental,
)
from alpacafarm.training import TrainingDefaults

cpo = trl_experimental("cpo")


@dataclass
class SimPOMethodConfig(PreferenceExamples, TrainingDefaults, cpo.CPOConfig):
    """Every ``trl.experimental.cpo.CPOConfig`` / ``TrainingArguments`` field, plus how many pairs to use and hold
    out; ``simpo_gamma`` is not set directly but from ``gamma_beta_ratio``.

    Defaults: the SimPO authors' configuration for a base model after SFT (the setting of SFT 10k;
    ``princeton-nlp/SimPO``, ``training_configs/llama-3-8b-base-simpo.yaml``): ``beta`` 2.0 (their README: 2.0 or
    2.5 in the paper), ``gamma_beta_ratio`` 0.5 (the README's recommended starting point, tuned in [0, 1]),
    learning rate 6e-7 (the README's grid is 3e-7 to 1e-6: the most important setting, and large rates such as
    1e-5 degrade the model), one epoch, cosine schedule with 10% warmup. ``cpo_alpha`` 0: pure SimPO (TRL's docs).
    ``max_length`` 512 as every AlpacaFarm method (the released scripts' ``model_max_length``; SimPO used 2048).
    """

    loss_type: str = field(default="simpo", metadata={"help": "'simpo': the SimPO loss"})
    cpo_alpha: float = field(default=0.0, metadata={"help": "weight of CPO's NLL term (0: pure SimPO)"})
    gamma_beta_ratio: float = field(
        default=0.5, metadata={"help": "SimPO's target margin gamma as a multiple of beta (gamma = ratio * beta)"}
    )
    simpo_gamma: float = field(default=1.0, init=False, metadata={"help": "gamma_beta_ratio * beta"})
    beta: float = 2.0
    learning_rate: float = 6e-7
    num_train_epochs: float = 1.0
    lr_scheduler_type: str = "cosine"
    warmup_steps: float = 0.1
    max_length: int | None = 512
    remove_unused_columns: bool = False  # TRL's pair collator needs the tokenized columns (it would reset it)

    def __post_init__(self) -> None:
        if self.loss_type != "simpo":
            raise ValueError(f"loss_type must be 'simpo' for the simpo method (got {self.loss_type!r})")
        if self.gamma_beta_ratio < 0:
            raise ValueError(f"gamma_beta_ratio must be >= 0, got {self.gamma_beta_ratio}")
        if self.cpo_alpha < 0:
            raise ValueError(f"cpo_alpha must be >= 0, got {self.cpo_alpha}")
        self.simpo_gamma = self.gamma_beta_ratio * self.beta
        super().__post_init__()


class SimPO(DirectAlignment):
    """SimPO from the SFT model on pairwise preferences (no reference model); writes ``model/`` and ``metrics.json``."""

    config_class = SimPOMethodConfig
    label = "SimPO"

    def build_trainer(self, args: Any, spec: Any, model_path: str, rows: list[dict[str, Any]],
                      eval_rows: list[dict[str, Any]]) -> Any:
        return build_preference_trainer(cpo.CPOTrainer, args, spec, model_path, rows, eval_rows)

    def describe(self, args: Any, spec: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"beta": args.beta, "gamma": round(args.simpo_gamma, 6), "cpo_alpha": args.cpo_alpha,
                "reference": "none"}
