"""The ``ppo`` method: PPO arithmetic against hand-computed values, learning on a tiny model, and the recipe
path (full fine-tuning and LoRA on one shared base), checkpoints and resume, rollouts behind the SFT folder's
prompt conditioning."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from alpacafarm.errors import RecipeError
from alpacafarm.recipe import ModelSpec, load_recipe
from alpacafarm.testing import run_recipe, write_records
from alpacafarm_methods.ppo.advantages import compute_gae, kl_penalized_rewards, masked_whiten
from alpacafarm_methods.ppo.losses import clipped_policy_loss, clipped_value_loss, entropy_of, logprobs_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [{"instruction": f"Tell me something about topic number {i}.", "input": "" if i % 3 else "briefly"}
           for i in range(24)]
#: Recipe runs shared by several tests. Built on first use inside a test, so with that test's single torch
#: thread (a module-scoped fixture would be set up before the function-scoped ``one_torch_thread``).
_RUNS: dict[str, dict[str, Any]] = {}


def preference_records(n: int) -> list[dict[str, Any]]:
    return [{"instruction": f"Say something about item {i}.", "input": "",
             "output_1": f"Item {i} is useful and interesting." if i % 2 else "No.",
             "output_2": "No." if i % 2 else f"Item {i} is useful and interesting.",
             "preference": 1 + (i + 1) % 2}
            for i in range(n)]


PPO_CONFIG = ("{max_steps: 4, warmup_steps: 0, rollout_batch_size: 8, mini_batch_size: 4,"
              " per_device_train_batch_size: 4,"
              " generation_batch_size: 8, max_new_tokens: 6, learning_rate: 1.0e-3, save_steps: 2,"
              " score_batch_size: 4}")


def ppo_recipe(tmp_path: Path, model: str, extra_model: str = "") -> Path:
    """split → reward model (2 steps) → ppo (4 steps, checkpoints every 2) → outputs of the PPO model."""
    instructions = write_records(tmp_path / "instructions.jsonl", PROMPTS)
    prefs = write_records(tmp_path / "prefs.jsonl", preference_records(16))
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "name: ppo-test\n"
        f"model: {{name: {model}{extra_model}}}\n"
        f"data:\n  instructions: {{path: {instructions}}}\n  preferences: {{path: {prefs}}}\n"
        "stages:\n"
        "  - {name: split, method: split_instructions, config: {eval_size: 4}}\n"
        "  - {name: rm, method: reward_model, config: {max_steps: 2, per_device_train_batch_size: 4,"
        " learning_rate: 1.0e-3, save_strategy: 'no', eval_fraction: 0.25}}\n"
        f"  - {{name: ppo, method: ppo, config: {PPO_CONFIG}}}\n"
        "  - {name: outputs, method: generate_outputs, inputs: {sft_model: ppo},"
        " config: {split: eval, sampling: {max_new_tokens: 4, batch_size: 4}}}\n",
        encoding="utf-8")
    return path


def close(actual: torch.Tensor, expected: list, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def steps_of(history: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in history if "score" in e}


def assert_value_is_the_reward(trainer: Any, spec: ModelSpec, rm_path: str, *, equal: bool = True) -> None:
    """The critic's value of each whole sequence (read where its next token would be predicted) equals the score
    of the reward model folder, loaded on its own, for that sequence."""
    from alpacafarm.model_loading import load_classifier
    from alpacafarm_methods.ppo.rollouts import collate

    tokenizer, pad = trainer.tokenizer, trainer.pad_id
    answers = ["A fine answer.", "No.", "Item 3 is useful and interesting."]
    sequences = [q + tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                 for q, a in zip(trainer.queries, answers, strict=False)]
    batch = collate(sequences, [[pad]] * len(sequences), pad)
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        values = trainer.models.actor_critic.critic(batch)[:, 0]
        scores = load_classifier(spec, rm_path)(input_ids=ids, attention_mask=(ids != pad).long()).logits
    if equal:
        torch.testing.assert_close(values, scores.squeeze(-1).float(), atol=1e-4, rtol=0)
    else:
        assert not torch.allclose(values, scores.squeeze(-1).float(), atol=1e-3)


class Notes:
    """A logger that keeps what it is told."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, message: str, *args: Any) -> None:
        self.lines.append(message % args)

    warning = info


# --------------------------------------------------------------------------------------------- the arithmetic


#: The hand-computed example: two responses (3 and 2 tokens), their log-probabilities and scores.
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
LOGPROBS = [[-1.0, -2.0, -3.0], [-1.0, -1.0, -5.0]]
REF_LOGPROBS = [[-1.5, -1.5, -3.5], [-2.0, -1.0, -1.0]]
SCORES = [2.0, -1.0]


