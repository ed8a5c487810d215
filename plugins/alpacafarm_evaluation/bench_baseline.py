"""What a bench baseline (``benchmarks/baselines/*.json``) records, and how it is read and checked against a run.

Per system and instruction the score (1 win, 0.5 tie, 0 loss against the reference) and a hash of the output; the
gate's margin, alpha and power; package and plugin versions; and three fingerprints of what the benchmark *is*, as
opposed to what it measures:

* **judge** — the evaluation annotator (name, config, plugin) and the labels it gives to a fixed probe of judged
  pairs stored in the baseline (re-judged at every run: a judge whose code changed under the same name and
  config labels them differently);
* **data** — the evaluated instructions and their reference outputs;
* **recipe** — the benchmark protocol: the recipe's name, seed, model, data sources, annotators, evaluation block
  and its stage names. Stage methods and configs are *not* in it: they are the candidate under test
  (``--set stages.best_of_n.method=my_best_of_n`` is gated, not stale).

A changed fingerprint makes the baseline stale (:func:`stale_reasons`): it no longer describes the benchmark.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError

BASELINE_FORMAT = "alpacafarm-bench-baseline/1"
#: Judged pairs kept in a baseline to fingerprint the judge by its behaviour.
PROBE_SIZE = 24
#: How far a continuous probe label may move and still be the same judge: float noise (a batched forward pass, a
#: reordered sum) moves labels by ~1e-7; a judge whose code or model changed moves some label by far more.
PROBE_TOLERANCE = 1e-4


def digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def text_hash(text: str) -> str:
    """A short content hash of an output (64 bits: collisions are not a concern at benchmark sizes)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def instruction_id(instruction: str, input_text: str | None) -> str:
    return text_hash(f"{instruction}\x00{input_text or ''}")


# ----------------------------------------------------------------------------------------------- outcomes


@dataclass
class SystemOutcomes:
    """One evaluated system: per instruction id, its score and its output's hash."""

    name: str
    scores: dict[str, float]
    outputs: dict[str, str]
    win_rate: float | None = None

    def to_json(self) -> dict[str, Any]:
        rows = {k: {"score": self.scores.get(k), "output": h} for k, h in sorted(self.outputs.items())}
        return {"win_rate": self.win_rate, "n": len(self.scores), "instructions": rows}

    @classmethod
    def from_json(cls, name: str, data: dict[str, Any]) -> SystemOutcomes:
        rows = data["instructions"]
        return cls(name, {k: float(v["score"]) for k, v in rows.items() if v.get("score") is not None},
                   {k: str(v["output"]) for k, v in rows.items()}, data.get("win_rate"))


def outcomes_of(name: str, records: list[dict[str, Any]]) -> SystemOutcomes:
    from alpacafarm_evaluation.metrics import scores

    values = scores([r.get("preference") for r in records])
    system = SystemOutcomes(name, {}, {})
    for record, value in zip(records, values, strict=True):
        key = instruction_id(record["instruction"], record.get("input"))
        system.outputs[key] = text_hash(record["output_2"])
        if value is not None:
            system.scores[key] = value
    if system.scores:
        system.win_rate = round(100 * sum(system.scores.values()) / len(system.scores), 4)
    return system


@dataclass
class BenchRun:
    """What a benchmark run produced: systems, fingerprints, the judge probe, versions."""

    recipe: str
    recipe_name: str
    overrides: list[str]
    run_dir: str
    systems: dict[str, SystemOutcomes]
    fingerprints: dict[str, str]
    judge: dict[str, Any]
    protocol: dict[str, Any]
    probe: list[dict[str, Any]]
    versions: dict[str, str]
    plugin_versions: dict[str, str]
    seconds: float
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict, repr=False)
    loaded: Any = field(default=None, repr=False)
    registry: Any = field(default=None, repr=False)

    def reprobe(self) -> None:
        """Pick a new judge probe from this run's judged pairs (for a new baseline) and fingerprint the judge on it."""
        self.probe = pick_probe(self.records)
        self.judge = {**self.judge, "probe_labels": judge_probe(self.loaded, self.registry, self.probe)}
        self.fingerprints = {**self.fingerprints, "judge": digest(self.judge)}


