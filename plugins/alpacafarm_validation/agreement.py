"""Agreement, bias and variance of pairwise annotators on multiply-annotated pairs (paper §4.3, App. C.2).

Input: records with ``instruction``, ``output_1``, ``output_2`` and ``preference`` (1: output_1 is better,
2: output_2 is better; 0 or 1.5: a tie; null/empty: no label, skipped and counted). A pair is the triple
(instruction, output_1, output_2); the humans' file holds several annotations per pair (AlpacaFarm's
cross-annotations: 650 pairs x 4 humans). Continuous preferences in [1, 2] are rounded to 1 or 2 (1.5 stays a
tie), as AlpacaEval's zero-one rule does.

Definitions (written from the AlpacaFarm paper, Dubois et al. 2023, §4.3 and App. C.2, and from how AlpacaEval's
``analyze.Analyzer`` defines them; every number is a fraction in [0, 1]):

* score(a, b) = 1 - |a - b| on labels {1, 1.5, 2}: 1 when equal, 0 when opposite, 0.5 when exactly one is a tie.
* mode(labels): the most frequent label; several most frequent labels are a tie broken at random, seeded by
  (seed, role, pair, index) so that results are identical across runs and record orders.
* Every average below is first over the annotations of a pair, then over pairs (equal when every pair has the
  same number of annotations, as in the cross-annotations).
* Human agreement (humans): leave-one-out, each human label scored against the mode of the OTHER humans'
  labels of the same pair (with 4 humans: against the majority of 3, as in Figure 4's "held-out human").
* Human variance: 1 - human agreement (AlpacaEval's "1 vs rest" error; 34.3 on its leaderboard). Human bias: 0
  by definition (the humans are the reference).
* Annotator agreement: each annotator label scored against a human majority. ``reference="held_out"`` (default,
  the paper's Figure 4): against the mode of each set of n-1 humans (leave each human out in turn), averaged,
  so an annotator faces the same majority-of-3 as a held-out human. ``reference="all"``: against the mode of
  all n humans (AlpacaEval's evaluator leaderboard, where a 2-2 split is a random tie-break).
* Annotator bias: 1 - score(mode of the annotator's labels of a pair, mode of all humans' labels), averaged:
  disagreement of the annotator's "typical" label with the humans' typical label (an over-estimate; AlpacaEval
  ``estimate_bias``). With one label per pair the annotator's mode is that label.
* Annotator variance: each annotator label scored against the mode of the annotator's OTHER labels of the same
  pair, error averaged (AlpacaEval ``estimate_variance``, "1 vs rest"; the paper: "average error of a held-out
  annotation to the majority vote over 3 random draws"). Needs >= 2 labels per pair, else null.
* P(prefer longer): among labels that pick a side (1 or 2) on pairs whose outputs' lengths in characters differ
  by more than ``length_margin`` (0: only equal lengths are skipped; AlpacaEval uses 30 and one label per pair),
  the share that picks the longer output.
* P(prefer first): share of labels choosing output_1, a tie counting one half (AlpacaEval: 2 - mean preference).

Measuring an annotator's variance needs several independent annotations of each pair by that annotator:
``alpacafarm annotate PAIRS --annotator NAME --replicates 4 -o SIM.json`` writes 4 per pair (``replicate`` 0-3),
so each is held out against the majority of the 3 others, as in the paper (p_sim^ann 0.43, p_sim^eval 0.26,
humans 0.35, greedy GPT-4 0.1); with 2 per pair the variance is the plain disagreement rate of two draws.
Annotating the same pair twice without a replicate index gives the same label (the cache and seeded draws are
keyed on the pair), so annotator records that carry a ``replicate`` field keep one label per (pair, replicate):
a later record with the same pair and replicate is a copy of the same annotation, skipped and counted
(``annotator_repeats``). Without human labels, :func:`self_variance` (``compare --variance SIM.json``) reports
the variance alone. A deterministic annotator (the offline judge, a greedy judge) has a variance of 0.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from alpacafarm.errors import UserError
from alpacafarm.seeding import stable_seed
from alpacafarm.validation import Validator

TIE = 1.5
KEY_FIELDS = ("instruction", "output_1", "output_2")
PairKey = tuple[str, str, str]


class AgreementConfig(BaseModel):
    """How to break ties and which human majority an annotator is compared with."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, description="seeds the random tie-break of modes")
    reference: Literal["held_out", "all"] = Field(
        "held_out", description="annotator vs majority of n-1 humans (paper) or of all n humans (AlpacaEval)")
    length_margin: int = Field(0, ge=0, description="P(prefer longer) skips pairs whose lengths differ by <= this")


