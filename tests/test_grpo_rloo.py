"""The ``grpo`` and ``rloo`` methods: TRL's online trainers run through recipes on tiny models, with a rule reward
the policy learns within a few steps, with the recipe's reward model, and the one-line errors."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from alpacafarm.errors import RecipeError, UserError
from alpacafarm.testing import run_recipe, tiny_tokenizer, write_records

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [{"instruction": f"Tell me something about topic number {i}.", "input": "" if i % 3 else "briefly"}
           for i in range(32)]
#: The rule reward as a recipe names it (this module's name depends on pytest's import mode).
EVEN_TOKENS = f"{__name__}:share_of_even_tokens"


@cache
def _tokenizer() -> Any:
    return tiny_tokenizer()


def share_of_even_tokens(records: list[dict[str, Any]], completions: list[str]) -> list[float]:
    """Share of a completion's tokens with an even id: half the vocabulary, so a random-init policy starts near
    0.5 with plenty of variance within a group, and learns it through the output layer in a few steps."""
    assert len(records) == len(completions) and all("instruction" in r for r in records)
    out = []
    for completion in completions:
        ids = _tokenizer()(completion, add_special_tokens=False)["input_ids"]
        out.append(sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1))
    return out


def write_recipe(tmp_path: Path, model: str, method: str, config: str, *, reward_model: bool = False) -> Path:
    """instructions → [split → reward model (1 step)] → ``method``; test settings first, ``config`` last."""
    instructions = write_records(tmp_path / "instructions.jsonl", PROMPTS)
    data = f"data:\n  instruction_splits: {{path: {instructions}}}\n"
    stages = ""
    if reward_model:
        prefs = write_records(tmp_path / "prefs.jsonl", [
            {"instruction": p["instruction"], "input": p["input"], "output_1": "Yes, gladly.", "output_2": "No.",
             "preference": 1 + i % 2} for i, p in enumerate(PROMPTS[:8])])
        data = f"data:\n  instructions: {{path: {instructions}}}\n  preferences: {{path: {prefs}}}\n"
        stages = ("  - {name: split, method: split_instructions, config: {eval_size: 4}}\n"
                  "  - {name: rm, method: reward_model, config: {max_steps: 1, per_device_train_batch_size: 4,"
                  " save_strategy: 'no', report_to: none, bf16: false}}\n")
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"name: {method}-test\nmodel: {{name: {model}}}\n{data}stages:\n{stages}"
        f"  - {{name: {method}, method: {method}, config: {{bf16: false, report_to: none, logging_steps: 1,"
        f" save_strategy: 'no', warmup_steps: 0, lr_scheduler_type: constant, {config}}}}}\n",
        encoding="utf-8")
    return path


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


# ------------------------------------------------------------------------------------------------ learning a rule


@pytest.mark.parametrize(("method", "config"), [
    # GRPO keeps its default beta (0.04): the frozen reference copy is built and a KL is logged.
    ("grpo", ""),
    # RLOO subtracts its KL from the reward, which at this learning rate pulls a tiny model back: beta 0 here.
    ("rloo", "beta: 0.0, "),
])
def test_the_policy_learns_a_rule_reward(method: str, config: str, tiny_model_dir: str, tmp_path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    steps = 16
    recipe = write_recipe(tmp_path, tiny_model_dir, method, (
        f"{config}max_steps: {steps}, per_device_train_batch_size: 16, num_generations: 4, max_completion_length: 8,"
        f" learning_rate: 0.1, use_reward_model: false, rule_rewards: ['{EVEN_TOKENS}']"))
    artifact = run_recipe(recipe, tmp_path / "run")[method]

    metrics = json.loads((tmp_path / "run/stages" / method / "metrics.json").read_text())
    logged = [e for e in metrics["log_history"] if "reward" in e]
    assert len(logged) == steps and artifact.metadata["steps"] == steps
    rewards = [e["reward"] for e in logged]
    first, last = mean(rewards[:4]), mean(rewards[-4:])
    print(f"{method}: mean reward of the first 4 steps {first:.3f}, of the last 4 {last:.3f}")
    assert last > first + 0.2, rewards
    assert logged[0]["rewards/share_of_even_tokens/mean"] == logged[0]["reward"]  # one source, weight 1
    assert (artifact.metadata["reward_first"], artifact.metadata["reward_last"]) == (rewards[0], rewards[-1])
    assert artifact.metadata["reward_sources"] == ["share_of_even_tokens"]
    assert (artifact.metadata["n_prompts"], artifact.metadata["num_generations"]) == (len(PROMPTS), 4)
    if method == "grpo":
        assert artifact.metadata["beta"] == 0.04 and logged[-1]["kl"] > 0

    # model/ reloads, and every parameter tensor moved away from the SFT model's
    assert artifact.kind == "model" and Path(artifact.path) == tmp_path / "run/stages" / method / "model"
    trained = dict(AutoModelForCausalLM.from_pretrained(artifact.path).named_parameters())
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    unchanged = [n for n, p in start.named_parameters() if p.requires_grad and torch.equal(p, trained[n])]
    assert not unchanged
    assert (Path(artifact.path) / "tokenizer.json").is_file()


# ------------------------------------------------------------------------------------------------ LoRA


def test_lora_grpo_trains_adapters_against_the_adapters_off_reference(tiny_model_dir: str, tmp_path: Path):
    from safetensors.torch import load_file

    from alpacafarm.model_loading import is_adapter_folder, load_merged_causal_lm
    from alpacafarm.recipe import ModelSpec

    model = f"{tiny_model_dir}, lora: {{r: 4, alpha: 8}}"
    recipe = write_recipe(tmp_path, model, "grpo", (
        "max_steps: 3, per_device_train_batch_size: 8, num_generations: 4, max_completion_length: 6,"
        f" learning_rate: 0.01, use_reward_model: false, rule_rewards: ['{EVEN_TOKENS}']"))
    artifact = run_recipe(recipe, tmp_path / "run")["grpo"]

    assert artifact.metadata["lora"] and not artifact.metadata["merged"] and is_adapter_folder(artifact.path)
    history = json.loads((tmp_path / "run/stages/grpo/metrics.json").read_text())["log_history"]
    kls = [e["kl"] for e in history if "kl" in e]
    assert kls[0] == 0 and kls[-1] > 0  # fresh adapters start as the SFT model, the reference (adapters off)
    adapters = load_file(Path(artifact.path) / "adapter_model.safetensors")
    assert any("lora_B" in name and weight.abs().sum() > 0 for name, weight in adapters.items())
    load_merged_causal_lm(ModelSpec(name=tiny_model_dir), artifact.path)


def test_full_fine_tuning_from_an_adapter_folder_with_a_kl_penalty_is_refused(tiny_model_dir: str, tmp_path: Path):
    """TRL would build the reference from the merged model's base name: the model before SFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapters = tmp_path / "sft-adapters"
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    peft_model.save_pretrained(adapters)
    _tokenizer().save_pretrained(adapters)
    recipe = write_recipe(tmp_path, str(adapters), "grpo", f"use_reward_model: false, rule_rewards: ['{EVEN_TOKENS}']")
    with pytest.raises(UserError, match="needs the SFT adapters merged") as caught:
        run_recipe(recipe, tmp_path / "run")
    assert "\n" not in str(caught.value)


