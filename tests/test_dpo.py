"""The ``dpo`` method: TRL's DPOTrainer on preference pairs, with real training on tiny models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from alpacafarm.recipe import ModelSpec, load_recipe
from alpacafarm.testing import learnable_preferences, run_recipe, write_records

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO_ROOT = Path(__file__).resolve().parents[1]


preference_records = learnable_preferences


UNRANKED = [
    {"instruction": "tie", "input": "", "output_1": "a", "output_2": "b", "preference": 0},
    {"instruction": "unparsed", "input": "", "output_1": "a", "output_2": "b", "preference": None},
]


def dpo_recipe(
    tmp_path: Path, model: str, records: list[dict[str, Any]], *, extra_model: str = "", config: str = ""
) -> Path:
    prefs = write_records(tmp_path / "prefs.jsonl", records)
    path = tmp_path / "dpo.yaml"
    path.write_text(
        "name: dpo-test\n"
        f"model: {{name: {model}{extra_model}}}\n"
        f"data:\n  preferences: {{path: {prefs}}}\n"
        "stages:\n  - name: dpo\n    method: dpo\n"
        "    config: {per_device_train_batch_size: 8, learning_rate: 1.0e-3, logging_steps: 1, save_strategy: 'no',"
        f" warmup_steps: 0{config}}}\n",
        encoding="utf-8",
    )
    return path


def completion_logps(model: Any, tokenizer: Any, rows: list[dict[str, str]], side: str) -> list[float]:
    """Summed log-probability of ``row[side] + EOS`` after ``row["prompt"]``, per row (as DPO scores a completion)."""
    import torch

    out = []
    with torch.no_grad():
        for row in rows:
            prompt = tokenizer(row["prompt"])["input_ids"]
            ids = tokenizer(row["prompt"] + row[side] + tokenizer.eos_token)["input_ids"]
            assert ids[: len(prompt)] == prompt
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
            logps = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            out.append(float(logps[len(prompt) - 1 :].sum()))
    return out


def margins(model: Any, tokenizer: Any, rows: list[dict[str, str]]) -> list[float]:
    """log p(chosen | x) - log p(rejected | x) per pair."""
    chosen, rejected = (
        completion_logps(model, tokenizer, rows, "chosen"),
        completion_logps(model, tokenizer, rows, "rejected"),
    )
    return [c - r for c, r in zip(chosen, rejected, strict=True)]


def training_rows(model_dir: str, records: list[dict[str, Any]]) -> list[dict[str, str]]:
    from alpacafarm.model_loading import load_tokenizer
    from alpacafarm.preference_rows import preference_rows

    spec = ModelSpec(name=model_dir)
    return preference_rows(records, style=spec.prompt_format, tokenizer=load_tokenizer(spec, model_dir))[0]


# ------------------------------------------------------------------------------------------------ full fine-tuning


@pytest.fixture(scope="module")
def dpo_run(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("dpo")
    records = [*preference_records(64), *UNRANKED]
    recipe = dpo_recipe(tmp_path, tiny_model_dir, records, config=", max_steps: 12, eval_fraction: 0.125")
    artifact = run_recipe(recipe, tmp_path / "run")["dpo"]
    metrics = json.loads((tmp_path / "run/stages/dpo/metrics.json").read_text())
    return {"artifact": artifact, "records": records, "metrics": metrics}


def test_dpo_trains_logs_rewards_and_saves_a_model(dpo_run, tiny_model_dir: str):
    import torch
    from safetensors.torch import load_file

    metadata, history = dpo_run["artifact"].metadata, dpo_run["metrics"]["log_history"]
    assert metadata["steps"] == 12 and metadata["reference"] == "copy" and metadata["beta"] == 0.1
    assert (metadata["n_pairs"], metadata["n_dropped_no_preference"]) == (64, 2)
    assert (metadata["n_train"], metadata["n_eval"]) == (56, 8)
    steps = [e for e in history if "loss" in e]
    assert len(steps) == 12
    first, last = steps[:4], steps[-4:]

    def mean(entries: list[dict[str, Any]], key: str) -> float:
        return sum(e[key] for e in entries) / len(entries)

    # DPO starts at log(2) (policy = reference); the loss falls, the implicit reward margin and accuracy rise.
    assert steps[0]["loss"] == pytest.approx(0.6931, abs=1e-3)
    assert steps[0]["rewards/margins"] == pytest.approx(0, abs=1e-4)
    assert mean(last, "loss") < mean(first, "loss") - 0.2
    assert mean(last, "rewards/margins") > mean(first, "rewards/margins") + 0.5
    assert mean(last, "rewards/accuracies") > 0.9
    assert metadata["rewards/accuracies"] == last[-1]["rewards/accuracies"]
    # held-out pairs: the learned preference generalises to unseen instructions
    assert metadata["eval_rewards/accuracies"] > 0.9 and metadata["eval_rewards/margins"] > 0

    before = load_file(f"{tiny_model_dir}/model.safetensors")
    after = load_file(f"{dpo_run['artifact'].path}/model.safetensors")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)


def test_dpo_policy_margin_grows_against_the_reference(dpo_run, tiny_model_dir: str):
    """The policy's log-prob margin chosen - rejected on the training pairs exceeds the SFT model's."""
    from transformers import AutoModelForCausalLM

    from alpacafarm.model_loading import load_tokenizer

    rows = training_rows(tiny_model_dir, dpo_run["records"])
    assert len(rows) == 64  # ties and unparsed annotations carry no pair
    tokenizer = load_tokenizer(ModelSpec(name=tiny_model_dir), tiny_model_dir)
    reference = margins(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tokenizer, rows)
    policy = margins(AutoModelForCausalLM.from_pretrained(dpo_run["artifact"].path), tokenizer, rows)
    gains = [p - r for p, r in zip(policy, reference, strict=True)]
    assert sum(gains) / len(gains) > 5.0
    assert sum(g > 0 for g in gains) / len(gains) > 0.95


def test_full_fine_tuning_keeps_a_frozen_reference_copy(tiny_model_dir: str, tmp_path: Path):
    import torch

    from alpacafarm.preference_training import DPOMethodConfig, build_dpo_trainer

    rows = training_rows(tiny_model_dir, preference_records(4))
    config = DPOMethodConfig(output_dir=str(tmp_path), max_steps=1, save_strategy="no", report_to=[])
    trainer = build_dpo_trainer(config, ModelSpec(name=tiny_model_dir), tiny_model_dir, rows)
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    policy, reference = dict(trainer.model.named_parameters()), dict(trainer.ref_model.named_parameters())
    assert all(torch.equal(policy[k], reference[k]) for k in policy)

    precomputed = build_dpo_trainer(
        DPOMethodConfig(
            output_dir=str(tmp_path),
            precompute_ref_log_probs=True,
            max_steps=1,
            save_strategy="no",
            report_to=[],
        ),
        ModelSpec(name=tiny_model_dir),
        tiny_model_dir,
        rows,
    )
    assert precomputed.ref_model is None and "ref_chosen_logps" in precomputed.train_dataset.column_names


# ------------------------------------------------------------------------------------------------ LoRA / QLoRA


@pytest.fixture(scope="module")
def lora_sft_dir(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """An SFT stage's un-merged LoRA output: adapters (made non-zero, as after training) + tokenizer."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = tmp_path_factory.mktemp("lora-sft")
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=0.05)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(directory)
    return str(directory)


