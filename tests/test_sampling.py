"""The core sampler decodes with exactly the settings it is given: a checkpoint's ``generation_config.json``
(e.g. a ``repetition_penalty`` or ``top_k`` shipped with an instruct model) changes nothing but the stop tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, GenerationConfig

from alpacafarm.sampling import sample
from alpacafarm.testing import save_tiny_causal_lm, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: Settings that change sampling drastically if they leak into a rollout.
SHIPPED = {"do_sample": True, "repetition_penalty": 50.0, "top_k": 2, "temperature": 0.3, "no_repeat_ngram_size": 1,
           "min_p": 0.2}


def _samples(model: object, prompts: list[list[int]], **kwargs: object) -> list[list[int]]:
    batches = sample(model, tiny_tokenizer(), prompts, n=2, temperature=1.0, max_new_tokens=12, batch_size=4,
                     seed=7, **kwargs)
    return [s.response_ids for batch in batches for s in batch]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    texts = ["Write a poem about the sea.", "List three fruits.", "Why is the sky blue?"]
    return [tiny_tokenizer()(t)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object]:
    plain = Path(save_tiny_causal_lm(tmp_path_factory.mktemp("plain")))
    shipped = Path(save_tiny_causal_lm(tmp_path_factory.mktemp("shipped")))
    config = GenerationConfig.from_pretrained(shipped)
    for key, value in SHIPPED.items():
        setattr(config, key, value)
    config.save_pretrained(shipped)
    loaded = AutoModelForCausalLM.from_pretrained(shipped)
    assert loaded.generation_config.repetition_penalty == 50.0  # the checkpoint really carries the settings
    return AutoModelForCausalLM.from_pretrained(plain).eval(), loaded.eval()


def test_a_checkpoints_generation_config_does_not_change_the_samples(models, prompts):
    plain, shipped = models
    assert _samples(shipped, prompts) == _samples(plain, prompts)
    assert shipped.generation_config.repetition_penalty == 50.0  # restored after sampling


def test_the_same_holds_through_a_peft_wrapper_and_a_custom_generate(models, prompts):
    from peft import LoraConfig, get_peft_model

    plain, shipped = models
    wrapped = get_peft_model(shipped, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=True))
    try:
        assert _samples(wrapped, prompts, generate=wrapped.generate) == _samples(plain, prompts)
    finally:
        wrapped.unload()


def test_sharding_across_ranks_is_an_argument_of_each_call(models, prompts, monkeypatch: pytest.MonkeyPatch):
    """Rank 1 of 2 (simulated): ``sharded=True`` samples its batches only and takes the rest from the gather;
    without it the rank samples everything, whatever any caller further up did before (no hidden switch)."""
    from alpacafarm import distributed
    from alpacafarm.generation import SamplingConfig, TransformersGenerator

    plain, _ = models
    whole = sample(plain, tiny_tokenizer(), prompts, n=1, max_new_tokens=4, batch_size=1, seed=3)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    gathered: list[dict] = []

    def all_gather_object(mine: dict, where: str = "") -> list[dict]:  # rank 0's part: the one-process samples
        gathered.append(mine)
        return [{i: whole[i] for i in range(len(prompts)) if i not in mine}, mine]

    monkeypatch.setattr(distributed, "all_gather_object", all_gather_object)
    calls: list[int] = []

    def generate(**kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return plain.generate(**kwargs)

    shared = sample(plain, tiny_tokenizer(), prompts, n=1, max_new_tokens=4, batch_size=1, seed=3,
                    generate=generate, sharded=True)
    assert calls == [1] and len(gathered[0]) == 1  # batch 1 of the 3 (b mod 2 == 1): rank 1's only
    assert [[s.text for s in g] for g in shared] == [[s.text for s in g] for g in whole]
    calls.clear()
    sample(plain, tiny_tokenizer(), prompts, n=1, max_new_tokens=4, batch_size=1, seed=3, generate=generate)
    assert len(calls) == 3 and len(gathered) == 1  # not sharded: every batch here, no gather
    generator = TransformersGenerator(plain, tiny_tokenizer(), sharded=True)  # a generator carries the choice
    texts = generator.generate(["a", "b c", "d e f"], SamplingConfig(max_new_tokens=2, batch_size=1))
    assert len(texts) == 3 and len(gathered) == 2
