"""The CI gate (``alpacafarm bench``): its statistics against scipy, and proof that it gates a plugin.

The proof runs a tiny benchmark (random-init tiny models, 96 held-out instructions) whose judge is a fixed reward
model (``reward_judge`` of the test plugin in ``tests/plugins/alpacafarm_benchtest``), so that best-of-n is really
better than a random sample under that judge and a best-of-n that keeps the *lowest*-reward sample is really
worse: the FAIL below is a statistical FAIL on 96 paired instructions, not an artefact.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO_ROOT, run_cli

from alpacafarm_evaluation.gate_stats import (
    EXIT_CODES,
    FAIL,
    INCONCLUSIVE,
    PASS,
    STALE,
    family_alpha,
    non_inferiority,
    paired_differences,
    verdict,
    worst,
)

BENCHTEST_PLUGIN = REPO_ROOT / "tests" / "plugins" / "alpacafarm_benchtest"
N_EVAL = 96

# ---------------------------------------------------------------------------------------------- statistics

#: per-instruction differences (points) of a made-up candidate: wins, ties and losses against a baseline
KNOWN = [100, 0, 0, -50, 0, 100, -100, 0, 50, 0, 0, -100, 0, 0, 50, 0, -100, 0, 0, 100, 0, -50, 0, 0, 0, 100, 0,
         -100, 0, 0, 50, -100] * 3


@pytest.mark.parametrize("margin,alpha", [(5.0, 0.05), (10.0, 0.025), (2.5, 0.1)])
def test_non_inferiority_matches_scipy_t_tests(margin: float, alpha: float):
    from scipy import stats

    test = non_inferiority(KNOWN, margin, alpha, 0.8)
    n = len(KNOWN)
    assert test.n == n and math.isclose(test.delta, sum(KNOWN) / n)
    assert math.isclose(test.standard_error, stats.sem(KNOWN), rel_tol=1e-12)
    # H0: Δ <= -margin against Δ > -margin: a one-sample t-test of d against -margin, one-sided
    assert math.isclose(test.p_value, stats.ttest_1samp(KNOWN, -margin, alternative="greater").pvalue, rel_tol=1e-9)
    # H0: Δ >= 0 against Δ < 0
    assert math.isclose(test.p_regression, stats.ttest_1samp(KNOWN, 0.0, alternative="less").pvalue, rel_tol=1e-9)
    # the bounds are one-sided at alpha: together the two-sided 1 - 2 alpha interval
    interval = stats.ttest_1samp(KNOWN, 0.0).confidence_interval(confidence_level=1 - 2 * alpha)
    assert math.isclose(test.ci_low, interval.low, rel_tol=1e-9)
    assert math.isclose(test.ci_high, interval.high, rel_tol=1e-9)
    mde = (stats.t.ppf(1 - alpha, n - 1) + stats.norm.ppf(0.8)) * stats.sem(KNOWN)
    assert math.isclose(test.mde, mde, rel_tol=1e-9)
    # PASS exactly when the p-value is below alpha (the lower bound above -margin)
    assert (test.verdict == PASS) == (test.p_value < alpha) == (test.ci_low > -margin)


def test_a_hand_computed_case():
    # d = 0, 10, 20, 30: mean 15, sd sqrt(500/3), SE sqrt(500/3)/2 = 6.455; t(0.95, 3) = 2.353363
    test = non_inferiority([0, 10, 20, 30], margin=5.0, alpha=0.05)
    se = math.sqrt(500 / 3) / 2
    assert math.isclose(test.standard_error, se, rel_tol=1e-12)
    assert math.isclose(test.ci_low, 15 - 2.3533634 * se, abs_tol=1e-5)
    assert math.isclose(test.ci_high, 15 + 2.3533634 * se, abs_tol=1e-5)
    assert test.verdict == PASS  # the lower bound -0.19 is above -5


def test_verdicts_follow_the_documented_rules():
    regression = [-30, -20, -10, -40, -20, -30, -10, -20] * 4  # Δ = -22.5, tight: FAIL
    noisy = [100, -100, 50, -100, 0, 100, -100, -50] * 2  # Δ = -12.5, wide: holds 0 and -margin
    assert non_inferiority(regression, 5.0).verdict == FAIL
    test = non_inferiority(noisy, 5.0)
    assert test.verdict == INCONCLUSIVE and test.ci_low <= -5.0 <= 0.0 <= test.ci_high
    assert non_inferiority([1, -1] * 50, 5.0).verdict == PASS
    # identical outputs pass whatever the judge said (a noisy judge may label identical pairs differently)
    assert non_inferiority(regression, 5.0, identical=True).verdict == PASS
    # no spread: the bounds collapse onto the mean
    flat = non_inferiority([-10.0] * 8, 5.0)
    assert (flat.verdict, flat.p_value, flat.p_regression, flat.ci_low, flat.ci_high) == (FAIL, 1.0, 0.0, -10, -10)
    assert non_inferiority([0.0] * 8, 5.0).verdict == PASS
    assert verdict(-4.9, 3.0, 5.0) == PASS and verdict(-5.0, -0.1, 5.0) == FAIL and verdict(-5.0, 0.0, 5.0) == \
        INCONCLUSIVE
    assert worst([PASS, INCONCLUSIVE, PASS]) == INCONCLUSIVE and worst([INCONCLUSIVE, FAIL]) == FAIL
    assert worst([FAIL, STALE]) == STALE and worst([]) == PASS
    assert EXIT_CODES == {PASS: 0, FAIL: 1, INCONCLUSIVE: 3, STALE: 4}
    assert family_alpha(0.05, 2) == 0.025 and family_alpha(0.05, 0) == 0.05
    assert paired_differences({"a": 1.0, "b": 0.5, "c": 0.0}, {"b": 1.0, "a": 1.0, "x": 0.0}) == [-50.0, 0.0]


def test_the_baseline_power_estimate_follows_the_formula_and_finds_the_instructions_needed():
    from scipy import stats

    from alpacafarm_evaluation.gate_stats import baseline_power

    a = {f"i{k}": [1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.0, 0.25][k % 8] for k in range(64)}
    b = {k: min(1.0, v + (0.25 if int(k[1:]) % 3 == 0 else 0.0)) for k, v in a.items()}
    rho = stats.pearsonr([a[k] for k in a], [b[k] for k in a]).statistic
    first, second = baseline_power({"a": a, "b": b}, margin=5.0, alpha=0.05, power=0.8)
    assert first.system == "a" and math.isclose(first.correlation, rho, rel_tol=1e-9)
    sd = math.sqrt(2 * (1 - rho)) * stats.tstd([100 * v for v in a.values()])
    expected = (stats.t.ppf(1 - 0.025, 63) + stats.norm.ppf(0.8)) * sd / 8  # alpha shared by two systems
    assert math.isclose(first.mde, expected, rel_tol=1e-9)
    n = first.needed
    mde_at = lambda m: (stats.t.ppf(1 - 0.025, m - 1) + stats.norm.ppf(0.8)) * sd / math.sqrt(m)  # noqa: E731
    assert first.underpowered == (first.mde > 5.0) and mde_at(n) <= 5.0 < mde_at(n - 1)
    # one system: no other system to estimate the correlation from, so the upper bound rho = 0
    (alone,) = baseline_power({"a": a}, margin=5.0)
    assert alone.correlation == 0.0 and alone.mde > first.mde and alone.needed > n
    assert second.system == "b"


@pytest.mark.parametrize("kwargs,message", [({"margin": 0.0}, "margin must be positive"),
                                            ({"alpha": 0.5}, "alpha must be in"), ({"power": 1.0}, "power")])
def test_bad_gate_settings_are_errors(kwargs: dict[str, float], message: str):
    with pytest.raises(ValueError, match=message):
        non_inferiority([1.0, 2.0, 3.0], **kwargs)
    with pytest.raises(ValueError, match="at least 2 instructions"):
        non_inferiority([1.0])


# ------------------------------------------------------------------------------------- the tiny benchmark

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def benchtest_plugin(monkeypatch_module: pytest.MonkeyPatch) -> None:
    """The test plugin registered in-process for the module (built-ins still load from their entry points)."""
    from alpacafarm.plugins import register_plugin, unregister_plugin

    monkeypatch_module.syspath_prepend(str(BENCHTEST_PLUGIN))
    import alpacafarm_benchtest

    register_plugin(alpacafarm_benchtest, "benchtest")
    yield
    unregister_plugin("benchtest")


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str, benchtest_plugin: None) -> dict:
    """A tiny benchmark recipe (its reward model, references written by the tiny LM) and its baseline."""
    from alpacafarm.data import BUILTIN_DIR, read_records
    from alpacafarm.generation import SamplingConfig, generate_records
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import ModelSpec
    from alpacafarm.testing import tiny_sequence_classifier, tiny_tokenizer, write_records
    from alpacafarm_evaluation.bench import baseline_json, run_benchmark

    root = tmp_path_factory.mktemp("bench")
    tokenizer = tiny_tokenizer()
    reward_dirs = []
    for seed in (1, 2):  # the judge's model (seed 1) and another one (a changed judge)
        folder = root / f"reward-{seed}"
        tiny_sequence_classifier(tokenizer, seed=seed).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        reward_dirs.append(str(folder))
    # References: the tiny LM's own samples, so that its best-of-4 wins about 4 times in 5 under the judge
    spec = ModelSpec(name=tiny_model_dir, dtype="float32", device="cpu", prompt_format="chat_template")
    generator = get_registry().create("generation_backend", "transformers", None, spec=spec,
                                      model_path=tiny_model_dir)
    records = read_records(BUILTIN_DIR / "alpaca_eval_sample.jsonl")
    rows = generate_records(generator, records, SamplingConfig(temperature=1.0, max_new_tokens=8, batch_size=64,
                                                               seed=999))
    generator.close()
    references = write_records(root / "references.jsonl", [
        {"instruction": r["instruction"], "input": r.get("input", ""), "reference": r["output"],
         "dataset": r.get("dataset")} for r in rows])
    recipe = root / "bench.yaml"
    recipe.write_text(f"""
