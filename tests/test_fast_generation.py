"""The ``openvino`` generation backend (extra ``fast-cpu``: OpenVINO GenAI's continuous batching on our own
export) samples as the transformers backend does: the same greedy outputs, stop tokens, finished flags and token
counts, ``n`` seeded samples per prompt in the prompts' order, the model's prompt format, and a cached export in
GenAI's layout that a crash cannot leave half-written. Speed is measured by ``benchmarks/generation_throughput.py``,
not here."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from alpacafarm.errors import MissingPackageError
from alpacafarm.generation import SamplingConfig, TransformersGenerator
from alpacafarm.recipe import ModelSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")
openvino = pytest.importorskip("openvino", reason="the fast-cpu extra is not installed")
pytest.importorskip("openvino_genai", reason="the fast-cpu extra is not installed")

PROMPTS = ["Name a fruit that is red.", "Say hi.", "Write a long list of every colour of the rainbow, in order.",
           "What is two plus two?", "Describe a cat."]


def spec_for(path: str, **fields) -> ModelSpec:
    return ModelSpec(name=path, dtype="float32", device="cpu", **fields)


def backend(path: str, **fields):
    from alpacafarm_generation.openvino_backend import OpenVINOBackendConfig, openvino_backend

    return openvino_backend(OpenVINOBackendConfig(), spec_for(path, **fields), path)


def formatted(generator, prompts=PROMPTS) -> list[str]:
    return generator.prompt_format.records([{"instruction": p, "input": ""} for p in prompts])


@pytest.fixture(scope="module")
def engines(tiny_model_dir: str):
    return backend(tiny_model_dir), TransformersGenerator.from_spec(spec_for(tiny_model_dir))


def test_greedy_outputs_token_counts_and_flags_equal_transformers(engines):
    fast, reference = engines
    greedy = SamplingConfig(temperature=0, max_new_tokens=12, batch_size=2)  # 3 batches of mixed lengths
    prompts = formatted(fast)
    assert prompts == formatted(reference)
    assert fast.generate(prompts, greedy) == reference.generate(prompts, greedy)
    assert fast.last_token_counts == reference.last_token_counts
    assert fast.last_finished == reference.last_finished


def test_stop_tokens_of_the_checkpoint_end_responses_as_in_transformers(tmp_path: Path, tiny_model_dir: str):
    """A token the model emits mid-response is made a stop token (generation_config.json): both engines cut
    there and flag the response finished; the others run to max_new_tokens, unfinished."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    greedy = SamplingConfig(temperature=0, max_new_tokens=10, batch_size=8)
    probe = TransformersGenerator.from_spec(spec_for(str(folder)))
    from alpacafarm.sampling import sample, tokenize_prompts

    tokens = [s.response_ids for group in sample(probe.model, probe.tokenizer,
                                                  tokenize_prompts(probe.tokenizer, formatted(probe)),
                                                  temperature=0, max_new_tokens=10) for s in group]
    stop = tokens[0][3]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [probe.tokenizer.eos_token_id, stop]}))

    fast, reference = backend(str(folder)), TransformersGenerator.from_spec(spec_for(str(folder)))
    prompts = formatted(fast)
    assert fast.generate(prompts, greedy) == reference.generate(prompts, greedy)
    assert fast.last_finished == reference.last_finished
    assert fast.last_token_counts == reference.last_token_counts
    assert fast.last_finished[0] == [True] and fast.last_token_counts[0][0] <= 4
    assert [False] in fast.last_finished  # a response that never met a stop token
    for counts, flags in zip(fast.last_token_counts, fast.last_finished, strict=True):
        assert counts[0] <= 10 and (flags[0] or counts[0] == 10)
    assert fast.last_token_ids[0][0][-1] == stop  # kept, as the sampler keeps it


def test_n_seeded_samples_per_prompt(engines):
    fast, _ = engines
    prompts = formatted(fast)
    sampling = SamplingConfig(n=3, temperature=1.0, top_p=0.95, max_new_tokens=8, batch_size=2, seed=7)
    first = fast.generate(prompts, sampling)
    assert [len(group) for group in first] == [3] * len(prompts)
    assert all(len(set(group)) > 1 for group in first)  # three draws, not one repeated
    assert all(c <= 8 for group in fast.last_token_counts for c in group)
    assert fast.generate(prompts, sampling) == first  # same seed, same samples
    assert fast.generate(prompts, sampling.model_copy(update={"seed": 8})) != first