# ------------------------------------------------------------------------------------------------ the reward model


def test_the_reward_model_scores_what_trl_logs(tiny_model_dir: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch):
    """RLOO (default beta 0.05) with the recipe's reward model stage wired as the optional reward_model input."""
    from alpacafarm.recipe import ModelSpec
    from alpacafarm.rewards import RewardScorer

    calls: list[tuple[list[dict[str, Any]], list[str], list[float]]] = []
    score = RewardScorer.__call__

    def recording(self: RewardScorer, records: list[dict[str, Any]], completions: list[str]) -> list[float]:
        scores = score(self, records, completions)
        calls.append((list(records), list(completions), scores))
        return scores

    monkeypatch.setattr(RewardScorer, "__call__", recording)
    recipe = write_recipe(tmp_path, tiny_model_dir, "rloo", (
        "max_steps: 2, per_device_train_batch_size: 8, num_generations: 4, max_completion_length: 6,"
        " learning_rate: 1.0e-3, score_batch_size: 3"), reward_model=True)
    artifacts = run_recipe(recipe, tmp_path / "run")

    metadata = artifacts["rloo"].metadata
    assert metadata["reward_sources"] == ["reward_model"] and metadata["beta"] == 0.05
    logged = [e for e in json.loads((tmp_path / "run/stages/rloo/metrics.json").read_text())["log_history"]
              if "reward" in e]
    assert len(calls) == len(logged) == 2
    train_split = [json.loads(line) for line in (tmp_path / "run/stages/split/train.jsonl").read_text().splitlines()]
    train = {(r["instruction"], r.get("input") or "") for r in train_split}
    fresh = RewardScorer.from_path(artifacts["rm"].path, ModelSpec(name=tiny_model_dir))
    for (records, completions, scores), entry in zip(calls, logged, strict=True):
        # 8 completions: 2 training prompts x 4 samples each, the records rebuilt from the dataset's columns
        assert len(records) == len(completions) == 8
        assert all((r["instruction"], r["input"]) in train for r in records)
        assert [r["instruction"] for r in records[::4]] == [r["instruction"] for r in records[3::4]]
        # what TRL logged is the reward model's score of exactly those answers to exactly those instructions
        assert entry["rewards/reward_model/mean"] == pytest.approx(mean(scores), abs=1e-5)
        assert entry["reward"] == pytest.approx(mean(scores), abs=1e-5)
        assert fresh.score_records(records, completions) == pytest.approx(scores, abs=1e-5)


