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
from collections.abc import Callable

from alpacafarm.testing.openai_server import FakeOpenAIServer, Fault, request_text
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


# ------------------------------------------------------------------------------- AlpacaEval's answer formats


def regex_answer(outputs_to_match: dict, choice: int) -> str:
    """A line that an AlpacaEval ``regex_parser`` with these patterns reads as ``choice`` (and not as the other)."""
    a_or_b = "a" if choice == 1 else "b"
    candidates = [f"Output ({a_or_b})", f"({a_or_b})", f'"Output (a) is better than Output (b)": '
                  f'{"true" if choice == 1 else "false"}']
    other = 2 if choice == 1 else 1
    for candidate in candidates:
        text = "\n" + candidate
        if re.search(outputs_to_match[choice], text) and not re.search(outputs_to_match[other], text):
            return text
    raise ValueError(f"no answer matches {outputs_to_match}")


class AlpacaEvalTagResponder:
    """Answers tagged pairs (:func:`tagged_pairs`) correctly in the answer format of the AlpacaEval member that sent
    the request (found by the request's model and the start of its prompt), padding answers included."""

    def __init__(self, members: list) -> None:
        from alpacafarm_annotators.alpaca_eval_source import PADDING, chat_messages, fill_template, pair_row

        self.members = []
        for m in members:  # each member's fixed text: its rendered prompt up to the first pair
            rows = [pair_row(PADDING, m.template)] * m.batch_size
            text = fill_template(m.template, rows, m.batch_size).strip()
            joined = "\n".join(x["content"] for x in chat_messages(text)) if m.chat else text
            self.members.append((m, joined[:joined.index(PADDING.instruction)]))

    def member(self, body: dict):
        sent = ("\n".join(x["content"] for x in body["messages"]) if "messages" in body else str(body.get("prompt")))
        found = [(len(prefix), i) for i, (member, prefix) in enumerate(self.members)
                 if member.model == body.get("model") and sent.startswith(prefix)]
        if not found:
            raise AssertionError(f"no member sends {body.get('model')}: {sent[:80]!r}")
        return self.members[max(found)[1]][0]

    def __call__(self, body: dict) -> str:
        member = self.member(body)
        firsts, seen = [], set()
        for pair_id, side in TAG.findall(request_text(body)):
            if pair_id not in seen:
                seen.add(pair_id)
                firsts.append(1 if side == "good" else 2)
        firsts += [1] * (member.batch_size - len(firsts))  # the padding pair
        return "".join(regex_answer(member.parser_kwargs["outputs_to_match"], c) for c in firsts)


class LogprobServer(FakeOpenAIServer):
    """A fake server whose chat completions carry the top log-probabilities ``top(body)`` gives for the first
    (only) answer token, as a logprob-weighted judge (AlpacaEval 2's) reads them."""

    def __init__(self, top: Callable[[dict], list[tuple[str, float]]], **kwargs) -> None:
        super().__init__(lambda body: top(body)[0][0], **kwargs)
        self.top = top

    def _completion(self, path: str, body: dict, text: str) -> dict:
        payload = super()._completion(path, body, text)
        if body.get("logprobs"):
            top = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in self.top(body)]
            for choice in payload["choices"]:
                choice["logprobs"] = {"content": [{**top[0], "top_logprobs": top}], "refusal": None}
        return payload


class FewChoicesServer(FakeOpenAIServer):
    """A server that ignores ``n`` (llama.cpp's does): one choice per request, whatever was asked."""

    def _completion(self, path: str, body: dict, text: str) -> dict:
        return super()._completion(path, {**body, "n": 1}, text)
