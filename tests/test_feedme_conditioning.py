"""``binary_feedme`` and ``binary_reward_conditioning`` on tiny models, and generation conditioned by a model folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_dpo import UNRANKED, completion_logps, margins, preference_records, training_rows

from alpacafarm.errors import UserError
from alpacafarm.generation import SamplingConfig, TransformersGenerator, generate_records
from alpacafarm.prompts import CONDITIONING_FILE, PromptConditioning, PromptFormat
from alpacafarm.recipe import ModelSpec, load_recipe
from alpacafarm.testing import run_recipe, tiny_causal_lm, tiny_tokenizer, write_records

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Weighted (AlpacaEval-style) preferences and the unranked ones: 1.2 → output_1, 1.9 → output_2, 1.5 → a tie.
EDGE_CASES = [
    {
        "instruction": "weighted one",
        "input": "ctx",
        "output_1": "first wins",
        "output_2": "second",
        "preference": 1.2,
    },
    {
        "instruction": "weighted two",
        "input": "",
        "output_1": "first",
        "output_2": "second wins",
        "preference": 1.9,
    },
    {"instruction": "exact tie", "input": "", "output_1": "a", "output_2": "b", "preference": 1.5},
    {"instruction": "garbage", "input": "", "output_1": "a", "output_2": "b", "preference": "n/a"},
    *UNRANKED,
]
NEW_INSTRUCTIONS = [
    {"instruction": f"Tell me something about {topic} (#{900 + i}).", "input": ""}
    for i, topic in enumerate(["rivers", "chess", "music", "oceans"])
]


def write_recipe(tmp_path: Path, model: str, records: list[dict[str, Any]], stages: str) -> Path:
    prefs = write_records(tmp_path / "prefs.jsonl", records)
    instructions = write_records(tmp_path / "instructions.jsonl", NEW_INSTRUCTIONS)
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "name: lpf-test\n"
        f"model: {{name: {model}}}\n"
        f"data:\n  preferences: {{path: {prefs}}}\n  instruction_splits: {{path: {instructions}}}\n"
        f"stages:\n{stages}",
        encoding="utf-8",
    )
    return path


def logged_losses(stage_dir: Path) -> list[float]:
    history = json.loads((stage_dir / "metrics.json").read_text())["log_history"]
    return [e["loss"] for e in history if "loss" in e]


def weights_changed(before_dir: str, after_dir: str) -> bool:
    import torch
    from safetensors.torch import load_file

    before, after = load_file(f"{before_dir}/model.safetensors"), load_file(f"{after_dir}/model.safetensors")
    assert before.keys() == after.keys()
    return any(not torch.equal(before[k], after[k]) for k in before)


# ------------------------------------------------------------------------------------------------ binary FeedME


def test_feedme_trains_on_exactly_the_preferred_outputs(tiny_model_dir: str, tmp_path: Path):
    from alpacafarm.prompts import format_prompt
    from alpacafarm_methods.supervised.feedme import FeedMEConfig, build_feedme_trainer

    records = [*preference_records(6), *EDGE_CASES]
    config = FeedMEConfig(output_dir=str(tmp_path), max_steps=1, save_strategy="no", report_to=[])
    trainer, dropped = build_feedme_trainer(config, ModelSpec(name=tiny_model_dir), tiny_model_dir, records)
    eos = trainer.processing_class.eos_token
    expected = [
        (format_prompt(r["instruction"], r["input"] or None), r[f"output_{r['preference']}"] + eos)
        for r in records[:6]
    ]
    expected += [
        (format_prompt("weighted one", "ctx"), "first wins" + eos),
        (format_prompt("weighted two"), "second wins" + eos),
    ]
    assert dropped == 4  # the exact tie, the unparsable label, the tie (0) and the unparsed annotation (None)
    assert (
        list(zip(trainer.train_dataset["prompt"], trainer.train_dataset["completion"], strict=True))
        == expected
    )
    assert all(c.startswith("Here is") for c in trainer.train_dataset["completion"][:6])  # never the refusal


def test_feedme_stage_learns_the_preferred_outputs(tiny_model_dir: str, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    from alpacafarm.model_loading import load_tokenizer

    records = [*preference_records(48), *UNRANKED]
    recipe = write_recipe(
        tmp_path,
        tiny_model_dir,
        records,
        (
            "  - name: feedme\n    method: binary_feedme\n"
            "    config: {max_steps: 16, per_device_train_batch_size: 8, learning_rate: 1.0e-2, logging_steps: 1,"
            " warmup_steps: 0, lr_scheduler_type: constant, save_strategy: 'no'}\n"
        ),
    )
    artifact = run_recipe(recipe, tmp_path / "run")["feedme"]
    assert (artifact.metadata["n_examples"], artifact.metadata["n_dropped_no_preference"]) == (48, 2)
    losses = logged_losses(tmp_path / "run/stages/feedme")
    assert len(losses) == 16 and sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3
    assert weights_changed(tiny_model_dir, artifact.path)

    rows = training_rows(tiny_model_dir, records)
    tokenizer = load_tokenizer(ModelSpec(name=tiny_model_dir), tiny_model_dir)
    sft, tuned = (
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        AutoModelForCausalLM.from_pretrained(artifact.path),
    )
    chosen_gain = [
        t - s
        for t, s in zip(
            completion_logps(tuned, tokenizer, rows, "chosen"),
            completion_logps(sft, tokenizer, rows, "chosen"),
            strict=True,
        )
    ]
    assert min(chosen_gain) > 20  # every preferred output became far more likely (nats)
    margin_gain = [
        t - s for t, s in zip(margins(tuned, tokenizer, rows), margins(sft, tokenizer, rows), strict=True)
    ]
    assert sum(g > 0 for g in margin_gain) == len(rows)  # ... and more likely than the rejected one


# ------------------------------------------------------------------------------------------------ reward conditioning


def test_conditioning_rows_carry_the_right_token_per_side(tiny_model_dir: str, tmp_path: Path):
    from alpacafarm.prompts import format_prompt
    from alpacafarm_methods.supervised.conditioning import RewardConditioningConfig, build_conditioning_trainer

    records = [*preference_records(4), *EDGE_CASES]
    config = RewardConditioningConfig(output_dir=str(tmp_path), max_steps=1, save_strategy="no", report_to=[])
    trainer, dropped = build_conditioning_trainer(
        config, ModelSpec(name=tiny_model_dir), tiny_model_dir, records
    )
    tokenizer, eos = trainer.processing_class, trainer.processing_class.eos_token
    assert dropped == 4 and len(trainer.train_dataset) == 2 * 6  # two examples per ranked pair
    expected = []
    for record in [*records[:4], *EDGE_CASES[:2]]:
        winner = 1 if float(record["preference"]) < 1.5 else 2
        prompt = format_prompt(record["instruction"], record["input"] or None)
        expected += [
            ("<good>\n" + prompt, record[f"output_{winner}"] + eos),
            ("<bad>\n" + prompt, record[f"output_{3 - winner}"] + eos),
        ]
    assert (
        list(zip(trainer.train_dataset["prompt"], trainer.train_dataset["completion"], strict=True))
        == expected
    )
    # Token level: each example starts with exactly the marker's tokens, and the loss never covers them.
    good, bad = tokenizer("<good>\n")["input_ids"], tokenizer("<bad>\n")["input_ids"]
    assert good != bad
    for i, example in enumerate(trainer.train_dataset):
        marker = good if i % 2 == 0 else bad
        assert example["input_ids"][: len(marker)] == marker
        assert example["labels"][: len(marker)] == [-100] * len(marker)

    with pytest.raises(ValueError, match="must differ"):
        RewardConditioningConfig(good_token="<x>", bad_token="<x>")


@pytest.fixture(scope="module")
def conditioning_run(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A conditioning stage, then a generate_outputs stage wired to its model as the recipes do."""
    tmp_path = tmp_path_factory.mktemp("conditioning")
    records = [*preference_records(40), *UNRANKED]
    recipe = write_recipe(
        tmp_path,
        tiny_model_dir,
        records,
        (
            "  - name: rc\n    method: binary_reward_conditioning\n"
            "    config: {max_steps: 40, per_device_train_batch_size: 16, learning_rate: 3.0e-3, logging_steps: 1,"
            " warmup_steps: 0, lr_scheduler_type: constant, save_strategy: 'no'}\n"
            "  - name: outputs\n    method: generate_outputs\n    inputs: {sft_model: rc}\n"
            "    config: {sampling: {temperature: 0, max_new_tokens: 12}}\n"
        ),
    )
    artifacts = run_recipe(recipe, tmp_path / "run")
    return {"artifacts": artifacts, "records": records, "dir": tmp_path / "run"}


