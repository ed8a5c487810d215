"""AlpacaEval's completion parsers, reproduced (checked against the package's own by
``tests/test_alpaca_eval_configs.py``): ``regex_parser``, ``ranking_parser``, ``json_parser``, ``lmsys_parser``,
``logprob_parser`` and ``pipeline_meta_parser``, over the completion text, or over the choice with its logprobs
when ``completion_key: completions_all``. A result whose length is not the batch size is no answer. The logprob
parser gives continuous preferences (``2 - p(first output)``), which flow into the weighted win-rate.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Sequence
from typing import Any

from alpacafarm_annotators.alpaca_eval_members import Member


def _regex(text: str, outputs_to_match: dict[Any, str]) -> list[Any]:
    if text == "":
        raise ValueError("empty completion")
    patterns = {key: re.compile(value) for key, value in outputs_to_match.items()}
    found = []
    while True:
        best = best_key = None
        for key, pattern in patterns.items():
            m = pattern.search(text)
            if m and (best is None or m.start() < best.start()):
                best, best_key = m, key
        if best is None or best.end() == 0:  # no match left (an empty match at 0 would repeat forever)
            return found
        found.append(best_key)
        text = text[best.end():]


def _ranking(value: Any, model_1_name: str = "model_1") -> list[Any]:
    if value == "":
        raise ValueError("empty completion")
    try:
        ranks = ast.literal_eval(value) if isinstance(value, str) else value
        rank = next(r for r in ranks if r["model"] == model_1_name)["rank"]
        return [rank] if rank in (1, 2) else [math.nan]
    except Exception:
        return [math.nan]


def _json(value: str, annotation_key: str | None) -> list[Any]:
    if value == "":
        raise ValueError("empty completion")
    if "```json" in value:
        value = re.search(r"```json(.*?)```", value, re.DOTALL).group(1)
    loaded = json.loads(value)
    if isinstance(loaded, dict):
        return [loaded[annotation_key] if annotation_key is not None else loaded]
    return [row[annotation_key] if annotation_key is not None else row for row in loaded]


def _lmsys(text: str) -> list[Any]:
    if text == "":
        raise ValueError("empty completion")
    try:
        first, second = text.split("\n")[0].replace(",", " ").split(" ")
        a, b = float(first), float(second)
    except ValueError:
        return [math.nan]
    return [1 if a > b else 2 if a < b else 0]


def _logprob(choice: dict[str, Any], numerator_token: str, denominator_tokens: Sequence[str],
             is_binarize: bool = True, log_prob_index: str | int = "batch") -> list[float]:
    content = ((choice or {}).get("logprobs") or {}).get("content")
    if not content:
        raise ValueError("the completion has no logprobs")
    wanted = [*denominator_tokens, numerator_token]

    def one(top: list[dict[str, Any]]) -> float:
        found = {t["token"]: t["logprob"] for t in top if t["token"] in wanted}
        if not found:
            return math.nan
        first = found.get(numerator_token, -math.inf)
        if is_binarize:
            others = [found.get(t, -math.inf) for t in denominator_tokens if t != numerator_token]
            return 1 if all(first > o for o in others) else 2
        values = [found.get(t, -math.inf) for t in denominator_tokens]
        peak = max(values)
        total = peak + math.log(sum(math.exp(v - peak) for v in values)) if peak > -math.inf else -math.inf
        return 2 - math.exp(first - total)

    if log_prob_index == "batch":
        return [one(position["top_logprobs"]) for position in content]
    return [one(content[int(log_prob_index)]["top_logprobs"])]


_SIMPLE = {"regex_parser": _regex, "ranking_parser": _ranking, "json_parser": _json, "lmsys_parser": _lmsys,
           "logprob_parser": _logprob}


def _pipeline(value: Any, parsers_to_kwargs: dict[str, dict], is_squeeze: bool = True, _depth: int = 0) -> list[Any]:
    steps = list(parsers_to_kwargs.items())
    (first, kwargs), rest = steps[0], dict(steps[1:])
    out = _SIMPLE[first](value, **(kwargs or {}))
    if rest:
        out = [_pipeline(v, rest, is_squeeze, _depth + 1) for v in out]
    if is_squeeze and len(out) == 1 and _depth != 0:
        return out[0]
    return out


def run_parser(member: Member, completion: str | dict[str, Any]) -> list[Any]:
    """The parser's raw result for one completion (raises when it cannot read it, as AlpacaEval's parsers do)."""
    kwargs = {k: (dict(v) if isinstance(v, dict) else v) for k, v in member.parser_kwargs.items()}
    if member.parser == "pipeline_meta_parser":
        return _pipeline(completion, **kwargs)
    return _SIMPLE[member.parser](completion, **kwargs)


def _as_preference(value: Any) -> float | int | None:
    """A valid AlpacaEval preference (0 = tie, or within [1, 2]) as a plain number, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            import numpy as np

            if isinstance(value, np.integer | np.floating):
                value = value.item()
            else:
                return None
        except ImportError:
            return None
    if isinstance(value, float) and math.isnan(value):
        return None
    if value == 0 or 1 <= value <= 2:
        return value
    return None


def parse_values(member: Member, completion: str | dict[str, Any]) -> list[float | int | None]:
    """One value per row of the (padded) batch, as AlpacaEval reads it: None where its parser gives NaN or an
    invalid preference; all None when the parser fails or returns the wrong number of values."""
    try:
        values = list(run_parser(member, completion))
    except Exception:
        return [None] * member.batch_size
    if len(values) != member.batch_size:
        return [None] * member.batch_size
    return [_as_preference(v) for v in values]
