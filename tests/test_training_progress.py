"""One progress line for every trainer (issue 42): steps done of the total, elapsed, remaining, and the loss or the
reward, from :class:`~alpacafarm.training_progress.StageProgress`. Redirected output (a file, a pipe, ``nohup``)
gets the line as it goes, not only when the loop ends: a GRPO stage of 6 steps used to show only its header
for 15 minutes. Here stderr is captured (not a terminal), so every line below is what a redirected run writes."""

from __future__ import annotations

import io
import logging
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from alpacafarm.testing import learnable_preferences, run_recipe, write_records

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: A progress line: "description ━━━╸   3/6 0:00:01 0:00:02 loss 0.69 reward 1.2" (the bar may be short).
LINE = re.compile(r"^(?P<description>\S.*?) [━╸╺ ]+ +(?P<done>\d+)/(?P<total>\d+|\?) (?P<elapsed>\d+:\d\d:\d\d)"
                  r" *(?P<remaining>\d+:\d\d:\d\d|-:--:--)? *(?P<status>.*?) *$")  # no remaining without a total
#: What the rule reward writes to stderr each time GRPO scores a batch of completions.
MARK = "[scoring batch {}]"
_calls = {"n": 0}


def marked_length(records: list[dict[str, Any]], completions: list[str]) -> list[float]:
    """A rule reward (completion length) that marks each of its calls on stderr, between the progress lines."""
    _calls["n"] += 1
    sys.stderr.write(MARK.format(_calls["n"]) + "\n")
    sys.stderr.flush()
    return [float(len(c)) for c in completions]


def answer_length(records: list[dict[str, Any]], answers: list[str]) -> list[float]:
    """The gold score online DPO's annotator labels by (Bradley-Terry samples: no ties)."""
    return [float(len(a)) for a in answers]


def lines(text: str, description: str) -> list[re.Match]:
    return [m for m in map(LINE.match, text.splitlines()) if m and m["description"] == description]


# ------------------------------------------------------------------------------------------------ the line itself


def test_a_redirected_line_is_written_at_each_tenth_as_it_goes(capsys: pytest.CaptureFixture):
    from alpacafarm.console import progress_bar

    with progress_bar("loop", 20) as line:
        for i in range(1, 21):
            line()
            if i == 10:
                sys.stderr.write("halfway\n")
    err = capsys.readouterr().err
    assert [int(m["done"]) for m in lines(err, "loop")] == list(range(2, 21, 2)), err
    assert err.index("10/20") < err.index("halfway") < err.index("12/20")  # written then, not when it ended


def test_a_line_without_a_total_is_written_every_echo_seconds(capsys: pytest.CaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch):
    from alpacafarm import console

    monkeypatch.setattr(console, "ECHO_SECONDS", 0.0)
    with console.progress_bar("features", None) as line:
        line(3)
        line.update(status="half")  # no step: nothing new to write
        line(2)
    assert [(m["done"], m["total"]) for m in lines(capsys.readouterr().err, "features")] == [
        ("3", "?"), ("5", "?"), ("5", "?")]  # the last one is the line's end


def test_a_loop_of_its_own_shows_the_same_line_and_logs_its_entries(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture,
                                                                    caplog: pytest.LogCaptureFixture):
    """The API for a trainer without trainer callbacks (Quark's own loop): ``loop_progress`` + ``advance``."""
    from alpacafarm.method import StageContext
    from alpacafarm.training_progress import loop_progress

    context = StageContext(stage="quark", stage_dir=tmp_path, run_dir=tmp_path, seed=0, inputs={}, recipe=None,
                           registry=None)
    with caplog.at_level(logging.INFO, logger="alpacafarm"), \
            loop_progress(context, "training (Quark)", 4, start=1) as progress:
        progress.advance(2, {"loss": 0.5, "reward": 1.25, "total_flos": 9})
        progress.advance(3)  # a step that logs nothing
        progress.advance(4, {"loss": 0.25, "score": 3.0})
    shown = [(m["done"], m["total"], m["status"]) for m in lines(capsys.readouterr().err, "training (Quark)")]
    assert shown == [("1", "4", ""), ("2", "4", "loss 0.5 reward 1.25"), ("3", "4", "loss 0.5 reward 1.25"),
                     ("4", "4", "loss 0.25 score 3")]
    assert [r.getMessage() for r in caplog.records] == ['stage quark: step 2: {"loss": 0.5, "reward": 1.25}',
                                                        'stage quark: step 4: {"loss": 0.25, "score": 3.0}']


# ------------------------------------------------------------------------------------------------ real trainers