def test_lora_dpo_has_no_reference_copy_and_its_reference_is_the_sft_model(
    tiny_model_dir: str, lora_sft_dir: str, tmp_path: Path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from alpacafarm.model_loading import load_tokenizer
    from alpacafarm.preference_training import DPOMethodConfig, build_dpo_trainer

    spec = ModelSpec(name=tiny_model_dir, lora={"r": 4, "alpha": 8})
    rows = training_rows(tiny_model_dir, preference_records(32))
    config = DPOMethodConfig(
        output_dir=str(tmp_path),
        max_steps=8,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
    )
    trainer = build_dpo_trainer(config, spec, lora_sft_dir, rows)
    assert (
        trainer.ref_model is None
    )  # no second model in memory: the reference is the policy with adapters off

    tokenizer = load_tokenizer(spec, tiny_model_dir)
    sft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora_sft_dir
    ).merge_and_unload()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    sft_margins = margins(sft, tokenizer, rows[:4])
    assert margins(base, tokenizer, rows[:4]) != pytest.approx(sft_margins, abs=1e-3)
    trainer.train()
    with trainer.model.disable_adapter():
        reference_margins = margins(trainer.model, tokenizer, rows[:4])
    # the frozen reference is the SFT model (its adapters merged), not the base model under them
    assert reference_margins == pytest.approx(sft_margins, abs=1e-4)
    gains = [
        p - r
        for p, r in zip(margins(trainer.model, tokenizer, rows), margins(sft, tokenizer, rows), strict=True)
    ]
    assert sum(gains) / len(gains) > 1.0
    assert [e["loss"] for e in trainer.state.log_history if "loss" in e][-1] < 0.6