def test_a_sample_does_not_depend_on_its_batch(engines):
    """Prompt i's samples are seeded by (seed, i): the same whatever ``batch_size`` schedules them with."""
    fast, _ = engines
    prompts = formatted(fast)
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=10, batch_size=1, seed=3)
    alone = fast.generate(prompts, sampling)
    assert fast.generate(prompts, sampling.model_copy(update={"batch_size": 5})) == alone


def test_outputs_come_back_in_the_prompts_order(engines):
    """Prompts of different lengths finish at different steps; each answer still lands at its prompt's index."""
    fast, _ = engines
    prompts = formatted(fast)
    greedy = SamplingConfig(temperature=0, max_new_tokens=12, batch_size=8)
    together = fast.generate(prompts, greedy)
    assert together == [fast.generate([p], greedy)[0] for p in prompts]
    assert fast.generate(prompts[::-1], greedy) == together[::-1]


def test_samples_follow_the_models_distribution(engines):
    """First tokens drawn at temperature 0.5 hit the most likely token as often as the model's probability says
    (within 4 standard errors), and top_p below that probability leaves only that token."""
    import math

    import torch

    fast, reference = engines
    prompt = formatted(fast, ["Describe a cat."])
    ids = reference.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        probs = torch.softmax(reference.model(input_ids=ids).logits[0, -1] / 0.5, -1)
    top, p_top = int(probs.argmax()), float(probs.max())
    draws = 400
    fast.generate(prompt, SamplingConfig(n=draws, temperature=0.5, max_new_tokens=1, batch_size=1, seed=1))
    hits = sum(r[0] == top for r in fast.last_token_ids[0])
    assert abs(hits / draws - p_top) < 4 * math.sqrt(p_top * (1 - p_top) / draws) + 1e-9
    fast.generate(prompt, SamplingConfig(n=20, temperature=0.5, top_p=p_top / 2, max_new_tokens=1, batch_size=1))
    assert {r[0] for r in fast.last_token_ids[0]} == {top}


def test_prompt_format_carries_chat_template_and_conditioning(tiny_model_dir: str):
    fast = backend(tiny_model_dir, prompt_format="chat_template")
    reference = TransformersGenerator.from_spec(spec_for(tiny_model_dir, prompt_format="chat_template"))
    assert formatted(fast) == formatted(reference) and "<|user|>" in formatted(fast)[0]


def test_export_is_cached_by_content_and_atomic(tmp_path: Path, tiny_model_dir: str, monkeypatch):
    from alpacafarm.paths import cache_dir
    from alpacafarm_generation import openvino_export as module

    monkeypatch.setenv("ALPACAFARM_CACHE_DIR", str(tmp_path / "cache"))
    first = module.exported_model(spec_for(tiny_model_dir), tiny_model_dir)
    assert first.parent == cache_dir() / "openvino"
    # GenAI's layout: the stateful graph, the converted tokenizer, the configs it reads
    for name in ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml", "config.json",
                 "generation_config.json"):
        assert (first / name).is_file(), name
    graph = openvino.Core().read_model(first / "openvino_model.xml")
    assert {"input_ids", "attention_mask", "position_ids", "beam_idx"} <= {n for p in graph.inputs for n in p.names}
    assert "logits" in graph.outputs[0].names and graph.get_sinks()  # the cache is state inside the graph
    stamp = (first / module.MODEL_FILE).stat().st_mtime_ns
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)  # same content elsewhere: the same export, not a second one
    assert module.exported_model(spec_for(str(copy)), str(copy)) == first
    assert (first / module.MODEL_FILE).stat().st_mtime_ns == stamp

    # A checkpoint whose weights cannot be loaded: the export fails and leaves no folder behind.
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(Exception):  # noqa: B017 -- whatever the loader raises, nothing may be left behind
        module.exported_model(spec_for(str(broken)), str(broken))
    assert sorted(p.name for p in (cache_dir() / "openvino").iterdir() if not p.name.startswith(".")) == [first.name]