def recipe(tmp_path: Path, model: str) -> Path:
    prefs = write_records(tmp_path / "prefs.jsonl", learnable_preferences(16))
    train = "report_to: none, bf16: false, logging_steps: 1, save_strategy: 'no', warmup_steps: 0"
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"name: progress\nmodel: {{name: {model}}}\n"
        f"data:\n  instructions: {{builtin: alpaca_eval_sample, limit: 14}}\n  preferences: {{path: {prefs}}}\n"
        f"annotator: {{name: gold, config: {{gold: '{__name__}:answer_length'}}}}\nstages:\n"
        "  - {name: split, method: split_instructions, config: {eval_size: 2}}\n"
        f"  - {{name: grpo, method: grpo, config: {{{train}, max_steps: 3, per_device_train_batch_size: 4,"
        f" num_generations: 2, max_completion_length: 4, use_reward_model: false,"
        f" rule_rewards: ['{__name__}:marked_length']}}}}\n"
        f"  - {{name: dpo, method: dpo, config: {{{train}, max_steps: 3, per_device_train_batch_size: 4}}}}\n"
        f"  - {{name: online, method: online_dpo, config: {{{train}, rounds: 2, steps_per_round: 2,"
        " prompts_per_round: 4, per_device_train_batch_size: 4, max_new_tokens: 6, generation_batch_size: 4}}\n",
        encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def console_of_a_run(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """What GRPO (3 steps), DPO (3 steps) and online DPO (2 rounds of 2 steps) write to stderr (a module
    fixture cannot use capsys: stderr is swapped by hand; the console writes to whatever ``sys.stderr`` is)."""
    tmp_path = tmp_path_factory.mktemp("progress")
    path = recipe(tmp_path, tiny_model_dir)
    captured, before = io.StringIO(), sys.stderr
    sys.stderr = captured
    try:
        run_recipe(path, tmp_path / "run")
    finally:
        sys.stderr = before
    return captured.getvalue()


def test_grpo_shows_each_step_with_its_reward_while_it_trains(console_of_a_run: str):
    grpo = lines(console_of_a_run, "training (GRPO)")
    assert [(m["done"], m["total"]) for m in grpo] == [("1", "3"), ("2", "3"), ("3", "3")], console_of_a_run
    assert all(re.fullmatch(r"loss -?[\d.e+-]+ reward [\d.e+-]+", m["status"]) for m in grpo), console_of_a_run
    # the line of step 1 was written before the second batch was scored: during training, not after it
    assert console_of_a_run.index(grpo[0].group(0)) < console_of_a_run.index(MARK.format(2))


def test_dpo_shows_each_step_with_its_loss(console_of_a_run: str):
    dpo = lines(console_of_a_run, "training (DPO)")
    assert [(m["done"], m["total"]) for m in dpo] == [("1", "3"), ("2", "3"), ("3", "3")], console_of_a_run
    assert all(re.fullmatch(r"loss [\d.e+-]+", m["status"]) for m in dpo), console_of_a_run
    assert dpo[-1]["remaining"] == "0:00:00"


def test_online_dpo_counts_every_round_on_one_line(console_of_a_run: str):
    online = lines(console_of_a_run, "training (online DPO)")
    assert [(m["done"], m["total"]) for m in online] == [("1", "4"), ("2", "4"), ("3", "4"), ("4", "4")], \
        console_of_a_run
    assert all(m["status"].startswith("loss ") for m in online)
    assert not [line for line in console_of_a_run.splitlines() if line.startswith("round ") and "DPO" in line]


def test_scoring_many_samples_shows_its_line_as_it_goes(capsys: pytest.CaptureFixture):
    """Best-of-n scores n x instructions samples after sampling them; that used to show nothing (the gate's
    best-of-8 printed no line for ten minutes after its sampling line)."""
    from alpacafarm.console import progress_bar
    from alpacafarm.reward_selection import score_rows

    def scored_length(records: list[dict[str, Any]], completions: list[str]) -> list[float]:
        sys.stderr.write("[batch]\n")
        return [float(len(c)) for c in completions]

    rows = [{"instruction": f"q{i}", "input": "", "output": "x" * (i + 1)} for i in range(20)]
    with progress_bar("best-of-4: scoring", None) as line:
        scores = score_rows(scored_length, rows, batch_size=2, progress=line)
    assert scores == [float(i + 1) for i in range(20)]
    err = capsys.readouterr().err
    written = lines(err, "best-of-4: scoring")
    assert [(int(m["done"]), m["total"]) for m in written][:3] == [(2, "20"), (4, "20"), (6, "20")], err
    second_batch = err.index("[batch]", err.index("[batch]") + 1)
    assert err.index(" 2/20") < second_batch  # written as it goes, not when the scoring ended
