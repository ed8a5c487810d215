"""Typed hand-offs between stages (:mod:`alpacafarm.artifacts`), as a third-party plugin uses them.

The plugin below imports only the public contract (``alpacafarm.method``, ``alpacafarm.artifacts``,
``alpacafarm.testing``): a ``toy_policy`` stage hands on a model with its snapshots, a ``toy_systems`` stage
hands on one system of outputs per snapshot, and the built-in evaluation (judged by the gold annotator with a gold
function defined here) and the gate (``alpacafarm bench``) read them. A malformed hand-off fails its stage in one
line naming it, exit status 2.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import alpacafarm
from alpacafarm.artifacts import Artifact, Snapshot, System, Table
from alpacafarm.data import BUILTIN_DIR, read_records, write_jsonl
from alpacafarm.method import Method, StageContext
from alpacafarm.testing import save_tiny_causal_lm

N = 12  # instructions answered and judged
STEPS = (1, 2, 3)


def answer_length(records: Any, answers: Any) -> list[float]:
    """The gold: longer answers are better (a gold function anyone can read)."""
    return [float(len(a)) for a in answers]


class ToyPolicy(Method):
    """Hands on its final model and a snapshot at every step before it, each with its training reward."""

    requires = ()
    provides = "policy_model"
    produces = ("snapshots",)

    def run(self, context: StageContext) -> Artifact:
        folders = {step: context.stage_dir / ("model" if step == STEPS[-1] else f"step-{step}") for step in STEPS}
        for step, folder in folders.items():
            save_tiny_causal_lm(folder, seed=step)
        return Artifact("model", str(folders[STEPS[-1]]), {"note": "for people only"},
                        snapshots=[Snapshot(step, str(folder), train_reward=step / 10) for step, folder in
                                   folders.items()])


class ToySystems(Method):
    """One system of outputs per snapshot of its ``sft_model`` input: a later step answers at greater length."""

    requires = ("sft_model",)
    provides = "policy_outputs"
    produces = ("systems",)

    def run(self, context: StageContext) -> Artifact:
        records = read_records(BUILTIN_DIR / "alpaca_eval_sample.jsonl")[:N]
        systems = []
        for snapshot in context.input("sft_model").snapshots:
            path = context.stage_dir / f"step-{snapshot.step}.jsonl"
            write_jsonl(path, [{"instruction": r["instruction"], "input": r.get("input", ""),
                                "output": "word " * (4 * snapshot.step)} for r in records])
            systems.append(System(f"toy@{snapshot.step}", str(path), step=snapshot.step,
                                  train_reward=snapshot.train_reward, proxy_reward=float(snapshot.step),
                                  kl=0.5 * snapshot.step, kl_se=0.0))
        return Artifact("outputs", str(context.stage_dir), systems=systems,
                        table=Table("toy systems", ["system", "step"], [[s.name, s.step] for s in systems]))


@dataclass
class MalformedConfig:
    case: str


class Malformed(Method):
    """Returns the hand-off its config names, broken."""

    config_class = MalformedConfig
    requires = ()
    provides = "policy_outputs"
    produces = ("systems",)

    def run(self, context: StageContext) -> Artifact:
        outputs = context.stage_dir / "a.jsonl"
        write_jsonl(outputs, [{"instruction": "x", "input": "", "output": "y"}])
        broken = {
            "none": Artifact("outputs", str(context.stage_dir)),
            "missing_file": Artifact("outputs", str(context.stage_dir),
                                     systems=[System("a", str(outputs)), System("b", str(context.stage_dir / "b"))]),
            "twice": Artifact("outputs", str(context.stage_dir),
                              systems=[System("a", str(outputs)), System("a", str(outputs))]),
            "snapshot_folder": Artifact("outputs", str(context.stage_dir), systems=[System("a", str(outputs))],
                                        snapshots=[Snapshot(4, str(context.stage_dir / "nowhere"))]),
            "not_finite": Artifact("outputs", str(context.stage_dir),
                                   systems=[System("a", str(outputs), proxy_reward=float("nan"))]),
            "dict": Artifact("outputs", str(context.stage_dir), systems={"a": {"outputs": "a.jsonl"}}),
        }
        return broken[self.config.case]


class HandoffPlugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("toy_policy", ToyPolicy)
        register("toy_systems", ToySystems)
        register("malformed", Malformed)


@pytest.fixture
def handoff_plugin(register_test_plugin) -> None:
    register_test_plugin(HandoffPlugin(), "handoff-test")


def toy_recipe(tmp_path: Path) -> Path:
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(f"""
name: toy-handoffs
stages:
  - name: toy_policy
    method: toy_policy
  - name: toy
    method: toy_systems
    inputs: {{sft_model: toy_policy}}
evaluation:
  evaluator: win_rate
  policy: toy
  annotator: {{name: gold, config: {{gold: "{__name__}:answer_length", mode: threshold}}}}
  config: {{max_instructions: {N}}}
