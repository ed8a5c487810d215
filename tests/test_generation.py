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
    records = [{"instruction": "Add 2 and 3.", "input": "", "dataset": "x"},
               {"instruction": "Translate", "input": "hola"}]
    rows = generate_records(generator, records, SamplingConfig(n=2, max_new_tokens=3))
    assert [(r["instruction"], r["sample_index"]) for r in rows] == [("Add 2 and 3.", 0), ("Add 2 and 3.", 1),
                                                                      ("Translate", 0), ("Translate", 1)]
    assert rows[0]["dataset"] == "x" and all(isinstance(r["output"], str) for r in rows)


def test_openai_compatible_backend_against_a_local_server():
    def responder(body: dict) -> str:
        return f"echo: {request_text(body)[-12:]}"

    with FakeOpenAIServer(responder) as server:
        backend = OpenAIGenerator(OpenAIBackendConfig(base_url=server.base_url, model="served-model",
                                                      max_concurrency=2))
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


# ------------------------------------------------------------------------ prompt conditioning, on every backend


def _conditioned_folder(tmp_path: Path) -> Path:
    from alpacafarm.prompts import PromptConditioning
    from alpacafarm.testing import save_tiny_causal_lm

    folder = Path(save_tiny_causal_lm(tmp_path / "conditioned"))
    PromptConditioning(prompt_prefix="<good>\n").save(folder)
    return folder


RECORDS = [{"instruction": "Add 2 and 3."}, {"instruction": "Translate", "input": "hola"}]


def test_transformers_backend_samples_behind_the_folders_conditioning(tmp_path: Path):
    from alpacafarm.plugins import get_registry
    from alpacafarm.prompts import PromptFormat
    from alpacafarm.recipe import ModelSpec
    from alpacafarm.sampling import tokenize_prompts

    folder = str(_conditioned_folder(tmp_path))
    generator = get_registry().create("generation_backend", "transformers", None, spec=ModelSpec(name=folder),
                                      model_path=folder)
    prompts = generator.prompt_format.records(RECORDS)
    assert prompts == [f"<good>\n{PromptFormat()(r['instruction'], r.get('input'))}" for r in RECORDS]
    greedy = SamplingConfig(temperature=0, max_new_tokens=5)
    rows = generate_records(generator, RECORDS, greedy)
    by_hand = generator.generate(prompts, greedy)  # what the model says behind the marker
    assert [r["output"] for r in rows] == [s[0] for s in by_hand]
    assert tokenize_prompts(generator.tokenizer, prompts)[0][:2] == generator.tokenizer("<good>\n")["input_ids"][:2]


def test_openai_backend_sends_the_conditioned_prompt_to_the_server(tmp_path: Path):
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import ModelSpec

    folder = str(_conditioned_folder(tmp_path))
    with FakeOpenAIServer(lambda body: "ok") as server:
        backend = get_registry().create("generation_backend", "openai", {"base_url": server.base_url},
                                        spec=ModelSpec(name=folder), model_path=folder)
        rows = generate_records(backend, RECORDS, SamplingConfig(max_new_tokens=4))
        prompts = sorted(r.body["prompt"] for r in server.requests)
    assert [r["output"] for r in rows] == ["ok", "ok"]
    assert len(prompts) == 2 and all(p.startswith("<good>\nBelow is an instruction") for p in prompts)
    assert {r.body["model"] for r in server.requests} == {folder}  # the served model defaults to the model path


def test_vllm_backend_writes_prompts_with_the_same_conditioning(tmp_path: Path):
    # vLLM needs a GPU; what the backend sends it is the prompt format built by the same rule as the OpenAI backend.
    from alpacafarm.recipe import ModelSpec
    from alpacafarm_generation import backends

    folder = str(_conditioned_folder(tmp_path))
    prompt_format = backends.prompt_format_for(ModelSpec(name=folder), folder)
    assert prompt_format.records(RECORDS[:1])[0].startswith("<good>\nBelow is an instruction")

    class RecordingLLM:  # stands in for vllm.LLM where vLLM cannot be installed (no CUDA on this machine)
        prompts: list[str] = []

    generator = backends.VLLMGenerator(RecordingLLM(), prompt_format)
    assert generator.prompt_format.conditioning.prompt_prefix == "<good>\n"


def test_a_backend_config_error_names_the_stage_path(tmp_path: Path):
    from alpacafarm.errors import RecipeError
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import ModelSpec

    with pytest.raises(RecipeError, match=r"backend_config\.base_ur: unknown key 'base_ur'; did you mean 'base_url'"):
        get_registry().create("generation_backend", "openai", {"base_ur": "x"}, spec=ModelSpec(name="m"),
                              model_path="m", path=("stages", "outputs", "config", "backend_config"))
