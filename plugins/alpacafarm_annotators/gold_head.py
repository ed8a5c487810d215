"""A gold that is itself a reward model: GPT-4's recorded preferences read off the SFT model's features.

Gao et al. (2023) study over-optimisation with a *gold reward model*: a reward model trained on preference data
stands in for the human, labels the pairs a smaller proxy learns from, and measures every policy. This is that
gold at CPU scale. :func:`preference_head` scores an answer ``w · h(prompt + answer)``, where ``h`` is
SmolLM2-135M-Instruct's final hidden state at the answer's last token (the very feature the head-only proxy reward
model reads) and ``w`` is a Bradley-Terry head fitted by ``tools/fit_gold_head.py`` to GPT-4's recorded judgments of
AlpacaEval answers (Davinci003 against seven systems, ``alpaca_eval_gpt4``), then made blind to length: the part of
``w`` that covaries with the answer's length in tokens across the SFT model's own samples is projected out, so a
policy cannot gain in expectation by writing longer or shorter (``tests/test_gold_head.py`` cuts and pads answers).

What it rewards: what GPT-4 preferred in those answers, as far as a linear read of a 135M model's last state can
see it (on held-out instructions it agrees with GPT-4 about as often as ``tools/fit_gold_head.py`` prints), length
removed. Why it is learnable: the proxy reads the same features, so a proxy fitted on a few hundred noisy labels
can recover the gold's direction (the gap between them is label noise and sample size, as in Gao et al.'s
smaller-proxy runs, not a capacity gap), and the SFT model's own samples vary along it within one instruction.
It is a stand-in for a person's preference, frozen at the SFT model's features: it does not move when a policy
trains, so a policy that changes its hidden states to please it is over-optimising it, as a policy does any gold.

Its weakness (measured by ``benchmarks/gold_token_stability.py``): the last state is mostly about the last token, so
an answer one token shorter scores only 0.51-correlated with itself, and most 64-token samples stop where
``max_new_tokens`` cuts them. :func:`answer_head` is the same construction on the answer's hidden states averaged
over its tokens (``tools/fit_gold_head.py --pooling mean``), which one token barely moves; the proxy that can learn
it is a head-only reward model with ``pooling: mean``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: The committed heads (``tools/fit_gold_head.py`` writes them): model, max_length, pooling (absent: last), weight,
#: and how each was fitted.
HEAD_FILE = Path(__file__).with_name("gold_head_smollm2.json")
MEAN_HEAD_FILE = Path(__file__).with_name("gold_head_smollm2_mean.json")


def frozen_model(name: str) -> tuple[Any, Any, Any]:
    """The model whose features the gold reads (float32, CPU, as a classifier), its tokenizer and prompt format:
    what :func:`preference_head` scores with and what ``tools/fit_gold_head.py`` fits on."""
    from alpacafarm.model_loading import load_classifier, load_tokenizer
    from alpacafarm.model_sources import resolve_model_path
    from alpacafarm.prompts import PromptFormat
    from alpacafarm.recipe import ModelSpec

    spec = ModelSpec(name=name, dtype="float32", device="cpu", prompt_format="chat_template")
    path = resolve_model_path(spec.name)
    tokenizer = load_tokenizer(spec, path)
    return load_classifier(spec, path).eval(), tokenizer, PromptFormat.for_model(spec.prompt_format, path, tokenizer)


@functools.cache
def _scorer(head_file: Path = HEAD_FILE) -> tuple[Any, Any, Any, tuple[Any, float], dict[str, Any], dict[str, float]]:
    """The frozen model, tokenizer, prompt format, a head and its document (loaded once per process and head
    file), and a text -> score cache."""
    import torch

    head = json.loads(head_file.read_text(encoding="utf-8"))
    model, tokenizer, prompt = _frozen(head["model"])
    weight = torch.tensor(head["weight"], dtype=torch.float32)
    return model, tokenizer, prompt, (weight, float(head["bias"])), head, {}


@functools.cache
def _frozen(name: str) -> tuple[Any, Any, Any]:
    """:func:`frozen_model`, once per process (both heads read the same model)."""
    return frozen_model(name)


def text_of(prompt: Any, eos: str, record: dict[str, Any], answer: str) -> str:
    """The text the gold reads: the instruction in the chat template, the answer, EOS (as the proxy reads it)."""
    from alpacafarm.rewards import with_eos

    return with_eos(prompt(record["instruction"], record.get("input") or "") + answer, eos)


def features_of(model: Any, tokenizer: Any, prompt: Any, records: Sequence[dict[str, Any]], answers: Sequence[str],
                *, pooling: str, max_length: int) -> Any:
    """The frozen features a head reads for each answer: the final hidden state at the answer's last token
    (``last``) or averaged over its tokens (``mean``), of :func:`text_of`'s text."""
    from alpacafarm.rewards import answer_mean_features, last_token_features

    if pooling == "mean":
        prompts = [prompt(r["instruction"], r.get("input") or "") for r in records]
        return answer_mean_features(model, tokenizer, prompts, list(answers), batch_size=16, max_length=max_length)
    if pooling != "last":
        raise ValueError(f"unknown pooling {pooling!r}: last or mean")
    texts = [text_of(prompt, tokenizer.eos_token, r, a) for r, a in zip(records, answers, strict=True)]
    return last_token_features(model, tokenizer, texts, batch_size=16, max_length=max_length)


