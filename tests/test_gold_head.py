"""The gold reward model (``alpacafarm_annotators.gold_head:preference_head``): the head its tool fits is blind to
length by construction, and the shipped gold gives nothing for an answer made only shorter or longer."""

from __future__ import annotations

import importlib
import json
import statistics
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def fit_tool() -> ModuleType:
    """``tools/fit_gold_head.py`` (a maintainers' tool outside the package: the gold never imports it)."""
    if str(REPO / "tools") not in sys.path:
        sys.path.insert(0, str(REPO / "tools"))
    return importlib.import_module("fit_gold_head")


def test_removing_length_leaves_no_covariance_with_length_and_keeps_the_rest():
    """After :func:`remove_length` the head's score has zero covariance with length over the samples it was
    removed on, and a head already blind to length is left as it was."""
    import torch

    tool = fit_tool()
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(200, 6, generator=generator)
    lengths = 30 + 10 * features[:, 0] + 5 * features[:, 2] + torch.randn(200, generator=generator)
    weight = torch.tensor([1.0, 0.5, -1.0, 0.0, 2.0, 0.3])
    blind = tool.remove_length(weight, features, lengths)
    scores = features @ blind
    covariance = float(((scores - scores.mean()) * (lengths - lengths.mean())).mean())
    assert abs(covariance) < 1e-4
    before = features @ weight
    assert float(((before - before.mean()) * (lengths - lengths.mean())).mean()) > 1.0  # there was some to remove
    again = tool.remove_length(blind, features, lengths)
    assert torch.allclose(again, blind, atol=1e-6)


def test_removing_the_cut_directions_leaves_a_head_nothing_to_gain_from_cutting_an_answer():
    """Features that drift as an answer is cut (a slope per token cut and a shift for any cut): after
    :func:`remove_directions` with :func:`cut_direction` and the mean shift, the head's score of the cut answers
    neither trends with how much was cut nor moves on average; before, it did."""
    import torch

    tool = fit_tool()
    generator = torch.Generator().manual_seed(1)
    whole = torch.randn(300, 8, generator=generator)
    full_lengths = 40 + 20 * torch.rand(300, generator=generator)
    cut_lengths = full_lengths * torch.rand(300, generator=generator)
    slope, shift = torch.randn(8, generator=generator), torch.randn(8, generator=generator)
    cut = whole + torch.outer(cut_lengths - full_lengths, slope) / 10 + shift + 0.1 * torch.randn(300, 8,
                                                                                                  generator=generator)
    weight = torch.randn(8, generator=generator)

    def drift(w: torch.Tensor) -> tuple[float, float]:
        gain = (cut - whole) @ w
        shortened = cut_lengths - full_lengths
        return float(gain.mean()), float(gain @ shortened / (shortened @ shortened))

    assert max(map(abs, drift(weight))) > 0.1  # there was some to remove
    blind = tool.remove_directions(weight, [tool.cut_direction(whole, cut, full_lengths, cut_lengths),
                                            (cut - whole).mean(0)])
    assert all(abs(x) < 1e-5 for x in drift(blind))
    assert float(blind @ weight) > 0  # the rest is kept


@pytest.mark.parametrize(("name", "pooling"), [("HEAD_FILE", "last"), ("MEAN_HEAD_FILE", "mean")])
def test_the_committed_heads_read_the_proxys_features(name: str, pooling: str):
    """Each shipped head is a weight per hidden unit of the model the proxy reads, finite, names the pooling a
    proxy must use to read the same features, and says how it was fitted (so ``tools/fit_gold_head.py`` can be
    re-run to the same document)."""
    import math

    from alpacafarm_annotators import gold_head

    head = json.loads(getattr(gold_head, name).read_text(encoding="utf-8"))
    assert head.get("pooling", "last") == pooling
    assert head["model"] == "smollm2-135m-instruct"
    assert len(head["weight"]) == 576  # SmolLM2-135M's hidden size
    assert all(math.isfinite(w) for w in head["weight"]) and math.isfinite(head["bias"])
    assert head["fitted"]["tool"] == "tools/fit_gold_head.py" and head["fitted"]["components"] > 0


#: How an answer is made only shorter, longer or padded.
CHANGES = {
    "first half": lambda a: " ".join(a.split(" ")[: max(1, len(a.split(" ")) // 2)]),
    "written twice": lambda a: f"{a}\n{a}",
    "padded": lambda a: f"{a} Thank you.",
}


@pytest.mark.slow
@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("gold", ["preference_head", "answer_head"])
def test_the_gold_reward_model_gives_nothing_for_length_alone(gold: str, change: str):
    """Made only shorter (the first half), longer (written twice) or padded (a polite sentence), answers score
    lower on average, never higher beyond noise. Answers: 48 bundled Davinci003 references and the same cut to
    the SFT model's length (its samples stop at 64 new tokens)."""
    from alpacafarm.data import load_source
    from alpacafarm.recipe import DataSource
    from alpacafarm_annotators import gold_head

    score = getattr(gold_head, gold)
    records = load_source(DataSource(builtin="alpaca_eval_sample"))[:48]
    long = [r["reference"] for r in records]
    short = [" ".join(a.split(" ")[:45]) for a in long]
    for answers in (long, short):
        full = score(records, answers)
        gains = [c - f for c, f in zip(score(records, [CHANGES[change](a) for a in answers]), full, strict=True)]
        mean, se = statistics.mean(gains), statistics.stdev(gains) / len(gains) ** 0.5
        assert mean < se, (len(answers[0]), mean, se)  # no gain beyond one standard error


@pytest.mark.slow
@pytest.mark.parametrize("gold", [
    pytest.param("preference_head", marks=pytest.mark.xfail(
        strict=True, reason="known weakness (docs/reports/2026-11-29-first-gold-worlds.md, 'Why the trained methods "
                            "do not learn it'): the gold reads the answer's last token, so half of it is where the "
                            "answer stops")),
    "answer_head",
])
def test_the_gold_of_an_answer_barely_moves_when_it_loses_its_last_token(gold: str):
    """A preference about answers scores an answer about alike one token shorter (correlation above 0.8 over
    48 answers cut mid-sentence, as most 64-token samples are); the last-token gold does not (0.5 on SFT samples,
    ``benchmarks/gold_token_stability.py``), the answer-averaged one does. Answers: 48 bundled Davinci003
    references cut to 45 words."""
    import numpy as np

    from alpacafarm.data import load_source
    from alpacafarm.recipe import DataSource
    from alpacafarm_annotators import gold_head

    score = getattr(gold_head, gold)
    tokenizer = gold_head._frozen("smollm2-135m-instruct")[1]  # the gold's own copy: loaded once
    records = load_source(DataSource(builtin="alpaca_eval_sample"))[:48]
    answers = [" ".join(r["reference"].split(" ")[:45]) for r in records]
    shorter = [tokenizer.decode(tokenizer(a, add_special_tokens=False)["input_ids"][:-1]) for a in answers]
    correlation = np.corrcoef(score(records, answers), score(records, shorter))[0, 1]
    assert correlation > 0.8, correlation
