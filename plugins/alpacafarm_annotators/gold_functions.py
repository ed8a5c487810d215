"""Built-in gold functions for the ``gold`` annotator: ``gold(records, answers) -> scores``.

Each is a readable rubric of what a person asking an instruction would want from the answer, with every part in
[0, 1] and no part that grows with length alone. Write your own with the same signature (docs/gold.md).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_WORD = re.compile(r"[a-z0-9']+")
#: Words too common to say what an instruction is about.
STOPWORDS = frozenset((
    "a", "about", "above", "after", "again", "against", "all", "also", "am", "an", "and", "any", "are", "as", "at",
    "be", "because", "been", "before", "being", "below", "between", "both", "but", "by", "can", "could", "did", "do",
    "does", "doing", "down", "during", "each", "few", "for", "from", "further", "had", "has", "have", "having", "he",
    "her", "here", "hers", "herself", "him", "himself", "his", "how", "i", "if", "in", "into", "is", "it", "its",
    "itself", "just", "let", "me", "more", "most", "my", "myself", "no", "nor", "not", "now", "of", "off", "on",
    "once", "only", "or", "other", "our", "ours", "ourselves", "out", "over", "own", "please", "same", "she",
    "should", "so", "some", "such", "than", "that", "the", "their", "theirs", "them", "themselves", "then", "there",
    "these", "they", "this", "those", "through", "to", "too", "under", "until", "up", "very", "was", "we", "were",
    "what", "when", "where", "which", "while", "who", "whom", "why", "will", "with", "would", "you", "your", "yours",
    "yourself", "yourselves", "give", "write", "make", "tell", "explain", "describe", "provide", "list", "one",
    "two", "three", "following", "using", "use", "used", "way", "ways", "get", "want", "need", "like", "know",
    "think", "find", "help", "answer", "answers", "question", "questions", "try", "step", "steps", "reasoning",
    "response",
))


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def stem(word: str) -> str:
    """A crude stem (the first 5 letters), so 'recipe' / 'recipes' and 'cook' / 'cooking' match."""
    return word[:5]


def key_terms(record: dict[str, Any]) -> set[str]:
    """The stems of the instruction's (and input's) content words: what the answer should talk about."""
    text = f"{record.get('instruction', '')} {record.get('input') or ''}"
    return {stem(w) for w in words(text) if len(w) >= 3 and w not in STOPWORDS and not w.isdigit()}


def coverage(record: dict[str, Any], answer: str) -> float:
    """Share of the instruction's key terms the answer uses (1.0 when the instruction has none)."""
    terms = key_terms(record)
    if not terms:
        return 1.0
    used = {stem(w) for w in words(answer)}
    return len(terms & used) / len(terms)


def list_items(answer: str) -> int:
    """How many lines of the answer are items of a list (``1.``, ``2)``, ``-``, ``*``, ``•``)."""
    return sum(bool(re.match(r"^(\d+[.)]|[-*•])\s", line.strip())) for line in answer.splitlines())


def organisation(answer: str) -> float:
    """How far the answer is organised as a list of points: 1/3 per item, at most 1."""
    return min(1.0, list_items(answer) / 3)


def _phrases(answer: str) -> tuple[int, int]:
    """(word 5-grams, those that repeat an earlier one)."""
    tokens = words(answer)
    grams = [tuple(tokens[i:i + 5]) for i in range(len(tokens) - 4)]
    return len(grams), len(grams) - len(set(grams))


def repeated_phrases(answer: str) -> int:
    """Word 5-grams that repeat an earlier one: a looping answer (natural prose rarely repeats five words)."""
    return _phrases(answer)[1]


def looping(answer: str) -> float:
    """How much of an answer loops, 0 to 1: the share of its word 5-grams that repeat an earlier one, beyond the
    0.1 that natural answers stay under (95% of the 6,319 answers AlpacaEval's GPT-4 judged; lists repeat a
    phrase or two), scaled so that an answer written twice (a share of about 0.45) scores 1. A share, not a
    count, so a long answer's natural repeats are not a cost its first half escapes (a count of repeats is: the
    first half of a long Davinci003 answer gained 0.125 from it alone)."""
    grams, repeated = _phrases(answer)
    share = repeated / grams if grams else 0.0
    return min(1.0, max(0.0, share - 0.1) / 0.3)


def helpfulness(records: Sequence[dict[str, Any]], answers: Sequence[str]) -> list[float]:
    """A rubric for an answer to an instruction: ``0.5 · coverage + 0.5 · organisation - repetition``.

    - **coverage** (0 to 1): the share of the instruction's key terms (content words, crudely stemmed) the answer
      uses: it talks about what was asked;
    - **organisation** (0 to 1): an answer laid out as a list of points, 1/3 per item up to three: it can be
      scanned;
    - **repetition** (0 to 1, subtracted): repeated five-word phrases, 1/5 each up to five: it does not loop.

    No part grows with length alone: cutting an answer short can only lose key terms and items (or a loop), and
    padding it adds neither (repeating it costs its repeated phrases); tests/test_gold.py checks this on the
    SFT model's answers. Why it is learnable at 135M parameters in CPU minutes: the SFT model's own samples
    (temperature 0.7, 64 new tokens) already vary in all three within one instruction (on 958 samples of 160
    training instructions, the score's standard deviation within an instruction is 0.19 of 0.29 overall, and
    9% of samples are lists of two or more items), so a sampler can find better answers among its own and a
    policy can be pushed toward them; and list layout and the question's words are surface properties that a
    few gradient steps change. It is a stand-in for a person's preference, not a measure of truth: a correct
    answer in one sentence scores below a list that restates the question.
    """
    return [0.5 * coverage(record, answer) + 0.5 * organisation(answer) - min(1.0, repeated_phrases(answer) / 5)
            for record, answer in zip(records, answers, strict=True)]