def test_kl_shaped_rewards_and_gae_match_hand_computed_values():
    mask, logprobs, ref_logprobs = torch.tensor(MASK), torch.tensor(LOGPROBS), torch.tensor(REF_LOGPROBS)
    scores = torch.tensor(SCORES)
    rewards, kl, penalized = kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=0.1,
                                                           penalty="k1")
    # kl = logp - ref on real tokens; the score lands on each row's last real token, padding stays 0.
    close(kl, [[0.5, -0.5, 0.5], [1.0, 0.0, 0.0]])
    close(penalized, [[0.5, -0.5, 0.5], [1.0, 0.0, 0.0]])
    assert rewards.tolist()[0] == pytest.approx([-0.05, 0.05, 1.95])
    assert rewards.tolist()[1] == pytest.approx([-0.1, -1.0, 0.0])

    # The default (the released implementation's): the penalty is charged on max(logp - ref, 0), so the token
    # the policy finds less likely than the reference (-0.5) earns no bonus. The sampled KL is unchanged.
    rewards, kl, penalized = kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=0.1)
    close(kl, [[0.5, -0.5, 0.5], [1.0, 0.0, 0.0]])
    close(penalized, [[0.5, 0.0, 0.5], [1.0, 0.0, 0.0]])
    assert rewards.tolist()[0] == pytest.approx([-0.05, 0.0, 1.95])
    assert rewards.tolist()[1] == pytest.approx([-0.1, -1.0, 0.0])
    with pytest.raises(ValueError, match="unknown KL penalty"):
        kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=0.1, penalty="k3")

    # Whitened over the five real tokens, mean kept: mean 0.16, population variance 0.9374.
    mean, std = 0.16, 0.9374 ** 0.5
    whitened = masked_whiten(rewards, mask, shift_mean=False)
    close(whitened, [[(-0.05 - mean) / std + mean, (0.0 - mean) / std + mean, (1.95 - mean) / std + mean],
                     [(-0.1 - mean) / std + mean, (-1.0 - mean) / std + mean, 0.0]])

    rewards = torch.tensor([[0.1, -0.2, 1.0], [0.3, 2.0, 9.0]])  # 9.0 and 7.0 sit on padding: ignored
    values = torch.tensor([[0.5, 0.4, 0.3], [1.0, -1.0, 7.0]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # gamma = lambda = 1: returns are reward-to-go, advantages returns minus values.
    assert returns.tolist()[0] == pytest.approx([0.9, 0.8, 1.0])
    assert returns.tolist()[1] == pytest.approx([2.3, 2.0, 0.0])
    assert advantages.tolist()[0] == pytest.approx([0.4, 0.4, 0.7])
    assert advantages.tolist()[1] == pytest.approx([1.3, 3.0, 0.0])

    # gamma = lambda = 0.5 on the first row, by hand: deltas 0.7, -0.45, -0.2 from the end.
    advantages, returns = compute_gae(rewards[:1], values[:1], mask[:1], gamma=0.5, lam=0.5)
    assert advantages.tolist()[0] == pytest.approx([-0.26875, -0.275, 0.7])
    assert returns.tolist()[0] == pytest.approx([0.23125, 0.125, 1.0])

    whitened = masked_whiten(torch.tensor([[1.0, 2.0], [3.0, 100.0]]),
                                      torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    close(whitened, [[-1.224745, 0.0], [1.224745, 0.0]])
    kept_mean = masked_whiten(torch.tensor([[1.0, 3.0]]), torch.ones(1, 2), shift_mean=False)
    close(kept_mean, [[1.0, 3.0]], atol=1e-4)  # std 1 already, mean 2 kept


def test_clipped_losses_match_hand_computed_values():
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0]])
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.7, 3.0]])
    new = (old + ratios.log()).requires_grad_(True)
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # the last token is padding
    terms = clipped_policy_loss(new, old, advantages, mask, cliprange=0.2)
    # per token max(-A r, -A clip(r)): -1.2 (clipped), -0.5, 1.1, 0.8 (clipped) → mean 0.05
    assert float(terms.loss.detach()) == pytest.approx(0.05)
    assert float(terms.clip_fraction) == pytest.approx(0.5)
    terms.loss.backward()
    # Clipped tokens pass no gradient; the others -A * r / n_tokens.
    assert new.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 4, 1.1 / 4, 0.0, 0.0])
    summed = clipped_policy_loss(new.detach(), old, advantages, mask, cliprange=0.2, denominator=8.0)
    assert float(summed.loss) == pytest.approx(0.2 / 8)

    old_values = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    new_values = torch.tensor([[0.5, -0.1, 1.3, 50.0]])
    returns = torch.tensor([[1.0, 0.5, 0.0, 0.0]])
    value_mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    terms = clipped_value_loss(new_values, old_values, returns, value_mask, cliprange_value=0.2)
    # squared errors: max(0.25, 0.64 clipped), 0.36 either way, max(1.69, 1.44) → 0.5 * mean(0.64, 0.36, 1.69)
    assert float(terms.loss) == pytest.approx(0.5 * (0.64 + 0.36 + 1.69) / 3)
    assert float(terms.clip_fraction) == pytest.approx(1 / 3)

    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    assert float(entropy_of(logits)) == pytest.approx(1.5 * torch.log(torch.tensor(2.0)).item())
    close(logprobs_of(logits, torch.tensor([[1]])), [[torch.log(torch.tensor(0.25)).item()]])


def test_the_trainer_by_default_clamps_the_kl_penalty_and_whitens_the_shaped_rewards():
    """Defaults on the hand-computed example: clamped KL; the shaped rewards padded to max_new_tokens columns and
    whitened over all of them (mean kept), GAE over every column (tests/test_ppo_oracle.py checks the same against
    the released code)."""
    from types import SimpleNamespace

    from alpacafarm.sampling import Sample
    from alpacafarm_methods.ppo.config import PPOMethodConfig
    from alpacafarm_methods.ppo.rollouts import Rollouts
    from alpacafarm_methods.ppo.trainer import PPOTrainer

    def rollouts() -> Rollouts:
        samples = [Sample([1], [5, 6, 7], "abc", True), Sample([1], [5, 6], "ab", True)]
        zeros = torch.zeros(2, 3)
        return Rollouts([{}, {}], samples, torch.tensor(SCORES), torch.tensor(MASK), torch.tensor(LOGPROBS),
                        torch.tensor(REF_LOGPROBS), zeros, zeros)

    args = PPOMethodConfig(output_dir="unused", rollout_batch_size=2, mini_batch_size=2, kl_coef=0.1,
                           max_new_tokens=4)
    assert (args.kl_penalty, args.whiten_rewards, args.adam_epsilon) == ("clamped", True, 1e-5)
    trainer = SimpleNamespace(args=args)
    done = PPOTrainer.compute_advantages(trainer, rollouts())
    close(done.rewards, [[-0.05, 0.0, 1.95], [-0.1, -1.0, 0.0]])  # clamped KL: 0.05 is not a bonus
    full = [-0.05, 0.0, 1.95, 0.0, -0.1, -1.0, 0.0, 0.0]  # padded to 4 columns
    mean = sum(full) / 8
    std = (sum((x - mean) ** 2 for x in full) / 8) ** 0.5
    w = [[(x - mean) / std + mean for x in full[:4]], [(x - mean) / std + mean for x in full[4:]]]
    # values are 0 and gamma = lambda = 1: returns are the whitened rewards to go over all 4 columns
    close(done.returns, [[sum(w[0]), sum(w[0][1:]), sum(w[0][2:])], [sum(w[1]), sum(w[1][1:]), 0.0]])
    stats = PPOTrainer.rollout_stats(trainer, done)
    # kl: the sampled estimate (0.5 and 1.0); penalized_kl: what was charged (1.0 twice); the penalty applied.
    assert (stats["kl"], stats["penalized_kl"]) == (pytest.approx(0.75), pytest.approx(1.0))
    assert stats["non_score_reward"] == pytest.approx(-0.1) and stats["reward"] == pytest.approx(0.4)

    # The other behaviours stay one option away: the plain k1 estimate, unwhitened rewards.
    plain = dataclasses.replace(args, kl_penalty="k1", whiten_rewards=False)
    done = PPOTrainer.compute_advantages(SimpleNamespace(args=plain), rollouts())
    close(done.rewards, [[-0.05, 0.05, 1.95], [-0.1, -1.0, 0.0]])
    close(done.returns, [[1.95, 2.0, 1.95], [-1.1, -1.0, 0.0]])
    with pytest.raises(ValueError, match="kl_penalty must be one of"):
        PPOMethodConfig(output_dir="unused", rollout_batch_size=2, mini_batch_size=2, kl_penalty="k2")


