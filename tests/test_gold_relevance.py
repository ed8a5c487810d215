"""The helpful gold's readings on tiny models: one pass gives the mean-head features exactly as the proxy reads them
and the answer's token log-probabilities exactly as the causal LM with tied embeddings gives them; relevance is
over a fixed window; the echo share counts copied trigrams."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def tied_model(tiny_model_dir: str, tmp_path: Path):
    """The tiny model with its language-model head tied to its input embedding (as SmolLM2's is), as a classifier
    and as a causal LM over the same weights, and its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config).eval()
    lm.save_pretrained(tmp_path / "tied")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.save_pretrained(tmp_path / "tied")
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path / "tied", num_labels=1).eval()
    return classifier, lm, tokenizer


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_one_pass_gives_the_proxy_s_features_and_the_lm_s_log_probabilities(tied_model, pad_is_eos: bool):
    import torch

    from alpacafarm.rewards import answer_mean_features
    from alpacafarm_annotators.gold_relevance import read_answers

    classifier, lm, tokenizer = tied_model
    if pad_is_eos:
        tokenizer.pad_token = tokenizer.eos_token
    prompts = ["Question: name a colour.\nAnswer:", "Say hi.\n", "Say hi.\n"]
    answers = [" Blue, like the sky.", "", " Hello there, friend!"]
    features, log_probs = read_answers(classifier, tokenizer, prompts, answers, batch_size=2, max_length=64)
    expected = answer_mean_features(classifier, tokenizer, prompts, answers, batch_size=2, max_length=64)
    assert torch.allclose(features, expected, atol=1e-5)
    with torch.inference_mode():
        for prompt, answer, got in zip(prompts, answers, log_probs, strict=True):
            start = len(tokenizer(prompt)["input_ids"])
            ids = tokenizer(prompt + answer + tokenizer.eos_token, return_tensors="pt")["input_ids"]
            logits = lm(input_ids=ids).logits[0].log_softmax(-1)
            want = [float(logits[t - 1, ids[0, t]]) for t in range(start, ids.shape[1])]
            assert got == pytest.approx(want, abs=1e-4)  # the answer's tokens and its EOS (the empty answer: EOS)


def test_a_model_without_tied_embeddings_is_refused(tiny_model_dir: str):
    from alpacafarm.model_loading import load_classifier, load_tokenizer
    from alpacafarm.recipe import ModelSpec
    from alpacafarm_annotators.gold_relevance import read_answers

    spec = ModelSpec(name=tiny_model_dir)
    model, tokenizer = load_classifier(spec, tiny_model_dir).eval(), load_tokenizer(spec, tiny_model_dir)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        read_answers(model, tokenizer, ["Hi.\n"], [" Hello."], batch_size=1, max_length=32)


def test_relevance_is_summed_over_the_window_and_divided_by_it():
    from alpacafarm_annotators.gold_relevance import relevance

    own = [[-1.0] * 40, [-1.0] * 8]
    neutral = [[-2.0] * 40, [-3.0] * 8]
    assert relevance(own, neutral, window=32) == [pytest.approx(1.0), pytest.approx(0.5)]
    # a reading cut shorter by max_length compares only the tokens both have
    assert relevance([[-1.0] * 10], [[-2.0] * 12], window=32) == [pytest.approx(10 / 32)]


def test_the_echo_share_counts_copied_trigrams():
    from alpacafarm_annotators.gold_relevance import echo_share

    record = {"instruction": "Explain why the sky is blue during the day.", "input": ""}
    assert echo_share(record, "Explain why the sky is blue during the day.") == 1.0
    assert echo_share(record, "Sunlight scatters off air molecules; blue light scatters the most.") == 0.0
    # 5 of its 9 trigrams quote the instruction ("the sky is blue during the day")
    assert echo_share(record, "The sky is blue during the day because of Rayleigh scattering.") == 5 / 9
    assert echo_share(record, "") == 0.0
