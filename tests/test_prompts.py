"""Prompt formats: the Alpaca prompt (exact text) and the tokenizer's chat template."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from alpacafarm.prompts import PROMPT_FORMATS, format_prompt, user_message

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "[PAD]": 1, "name": 2, "a": 3, "colour": 4}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")


def test_alpaca_without_input():
    assert format_prompt("Name a colour.") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request."
        "\n\n### Instruction:\nName a colour.\n\n### Response:\n"
    )
    assert (format_prompt("Name a colour.", "") == format_prompt("Name a colour.", None)
            == format_prompt("Name a colour."))


def test_alpaca_with_input():
    assert format_prompt("Translate to English.", "bonjour {x}", style="alpaca") == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nTranslate to English.\n\n### Input:\nbonjour {x}\n\n### Response:\n"
    )


def test_user_message():
    assert user_message("Translate.", "bonjour") == "Translate.\n\nbonjour"
    assert user_message("Name a colour.") == user_message("Name a colour.", "") == "Name a colour."


def test_chat_template_style(tokenizer):
    tokenizer.chat_template = CHAT_TEMPLATE
    assert format_prompt("Name a colour.", style="chat_template", tokenizer=tokenizer) == (
        "<|user|>Name a colour.<|end|>\n<|assistant|>"
    )
    assert format_prompt("Translate.", "bonjour", style="chat_template", tokenizer=tokenizer) == (
        "<|user|>Translate.\n\nbonjour<|end|>\n<|assistant|>"
    )


def test_chat_template_style_needs_a_template(tokenizer):
    assert not tokenizer.chat_template
    for tok in (tokenizer, None):
        with pytest.raises(ValueError, match="needs a tokenizer that has a chat template"):
            format_prompt("Name a colour.", style="chat_template", tokenizer=tok)


def test_unknown_style():
    assert PROMPT_FORMATS == ("alpaca", "chat_template")
    with pytest.raises(ValueError, match=r"unknown prompt format 'vicuna'; use one of alpaca, chat_template"):
        format_prompt("Name a colour.", style="vicuna")
