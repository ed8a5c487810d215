"""A responder for the fake OpenAI server that judges like a real annotator would: from the prompt alone.

Test pairs carry tags in their outputs: ``[[p7:good]]`` in the better output and ``[[p7:bad]]`` in the worse.
The responder finds the tags in the order the prompt shows them (in-context examples carry none), so it answers
"which shown output is good" for every pair in the batch, in the answer format the prompt asks for. Whether the
annotator unswapped a shuffled pair correctly is then checked against the caller's order.
"""

from __future__ import annotations

import json
import re
import threading

from alpacafarm.testing.openai_server import Fault, request_text
from alpacafarm.types import Pair

TAG = re.compile(r"\[\[p(\d+):(good|bad)\]\]")


def tagged_pairs(n: int, *, start: int = 0, good_first_every: int = 2) -> tuple[list[Pair], list[int]]:
    """``n`` pairs and the label an accurate judge gives in the caller's order."""
    pairs, labels = [], []
    for i in range(start, start + n):
        good = f"A careful, correct answer number {i} [[p{i}:good]]."
        bad = f"Meh {i} [[p{i}:bad]]"
        if i % good_first_every == 0:
            pairs.append(Pair(f"Question {i}?", good, bad))
            labels.append(1)
        else:
            pairs.append(Pair(f"Question {i}?", bad, good))
            labels.append(2)
    return pairs, labels


class TagResponder:
    """Answers every pair correctly; can be told to give the wrong number of answers a given number of times."""

    def __init__(self) -> None:
        self.wrong_count_left = 0
        self.always_wrong_count = False
        self._lock = threading.Lock()

    def __call__(self, body: dict) -> str | Fault:
        text = request_text(body)
        firsts: list[int] = []  # per pair in the order shown: 1 if the first shown output is the good one
        seen: set[str] = set()
        for pair_id, side in TAG.findall(text):
            if pair_id not in seen:
                seen.add(pair_id)
                firsts.append(1 if side == "good" else 2)
        with self._lock:
            wrong = self.always_wrong_count or self.wrong_count_left > 0
            if self.wrong_count_left > 0:
                self.wrong_count_left -= 1
        if wrong:
            firsts = firsts[:-1] if len(firsts) > 1 else [*firsts, 1]
        if "JSON" in text:
            return json.dumps([{"pair": k, "reasoning": "the tagged one is better", "preferred": c}
                               for k, c in enumerate(firsts, start=1)])
        lines = [f"Pair {k}: {c}" for k, c in enumerate(firsts, start=1)]
        if len(firsts) == 1:
            lines.insert(0, f"Output ({firsts[0]})")
        return "Here are my verdicts.\n" + "\n".join(lines)
