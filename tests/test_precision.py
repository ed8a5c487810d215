"""Trainable weights keep float32 master copies whatever ``model.dtype`` says; frozen copies keep ``dtype``;
saved full weights are written in ``model.save_dtype`` (default ``dtype``).

Pure-bf16 training loses most AdamW updates at the paper's learning rates (1e-6 to 1e-5): a step moves a
weight by about the learning rate, far below bfloat16's resolution for a typical weight.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from alpacafarm.recipe import LoraSpec, ModelSpec
from alpacafarm.testing import save_tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SFT_RECORDS = [{"instruction": f"Name colour number {i}.", "input": "", "output": f"Colour {i} is a shade of blue."}
               for i in range(8)]
PAIRS = [{"prompt": f"Question {i}: ", "chosen": f"A kind helpful answer {i}.", "rejected": "No."} for i in range(8)]


@pytest.fixture(scope="module")
def fp32_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny model whose weights are written in float32 (the dtype the tests compare against)."""
    return save_tiny_causal_lm(tmp_path_factory.mktemp("fp32-model"))


def _initial(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def _changed_fraction(model: Any, initial: dict[str, torch.Tensor]) -> float:
    changed = total = 0
    for name, tensor in model.state_dict().items():
        if name in initial and tensor.is_floating_point():
            changed += int((tensor.float() != initial[name].float()).sum())
            total += tensor.numel()
    return changed / total


def _sft_trainer(path: str, tmp_path: Path, dtype: str, *, lora: bool = False, steps: int = 20) -> Any:
    from alpacafarm_methods.supervised.sft import SFTMethodConfig, build_sft_trainer

    spec = ModelSpec(name=path, dtype=dtype, lora=LoraSpec(r=4, alpha=8) if lora else None)
    config = SFTMethodConfig(output_dir=str(tmp_path / dtype), max_steps=steps, learning_rate=1e-5,
                             per_device_train_batch_size=2, lr_scheduler_type="constant", warmup_steps=0,
                             save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    return build_sft_trainer(config, spec, path, SFT_RECORDS)


def test_sft_at_the_paper_learning_rate_moves_bf16_weights_as_float32_ones(fp32_model_dir: str, tmp_path: Path):
    initial = _initial(fp32_model_dir)
    moved = {}
    for dtype in ("float32", "bfloat16"):
        trainer = _sft_trainer(fp32_model_dir, tmp_path, dtype)
        assert {p.dtype for p in trainer.model.parameters() if p.requires_grad} == {torch.float32}
        trainer.train()
        moved[dtype] = _changed_fraction(trainer.model, initial)
    assert moved["float32"] > 0.3  # 20 AdamW steps at lr 1e-5 move most float32 weights
    assert moved["bfloat16"] >= 0.9 * moved["float32"], moved  # pure bf16 moved ~1/6 as many


def test_lora_keeps_the_frozen_base_in_bf16_and_trains_float32_adapters(fp32_model_dir: str, tmp_path: Path):
    trainer = _sft_trainer(fp32_model_dir, tmp_path, "bfloat16", lora=True, steps=2)
    trainable = {n: p.dtype for n, p in trainer.model.named_parameters() if p.requires_grad}
    frozen = {p.dtype for p in trainer.model.parameters() if not p.requires_grad}
    assert trainable and set(trainable.values()) == {torch.float32} and frozen == {torch.bfloat16}
    trainer.train()


def test_lora_reward_model_head_trains_in_float32_over_a_bf16_base(fp32_model_dir: str, tmp_path: Path):
    from alpacafarm_methods.reward_model.method import RewardModelConfig, build_reward_trainer

    spec = ModelSpec(name=fp32_model_dir, dtype="bfloat16", lora=LoraSpec(r=4, alpha=8))
    config = RewardModelConfig(output_dir=str(tmp_path / "rm"), max_steps=2, per_device_train_batch_size=4,
                               learning_rate=1e-5, save_strategy="no", report_to="none", disable_tqdm=True)
    trainer = build_reward_trainer(config, spec, fp32_model_dir, PAIRS)
    trainable = {n: p.dtype for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("score" in n for n in trainable) and set(trainable.values()) == {torch.float32}
    trainer.train()  # the float32 head runs on the bf16 backbone's features without autocast (a CPU)


def test_dpo_trains_a_float32_policy_against_a_frozen_bf16_reference(fp32_model_dir: str, tmp_path: Path):
    from alpacafarm.preference_training import DPOMethodConfig, build_dpo_trainer

    spec = ModelSpec(name=fp32_model_dir, dtype="bfloat16")
    config = DPOMethodConfig(output_dir=str(tmp_path / "dpo"), max_steps=1, per_device_train_batch_size=4,
                             save_strategy="no", report_to="none", disable_tqdm=True)
    trainer = build_dpo_trainer(config, spec, fp32_model_dir, PAIRS)
    assert {p.dtype for p in trainer.model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in trainer.ref_model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize(("save_dtype", "expected"), [(None, "bfloat16"), ("float32", "float32")])
def test_saved_full_weights_use_the_save_dtype_and_leave_the_master_copy_alone(
        fp32_model_dir: str, tmp_path: Path, save_dtype: str | None, expected: str):
    from safetensors.torch import load_file

    from alpacafarm.model_loading import save_model

    trainer = _sft_trainer(fp32_model_dir, tmp_path, "bfloat16", steps=1)
    spec = ModelSpec(name=fp32_model_dir, dtype="bfloat16", save_dtype=save_dtype)
    save_model(trainer.model, trainer.processing_class, tmp_path / "saved", spec, start_from=fp32_model_dir)
    written = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert {str(t.dtype).removeprefix("torch.") for t in written.values()} == {expected}
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["dtype"] == expected
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}  # still training in float32


@pytest.mark.parametrize("sft_layout", ["adapters", "full"])
def test_a_lora_reward_model_scores_after_reload_as_it_did_in_training(fp32_model_dir: str, tmp_path: Path,
                                                                       sft_layout: str):
    """An RM trained with LoRA on a LoRA SFT model (adapter folder) reloads on the SFT weights, not the pre-SFT
    base that its adapters' ``base_model_name_or_path`` names; on a full-weights SFT model it stays adapters."""
    from alpacafarm.model_loading import is_adapter_folder, save_model
    from alpacafarm.rewards import RewardScorer
    from alpacafarm_methods.reward_model.method import RewardModelConfig, build_reward_trainer

    sft = _sft_trainer(fp32_model_dir, tmp_path, "float32", lora=sft_layout == "adapters", steps=3)
    sft.args.learning_rate = 1e-2  # SFT weights far from the base, so scoring on the wrong base shows
    sft.train()
    sft_dir = tmp_path / "sft"
    save_model(sft.model, sft.processing_class, sft_dir)
    assert is_adapter_folder(sft_dir) == (sft_layout == "adapters")

    spec = ModelSpec(name=fp32_model_dir, dtype="float32", lora=LoraSpec(r=4, alpha=8))
    config = RewardModelConfig(output_dir=str(tmp_path / "rm"), max_steps=3, per_device_train_batch_size=4,
                               learning_rate=1e-2, save_strategy="no", report_to="none", disable_tqdm=True)
    trainer = build_reward_trainer(config, spec, str(sft_dir), PAIRS)
    trainer.train()
    texts = [p["prompt"] + p[side] for p in PAIRS[:4] for side in ("chosen", "rejected")]
    in_training = RewardScorer(trainer.model.eval(), trainer.processing_class, prompt_format="alpaca")
    expected = in_training.score_texts(texts, batch_size=4)
    save_model(trainer.model, trainer.processing_class, tmp_path / "rm-model", spec, start_from=str(sft_dir))
    reloaded = RewardScorer.from_path(str(tmp_path / "rm-model"), spec).score_texts(texts, batch_size=4)
    assert reloaded == pytest.approx(expected, abs=1e-4)
    assert len(set(round(x, 4) for x in expected)) > 1  # a trained head, not a constant


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_reward_model_starts_the_same_whatever_ran_before_in_the_process(fp32_model_dir: str, tmp_path: Path,
                                                                           lora: bool):
    """The score head and LoRA adapters are drawn before the Trainer seeds itself; the builder seeds first, so a
    resumed run (or one with other stages before it in the process) trains the same reward model."""
    from alpacafarm_methods.reward_model.method import RewardModelConfig, build_reward_trainer

    spec = ModelSpec(name=fp32_model_dir, dtype="float32", lora=LoraSpec(r=4, alpha=8) if lora else None)
    config = RewardModelConfig(output_dir=str(tmp_path / "rm"), max_steps=1, save_strategy="no", report_to="none",
                               disable_tqdm=True, seed=3)
    initial = []
    for noise in (1, 2):
        torch.manual_seed(noise)
        torch.rand(noise * 100)  # some other stage drew random numbers first
        trainer = build_reward_trainer(config, spec, fp32_model_dir, PAIRS)
        initial.append({n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad})
    assert initial[0].keys() == initial[1].keys()
    for name, tensor in initial[0].items():
        assert torch.equal(tensor, initial[1][name]), name


@pytest.mark.parametrize("native", [True, False])
def test_bf16_true_autocasts_training_on_a_cpu_only_where_it_computes_bfloat16(
        fp32_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool):
    """``bf16: true`` was always turned off without a GPU, so a CPU with AVX512-BF16 trained at half the speed it
    has (a SmolLM2 step: 22.6 s float32, 11.5 s autocast). Now it autocasts there, keeping float32 master weights,
    and stays float32 where bfloat16 would be emulated."""
    import alpacafarm.hardware as hardware
    from alpacafarm.hardware import native_bfloat16
    from alpacafarm.preference_training import DPOMethodConfig, build_dpo_trainer

    native_bfloat16.cache_clear()
    flags = "avx2 avx512f avx512_bf16" if native else "avx2 fma"
    monkeypatch.setattr(hardware, "cpu_flags", lambda cpuinfo=None: frozenset(flags.split()))
    try:
        config = DPOMethodConfig(output_dir=str(tmp_path / "dpo"), max_steps=1, per_device_train_batch_size=4,
                                 save_strategy="no", report_to="none", disable_tqdm=True, bf16=True)
        assert config.bf16 is native
        assert config.device_notes == [
            "bf16: true: training with bfloat16 autocast on this CPU (avx512_bf16), float32 master weights" if native
            else "bf16: true needs bfloat16 arithmetic in hardware (a GPU from Ampere on, or a CPU with amx_bf16 or "
                 "avx512_bf16); this machine has none, so training runs in float32"]
        trainer = build_dpo_trainer(config, ModelSpec(name=fp32_model_dir, dtype="float32"), fp32_model_dir, PAIRS)
        seen: set[torch.dtype] = set()
        layer = next(m for n, m in trainer.model.named_modules() if n.endswith("mlp.down_proj"))
        handle = layer.register_forward_hook(lambda module, args, output: seen.add(output.dtype))
        trainer.train()
        handle.remove()
        assert seen == {torch.bfloat16 if native else torch.float32}
        assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}  # master weights
    finally:
        native_bfloat16.cache_clear()