@pytest.mark.parametrize("package", ["openvino", "openvino_genai"])
def test_missing_extra_is_one_line_error_naming_it(monkeypatch, tiny_model_dir: str, package: str):
    from alpacafarm.plugins import get_registry

    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    with pytest.raises(MissingPackageError) as error:
        get_registry().create("generation_backend", "openvino", {}, spec=spec_for(tiny_model_dir),
                              model_path=tiny_model_dir)
    assert "alpacafarm[fast-cpu]" in str(error.value) and package in str(error.value)
    assert "\n" not in str(error.value)


def test_bfloat16_on_one_thread_is_refused_in_one_line(tiny_model_dir: str):
    """OpenVINO 2026.4.1 dies of SIGFPE compiling bfloat16 for one thread: refused before it can crash."""
    from alpacafarm.errors import UserError
    from alpacafarm_generation.openvino_backend import OpenVINOBackendConfig, openvino_backend

    with pytest.raises(UserError, match="threads >= 2") as error:
        openvino_backend(OpenVINOBackendConfig(threads=1, precision="bfloat16"), spec_for(tiny_model_dir),
                         tiny_model_dir)
    assert "\n" not in str(error.value)


def test_generate_outputs_stage_runs_on_the_openvino_backend(tmp_path: Path, tiny_model_dir: str):
    from alpacafarm.data import read_records
    from alpacafarm.testing import run_recipe

    stages = "".join(f"""
  - name: {name}
    method: generate_outputs
    config: {{split: eval, backend: {name}, sampling: {{temperature: 0, max_new_tokens: 6, batch_size: 3}}}}"""
                     for name in ("transformers", "openvino"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""
name: fast
model: {{name: {tiny_model_dir}, dtype: float32, device: cpu}}
data:
  instructions: {{builtin: alpaca_eval_sample, limit: 12}}
stages:
  - name: split
    method: split_instructions
    config: {{eval_size: 5}}{stages}
""", encoding="utf-8")
    artifacts = run_recipe(recipe, tmp_path / "run")
    rows = {name: read_records(artifacts[name].path) for name in ("transformers", "openvino")}
    assert len(rows["openvino"]) == 5 and rows["openvino"] == rows["transformers"]
    assert artifacts["openvino"].metadata["tokens_per_second"]


@pytest.mark.slow
def test_smollm2_greedy_outputs_equal_transformers():
    """The real model, float32: the same greedy answers as transformers (short: 3 prompts, 24 tokens)."""
    prompts = PROMPTS[:3]
    fast = backend("smollm2-135m-instruct", prompt_format="chat_template")
    reference = TransformersGenerator.from_spec(spec_for("smollm2-135m-instruct", prompt_format="chat_template"))
    greedy = SamplingConfig(temperature=0, max_new_tokens=24, batch_size=3)
    assert fast.generate(formatted(fast, prompts), greedy) == reference.generate(formatted(reference, prompts),
                                                                                greedy)
    assert fast.last_finished == reference.last_finished
    assert os.environ["ALPACAFARM_CACHE_DIR"]  # the export went to the session cache, not the user's


def test_bfloat16_builds_and_samples_on_this_cpu_whatever_it_computes_natively(tiny_model_dir: str):
    """A bfloat16 model block builds on every CPU: on an AVX2-only CPU (no native bfloat16) OpenVINO 2026.4.1
    refused the bfloat16 KV cache ("expect kvcache type f32") and the quickstart died before sampling."""
    from alpacafarm.generation import SamplingConfig
    from alpacafarm_generation.openvino_backend import OpenVINOBackendConfig, openvino_backend, pipeline_properties

    config = OpenVINOBackendConfig(precision="bfloat16", threads=2)
    spec = spec_for(tiny_model_dir)
    assert pipeline_properties(config, spec, ["FP32", "INT8"])["KV_CACHE_PRECISION"] == "f32"
    assert pipeline_properties(config, spec, ["FP32", "BF16"])["KV_CACHE_PRECISION"] == "bf16"
    generator = openvino_backend(config, spec, tiny_model_dir)
    try:
        out = generator.generate(formatted(generator)[:2], SamplingConfig(max_new_tokens=4, temperature=0.0))
    finally:
        generator.close()
    assert len(out) == 2 and all(len(group) == 1 for group in out)
