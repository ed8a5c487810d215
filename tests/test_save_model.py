"""``alpacafarm.model_loading.save_model``: the one function that writes a trained model folder, for every trainer
(full weights in the save dtype, LoRA adapters, adapters merged, adapters trained on an adapter folder), with the
tokenizer and the prompt conditioning, whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from alpacafarm.errors import UserError
from alpacafarm.prompts import PromptConditioning, PromptFormat
from alpacafarm.recipe import ModelSpec
from alpacafarm.testing import save_tiny_causal_lm, tiny_causal_lm, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_the_model_block_decides_what_is_written(tmp_path: Path):
    from peft import PeftConfig, get_peft_model

    from alpacafarm.model_loading import (
        is_adapter_folder,
        load_causal_lm,
        load_merged_causal_lm,
        lora_config,
        save_model,
    )

    base = save_tiny_causal_lm(tmp_path / "base")
    tokenizer = tiny_tokenizer()

    # Full weights: in the save dtype, the float32 master copy untouched; the conditioning saved beside them.
    model = tiny_causal_lm(tokenizer)
    conditioning = PromptConditioning(prompt_prefix="<good> ")
    spec = ModelSpec(name=base, dtype="bfloat16")
    assert save_model(model, tokenizer, tmp_path / "full", spec, start_from=base, conditioning=conditioning) is False
    assert {t.dtype for t in weights(tmp_path / "full").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "full/config.json").read_text())["dtype"] == "bfloat16"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert PromptFormat.for_model("alpaca", str(tmp_path / "full"), tokenizer).conditioning == conditioning
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "full"]  # no .partial folder left

    # LoRA on full weights: an adapter folder naming its base; no conditioning file when there is none.
    lora = ModelSpec(name=base, lora={"r": 4, "alpha": 8})
    adapters = get_peft_model(load_causal_lm(lora, base), lora_config(lora))
    assert save_model(adapters, tokenizer, tmp_path / "adapters", lora, start_from=base) is False
    assert is_adapter_folder(tmp_path / "adapters") and not (tmp_path / "adapters/model.safetensors").exists()
    assert PeftConfig.from_pretrained(str(tmp_path / "adapters")).base_model_name_or_path == base
    assert not list((tmp_path / "adapters").glob("*conditioning*"))

    # New adapters trained on an adapter folder describe a model no folder holds: merged into full weights.
    stacked = get_peft_model(load_merged_causal_lm(lora, str(tmp_path / "adapters")), lora_config(lora))
    assert save_model(stacked, tokenizer, tmp_path / "stacked", lora, start_from=str(tmp_path / "adapters")) is True
    assert not is_adapter_folder(tmp_path / "stacked") and weights(tmp_path / "stacked")

    # merge_adapters: merged whatever the start.
    merged_spec = ModelSpec(name=base, lora={"r": 4, "alpha": 8}, merge_adapters=True)
    adapters = get_peft_model(load_causal_lm(merged_spec, base), lora_config(merged_spec))
    assert save_model(adapters, tokenizer, tmp_path / "merged", merged_spec, start_from=base) is True
    assert weights(tmp_path / "merged").keys() == weights(Path(base)).keys()


def test_diverged_weights_leave_nothing_behind(tmp_path: Path):
    from alpacafarm.model_loading import save_model

    tokenizer = tiny_tokenizer()
    model = tiny_causal_lm(tokenizer)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    with pytest.raises(UserError, match=r"^the trained weights for .*model are not finite \(NaN or inf in "):
        save_model(model, tokenizer, tmp_path / "model", ModelSpec(name="unused"))
    assert not list(tmp_path.iterdir())


def test_a_merged_save_leaves_the_model_in_training_as_it_was(tmp_path: Path):
    """PPO writes merged snapshots of a LoRA policy mid-training: the save must not merge the adapters into the
    live model (peft's merge_and_unload does that in place), or every later step trains a different model."""
    from peft import get_peft_model

    from alpacafarm.model_loading import load_causal_lm, load_merged_causal_lm, lora_config, save_model

    base = save_tiny_causal_lm(tmp_path / "base")
    tokenizer = tiny_tokenizer()
    spec = ModelSpec(name=base, lora={"r": 4, "alpha": 8}, merge_adapters=True)
    model = get_peft_model(load_causal_lm(spec, base), lora_config(spec)).eval()  # eval: no LoRA dropout
    with torch.no_grad():  # adapters that change the outputs (peft starts lora_B at zero)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    ids = torch.tensor([[1, 2, 3, 4]])
    before = model(input_ids=ids).logits.detach()
    lora = sorted(name for name, _ in model.named_parameters() if "lora_" in name)

    assert save_model(model, tokenizer, tmp_path / "snapshot", spec, start_from=base) is True

    assert sorted(name for name, _ in model.named_parameters() if "lora_" in name) == lora
    assert torch.equal(model(input_ids=ids).logits.detach(), before)
    saved = load_merged_causal_lm(ModelSpec(name=str(tmp_path / "snapshot")), str(tmp_path / "snapshot"))
    assert torch.allclose(saved(input_ids=ids).logits, before, atol=1e-5)