# ------------------------------------------------------------------------------------------- fingerprints


def protocol_of(recipe: Any) -> dict[str, Any]:
    """The parts of a recipe that define the benchmark (not the candidate): see the module docstring."""
    data = recipe.model_dump(mode="json")
    evaluation = data["evaluation"]
    if isinstance(evaluation, dict) and not evaluation.get("inputs"):
        # no explicit wiring is the protocol of before evaluation.inputs existed: a baseline made then still holds
        evaluation = {k: v for k, v in evaluation.items() if k != "inputs"}
    return {"name": data["name"], "seed": data["seed"], "model": data["model"], "data": data["data"],
            "annotator": data["annotator"], "evaluation": evaluation,
            "stages": [[s["name"], s["enabled"]] for s in data["stages"]]}


def data_fingerprint(records: dict[str, list[dict[str, Any]]]) -> str:
    """The evaluated instructions and their references, whatever the systems answered."""
    return digest(sorted({(instruction_id(r["instruction"], r.get("input")), text_hash(r["output_1"]))
                          for rows in records.values() for r in rows}))


def judge_identity(loaded: Any, registry: Any) -> dict[str, Any]:
    ref = loaded.recipe.annotator_for("evaluation")
    if ref is None:
        raise UserError(f"bench: recipe {loaded.path} names no evaluation annotator (evaluation.annotator)")
    return {"annotator": ref.model_dump(mode="json"), "plugin": registry.entry("annotator", ref.name).plugin}


def pick_probe(records: dict[str, list[dict[str, Any]]], size: int = PROBE_SIZE) -> list[dict[str, Any]]:
    """Judged pairs to fingerprint the judge with: taken round-robin over the systems, distinct outputs."""
    probe, seen = [], set()
    columns = [sorted(rows, key=lambda r: instruction_id(r["instruction"], r.get("input")))
               for _, rows in sorted(records.items())]
    for i in range(max((len(c) for c in columns), default=0)):
        for column in columns:
            if i < len(column) and len(probe) < size:
                r = column[i]
                key = (r["instruction"], r.get("input") or "", r["output_2"])
                if key not in seen and r["output_1"] != r["output_2"]:
                    seen.add(key)
                    probe.append({"instruction": r["instruction"], "input": r.get("input") or "",
                                  "output_1": r["output_1"], "output_2": r["output_2"]})
    return probe


def judge_probe(loaded: Any, registry: Any, probe: list[dict[str, Any]]) -> list[Any]:
    """The recipe's evaluation judge's labels on the probe pairs."""
    from alpacafarm.types import Pair

    ref = loaded.recipe.annotator_for("evaluation")
    annotator = registry.create("annotator", ref.name, loaded.annotator_configs.get("evaluation", ref.config))
    try:
        pairs = [Pair(p["instruction"], p["output_1"], p["output_2"], p["input"]) for p in probe]
        return [a.preference for a in annotator.annotate(pairs)] if pairs else []
    finally:
        annotator.close()


# ----------------------------------------------------------------------------------------------- the file


def baseline_json(run: BenchRun, margin: float, alpha: float, power: float) -> dict[str, Any]:
    return {
        "format": BASELINE_FORMAT, "recipe": run.recipe, "recipe_name": run.recipe_name, "overrides": run.overrides,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gate": {"margin": margin, "alpha": alpha, "power": power},
        "fingerprints": run.fingerprints, "judge": run.judge, "protocol": run.protocol, "judge_probe": run.probe,
        "versions": run.versions, "plugin_versions": run.plugin_versions,
        "systems": {name: system.to_json() for name, system in run.systems.items()},
    }


#: At most this many probe pairs, systems and instructions per system in a baseline file (far above real ones:
#: 24 probe pairs, a handful of systems, 805 instructions).
MAX_PROBE, MAX_SYSTEMS, MAX_INSTRUCTIONS = 1_000, 1_000, 100_000


