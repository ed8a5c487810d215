"""Preference pairs as training data: which output won, chosen/rejected rows, preferred demonstrations, splits.

``preference`` 1 means ``output_1`` won, 2 means ``output_2`` won; ties (0), unparsed annotations (None) and
anything else carry no ranking and are dropped (and counted). Continuous preferences in [1, 2] (AlpacaEval's
weighted annotators) are rounded to the nearer side; exactly 1.5 is a tie.
"""

from __future__ import annotations

import random
from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.prompts import format_prompt


def winner(preference: Any) -> int | None:
    """1 or 2: the output that won; None when the preference carries no ranking."""
    try:
        value = float(preference)
    except (TypeError, ValueError):
        return None
    if 1.0 <= value < 1.5:
        return 1
    if 1.5 < value <= 2.0:
        return 2
    return None


def check_pair_record(record: dict[str, Any]) -> None:
    """Refuse a preference record without an instruction and two outputs, naming the fields it has."""
    missing = [k for k in ("instruction", "output_1", "output_2") if k not in record]
    if missing:
        raise UserError(f"a preference record lacks {', '.join(missing)} (fields: {', '.join(sorted(record))})")


def ranked(records: list[dict[str, Any]]) -> tuple[list[tuple[dict[str, Any], str, str]], int]:
    """``(record, chosen output, rejected output)`` for every record with a ranking, and how many had none."""
    found, dropped = [], 0
    for record in records:
        check_pair_record(record)
        won = winner(record.get("preference"))
        if won is None:
            dropped += 1
        else:
            found.append((record, record[f"output_{won}"], record[f"output_{3 - won}"]))
    return found, dropped


def preference_rows(records: list[dict[str, Any]], *, style: str, tokenizer: Any) -> tuple[list[dict[str, str]], int]:
    """Preference records → ``{"prompt", "chosen", "rejected"}`` rows, and how many had no usable preference."""
    pairs, dropped = ranked(records)
    return [{"prompt": format_prompt(r["instruction"], r.get("input") or None, style=style, tokenizer=tokenizer),
             "chosen": chosen, "rejected": rejected} for r, chosen, rejected in pairs], dropped


def preferred_demonstrations(records: list[dict[str, Any]]) -> tuple[list[dict[str, str]], int]:
    """Preference records → demonstration records (instruction, input, output = the preferred output), and how
    many pairs had no usable preference."""
    pairs, dropped = ranked(records)
    return [{"instruction": r["instruction"], "input": r.get("input") or "", "output": chosen}
            for r, chosen, _ in pairs], dropped


def split_pairs(rows: list[dict[str, str]], eval_fraction: float,
                seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """A seeded shuffle, then the last ``eval_fraction`` of the pairs held out (at least one when asked for any)."""
    shuffled = list(rows)
    random.Random(seed).shuffle(shuffled)
    n_eval = 0 if eval_fraction == 0 else max(1, round(len(shuffled) * eval_fraction))
    if n_eval >= len(shuffled):
        raise UserError(f"{len(shuffled)} usable preference pairs are too few to hold out {eval_fraction:.0%}")
    return shuffled[: len(shuffled) - n_eval], shuffled[len(shuffled) - n_eval:]
