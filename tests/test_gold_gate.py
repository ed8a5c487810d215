"""The gold world's gate sees a method stop learning (``benchmarks/baselines/gold.json``, ``recipes/bench/gold.yaml``,
``alpacafarm bench`` against the committed baseline):

- a reward model that learns from swapped labels (a plugin bug anyone could write: chosen and rejected the wrong way
  round) takes best-of-8 from its baseline's lead over a plain SFT sample to below it: FAIL;
- DPO trained on swapped pairs, and DPO at a learning rate of 0 (a trained method that stops learning: the SFT
  model comes out), take ``dpo_outputs`` below its baseline: FAIL;

and in each the systems the sabotage cannot reach pass.

The reward model's test is marked ``gate`` (``pytest -m gate``; ``.ci/run`` runs it right after the gate itself):
it runs the reward model, best-of-8 and the evaluation again (7-12 minutes on 2 cores). DPO's two are marked
``trained_gate`` (``pytest -m trained_gate``; not in ``.ci/run``, for time): each trains DPO again (18-20 minutes
on 2 cores in float32), then its answers and the evaluation. The gate itself trains DPO on every ``.ci/run``, so a
change that stops DPO learning FAILs there; these tests show that it would. Where the gate's own run folder exists
(``alpacafarm bench recipes/bench/gold.yaml ...`` was run here, as ``.ci/run`` does first) it is copied, so the
split, the labelled SFT samples and the stages the sabotage does not reach are not made again; without it they
are made too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import alpacafarm

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes/bench/gold.yaml"
BASELINE = REPO / "benchmarks/baselines/gold.json"
GATE_RUN = REPO / "runs/bench/bench-gold"  # where `alpacafarm bench recipes/bench/gold.yaml` runs by default


def swapped_reward_model() -> type:
    from alpacafarm_methods.reward_model.method import RewardModel

    class SwappedRewardModel(RewardModel):
        """The built-in reward model fed its preferences the wrong way round."""

        def run(self, context: Any) -> Any:
            read = context.records

            def records(name: str, file: str | None = None) -> list[dict[str, Any]]:
                rows = read(name, file)
                if name != "preferences":
                    return rows
                return [{**r, "preference": 3 - r["preference"]} if r.get("preference") in (1, 2) else r
                        for r in rows]

            context.records = records
            return super().run(context)

    return SwappedRewardModel


def swapped_dpo() -> type:
    from alpacafarm_methods.preference.dpo import DPO

    class SwappedDPO(DPO):
        """The built-in DPO fed its pairs the wrong way round: it learns to prefer what the annotators rejected."""

        def examples(self, records: list[dict[str, Any]], spec: Any, tokenizer: Any) -> tuple[list, int]:
            groups, dropped = super().examples(records, spec, tokenizer)
            return [[{**row, "chosen": row["rejected"], "rejected": row["chosen"]} for row in group]
                    for group in groups], dropped

    return SwappedDPO


class SwapPlugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("swapped_reward_model", swapped_reward_model())
        register("swapped_dpo", swapped_dpo())


def bench_against_the_baseline(run: Path, capsys: pytest.CaptureFixture, overrides: list[str]
                               ) -> tuple[int, dict[str, Any], dict[str, dict[str, Any]]]:
    """``alpacafarm bench`` of the gold recipe with ``overrides`` into ``run`` (a copy of the gate's own run folder
    where there is one): its exit code, its JSON report and each system's verdict."""
    from alpacafarm.cli import main

    if (GATE_RUN / "stages/preferences/manifest.json").is_file():
        shutil.copytree(GATE_RUN, run)
    capsys.readouterr()
    arguments = ["bench", str(RECIPE), "--baseline", str(BASELINE), "--output-dir", str(run), "--json"]
    for override in overrides:
        arguments += ["--set", override]
    code = main(arguments)
    report = json.loads(capsys.readouterr().out)
    return code, report, {s["system"]: s for s in report["systems"]}


@pytest.mark.gate
def test_the_gate_fails_a_reward_model_that_learns_from_swapped_labels(register_test_plugin, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture):
    register_test_plugin(SwapPlugin(), "swap-test")
    run = tmp_path / "run"
    code, report, verdicts = bench_against_the_baseline(
        run, capsys, ["stages.reward_model.method=swapped_reward_model"])
    assert code == 1 and report["verdict"] == "FAIL", report
    assert verdicts["best_of_8"]["verdict"] == "FAIL", verdicts["best_of_8"]
    assert verdicts["best_of_8"]["delta"] < -5  # not a marginal call: learning the wrong way round costs more
    assert verdicts["best_of_1"]["verdict"] == "PASS"  # a plain sample does not read the reward model
    assert verdicts["dpo_outputs"]["verdict"] == "PASS"  # DPO reads the labels, not the reward model
    manifest = json.loads((run / "stages/reward_model/manifest.json").read_text())
    assert manifest["method"] == "swapped_reward_model"  # the candidate really ran


@pytest.mark.trained_gate
@pytest.mark.parametrize(("override", "method", "learning_rate", "drop_beyond"), [
    # learning the wrong way round goes below the SFT model, not just back to it
    ("stages.dpo.method=swapped_dpo", "swapped_dpo", 2.0e-5, -5.0),
    # nothing learnt: the SFT model comes out, a drop of DPO's whole gain (4.3 points on the baseline)
    ("stages.dpo.config.learning_rate=0.0", "dpo", 0.0, 0.0),
], ids=["swapped pairs", "learning rate 0"])
def test_the_gate_fails_a_dpo_that_stops_learning(override: str, method: str, learning_rate: float, drop_beyond: float,
                                                  register_test_plugin, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture):
    register_test_plugin(SwapPlugin(), "swap-test")
    run = tmp_path / "run"
    code, report, verdicts = bench_against_the_baseline(run, capsys, [override])
    assert code == 1 and report["verdict"] == "FAIL", report
    assert verdicts["dpo_outputs"]["verdict"] == "FAIL", verdicts["dpo_outputs"]  # a drop beyond the margin shown
    assert verdicts["dpo_outputs"]["delta"] < drop_beyond, verdicts["dpo_outputs"]
    for untouched in ("best_of_1", "best_of_8"):  # best-of-n does not read DPO's model
        assert verdicts[untouched]["verdict"] == "PASS", verdicts[untouched]
    manifest = json.loads((run / "stages/dpo/manifest.json").read_text())
    # the candidate really ran
    assert (manifest["method"], manifest["config"]["learning_rate"]) == (method, learning_rate), manifest["config"]
