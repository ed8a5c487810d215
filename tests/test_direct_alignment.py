"""The direct-alignment methods ``ipo``, ``simpo``, ``orpo`` and ``kto``: real TRL trainers on a tiny model.

For each method one recipe run of 6 steps (checkpoints every 3) is the uninterrupted run; then the stage is
"killed" after checkpoint-3 (its last checkpoint and model deleted, its manifest left ``running``) and run again.
The policy's own log-probabilities, computed here, must move the way the method's loss says, and the resumed run
must end with the uninterrupted run's weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from alpacafarm.errors import RecipeError, UserError
from alpacafarm.recipe import ModelSpec, load_recipe
from alpacafarm.testing import learnable_preferences, run_recipe, write_records

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO_ROOT = Path(__file__).resolve().parents[1]
METHODS = ("ipo", "simpo", "orpo", "kto")

UNRANKED = [
    {"instruction": "tie", "input": "", "output_1": "a", "output_2": "b", "preference": 0},
    {"instruction": "unparsed", "input": "", "output_1": "a", "output_2": "b", "preference": None},
]
#: Ties with pointwise labels: no pair for the pairwise methods, two labelled outputs each for KTO.
POINTWISE = [
    {"instruction": "Name a colour.", "input": "", "output_1": "Blue.", "output_2": "No.", "preference": 0,
     "acceptable_1": True, "acceptable_2": False},
    {"instruction": "Name a fruit.", "input": "", "output_1": "I refuse.", "output_2": "Pear.", "preference": None,
     "acceptable_1": False, "acceptable_2": True},
]
RECORDS = [*learnable_preferences(32), *UNRANKED, *POINTWISE]

#: The resumed run repeats the uninterrupted run's float32 operations in the same order: in practice bit-equal.
RESUME_RTOL, RESUME_ATOL = 1e-5, 1e-7


def recipe_file(tmp_path: Path, model: str, method: str, config: str = "") -> Path:
    prefs = write_records(tmp_path / "prefs.jsonl", RECORDS)
    path = tmp_path / f"{method}.yaml"
    path.write_text(
        f"name: {method}-test\nmodel: {{name: {model}}}\ndata:\n  preferences: {{path: {prefs}}}\n"
        f"stages:\n  - name: {method}\n    method: {method}\n"
        "    config: {per_device_train_batch_size: 8, learning_rate: 1.0e-3, logging_steps: 1, warmup_steps: 0,"
        f" max_steps: 6, save_strategy: steps, save_steps: 3, eval_fraction: 0.125{config}}}\n",
        encoding="utf-8",
    )
    return path


def weights(model_dir: str | Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


@pytest.fixture(scope="module", params=METHODS)
def run(request: pytest.FixtureRequest, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run of one method, then the same stage killed after checkpoint-3 and run again."""
    method = request.param
    tmp_path = tmp_path_factory.mktemp(method)
    recipe = recipe_file(tmp_path, tiny_model_dir, method)
    run_dir = tmp_path / "run"
    artifact = run_recipe(recipe, run_dir)[method]
    stage = run_dir / "stages" / method
    metrics = json.loads((stage / "metrics.json").read_text())
    uninterrupted = weights(artifact.path)
    assert (stage / "checkpoint-3").is_dir() and (stage / "checkpoint-6").is_dir()

    shutil.rmtree(stage / "checkpoint-6")  # killed after checkpoint-3: the pipeline re-runs a "running" stage
    shutil.rmtree(stage / "model")
    manifest = json.loads((stage / "manifest.json").read_text())
    (stage / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))
    resumed = run_recipe(recipe, run_dir)[method]
    return {"method": method, "artifact": artifact, "metrics": metrics, "weights": uninterrupted,
            "resumed": resumed, "resumed_weights": weights(resumed.path), "run_dir": run_dir}


# ------------------------------------------------------------------------------------- the policy's log-probabilities


