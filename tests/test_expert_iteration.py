"""Expert iteration's SFT targets: a winner that stopped ends with EOS, one cut at max_new_tokens does not."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from alpacafarm.data import read_records
from alpacafarm.testing import run_recipe, tiny_tokenizer, write_records
from alpacafarm.testing.openai_server import FakeOpenAIServer, request_text

pytestmark = pytest.mark.usefixtures("one_torch_thread")

INSTRUCTIONS = [{"instruction": f"Describe place number {i}.", "input": "" if i % 3 else "in one line"}
                for i in range(4)]
FINISHED = "A complete answer."
CUT = "An answer that was cut off in the"
MAX_NEW_TOKENS = 8


def targets(row: dict[str, list[int]]) -> list[int]:
    return [t for t in row["labels"] if t != -100]


# ----------------------------------------------------------------------------------------------- rows


def test_a_finished_winner_ends_with_eos_and_a_cut_one_does_not():
    from alpacafarm.prompts import format_prompt
    from alpacafarm.training_rows import training_rows

    tokenizer = tiny_tokenizer()
    eos = tokenizer.eos_token_id
    demos = [{**INSTRUCTIONS[0], "output": FINISHED, "finished": True},
             {**INSTRUCTIONS[1], "output": CUT, "finished": False}]
    finished, cut = training_rows(demos, tokenizer, "alpaca")
    assert targets(finished)[-1] == eos and targets(finished).count(eos) == 1
    assert eos not in targets(cut)
    assert tokenizer.decode(targets(finished), skip_special_tokens=True) == FINISHED
    assert tokenizer.decode(targets(cut)) == CUT
    for demo, row in zip(demos, (finished, cut), strict=True):  # the prompt is context, not a target
        prompt = tokenizer(format_prompt(demo["instruction"], demo["input"] or None))["input_ids"]
        assert row["input_ids"][:len(prompt)] == prompt and row["labels"][:len(prompt)] == [-100] * len(prompt)
        assert row["input_ids"][len(prompt):] == targets(row)


def test_cut_samples_are_what_the_backend_reports_and_a_backend_that_cannot_tell_is_an_error():
    from alpacafarm.errors import UserError
    from alpacafarm.reward_selection import mark_finished

    class Reporting:
        last_finished = [[True, False], [False, True]]

    samples = [[{"output": "a"}, {"output": "b"}], [{"output": "c"}, {"output": "d"}]]
    mark_finished(samples, Reporting(), "transformers")
    assert [[s["finished"] for s in g] for g in samples] == [[True, False], [False, True]]

    class Silent:  # a third-party backend that does not fill last_finished
        last_finished = ()

    with pytest.raises(UserError, match="'mine' does not report which completions were cut"):
        mark_finished(samples, Silent(), "mine")


def test_truncated_winners_option_is_checked(tmp_path: Path):
    from alpacafarm_methods.sampling.expert_iteration import ExpertIterationConfig

    assert ExpertIterationConfig(output_dir=str(tmp_path)).truncated_winners == "keep"
    with pytest.raises(ValueError, match="truncated_winners"):
        ExpertIterationConfig(output_dir=str(tmp_path), truncated_winners="trim")


# ----------------------------------------------------------------------------------------------- the stage


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    """An OpenAI-compatible server that cuts answers at ``max_tokens`` (``finish_reason: length``), as vLLM does:
    even-numbered places get a short answer that ends, odd-numbered ones an answer longer than the limit."""
    def respond(body: dict[str, Any]) -> str:
        number = int(re.search(r"place number (\d+)", request_text(body)).group(1))
        return FINISHED if number % 2 == 0 else CUT + " middle of a long sentence that goes on"

    with FakeOpenAIServer(respond, enforce_max_tokens=True) as fake:
        yield fake


@pytest.fixture
def built_trainers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every SFT trainer expert iteration builds (through
    :func:`alpacafarm.policy_training.build_sft_trainer_on_rows`)."""
    import alpacafarm_methods.sampling.expert_iteration as expert_iteration

    built: list[Any] = []
    real = expert_iteration.build_sft_trainer_on_rows

    def spy(*args: Any, **kwargs: Any) -> Any:
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(expert_iteration, "build_sft_trainer_on_rows", spy)
    return built


def expert_iteration_recipe(tmp_path: Path, model: str, server: FakeOpenAIServer, extra: str = "") -> Path:
    instructions = write_records(tmp_path / "instructions.jsonl", INSTRUCTIONS)
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"name: ei-eos\nmodel: {{name: {model}, dtype: float32, device: cpu}}\n"
        f"data:\n  prompts: {{path: {instructions}}}\n"
        "stages:\n  - {name: expert_iteration, method: expert_iteration, "
        "inputs: {instruction_splits: prompts, reward_model: base_model}, "
        f"config: {{n: 2, max_new_tokens: {MAX_NEW_TOKENS}, generation_batch_size: 4, max_steps: 1, "
        f"backend: openai, backend_config: {{base_url: '{server.base_url}', model: tiny}}, "
        f"per_device_train_batch_size: 4, save_strategy: 'no'{extra}}}}}\n",
        encoding="utf-8")
    return path


