"""Prompt templates for prompted annotators, stored as data in ``templates/<name>.yaml``.

A template says how to ask an LLM which of two outputs is better for a *batch* of pairs: guidelines first,
then optional in-context examples (rendered with the same numbered ``item`` format and followed by their answer,
so the model sees what a batched answer looks like), then the pairs to judge, then the answer format.
:func:`render` turns a template and pairs into OpenAI chat messages or one completion prompt;
:func:`render_answer` writes labels in the template's own answer format (used for the examples, and by tests to
check that template and parser agree).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from alpacafarm.errors import did_you_mean
from alpacafarm.types import Pair
from alpacafarm_annotators.config import TEMPLATE_DIR

Style = Literal["chat", "completion"]


class Example(BaseModel):
    """One in-context example: a pair and the label (and optional reasoning) we want the model to imitate."""

    model_config = ConfigDict(extra="forbid")

    instruction: str
    input: str = ""
    output_1: str
    output_2: str
    answer: Literal[1, 2]
    explanation: str | None = Field(None, description="short reasoning, shown by chain-of-thought templates")

    def pair(self) -> Pair:
        return Pair(self.instruction, self.output_1, self.output_2, self.input)


class PromptTemplate(BaseModel):
    """The parts of an annotation prompt. Format strings are checked when the template is loaded."""

    model_config = ConfigDict(extra="forbid")

    system: str | None = Field(None, description="system message (chat) or preamble (completion), e.g. a persona")
    guidelines: str = Field(description="shown first: what makes a good answer and how to answer")
    examples: list[Example] = Field(default_factory=list)
    batch_examples: bool = Field(True, description="all examples as one numbered batch (else one block each)")
    example_header: str = Field("## Example {k}\n", description="before each example block; {k} counts blocks")
    example_answer_intro: str = Field("Answer:\n", description="before an example's answer when no answer_prefix")
    task_header: str = Field("## Pairs to judge\n", description="before the pairs to annotate")
    item: str = Field(description="one pair: {index} {instruction} {input_block} {output_1} {output_2}")
    input_format: str = Field("\nInput {index}: {input}\n", description="the {input_block}, only when non-empty")
    answer_format: str = Field(description="after the pairs: the exact answer format for {n} pairs")
    answer_style: Literal["lines", "json"] = Field("lines", description="how answers are written")
    answer_line: str = Field("Pair {index}: {answer}", description="one answer when answer_style is lines")
    answer_prefix: str | None = Field(None, description="ends a completion-style prompt; starts example answers")

    @model_validator(mode="after")
    def _check_format_strings(self) -> PromptTemplate:
        checks = {
            "item": lambda: self.item.format(index=1, instruction="", input_block="", output_1="", output_2=""),
            "input_format": lambda: self.input_format.format(index=1, input=""),
            "answer_format": lambda: self.answer_format.format(n=2),
            "answer_line": lambda: self.answer_line.format(index=1, answer=1),
            "example_header": lambda: self.example_header.format(k=1),
        }
        for name, check in checks.items():
            try:
                check()
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(f"template field {name!r} is not a valid format string: {exc!r}") from exc
        return self


def available_templates() -> list[str]:
    """Names of the built-in templates (files in ``TEMPLATE_DIR``)."""
    return sorted(p.stem for p in TEMPLATE_DIR.glob("*.yaml"))


def load_template(name_or_path: str) -> PromptTemplate:
    """A built-in template by name, or a template file when given a path ending in ``.yaml``."""
    if name_or_path.endswith((".yaml", ".yml")):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ValueError(f"template file {str(path)!r} does not exist")
    else:
        path = TEMPLATE_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            known = available_templates()
            raise ValueError(f"unknown template {name_or_path!r}{did_you_mean(name_or_path, known)} "
                             f"(known: {', '.join(known)})")
    from alpacafarm.paths import read_text
    from alpacafarm.yamlsource import yaml_value

    try:  # bounded (alias bombs, nesting), UTF-8: a template file is something a person edits
        data = yaml_value(read_text(path, "template file"), f"template file {str(path)!r}")
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ValueError(f"template file {str(path)!r} is not valid YAML ({problem})") from None
    if not isinstance(data, dict):
        raise ValueError(f"template file {str(path)!r} must hold a mapping")
    try:
        return PromptTemplate.model_validate(data)
    except ValueError as exc:
        raise ValueError(f"invalid template {str(path)!r}: {exc}") from exc


def template_text(template: PromptTemplate) -> str:
    """A canonical serialisation (stable key order), e.g. for annotation cache keys."""
    return json.dumps(template.model_dump(mode="json"), sort_keys=True, ensure_ascii=False)


def render_items(template: PromptTemplate, pairs: Sequence[Pair]) -> str:
    """The pairs in the ``item`` format, numbered 1..n; the input block only for pairs with an input."""
    blocks = []
    for index, pair in enumerate(pairs, start=1):
        input_block = template.input_format.format(index=index, input=pair.input) if pair.input.strip() else ""
        blocks.append(template.item.format(index=index, instruction=pair.instruction, input_block=input_block,
                                           output_1=pair.output_1, output_2=pair.output_2).rstrip("\n"))
    return "\n\n".join(blocks)


def render_answer(template: PromptTemplate, labels: Sequence[int], explanations: Sequence[str | None] = ()) -> str:
    """Labels (1 or 2, for pairs 1..n) written exactly in the template's answer format."""
    explained = list(explanations) + [None] * (len(labels) - len(explanations))
    if template.answer_style == "json":
        rows = [{"pair": i, "reasoning": why or "", "preferred": label}
                for i, (label, why) in enumerate(zip(labels, explained, strict=True), start=1)]
        return json.dumps(rows, indent=2, ensure_ascii=False)
    return "\n".join(template.answer_line.format(index=i, answer=label) for i, label in enumerate(labels, start=1))