def parse_label(value: Any, where: str) -> float | None:
    """1.0, 2.0, 1.5 (tie) or None (no label). Raises UserError for anything else."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, str):
        if not value.strip() or value.strip().lower() in ("nan", "none", "null"):
            return None
        try:
            value = float(value)
        except ValueError:
            raise UserError(f"{where}: preference must be 1, 2, 0 (tie) or null, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"{where}: preference must be 1, 2, 0 (tie) or null, got {value!r}")
    if value in (0, TIE):
        return TIE
    if 1 <= value <= 2:
        return 1.0 if value < TIE else 2.0
    raise UserError(f"{where}: preference must be 1, 2, 0 (tie) or null, got {value!r}")


@dataclass
class Labelled:
    """The labels of one file grouped by pair (in first-seen order), and how many records had no label."""

    labels: dict[PairKey, list[float]]
    n_missing: int = 0
    n_repeats: int = 0

    @property
    def n_labels(self) -> int:
        return sum(len(v) for v in self.labels.values())


def group(records: list[dict[str, Any]], source: str, *, by_replicate: bool = False) -> Labelled:
    """Group ``records`` by (instruction, output_1, output_2); ``source`` names the file in error messages.
    ``by_replicate``: keep one label per (pair, ``replicate`` field) among records that have that field."""
    out: dict[PairKey, list[float]] = {}
    missing = repeats = 0
    seen: set[tuple[PairKey, str]] = set()
    for number, record in enumerate(records, start=1):
        absent = [f for f in (*KEY_FIELDS, "preference") if f not in record]
        if absent:
            raise UserError(f"{source}: record {number} has no {absent[0]!r} field "
                            f"(needs {', '.join(KEY_FIELDS)}, preference)")
        key: PairKey = tuple(str(record[f]) for f in KEY_FIELDS)  # type: ignore[assignment]
        if by_replicate and record.get("replicate") is not None:
            if (key, str(record["replicate"])) in seen:
                repeats += 1
                continue
            seen.add((key, str(record["replicate"])))
        label = parse_label(record["preference"], f"{source}: record {number}")
        if label is None:
            missing += 1
            continue
        out.setdefault(key, []).append(label)
    return Labelled(out, missing, repeats)


def score(a: float, b: float) -> float:
    """1 - |a - b|: 1 for agreement, 0 for opposite sides, 0.5 when exactly one of them is a tie."""
    return 1.0 - abs(a - b)


def mode(labels: list[float], *tie_key: object) -> float:
    """Most frequent label; a tie between several is broken by a RNG seeded from ``tie_key``."""
    counts = Counter(labels)
    top = max(counts.values())
    modes = sorted(label for label, count in counts.items() if count == top)
    if len(modes) == 1:
        return modes[0]
    return random.Random(stable_seed(*tie_key)).choice(modes)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def leave_one_out(labels: dict[PairKey, list[float]], seed: int, role: str) -> float | None:
    """Mean over pairs of the mean over annotations of score(label, mode of the pair's other labels)."""
    per_pair = []
    for key, values in labels.items():
        if len(values) < 2:
            continue
        per_pair.append(_mean([score(v, mode(values[:i] + values[i + 1:], seed, role, *key, i))
                               for i, v in enumerate(values)]))
    return _mean(per_pair)  # type: ignore[arg-type]


def preference_shares(labels: dict[PairKey, list[float]], length_margin: int) -> dict[str, Any]:
    """P(prefer longer) and P(prefer first) over every label, with the counts they rest on."""
    longer = decided = first = total = 0.0
    for (_, out1, out2), values in labels.items():
        diff = len(out1) - len(out2)
        for value in values:
            total += 1
            first += 1.0 if value == 1.0 else 0.5 if value == TIE else 0.0
            if value != TIE and abs(diff) > length_margin:
                decided += 1
                longer += (value == 1.0) == (diff > 0)
    return {"p_prefer_longer": longer / decided if decided else None, "n_length_decided": int(decided),
            "p_prefer_first": first / total if total else None}


@dataclass
class AgreementResult:
    """What :func:`measure` found; ``to_json`` is the ``compare --agreement --json`` object."""

    reference: str
    seed: int
    humans: dict[str, Any]
    annotator: dict[str, Any] | None = None
    counts: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"reference": self.reference, "seed": self.seed, "counts": self.counts,
                "humans": self.humans, "annotator": self.annotator}