# ------------------------------------------------------------------------------------------------ learning


def _train_on_token_reward(kl_coef: float) -> list[dict[str, Any]]:
    """PPO on a tiny random model, paid for the share of a completion's tokens (its text tokenized again) that
    come from a fixed eighth of the vocabulary."""
    from alpacafarm.testing import tiny_causal_lm, tiny_sequence_classifier, tiny_tokenizer
    from alpacafarm_methods.ppo.config import PPOMethodConfig
    from alpacafarm_methods.ppo.models import SeparateModels, ValueModel
    from alpacafarm_methods.ppo.trainer import PPOTrainer

    tokenizer = tiny_tokenizer()
    policy = tiny_causal_lm(tokenizer)
    critic = ValueModel.from_classifier(tiny_sequence_classifier(tokenizer))
    models = SeparateModels(policy, copy.deepcopy(policy), critic)
    target = set(range(0, len(tokenizer), 8))

    def reward(records, completions):  # an alpacafarm.rewards.RewardFunction: text only, no token ids
        assert len(records) == len(completions) == 16
        ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
        return [sum(t in target for t in row) / max(len(row), 1) for row in ids]

    args = PPOMethodConfig(output_dir="unused", max_steps=24, warmup_steps=0, rollout_batch_size=16, mini_batch_size=8,
                           per_device_train_batch_size=8, generation_batch_size=16, max_new_tokens=8,
                           learning_rate=1e-2, kl_coef=kl_coef, save_strategy="no", seed=1)
    trainer = PPOTrainer(args, models, tokenizer, PROMPTS, reward)
    trainer.train()
    return [e for e in trainer.state.log_history if "score" in e]