name: tiny-bench
seed: 5
model: {{name: {tiny_model_dir}, dtype: float32, device: cpu, prompt_format: chat_template}}
data:
  instructions: {{builtin: alpaca_eval_sample}}
stages:
  - name: split
    method: split_instructions
    config: {{eval_size: {N_EVAL}}}
  - name: reward_model
    method: fixed_reward_model
    config: {{path: {reward_dirs[0]}}}
  - name: best_of_n
    method: best_of_n
    config: {{n: 4, n_values: [1, 4], sampling: {{temperature: 1.0, max_new_tokens: 8, batch_size: 32}}}}
evaluation:
  annotator: {{name: reward_judge, config: {{model: {reward_dirs[0]}}}}}
  policy: [best_of_n]
  config: {{references: {{path: {references}}}}}
""", encoding="utf-8")
    run = run_benchmark(str(recipe), [], str(root / "baseline-run"))
    baseline = baseline_json(run, margin=5.0, alpha=0.05, power=0.8)
    baseline_file = root / "baseline.json"
    baseline_file.write_text(json.dumps(baseline), encoding="utf-8")
    return {"root": root, "recipe": str(recipe), "baseline": baseline, "baseline_file": baseline_file,
            "reward_dirs": reward_dirs, "references": references, "run": run}


def gate(tiny_bench: dict, name: str, overrides: list[str], margin: float = 5.0,
         fresh: bool = False) -> tuple[Any, dict[str, Any]]:
    """Run the tiny benchmark with ``overrides`` and compare it with the baseline. The run starts from a copy of
    the baseline's run directory (only the stages that the overrides change run), or from nothing (``fresh``)."""
    import shutil

    from alpacafarm_evaluation.bench import compare, run_benchmark

    run_dir = tiny_bench["root"] / name
    if not fresh and not run_dir.exists():
        shutil.copytree(tiny_bench["root"] / "baseline-run", run_dir)
    run = run_benchmark(tiny_bench["recipe"], overrides, str(run_dir), probe=tiny_bench["baseline"]["judge_probe"])
    return run, compare(run, tiny_bench["baseline"], margin, 0.05, 0.8)