def read_baseline(path: Path) -> dict[str, Any]:
    """The baseline at ``path``, every field checked (:mod:`alpacafarm.validated_input`): a damaged or hand-edited
    file is one line naming the field, exit status 2 — never a traceback, never a verdict."""
    from alpacafarm.validated_input import Fields, load_json

    shown = f"--baseline {path}"
    if not path.exists() and not path.is_dir():
        raise UserError(f"{shown}: no such file; create it with --update-baseline")
    data = load_json(path, "baseline", display=shown)
    if not isinstance(data, dict) or data.get("format") != BASELINE_FORMAT:
        raise UserError(f"{shown} is not an alpacafarm bench baseline (format {BASELINE_FORMAT!r}); "
                        "write one with --update-baseline")
    top = Fields(data, shown)
    check_protocol(top.sub("gate", required=False), shown)
    fingerprints = top.sub("fingerprints")
    for key in ("judge", "data", "recipe"):
        fingerprints.text(key, max_len=256)
    judge = top.sub("judge", required=False)
    if not isinstance(judge.data.get("probe_labels", []), list):
        raise judge.error("must be a list", "probe_labels")
    top.sub("protocol", required=False)
    for pair in top.objects("judge_probe", max_items=MAX_PROBE):
        for key in ("instruction", "input", "output_1", "output_2"):
            pair.text(key)
    for _, system in top.items("systems", max_items=MAX_SYSTEMS):
        system.number("win_rate", low=0, high=100, required=False, nullable=True)
        for _, row in system.items("instructions", max_items=MAX_INSTRUCTIONS):
            row.number("score", low=0, high=1, required=False, nullable=True)
            row.text("output", max_len=256)
    return data


def check_protocol(gate: Any, shown: str) -> dict[str, float]:
    """The gate's margin, alpha and power (``gate`` a :class:`~alpacafarm.validated_input.Fields`), each within
    :data:`~alpacafarm_evaluation.gate_stats.PROTOCOL_BOUNDS`; absent ones take the defaults."""
    from alpacafarm_evaluation.gate_stats import DEFAULT_ALPHA, DEFAULT_MARGIN, DEFAULT_POWER, PROTOCOL_BOUNDS

    defaults = {"margin": DEFAULT_MARGIN, "alpha": DEFAULT_ALPHA, "power": DEFAULT_POWER}
    out = {}
    for name, (low, high, open_low, open_high) in PROTOCOL_BOUNDS.items():
        out[name] = gate.number(name, low=low, high=high, open_low=open_low, open_high=open_high, required=False,
                                default=defaults[name])
    return out


def same_label(old: Any, new: Any) -> bool:
    """Whether a probe pair got the same label: equal, or continuous labels within :data:`PROBE_TOLERANCE`."""
    numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in (old, new))
    return abs(old - new) <= PROBE_TOLERANCE if numbers else old == new


def stale_reasons(run: BenchRun, baseline: dict[str, Any]) -> list[str]:
    """Why the baseline does not describe this benchmark any more (empty: it does)."""
    reasons = []
    old = baseline["fingerprints"]
    if old["judge"] != run.fingerprints["judge"]:
        before = baseline.get("judge") or {}
        if {k: v for k, v in before.items() if k != "probe_labels"} != \
                {k: v for k, v in run.judge.items() if k != "probe_labels"}:
            reasons.append(f"judge changed: {before.get('annotator')} -> {run.judge['annotator']}")
        else:
            old_labels, new_labels = before.get("probe_labels") or [], run.judge["probe_labels"]
            differ = sum(not same_label(a, b) for a, b in zip(old_labels, new_labels, strict=False))
            if differ or len(old_labels) != len(new_labels):
                reasons.append(f"judge changed: same name and config, but it labels {differ} of {len(new_labels)} "
                               "probe pairs differently (its code or model changed)")
    if old["data"] != run.fingerprints["data"]:
        reasons.append("data changed: the evaluated instructions or their reference outputs differ")
    if old["recipe"] != run.fingerprints["recipe"]:
        before = baseline.get("protocol") or {}
        parts = sorted(k for k in set(before) | set(run.protocol) if before.get(k) != run.protocol.get(k))
        reasons.append(f"recipe changed: {', '.join(parts) or 'protocol'}")
    base_systems, run_systems = set(baseline["systems"]), set(run.systems)
    if base_systems != run_systems:
        reasons.append(f"systems changed: baseline has {', '.join(sorted(base_systems))}; this run has "
                       f"{', '.join(sorted(run_systems))}")
    return reasons
