"""The one place that turns an instruction (+ optional input) into a model prompt.

``alpaca`` is the prompt the Alpaca / AlpacaFarm models were trained with (with and without an input);
``chat_template`` uses the tokenizer's own chat template (for instruct models such as SmolLM2).
SFT, generation, reward modelling and evaluation all call :func:`format_prompt`, so they always agree.
"""

from __future__ import annotations

from typing import Any

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
PROMPT_FORMATS = ("alpaca", "chat_template")


def user_message(instruction: str, input: str | None = None) -> str:
    """Instruction and input merged as AlpacaEval merges them (``"{instruction}\\n\\n{input}"``)."""
    return f"{instruction}\n\n{input}" if input else instruction


def format_prompt(instruction: str, input: str | None = None, *, style: str = "alpaca", tokenizer: Any = None) -> str:
    """The prompt text for one instruction in the given ``style``."""
    if style == "alpaca":
        template = ALPACA_WITH_INPUT if input else ALPACA_NO_INPUT
        return template.format(instruction=instruction, input=input)
    if style == "chat_template":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("prompt_format 'chat_template' needs a tokenizer that has a chat template")
        messages = [{"role": "user", "content": user_message(instruction, input)}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    raise ValueError(f"unknown prompt format {style!r}; use one of {', '.join(PROMPT_FORMATS)}")
