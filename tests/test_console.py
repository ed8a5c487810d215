"""A quiet console: ``alpacafarm run`` redirected shows stage lines, one progress line per loop (with the training
loss), and the tables last; library load reports, warnings, progress bars and the Trainer's log dicts go to the
run's ``run.log`` (``-v`` shows them on the console too)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli

#: A tiny run with every kind of noise: a classifier loaded from a causal LM (a load report), two TRL trainers
#: (reward model, expert iteration's SFT: loss dicts, pin_memory warnings, datasets "Map" bars), sampling,
#: judging, and an evaluation of two systems (the results table).
RECIPE = """
name: tiny-console
seed: 3
model: {{name: {model}, dtype: float32, device: cpu}}
data:
  instructions: {{builtin: alpaca_eval_sample, limit: 14}}
annotator: offline_ann
stages:
  - name: split
    method: split_instructions
    config: {{eval_size: 4}}
  - name: preferences
    method: preference_data
    config: {{k: 2, sampling: {{temperature: 1.0, max_new_tokens: 8, batch_size: 10}}}}
  - name: reward_model
    method: reward_model
    config: {{max_steps: 2, per_device_train_batch_size: 4, learning_rate: 1.0e-3, eval_fraction: 0.2,
              logging_steps: 1, save_strategy: 'no'}}
  - name: outputs
    method: generate_outputs
    config: {{sampling: {{temperature: 0.7, max_new_tokens: 8, batch_size: 4}}}}
  - name: expert_iteration
    method: expert_iteration
    config: {{n: 2, rounds: 1, max_new_tokens: 8, generation_batch_size: 5, max_steps: 2,
              per_device_train_batch_size: 4, learning_rate: 1.0e-3, logging_steps: 1, save_strategy: 'no'}}
  - name: expert_iteration_outputs
    method: generate_outputs
    inputs: {{sft_model: expert_iteration}}
    config: {{sampling: {{temperature: 0.7, max_new_tokens: 8, batch_size: 4}}}}
evaluation:
  annotator: offline
  policy: [outputs, expert_iteration_outputs]
"""
RESULTS_TITLE = "win-rate vs"
#: What libraries would print: transformers' weight-loading bar and load report, a torch warning, the Trainer's
#: printed log dicts, any tqdm bar ("100%|####| 2/2 [00:01<00:00, 1.5it/s]"), datasets' "Map" bars.
LIBRARY_NOISE = {
    "loading bar": re.compile(r"Loading weights"),
    "load report": re.compile(r"LOAD REPORT"),
    "pin_memory warning": re.compile(r"pin_memory"),
    "Trainer log dict": re.compile(r"\{'loss': "),
    "tqdm bar": re.compile(r"\d+%\|.*\| *\d+/\d+ \[|it/s\]|s/it\]"),
    "datasets bar": re.compile(r"^\s*Map\b", re.MULTILINE),
}
#: A progress line of ours, as rich writes it when redirected: "description ━━━━ 3/4 0:00:01 0:00:00 loss 0.69".
PROGRESS_LINE = re.compile(r"^[^┃│┏┡└\s].* [━╸╺]+ +\d+/(\d+|\?) ")
SCREEN = 40


def run(recipe: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """``alpacafarm run`` in a fresh process with stdout and stderr redirected to pipes (not a terminal)."""
    result = run_cli("run", str(recipe), "--output-dir", str(run_dir), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def recipe(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("console") / "recipe.yaml"
    path.write_text(RECIPE.format(model=tiny_model_dir), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def quiet(recipe: Path) -> dict:
    run_dir = recipe.parent / "quiet"
    result = run(recipe, run_dir)
    return {"stdout": result.stdout, "stderr": result.stderr, "log": (run_dir / "run.log").read_text("utf-8")}


@pytest.fixture(scope="module")
def verbose(recipe: Path) -> dict:
    run_dir = recipe.parent / "verbose"
    result = run(recipe, run_dir, "-v")
    return {"console": result.stdout + result.stderr, "log": (run_dir / "run.log").read_text("utf-8")}


@pytest.mark.slow
def test_redirected_output_has_no_library_noise_and_no_colour_codes(quiet: dict):
    console = quiet["stdout"] + quiet["stderr"]
    found = {name: pattern.search(console).group(0) for name, pattern in LIBRARY_NOISE.items()
             if pattern.search(console)}
    assert found == {}, console
    assert "\x1b[" not in console
    assert quiet["stdout"].strip() == ""  # everything of ours is on stderr; nothing of the libraries anywhere


@pytest.mark.slow
def test_each_training_run_is_one_progress_line_with_its_loss(quiet: dict):
    """Redirected, a run's line is written as it goes (each tenth of its steps), the last time when it ends."""
    training: dict[str, list[str]] = {}
    for line in quiet["stderr"].splitlines():
        if PROGRESS_LINE.match(line) and " loss " in line:
            training.setdefault(re.split(r" [━╸╺]", line)[0], []).append(line)
    # the reward model and expert iteration's SFT round, each at step 1 and at its end
    assert sorted(training) == ["round 1: SFT on the winners", "training (reward model)"], quiet["stderr"]
    assert all([re.search(r" (\d)/2 .* loss \d", line)[1] for line in run] == ["1", "2"] for run in training.values())


