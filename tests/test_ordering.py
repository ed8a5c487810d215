"""``alpacafarm ordering``: a run's method gains against the paper's ordering (Table 2, simulated column), with
Spearman and Kendall checked against scipy, a bootstrap over instructions, and the swapped pairs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import run_cli
from scipy import stats

from alpacafarm.errors import UserError


def word_gold(records: list[dict[str, Any]], answers: list[str]) -> list[float]:
    return [0.1 * len(set(answer.split())) for answer in answers]


@pytest.mark.parametrize("seed", range(5))
def test_spearman_and_kendall_equal_scipy_with_and_without_ties(seed: int):
    from alpacafarm_evaluation.ordering import kendall, spearman

    rng = np.random.default_rng(seed)
    theirs = np.array([10.1, 10.1, 8.3, 5.2, -0.1, -1.1, -4.3])  # the paper's gains: PPO and DPO tie
    ours = rng.integers(-3, 4, size=(6, theirs.size)).astype(float)  # small integers: ties on our side too
    for row, rho, tau in zip(ours, spearman(ours, theirs), kendall(ours, theirs), strict=True):
        if np.unique(row).size < 2:
            continue
        assert rho == pytest.approx(stats.spearmanr(row, theirs).statistic)
        assert tau == pytest.approx(stats.kendalltau(row, theirs, variant="b").statistic)


def test_the_paper_reference_gains_and_name_matching():
    from alpacafarm.data import PAPER_TABLE2
    from alpacafarm_evaluation.ordering import match, read_reference

    gains = read_reference(PAPER_TABLE2)
    assert gains["PPO"] == pytest.approx(10.1) and gains["Binary Reward Conditioning"] == pytest.approx(-4.3)
    assert gains["Best-of-1024"] == pytest.approx(8.3) and "SFT 10k" not in gains
    systems = ["best_of_2", "best_of_8", "ppo_outputs", "expert_iteration_outputs", "binary_feedme_outputs",
               "rloo_outputs", "dpo_reward_pairs_outputs"]
    matched = match(systems, gains, {"dpo_reward_pairs_outputs": "DPO"})
    assert matched == {"dpo_reward_pairs_outputs": "DPO", "best_of_8": "Best-of-1024", "ppo_outputs": "PPO",
                       "expert_iteration_outputs": "Expert Iteration", "binary_feedme_outputs": "Binary FeedME"}
    with pytest.raises(UserError, match="--map x=PPO: the run has no system 'x'"):
        match(systems, gains, {"x": "PPO"})


def test_a_swap_is_named_and_the_interval_reflects_the_instructions():
    from alpacafarm_evaluation.ordering import ordering

    rng = np.random.default_rng(0)
    keys = [f"i{k}" for k in range(200)]
    base = {k: 0.5 for k in keys}
    # PPO clearly below Quark in the run, DPO and best-of clearly ordered as in the paper
    means = {"ppo": 0.45, "dpo": 0.75, "best": 0.65, "quark": 0.6}
    scores = {"sft": base, **{s: {k: float(rng.random() < m) for k in keys} for s, m in means.items()}}
    matched = {"ppo": "PPO", "dpo": "DPO", "best": "Best-of-1024", "quark": "Quark"}
    reference = {"PPO": 10.1, "DPO": 10.0, "Best-of-1024": 8.3, "Quark": -1.1}
    result = ordering(scores, "sft", matched, reference, n_bootstrap=500, seed=1)
    gains = {m["system"]: m["gain"] for m in result.methods}
    assert gains["ppo"] == pytest.approx(100 * (np.mean(list(scores["ppo"].values())) - 0.5))
    expected = stats.spearmanr([gains[s] for s in matched], [reference[m] for m in matched.values()]).statistic
    assert result.spearman == pytest.approx(expected, abs=1e-4)
    low, high = result.spearman_interval
    assert low <= result.spearman <= high and low < high
    swapped = {(s["above_in_reference"], s["below_in_reference"]) for s in result.swaps}
    assert ("ppo", "quark") in swapped and ("dpo", "best") not in swapped
    share = next(s for s in result.swaps if s["below_in_reference"] == "quark")["bootstrap_share_swapped"]
    assert share > 0.9


@pytest.mark.slow
def test_the_command_reads_a_finished_run_and_matches_its_evaluation(tmp_path: Path, tiny_model_dir: str,
                                                                     monkeypatch: pytest.MonkeyPatch):
    from alpacafarm.testing import run_recipe

    monkeypatch.setenv("ALPACAFARM_CACHE_DIR", str(tmp_path / "cache"))
    stages = "\n".join(f"""  - name: {name}
    method: generate_outputs
    config: {{sampling: {{temperature: 1.0, max_new_tokens: 6, batch_size: 4, seed: {seed}}}}}"""
                       for seed, name in enumerate(["sft_outputs", "ppo_outputs", "quark_outputs", "my_method",
                                                    "expert_iteration_outputs"]))
    recipe = tmp_path / "ordering.yaml"
    recipe.write_text(f"""
name: ordering
model: {{name: {tiny_model_dir}, dtype: float32, device: cpu}}
data:
  instructions: {{builtin: alpaca_eval_sample, limit: 40}}
stages:
  - name: split
    method: split_instructions
    config: {{eval_size: 24}}
{stages}
evaluation:
  annotator: {{name: gold, config: {{gold: "test_ordering:word_gold", mode: continuous}}}}
  policy: [sft_outputs, ppo_outputs, quark_outputs, my_method, expert_iteration_outputs]
""", encoding="utf-8")
    run_recipe(recipe, tmp_path / "run")
    result = run_cli("ordering", str(tmp_path / "run"), "--map", "my_method=DPO", "--n-bootstrap", "300", "--json",
                     env={"PYTHONPATH": str(Path(__file__).parent)})
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    rows = {r["system"]: r for r in json.loads((tmp_path / "run" / "stages" / "evaluate" / "results.json")
                                               .read_text(encoding="utf-8"))["rows"]}
    assert printed["base"] == "sft_outputs" and printed["n_instructions"] == 24 and printed["unmatched"] == []
    for method in printed["methods"]:  # the gains are the evaluation's own paired differences to the SFT row
        assert method["gain"] == pytest.approx(rows[method["system"]]["delta_vs_system"], abs=1e-6)
        assert method["paired_se"] == pytest.approx(rows[method["system"]]["paired_se_vs_system"], abs=1e-6)
    assert {m["method"] for m in printed["methods"]} == {"PPO", "Quark", "DPO", "Expert Iteration"}
    gains = [m["gain"] for m in printed["methods"]]
    if len(set(gains)) > 1:
        expected = stats.spearmanr(gains, [m["reference_gain"] for m in printed["methods"]]).statistic
        assert printed["spearman"] == pytest.approx(expected, abs=1e-4)
    text = run_cli("ordering", str(tmp_path / "run"), "--map", "my_method=DPO", "--n-bootstrap", "50",
                   env={"PYTHONPATH": str(Path(__file__).parent)})
    assert text.returncode == 0 and "Spearman" in text.stdout and "Kendall" in text.stdout


def test_an_unfinished_or_missing_evaluation_is_one_line_exit_2(tmp_path: Path):
    result = run_cli("ordering", str(tmp_path))
    assert result.returncode == 2 and "manifest.json does not exist" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    stage = tmp_path / "stages" / "evaluate"
    stage.mkdir(parents=True)
    (stage / "manifest.json").write_text(json.dumps({"status": "running"}), encoding="utf-8")
    result = run_cli("ordering", str(tmp_path))
    assert result.returncode == 2 and "did not finish" in result.stderr