def by_system(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["system"]: row for row in report["systems"]}


def test_the_baseline_records_outcomes_hashes_fingerprints_and_versions(tiny_bench: dict):
    baseline = tiny_bench["baseline"]
    assert set(baseline["systems"]) == {"best_of_1", "best_of_4"}
    for system in baseline["systems"].values():
        assert system["n"] == N_EVAL and len(system["instructions"]) == N_EVAL
        assert {row["score"] for row in system["instructions"].values()} <= {0.0, 0.5, 1.0}
    assert set(baseline["fingerprints"]) == {"judge", "data", "recipe"}
    assert len(baseline["judge_probe"]) == 24 and len(baseline["judge"]["probe_labels"]) == 24
    assert baseline["judge"]["annotator"]["name"] == "reward_judge" and baseline["judge"]["plugin"] == "benchtest"
    assert baseline["versions"]["torch"] and baseline["plugin_versions"]["evaluation"]
    assert baseline["gate"] == {"margin": 5.0, "alpha": 0.05, "power": 0.8}
    # Under this judge best-of-4 is really better than one sample: the regression below is a real one.
    assert baseline["systems"]["best_of_4"]["win_rate"] > baseline["systems"]["best_of_1"]["win_rate"] + 15


def test_the_unchanged_method_passes_with_identical_outputs(tiny_bench: dict):
    _, report = gate(tiny_bench, "unchanged", [], fresh=True)  # every stage runs again
    assert report["verdict"] == PASS and report["exit_code"] == 0 and report["stale"] == []
    for row in report["systems"]:
        assert row["identical"] and row["n_changed_outputs"] == 0 and row["verdict"] == PASS
        assert row["delta"] == 0.0 and row["n"] == N_EVAL


