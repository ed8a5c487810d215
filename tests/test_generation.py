"""The generator (transformers backend, OpenAI-compatible backend) and the generate_outputs stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from alpacafarm.generation import SamplingConfig, TransformersGenerator, generate_records
from alpacafarm.testing import tiny_causal_lm, tiny_tokenizer
from alpacafarm.testing.openai_server import FakeOpenAIServer, request_text
from alpacafarm_generation.backends import OpenAIBackendConfig, OpenAIGenerator

PROMPTS = ["Give three tips for staying healthy.", "Hi", "Describe the water cycle in simple words for a child."]


@pytest.fixture(scope="module")
def generator() -> TransformersGenerator:
    tokenizer = tiny_tokenizer()
    return TransformersGenerator(tiny_causal_lm(tokenizer), tokenizer)


def test_n_samples_per_prompt_in_prompt_order(generator):
    outputs = generator.generate(PROMPTS, SamplingConfig(n=4, max_new_tokens=6, batch_size=2))
    assert [len(samples) for samples in outputs] == [4, 4, 4]
    assert len({s for samples in outputs for s in samples}) > 4  # sampling, not copies


def test_max_new_tokens_is_respected(generator):
    generator.generate(PROMPTS, SamplingConfig(n=2, max_new_tokens=5, batch_size=3))
    counts = [c for per_prompt in generator.last_token_counts for c in per_prompt]
    assert len(counts) == 6 and max(counts) <= 5 and min(counts) >= 1


def test_seeded_sampling_is_reproducible_and_seed_dependent(generator):
    config = SamplingConfig(n=2, max_new_tokens=6, batch_size=2, seed=7)
    first = generator.generate(PROMPTS, config)
    assert generator.generate(PROMPTS, config) == first
    assert generator.generate(PROMPTS, config.model_copy(update={"seed": 8})) != first


def test_greedy_decoding_does_not_depend_on_batching(generator):
    greedy = SamplingConfig(temperature=0, max_new_tokens=6, batch_size=1)
    one_by_one = generator.generate(PROMPTS, greedy)
    batched = generator.generate(PROMPTS, greedy.model_copy(update={"batch_size": 3}))
    assert one_by_one == batched  # left padding keeps the prompts aligned


def test_generate_records_formats_prompts_and_keeps_fields(generator):
    records = [{"instruction": "Add 2 and 3.", "input": "", "dataset": "x"}, {"instruction": "Translate", "input": "hola"}]
    rows = generate_records(generator, records, SamplingConfig(n=2, max_new_tokens=3))
    assert [(r["instruction"], r["sample_index"]) for r in rows] == [("Add 2 and 3.", 0), ("Add 2 and 3.", 1),
                                                                      ("Translate", 0), ("Translate", 1)]
    assert rows[0]["dataset"] == "x" and all(isinstance(r["output"], str) for r in rows)


def test_openai_compatible_backend_against_a_local_server():
    def responder(body: dict) -> str:
        return f"echo: {request_text(body)[-12:]}"

    with FakeOpenAIServer(responder) as server:
        backend = OpenAIGenerator(OpenAIBackendConfig(base_url=server.base_url, model="served-model", max_concurrency=2))
        outputs = backend.generate(PROMPTS, SamplingConfig(n=3, max_new_tokens=8, temperature=0.5))
        assert [len(o) for o in outputs] == [3, 3, 3]
        assert outputs[1] == ["echo: Hi"] * 3
        bodies = [r.body for r in server.requests]
        assert {b["model"] for b in bodies} == {"served-model"} and {b["n"] for b in bodies} == {3}
        assert {b["max_tokens"] for b in bodies} == {8}


def test_generate_outputs_stage_in_a_recipe(tiny_model_dir: str, tmp_path: Path):
    recipe = tmp_path / "gen.yaml"
    recipe.write_text(
        "name: gen\n"
        f"model: {{name: {tiny_model_dir}}}\n"
        "data:\n  instructions: {builtin: alpaca_eval_sample, limit: 10}\n"
        "stages:\n  - {name: split, method: split_instructions, config: {eval_size: 3}}\n"
        "  - name: outputs\n    method: generate_outputs\n"
        "    config: {sampling: {n: 2, max_new_tokens: 4, temperature: 1.0}}\n"
    )
    result = run_cli("run", str(recipe), "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run/stages/outputs/outputs.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["sample_index"] for r in rows} == {0, 1}
    manifest = json.loads((tmp_path / "run/stages/outputs/manifest.json").read_text())
    assert manifest["artifact"]["metadata"]["n_outputs"] == 6
