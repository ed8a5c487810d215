"""The gold world's gate sees a method stop learning: a reward model that learns from swapped labels (a plugin bug
anyone could write: chosen and rejected the wrong way round) takes best-of-8 from its baseline's lead over a plain
SFT sample to below it, and ``alpacafarm bench`` FAILs it against the committed baseline
(``benchmarks/baselines/gold.json``, ``recipes/bench/gold.yaml``); the unchanged plain sample passes.

Marked ``gate`` (``pytest -m gate``; ``.ci/run`` runs it right after the gate itself): it runs the benchmark's
reward model, best-of-8 and evaluation again (about 4 minutes on 2 cores). Where the gate's own run folder exists
(``alpacafarm bench recipes/bench/gold.yaml ...`` was run here, as ``.ci/run`` does first) it is copied, so the split
and the labelled SFT samples are not made twice; without it they are made too."""

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


class SwapPlugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("swapped_reward_model", swapped_reward_model())


@pytest.mark.gate
def test_the_gate_fails_a_reward_model_that_learns_from_swapped_labels(register_test_plugin, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture):
    from alpacafarm.cli import main

    run = tmp_path / "run"
    if (GATE_RUN / "stages/preferences/manifest.json").is_file():
        shutil.copytree(GATE_RUN, run)
    register_test_plugin(SwapPlugin(), "swap-test")
    capsys.readouterr()
    code = main(["bench", str(RECIPE), "--baseline", str(BASELINE), "--output-dir", str(run), "--json",
                 "--set", "stages.reward_model.method=swapped_reward_model"])
    report = json.loads(capsys.readouterr().out)
    verdicts = {s["system"]: s for s in report["systems"]}
    assert code == 1 and report["verdict"] == "FAIL", report
    assert verdicts["best_of_8"]["verdict"] == "FAIL", verdicts["best_of_8"]
    assert verdicts["best_of_8"]["delta"] < -5  # not a marginal call: learning the wrong way round costs more
    assert verdicts["best_of_1"]["verdict"] == "PASS"  # a plain sample does not read the reward model
    manifest = json.loads((run / "stages/reward_model/manifest.json").read_text())
    assert manifest["method"] == "swapped_reward_model"  # the candidate really ran