def test_a_plugin_whose_best_of_n_keeps_the_lowest_reward_sample_fails(tiny_bench: dict):
    from scipy import stats

    from alpacafarm_evaluation.bench import SystemOutcomes

    run, report = gate(tiny_bench, "worst", ["stages.best_of_n.method=worst_of_n"])
    assert report["verdict"] == FAIL and report["exit_code"] == 1 and report["stale"] == []
    rows = by_system(report)
    assert rows["best_of_1"]["identical"] and rows["best_of_1"]["verdict"] == PASS  # the first sample: unchanged
    worst_row = rows["best_of_4"]
    assert worst_row["verdict"] == FAIL and not worst_row["identical"] and worst_row["n"] == N_EVAL
    # a statistical FAIL: the whole interval is below 0 and the drop is far beyond the margin
    assert worst_row["ci_high"] < 0 and worst_row["delta"] < -30 and worst_row["p_regression"] < 1e-6
    assert worst_row["p_value"] > 0.5 and worst_row["mde"] < 25
    # ... and the numbers are scipy's paired t-test on the per-instruction scores
    base = SystemOutcomes.from_json("best_of_4", tiny_bench["baseline"]["systems"]["best_of_4"])
    cand = run.systems["best_of_4"]
    diffs = [100 * (cand.scores[k] - base.scores[k]) for k in base.scores]
    assert math.isclose(worst_row["p_regression"], stats.ttest_1samp(diffs, 0, alternative="less").pvalue,
                        rel_tol=1e-9)
    assert math.isclose(worst_row["p_value"], stats.ttest_1samp(diffs, -5.0, alternative="greater").pvalue,
                        rel_tol=1e-9)
    assert report["alpha_per_system"] == 0.025  # two systems share alpha


@pytest.mark.parametrize("overrides", [["stages.best_of_n.method=best_of_n_refactored"],
                                       ["stages.best_of_n.config.score_batch_size=3"]],
                         ids=["renamed-subclass", "config-change"])
def test_a_neutral_refactor_passes(tiny_bench: dict, overrides: list[str]):
    _, report = gate(tiny_bench, "refactor-" + overrides[0].split("=")[1], overrides)
    assert report["verdict"] == PASS and report["stale"] == []
    assert all(row["identical"] for row in report["systems"])