# ------------------------------------------------------------------------------------------------ prompts and errors


class _BosTokenizer:
    """A Llama-like tokenizer stand-in: it adds ``<s>`` to every text unless ``adds`` is false."""

    bos_token, bos_token_id = "<s>", 1

    def __init__(self, adds: bool) -> None:
        self.adds = adds

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [1, 7] if self.adds else [7]}


@pytest.mark.parametrize("adds", [True, False])
def test_prompt_rows_keep_a_single_bos(adds: bool):
    """TRL tokenizes standard prompts with special tokens: a BOS the chat template wrote is dropped only when
    the tokenizer adds it back, so training sees the token ids generation uses."""
    from alpacafarm_methods.online_rl.base import prompt_rows

    def fmt(instruction: str, input: str | None) -> str:
        return f"<s>[INST] {instruction} {input or ''}[/INST]"

    rows = prompt_rows([{"instruction": "Hi.", "input": None}, {"instruction": "Add.", "input": "1+1"}], fmt,
                       _BosTokenizer(adds))
    prefix = "" if adds else "<s>"
    assert rows == [{"prompt": f"{prefix}[INST] Hi. [/INST]", "instruction": "Hi.", "input": ""},
                    {"prompt": f"{prefix}[INST] Add. 1+1[/INST]", "instruction": "Add.", "input": "1+1"}]


@pytest.mark.parametrize(("config", "error", "message"), [
    ("use_reward_model: false", UserError, "stage 'grpo' has no reward source"),
    ("rule_rewards: []", UserError, "stage 'grpo': use_reward_model is true but no reward_model input is wired"),
    (f"use_reward_model: false, rule_rewards: ['{EVEN_TOKENS}'], reward_weights: [1.0, 2.0]", UserError,
     "stage 'grpo': 2 reward_weights for 1 reward sources"),
    ("rule_rewards: [not_a_target]", RecipeError, "'not_a_target' is not of the form 'module:function'"),
])
def test_reward_source_errors_are_one_line(config: str, error: type, message: str, tiny_model_dir: str,
                                           tmp_path: Path):
    recipe = write_recipe(tmp_path, tiny_model_dir, "grpo", f"max_steps: 1, {config}")
    with pytest.raises(error, match=message) as caught:
        run_recipe(recipe, tmp_path / "run")
    assert "\n" not in str(caught.value)