def test_lora_dpo_stage_on_an_adapter_sft_saves_full_weights(
    tiny_model_dir: str, lora_sft_dir: str, tmp_path: Path
):
    recipe = dpo_recipe(
        tmp_path,
        lora_sft_dir,
        preference_records(16),
        extra_model=", lora: {r: 4, alpha: 8}",
        config=", max_steps: 2",
    )
    artifact = run_recipe(recipe, tmp_path / "run")["dpo"]
    assert artifact.metadata["reference"] == "adapters disabled" and artifact.metadata["merged"] is True
    assert (Path(artifact.path) / "model.safetensors").is_file()
    assert not (Path(artifact.path) / "adapter_config.json").exists()


def test_qlora_dpo(tiny_model_dir: str, tmp_path: Path):
    pytest.importorskip("bitsandbytes")
    recipe = dpo_recipe(
        tmp_path,
        tiny_model_dir,
        preference_records(16),
        extra_model=", quantization: 4bit, lora: {r: 4, alpha: 8}",
        config=", max_steps: 2",
    )
    artifact = run_recipe(recipe, tmp_path / "run")["dpo"]
    assert artifact.metadata["steps"] == 2 and artifact.metadata["reference"] == "adapters disabled"
    assert (Path(artifact.path) / "adapter_config.json").is_file()


# ------------------------------------------------------------------------------------------------ config and recipe


def test_dpo_config_defaults_and_recipe_errors(tiny_model_dir: str, tmp_path: Path):
    from alpacafarm.errors import RecipeError
    from alpacafarm.preference_training import DPOMethodConfig

    defaults = DPOMethodConfig()
    assert (defaults.beta, defaults.learning_rate, defaults.num_train_epochs, defaults.max_length) == (
        0.1,
        1e-6,
        2.0,
        512,
    )
    assert defaults.bf16 is False and defaults.gradient_checkpointing is False  # CPU: automatic values
    recipe = dpo_recipe(tmp_path, tiny_model_dir, preference_records(4))
    config = load_recipe(
        recipe, ["stages.dpo.config.beta=0.3", "stages.dpo.config.loss_type=[ipo]"]
    ).stage_configs["dpo"]
    assert (config.beta, config.loss_type) == (0.3, ["ipo"])
    with pytest.raises(RecipeError, match="did you mean 'beta'"):
        load_recipe(recipe, ["stages.dpo.config.betta=0.3"])
    with pytest.raises(RecipeError, match="eval_fraction"):
        load_recipe(recipe, ["stages.dpo.config.eval_fraction=1.5"])


def test_paper_recipe_checks():
    from alpacafarm.pipeline import plan
    from alpacafarm.plugins import get_registry

    registry = get_registry()
    loaded = load_recipe(REPO_ROOT / "recipes" / "dpo.yaml", (), registry)
    stages = {s.name: s for s in plan(loaded, registry)}
    assert list(stages) == ["sft", "dpo", "outputs", "evaluate"]
    assert stages["dpo"].inputs == {"sft_model": "sft", "preferences": "preferences"}
    assert stages["outputs"].inputs["sft_model"] == "dpo"
    config = loaded.stage_configs["dpo"]
    assert (config.beta, config.learning_rate, config.num_train_epochs) == (0.1, 1e-5, 1)  # Appendix B.3
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps == 64