def measure(human_records: list[dict[str, Any]], config: AgreementConfig,
            annotator_records: list[dict[str, Any]] | None = None,
            human_source: str = "humans", annotator_source: str = "annotator") -> AgreementResult:
    """Human leave-one-out agreement/variance and, given annotator labels, its agreement, bias and variance."""
    seed = config.seed
    humans = group(human_records, human_source)
    # only pairs with >= 2 human labels have a leave-one-out majority; the rest cannot be scored
    human_labels = {k: v for k, v in humans.labels.items() if len(v) >= 2}
    if not human_labels:
        raise UserError(f"{human_source}: no pair has 2 or more human labels; "
                        "agreement needs multiply-annotated pairs (same instruction, output_1, output_2)")
    agreement = leave_one_out(human_labels, seed, "humans")
    counts = {"pairs": len(human_labels), "human_labels": sum(len(v) for v in human_labels.values()),
              "human_missing": humans.n_missing, "pairs_single_label": len(humans.labels) - len(human_labels)}
    human_row = {"agreement": agreement, "bias": 0.0, "variance": 1.0 - agreement,  # type: ignore[operator]
                 **preference_shares(human_labels, config.length_margin), "n_labels": counts["human_labels"]}
    result = AgreementResult(config.reference, seed, human_row, None, counts)
    if annotator_records is None:
        return result

    annotator = group(annotator_records, annotator_source, by_replicate=True)
    matched = {k: v for k, v in annotator.labels.items() if k in human_labels}
    counts.update(annotator_labels=sum(len(v) for v in matched.values()), annotator_missing=annotator.n_missing,
                  annotator_repeats=annotator.n_repeats,
                  annotator_pairs_matched=len(matched), annotator_pairs_unmatched=len(annotator.labels) - len(matched),
                  human_pairs_unlabelled=len(human_labels) - len(matched))
    if not matched:
        raise UserError(f"{annotator_source}: none of its pairs matches a human pair "
                        "(matched on instruction, output_1, output_2)")
    agree, bias = [], []
    for key, values in matched.items():
        people = human_labels[key]
        human_mode = mode(people, seed, "human_mode", *key)
        if config.reference == "all":
            agree.append(_mean([score(v, human_mode) for v in values]))
        else:
            majorities = [mode(people[:i] + people[i + 1:], seed, "humans", *key, i) for i in range(len(people))]
            agree.append(_mean([score(v, m) for v in values for m in majorities]))
        bias.append(1.0 - score(mode(values, seed, "annotator_mode", *key), human_mode))
    self_agreement = leave_one_out(matched, seed, "annotator")
    result.annotator = {
        "agreement": _mean(agree), "bias": _mean(bias),  # type: ignore[arg-type]
        "variance": None if self_agreement is None else 1.0 - self_agreement,
        **preference_shares(matched, config.length_margin), "n_labels": counts["annotator_labels"],
    }
    return result


def self_variance(records: list[dict[str, Any]], config: AgreementConfig, source: str = "annotator") -> dict[str, Any]:
    """An annotator's variance from its replicate labels alone (no humans): each label against the mode of the
    others of its pair (as above), over the pairs with >= 2 labels; with P(prefer longer/first) and counts."""
    annotator = group(records, source, by_replicate=True)
    replicated = {k: v for k, v in annotator.labels.items() if len(v) >= 2}
    if not replicated:
        raise UserError(f"{source}: no pair has 2 or more labels; annotate with --replicates K (K >= 2) "
                        "to measure an annotator's variance")
    self_agreement = leave_one_out(replicated, config.seed, "annotator")
    n_labels = sum(len(v) for v in replicated.values())
    return {"variance": 1.0 - self_agreement, **preference_shares(replicated, config.length_margin),  # type: ignore[operator]
            "n_labels": n_labels, "pairs": len(replicated), "labels_per_pair": n_labels / len(replicated),
            "pairs_single_label": len(annotator.labels) - len(replicated), "missing": annotator.n_missing,
            "repeats": annotator.n_repeats}


class AgreementValidator(Validator):
    """Registered validator ``agreement``: ``validate(humans, annotator_labels)``; built by ``Registry.create``."""

    config_class = AgreementConfig
    config: AgreementConfig

    def validate(self, human_records: list[dict[str, Any]], annotator_records: list[dict[str, Any]] | None = None,
                 *, human_source: str = "humans", annotator_source: str = "annotator") -> AgreementResult:
        """Measure the humans (and the annotator's labels on the same pairs, when given); the sources name the
        files in error messages."""
        return measure(human_records, self.config, annotator_records, human_source, annotator_source)

    def variance(self, annotator_records: list[dict[str, Any]], *, source: str = "annotator") -> dict[str, Any]:
        """The annotator's variance from its replicate labels alone (:func:`self_variance`)."""
        return self_variance(annotator_records, self.config, source)