def test_the_same_method_with_other_samples_passes_on_statistics(tiny_bench: dict):
    # Other sampling seeds: every output changes, the method does not. The tiny benchmark's MDE is ~17 points,
    # so the margin must be above it for an unchanged method to pass (the gate prints the MDE for this reason).
    _, report = gate(tiny_bench, "other-seed", ["stages.best_of_n.config.sampling.seed=7"], margin=25.0)
    assert report["verdict"] == PASS and report["stale"] == []
    for row in report["systems"]:
        assert not row["identical"] and row["n_changed_outputs"] > N_EVAL * 0.9
        assert row["ci_low"] > -25.0 and row["verdict"] == PASS and row["mde"] < 25.0


def test_a_changed_judge_is_stale(tiny_bench: dict):
    other_judge = f"evaluation.annotator.config.model={tiny_bench['reward_dirs'][1]}"
    _, report = gate(tiny_bench, "judge", [other_judge])
    assert report["verdict"] == STALE and report["exit_code"] == 4
    assert any(r.startswith("judge changed: {") for r in report["stale"])
    assert all(row["verdict"] == STALE for row in report["systems"])


def test_a_judge_whose_code_changed_under_the_same_name_is_stale(tiny_bench: dict,
                                                                   monkeypatch: pytest.MonkeyPatch):
    from alpacafarm_benchtest.judge import RewardJudge

    # a new version of the judge: same name and config, different decisions (it now prefers the lower score)
    monkeypatch.setattr(RewardJudge, "decide", staticmethod(lambda a, b: 0 if a == b else (2 if a > b else 1)))
    _, report = gate(tiny_bench, "judge", [])
    assert report["verdict"] == STALE
    assert any("same name and config, but it labels" in r for r in report["stale"]), report["stale"]


def test_changed_data_is_stale(tiny_bench: dict, tmp_path: Path):
    from alpacafarm.data import read_records
    from alpacafarm.testing import write_records

    references = read_records(tiny_bench["references"])
    changed = write_records(tmp_path / "references.jsonl", [{**r, "reference": r["reference"] + " (edited)"}
                                                            for r in references])
    _, report = gate(tiny_bench, "judge", [f"evaluation.config.references.path={changed}"])
    assert report["verdict"] == STALE
    assert any(r.startswith("data changed") for r in report["stale"])
    _, report = gate(tiny_bench, "seed", ["seed=6"])  # another seed holds out other instructions
    assert report["verdict"] == STALE and any(r.startswith("data changed") for r in report["stale"])
    assert any(r == "recipe changed: seed" for r in report["stale"])


def test_reports_are_json_and_markdown_ready_for_a_pull_request(tiny_bench: dict):
    from alpacafarm_evaluation.bench import markdown

    _, report = gate(tiny_bench, "worst", ["stages.best_of_n.method=worst_of_n"])  # skipped: already run
    text = markdown(report)
    assert text.startswith("## ❌ alpacafarm bench: FAIL")
    assert "| system | n | base % | now % | Δ | CI | p | MDE | verdict |" in text
    assert f"| best_of_1 | {N_EVAL} |" in text and "| identical | - | - | - | PASS |" in text and "| FAIL |" in text
    json.loads(json.dumps(report))


# ---------------------------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def benchtest_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test plugin pip-installed (no network) into a folder for PYTHONPATH, as a plugin repository's CI does."""
    import shutil

    work = tmp_path_factory.mktemp("benchtest-plugin")
    shutil.copytree(BENCHTEST_PLUGIN, work / "src")
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                             "--no-index", "--target", str(work / "site"), str(work / "src")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return work / "site"


@pytest.mark.slow
def test_the_command_exits_1_on_fail_with_json_and_a_report(tiny_bench: dict, benchtest_site: Path,
                                                            tmp_path: Path):
    report_file = tmp_path / "gate.md"
    result = run_cli("bench", tiny_bench["recipe"], "--baseline", str(tiny_bench["baseline_file"]),
                     "--output-dir", str(tiny_bench["root"] / "worst"), "--set", "stages.best_of_n.method=worst_of_n",
                     "--json", "--report", str(report_file), env={"PYTHONPATH": str(benchtest_site)})
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == FAIL and by_system(report)["best_of_4"]["verdict"] == FAIL
    assert report["margin"] == 5.0 and report["alpha"] == 0.05  # the baseline's gate settings
    assert report_file.read_text(encoding="utf-8").startswith("## ❌ alpacafarm bench: FAIL")


