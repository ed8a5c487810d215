"""The offline judge's weighted preferences (``continuous: true``): AlpacaEval 2's weighted win-rate offline.

The probability mirrors exactly, agrees with the hard label, is judged again (never mixed with hard labels) when
a recipe switches it, and the evaluator turns it into a weighted win-rate.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import alpacafarm
from alpacafarm.data import BUILTIN_DIR, read_records
from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, StageContext
from alpacafarm.plugins import get_registry
from alpacafarm.testing import write_records
from alpacafarm.types import Pair
from alpacafarm_annotators.offline_judge.annotator import OfflineAnnotator, OfflineAnnotatorConfig

SAMPLE = read_records(BUILTIN_DIR / "alpaca_eval_sample.jsonl")


@pytest.fixture(scope="module")
def pairs() -> list[Pair]:
    """Lopsided and close pairs: a whole answer against its first sentence, and against another instruction's."""
    records = SAMPLE[:10]
    lopsided = [Pair(r["instruction"], r["reference"], r["reference"].split(".")[0] + ".", r["input"]) for r in records]
    unrelated = [Pair(r["instruction"], r["reference"], other["reference"], r["input"])
                 for r, other in zip(records, SAMPLE[10:20], strict=True)]
    return [p for p in lopsided + unrelated if p.output_1.strip() != p.output_2.strip()]


@pytest.fixture(scope="module")
def judges() -> tuple[OfflineAnnotator, OfflineAnnotator]:
    """(hard, continuous), sharing one judge so that the second costs no model load."""
    hard = OfflineAnnotator(OfflineAnnotatorConfig())
    soft = OfflineAnnotator(OfflineAnnotatorConfig(continuous=True))
    soft.judge = hard.judge
    return hard, soft


def test_the_probability_mirrors_and_agrees_with_the_hard_label(judges, pairs):
    hard, soft = judges
    forward = [a.preference for a in soft.annotate(pairs)]
    backward = [a.preference for a in soft.annotate([p.swapped() for p in pairs])]
    labels = [a.preference for a in hard.annotate(pairs)]
    assert all(isinstance(p, float) and 1.0 <= p <= 2.0 for p in forward + backward)
    for p, q, label in zip(forward, backward, labels, strict=True):
        assert (p - 1.0) + (q - 1.0) == pytest.approx(1.0, abs=1e-12)  # P(a beats b) = 1 - P(b beats a)
        assert label == (2 if p > 1.5 else 1 if p < 1.5 else 0)
    # weighted, not hard: some pair is judged with less than certainty
    assert any(1.01 < p < 1.99 for p in forward)
    # identical outputs stay an exact tie (never sent to the judge)
    assert soft.annotate([Pair("q", "same", "same")])[0].preference == 0


def test_the_probability_is_the_sigmoid_of_the_score_difference(judges, pairs):
    _, soft = judges
    pair = next(p for p in pairs if not p.input)
    s1, s2 = soft.judge.score_batch([(pair.instruction, pair.output_1, None), (pair.instruction, pair.output_2, None)])
    assert soft.annotate([pair])[0].preference == pytest.approx(1.0 + 1.0 / (1.0 + math.exp(s1 - s2)), abs=1e-12)
    far = [(pair.instruction, pair.output_1, pair.output_1 + " zzqx" * n, None) for n in (1, 40, 400)]
    there, back = soft.judge.win_probability(far), soft.judge.win_probability([(i, b, a, r) for i, a, b, r in far])
    assert all(t + b == 1.0 and 0.0 <= t <= 1.0 for t, b in zip(there, back, strict=True))  # exact mirror, no overflow


def test_an_unknown_option_is_still_an_error():
    with pytest.raises(UserError, match="continous"):
        get_registry().config("annotator", "offline", {"continous": True})


# --------------------------------------------------------------------------- inside a pipeline: weighted win-rate


class WriteFirstSentences(Method):
    """A stand-in policy: the first sentence of each reference answer (a clear loser, often a close one)."""

    requires = ()
    provides = "policy"

    def run(self, context: StageContext) -> Artifact:
        path = context.stage_dir / "outputs.jsonl"
        write_records(path, [{"instruction": r["instruction"], "input": r["input"],
                              "output": r["reference"].split(".")[0] + "."} for r in SAMPLE[:12]])
        return Artifact("dataset", str(path))


class FirstSentencesPlugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("write_first_sentences", WriteFirstSentences)


def _recipe(path: Path, continuous: bool | None) -> Path:
    judge = "offline" if continuous is None else f"{{name: offline, config: {{continuous: {str(continuous).lower()}}}}}"
    path.write_text("name: weighted\nstages:\n  - name: policy\n    method: write_first_sentences\n"
                    f"evaluation:\n  evaluator: win_rate\n  annotator: {judge}\n  config: {{max_instructions: 12}}\n")
    return path


def outcomes_table(run_dir: Path) -> list[str]:
    """The columns of the table the evaluate stage recorded in its manifest."""
    manifest = json.loads((run_dir / "stages" / "evaluate" / "manifest.json").read_text())
    return manifest["artifact"]["table"]["columns"]


@pytest.mark.slow
def test_weighted_win_rate_in_a_pipeline_is_judged_apart_from_hard_labels(tmp_path: Path, register_test_plugin):
    from alpacafarm.pipeline import Pipeline
    from alpacafarm.recipe import load_recipe

    register_test_plugin(FirstSentencesPlugin(), "weighted-test")
    run_dir = tmp_path / "run"
    annotations = run_dir / "stages" / "evaluate" / "annotations.json"

    def run(continuous: bool | None) -> tuple[dict, list[dict], str]:
        outcomes = {o.name: o for o in Pipeline(load_recipe(_recipe(tmp_path / "r.yaml", continuous)),
                                                get_registry(), run_dir).run()}
        metrics = json.loads((run_dir / "stages" / "evaluate" / "metrics.json").read_text())
        return metrics, json.loads(annotations.read_text()), outcomes["evaluate"].status

    hard, hard_records, status = run(None)
    assert status == "ran" and not hard["continuous_preferences"]
    assert outcomes_table(run_dir)[1] == "win-rate %"
    soft, soft_records, status = run(True)
    assert status == "ran"  # switching to weighted labels judges again: the stage's fingerprint changed
    preferences = [r["preference"] for r in soft_records]
    assert soft["continuous_preferences"] and any(p not in (0, 1, 2) for p in preferences)
    assert outcomes_table(run_dir)[1] == "weighted win-rate %"
    # the weighted win-rate: 100 x mean P(system beats the reference), with its sample SE
    values = [0.5 if p == 0 else p - 1.0 for p in preferences]
    mean = sum(values) / len(values)
    assert soft["win_rate"] == pytest.approx(100 * mean)
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))
    assert soft["standard_error"] == pytest.approx(100 * se)
    assert soft["n_total"] == hard["n_total"] == 12
    # the same systems' hard labels are the rounded probabilities
    assert [r["preference"] for r in hard_records] == [0 if p == 0 or p == 1.5 else round(p) for p in preferences]
    again, _, status = run(True)
    assert status == "skipped" and again["win_rate"] == soft["win_rate"]
    back, back_records, status = run(False)  # hard labels again: judged again, never the soft ones reused
    assert status == "ran" and back_records == hard_records and back["win_rate"] == hard["win_rate"]


def test_the_results_table_names_weighted_win_rates():
    from alpacafarm_evaluation.evaluator import Candidate
    from alpacafarm_evaluation.results import results_rows, results_table

    keys = [f"q{i}" for i in range(8)]
    first, second = {k: 0.2 for k in keys}, {k: 0.9 if i % 2 else 0.3 for i, k in enumerate(keys)}

    def evaluated(continuous: bool) -> list:
        return [(Candidate(name, name, []), {"win_rate": 100 * sum(s.values()) / len(s), "standard_error": 1.0,
                                          "continuous_preferences": continuous}, s)
                for name, s in (("sft", first), ("better", second))]

    soft = results_rows(evaluated(True), [None, None])
    assert [r["continuous_preferences"] for r in soft] == [True, True]
    assert soft[1]["delta_vs_system"] == pytest.approx(100 * (0.6 - 0.2)) and soft[1]["significant"]
    assert results_table(soft, "t")["columns"][2] == "weighted win-rate %"
    assert results_table(results_rows(evaluated(False), [None, None]), "t")["columns"][2] == "win-rate %"