def test_conditioning_stage_trains_and_saves_its_generation_conditioning(
    conditioning_run, tiny_model_dir: str
):
    artifact = conditioning_run["artifacts"]["rc"]
    assert (artifact.metadata["n_examples"], artifact.metadata["n_dropped_no_preference"]) == (80, 2)
    losses = logged_losses(conditioning_run["dir"] / "stages/rc")
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < 0.25 * sum(losses[:5]) / 5
    assert weights_changed(tiny_model_dir, artifact.path)
    saved = json.loads((Path(artifact.path) / CONDITIONING_FILE).read_text())
    assert saved == {"prompt_prefix": "<good>\n", "response_prefix": ""}


def test_conditioning_model_learns_the_control_tokens(conditioning_run, tiny_model_dir: str):
    """On every training pair, the good token makes the chosen output likelier and the bad token the rejected one."""
    from transformers import AutoModelForCausalLM

    from alpacafarm.model_loading import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(conditioning_run["artifacts"]["rc"].path)
    tokenizer = load_tokenizer(ModelSpec(name=tiny_model_dir), tiny_model_dir)
    rows = training_rows(tiny_model_dir, conditioning_run["records"])
    good = [{**r, "prompt": "<good>\n" + r["prompt"]} for r in rows]
    bad = [{**r, "prompt": "<bad>\n" + r["prompt"]} for r in rows]
    for side, favoured, other in (("chosen", good, bad), ("rejected", bad, good)):
        gains = [
            f - o
            for f, o in zip(
                completion_logps(model, tokenizer, favoured, side),
                completion_logps(model, tokenizer, other, side),
                strict=True,
            )
        ]
        assert min(gains) > 1.0, side  # nats; measured: chosen >= 2.7 (mean 3.3), rejected >= 2.1 (mean 2.3)