@pytest.mark.slow
def test_the_command_exits_4_on_a_stale_baseline_and_update_baseline_writes_a_new_one(
        tiny_bench: dict, benchtest_site: Path, tmp_path: Path):
    env = {"PYTHONPATH": str(benchtest_site)}
    sets = ["--set", "stages.best_of_n.method=worst_of_n",  # the previous test's run: only the evaluation re-runs
            "--set", f"evaluation.annotator.config.model={tiny_bench['reward_dirs'][1]}"]
    run_dir = str(tiny_bench["root"] / "worst")
    stale = run_cli("bench", tiny_bench["recipe"], "--baseline", str(tiny_bench["baseline_file"]),
                    "--output-dir", run_dir, *sets, env=env)
    assert stale.returncode == 4, stale.stderr
    assert "stale: judge changed" in stale.stderr and "STALE" in stale.stderr
    baseline = tmp_path / "baselines" / "tiny.json"  # a new file in a new folder
    # The tiny benchmark cannot see a 7.5-point regression (its MDE is ~17): refused, one line, nothing written
    refused = run_cli("bench", tiny_bench["recipe"], "--baseline", str(baseline), "--update-baseline",
                      "--output-dir", run_dir, "--margin", "7.5", *sets, env=env)
    assert refused.returncode == 2, refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("error: bench: baseline not written: best_of_") and "above the margin 7.5" in last, last
    assert re.search(r"\(96 instructions; about \d+ instructions would do\)", last), last
    assert re.search(r"best_of_4: estimated MDE \d+\.\d points on 96 instructions \(margin 7.5; about \d+ needed",
                     refused.stderr), refused.stderr
    assert not baseline.exists()
    result = run_cli("bench", tiny_bench["recipe"], "--baseline", str(baseline), "--update-baseline",
                     "--output-dir", run_dir, "--margin", "7.5", "--allow-underpowered", *sets, env=env)
    assert result.returncode == 0, result.stderr
    assert f"baseline written: {baseline}" in result.stderr
    written = json.loads(baseline.read_text(encoding="utf-8"))
    assert written["gate"]["margin"] == 7.5 and set(written["systems"]) == {"best_of_1", "best_of_4"}
    estimate = {e["system"]: e for e in written["power_estimate"]}
    assert estimate["best_of_4"]["underpowered"] and estimate["best_of_4"]["needed"] > 96
    assert estimate["best_of_4"]["mde"] > 7.5
    assert written["judge"]["annotator"]["config"]["model"] == tiny_bench["reward_dirs"][1]
    assert written["fingerprints"]["data"] == tiny_bench["baseline"]["fingerprints"]["data"]
    # a crash is no verdict: exit 5 with the traceback, never 1 (FAIL)
    crash = run_cli("bench", tiny_bench["recipe"], "--baseline", str(baseline), "--output-dir", run_dir, *sets,
                    "--set", "stages.reward_model.config.crash=true", env=env)
    assert crash.returncode == 5, crash.stderr
    assert "RuntimeError: planted crash" in crash.stderr and "Traceback" in crash.stderr
    assert crash.stderr.strip().splitlines()[-1] == (
        "error: the benchmark run crashed (RuntimeError: planted crash); no verdict (exit 5)")


def test_a_missing_or_bad_baseline_is_a_one_line_user_error(tmp_path: Path):
    missing = run_cli("bench", "recipes/bench/best_of_n.yaml", "--baseline", str(tmp_path / "none.json"))
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"error: --baseline {tmp_path / 'none.json'}: no such file; create it with --update-baseline"]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    result = run_cli("bench", "recipes/bench/best_of_n.yaml", "--baseline", str(bad))
    assert result.returncode == 2 and result.stderr.startswith(f"error: --baseline {bad} is not JSON")
    bad.write_text(json.dumps({"format": "something else"}), encoding="utf-8")
    result = run_cli("bench", "recipes/bench/best_of_n.yaml", "--baseline", str(bad))
    assert result.returncode == 2 and "is not an alpacafarm bench baseline" in result.stderr
    result = run_cli("bench", "recipes/bench/best_of_n.yaml", "--baseline", str(bad), "--margin", "0")
    assert result.returncode == 2 and "--margin must be in (0, 20]" in result.stderr


