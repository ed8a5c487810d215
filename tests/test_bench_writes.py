"""Where ``alpacafarm bench`` may write (issue 61): one rule, checked before the benchmark runs.

The report and (with ``--update-baseline``) the baseline: not a symbolic link, not the same file as each other or
the recipe, an existing baseline only replaced when it is a baseline bench wrote, the folder made when missing and
writable. A refusal is one line naming the path, exit 2 (a user error), never the gate's FAIL (1), and nothing has
run: a refusal found after a 7-minute run would lose its verdict.

The benchmark itself is a stand-in here (:func:`stand_in`): these tests are about the files, not the gate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO_ROOT
from test_user_errors import one_error_line, permission_checked

from alpacafarm.errors import UserError
from alpacafarm_evaluation import bench
from alpacafarm_evaluation.bench_baseline import BenchRun, SystemOutcomes, baseline_json

README = "# My plugin\n\nHand-written notes: keep me.\n"


class StandInRun(BenchRun):
    """A finished benchmark run without a judge to re-ask (a new baseline keeps its probe)."""

    def reprobe(self) -> None:
        return None


def stand_in_run(recipe: str) -> StandInRun:
    """40 instructions of one system, half of them won: the same run every time (a PASS on identical outputs)."""
    keys = [f"i{k:02d}" for k in range(40)]
    system = SystemOutcomes("best_of_1", {k: float(i % 2) for i, k in enumerate(keys)},
                            {k: f"h{k}" for k in keys}, 50.0)
    return StandInRun(recipe=str(recipe), recipe_name="b", overrides=[], run_dir="run", systems={"best_of_1": system},
                      fingerprints={"judge": "j", "data": "d", "recipe": "r"},
                      judge={"annotator": {"name": "offline"}, "probe_labels": []}, protocol={}, probe=[],
                      versions={}, plugin_versions={}, seconds=0.0)


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A recipe and its baseline in a working directory of their own, and a stand-in benchmark that counts its
    runs (``ran``)."""
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "bench.yaml"
    recipe.write_text("name: b\n", encoding="utf-8")
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(baseline_json(stand_in_run(str(recipe)), 5.0, 0.05, 0.8)), encoding="utf-8")
    ran: list[str] = []

    def stand_in(recipe: str, overrides: list[str], output_dir: str | None, probe: Any = None,
                 force: bool = False) -> BenchRun:
        ran.append(recipe)
        return stand_in_run(recipe)

    monkeypatch.setattr(bench, "run_benchmark", stand_in)
    monkeypatch.setattr("alpacafarm.library_logs.route_library_output", lambda verbose=False: None)
    return {"root": tmp_path, "recipe": recipe, "baseline": baseline, "ran": ran}


def refused(work: dict[str, Any], *args: str) -> str:
    """The one-line refusal of ``bench RECIPE ARGS``, after checking that the benchmark never ran."""
    with pytest.raises(UserError) as caught:
        bench.main([str(work["recipe"]), *args])
    assert work["ran"] == [], "the benchmark ran before the write was refused"
    message = str(caught.value)
    assert "\n" not in message and caught.value.exit_code == 2
    return message


def snapshot(*paths: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in paths}


# ------------------------------------------------------------------------------- files bench did not write


@pytest.mark.parametrize("content", [README, "name: other-recipe\nstages: []\n", '{"a": 1}\n', ""],
                         ids=["readme", "recipe", "other-json", "empty"])
def test_update_baseline_never_overwrites_a_file_that_is_not_a_baseline(work: dict[str, Any], content: str):
    """It used to print one yellow line ('... it is replaced') and write the baseline over it."""
    target = work["root"] / "README.md"
    target.write_text(content, encoding="utf-8")
    message = refused(work, "--baseline", "README.md", "--update-baseline", "--allow-underpowered")
    assert "README.md" in message and "replaces only a baseline bench wrote" in message, message
    assert target.read_text(encoding="utf-8") == content


def test_update_baseline_onto_the_recipe_itself_is_refused(work: dict[str, Any]):
    before = snapshot(work["recipe"])
    message = refused(work, "--baseline", str(work["recipe"]), "--update-baseline", "--allow-underpowered")
    assert "is the same file as the recipe" in message, message
    assert snapshot(work["recipe"]) == before


@pytest.mark.parametrize("how", ["same-name", "other-spelling", "hard-link"])
def test_a_report_that_is_the_baseline_is_refused(work: dict[str, Any], how: str):
    """``--report X --baseline X`` wrote the Markdown report over the baseline."""
    report = {"same-name": "baseline.json", "other-spelling": "sub/../baseline.json", "hard-link": "linked.json"}[how]
    (work["root"] / "sub").mkdir()
    if how == "hard-link":
        os.link(work["baseline"], work["root"] / "linked.json")
    before = snapshot(work["baseline"])
    message = refused(work, "--baseline", "baseline.json", "--report", report)
    assert f"--report {report} is the same file as --baseline baseline.json" in message, message
    assert snapshot(work["baseline"]) == before


def test_a_report_that_is_the_recipe_is_refused(work: dict[str, Any]):
    before = snapshot(work["recipe"])
    message = refused(work, "--baseline", "baseline.json", "--report", "bench.yaml")
    assert "is the same file as the recipe" in message, message
    assert snapshot(work["recipe"]) == before


