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


@pytest.mark.parametrize("share_prompts", [True, False])
@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_one_pass_gives_the_proxy_s_features_and_the_lm_s_log_probabilities(tied_model, pad_is_eos: bool,
                                                                            share_prompts: bool):
    import torch

    from alpacafarm.rewards import answer_mean_features
    from alpacafarm_annotators.gold_relevance import read_answers

    classifier, lm, tokenizer = tied_model
    if pad_is_eos:
        tokenizer.pad_token = tokenizer.eos_token
    prompts = ["Question: name a colour.\nAnswer:", "Say hi.\n", "Say hi.\n"]
    answers = [" Blue, like the sky.", "", " Hello there, friend!"]
    features, log_probs = read_answers(classifier, tokenizer, prompts, answers, batch_size=2, max_length=64,
                                       share_prompts=share_prompts)
    expected = answer_mean_features(classifier, tokenizer, prompts, answers, batch_size=2, max_length=64)
    assert torch.allclose(features, expected, atol=1e-5)
    with torch.inference_mode():
        for prompt, answer, got in zip(prompts, answers, log_probs, strict=True):
            start = len(tokenizer(prompt)["input_ids"])
            ids = tokenizer(prompt + answer + tokenizer.eos_token, return_tensors="pt")["input_ids"]
            logits = lm(input_ids=ids).logits[0].log_softmax(-1)
            want = [float(logits[t - 1, ids[0, t]]) for t in range(start, ids.shape[1])]
            assert got == pytest.approx(want, abs=1e-4)  # the answer's tokens and its EOS (the empty answer: EOS)


def test_answers_to_one_prompt_read_it_once(tied_model):
    """Issue 65: the gold read the prompt again for every answer (8 best-of-n samples, 8 prompt passes; the gold's
    neutral reading, a pass over the same neutral prompt for every answer). Now a prompt is read once per batch of
    its answers, and a text cut inside its prompt (max_length) is still read whole."""
    from alpacafarm_annotators.gold_relevance import read_answers

    classifier, _, tokenizer = tied_model
    prompt = "Say hi to the whole team.\n"
    prompt_ids = tokenizer(prompt)["input_ids"]
    rows: list[list[int]] = []
    hook = classifier.base_model.register_forward_hook(
        lambda module, args, kwargs, out: rows.extend(kwargs["input_ids"].tolist()), with_kwargs=True)
    try:
        answers = [" Hello!", " Hi, all.", " Good morning, team.", ""]
        for share, reads in ((True, 1), (False, 4)):
            rows.clear()
            read_answers(classifier, tokenizer, [prompt] * 4, answers, batch_size=4, max_length=64,
                         share_prompts=share)
            assert sum(r[:len(prompt_ids)] == prompt_ids for r in rows) == reads
        rows.clear()
        _, cut = read_answers(classifier, tokenizer, [prompt] * 2, answers[:2], batch_size=4, max_length=3)
        assert [len(c) for c in cut] == [1, 1] and all(len(r) == 3 for r in rows)
    finally:
        hook.remove()


def test_the_neutral_reading_stops_at_the_relevance_window(tied_model):
    """Relevance reads an answer's first 32 log-probabilities; the neutral reading used to read every answer whole
    (64 tokens and its EOS) for them. With ``window`` it reads no further, and the numbers are the same."""
    from alpacafarm_annotators.gold_relevance import read_answers

    classifier, _, tokenizer = tied_model
    prompts, answers = ["Name a colour.\n"] * 2, [" Blue, like the sky on a clear day.", " Red."]
    _, whole = read_answers(classifier, tokenizer, prompts, answers, batch_size=2, max_length=64, features=False)
    rows: list[list[int]] = []
    hook = classifier.base_model.register_forward_hook(
        lambda module, args, kwargs, out: rows.extend(kwargs["input_ids"].tolist()), with_kwargs=True)
    try:
        _, cut = read_answers(classifier, tokenizer, prompts, answers, batch_size=2, max_length=64, features=False,
                              window=3)
    finally:
        hook.remove()
    assert [len(c) for c in cut] == [3, 3]
    for got, want in zip(cut, whole, strict=True):
        assert got == pytest.approx(want[:3], abs=1e-5)
    assert max(len(r) for r in rows[1:]) == 3  # the prompt once, then three tokens of each answer


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


def test_answers_alone_under_their_prompt_are_read_whole_in_one_batch(tied_model):
    """A prompt with a single answer (each reference answer) was read as its own pass and then its answer's: two
    passes of one text each. Such texts are batched whole (128 Davinci003 answers in float32 on AVX2: 42 s -> 31 s),
    and the numbers are those of reading them one by one."""
    import torch

    from alpacafarm_annotators.gold_relevance import read_answers

    classifier, _, tokenizer = tied_model
    lengths: list[int] = []
    handle = classifier.base_model.register_forward_hook(
        lambda _m, args, kwargs, _o: lengths.append(int(kwargs["input_ids"].shape[0])), with_kwargs=True)
    prompts = ["Name a colour.\n", "Say hi.\n", "Count to three.\n"]
    answers = [" Blue.", " Hello there!", " One, two, three."]
    features, log_probs = read_answers(classifier, tokenizer, prompts, answers, batch_size=16, max_length=64)
    handle.remove()
    assert lengths == [3]  # one pass, three texts
    for k in range(3):
        alone, alone_log_probs = read_answers(classifier, tokenizer, prompts[k:k + 1], answers[k:k + 1],
                                              batch_size=16, max_length=64)
        assert torch.allclose(alone[0], features[k], atol=1e-5)
        assert alone_log_probs[0] == pytest.approx(log_probs[k], abs=1e-4)