@pytest.mark.slow
def test_a_method_whose_code_changed_under_the_same_version_re_runs_and_fails(tiny_bench: dict, tmp_path: Path):
    """The plugin's version is not bumped: only its source changes. The gate must not reuse the old outputs."""
    import shutil

    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                             "--no-index", "--target", str(site), str(BENCHTEST_PLUGIN)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_bench["root"] / "baseline-run", run_dir)
    command = ["bench", tiny_bench["recipe"], "--baseline", str(tiny_bench["baseline_file"]), "--output-dir",
               str(run_dir), "--set", "stages.best_of_n.method=best_of_n_refactored", "--json"]
    env = {"PYTHONPATH": str(site)}
    first = run_cli(*command, env=env)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["verdict"] == PASS
    # The author changes the method to keep the lowest-reward sample, same name, same version 0.1.0.
    methods = site / "alpacafarm_benchtest" / "methods.py"
    source = methods.read_text(encoding="utf-8")
    assert "class RefactoredBestOfN(BestOfN):" in source
    methods.write_text(source.replace("class RefactoredBestOfN(BestOfN):", "class RefactoredBestOfN(WorstOfN):"),
                       encoding="utf-8")
    second = run_cli(*command, env=env)
    assert second.returncode == 1, second.stderr
    assert "best_of_n (best_of_n_refactored) — fingerprint changed: code" in second.stderr
    assert "split: unchanged, skipped" in second.stderr  # the stages whose code did not change are reused
    report = json.loads(second.stdout)
    assert report["verdict"] == FAIL and by_system(report)["best_of_4"]["verdict"] == FAIL
    # --force re-runs every stage, the unchanged ones too
    forced = run_cli(*command, "--force", env=env)
    assert forced.returncode == 1, forced.stderr
    assert "split (split_instructions) — forced (--force)" in forced.stderr
    assert "unchanged, skipped" not in forced.stderr


def test_probe_labels_within_float_noise_keep_the_baseline_and_a_moved_label_makes_it_stale():
    """The judge fingerprint hashes its probe labels, so float noise from a batched forward pass (the offline judge
    batches its language-model reads) changed the digest and made every baseline stale with '0 of 24 differ'."""
    from alpacafarm_evaluation.bench_baseline import BenchRun, digest, stale_reasons

    labels = [1.0 + i / 50 for i in range(24)]
    judge = {"annotator": {"name": "offline", "config": {"continuous": True}}, "plugin": "annotators"}
    baseline = {"fingerprints": {"judge": digest({**judge, "probe_labels": labels}), "data": "d", "recipe": "r"},
                "judge": {**judge, "probe_labels": labels}, "systems": {"best_of_1": {}}}

    def run_with(new_labels: list[float]) -> BenchRun:
        new_judge = {**judge, "probe_labels": new_labels}
        return BenchRun(recipe="b.yaml", recipe_name="b", overrides=[], run_dir="run", systems={"best_of_1": None},
                        fingerprints={"judge": digest(new_judge), "data": "d", "recipe": "r"}, judge=new_judge,
                        protocol={}, probe=[], versions={}, plugin_versions={}, seconds=0.0)

    assert stale_reasons(run_with(labels), baseline) == []
    assert stale_reasons(run_with([x + 3e-7 for x in labels]), baseline) == []
    moved = [*labels[:5], labels[5] + 0.01, *labels[6:]]
    assert stale_reasons(run_with(moved), baseline) == [
        "judge changed: same name and config, but it labels 1 of 24 probe pairs differently (its code or model "
        "changed)"]
    assert stale_reasons(run_with(labels[:23]), baseline) != []  # a lost probe pair is not the same judge