def _attach(prefix: str, answer: str) -> str:
    if not prefix or prefix[-1].isspace():
        return prefix + answer
    return prefix + ("\n" if "\n" in answer else " ") + answer


def render_examples(template: PromptTemplate) -> str:
    """The in-context examples (empty when there are none), each block numbered like a real batch."""
    if not template.examples:
        return ""
    groups = [template.examples] if template.batch_examples else [[ex] for ex in template.examples]
    blocks = []
    for k, group in enumerate(groups, start=1):
        items = render_items(template, [ex.pair() for ex in group])
        answer = render_answer(template, [ex.answer for ex in group], [ex.explanation for ex in group])
        intro = template.answer_prefix if template.answer_prefix is not None else template.example_answer_intro
        blocks.append(f"{template.example_header.format(k=k)}{items}\n\n{_attach(intro, answer)}")
    return "\n\n".join(blocks)


def render_body(template: PromptTemplate, pairs: Sequence[Pair]) -> str:
    """Guidelines, examples, the numbered pairs and the answer format (no system text, no answer prefix)."""
    if not pairs:
        raise ValueError("cannot render a prompt for zero pairs")
    parts = [template.guidelines.strip(), render_examples(template),
             template.task_header + render_items(template, pairs), template.answer_format.format(n=len(pairs)).strip()]
    return "\n\n".join(p for p in parts if p)


def render(template: PromptTemplate, pairs: Sequence[Pair], style: Style = "chat") -> list[dict[str, Any]] | str:
    """The request for ``pairs``: OpenAI chat messages ([system], user) or, for ``completion``, one string."""
    body = render_body(template, pairs)
    if style == "chat":
        messages: list[dict[str, Any]] = []
        if template.system:
            messages.append({"role": "system", "content": template.system.strip()})
        messages.append({"role": "user", "content": body})
        return messages
    if style == "completion":
        text = f"{template.system.strip()}\n\n{body}" if template.system else body
        return f"{text}\n\n{template.answer_prefix}" if template.answer_prefix else text
    raise ValueError(f"unknown prompt style {style!r} (known: chat, completion)")