def test_generation_from_the_saved_model_is_conditioned_on_the_good_token(
    conditioning_run, tiny_model_dir: str
):
    outputs = [
        json.loads(line)["output"]
        for line in (conditioning_run["dir"] / "stages/outputs/outputs.jsonl").read_text().splitlines()
    ]
    assert len(outputs) == len(NEW_INSTRUCTIONS)
    assert all(o.startswith("Here is a clear") for o in outputs), (
        outputs
    )  # the preferred style, on new prompts
    assert not any("<good>" in o or "<bad>" in o for o in outputs)  # the marker is prompt, never output

    # The same model without its conditioning file's prefix, but with the bad token: the other style.
    spec, path = ModelSpec(name=tiny_model_dir), conditioning_run["artifacts"]["rc"].path
    generator = TransformersGenerator.from_spec(spec, path)
    assert generator.prompt_format.conditioning == PromptConditioning(prompt_prefix="<good>\n")
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    rows = generate_records(generator, NEW_INSTRUCTIONS, greedy)
    assert [r["output"] for r in rows] == outputs
    generator.prompt_format = PromptFormat(spec.prompt_format, generator.tokenizer, PromptConditioning("<bad>\n"))
    bad = [r["output"] for r in generate_records(generator, NEW_INSTRUCTIONS, greedy)]
    assert all(o.startswith("No. I refuse") for o in bad), bad


# ------------------------------------------------------------------------------------------------ generation hook


def test_prompt_conditioning_is_applied_to_every_prompt_and_never_returned(tmp_path: Path):
    tokenizer = tiny_tokenizer()
    model = tiny_causal_lm(tokenizer)
    prompts = ["Give three tips for staying healthy.", "Hi"]
    greedy = SamplingConfig(temperature=0, max_new_tokens=6)
    conditioning = PromptConditioning(prompt_prefix="<good>\n", response_prefix="Sure:")
    records = [{"instruction": p} for p in prompts]
    conditioned_format = PromptFormat("alpaca", tokenizer, conditioning)
    conditioned = generate_records(TransformersGenerator(model, tokenizer, conditioned_format), records, greedy)
    by_hand = TransformersGenerator(model, tokenizer).generate(
        [f"<good>\n{PromptFormat()(p)}Sure:" for p in prompts], greedy)
    assert [r["output"] for r in conditioned] == [samples[0] for samples in by_hand]
    plain = generate_records(TransformersGenerator(model, tokenizer), records, greedy)
    assert [r["output"] for r in conditioned] != [r["output"] for r in plain]

    assert PromptConditioning.load(tmp_path) == PromptConditioning()  # a folder without the file
    conditioning.save(tmp_path)
    assert PromptConditioning.load(tmp_path) == conditioning
    (tmp_path / CONDITIONING_FILE).write_text('{"prompt_prefx": "<good>"}')
    with pytest.raises(UserError, match=CONDITIONING_FILE):
        PromptConditioning.load(tmp_path)


# ------------------------------------------------------------------------------------------------ recipes


@pytest.mark.parametrize(
    ("name", "stage", "method"),
    [
        ("binary_feedme", "feedme", "binary_feedme"),
        ("binary_reward_conditioning", "reward_conditioning", "binary_reward_conditioning"),
    ],
)
def test_paper_recipes_check(name: str, stage: str, method: str):
    from alpacafarm.pipeline import plan
    from alpacafarm.plugins import get_registry

    registry = get_registry()
    loaded = load_recipe(REPO_ROOT / "recipes" / f"{name}.yaml", (), registry)
    stages = {s.name: s for s in plan(loaded, registry)}
    assert list(stages) == ["sft", stage, "outputs", "evaluate"]
    assert stages[stage].method == method and stages[stage].inputs == {
        "sft_model": "sft",
        "preferences": "preferences",
    }
    assert stages["outputs"].inputs["sft_model"] == stage
    config = loaded.stage_configs[stage]
    assert (config.learning_rate, config.num_train_epochs, config.max_length) == (2e-5, 3, 512)
