"""The ``ppo`` method: PPO arithmetic against hand-computed values, learning on a tiny model, and the recipe
path (full fine-tuning and LoRA on one shared base), checkpoints and resume, rollouts behind the SFT folder's
prompt conditioning."""

from __future__ import annotations

import copy
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
from alpacafarm_trl import ppo_core

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


PPO_CONFIG = ("{max_steps: 4, rollout_batch_size: 8, mini_batch_size: 4, per_device_train_batch_size: 4,"
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


# --------------------------------------------------------------------------------------------- the arithmetic


def test_kl_shaped_rewards_and_gae_match_hand_computed_values():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -5.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.5, -3.5], [-2.0, -1.0, -1.0]])
    scores = torch.tensor([2.0, -1.0])
    rewards, kl = ppo_core.kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=0.1)
    # kl = logp - ref on real tokens; the score lands on each row's last real token, padding stays 0.
    close(kl, [[0.5, -0.5, 0.5], [1.0, 0.0, 0.0]])
    assert rewards.tolist()[0] == pytest.approx([-0.05, 0.05, 1.95])
    assert rewards.tolist()[1] == pytest.approx([-0.1, -1.0, 0.0])

    rewards = torch.tensor([[0.1, -0.2, 1.0], [0.3, 2.0, 9.0]])  # 9.0 and 7.0 sit on padding: ignored
    values = torch.tensor([[0.5, 0.4, 0.3], [1.0, -1.0, 7.0]])
    advantages, returns = ppo_core.compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # gamma = lambda = 1: returns are reward-to-go, advantages returns minus values.
    assert returns.tolist()[0] == pytest.approx([0.9, 0.8, 1.0])
    assert returns.tolist()[1] == pytest.approx([2.3, 2.0, 0.0])
    assert advantages.tolist()[0] == pytest.approx([0.4, 0.4, 0.7])
    assert advantages.tolist()[1] == pytest.approx([1.3, 3.0, 0.0])

    # gamma = lambda = 0.5 on the first row, by hand: deltas 0.7, -0.45, -0.2 from the end.
    advantages, returns = ppo_core.compute_gae(rewards[:1], values[:1], mask[:1], gamma=0.5, lam=0.5)
    assert advantages.tolist()[0] == pytest.approx([-0.26875, -0.275, 0.7])
    assert returns.tolist()[0] == pytest.approx([0.23125, 0.125, 1.0])

    whitened = ppo_core.masked_whiten(torch.tensor([[1.0, 2.0], [3.0, 100.0]]),
                                      torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    close(whitened, [[-1.224745, 0.0], [1.224745, 0.0]])
    kept_mean = ppo_core.masked_whiten(torch.tensor([[1.0, 3.0]]), torch.ones(1, 2), shift_mean=False)
    close(kept_mean, [[1.0, 3.0]], atol=1e-4)  # std 1 already, mean 2 kept


def test_clipped_losses_match_hand_computed_values():
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0]])
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.7, 3.0]])
    new = (old + ratios.log()).requires_grad_(True)
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # the last token is padding
    terms = ppo_core.clipped_policy_loss(new, old, advantages, mask, cliprange=0.2)
    # per token max(-A r, -A clip(r)): -1.2 (clipped), -0.5, 1.1, 0.8 (clipped) → mean 0.05
    assert float(terms.loss.detach()) == pytest.approx(0.05)
    assert float(terms.clip_fraction) == pytest.approx(0.5)
    terms.loss.backward()
    # Clipped tokens pass no gradient; the others -A * r / n_tokens.
    assert new.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 4, 1.1 / 4, 0.0, 0.0])
    summed = ppo_core.clipped_policy_loss(new.detach(), old, advantages, mask, cliprange=0.2, denominator=8.0)
    assert float(summed.loss) == pytest.approx(0.2 / 8)

    old_values = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    new_values = torch.tensor([[0.5, -0.1, 1.3, 50.0]])
    returns = torch.tensor([[1.0, 0.5, 0.0, 0.0]])
    value_mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    terms = ppo_core.clipped_value_loss(new_values, old_values, returns, value_mask, cliprange_value=0.2)
    # squared errors: max(0.25, 0.64 clipped), 0.36 either way, max(1.69, 1.44) → 0.5 * mean(0.64, 0.36, 1.69)
    assert float(terms.loss) == pytest.approx(0.5 * (0.64 + 0.36 + 1.69) / 3)
    assert float(terms.clip_fraction) == pytest.approx(1 / 3)

    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    assert float(ppo_core.entropy_of(logits)) == pytest.approx(1.5 * torch.log(torch.tensor(2.0)).item())
    close(ppo_core.logprobs_of(logits, torch.tensor([[1]])), [[torch.log(torch.tensor(0.25)).item()]])


# ------------------------------------------------------------------------------------------------ learning