def preference_head(records: Sequence[dict[str, Any]], answers: Sequence[str]) -> list[float]:
    """The gold score of each answer: ``w · h + b`` (see the module; standardised on the SFT model's samples: mean
    0, standard deviation 1) minus the rubric's repetition penalty (1/5 per repeated five-word phrase, at most 1:
    the head alone scores an SFT answer written twice 0.39 ± 0.08 higher than written once, a loop a policy
    would find). Each distinct text is scored once per process."""
    from alpacafarm_annotators.gold_functions import repeated_phrases

    return _head_scores(HEAD_FILE, records, answers, lambda a: min(1.0, repeated_phrases(a) / 5))


def answer_head(records: Sequence[dict[str, Any]], answers: Sequence[str]) -> list[float]:
    """:func:`preference_head`'s construction on the answer's hidden states averaged over its tokens (its head:
    ``gold_head_smollm2_mean.json``, fitted by ``tools/fit_gold_head.py --pooling mean --cuts 300``: blind to
    length across the SFT samples and to cutting an answer short), minus how much the answer loops
    (:func:`~alpacafarm_annotators.gold_functions.looping`, 0 to 1: a share of repeated phrases, not a count, so
    that a long answer's first half does not gain by dropping natural repeats): a score of the whole answer, not
    of the token it stops on."""
    from alpacafarm_annotators.gold_functions import looping

    return _head_scores(MEAN_HEAD_FILE, records, answers, looping)


def _head_scores(head_file: Path, records: Sequence[dict[str, Any]], answers: Sequence[str],
                 penalty: Callable[[str], float]) -> list[float]:
    model, tokenizer, prompt, (weight, bias), head, cache = _scorer(head_file)
    keys = [text_of(prompt, tokenizer.eos_token, r, a) for r, a in zip(records, answers, strict=True)]
    todo = {k: (r, a) for k, r, a in zip(keys, records, answers, strict=True) if k not in cache}
    if todo:
        features = features_of(model, tokenizer, prompt, [r for r, _ in todo.values()], [a for _, a in todo.values()],
                               pooling=head.get("pooling", "last"), max_length=int(head["max_length"]))
        for key, value in zip(todo, (features @ weight + bias).tolist(), strict=True):
            cache[key] = float(value)
    return [cache[k] - penalty(a) for k, a in zip(keys, answers, strict=True)]