def test_the_stage_trains_cut_winners_without_eos(tiny_model_dir: str, tmp_path: Path, built_trainers: list[Any],
                                                  server: FakeOpenAIServer):
    artifacts = run_recipe(expert_iteration_recipe(tmp_path, tiny_model_dir, server), tmp_path / "run")
    round_dir = tmp_path / "run/stages/expert_iteration/round_1"
    winners = read_records(round_dir / "winners.jsonl")
    assert [w["finished"] for w in winners] == [True, False, True, False]
    assert all(s["finished"] == (s["output"] == FINISHED) for s in read_records(round_dir / "samples.jsonl"))

    (trainer,) = built_trainers
    tokenizer = trainer.processing_class
    eos = tokenizer.eos_token_id
    rows = list(trainer.train_dataset)
    assert len(rows) == 4
    for row in rows:
        text = tokenizer.decode(targets(row), skip_special_tokens=True).strip()
        assert text in (FINISHED, CUT)
        if text == FINISHED:
            assert targets(row)[-1] == eos  # a winner that stopped teaches stopping
        else:
            assert eos not in targets(row)  # a winner cut at the limit does not
    metrics = json.loads((round_dir / "metrics.json").read_text())
    assert metrics["n_truncated_winners"] == 2 and metrics["n_trained"] == 4
    assert artifacts["expert_iteration"].metadata["final_round"]["truncated_winners"] == "keep"


def test_the_stage_can_drop_cut_winners(tiny_model_dir: str, tmp_path: Path, built_trainers: list[Any],
                                        server: FakeOpenAIServer):
    run_recipe(expert_iteration_recipe(tmp_path, tiny_model_dir, server, ", truncated_winners: drop"),
               tmp_path / "run")
    (trainer,) = built_trainers
    rows = list(trainer.train_dataset)
    tokenizer = trainer.processing_class
    assert len(rows) == 2 and all(targets(row)[-1] == tokenizer.eos_token_id for row in rows)
    metrics = json.loads((tmp_path / "run/stages/expert_iteration/round_1/metrics.json").read_text())
    assert metrics["n_truncated_winners"] == 2 and metrics["n_trained"] == 2


def test_random_selection_draws_each_sample_alike_and_is_seeded(tmp_path: Path):
    """The control of expert iteration (issue 59): one of each instruction's n samples drawn at random, not the
    reward model's best, so a gain from the fine-tuning alone shows as the same gain without the selection."""
    from collections import Counter

    from alpacafarm.reward_selection import select
    from alpacafarm_methods.sampling.expert_iteration import ExpertIterationConfig, pick_random

    samples = [[{"output": f"{i}-{j}", "reward": float(j)} for j in range(4)] for i in range(400)]
    picked = pick_random(samples, 4, seed=3)
    assert picked == pick_random(samples, 4, seed=3) and picked != pick_random(samples, 4, seed=4)
    counts = Counter(int(p["output"].split("-")[1]) for p in picked)
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 70  # ~100 each; best-of-4 would be all 3
    assert {int(w["output"].split("-")[1]) for w in select(samples, 4)} == {3}
    assert all(p["n"] == 4 for p in picked)
    assert {int(p["output"].split("-")[1]) for p in pick_random(samples, 2, seed=3)} == {0, 1}  # the first n only
    assert ExpertIterationConfig(output_dir=str(tmp_path)).selection == "best"
    with pytest.raises(ValueError, match="selection must be one of best, random"):
        ExpertIterationConfig(output_dir=str(tmp_path), selection="worst")


def test_the_stage_fine_tunes_on_the_random_picks(tiny_model_dir: str, tmp_path: Path, built_trainers: list[Any],
                                                  server: FakeOpenAIServer):
    run_recipe(expert_iteration_recipe(tmp_path, tiny_model_dir, server, ", selection: random"),
               tmp_path / "run")
    round_dir = tmp_path / "run/stages/expert_iteration/round_1"
    samples = read_records(round_dir / "samples.jsonl")
    winners = read_records(round_dir / "winners.jsonl")
    assert len(winners) == 4 and all(any(s["output"] == w["output"] and s["reward"] == w["reward"]
                                         for s in samples) for w in winners)
    metrics = json.loads((round_dir / "metrics.json").read_text())
    assert metrics["selection"] == "random" and metrics["n"] == 2
    (trainer,) = built_trainers
    assert len(list(trainer.train_dataset)) == 4
