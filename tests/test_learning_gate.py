"""The gate sees a trained method stop learning (issue: learning you can see).

In the gold-preference world every gated method beats the SFT model by far more than the gate's minimum detectable
effect (benchmarks/baselines/learning.json), so a DPO whose learning rate is 0 — the SFT model again, under a new
name — falls back to the SFT win-rate and FAILs, while the unchanged recipe PASSes (its outputs are identical to
the baseline's on the machine that wrote it, else the paired test decides). Real SmolLM2 runs: the ``gate`` tier,
which ``.ci/run`` runs right after the gate itself, in the gate's run folder, so only DPO and what follows it run
again here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/bench/learning.yaml"
BASELINE = "benchmarks/baselines/learning.json"


def bench(*overrides: str) -> tuple[int, dict]:
    command = [sys.executable, "-m", "alpacafarm", "bench", RECIPE, "--baseline", BASELINE, "--json"]
    for override in overrides:
        command += ["--set", override]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3000)
    assert done.stdout.strip(), done.stderr[-2000:]
    return done.returncode, json.loads(done.stdout)


@pytest.mark.gate
def test_the_gate_fails_a_dpo_that_stops_learning_and_passes_it_unchanged():
    code, report = bench("stages.dpo.config.learning_rate=0")
    verdicts = {row["system"]: row["verdict"] for row in report["systems"]}
    assert code == 1 and report["verdict"] == "FAIL", report
    assert verdicts["dpo_outputs"] == "FAIL"
    assert verdicts["best_of_8"] == "PASS" and verdicts["ppo_outputs"] == "PASS"  # untouched: identical outputs
    code, report = bench()
    assert code == 0 and report["verdict"] == "PASS", report
