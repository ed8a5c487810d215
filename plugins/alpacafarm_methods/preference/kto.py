"""``kto``: Kahneman-Tversky Optimization (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic
Optimization", arXiv:2402.01306), with TRL's ``KTOTrainer``, on binary feedback: each output desirable or not.

KTO needs no pairs, only a label per output. Its loss (Eq. 7; TRL's docs) is
``w(y) (1 - v(x, y))`` with ``v = sigmoid(beta (r - z))`` for a desirable output and ``sigmoid(beta (z - r))`` for an
undesirable one, where ``r = log p(y|x)/p_SFT(y|x)`` and ``z`` is a batch estimate of the KL divergence between
policy and reference (from mismatched prompt/output pairs of the batch). Desirable outputs are pushed above the
reference point, undesirable ones below it. The reference is ``dpo``'s: a frozen SFT copy, or with LoRA the
policy with its adapters disabled.

Where the labels come from (:func:`binary_feedback`), per output of a preference record:

- ``acceptable_1`` / ``acceptable_2`` (booleans), where the record has them: a *pointwise* label. An LLM judge gives
  one with a pointwise prompt ("Here is an instruction and an answer. Is this answer acceptable? Answer yes or
  no."), asked once per output instead of once per pair; a human gives a thumbs up or down. ``null`` (or no
  field) means the output has no pointwise label.
- otherwise the pairwise ``preference``, as TRL converts paired data: the preferred output is desirable (label
  True), the other undesirable (False). A tie or an unparsed preference labels neither.

An output with neither is left out; a record that labels neither output is counted as dropped. Both rows of a
record stay on the same side of the train/eval split. TRL estimates the KL term from the batch, reading the rows
in order (``train_sampling_strategy: sequential``): the training rows are shuffled once, with the stage seed, so
that the two outputs of a record are not always neighbours.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from trl import KTOConfig, KTOTrainer

from alpacafarm.errors import UserError
from alpacafarm.preference_rows import check_pair_record, winner
from alpacafarm.preference_training import (
    DirectAlignment,
    PreferenceExamples,
    ReleasedDPOSchedule,
    build_preference_trainer,
    frozen_reference,
    reference_kind,
)
from alpacafarm.prompts import format_prompt
from alpacafarm.training import TrainingDefaults

#: The statistics TRL's KTOTrainer logs (no accuracy: the rows are not pairs) that go into the metrics.
KTO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "kl")


def output_labels(record: dict[str, Any]) -> dict[int, bool]:
    """``{output number: desirable}`` for the outputs of one preference record that carry a label (see the module
    docstring): ``acceptable_<k>`` where it is a boolean, else the pairwise preference."""
    won = winner(record.get("preference"))
    labels = {}
    for k in (1, 2):
        pointwise = record.get(f"acceptable_{k}")
        if pointwise is not None and not isinstance(pointwise, bool):
            raise UserError(f"a preference record's acceptable_{k} is {pointwise!r}: it must be true, false or null")
        if pointwise is not None:
            labels[k] = pointwise
        elif won is not None:
            labels[k] = won == k
    return labels


def binary_feedback(records: list[dict[str, Any]], *, style: str,
                    tokenizer: Any) -> tuple[list[list[dict[str, Any]]], int]:
    """Preference records → KTO's unpaired ``{"prompt", "completion", "label"}`` rows, grouped by record, and how
    many records gave no row."""
    groups, dropped = [], 0
    for record in records:
        check_pair_record(record)
        labels = output_labels(record)
        if not labels:
            dropped += 1
            continue
        prompt = format_prompt(record["instruction"], record.get("input") or None, style=style, tokenizer=tokenizer)
        groups.append([{"prompt": prompt, "completion": record[f"output_{k}"], "label": label}
                       for k, label in labels.items()])
    return groups, dropped


@dataclass
class KTOMethodConfig(PreferenceExamples, ReleasedDPOSchedule, TrainingDefaults, KTOConfig):
    """Every ``trl.KTOConfig`` / ``TrainingArguments`` field, plus how many preference records to use and hold out.

    Defaults: ``beta`` 0.1 and ``desirable_weight`` = ``undesirable_weight`` = 1.0, those of TRL's ``KTOConfig``
    and of the KTO authors' library (``ContextualAI/HALOs``, ``config/loss/kto.yaml``). The paper's rule for the
    weights (Eq. 8, which TRL checks and warns about) is ``desirable_weight * n_desirable / (undesirable_weight *
    n_undesirable)`` in [1, 4/3]; pairs give as many desirable as undesirable outputs, so 1.0 / 1.0 is in range —
    with pointwise labels, set the weights from the counts in ``metrics.json``. Learning rate 1e-6 (TRL's
    ``KTOConfig`` default, also AlpacaFarm's released DPO script's), and ``dpo``'s schedule: 2 epochs, cosine with
    3% warmup, 512 tokens. KTO's KL estimate needs ``per_device_train_batch_size`` > 1.
    """

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.desirable_weight <= 0 or self.undesirable_weight <= 0:
            raise ValueError("desirable_weight and undesirable_weight must be > 0")
        if self.loss_type == "kto" and self.per_device_train_batch_size < 2:
            raise ValueError("per_device_train_batch_size must be at least 2 for KTO: its KL term is estimated from "
                             "the other rows of the batch")
        if self.loss_type == "kto" and self.train_sampling_strategy != "sequential":
            raise ValueError("train_sampling_strategy must be 'sequential' for KTO (the rows are shuffled once "
                             "before training instead)")
        super().__post_init__()


class KTO(DirectAlignment):
    """KTO from the SFT model on desirable / undesirable outputs; writes ``model/`` and ``metrics.json``."""

    config_class = KTOMethodConfig
    label = "KTO"
    logged_metrics = KTO_METRICS
    usable = "a usable preference (1 or 2) or an acceptable_1 / acceptable_2 label"

    def examples(self, records: list[dict[str, Any]], spec: Any, tokenizer: Any) -> tuple[list[list[dict]], int]:
        return binary_feedback(records, style=spec.prompt_format, tokenizer=tokenizer)

    def build_trainer(self, args: Any, spec: Any, model_path: str, rows: list[dict[str, Any]],
                      eval_rows: list[dict[str, Any]]) -> Any:
        shuffled = list(rows)
        random.Random(args.seed).shuffle(shuffled)
        return build_preference_trainer(KTOTrainer, args, spec, model_path, shuffled, eval_rows,
                                        ref_model=frozen_reference(args, spec, model_path))

    def describe(self, args: Any, spec: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
        desirable = sum(row["label"] for row in rows)
        return {"beta": args.beta, "desirable_weight": args.desirable_weight,
                "undesirable_weight": args.undesirable_weight, "n_desirable": desirable,
                "n_undesirable": len(rows) - desirable, "reference": reference_kind(args, spec)}
