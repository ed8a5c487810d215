"""``ipo``: Identity Preference Optimisation (Azar et al. 2023, "A General Theoretical Paradigm to Understand
Learning from Human Preferences", arXiv:2310.12036), with TRL's DPOTrainer and ``loss_type: [ipo]``.

IPO regresses the policy's log-likelihood-ratio margin over the reference onto a fixed target instead of pushing it
through a sigmoid (Eq. 17): minimise ``(h - 1/(2 tau))^2`` with
``h = log p(y_w|x)/p_SFT(y_w|x) - log p(y_l|x)/p_SFT(y_l|x)``. The margin stops growing at ``1/(2 tau)``, so IPO
does not drive it to infinity on deterministic preferences as DPO can. TRL averages the log-probabilities over each
completion's tokens (the form the IPO authors confirmed to TRL; see ``DPOTrainer``'s loss), so ``h`` is per token.

What tau means at this scale: the target ``1/(2 tau)`` is a margin in nats *per token* of the average log-ratio,
not per answer. TRL's default tau 0.1 asks the chosen answer's per-token log-ratio to exceed the rejected one's by
5 nats (about 320 nats over a 64-token answer); the runs in docs/gold.md reach ~0.06 nats per token, about 80
times less, so at those budgets the target is never near and IPO acts as an unregularised squared push on the
margin (their KL to the SFT model, 17.7-19.4 nats, is the largest of the direct methods). For the regularisation
to bind, choose tau from the per-token margin you accept, ``tau = 1 / (2 m)``: m = 0.05 nats per token is tau 10.
The per-sequence form (the margin summed over tokens, as Eq. 17 is written) is not offered: TRL's DPOTrainer has
only the averaged form, and another form would mean overriding the trainer's private loss code, which this project
does not do; for answers of similar length L, a per-sequence target M corresponds to tau = L / (2 M).

Everything else is ``dpo``'s: the reference (a frozen SFT copy, or the adapters-off policy with LoRA), the data and
the stage (:class:`~alpacafarm.preference_training.DirectAlignment`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from alpacafarm.preference_training import DPOMethodConfig
from alpacafarm_methods.preference.dpo import DPO


@dataclass
class IPOMethodConfig(DPOMethodConfig):
    """``dpo``'s config with the IPO loss; ``beta`` is IPO's regularisation parameter tau.

    Defaults: ``beta`` (tau) 0.1, TRL's ``DPOConfig`` default, which TRL documents as IPO's tau, and the value in the
    KTO authors' HALOs library (``config/loss/ipo.yaml``); the IPO paper's experiments are illustrative and fix no
    value for language models, so tune it. The rest are ``dpo``'s defaults (AlpacaFarm's released DPO script:
    learning rate 1e-6, 2 epochs, cosine with 3% warmup, 512 tokens), so that ``ipo`` and ``dpo`` differ only in
    the loss.
    """

    loss_type: list[str] = field(default_factory=lambda: ["ipo"], metadata={"help": "['ipo']: the IPO loss"})

    def __post_init__(self) -> None:
        super().__post_init__()  # DPOConfig turns a single name into a list
        if self.loss_type != ["ipo"]:
            raise ValueError(f"loss_type must be ['ipo'] for the ipo method (got {self.loss_type}); "
                             "other DPO losses are the dpo method's loss_type")


class IPO(DPO):
    """IPO from the SFT model on pairwise preferences; writes ``model/`` and ``metrics.json``."""

    config_class = IPOMethodConfig
    label = "IPO"

    def describe(self, args: Any, spec: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {**super().describe(args, spec, rows), "loss_type": "ipo"}