#: The helpful gold's document (``tools/fit_gold_relevance.py`` writes it): the mean head it builds on, the
#: weights of relevance and echo, the relevance clip, and the standardisation.
HELPFUL_FILE = Path(__file__).with_name("gold_helpful_smollm2.json")


def helpful_head(records: Sequence[dict[str, Any]], answers: Sequence[str]) -> list[float]:
    """A gold a person would sign: :func:`answer_head`'s reading of GPT-4's preferences (the mean head, length
    projected out) plus whether the answer answers its own instruction, minus copying it, minus looping::

        gold = (head + beta * clip(relevance) * (1 - echo) - gamma * echo - mean) / scale - looping

    ``relevance`` is the pointwise mutual information of the answer and its instruction under the frozen SFT model,
    per token over the answer's first 32 tokens (:mod:`~alpacafarm_annotators.gold_relevance`), ``echo`` the
    share of the answer copied from the instruction. ``beta`` and ``gamma`` were fitted by
    ``tools/fit_gold_relevance.py`` on GPT-4's judgments (on the head's instructions) together with contrasts any
    person makes (the real answer against the empty answer, generic filler, a refusal, another instruction's answer
    and an echo of the instruction), and the score is standardised on the SFT model's samples (mean 0, sd 1).

    What it rewards, in two sentences: an answer that is about its own
    instruction and says something the instruction makes likely, as GPT-4 preferred among on-topic answers;
    non-answers (empty, generic, refusing, off-topic, echoed) lose to a real answer. Formatting, politeness,
    padding and cutting move it little: relevance is read over a fixed window of the answer's opening tokens and
    the head is blind to length.

    Why a proxy can learn it, and what it cannot see: the mean-pooled proxy reads the same averaged features as
    the head, and those features carry part of the relevance (an answer's states differ under its own
    instruction); the exact likelihood ratio against the empty instruction is not among them, so a proxy fitted on
    SFT samples sees the gold only in part (the realistic case: over-optimisation shows where it cannot see)."""
    from alpacafarm.readings import default_store
    from alpacafarm_annotators.gold_functions import looping
    from alpacafarm_annotators.gold_relevance import NEUTRAL, echo_share, read_answers, relevance

    document = _helpful_document()
    model, tokenizer, prompt, (weight, bias), head, cache = _scorer(Path(__file__).with_name(document["head_file"]))
    keys = [("helpful", text_of(prompt, tokenizer.eos_token, r, a)) for r, a in zip(records, answers, strict=True)]
    todo = {k: (r, a) for k, r, a in zip(keys, records, answers, strict=True) if k not in cache}
    if todo:
        pending = list(todo.values())
        own_prompts = [prompt(r["instruction"], r.get("input") or "") for r, _ in pending]
        texts = [a for _, a in pending]
        size = int(head["max_length"])
        window = document["relevance_window"]
        store = default_store()  # what the reward model (same weights, float32) or an earlier run read is kept
        features, own = read_answers(model, tokenizer, own_prompts, texts, batch_size=16, max_length=size,
                                     window=window, store=store)
        _, neutral = read_answers(model, tokenizer, [prompt(*NEUTRAL)] * len(texts), texts, batch_size=16,
                                  max_length=size, features=False, window=window, store=store)
        low, high = document["relevance_clip"]
        related_all = relevance(own, neutral, window)
        for key, (record, answer), head_score, related in zip(
                todo, pending, (features @ weight + bias).tolist(), related_all, strict=True):
            echo = echo_share(record, answer)
            raw = (head_score + document["relevance_weight"] * min(max(related, low), high) * (1 - echo)
                   - document["echo_weight"] * echo)
            cache[key] = (raw - document["mean"]) / document["scale"]
    return [cache[k] - looping(a) for k, a in zip(keys, answers, strict=True)]


@functools.cache
def _helpful_document() -> dict[str, Any]:
    return json.loads(HELPFUL_FILE.read_text(encoding="utf-8"))