@pytest.mark.slow
def test_reward_rises_while_the_kl_penalty_bounds_the_drift():
    penalised = _train_on_token_reward(kl_coef=0.02)
    free = _train_on_token_reward(kl_coef=0.0)
    for history, gain in ((penalised, 0.05), (free, 0.5)):
        scores = [e["score"] for e in history]
        assert len(history) == 24
        assert history[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # policy = reference at first
        assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + gain  # a random policy scores about 1/8
    # With the penalty the drift stays within a few nats; without it the policy collapses onto target tokens.
    assert max(e["kl"] for e in penalised) < 15.0
    assert free[-1]["kl"] > 20.0 and free[-1]["score"] > 0.8
    assert max(e["kl"] for e in penalised) < 0.5 * free[-1]["kl"]
    assert free[-1]["entropy"] < penalised[-1]["entropy"]


# ------------------------------------------------------------------------------------------- full fine-tuning


@pytest.fixture
def full_run(one_torch_thread: None, tiny_model_dir: str,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if "full" not in _RUNS:
        tmp_path = tmp_path_factory.mktemp("ppo-full")
        recipe = ppo_recipe(tmp_path, tiny_model_dir)
        artifacts = run_recipe(recipe, tmp_path / "run")
        _RUNS["full"] = {"recipe": recipe, "run": tmp_path / "run", "artifacts": artifacts}
    return _RUNS["full"]


def test_recipe_trains_logs_every_key_and_saves_a_changed_policy(full_run, tiny_model_dir: str):
    from safetensors.torch import load_file

    from alpacafarm_methods.ppo.trainer import LOG_KEYS

    stage = full_run["run"] / "stages/ppo"
    artifact = full_run["artifacts"]["ppo"]
    assert Path(artifact.path) == stage / "model" and artifact.kind == "model"
    assert artifact.metadata["steps"] == 4 and artifact.metadata["n_prompts"] == 20
    assert not artifact.metadata["lora"]
    metrics = json.loads((stage / "metrics.json").read_text())
    steps = steps_of(metrics["log_history"])
    assert sorted(steps) == [1, 2, 3, 4]
    for entry in steps.values():
        assert set(LOG_KEYS) <= set(entry), set(LOG_KEYS) - set(entry)
        assert entry["response_length"] <= 6 and 0.0 <= entry["clip_fraction"] <= 1.0 and entry["entropy"] > 0
    assert steps[1]["kl"] == pytest.approx(0.0, abs=1e-5) and steps[4]["kl"] != 0.0
    assert metrics["log_history"][-1]["train_runtime"] > 0
    assert (stage / "checkpoint-2").is_dir() and (stage / "checkpoint-4").is_dir()
    # accelerator.save_state: the trained tensors (policy and critic), AdamW, RNG; and the trainer state
    files = {p.name for p in (stage / "checkpoint-2").iterdir()}
    assert files >= {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "trainer_state.json"}, files
    assert not any(name.endswith(".pth") for name in files)  # nothing unpickled with weights_only=False

    before = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    after = load_file(str(stage / "model/model.safetensors"))
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    outputs_file = full_run["run"] / "stages/outputs/outputs.jsonl"
    outputs = [json.loads(line) for line in outputs_file.read_text().splitlines()]
    assert len(outputs) == 4 and all("output" in o for o in outputs)
    manifest = json.loads((full_run["run"] / "stages/outputs/manifest.json").read_text())
    assert manifest["inputs"]["sft_model"]["from"] == "ppo"


def test_value_model_is_the_reward_models_backbone_with_a_zero_head(full_run, tiny_model_dir: str):
    """As released: the critic is the reward model's backbone with a new head whose weight and bias are 0 (values
    0 at step 0); ``value_head_init: reward_head`` starts the head as the reward model's score head instead."""
    from alpacafarm.model_loading import load_classifier
    from alpacafarm_methods.ppo.config import PPOMethodConfig
    from alpacafarm_methods.ppo.method import build_ppo_trainer
    from alpacafarm_methods.ppo.rollouts import collate

    spec = ModelSpec(name=tiny_model_dir)
    rm_path = full_run["artifacts"]["rm"].path
    args = PPOMethodConfig(output_dir="unused", max_steps=1, rollout_batch_size=4, mini_batch_size=4)
    notes = Notes()
    trainer = build_ppo_trainer(args, spec, tiny_model_dir, rm_path, PROMPTS[:4], logger=notes)
    assert any("new zero-initialised value head" in line for line in notes.lines)
    classifier = load_classifier(spec, rm_path)
    critic = trainer.models.actor_critic.critic
    assert not torch.equal(classifier.score.weight, torch.zeros_like(classifier.score.weight))
    assert torch.count_nonzero(critic.head.weight) == 0 and torch.count_nonzero(critic.head.bias) == 0
    assert critic.head.weight.requires_grad and critic.head.weight.dtype == torch.float32
    pairs = zip(critic.backbone.state_dict().items(), classifier.model.state_dict().items(), strict=True)
    for (name, mine), (_, theirs) in pairs:
        assert torch.equal(mine, theirs), name
    batch = collate(trainer.queries[:3], [[5, 6, 7]] * 3, trainer.pad_id)
    with torch.no_grad():
        assert torch.equal(critic(batch), torch.zeros(3, 3))
    # Four models without LoRA: policy, frozen reference, critic and reward model (all distinct weights).
    assert trainer.models.reference is not trainer.models.actor_critic.policy
    assert not any(p.requires_grad for p in trainer.models.reference.parameters())
    assert len(_llama_backbones(trainer)) == 4

    old = dataclasses.replace(args, value_head_init="reward_head")
    trainer = build_ppo_trainer(old, spec, tiny_model_dir, rm_path, PROMPTS[:4], logger=Notes())
    assert_value_is_the_reward(trainer, spec, rm_path)


def _llama_backbones(trainer: Any) -> set[int]:
    """Distinct LlamaModel weights (by storage) reachable from the trainer's models and its reward scorer."""
    from transformers import LlamaModel

    modules = [trainer.models.actor_critic, *trainer.models.frozen_modules(), trainer.reward_fn.model]
    storages = set()
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, LlamaModel):
                storages.add(sub.embed_tokens.weight.data_ptr())
    return storages


def test_resume_continues_the_step_count_and_reproduces_the_run(full_run, tmp_path: Path):
    run = tmp_path / "run"
    shutil.copytree(full_run["run"], run)
    stage = run / "stages/ppo"
    # Pretend the first attempt died after checkpoint-2: the pipeline re-runs a "running" stage, resuming.
    shutil.rmtree(stage / "checkpoint-4")
    shutil.rmtree(stage / "model")
    (stage / "metrics.json").unlink()
    manifest = json.loads((stage / "manifest.json").read_text())
    (stage / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))
    artifact = run_recipe(full_run["recipe"], run)["ppo"]
    assert artifact.metadata["steps"] == 4 and (stage / "model/model.safetensors").is_file()
    resumed = steps_of(json.loads((stage / "metrics.json").read_text())["log_history"])
    original = steps_of(json.loads((full_run["run"] / "stages/ppo/metrics.json").read_text())["log_history"])
    assert sorted(resumed) == [1, 2, 3, 4]  # steps 1-2 come from the checkpoint's trainer state
    # Prompts, samples and mini-batches are seeded by step; weights, optimizer, scheduler come back: same run.
    for step in (3, 4):
        for key in ("score", "kl", "policy_loss", "value_loss", "learning_rate"):
            assert resumed[step][key] == pytest.approx(original[step][key], rel=1e-4, abs=1e-6), (step, key)


def test_config_is_recipe_settable_and_checked(tiny_model_dir: str, tmp_path: Path):
    recipe = ppo_recipe(tmp_path, tiny_model_dir)
    loaded = load_recipe(recipe, ["stages.ppo.config.kl_coef=0.02", "stages.ppo.config.cliprange=0.1",
                                  "stages.ppo.config.weight_decay=0.01"])
    config = loaded.stage_configs["ppo"]
    assert (config.kl_coef, config.cliprange, config.weight_decay) == (0.02, 0.1, 0.01)
    assert config.bf16 is False and config.gradient_checkpointing is False  # CPU: automatic values
    with pytest.raises(RecipeError, match="multiple of mini_batch_size"):
        load_recipe(recipe, ["stages.ppo.config.mini_batch_size=3"])
    with pytest.raises(RecipeError, match="did you mean 'kl_coef'"):
        load_recipe(recipe, ["stages.ppo.config.kl_coeff=0.1"])
    with pytest.raises(RecipeError, match="temperature must be positive"):
        load_recipe(recipe, ["stages.ppo.config.temperature=0"])


def test_paper_recipe_checks_and_its_offline_smoke_overrides_load(tmp_path: Path):
    path = REPO_ROOT / "recipes" / "ppo.yaml"
    loaded = load_recipe(path)
    ppo = loaded.stage_configs["ppo"]
    assert (ppo.rollout_batch_size, ppo.mini_batch_size, ppo.ppo_epochs) == (512, 256, 2)
    paper = (0.002, 1e-5, 1.0, 1.0, 1.0)
    assert (ppo.kl_coef, ppo.learning_rate, ppo.gamma, ppo.lam, ppo.max_grad_norm) == paper
    released = ("clamped", True, 0.2, 0.2, 0.1, 1e-5)  # where the paper is silent
    assert (ppo.kl_penalty, ppo.whiten_rewards, ppo.cliprange, ppo.cliprange_value, ppo.vf_coef,
            ppo.adam_epsilon) == released
    assert loaded.recipe.model.name == "huggyllama/llama-7b"
    stages = {s.name: s for s in loaded.recipe.stages}
    assert stages["ppo"].inputs == {"instruction_splits": "unlabeled"}
    assert stages["outputs"].inputs == {"sft_model": "ppo"}
    assert loaded.recipe.data["unlabeled"].split == "unlabeled"

    # The smoke command in the recipe's comments: every --set must load (the preferences file made up here).
    lines = path.read_text().splitlines()
    command_start = "alpacafarm run recipes/ppo.yaml --set model.name"
    start = next(i for i, line in enumerate(lines) if command_start in line)
    command = []
    for line in lines[start:]:
        body = line.lstrip("#").strip()
        command.append(body.rstrip("\\"))
        if not body.endswith("\\"):
            break
    words = shlex.split(" ".join(command))
    prefs = write_records(tmp_path / "prefs.jsonl", preference_records(4))
    overrides = [words[i + 1].replace("runs/quickstart/stages/preferences/preferences.jsonl", str(prefs))
                 for i, word in enumerate(words) if word == "--set"]
    assert len(overrides) == 13
    smoke = load_recipe(path, overrides)
    assert smoke.stage_configs["ppo"].max_steps == 2 and smoke.recipe.model.name == "smollm2-135m-instruct"


