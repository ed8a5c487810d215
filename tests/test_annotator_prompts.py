"""The annotator pool as data: configs, prompt templates and parsers (real files, no mocks).

Checks that every config in ``configs/`` validates and renders, that the pools mirror the paper's 13 annotators
(5 GPT-4, 4 ChatGPT, 4 Davinci003; batch sizes 1/4/5; completion style; a JSON chain-of-thought variant), that
rendering numbers every component, and that each template's own answer format parses back with its parser.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from alpacafarm.types import Pair
from alpacafarm_annotators import parsing, templates
from alpacafarm_annotators.config import CONFIG_DIR, TEMPLATE_DIR, PoolConfig, PromptedAnnotatorConfig

PAIRS_NO_INPUT = [Pair(f"Instruction number {i}?", f"first answer {i}", f"second answer {i}") for i in range(1, 6)]
PAIRS_INPUT = [Pair(f"Instruction number {i}?", f"first answer {i}", f"second answer {i}", f"input text {i}")
               for i in range(1, 6)]
LABELS = [2, 1, 1, 2, 2]


def _load(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def _configs() -> dict[str, PromptedAnnotatorConfig | PoolConfig]:
    out: dict[str, PromptedAnnotatorConfig | PoolConfig] = {}
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        data = _load(path)
        if data.get("kind") == "alpaca_eval":  # the paper's configs, read from alpaca-eval (test_alpaca_eval_configs)
            continue
        out[path.stem] = (PoolConfig if data.get("kind") == "pool" else PromptedAnnotatorConfig).model_validate(data)
    return out


CONFIGS = _configs()
PROMPTED = {k: v for k, v in CONFIGS.items() if isinstance(v, PromptedAnnotatorConfig)}
POOLS = {k: v for k, v in CONFIGS.items() if isinstance(v, PoolConfig)}
THIRTEEN = sorted(k for k in PROMPTED if k != "gpt4_greedy_b5")


def _text(prompt: list[dict[str, Any]] | str) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


# ---------------------------------------------------------------- configs and pools


def test_config_inventory():
    assert len(PROMPTED) == 14 and len(POOLS) == 4
    assert set(POOLS) == {"alpacafarm_eval_builtin", "alpacafarm_ann_builtin", "alpacafarm_gpt4_builtin", "offline_ann"}
    assert POOLS["offline_ann"].annotators == ["offline"] and POOLS["offline_ann"].p_label_flip == 0.25
    presets = {path.stem: _load(path) for path in CONFIG_DIR.glob("*.yaml") if _load(path)["kind"] == "alpaca_eval"}
    assert {k: (v["config"], v["fallback"], v["p_label_flip"]) for k, v in presets.items()} == {
        "alpacafarm_ann": ("alpaca_farm", "alpacafarm_ann_builtin", 0.25),
        "alpacafarm_eval": ("alpaca_farm", "alpacafarm_eval_builtin", 0.0),
        "alpacafarm_gpt4": ("alpaca_farm_greedy_gpt4", "alpacafarm_gpt4_builtin", 0.0)}
    for path in CONFIG_DIR.glob("*.yaml"):
        assert _load(path)["kind"] in ("prompted", "pool", "alpaca_eval"), path.name


@pytest.mark.parametrize("name", sorted(PROMPTED))
@pytest.mark.parametrize("pairs", [PAIRS_NO_INPUT, PAIRS_INPUT], ids=["no-input", "input"])
def test_prompted_config_renders(name: str, pairs: list[Pair]):
    config = PROMPTED[name]
    assert config.description and config.parser in parsing.PARSERS
    template = templates.load_template(config.template)
    batch = pairs[: config.batch_size]
    prompt = templates.render(template, batch, config.style)
    assert isinstance(prompt, str if config.style == "completion" else list)
    text = _text(prompt)
    items = templates.render_items(template, batch)
    assert items in text
    for i, pair in enumerate(batch, start=1):
        assert pair.instruction in items and pair.output_1 in items and pair.output_2 in items
        input_header = template.input_format.format(index=i, input="\0").split("\0")[0].strip()
        assert (input_header in items) == bool(pair.input)
        assert not pair.input or pair.input in items


def test_pools_mirror_the_paper():
    ev, ann, gpt4 = POOLS["alpacafarm_eval_builtin"], POOLS["alpacafarm_ann_builtin"], POOLS["alpacafarm_gpt4_builtin"]
    assert len(THIRTEEN) == 13
    for pool in (ev, ann):
        assert sorted(pool.annotators) == THIRTEEN and len(set(pool.annotators)) == 13
        assert pool.randomize_order
    assert ev.p_label_flip == 0.0 and ann.p_label_flip == 0.25
    assert gpt4.annotators == ["gpt4_greedy_b5"] and gpt4.randomize_order and gpt4.p_label_flip == 0.0
    greedy = PROMPTED["gpt4_greedy_b5"]
    assert greedy.model == "gpt-4-0314" and greedy.batch_size == 5 and greedy.decoding["temperature"] == 0


def test_thirteen_annotators_vary_like_the_paper():
    members = [PROMPTED[n] for n in THIRTEEN]
    assert Counter(c.model for c in members) == {"gpt-4-0314": 5, "gpt-3.5-turbo-0301": 4, "text-davinci-003": 4}
    assert {c.batch_size for c in members} == {1, 4, 5}
    assert all(c.style == "completion" for c in members if c.model == "text-davinci-003")
    assert {c.style for c in members} == {"chat", "completion"}
    assert any(c.parser == "json" and c.model == "gpt-3.5-turbo-0301" for c in members)
    for c in members:
        assert c.decoding["temperature"] == 1.0 and c.decoding["top_p"] == 1.0 and c.decoding["max_tokens"] > 0
    n_examples = {len(templates.load_template(c.template).examples) for c in members}
    assert 0 in n_examples and max(n_examples) >= 2
    personas = [templates.load_template(PROMPTED[n].template).system or ""
                for n in ("gpt4_verbose_b5", "gpt4_concise_b5")]
    assert "detail" in personas[0] and "list" in personas[1]


def test_every_template_file_loads():
    names = templates.available_templates()
    assert {c.template for c in PROMPTED.values()} <= set(names)
    for name in names:
        assert templates.load_template(name) == templates.load_template(str(TEMPLATE_DIR / f"{name}.yaml"))


# ---------------------------------------------------------------- templates and rendering


def test_unknown_template_suggests_a_name():
    with pytest.raises(ValueError, match="did you mean 'ranking'"):
        templates.load_template("rankin")
    with pytest.raises(ValueError, match="does not exist"):
        templates.load_template("/nonexistent/template.yaml")


def test_bad_format_string_is_rejected(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"guidelines": "g", "item": "{index} {oops}", "answer_format": "{n}"}))
    with pytest.raises(ValueError, match="item"):
        templates.load_template(str(path))


def test_template_text_is_canonical():
    a, b = templates.load_template("ranking"), templates.load_template("ranking_noex")
    assert templates.template_text(a) == templates.template_text(templates.load_template("ranking"))
    assert templates.template_text(a) != templates.template_text(b)


def test_batched_chat_rendering():
    template = templates.load_template("ranking")
    pairs = [PAIRS_NO_INPUT[0], PAIRS_INPUT[1], PAIRS_NO_INPUT[2]]
    messages = templates.render(template, pairs, "chat")
    assert [m["role"] for m in messages] == ["user"]
    text = messages[0]["content"]
    for i, pair in enumerate(pairs, start=1):
        assert f"### Pair {i}\n[Instruction {i}]\n{pair.instruction}" in text
        assert f"[Pair {i}, output 1]\n{pair.output_1}" in text and f"[Pair {i}, output 2]\n{pair.output_2}" in text
    assert "[Input 2]\ninput text 2" in text and "[Input 1]" not in text.split("## Pairs to judge")[1]
    assert "### Pair 4" not in text.split("## Pairs to judge")[1]
    assert (text.index(template.examples[0].instruction) < text.index("## Pairs to judge")
            < text.index(pairs[0].instruction))
    assert "Pair 1: 1\nPair 2: 2\nPair 3: 1" in text  # the examples' batched answer
    assert text.rstrip().endswith(template.answer_format.format(n=3).strip())
    assert "Write exactly 3 lines" in text


def test_system_message_and_completion_style():
    template = templates.load_template("ranking_verbose")
    messages = templates.render(template, PAIRS_NO_INPUT[:2], "chat")
    assert [m["role"] for m in messages] == ["system", "user"] and messages[0]["content"] == template.system
    prompt = templates.render(templates.load_template("completion_ranking"), PAIRS_INPUT[:4], "completion")
    assert isinstance(prompt, str) and prompt.endswith("Verdicts:")
    assert "Response 4.2: second answer 4" in prompt and "Input 4: input text 4" in prompt
    with pytest.raises(ValueError, match="style"):
        templates.render(template, PAIRS_NO_INPUT[:1], "xml")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        templates.render(template, [], "chat")


def test_single_pair_examples_are_shown_one_by_one():
    template = templates.load_template("completion_single")
    prompt = templates.render(template, PAIRS_NO_INPUT[:1], "completion")
    assert prompt.count("Better output: Output (") == 2 and prompt.endswith("Better output:")
    assert prompt.index("--- Example 2 ---") < prompt.index("--- To judge ---") < prompt.index("Instruction number 1?")


# ---------------------------------------------------------------- parsers


@pytest.mark.parametrize(("text", "n", "expected"), [
    ("Here are my verdicts:\n**Pair 1:** 2\n- pair 2 - Output (1)\n3: (2)\nHope this helps!", 3, [2, 1, 2]),
    ("Pair 1: 2, Pair 2: 1", 2, [2, 1]),
    ("PAIR 1: Output 2 is better\nPair 2: 1 (more accurate)\n`Pair 3: [2]`", 3, [2, 1, 2]),
    ("## Verdicts\n1. 1\n2. 2", 2, [1, 2]),
    ("Pair 1: 2\nPair 2: 1", 3, None),  # missing pair
    ("Pair 1: 2\nPair 2: 1\nPair 3: 1", 2, None),  # too many
    ("Pair 1: 2\nPair 1: 1", 2, None),  # duplicate
    ("Pair 1: 2\nPair 3: 1", 2, None),  # out of range
    ("Pair 0: 1", 1, None),
    ("Pair 1: tie\nPair 2: 1", 2, None),
    ("Pair 1: Output 1 is worse than Output 2", 1, None),
    ("Pair 1: 2.5", 1, None),
    ("1: 2 cups of flour", 1, None),
    ("Both outputs are fine, it depends on personal preference.", 1, None),
    ("", 1, None),
])
def test_ranking_parser(text: str, n: int, expected: list[int] | None):
    assert parsing.parse("ranking", text, n) == expected


@pytest.mark.parametrize(("text", "n", "expected"), [
    ('Sure!\n```json\n[{"pair": 1, "reasoning": "a", "preferred": 2},\n {"pair": "2", "reasoning": "b", '
     '"preferred": "1"}]\n```\nLet me know.', 2, [2, 1]),
    ('My answer: [{"pair": 2, "preferred": 1}, {"pair": 1, "preferred": "Output (2)"}] done', 2, [2, 1]),
    ('{"annotations": [{"pair": 1, "reasoning": "x", "preferred": 2}]}', 1, [2]),
    ('{"reasoning": "short", "preferred": 1}', 1, [1]),
    ('[{"pair": 1, "preferred": 2}]', 2, None),  # wrong count
    ('[{"pair": 1, "preferred": 2}, {"pair": 1, "preferred": 1}]', 2, None),  # duplicate
    ('[{"pair": 1, "preferred": 2}, {"pair": 3, "preferred": 1}]', 2, None),  # out of range
    ('[{"pair": 1, "preferred": true}]', 1, None),
    ('[{"pair": 1, "preferred": "tie"}]', 1, None),
    ('{"reasoning": "short", "preferred": 1}', 2, None),
    ('```json\n[{"pair": 1, "preferred": \n```', 1, None),
    ("Pair 1: 2", 1, None),
])
def test_json_parser(text: str, n: int, expected: list[int] | None):
    assert parsing.parse("json", text, n) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("Output (2)", [2]), (" 1", [1]), ("**Output (1)**", [1]), ("Answer: Output (2)", [2]),
    ("Better output: Output (1)", [1]), ("Output (2) is better.", [2]), ("Output (1)\n\nOutput (2) rambles.", [1]),
    ("Output (1)\nOutput (1)", [1]), ("# Output (2)", [2]),
    ("Here is my verdict.\nOutput (1)\nPair 1: 1", [1]), ("Pair 1: 2", [2]), ("Output (2)\nPair 1: 1", None),
    ("Pair 2: 1", None), ("Output (1) because output 2 is vague", None),
    ("The second output is better", None), ("Output (1)\nOutput (2)", None), ("1 or 2", None),
    ("Neither is better.", None), ("Output (3)", None), ("2.5", None), ("", None),
])
def test_single_parser(text: str, expected: list[int] | None):
    assert parsing.parse("single", text, 1) == expected
    assert parsing.parse("single", text, 2) is None


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match=r"ranking.*json.*single"):
        parsing.parse("regex", "Pair 1: 1", 1)


@pytest.mark.parametrize("name", sorted(PROMPTED))
def test_template_and_parser_agree(name: str):
    """A completion written exactly in the template's answer format parses back to the intended labels."""
    config = PROMPTED[name]
    template = templates.load_template(config.template)
    labels = LABELS[: config.batch_size]
    answer = templates.render_answer(template, labels, ["because it is better"] * len(labels))
    assert parsing.parse(config.parser, answer, len(labels)) == labels
    assert parsing.parse(config.parser, "\n" + answer + "\n", len(labels)) == labels
    if template.answer_prefix:  # what the model sees at the end of the prompt, followed by its completion
        assert parsing.parse(config.parser, f"{template.answer_prefix} {answer}", len(labels)) == labels
    assert parsing.parse(config.parser, answer, len(labels) + 1) is None
    groups = [template.examples] if template.batch_examples else [[ex] for ex in template.examples]
    for group in groups if template.examples else []:  # the examples' answers, as rendered in the prompt, parse too
        shown = templates.render_answer(template, [ex.answer for ex in group], [ex.explanation for ex in group])
        assert shown in _text(templates.render(template, PAIRS_NO_INPUT[:1], config.style))
        assert parsing.parse(config.parser, shown, len(group)) == [ex.answer for ex in group]