# ------------------------------------------------------------------------------------------ symbolic links


@pytest.mark.parametrize("where", ["the file", "its folder"])
def test_a_report_through_a_symbolic_link_is_refused_and_its_target_untouched(work: dict[str, Any], where: str):
    """A link committed in a pull request (``gate.md -> ~/.bashrc``, ``reports -> /etc``) sent CI's report into
    its target."""
    elsewhere = work["root"] / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "gate.md"
    target.write_text(README, encoding="utf-8")
    if where == "the file":
        (work["root"] / "gate.md").symlink_to(target)
        report = "gate.md"
    else:
        (work["root"] / "reports").symlink_to(elsewhere, target_is_directory=True)
        report = "reports/gate.md"
    message = refused(work, "--baseline", "baseline.json", "--report", report)
    assert f"--report {report}" in message and "symbolic link" in message, message
    assert target.read_text(encoding="utf-8") == README


def test_a_baseline_that_is_a_symbolic_link_is_not_replaced(work: dict[str, Any]):
    """``--update-baseline`` onto a link to a valid baseline elsewhere: the link is refused, nothing written."""
    (work["root"] / "link.json").symlink_to(work["baseline"])
    before = snapshot(work["baseline"])
    message = refused(work, "--baseline", "link.json", "--update-baseline", "--allow-underpowered")
    assert "--baseline link.json is a symbolic link" in message, message
    assert snapshot(work["baseline"]) == before and (work["root"] / "link.json").is_symlink()


# ------------------------------------------------------------------------------------------ folders


def test_a_report_in_a_missing_folder_is_written_after_the_verdict(work: dict[str, Any]):
    """It used to be a traceback (FileNotFoundError) and exit 1, the gate's FAIL, after the whole run."""
    status = bench.main([str(work["recipe"]), "--baseline", "baseline.json", "--report", "new/deeper/gate.md"])
    assert status == 0 and work["ran"]  # identical outputs: PASS
    assert (work["root"] / "new/deeper/gate.md").read_text(encoding="utf-8").startswith("## ✅ alpacafarm bench: PASS")


def test_a_baseline_bench_wrote_is_replaced_and_a_new_one_goes_in_a_new_folder(work: dict[str, Any]):
    """What the rule allows still works: replacing a real baseline, and a first baseline in a new folder."""
    assert bench.main([str(work["recipe"]), "--baseline", "baseline.json", "--update-baseline",
                       "--allow-underpowered", "--report", "gate.md"]) == 0
    assert json.loads(work["baseline"].read_text(encoding="utf-8"))["format"] == "alpacafarm-bench-baseline/1"
    assert (work["root"] / "gate.md").is_file() and not (work["root"] / "gate.md").is_symlink()
    assert bench.main([str(work["recipe"]), "--baseline", "baselines/new.json", "--update-baseline",
                       "--allow-underpowered"]) == 0
    assert (work["root"] / "baselines/new.json").is_file()
    assert not [p for p in work["root"].rglob("*") if ".tmp" in p.name or "write-check" in p.name]


def test_a_file_in_the_way_of_the_report_folder_is_refused_before_the_run(work: dict[str, Any]):
    (work["root"] / "taken").write_text("a file\n", encoding="utf-8")
    message = refused(work, "--baseline", "baseline.json", "--report", "taken/gate.md")
    assert "taken is a file, not a directory" in message, message


#: ``alpacafarm bench`` through the real command line, its benchmark a stand-in that says it ran and crashes (exit
#: 5): a refusal must come first, as exit 2.
DRIVER = """
import sys
from alpacafarm_evaluation import bench
def ran(*args, **kwargs):
    raise RuntimeError("the benchmark ran before the write was refused")
bench.run_benchmark = ran
from alpacafarm.cli import main
sys.exit(main(["bench", *sys.argv[1:]]))
"""


def bench_cli(cwd: Path, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}, timeout=300)


@pytest.mark.parametrize("which", ["--report", "--baseline"])
def test_a_read_only_folder_is_one_line_before_the_run(work: dict[str, Any], which: str):
    """A read-only report or baseline folder was found only when the report was written, after the run."""
    prefix = permission_checked()
    folder = work["root"] / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        args = (["--baseline", "baseline.json", "--report", "ro/gate.md"] if which == "--report" else
                ["--baseline", "ro/new.json", "--update-baseline", "--allow-underpowered"])
        result = bench_cli(work["root"], str(work["recipe"]), *args, prefix=prefix)
        path = "ro/gate.md" if which == "--report" else "ro/new.json"
        one_error_line(result, f"cannot write {which} {path}", "permission denied")
    finally:
        folder.chmod(0o755)
    assert list(folder.iterdir()) == []


def test_a_refused_report_through_the_command_line_is_exit_2_in_one_line(work: dict[str, Any]):
    (work["root"] / "gate.md").symlink_to(work["root"] / "elsewhere.md")
    result = bench_cli(work["root"], str(work["recipe"]), "--baseline", "baseline.json", "--report", "gate.md")
    one_error_line(result, "--report gate.md is a symbolic link")
    assert not (work["root"] / "elsewhere.md").exists()
