"""Rows for trainers, built from instruction records: what SFT-style methods train on.

Part of the method helpers (with :mod:`alpacafarm.reward_selection` and :mod:`alpacafarm.policy_training`): what
the built-in methods call themselves, public so that a plugin imports these, never a built-in, and a third-party
method built from them behaves as the built-ins do.

:func:`prompt_completion_rows` — instruction records → ``{"prompt", "completion"}`` rows (completion + EOS) for TRL's
``SFTTrainer``; :func:`response_of` — a demonstration's answer; :func:`training_rows` — tokenized rows whose
completion ends with EOS only when the sample ``finished`` (a sample cut at ``max_new_tokens`` must not be trained
to stop there).
"""

from __future__ import annotations

from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.prompts import format_prompt

#: Where an answer may live in a demonstration record, in order of preference after ``response_field``.
FALLBACK_RESPONSE_FIELDS = ("output", "reference")
#: The label of a token the loss ignores (the prompt's, in :func:`training_rows`).
IGNORE_INDEX = -100


def response_of(record: dict[str, Any], response_field: str) -> str:
    """The answer of a demonstration: ``response_field``, else ``output``, else ``reference``."""
    for name in (response_field, *FALLBACK_RESPONSE_FIELDS):
        value = record.get(name)
        if isinstance(value, str):
            return value
    raise UserError(f"a demonstration record has no {response_field!r} field (fields: {', '.join(sorted(record))}); "
                    f"set stages.<name>.config.response_field")


def prompt_completion_rows(records: list[dict[str, Any]], *, response_field: str, style: str,
                           tokenizer: Any) -> list[dict[str, str]]:
    """Records → ``{"prompt", "completion"}`` rows; the completion ends with EOS so the model learns to stop."""
    eos = tokenizer.eos_token or ""
    rows = []
    for record in records:
        if not record.get("instruction"):
            raise UserError(f"a demonstration record has no 'instruction' (fields: {', '.join(sorted(record))})")
        prompt = format_prompt(record["instruction"], record.get("input") or None, style=style, tokenizer=tokenizer)
        response = response_of(record, response_field)
        rows.append({"prompt": prompt, "completion": response if response.endswith(eos) else response + eos})
    return rows


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def training_rows(demonstrations: list[dict[str, Any]], tokenizer: Any, style: str) -> list[dict[str, list[int]]]:
    """Tokenized SFT rows (``input_ids``, ``labels`` with the prompt ignored) of the demonstrations.

    Tokenized as TRL tokenizes a prompt/completion row (prompt + completion as one text; the completion starts
    where the tokenized prompt stops being a prefix), but the completion ends with EOS only when the demonstration
    ``finished``: a response cut at the token limit is trained on as it is, without an end.
    """
    eos = tokenizer.eos_token or ""
    rows = []
    for d in demonstrations:
        prompt = format_prompt(d["instruction"], d.get("input") or None, style=style, tokenizer=tokenizer)
        finished = bool(d.get("finished", True))
        prompt_ids = list(tokenizer(text=prompt)["input_ids"])
        ids = list(tokenizer(text=prompt + d["output"] + (eos if finished else ""))["input_ids"])
        if not finished and ids and ids[-1] == tokenizer.eos_token_id:  # a tokenizer that appends EOS itself
            ids = ids[:-1]
        start = _common_prefix(prompt_ids, ids)
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * start + ids[start:]})
    return rows
