"""The rules a gold a person would sign must keep (ARCHITECTURE.md, "A gold is a preference a person would sign"),
probed as a person would fool it: on instructions the gold was never fitted on (the bundled AlpacaEval sample) and
on a system's answers it never saw (Zephyr-7B-beta's, cut to 45 words; CC BY-NC 4.0, ../shared/data).

- every non-answer family loses to the real answer by more than 3 paired SE and wins with probability at most 0.35
  at the evaluation's temperature (1.0: P(b beats a) = sigmoid(gold(b) - gold(a)));
- style alone (a numbered list, bullets, markdown, a polite wrapper, padding, cutting) wins with probability at most
  0.6;
- relevance: an answer's gold under its own instruction correlates at most 0.7 with its gold under another's.

The families and texts here are not those ``tools/fit_gold_relevance.py`` fitted on (other filler, other refusals,
and families it never saw: "I don't know", a question back, a restated instruction, an empty wrapper). The answer
gold of before (``answer_head``) breaks them; the helpful gold keeps them.
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

N_INSTRUCTIONS = 40
TEMPERATURE = 1.0
FILLER = ("Great question! This is a topic that many people wonder about. The answer can vary a lot depending on "
          "the context, so it is best to keep an open mind and explore the options.")
OTHER_FILLER = "Thank you for asking. Everyone has a different view on this, and there is no single right answer."
REFUSAL = "I apologise, but I am not able to assist with this."


def cut(text: str, words: int = 45) -> str:
    return " ".join(text.split()[:words])


@functools.cache
def probe_set() -> tuple[list[dict[str, Any]], list[str]]:
    """40 seeded instructions of the bundled sample, each with Zephyr-7B-beta's answer cut to 45 words."""
    from alpacafarm.data import load_source
    from alpacafarm.recipe import DataSource

    path = SHARED_DATA / "tatsu-lab_alpaca_eval" / "results" / "zephyr-7b-beta" / "model_outputs.json"
    if not path.is_file():
        pytest.skip(f"{path} is not here (../shared/data)")
    answers = {r["instruction"]: r["output"] for r in json.loads(path.read_text(encoding="utf-8"))}
    sample = [r for r in load_source(DataSource(builtin="alpaca_eval_sample")) if r["instruction"] in answers
              and not r.get("input")]
    chosen = random.Random(3).sample(sample, N_INSTRUCTIONS)
    return [{"instruction": r["instruction"], "input": ""} for r in chosen], \
        [cut(answers[r["instruction"]].strip()) for r in chosen]


def non_answers(records: list[dict[str, Any]], real: list[str]) -> dict[str, list[str]]:
    n = len(real)
    return {
        "empty": [""] * n,
        "generic filler": [FILLER if k % 2 else OTHER_FILLER for k in range(n)],
        "refusal": [REFUSAL] * n,
        "another instruction's answer": [real[(k + 7) % n] for k in range(n)],
        "echo of the instruction": [r["instruction"] for r in records],
        "I don't know": ["I don't know."] * n,
        "a question back": ["Could you please clarify what exactly you would like to know?"] * n,
        "restated instruction": [f"You asked me the following: {r['instruction']}" for r in records],
        "an empty wrapper": ["Sure! Here is the answer you asked for. I hope this helps!"] * n,
    }


def style_rewrites(real: list[str]) -> dict[str, list[str]]:
    def sentences(text: str) -> list[str]:
        return [s.strip().rstrip(".") + "." for s in text.replace("\n", " ").split(". ") if s.strip()]

    return {
        "numbered list": ["\n".join(f"{i + 1}. {s}" for i, s in enumerate(sentences(a))) for a in real],
        "bullets": ["\n".join(f"- {s}" for s in sentences(a)) for a in real],
        "markdown header and bold": [f"## Answer\n\n**{a}**" for a in real],
        "polite wrapper": [f"Certainly! I'd be happy to help. {a} Let me know if you have any other questions!"
                           for a in real],
        "padding": [f"{a} {OTHER_FILLER}" for a in real],
        "cut to a third": [" ".join(a.split()[: max(1, len(a.split()) // 3)]) for a in real],
    }


def paired(gold: Callable[..., list[float]], records: list[dict[str, Any]], real: list[str],
           rewrite: list[str]) -> tuple[float, float, float]:
    """(mean gold of the rewrite minus the real answer's, its paired SE, mean P(the rewrite wins))."""
    deltas = [b - a for a, b in zip(gold(records, real), gold(records, rewrite), strict=True)]
    mean = sum(deltas) / len(deltas)
    se = math.sqrt(sum((d - mean) ** 2 for d in deltas) / (len(deltas) - 1) / len(deltas))
    wins = sum(1 / (1 + math.exp(-d / TEMPERATURE)) for d in deltas) / len(deltas)
    return mean, se, wins


def helpful() -> Callable[..., list[float]]:
    from alpacafarm_annotators.gold_head import helpful_head

    return helpful_head


@pytest.mark.parametrize("family", list(non_answers([{"instruction": ""}] * 2, ["a", "b"])))
def test_every_non_answer_loses_to_the_real_answer(family: str):
    records, real = probe_set()
    mean, se, wins = paired(helpful(), records, real, non_answers(records, real)[family])
    assert mean < -3 * se, f"{family}: {mean:+.2f} ± {se:.2f}"
    assert wins <= 0.35, f"{family}: wins with probability {wins:.2f}"


@pytest.mark.parametrize("rewrite", list(style_rewrites(["a. b"])))
def test_style_alone_buys_little(rewrite: str):
    records, real = probe_set()
    mean, se, wins = paired(helpful(), records, real, style_rewrites(real)[rewrite])
    assert wins <= 0.6, f"{rewrite}: {mean:+.2f} ± {se:.2f}, wins with probability {wins:.2f}"


def correlation(x: list[float], y: list[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))


def test_relevance_an_answer_under_another_instruction_is_another_score():
    records, real = probe_set()
    gold = helpful()
    elsewhere = [records[(k + 11) % len(records)] for k in range(len(records))]
    assert correlation(gold(records, real), gold(elsewhere, real)) <= 0.7


def test_the_answer_gold_of_before_breaks_the_rules():
    """Why the helpful gold replaced it: the answer head ties the empty answer and generic filler with a real
    answer, and scores an answer nearly the same under any instruction."""
    from alpacafarm_annotators.gold_head import answer_head

    records, real = probe_set()
    families = non_answers(records, real)
    broken = [name for name in ("empty", "generic filler", "another instruction's answer")
              if paired(answer_head, records, real, families[name])[2] > 0.35]
    assert broken, "the answer head kept the non-answer rules"
    elsewhere = [records[(k + 11) % len(records)] for k in range(len(records))]
    assert correlation(answer_head(records, real), answer_head(elsewhere, real)) > 0.7


def test_fitting_never_saw_the_probe_instructions():
    """The rules are probed on instructions and a system the weights were not fitted on."""
    from alpacafarm_annotators.gold_head import HELPFUL_FILE

    fitted = json.loads(Path(HELPFUL_FILE).read_text(encoding="utf-8"))["fitted"]
    assert "zephyr" not in json.dumps(fitted).lower()
    assert fitted["tool"] == "tools/fit_gold_relevance.py"  # which leaves out the bundled sample's instructions
