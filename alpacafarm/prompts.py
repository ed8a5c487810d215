"""The one place that turns an instruction (+ optional input) into a model prompt.

``alpaca`` is the prompt the Alpaca / AlpacaFarm models were trained with (with and without an input);
``chat_template`` uses the tokenizer's own chat template (for instruct models such as SmolLM2).
SFT, generation, reward modelling and evaluation all call :func:`format_prompt`, so they always agree.

A model folder may carry ``alpacafarm_generation.json`` (:class:`PromptConditioning`): fixed text the model was
trained to see around every prompt, such as the "good" control token of binary reward conditioning.
:class:`PromptFormat` applies it where prompts are formatted, so every generation backend and every sampler
(generation, best-of-n, PPO and Quark rollouts) that samples from that folder is conditioned the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
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

#: The file in a model folder that holds its :class:`PromptConditioning`.
CONDITIONING_FILE = "alpacafarm_generation.json"


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


@dataclass(frozen=True)
class PromptConditioning:
    """Text a model expects around every formatted prompt, saved next to its weights by the stage that trained it.

    ``prompt_prefix`` goes before the prompt (reward conditioning's control token: the paper prepends it to the
    whole example), ``response_prefix`` after it (the response is generated as its continuation). Both are part
    of the prompt, so they never appear in a completion.
    """

    prompt_prefix: str = ""
    response_prefix: str = ""

    def apply(self, prompt: str) -> str:
        """``prompt_prefix + prompt + response_prefix``: the text the model is conditioned on."""
        return f"{self.prompt_prefix}{prompt}{self.response_prefix}"

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / CONDITIONING_FILE
        path.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> PromptConditioning:
        """The conditioning saved in a local model folder; none (empty prefixes) when there is no file."""
        from alpacafarm.errors import UserError

        path = Path(directory) / CONDITIONING_FILE
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise UserError(f"{path}: not a valid generation conditioning file: {exc}") from None
        known = {f.name for f in fields(cls)}
        bad = ([k for k, v in data.items() if k not in known or not isinstance(v, str)] if isinstance(data, dict)
               else [""])
        if bad:
            raise UserError(f"{path}: not a valid generation conditioning file: unexpected {bad[0]!r} "
                            f"(allowed: {', '.join(sorted(known))}, strings)")
        return cls(**data)


@dataclass(frozen=True)
class PromptFormat:
    """How a model's prompts are written: the style, the tokenizer (for chat templates) and its conditioning."""

    style: str = "alpaca"
    tokenizer: Any = None
    conditioning: PromptConditioning = field(default_factory=PromptConditioning)

    @classmethod
    def for_model(cls, style: str, model_path: str | Path | None, tokenizer: Any = None) -> PromptFormat:
        """The format for sampling from ``model_path``, with the conditioning its folder carries (if local)."""
        location = Path(model_path) if model_path else None
        conditioning = PromptConditioning.load(location) if location is not None and location.is_dir() else None
        return cls(style, tokenizer, conditioning or PromptConditioning())

    def __call__(self, instruction: str, input: str | None = None) -> str:
        return self.conditioning.apply(format_prompt(instruction, input or None, style=self.style,
                                                     tokenizer=self.tokenizer))

    def records(self, records: Sequence[dict[str, Any]]) -> list[str]:
        """The prompts of instruction records (``instruction`` and optional ``input``), in order."""
        return [self(r["instruction"], r.get("input")) for r in records]