def completion_logprob(model: Any, tokenizer: Any, prompt: str, completion: str) -> tuple[float, int]:
    """Summed log-probability of ``completion + EOS`` after ``prompt``, and its number of tokens."""
    import torch

    prompt_ids = tokenizer(prompt)["input_ids"]
    ids = tokenizer(prompt + completion + tokenizer.eos_token)["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    logps = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return float(logps[len(prompt_ids) - 1:].sum()), len(ids) - len(prompt_ids)


def pair_margins(model: Any, tokenizer: Any, rows: list[dict[str, str]], *, average: bool) -> list[float]:
    """log p(chosen | x) - log p(rejected | x) per pair, summed over tokens or averaged per token (SimPO, ORPO and
    TRL's IPO compare per-token averages)."""
    margins = []
    for row in rows:
        (chosen, n_chosen), (rejected, n_rejected) = (
            completion_logprob(model, tokenizer, row["prompt"], row[side]) for side in ("chosen", "rejected"))
        margins.append(chosen / n_chosen - rejected / n_rejected if average else chosen - rejected)
    return margins


def model_and_tokenizer(path: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    from alpacafarm.model_loading import load_tokenizer

    return AutoModelForCausalLM.from_pretrained(path), load_tokenizer(ModelSpec(name=path), path)


def test_a_few_steps_widen_the_margin_the_loss_optimises(run: dict, tiny_model_dir: str):
    """Pairwise methods: the chosen-minus-rejected margin on the training pairs grows over the SFT model's; KTO:
    desirable outputs gain log-probability over the SFT model (the reference) and undesirable ones lose it."""
    from alpacafarm.preference_rows import preference_rows
    from alpacafarm_methods.preference.kto import binary_feedback

    sft, tokenizer = model_and_tokenizer(tiny_model_dir)
    policy, _ = model_and_tokenizer(run["artifact"].path)
    style = ModelSpec(name=tiny_model_dir).prompt_format
    if run["method"] == "kto":
        groups, _ = binary_feedback(RECORDS, style=style, tokenizer=tokenizer)
        rows = [row for group in groups for row in group]

        def log_ratio(row: dict[str, Any]) -> float:
            return (completion_logprob(policy, tokenizer, row["prompt"], row["completion"])[0]
                    - completion_logprob(sft, tokenizer, row["prompt"], row["completion"])[0])

        desirable = [log_ratio(row) for row in rows if row["label"]]
        undesirable = [log_ratio(row) for row in rows if not row["label"]]
        assert len(desirable) == len(undesirable) == 34
        assert sum(desirable) / 34 > 1.0 and sum(undesirable) / 34 < -1.0
        assert min(desirable[:32]) > max(undesirable[:32])  # the learnable pairs, separated completely
        return
    rows = preference_rows(RECORDS, style=style, tokenizer=tokenizer)[0]
    assert len(rows) == 32  # ties and unparsed annotations carry no pair, pointwise labels neither
    average = run["method"] in ("simpo", "orpo", "ipo")
    gains = [p - s for p, s in zip(pair_margins(policy, tokenizer, rows, average=average),
                                   pair_margins(sft, tokenizer, rows, average=average), strict=True)]
    assert sum(gains) / len(gains) > 0.3
    assert sum(g > 0 for g in gains) / len(gains) > 0.9


def test_the_stage_logs_the_trainers_statistics_and_counts_its_rows(run: dict):
    metadata, history = run["artifact"].metadata, run["metrics"]["log_history"]
    assert metadata["steps"] == 6 and len([e for e in history if "loss" in e]) == 6
    if run["method"] == "kto":
        # 34 labelled records: 32 pairs + 2 ties labelled pointwise; 4 held out, 30 x 2 rows trained on
        assert (metadata["n_pairs"], metadata["n_dropped_no_preference"]) == (34, 2)
        assert (metadata["n_train"], metadata["n_eval"]) == (60, 8)
        assert metadata["n_desirable"] == metadata["n_undesirable"] == 30
        assert metadata["reference"] == "copy" and "kl" in metadata and "eval_kl" in metadata
    else:
        assert (metadata["n_pairs"], metadata["n_dropped_no_preference"]) == (32, 4)
        assert (metadata["n_train"], metadata["n_eval"]) == (28, 4)
        assert metadata["reference"] == ("copy" if run["method"] == "ipo" else "none")
        assert "rewards/accuracies" in metadata and "eval_rewards/accuracies" in metadata
    assert metadata["rewards/margins"] == pytest.approx(next(e["rewards/margins"] for e in reversed(history)
                                                             if "rewards/margins" in e and "loss" in e), abs=1e-6)
    if run["method"] == "orpo":
        assert {"log_odds_ratio", "log_odds_chosen", "nll_loss"} <= set(metadata)
    if run["method"] == "simpo":
        assert (metadata["beta"], metadata["gamma"], metadata["cpo_alpha"]) == (2.0, 1.0, 0.0)


def test_a_stage_killed_after_a_checkpoint_resumes_to_the_uninterrupted_weights(run: dict, tiny_model_dir: str):
    import torch

    log = (run["run_dir"] / "run.log").read_text()
    assert f"stage {run['method']}: resuming from" in log and "checkpoint-3" in log
    resumed_history = json.loads((run["run_dir"] / "stages" / run["method"] / "metrics.json").read_text())
    steps = [e["step"] for e in resumed_history["log_history"] if "loss" in e]
    assert run["resumed"].metadata["steps"] == 6 and steps[-3:] == [4, 5, 6]
    before, after = run["weights"], run["resumed_weights"]
    assert before.keys() == after.keys()
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=RESUME_RTOL, atol=RESUME_ATOL)
    sft = weights(tiny_model_dir)
    assert any(not torch.equal(before[k], sft[k]) for k in before)  # it trained: equal weights are not trivially so


# ------------------------------------------------------------------------------------------- KTO's binary feedback


@pytest.mark.parametrize("method", ["simpo", "orpo", "kto"])
def test_a_prompt_that_fills_max_length_is_left_out_instead_of_turning_the_weights_to_nan(
        method: str, tiny_model_dir: str, tmp_path: Path):
    """TRL's CPO and ORPO trainers keep a row whose prompt alone fills max_length, with an empty answer, and its
    average log-probability is 0/0: every weight was NaN after the first step (SimPO diverged at any learning rate
    on real data, where 7 of 384 AlpacaEval prompts are longer than 192 tokens). The stage leaves such rows out,
    counts them, and trains on the rest."""
    import torch

    long = {"instruction": "Summarise this text: " + "the quick brown fox jumps over the lazy dog " * 12,
            "input": "", "output_1": "A fox jumps.", "output_2": "No.", "preference": 1}
    prefs = write_records(tmp_path / "prefs.jsonl", [*learnable_preferences(8), long])
    recipe = tmp_path / "long.yaml"
    recipe.write_text(
        f"name: long-prompt\nmodel: {{name: {tiny_model_dir}}}\ndata:\n  preferences: {{path: {prefs}}}\n"
        f"stages:\n  - name: {method}\n    method: {method}\n"
        "    config: {per_device_train_batch_size: 9, learning_rate: 1.0e-3, logging_steps: 1, warmup_steps: 0,"
        " max_steps: 2, max_length: 128, eval_fraction: 0, save_strategy: 'no'}\n", encoding="utf-8")
    artifact = run_recipe(recipe, tmp_path / "run")[method]
    assert artifact.metadata["n_dropped_prompt_fills_max_length"] == (2 if method == "kto" else 1)
    assert artifact.metadata["n_train_kept"] == (16 if method == "kto" else 8)
    assert all(torch.isfinite(w).all() for w in weights(artifact.path).values())
    assert "prompt alone fills max_length 128" in (tmp_path / "run" / "run.log").read_text()


def test_every_prompt_filling_max_length_is_a_one_line_error(tiny_model_dir: str, tmp_path: Path):
    recipe = recipe_file(tmp_path, tiny_model_dir, "simpo", ", max_length: 16")
    with pytest.raises(UserError, match=r"stage simpo: every prompt fills max_length 16 on its own: raise max_length"):
        run_recipe(recipe, tmp_path / "run")


def test_kto_turns_pairs_into_desirable_and_undesirable_outputs_and_reads_pointwise_labels():
    from alpacafarm.prompts import format_prompt
    from alpacafarm_methods.preference.kto import binary_feedback

    records = [
        {"instruction": "A", "input": "", "output_1": "a1", "output_2": "a2", "preference": 1},
        {"instruction": "B", "input": "x", "output_1": "b1", "output_2": "b2", "preference": 1.8},
        {"instruction": "tie", "output_1": "t1", "output_2": "t2", "preference": 0},
        # pointwise labels where present: both acceptable on a tie, both unacceptable despite a preference
        {"instruction": "C", "output_1": "c1", "output_2": "c2", "preference": 0,
         "acceptable_1": True, "acceptable_2": True},
        {"instruction": "D", "output_1": "d1", "output_2": "d2", "preference": 1,
         "acceptable_1": False, "acceptable_2": False},
        # one pointwise label, no ranking: only that output; null means no label
        {"instruction": "E", "output_1": "e1", "output_2": "e2", "preference": None,
         "acceptable_1": True, "acceptable_2": None},
        # one pointwise label, the other output's from the preference
        {"instruction": "F", "output_1": "f1", "output_2": "f2", "preference": 2, "acceptable_2": False},
    ]
    groups, dropped = binary_feedback(records, style="alpaca", tokenizer=None)
    assert dropped == 1
    labels = [[(row["completion"], row["label"]) for row in group] for group in groups]
    assert labels == [
        [("a1", True), ("a2", False)],
        [("b1", False), ("b2", True)],
        [("c1", True), ("c2", True)],
        [("d1", False), ("d2", False)],
        [("e1", True)],
        [("f1", False), ("f2", False)],
    ]
    assert groups[1][0]["prompt"] == format_prompt("B", "x", style="alpaca")
    assert all(set(row) == {"prompt", "completion", "label"} for group in groups for row in group)

    with pytest.raises(UserError, match="acceptable_2 is 'yes': it must be true, false or null"):
        binary_feedback([{**records[0], "acceptable_2": "yes"}], style="alpaca", tokenizer=None)
    with pytest.raises(UserError, match="lacks output_2"):
        binary_feedback([{"instruction": "x", "output_1": "y", "acceptable_1": True}], style="alpaca",
                        tokenizer=None)


def test_kto_with_no_labelled_output_is_a_one_line_error(tiny_model_dir: str, tmp_path: Path):
    prefs = write_records(tmp_path / "prefs.jsonl", UNRANKED)
    recipe = tmp_path / "kto.yaml"
    recipe.write_text(f"name: kto-empty\nmodel: {{name: {tiny_model_dir}}}\ndata:\n  preferences: {{path: {prefs}}}\n"
                      "stages:\n  - {name: kto, method: kto, config: {max_steps: 1}}\n")
    with pytest.raises(UserError, match=r"none of the 2 preference records has a usable preference .* acceptable_1"):
        run_recipe(recipe, tmp_path / "run")


# ------------------------------------------------------------------------------------------- LoRA: no reference copy


@pytest.mark.parametrize("method", METHODS)
def test_with_lora_no_second_model_is_kept(method: str, tiny_model_dir: str, tmp_path: Path):
    from peft import PeftModel

    from alpacafarm.model_loading import load_tokenizer
    from alpacafarm.plugins import get_registry

    registry = get_registry()
    target = registry.get("method", method)
    config = registry.config("method", method, {"max_steps": 1, "output_dir": str(tmp_path), "report_to": []})
    spec = ModelSpec(name=tiny_model_dir, lora={"r": 4, "alpha": 8})
    stage = target(config)
    groups, _ = stage.examples(learnable_preferences(4), spec, load_tokenizer(spec, tiny_model_dir))
    trainer = stage.build_trainer(config, spec, tiny_model_dir, [row for group in groups for row in group], [])
    assert isinstance(trainer.model, PeftModel)
    assert getattr(trainer, "ref_model", None) is None  # ipo/kto: the reference is the adapters-off policy
    assert stage.describe(config, spec, groups[0])["reference"] in ("adapters disabled", "none")


# ------------------------------------------------------------------------------------------- config and recipes


def test_defaults_are_the_values_of_each_methods_published_recipe():
    """IPO and KTO: TRL's and the HALOs library's; SimPO: its authors' llama-3-8b-base-simpo.yaml; ORPO:
    run_mistral_orpo_beta.sh (each config's docstring says why)."""
    from alpacafarm_methods.preference.ipo import IPOMethodConfig
    from alpacafarm_methods.preference.kto import KTOMethodConfig
    from alpacafarm_methods.preference.orpo import ORPOMethodConfig
    from alpacafarm_methods.preference.simpo import SimPOMethodConfig

    ipo, simpo, orpo, kto = IPOMethodConfig(), SimPOMethodConfig(), ORPOMethodConfig(), KTOMethodConfig()
    assert (ipo.loss_type, ipo.beta, ipo.learning_rate) == (["ipo"], 0.1, 1e-6)
    assert (simpo.loss_type, simpo.cpo_alpha, simpo.beta, simpo.gamma_beta_ratio, simpo.simpo_gamma) == (
        "simpo", 0.0, 2.0, 0.5, 1.0)
    assert SimPOMethodConfig(beta=2.5).simpo_gamma == 1.25  # gamma follows beta at the ratio
    assert (simpo.learning_rate, simpo.num_train_epochs) == (6e-7, 1.0)
    assert (orpo.beta, orpo.learning_rate) == (0.1, 5e-6)
    assert (kto.beta, kto.desirable_weight, kto.undesirable_weight, kto.learning_rate) == (0.1, 1.0, 1.0, 1e-6)
    assert all(c.max_length == 512 and c.bf16 is False for c in (ipo, simpo, orpo, kto))


BAD_VALUES = [
    ("ipo", "stages.ipo.config.loss_type=[sigmoid]", "loss_type must be \\['ipo'\\]"),
    ("simpo", "stages.simpo.config.loss_type=sigmoid", "loss_type must be 'simpo'"),
    ("simpo", "stages.simpo.config.simpo_gamma=1.0", "unknown key 'simpo_gamma'"),
    ("simpo", "stages.simpo.config.gamma_beta_ratio=-1", "gamma_beta_ratio must be >= 0"),
    ("orpo", "stages.orpo.config.beta=-0.1", "beta must be a finite number >= 0"),
    ("kto", "stages.kto.config.per_device_train_batch_size=1", "at least 2 for KTO"),
    ("kto", "stages.kto.config.train_sampling_strategy=random", "must be 'sequential' for KTO"),
    ("kto", "stages.kto.config.desirable_weight=0", "must be > 0"),
]


@pytest.mark.parametrize(("method", "override", "message"), BAD_VALUES, ids=[b[1] for b in BAD_VALUES])
def test_a_bad_value_is_a_recipe_error_naming_the_stage(method: str, override: str, message: str,
                                                          tiny_model_dir: str, tmp_path: Path):
    recipe = recipe_file(tmp_path, tiny_model_dir, method)
    # the culprit's place: the file and line of the stage's config block, or the --set that gave the key
    with pytest.raises(RecipeError, match=rf"(^--set|{method}\.yaml:\d+): stages\[0\]\.config.*{message}"):
        load_recipe(recipe, [override])


@pytest.mark.parametrize("method", METHODS)
def test_an_unknown_key_gets_did_you_mean(method: str, tiny_model_dir: str, tmp_path: Path):
    recipe = recipe_file(tmp_path, tiny_model_dir, method)
    with pytest.raises(RecipeError, match=r"stages\[0\]\.config\.betta: unknown key 'betta'.*did you mean 'beta'"):
        load_recipe(recipe, [f"stages.{method}.config.betta=0.3"])
    assert load_recipe(recipe, [f"stages.{method}.config.beta=0.3"]).stage_configs[method].beta == 0.3


@pytest.mark.parametrize("method", METHODS)
def test_the_shipped_recipe_loads_and_wires_sft_then_the_method(method: str):
    from alpacafarm.pipeline import plan
    from alpacafarm.plugins import get_registry

    registry = get_registry()
    assert registry.entry("method", method).description
    loaded = load_recipe(REPO_ROOT / "recipes" / f"{method}.yaml", (), registry)
    stages = {s.name: s for s in plan(loaded, registry)}
    assert list(stages) == ["sft", method, "outputs", "evaluate"]
    assert stages[method].inputs == {"sft_model": "sft", "preferences": "preferences"}
    assert stages["outputs"].inputs["sft_model"] == method
    config = loaded.stage_configs[method]
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps == 64  # as recipes/dpo.yaml
    assert config.num_train_epochs == 1