""")
    return recipe


def test_a_plugin_hands_snapshots_and_systems_to_the_evaluation_and_the_gate(handoff_plugin: None, tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture):
    from alpacafarm.cli import main
    from alpacafarm.testing import run_recipe

    run = run_recipe(toy_recipe(tmp_path), tmp_path / "run")
    stage = tmp_path / "run" / "stages"
    assert [(s.step, s.path) for s in run["toy_policy"].snapshots] == [
        (1, str(stage / "toy_policy/step-1")), (2, str(stage / "toy_policy/step-2")),
        (3, str(stage / "toy_policy/model"))]
    rows = json.loads((stage / "evaluate/results.json").read_text())["rows"]
    assert [(r["system"], r["step"], r["train_reward"], r["proxy_reward"], r["kl"]) for r in rows] == [
        (f"toy@{s}", s, s / 10, float(s), 0.5 * s) for s in STEPS]  # every declared figure reached the table
    win_rates = [r["win_rate"] for r in rows]
    assert win_rates == sorted(win_rates) and win_rates[-1] > win_rates[0]  # longer answers win under the gold
    assert [r["gold"] for r in rows] == [float(len("word " * (4 * s))) for s in STEPS]
    evaluation = run["evaluate"]
    assert [(j.name, j.stage, j.win_rate) for j in evaluation.judged] == [
        (r["system"], "toy", r["win_rate"]) for r in rows]
    assert [row[0] for row in evaluation.table.rows] == [f"toy@{s}" for s in STEPS]

    # The manifest keeps the hand-offs run-relative: a moved run directory reads them in their new place.
    manifest = json.loads((stage / "toy/manifest.json").read_text())
    assert manifest["artifact"]["systems"][0]["outputs"] == "${run_dir}/stages/toy/step-1.jsonl"
    assert "stages/toy/step-3.jsonl" in manifest["outputs"]
    moved = tmp_path / "moved"
    (tmp_path / "run").rename(moved)
    again = run_recipe(toy_recipe(tmp_path), moved)
    assert again["toy"].systems[2] == System("toy@3", str(moved / "stages/toy/step-3.jsonl"), step=3,
                                             train_reward=0.3, proxy_reward=3.0, kl=1.5, kl_se=0.0)
    assert again["toy_policy"].snapshots[0].path == str(moved / "stages/toy_policy/step-1")

    # The gate reads the evaluation's judged systems: a baseline of the three, then identical outputs pass.
    baseline = tmp_path / "baseline.json"
    capsys.readouterr()
    assert main(["bench", str(toy_recipe(tmp_path)), "--baseline", str(baseline), "--output-dir", str(moved),
                 "--update-baseline", "--allow-underpowered"]) == 0, capsys.readouterr().err
    assert sorted(json.loads(baseline.read_text())["systems"]) == [f"toy@{s}" for s in STEPS]
    capsys.readouterr()
    assert main(["bench", str(toy_recipe(tmp_path)), "--baseline", str(baseline), "--output-dir", str(moved),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "PASS" and [s["system"] for s in report["systems"]] == [f"toy@{s}" for s in STEPS]


@pytest.mark.parametrize("case,message", [
    ("none", r"whose systems is empty, though its method declares it \(Method.produces = \('systems',\)\)"),
    ("missing_file", r"whose systems\[1\] \('b'\): its outputs file .*/stages/bad/b does not exist"),
    ("twice", "whose system name 'a' appears twice"),
    ("snapshot_folder", r"whose snapshots\[0\] \(step 4\): .*/nowhere is not a model folder"),
    ("not_finite", r"whose systems\[0\] \('a'\) has proxy_reward nan: not a finite number"),
    ("dict", "whose systems must be a list of alpacafarm.artifacts.System, got dict"),
])
def test_a_malformed_handoff_fails_its_stage_in_one_line(handoff_plugin: None, tmp_path: Path, case: str,
                                                         message: str, capsys: pytest.CaptureFixture):
    from alpacafarm.cli import main

    recipe = tmp_path / "bad.yaml"
    recipe.write_text(f"name: bad\nstages:\n  - name: bad\n    method: malformed\n    config: {{case: {case}}}\n")
    assert main(["run", str(recipe), "--output-dir", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # the stage's start line, then one error line
    assert lines[:-1] == ["▶ bad (malformed)"] and lines[-1].startswith(
        "error: stage 'bad': method 'malformed' of plugin 'handoff-test' returned a outputs artifact "), lines
    assert lines[-1].endswith("; the stage is not recorded complete")
    assert re.search(message, lines[-1]), lines[-1]
    manifest = json.loads((tmp_path / "run/stages/bad/manifest.json").read_text())
    assert manifest["status"] == "running"  # never recorded complete


def test_a_method_declaring_an_unknown_handoff_is_refused_when_defined():
    with pytest.raises(TypeError, match=r"\.produces = \('system',\): it must be a tuple of files, systems, "):
        type("Typo", (Method,), {"produces": ("system",)})