def _train_on_token_reward(kl_coef: float) -> list[dict[str, Any]]:
    """PPO on a tiny random model, paid for the share of a completion's tokens (its text tokenized again) that
    come from a fixed eighth of the vocabulary."""
    from alpacafarm.testing import tiny_causal_lm, tiny_sequence_classifier, tiny_tokenizer
    from alpacafarm_trl.ppo_config import PPOMethodConfig
    from alpacafarm_trl.ppo_models import SeparateModels, ValueModel
    from alpacafarm_trl.ppo_trainer import PPOTrainer

    tokenizer = tiny_tokenizer()
    policy = tiny_causal_lm(tokenizer)
    critic = ValueModel.from_classifier(tiny_sequence_classifier(tokenizer))
    models = SeparateModels(policy, copy.deepcopy(policy), critic)
    target = set(range(0, len(tokenizer), 8))

    def reward(records, completions):  # an alpacafarm.rewards.RewardFunction: text only, no token ids
        assert len(records) == len(completions) == 16
        ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
        return [sum(t in target for t in row) / max(len(row), 1) for row in ids]

    args = PPOMethodConfig(output_dir="unused", max_steps=24, rollout_batch_size=16, mini_batch_size=8,
                           per_device_train_batch_size=8, generation_batch_size=16, max_new_tokens=8,
                           learning_rate=1e-2, kl_coef=kl_coef, save_strategy="no", seed=1)
    trainer = PPOTrainer(args, models, tokenizer, PROMPTS, reward)
    trainer.train()
    return [e for e in trainer.state.log_history if "score" in e]