# --------------------------------------------------------------------------------------------- LoRA: one base


@pytest.fixture
def lora_run(one_torch_thread: None, tiny_model_dir: str,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if "lora" not in _RUNS:
        tmp_path = tmp_path_factory.mktemp("ppo-lora")
        recipe = ppo_recipe(tmp_path, tiny_model_dir, extra_model=", lora: {r: 4, alpha: 8}")
        artifacts = run_recipe(recipe, tmp_path / "run", ("stages.ppo.config.max_steps=2",))
        _RUNS["lora"] = {"run": tmp_path / "run", "artifacts": artifacts}
    return _RUNS["lora"]


def test_lora_recipe_saves_a_policy_adapter_that_generation_loads(lora_run, tiny_model_dir: str):
    from peft import PeftConfig

    model_dir = Path(lora_run["artifacts"]["ppo"].path)
    assert (model_dir / "adapter_model.safetensors").is_file()
    assert not (model_dir / "model.safetensors").exists()
    config = PeftConfig.from_pretrained(str(model_dir))
    assert config.base_model_name_or_path == tiny_model_dir
    assert not [p for p in model_dir.iterdir() if p.is_dir()]  # the policy only, no value/reward adapters
    assert lora_run["artifacts"]["ppo"].metadata["lora"] is True
    assert lora_run["artifacts"]["outputs"].metadata["n_outputs"] == 4


def _lora_trainer(lora_run: dict[str, Any], tiny_model_dir: str, spec: ModelSpec, **config: Any) -> Any:
    return _trainer(tiny_model_dir, lora_run["artifacts"]["rm"].path, spec, **config)


def _trainer(sft_path: str, rm_path: str, spec: ModelSpec, logger: Any = None, **config: Any) -> Any:
    from alpacafarm_methods.ppo.config import PPOMethodConfig
    from alpacafarm_methods.ppo.method import build_ppo_trainer

    settings = {"max_steps": 2, "warmup_steps": 0, "rollout_batch_size": 8, "mini_batch_size": 4,
                "output_dir": "unused",
                "per_device_train_batch_size": 4, "generation_batch_size": 8, "max_new_tokens": 6,
                "learning_rate": 1e-2, "save_strategy": "no", **config}
    return build_ppo_trainer(PPOMethodConfig(**settings), spec, sft_path, rm_path, PROMPTS[:8], logger=logger)


def _assert_critic_starts_at_zero(trainer: Any) -> None:
    from alpacafarm_methods.ppo.rollouts import collate

    batch = collate(trainer.queries[:3], [[5, 6, 7]] * 3, trainer.pad_id)
    with torch.no_grad():
        assert torch.equal(trainer.models.actor_critic.critic(batch), torch.zeros(3, 3))


def test_lora_policy_on_the_sft_base_and_the_critic_on_the_merged_reward_adapters(lora_run, tiny_model_dir: str):
    """LoRA reward adapters trained on the SFT model: the policy is an adapter on the one SFT base (the reference
    is that base with it disabled); the critic is the reward model (its adapters merged) with a fresh value adapter
    and a zero head, and scores the rewards with the adapter off. No adapter is switched under a gradient."""
    from transformers import AutoModelForCausalLM

    from alpacafarm.model_loading import is_adapter_folder
    from alpacafarm.rewards import RewardScorer
    from alpacafarm_methods.ppo.models import RewardModelCritic
    from alpacafarm_methods.ppo.rollouts import collate

    spec = ModelSpec(name=tiny_model_dir, lora={"r": 4, "alpha": 8})
    rm_path = lora_run["artifacts"]["rm"].path
    assert is_adapter_folder(rm_path)  # LoRA reward adapters trained on the SFT model itself
    notes = Notes()
    trainer = _trainer(tiny_model_dir, rm_path, spec, logger=notes)
    models = trainer.models
    policy, critic = models.actor_critic.policy, models.actor_critic.critic
    assert set(policy.peft_config) == {"default"} and isinstance(critic, RewardModelCritic)
    assert any("fresh LoRA adapter and a new zero-initialised value head" in n for n in notes.lines), notes.lines
    _assert_critic_starts_at_zero(trainer)
    assert len(_llama_backbones(trainer)) == 2  # the SFT base (policy, reference), the reward model's (critic)
    trained = set(trainer.params)
    assert trained and all(".default." in n or ".value." in n or n.startswith("critic.head.") for n in trained)
    assert any(n.startswith("critic.head.") for n in trained) and any(".value." in n for n in trained)

    # The reward model scores exactly like the reward model folder loaded on its own.
    records, completions = PROMPTS[:3], ["A fine answer.", "No.", "Item 3 is useful and interesting."]
    alone = RewardScorer.from_path(lora_run["artifacts"]["rm"].path, spec).score_records(records, completions)
    assert trainer.reward_fn(records, completions) == pytest.approx(alone, abs=1e-5)

    # The reference is the SFT model (adapter disabled), before and after training; the policy moves away.
    sft = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = collate([trainer.queries[0], trainer.queries[1]], [[5, 6, 7], [8, 9]], trainer.pad_id)
    expected = sft(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits[:, -4:-1]
    with torch.no_grad():
        assert torch.allclose(models.reference_logits(batch), expected, atol=1e-5)
        assert torch.allclose(models.actor_critic(**vars(batch))[0], expected, atol=1e-5)  # LoRA B starts at 0
    trainer.train()
    with torch.no_grad():
        assert torch.allclose(models.reference_logits(batch), expected, atol=1e-5)
        assert not torch.allclose(models.actor_critic(**vars(batch))[0], expected, atol=1e-4)
    # The critic trained, the reward model (the same backbone, adapter off) did not.
    assert trainer.reward_fn(records, completions) == pytest.approx(alone, abs=1e-5)
    assert torch.count_nonzero(critic.head.weight) > 0


@pytest.mark.parametrize("reward_model", ["lora", "full"])
def test_activation_checkpointing_does_not_change_the_lora_update(reward_model: str, tiny_model_dir: str,
                                                                  request: pytest.FixtureRequest):
    """Checkpointed layers are recomputed during backward: the policy's and the critic's recompute must be what
    ran forward (no adapter is switched between the forward and its backward)."""
    run = request.getfixturevalue(f"{reward_model}_run")
    spec = ModelSpec(name=tiny_model_dir, lora={"r": 4, "alpha": 8})
    trained = []
    for checkpointing in (False, True):
        trainer = _trainer(tiny_model_dir, run["artifacts"]["rm"].path, spec, max_steps=1,
                           gradient_checkpointing=checkpointing)
        actor_critic = trainer.models.actor_critic
        layers = [*actor_critic.policy.get_base_model().model.layers,
                  *actor_critic.critic.backbone.get_base_model().layers]
        assert all(layer.gradient_checkpointing == checkpointing for layer in layers)
        trainer.train()
        trained.append({n: p.detach().clone() for n, p in trainer.params.items()})
    plain, checkpointed = trained
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_4bit_lora_trains_on_quantized_bases(lora_run, tiny_model_dir: str):
    pytest.importorskip("bitsandbytes")
    spec = ModelSpec(name=tiny_model_dir, lora={"r": 4, "alpha": 8}, quantization="4bit")
    trainer = _lora_trainer(lora_run, tiny_model_dir, spec)
    assert {type(m).__name__ for m in trainer.models.actor_critic.policy.modules()} >= {"Linear4bit"}
    quantized = [m.weight for m in trainer.models.actor_critic.policy.modules() if type(m).__name__ == "Linear4bit"]
    frozen = [w.detach().clone() for w in quantized]
    before = {n: p.detach().clone() for n, p in trainer.params.items()}
    result = trainer.train()
    assert result.global_step == 2 and len(_llama_backbones(trainer)) == 2
    # The adapters learned; the quantized base did not move.
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.params.items())
    assert all(torch.equal(w.detach(), f) for w, f in zip(quantized, frozen, strict=True))


def test_quantization_without_lora_is_refused(tiny_model_dir: str):
    from alpacafarm.errors import UserError
    from alpacafarm_methods.ppo.config import PPOMethodConfig
    from alpacafarm_methods.ppo.method import build_ppo_trainer

    with pytest.raises(UserError, match="PPO cannot train quantized weights: add 'lora:'"):
        build_ppo_trainer(PPOMethodConfig(output_dir="unused", rollout_batch_size=4, mini_batch_size=4),
                          ModelSpec(name=tiny_model_dir, quantization="4bit"), tiny_model_dir, tiny_model_dir,
                          PROMPTS)



# ------------------------------------------------------------------- LoRA policy, reward model on its own base


def test_lora_policy_with_a_full_weight_reward_model_trains_a_critic_on_its_backbone(
        full_run, tiny_model_dir: str, tmp_path: Path):
    """The common case (a LoRA reward model trained on a LoRA SFT model is saved merged): the critic is the reward
    model with a fresh adapter and a zero head, and the reward model scores through the same backbone, adapter off;
    a checkpoint of this layout (trained tensors only) resumes into a fresh trainer."""
    from alpacafarm.model_loading import is_adapter_folder
    from alpacafarm.rewards import RewardScorer

    spec = ModelSpec(name=tiny_model_dir, lora={"r": 4, "alpha": 8})
    rm_path = full_run["artifacts"]["rm"].path
    assert not is_adapter_folder(rm_path)
    trainer = _trainer(tiny_model_dir, rm_path, spec, output_dir=str(tmp_path / "ppo"), save_strategy="steps",
                       save_steps=1)
    _assert_critic_starts_at_zero(trainer)
    assert len(_llama_backbones(trainer)) == 2  # the SFT base and the reward model's: no third copy
    records, completions = PROMPTS[:3], ["A fine answer.", "No.", "Item 3 is useful and interesting."]
    alone = RewardScorer.from_path(rm_path, spec).score_records(records, completions)
    assert trainer.reward_fn(records, completions) == pytest.approx(alone, abs=1e-5)
    trainer.train()
    assert trainer.reward_fn(records, completions) == pytest.approx(alone, abs=1e-5)

    from safetensors import safe_open

    with safe_open(str(tmp_path / "ppo/checkpoint-2/model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == set(trainer.params)  # the trained tensors, not the frozen bases
    resumed = _trainer(tiny_model_dir, rm_path, spec, output_dir=str(tmp_path / "ppo"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "ppo/checkpoint-2"))
    for name, param in trainer.params.items():
        assert torch.equal(resumed.params[name], param), name


def test_reward_adapters_on_another_base_are_loaded_merged_for_the_critic(lora_run, tmp_path: Path):
    from alpacafarm.testing import save_tiny_causal_lm

    sft = save_tiny_causal_lm(tmp_path / "other-sft", seed=1)  # not the base the reward adapters were trained on
    spec = ModelSpec(name=sft, lora={"r": 4, "alpha": 8})
    rm_path = lora_run["artifacts"]["rm"].path
    trainer = _trainer(sft, rm_path, spec, value_head_init="reward_head")
    assert set(trainer.models.actor_critic.policy.peft_config) == {"default"}
    assert_value_is_the_reward(trainer, spec, rm_path)  # the reward_head start: values are the reward at step 0


# ------------------------------------------------------------------------------ precision: fp32 master weights


def test_bfloat16_models_train_float32_master_weights_that_move_at_the_paper_learning_rate(
        full_run, tiny_model_dir: str, tmp_path: Path):
    """``dtype: bfloat16`` is for the frozen copies: at lr 1e-5 updates are below bfloat16's resolution, so the
    trained weights must be float32 or most of them never move."""
    from safetensors.torch import load_file

    from alpacafarm.model_loading import save_model

    rm_path = full_run["artifacts"]["rm"].path

    def train(dtype: str) -> tuple[Any, float]:
        spec = ModelSpec(name=tiny_model_dir, dtype=dtype)
        trainer = _trainer(tiny_model_dir, rm_path, spec, learning_rate=1e-5, seed=3)
        before = {n: p.detach().clone() for n, p in trainer.params.items()
                  if n.startswith("policy.") and "embed_tokens" not in n}
        trainer.train()
        changed = sum(int((trainer.params[n].detach() != p).sum()) for n, p in before.items())
        return trainer, changed / sum(p.numel() for p in before.values())

    trainer, moved_bf16 = train("bfloat16")
    models = trainer.models
    assert all(p.dtype == torch.float32 for p in trainer.params.values())
    assert any(n.startswith("critic.") for n in trainer.params)
    assert {p.dtype for p in models.reference.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.reward_fn.model.parameters()} == {torch.bfloat16}
    _, moved_fp32 = train("float32")
    assert moved_fp32 > 0.5 and moved_bf16 >= 0.8 * moved_fp32, (moved_bf16, moved_fp32)

    # Saved in the recipe's dtype; the float32 master weights in memory are left as they are.
    save_model(trainer.policy, trainer.tokenizer, tmp_path / "model", ModelSpec(name=tiny_model_dir, dtype="bfloat16"),
               start_from=tiny_model_dir, state_dict=trainer.policy_state_dict())
    assert {t.dtype for t in load_file(str(tmp_path / "model/model.safetensors")).values()} == {torch.bfloat16}
    assert {p.dtype for p in models.actor_critic.policy.parameters()} == {torch.float32}

    # LoRA: the adapters and the value head are float32, the two frozen bases bfloat16; a step runs on a CPU.
    spec = ModelSpec(name=tiny_model_dir, dtype="bfloat16", lora={"r": 4, "alpha": 8})
    trainer = _trainer(tiny_model_dir, rm_path, spec, max_steps=1, learning_rate=1e-5)
    assert all(p.dtype == torch.float32 for p in trainer.params.values())
    frozen = [p for n, p in trainer.models.actor_critic.named_parameters() if "lora_" not in n
              and not p.requires_grad]
    assert frozen and {p.dtype for p in frozen} == {torch.bfloat16}
    assert trainer.train().global_step == 1


# ------------------------------------------------------------------------------------------------ logging


def test_step_metrics_go_to_the_report_to_trackers(tmp_path: Path):
    """``report_to: tensorboard``: every logged step reaches TensorBoard through ``accelerator.log``; a tracker
    accelerate does not know, or whose package is missing, is one line naming it (accelerate would drop it)."""
    from alpacafarm.errors import UserError
    from alpacafarm.testing import tiny_causal_lm, tiny_sequence_classifier, tiny_tokenizer
    from alpacafarm_methods.ppo.config import PPOMethodConfig
    from alpacafarm_methods.ppo.models import SeparateModels, ValueModel
    from alpacafarm_methods.ppo.trainer import PPOTrainer

    tokenizer = tiny_tokenizer()
    policy = tiny_causal_lm(tokenizer)

    def build(report_to: list[str]) -> PPOTrainer:
        models = SeparateModels(policy, copy.deepcopy(policy),
                                ValueModel.from_classifier(tiny_sequence_classifier(tokenizer)))
        args = PPOMethodConfig(output_dir=str(tmp_path / "ppo"), max_steps=2, warmup_steps=0, rollout_batch_size=4,
                               mini_batch_size=4, per_device_train_batch_size=4, generation_batch_size=4,
                               max_new_tokens=4, save_strategy="no", report_to=report_to)
        return PPOTrainer(args, models, tokenizer, PROMPTS[:4], lambda r, c: [float(len(x)) for x in c])

    build(["tensorboard"]).train()
    from alpacafarm.testing import tensorboard_scalars

    tags = tensorboard_scalars(tmp_path / "ppo")
    for key in ("score", "kl", "policy_loss", "value_loss", "learning_rate"):
        assert len(tags[f"ppo/{key}"]) == 2, (key, sorted(tags))
    with pytest.raises(UserError, match="report_to: 'nosuchtracker' is not a tracker accelerate can log to"):
        build(["nosuchtracker"])


# ------------------------------------------------------------------------------- snapshots over training


class _LongerAnswerJudge:
    """Prefers the longer output (ties: the first): a judge with no model, for the evaluation's plumbing."""

    def __init__(self, config: Any = None) -> None:
        self.name = "longer"

    async def aannotate(self, pairs: Any, progress: Any = None, *, replicate: int = 0) -> list[Any]:
        from alpacafarm.types import Annotation

        return [Annotation(1 if len(p.output_1) >= len(p.output_2) else 2, self.name) for p in pairs]


def test_snapshots_are_saved_sampled_and_judged_step_by_step(one_torch_thread: None, tiny_model_dir: str,
                                                             tmp_path: Path, register_test_plugin):
    import alpacafarm
    from alpacafarm.annotation import Annotator
    from alpacafarm.artifacts import System

    judge = type("LongerAnswerJudge", (_LongerAnswerJudge, Annotator), {})

    class Plugin:
        @alpacafarm.hookimpl
        def register_annotators(self, register):
            register("longer_answer", judge)

    register_test_plugin(Plugin(), "snapshot-test")
    references = write_records(tmp_path / "refs.jsonl", [{**p, "output": "A reference answer."} for p in PROMPTS])
    recipe = ppo_recipe(tmp_path, tiny_model_dir)
    text = recipe.read_text().replace("save_steps: 2,", "save_steps: 2, snapshot_steps: 2,")
    text = text.replace("config: {split: eval, sampling:", "config: {split: eval, snapshots: true, sampling:")
    recipe.write_text(text + "evaluation:\n  evaluator: win_rate\n  annotator: longer_answer\n  policy: outputs\n"
                      f"  config: {{references: {{path: {references}}}, reference_field: output}}\n")
    artifacts = run_recipe(recipe, tmp_path / "run")

    stage = tmp_path / "run" / "stages" / "ppo"
    listed = {s.step: s.path for s in artifacts["ppo"].snapshots}
    assert listed == {2: str(stage / "snapshots/step-2"), 4: str(stage / "model")}
    weights = [load_weights(Path(folder)) for folder in listed.values()]
    assert all(not torch.equal(a, b) for a, b in itertools.pairwise(weights))  # each step moved it
    assert not list((stage / "snapshots").glob("*.partial"))

    outputs = tmp_path / "run" / "stages" / "outputs"
    systems = artifacts["outputs"].systems
    scores = {s.step: s.train_reward for s in artifacts["ppo"].snapshots}
    logged = steps_of(json.loads((stage / "metrics.json").read_text())["log_history"])
    # each snapshot's training reward: the mean rollout reward of the steps that led to it, not its last step's
    assert scores == pytest.approx({2: (logged[1]["score"] + logged[2]["score"]) / 2,
                                    4: (logged[3]["score"] + logged[4]["score"]) / 2})
    assert systems == [System(f"outputs@{s}", str(outputs / ("outputs.jsonl" if s == 4 else f"step-{s}.jsonl")),
                              step=s, train_reward=scores[s]) for s in (2, 4)]
    for system in systems:
        assert len(Path(system.outputs).read_text().splitlines()) == 4

    evaluation = tmp_path / "run" / "stages" / "evaluate"
    rows = json.loads((evaluation / "results.json").read_text())["rows"]
    assert [(r["system"], r["step"]) for r in rows] == [(f"outputs@{s}", s) for s in (2, 4)]
    assert all(isinstance(r["proxy_reward"], float) for r in rows)
    assert [r["train_reward"] for r in rows] == [scores[s] for s in (2, 4)]
    assert (evaluation / "over_training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_snapshots_training_reward_is_the_mean_over_the_steps_since_the_one_before():
    from alpacafarm_methods.ppo.method import snapshot_rewards

    steps = [{"step": s, "score": float(s)} for s in range(1, 9)] + [{"step": 9, "kl": 0.1}]  # a row without score
    assert snapshot_rewards(steps, [8, 4]) == {4: 2.5, 8: 6.5}  # (1+2+3+4)/4 and (5+6+7+8)/4, in step order
    assert snapshot_rewards(steps, [3, 9]) == {3: 2.0, 9: 6.0}  # the last window holds steps 4..8 (9 has no score)
    assert snapshot_rewards([], [2]) == {2: None}  # nothing logged: no number made up


def load_weights(folder: Path) -> torch.Tensor:
    """Every weight of a saved model folder, flattened into one vector."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    return torch.cat([tensors[k].flatten().float() for k in sorted(tensors)])


def test_snapshots_of_a_stage_that_wrote_none_is_one_line(tiny_model_dir: str, tmp_path: Path):
    from alpacafarm.errors import UserError

    recipe = tmp_path / "r.yaml"
    instructions = write_records(tmp_path / "instructions.jsonl", PROMPTS[:6])
    recipe.write_text(f"name: no-snapshots\nmodel: {{name: {tiny_model_dir}}}\n"
                      f"data:\n  instructions: {{path: {instructions}}}\n"
                      "stages:\n  - {name: split, method: split_instructions, config: {eval_size: 2}}\n"
                      "  - {name: outputs, method: generate_outputs,"
                      " config: {snapshots: true, sampling: {max_new_tokens: 2, batch_size: 2}}}\n")
    with pytest.raises(UserError, match="snapshots: true, but the model's stage hands on no snapshots"):
        run_recipe(recipe, tmp_path / "run")


def test_a_policy_whose_forward_cannot_keep_only_the_response_logits_is_one_line():
    """Every forward passes ``logits_to_keep`` (transformers' causal LMs take it); no signature is inspected, and a
    model class that does not take it fails in one line naming it."""
    from transformers import LlamaForCausalLM

    from alpacafarm.errors import UserError
    from alpacafarm.testing import tiny_causal_lm, tiny_sequence_classifier, tiny_tokenizer
    from alpacafarm_methods.ppo.models import SeparateModels, ValueModel
    from alpacafarm_methods.ppo.rollouts import collate

    class AllLogitsLM(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=use_cache)

    tokenizer = tiny_tokenizer()
    plain = tiny_causal_lm(tokenizer)
    batch = collate([[1, 2, 3]], [[5, 6]], tokenizer.pad_token_id)
    critic = ValueModel.from_classifier(tiny_sequence_classifier(tokenizer))
    logits, _ = SeparateModels(plain, copy.deepcopy(plain), critic).actor_critic(**vars(batch))
    assert logits.shape[:2] == (1, 2)
    odd = AllLogitsLM(plain.config)
    models = SeparateModels(odd, copy.deepcopy(odd), critic)
    with pytest.raises(UserError, match=r"^PPO needs a causal LM whose forward takes logits_to_keep .*; "
                                        r"AllLogitsLM does not$"):
        models.actor_critic(**vars(batch))
    with pytest.raises(UserError, match="AllLogitsLM does not"):
        models.reference_logits(batch)


def test_bf16_true_autocasts_the_ppo_update_on_a_cpu_that_computes_bfloat16(
        full_run, tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch):
    """PPO's own Accelerator loop honours ``bf16: true`` on a CPU with AVX512-BF16 (it was always turned off without
    a GPU; on this repo's 2-core CPU a SmolLM2 step then took 86 s where autocast takes 47 s): the update's matmuls
    run in bfloat16, the weights stay float32."""
    import alpacafarm.hardware as hardware

    hardware.native_bfloat16.cache_clear()
    monkeypatch.setattr(hardware, "cpu_flags", lambda cpuinfo=None: frozenset({"avx2", "avx512_bf16"}))
    try:
        trainer = _trainer(tiny_model_dir, full_run["artifacts"]["rm"].path, ModelSpec(name=tiny_model_dir),
                           bf16=True, max_steps=1)
        layer = next(m for n, m in trainer.policy.named_modules() if n.endswith("mlp.down_proj"))
        seen: set[torch.dtype] = set()
        handle = layer.register_forward_hook(lambda module, args, output: seen.add(output.dtype))
        trainer.train()
        handle.remove()
        assert seen == {torch.bfloat16}
        assert all(p.dtype == torch.float32 for p in trainer.params.values())
    finally:
        hardware.native_bfloat16.cache_clear()
