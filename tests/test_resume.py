"""Resume without traps: half-written checkpoints are skipped, lost or changed outputs re-run their stage,
a copied run directory resumes in its new place, and ``alpacafarm run --plan`` says what a run would do."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

import alpacafarm
from alpacafarm.cli import main
from alpacafarm.data import write_json
from alpacafarm.manifest import record_outputs
from alpacafarm.method import Artifact, Method, StageContext
from alpacafarm.pipeline import Pipeline
from alpacafarm.plugins import get_registry
from alpacafarm.recipe import load_recipe
from alpacafarm.testing import run_recipe, write_records
from alpacafarm.training import resume_checkpoint

# ------------------------------------------------------------------------------------------ checkpoints


def _checkpoint(stage_dir: Path, step: int, *, weights: str = "model.safetensors") -> Path:
    import torch
    from safetensors.torch import save_file

    path = stage_dir / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if weights == "model.safetensors":
        save_file({"w": torch.ones(4, 4) * step}, str(path / weights))
    else:  # a torch-pickled layout (accelerate's save_state without safetensors)
        torch.save({"w": torch.ones(4, 4) * step}, path / weights)
    torch.save({"state": {}, "param_groups": []}, path / "optimizer.pt")
    write_json(path / "trainer_state.json", {"global_step": step, "log_history": []})
    return path


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _context(stage_dir: Path) -> SimpleNamespace:
    return SimpleNamespace(resuming=True, stage_dir=stage_dir, stage="sft", logger=logging.getLogger("alpacafarm"))


def test_half_written_checkpoints_are_skipped_with_one_warning_each(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    stage = tmp_path / "stage"
    _checkpoint(stage, 2)
    _checkpoint(stage, 3, weights="pytorch_model.bin")  # a torch-pickled checkpoint is readable too
    (_checkpoint(stage, 4) / "trainer_state.json").unlink()  # died before the trainer state (written last)
    _truncate(_checkpoint(stage, 6) / "model.safetensors")
    _truncate(_checkpoint(stage, 8) / "optimizer.pt")
    (_checkpoint(stage, 10) / "trainer_state.json").write_text('{"global_step": 1')
    (stage / "checkpoint-12").mkdir()  # an empty folder: "Can't find a valid checkpoint" before
    with caplog.at_level(logging.WARNING, logger="alpacafarm"):
        assert resume_checkpoint(_context(stage)) == str(stage / "checkpoint-3")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 5 and all("\n" not in w and w.endswith("resuming from checkpoint-3") for w in warnings)
    reasons = "\n".join(warnings)
    for expected in ("checkpoint-12 (no trainer_state.json)", "checkpoint-10 (trainer_state.json is unreadable",
                     "checkpoint-8 (optimizer.pt is truncated", "checkpoint-6 (model.safetensors is truncated)",
                     "checkpoint-4 (no trainer_state.json)"):
        assert expected in reasons
    assert sorted(p.name for p in stage.iterdir())[:2] == ["checkpoint-10", "checkpoint-12"]  # nothing deleted

    for good in ("checkpoint-2", "checkpoint-3"):
        (stage / good / "trainer_state.json").unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="alpacafarm"):
        assert resume_checkpoint(_context(stage)) is None  # nothing readable: a fresh start
    assert all(r.getMessage().endswith("starting from scratch") for r in caplog.records)


def test_sft_resumes_from_the_previous_checkpoint_when_the_last_is_half_written(
        tiny_model_dir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture):
    data = write_records(tmp_path / "sft.jsonl", [{"instruction": f"Say {i}.", "output": f"It is {i}."}
                                                  for i in range(12)])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: sft-resume\nmodel: {{name: {tiny_model_dir}}}\ndata:\n  sft_data: {{path: {data}}}\n"
                      "stages:\n  - {name: sft, method: sft, config: {max_steps: 6, per_device_train_batch_size: 4,"
                      " learning_rate: 1.0e-3, logging_steps: 1, save_strategy: steps, save_steps: 3}}\n")
    run_recipe(recipe, tmp_path / "run")
    stage = tmp_path / "run/stages/sft"
    # The attempt died while writing checkpoint-6: half its weights, no optimizer, no trainer state.
    for name in ("trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (stage / "checkpoint-6" / name).unlink(missing_ok=True)
    _truncate(stage / "checkpoint-6/model.safetensors")
    shutil.rmtree(stage / "model")
    manifest = json.loads((stage / "manifest.json").read_text())
    (stage / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))
    with caplog.at_level(logging.WARNING, logger="alpacafarm"):
        artifact = run_recipe(recipe, tmp_path / "run")["sft"]
    assert any("skipping unreadable checkpoint checkpoint-6 (no trainer_state.json); resuming from checkpoint-3"
               in r.getMessage() for r in caplog.records)
    history = json.loads((stage / "metrics.json").read_text())["log_history"]
    assert artifact.metadata["steps"] == 6 and [e["step"] for e in history if "loss" in e][-3:] == [4, 5, 6]
    assert (stage / "model/model.safetensors").is_file()


# ------------------------------------------------------------------------- outputs, copied run directories

CALLS: list[str] = []


class CountLines(Method):
    """Counts the split's lines; its metadata names its file by absolute path (as evaluators' ``results`` do)."""

    requires = ("instruction_splits",)
    provides = "counts"

    def run(self, context: StageContext) -> Artifact:
        CALLS.append(context.stage)
        counts = {"train": len(context.records("instruction_splits", "train"))}
        write_json(context.stage_dir / "counts.json", counts)
        return Artifact("report", str(context.stage_dir / "counts.json"),
                        {**counts, "files": {"json": str(context.stage_dir / "counts.json")}})


class Summary(Method):
    requires = ("policy",)
    provides = "evaluation"

    def run(self, context: StageContext) -> Artifact:
        CALLS.append(context.stage)
        return Artifact("evaluation", None, {"train": context.input("policy").metadata["train"]})


class ResumePlugin:
    @alpacafarm.hookimpl
    def register_methods(self, register):
        register("count_lines", CountLines)

    @alpacafarm.hookimpl
    def register_evaluators(self, register):
        register("summary", Summary)


@pytest.fixture
def recipe(tmp_path: Path, register_test_plugin) -> Path:
    register_test_plugin(ResumePlugin(), "resume-test")
    CALLS.clear()
    data = write_records(tmp_path / "data" / "instructions.jsonl", [{"instruction": f"Task {i}."} for i in range(8)])
    path = tmp_path / "recipe.yaml"
    path.write_text(f"name: resume\ndata:\n  instructions: {{path: {data}}}\n"
                    "stages:\n  - {name: split, method: split_instructions, config: {eval_size: 2}}\n"
                    "  - {name: count, method: count_lines}\n"
                    "evaluation: {evaluator: summary}\n")
    return path


def statuses(recipe: Path, run_dir: Path, *overrides: str) -> dict[str, str]:
    outcomes = Pipeline(load_recipe(recipe, list(overrides)), get_registry(), run_dir).run()
    return {o.name: o.status for o in outcomes}


ALL_SKIPPED = {"split": "skipped", "count": "skipped", "evaluate": "skipped"}
ALL_RAN = {"split": "ran", "count": "ran", "evaluate": "ran"}


def test_a_deleted_output_reruns_its_stage_and_what_depends_on_it(recipe: Path, tmp_path: Path):
    run = tmp_path / "run"
    assert statuses(recipe, run) == ALL_RAN
    manifest = json.loads((run / "stages/split/manifest.json").read_text())
    assert manifest["format"] == 3 and set(manifest["outputs"]) == {"stages/split/train.jsonl",
                                                                     "stages/split/eval.jsonl"}
    assert set(manifest["outputs"]["stages/split/train.jsonl"]) == {"size", "mtime_ns", "sha256"}
    (run / "stages/split/train.jsonl").unlink()
    CALLS.clear()
    assert statuses(recipe, run) == ALL_RAN  # no --force needed; downstream re-runs because its input changed
    assert CALLS == ["count", "evaluate"] and (run / "stages/split/train.jsonl").is_file()
    assert statuses(recipe, run) == ALL_SKIPPED

    (run / "stages/count/counts.json").unlink()  # a middle stage: only it and what follows re-run
    assert statuses(recipe, run) == {"split": "skipped", "count": "ran", "evaluate": "ran"}


def test_a_changed_output_reruns_but_a_touched_one_does_not(recipe: Path, tmp_path: Path):
    run = tmp_path / "run"
    statuses(recipe, run)
    counts = run / "stages/count/counts.json"
    text = counts.read_text()
    os.utime(counts, ns=(1_000_000_000, 1_000_000_000))  # same content, another mtime: hashed once, still intact
    assert statuses(recipe, run) == ALL_SKIPPED
    recorded = json.loads((run / "stages/count/manifest.json").read_text())["outputs"]["stages/count/counts.json"]
    assert recorded["mtime_ns"] == 1_000_000_000  # the new mtime is kept: the next check needs no hash
    counts.write_text(text.replace("6", "7"))  # same size, other content
    assert statuses(recipe, run) == {"split": "skipped", "count": "ran", "evaluate": "ran"}


def test_checkpoints_of_a_finished_stage_are_not_outputs(recipe: Path, tmp_path: Path):
    run = tmp_path / "run"
    statuses(recipe, run)
    checkpoint = run / "stages/split/checkpoint-5"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")
    manifest = json.loads((run / "stages/split/manifest.json").read_text())
    # recorded again with the checkpoint in the stage folder: the same outputs
    assert set(record_outputs(Artifact.from_json(manifest["artifact"], run), run)) == set(manifest["outputs"])
    assert statuses(recipe, run) == ALL_SKIPPED
    shutil.rmtree(checkpoint)
    assert statuses(recipe, run) == ALL_SKIPPED


@pytest.mark.parametrize("copy_function", [shutil.copy2, shutil.copy], ids=["times-kept", "times-reset"])
def test_a_copied_run_directory_resumes_in_its_new_place(recipe: Path, tmp_path: Path, copy_function):
    old, new = tmp_path / "old", tmp_path / "elsewhere" / "new"
    statuses(recipe, old)
    shutil.copytree(old, new, copy_function=copy_function)
    shutil.rmtree(old)
    CALLS.clear()
    outcomes = {o.name: o for o in Pipeline(load_recipe(recipe), get_registry(), new).run()}
    assert {name: o.status for name, o in outcomes.items()} == ALL_SKIPPED and CALLS == []
    count = outcomes["count"].artifact
    assert count.path == str(new / "stages/count/counts.json")
    assert count.metadata["files"]["json"] == str(new / "stages/count/counts.json")  # metadata paths too
    assert outcomes["split"].artifact.path == str(new / "stages/split")
    for manifest in new.glob("stages/*/manifest.json"):
        assert str(old) not in manifest.read_text()
    saved = json.loads((new / "stages/count/manifest.json").read_text())["artifact"]
    assert saved["path"] == "stages/count/counts.json" and saved["path_base"] == "run_dir"
    assert saved["metadata"]["files"]["json"] == "${run_dir}/stages/count/counts.json"
    assert not old.exists()


def test_a_complete_manifest_without_outputs_reruns_its_stage(recipe: Path, tmp_path: Path):
    run = tmp_path / "run"
    statuses(recipe, run)
    path = run / "stages/split/manifest.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "outputs"}))
    assert statuses(recipe, run) == ALL_RAN  # nothing says its files are intact: never skipped on trust
    assert "stages/split/train.jsonl" in json.loads(path.read_text())["outputs"]


# ------------------------------------------------------------------------------------------------- --plan


def plan(recipe: Path, run_dir: Path, capsys: pytest.CaptureFixture, *args: str) -> dict[str, tuple[str, str]]:
    assert main(["run", str(recipe), "--output-dir", str(run_dir), "--plan", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("plan for recipe 'resume'")
    rows = {}
    for line in lines[1:-1]:
        name, action, reason = line.split(maxsplit=2)
        rows[name] = (action, reason)
    rows["summary"] = ("", lines[-1])
    return rows


def test_plan_of_a_fresh_run_runs_everything_and_writes_nothing(recipe: Path, tmp_path: Path, capsys):
    rows = plan(recipe, tmp_path / "run", capsys)
    assert rows == {"split": ("run", "never run"), "count": ("run", "never run"),
                    "evaluate": ("run", "never run"), "summary": ("", "3 of 3 stage(s) would run")}
    assert not (tmp_path / "run").exists() and CALLS == []


def test_plan_of_a_finished_run_skips_everything(recipe: Path, tmp_path: Path, capsys):
    run = tmp_path / "run"
    statuses(recipe, run)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    rows = plan(recipe, run, capsys)
    assert {n: r for n, r in rows.items() if n != "summary"} == {
        n: ("skip", "unchanged, outputs intact") for n in ("split", "count", "evaluate")}
    assert rows["summary"][1] == "nothing to do: every stage is skipped"
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before  # nothing written, not even run.log


def test_plan_after_a_config_change_shows_the_stage_and_downstream_rerunning(recipe: Path, tmp_path: Path, capsys):
    run = tmp_path / "run"
    statuses(recipe, run)
    rows = plan(recipe, run, capsys, "--set", "stages.split.config.eval_size=3")
    assert rows["split"] == ("run", "fingerprint changed: config")
    assert rows["count"] == ("run", "fingerprint changed: input instruction_splits (stage 'split' re-runs)")
    assert rows["evaluate"] == ("run", "fingerprint changed: input policy (stage 'count' re-runs)")
    assert CALLS == ["count", "evaluate"]  # from the first run only: the plan ran nothing

    rows = plan(recipe, run, capsys, "--force", "count")
    assert rows["split"][0] == "skip" and rows["count"] == ("run", "forced (--force)")
    assert rows["evaluate"] == ("run", "fingerprint changed: input policy (stage 'count' re-runs)")

    (run / "stages/split/eval.jsonl").unlink()
    write_records(tmp_path / "data" / "instructions.jsonl", [{"instruction": f"Job {i}."} for i in range(8)])
    rows = plan(recipe, run, capsys)
    assert rows["split"] == ("run", "fingerprint changed: input instructions (from 'instructions')")
    write_records(tmp_path / "data" / "instructions.jsonl", [{"instruction": f"Task {i}."} for i in range(8)])
    rows = plan(recipe, run, capsys)
    assert rows["split"] == ("run", "outputs missing: stages/split/eval.jsonl")
    assert rows["summary"][1] == "3 of 3 stage(s) would run"
    # What the plan says is what a run does.
    assert statuses(recipe, run, "stages.split.config.eval_size=2") == ALL_RAN