def test_reward_rises_while_the_kl_penalty_bounds_the_drift():
    penalised = _train_on_token_reward(kl_coef=0.02)
    free = _train_on_token_reward(kl_coef=0.0)
    for history, gain in ((penalised, 0.05), (free, 0.5)):
        scores = [e["score"] for e in history]
        assert len(history) == 24
        assert history[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # policy = reference at first
        assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + gain  # a random policy scores about 1/8
    # With the penalty the drift stays within a few nats; without it the policy collapses onto target tokens.
    assert max(e["kl"] for e in penalised) < 10.0
    assert free[-1]["kl"] > 20.0 and free[-1]["score"] > 0.8
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

    from alpacafarm_trl.ppo_trainer import LOG_KEYS

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
    assert {p.name for p in (stage / "checkpoint-2").iterdir()} >= {
        "trainable.pt", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"}

    before = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    after = load_file(str(stage / "model/model.safetensors"))
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    outputs_file = full_run["run"] / "stages/outputs/outputs.jsonl"
    outputs = [json.loads(line) for line in outputs_file.read_text().splitlines()]
    assert len(outputs) == 4 and all("output" in o for o in outputs)
    manifest = json.loads((full_run["run"] / "stages/outputs/manifest.json").read_text())
    assert manifest["inputs"]["sft_model"]["from"] == "ppo"


def test_value_model_starts_from_the_reward_model(full_run, tiny_model_dir: str):
    from alpacafarm.modeling import load_classifier
    from alpacafarm_trl.ppo_config import PPOMethodConfig
    from alpacafarm_trl.ppo_trainer import build_ppo_trainer

    spec = ModelSpec(name=tiny_model_dir)
    rm_path = full_run["artifacts"]["rm"].path
    args = PPOMethodConfig(output_dir="unused", max_steps=1, rollout_batch_size=4, mini_batch_size=4)
    trainer = build_ppo_trainer(args, spec, tiny_model_dir, rm_path, PROMPTS[:4])
    classifier = load_classifier(spec, rm_path)
    value = trainer.models.value
    assert torch.equal(value.head.weight, classifier.score.weight)
    pairs = zip(value.backbone.state_dict().items(), classifier.model.state_dict().items(), strict=True)
    for (name, mine), (_, theirs) in pairs:
        assert torch.equal(mine, theirs), name
    # Four models without LoRA: policy, frozen reference, value and reward model (all distinct weights).
    assert trainer.models.reference is not trainer.models.policy
    assert not any(p.requires_grad for p in trainer.models.reference.parameters())
    assert len(_llama_backbones(trainer)) == 4


def _llama_backbones(trainer: Any) -> set[int]:
    """Distinct LlamaModel weights (by storage) reachable from the trainer's models and its reward scorer."""
    from transformers import LlamaModel

    modules = [*trainer.models.modules(), trainer.reward_fn.model]
    storages = set()
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, LlamaModel):
                storages.add(sub.embed_tokens.weight.data_ptr())
    owned = getattr(trainer.reward_fn.model, "_models", None)
    if owned:  # the shared reward classifier runs on the shared base
        storages.add(owned[0].backbone.embed_tokens.weight.data_ptr())
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
    from alpacafarm_trl.ppo_config import PPOMethodConfig
    from alpacafarm_trl.ppo_trainer import build_ppo_trainer

    settings = {"max_steps": 2, "rollout_batch_size": 8, "mini_batch_size": 4,
                "per_device_train_batch_size": 4, "generation_batch_size": 8, "max_new_tokens": 6,
                "learning_rate": 1e-2, "save_strategy": "no", **config}
    args = PPOMethodConfig(output_dir="unused", **settings)
    return build_ppo_trainer(args, spec, tiny_model_dir, lora_run["artifacts"]["rm"].path, PROMPTS[:8])


def test_lora_keeps_one_base_with_policy_value_and_reward_adapters(lora_run, tiny_model_dir: str):
    from transformers import AutoModelForCausalLM

    from alpacafarm.rewards import RewardScorer
    from alpacafarm_trl.ppo_core import collate

    spec = ModelSpec(name=tiny_model_dir, lora={"r": 4, "alpha": 8})
    trainer = _lora_trainer(lora_run, tiny_model_dir, spec)
    models = trainer.models
    assert set(models.peft_model.peft_config) == {"policy", "value", "reward"}
    assert len(_llama_backbones(trainer)) == 1  # policy, reference, value and reward share one base
    trained = set(trainer.params)
    assert trained and all(".policy." in n or ".value." in n or n.startswith("value_head.") for n in trained)
    assert not any(p.requires_grad for n, p in models.peft_model.named_parameters()
                   if ".reward." in n or "lora_" not in n)

    # The reward adapter + head score exactly like the reward model folder loaded on its own.
    records, completions = PROMPTS[:3], ["A fine answer.", "No.", "Item 3 is useful and interesting."]
    alone = RewardScorer.from_path(lora_run["artifacts"]["rm"].path, spec).score_records(records, completions)
    shared = trainer.reward_fn(records, completions)
    assert shared == pytest.approx(alone, abs=1e-5)

    # The reference is the SFT model (adapters disabled), before and after training; the policy moves away.
    sft = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = collate([trainer.queries[0], trainer.queries[1]], [[5, 6, 7], [8, 9]], trainer.pad_id)
    expected = sft(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits[:, -4:-1]
    with torch.no_grad():
        assert torch.allclose(models.reference_logits(batch), expected, atol=1e-5)
        assert torch.allclose(models.policy_logits(batch), expected, atol=1e-5)  # LoRA B starts at zero
    trainer.train()
    with torch.no_grad():
        assert torch.allclose(models.reference_logits(batch), expected, atol=1e-5)
        assert not torch.allclose(models.policy_logits(batch), expected, atol=1e-4)
    reward_a = {n: p for n, p in models.peft_model.named_parameters() if ".reward." in n}
    value_a = {n.replace(".reward.", ".value."): p for n, p in reward_a.items()}
    trained_values = dict(models.peft_model.named_parameters())
    # The critic trained, the reward model did not.
    assert any(not torch.equal(trained_values[n], p) for n, p in value_a.items())
    assert models.peft_model.active_adapter == "policy"


def test_activation_checkpointing_does_not_change_the_shared_update(lora_run, tiny_model_dir: str):
    """Checkpointed layers are recomputed during backward: the value backward must use the value adapter."""
    spec = ModelSpec(name=tiny_model_dir, lora={"r": 4, "alpha": 8})
    trained = []
    for checkpointing in (False, True):
        trainer = _lora_trainer(lora_run, tiny_model_dir, spec, max_steps=1,
                                gradient_checkpointing=checkpointing)
        layers = trainer.models.backbone.layers
        assert all(layer.gradient_checkpointing == checkpointing for layer in layers)
        trainer.train()
        trained.append({n: p.detach().clone() for n, p in trainer.params.items()})
    plain, checkpointed = trained
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_4bit_lora_trains_on_one_quantized_base(lora_run, tiny_model_dir: str):
    pytest.importorskip("bitsandbytes")
    spec = ModelSpec(name=tiny_model_dir, lora={"r": 4, "alpha": 8}, quantization="4bit")
    trainer = _lora_trainer(lora_run, tiny_model_dir, spec)
    assert {type(m).__name__ for m in trainer.models.peft_model.modules()} >= {"Linear4bit"}
    result = trainer.train()
    assert result.global_step == 2 and len(_llama_backbones(trainer)) == 1


def test_quantization_without_lora_is_refused(tiny_model_dir: str):
    from alpacafarm.errors import UserError
    from alpacafarm_trl.ppo_config import PPOMethodConfig
    from alpacafarm_trl.ppo_trainer import build_ppo_trainer

    with pytest.raises(UserError):
        build_ppo_trainer(PPOMethodConfig(output_dir="unused", rollout_batch_size=4, mini_batch_size=4),
                          ModelSpec(name=tiny_model_dir, quantization="4bit"), tiny_model_dir, tiny_model_dir,
                          PROMPTS)