@pytest.mark.slow
def test_the_results_table_is_the_last_block_and_it_all_fits_on_a_screen(quiet: dict):
    lines = [line for line in quiet["stderr"].splitlines() if line.strip()]
    title = max(i for i, line in enumerate(lines) if RESULTS_TITLE in line)
    # the title (with the held-out looks caption) may wrap onto a second line, never more
    top = next(i for i in range(title, len(lines)) if lines[i].lstrip().startswith("┏"))
    assert top - title <= 2, lines[title:top]
    assert all(line.lstrip()[0] in "┏┃┡│└" for line in lines[top:]), lines[title:]
    assert any("expert_i" in line for line in lines[title:])  # the table's rows, not just its title
    assert any(line.startswith("run directory:") for line in lines[:title])
    other = [line for line in lines if not PROGRESS_LINE.match(line)]
    assert len(other) <= SCREEN, "\n".join(other)


@pytest.mark.slow
def test_what_the_console_leaves_out_is_in_the_run_log(quiet: dict):
    log = quiet["log"]
    assert "LOAD REPORT" in log and "pin_memory" in log
    assert re.search(r"stage reward_model: step 1: \{\"loss\": ", log)
    assert re.search(r"stage expert_iteration: step 2: \{\"loss\": ", log)
    assert "[transformers." in log and "[py.warnings]" in log  # the library is named
    assert "\x1b[" not in log


@pytest.mark.slow
def test_verbose_shows_library_reports_warnings_and_bars_on_the_console(verbose: dict):
    console = verbose["console"]
    assert "LOAD REPORT" in console and "pin_memory" in console and "Loading weights" in console
    assert "\x1b[" not in console  # redirected: plain text, even in what the libraries colour
    assert "LOAD REPORT" in verbose["log"]


def test_library_records_from_before_the_run_log_exists_are_written_to_it(tmp_path: Path):
    """Records that come while no run log is attached (imports, recipe loading) wait for it, in order."""
    import sys

    code = """
import logging, sys, warnings
from alpacafarm.library_logs import route_library_output
route_library_output()
route_library_output()  # idempotent: still one handler each
logging.getLogger("transformers.modeling_utils").warning("\\x1b[1mearly\\x1b[0m report")
warnings.warn("early warning")
run = logging.getLogger("alpacafarm")
run.addHandler(logging.FileHandler(sys.argv[1]))
run.warning("the run starts")
logging.getLogger("peft").warning("late")
assert len(logging.getLogger("transformers").handlers) == 1, logging.getLogger("transformers").handlers
"""
    log = tmp_path / "run.log"
    result = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout + result.stderr == ""
    lines = [line for line in log.read_text("utf-8").splitlines() if line.strip()]
    assert lines[0] == "[transformers.modeling_utils] early report"  # colour codes stripped, the library named
    assert lines[1].startswith("[py.warnings] ") and "early warning" in lines[1]
    assert lines[2:] == ["the run starts", "[peft] late"]
