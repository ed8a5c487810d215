"""The ``quark`` method (best-quantile Quark, fresh pool per round) on tiny random-init models."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from alpacafarm.errors import RecipeError
from alpacafarm.recipe import ModelSpec, load_recipe
from alpacafarm.testing import run_recipe, write_records

pytestmark = pytest.mark.usefixtures("one_torch_thread")

INSTRUCTIONS = [{"instruction": f"Say something about topic {i}.", "input": "" if i % 3 else "a short note"}
                for i in range(16)]
TOPICS = ["rivers", "baking", "chess", "planets"]


def e_share(records: list[dict[str, Any]], completions: list[str]) -> list[float]:
    """A simple learnable reward: the share of the letter 'e' among the completion's characters."""
    return [c.count("e") / max(len(c), 1) for c in completions]


def quark_args(tmp_path: Path, **overrides: Any) -> Any:
    """Build right before the trainer (building ``TrainingArguments`` sets accelerate's process state up afresh)."""
    from alpacafarm_methods.quark.config import QuarkMethodConfig

    values = {"output_dir": str(tmp_path), "rounds": 2, "prompts_per_round": 8,
              "rollouts_per_prompt": 4, "top_quantile": 0.25, "max_new_tokens": 10,
              "generation_batch_size": 8, "per_device_train_batch_size": 8, "step_batch_size": 16,
              "learning_rate": 5e-3,
              "report_to": "none", "disable_tqdm": True, **overrides}
    return QuarkMethodConfig(**values)


def tiny_trainer(tmp_path: Path, records: list[dict[str, Any]] = INSTRUCTIONS, reward: Any = e_share,
                 **overrides: Any) -> Any:
    """A trainer whose policy and frozen reference are two identical tiny models; pools and checkpoints go to
    ``tmp_path``."""
    from alpacafarm.testing import tiny_causal_lm, tiny_tokenizer
    from alpacafarm_methods.quark.trainer import build_quark_trainer

    tokenizer = tiny_tokenizer()
    return build_quark_trainer(quark_args(tmp_path, **overrides), tiny_causal_lm(tokenizer), tokenizer, records,
                               reward, ref_model=tiny_causal_lm(tokenizer))


def step_entries(trainer: Any) -> list[dict[str, Any]]:
    """The per-step log entries (the others are the rounds' statistics)."""
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def read_pool(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def preference_records(n: int = 24) -> list[dict[str, Any]]:
    records = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        good, bad = f"Here is a helpful answer about {topic}.", f"No. I refuse to talk about {topic}."
        first, second = (good, bad) if i % 2 else (bad, good)
        records.append({"instruction": f"Tell me about {topic} (#{i}).", "input": "", "output_1": first,
                        "output_2": second, "preference": 2 - i % 2})
    return records


def quark_recipe(tmp_path: Path, model: str, extra_model: str = "", quark_config: str = "") -> Path:
    prefs = write_records(tmp_path / "prefs.jsonl", preference_records())
    instructions = write_records(tmp_path / "instructions.jsonl", INSTRUCTIONS[:8])
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "name: quark-test\n"
        f"model: {{name: {model}{extra_model}}}\n"
        f"data:\n  preferences: {{path: {prefs}}}\n  unlabeled: {{path: {instructions}}}\n"
        "stages:\n"
        "  - {name: rm, method: reward_model, config: {max_steps: 2, per_device_train_batch_size: 8,"
        " save_strategy: 'no', eval_fraction: 0.25}}\n"
        "  - name: quark\n    method: quark\n    inputs: {instruction_splits: unlabeled}\n"
        "    config: {rounds: 2, prompts_per_round: 4, rollouts_per_prompt: 2, top_quantile: 0.5,"
        " max_new_tokens: 6, generation_batch_size: 4, per_device_train_batch_size: 4, step_batch_size: 8,"
        " learning_rate: 1.0e-3,"
        f" disable_tqdm: true{quark_config}}}\n"
        "  - name: outputs\n    method: generate_outputs\n"
        "    inputs: {sft_model: quark, instruction_splits: unlabeled}\n"
        "    config: {sampling: {max_new_tokens: 4, batch_size: 4}}\n",
        encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------ config


def test_config_defaults_follow_the_paper_and_the_released_run_and_bad_values_are_errors(tmp_path: Path):
    from alpacafarm_methods.quark.config import QuarkMethodConfig
    from alpacafarm_methods.quark.selection import kept_count

    config = QuarkMethodConfig(output_dir=str(tmp_path))
    paper = (0.05, 3e-6, 1.0)
    assert (config.kl_coef, config.learning_rate, config.max_grad_norm) == paper
    assert config.lr_scheduler_type.value == "linear"
    # Released, where the paper is silent: 5 warm-up steps (examples/scripts/rlhf_quark.sh), AdamW epsilon 1e-5
    # (quark_utils.TrainingArguments), the stop token never trained (rollouts re-tokenized without it).
    assert (config.warmup_steps, config.adam_epsilon, config.train_eos) == (5, 1e-5, False)
    assert (config.rounds, config.prompts_per_round) == (390, 512)
    # Released: the top of 4 reward bins (floor(512 / 4) = 128 kept), one optimizer step of 256 per round.
    assert (config.top_quantile, config.steps_per_round, config.step_batch_size) == (0.25, 1, 256)
    assert config.quantile_scope == "pool"  # the released cut: across the round's whole pool
    assert kept_count(config.prompts_per_round * config.rollouts_per_prompt, config.top_quantile) == 128
    assert config.split == "train" and config.max_instructions is None
    assert config.bf16 is False and config.gradient_checkpointing is False  # automatic values on a CPU
    # Each bad value is refused with the message naming its own field (a check that refuses for another reason,
    # or a missing check, fails here).
    for bad, message in (({"top_quantile": 0.0}, "top_quantile must be in"), ({"top_quantile": 1.5}, "top_quantile"),
                         ({"rounds": 0}, "rounds must be at least 1"), ({"kl_coef": -0.1}, "kl_coef must be"),
                         ({"temperature": 0.0}, "temperature must be positive"),
                         ({"steps_per_round": 0}, "steps_per_round must be at least 1"),
                         ({"step_batch_size": 0}, "step_batch_size must be at least 1"),
                         ({"step_batch_size": 12, "per_device_train_batch_size": 8}, "a multiple of"),
                         ({"num_train_epochs": 2}, "num_train_epochs does not apply"),
                         ({"max_steps": 5}, "max_steps does not apply"),
                         ({"rollouts_per_prompt": 0}, "rollouts_per_prompt must be at least 1"),
                         ({"max_instructions": 0}, "max_instructions must be at least 1"),
                         ({"ensemble": "median"}, "ensemble must be one of")):
        with pytest.raises(ValueError, match=message):
            QuarkMethodConfig(output_dir=str(tmp_path), **bad)


def test_config_fields_are_recipe_settable(tiny_model_dir: str, tmp_path: Path):
    recipe = quark_recipe(tmp_path, tiny_model_dir)
    config = load_recipe(recipe, ["stages.quark.config.kl_coef=0.1", "stages.quark.config.weight_decay=0.01",
                                  "stages.quark.config.split=eval"]).stage_configs["quark"]
    assert (config.kl_coef, config.weight_decay, config.split, config.rounds) == (0.1, 0.01, "eval", 2)
    with pytest.raises(RecipeError, match=r"top_quantil.*did you mean 'top_quantile'"):
        load_recipe(recipe, ["stages.quark.config.top_quantil=0.5"])
    with pytest.raises(RecipeError, match="top_quantile must be in"):
        load_recipe(recipe, ["stages.quark.config.top_quantile=2"])


# ------------------------------------------------------------------------------------------------ the loop


def test_kept_set_is_exactly_the_top_quantile_rounded_down():
    from alpacafarm_methods.quark.selection import kept_count, top_quantile

    assert [kept_count(n, 0.25) for n in (1, 3, 4, 8, 9, 30)] == [1, 1, 1, 2, 2, 7]  # released: n // 4
    assert kept_count(10, 0.3) == 3 and kept_count(512, 0.2) == 102 and kept_count(5, 1.0) == 5
    assert kept_count(512, 0.25) == 128 and kept_count(511, 0.25) == 127
    rewards = [0.1, 0.9, 0.5, 0.9, -2.0, 0.7, 0.5, 0.0]
    assert top_quantile(rewards, 0.25) == [1, 3]
    assert top_quantile(rewards, 0.5) == [1, 2, 3, 5]  # the tie at 0.5 goes to the earlier index


def test_pool_files_keep_the_top_quantile_of_the_scorer(tmp_path: Path):
    from alpacafarm_methods.quark.selection import kept_count

    def score(records, completions):  # distinct, known rewards: the length, tie-broken by the text's checksum
        return [len(c) + sum(map(ord, c)) % 97 / 100 for c in completions]

    trainer = tiny_trainer(tmp_path, reward=score, top_quantile=0.3)
    trainer.train()
    stats = trainer.round_stats
    assert [stat["round"] for stat in stats] == [1, 2]
    for stat in stats:
        pool = read_pool(tmp_path / f"round_{stat['round']}" / "pool.jsonl")
        assert len(pool) == 32 == stat["n_pool"]
        assert [row["reward"] for row in pool] == score(None, [row["output"] for row in pool])
        k = kept_count(len(pool), 0.3)
        best = sorted(range(len(pool)), key=lambda i: -pool[i]["reward"])[:k]
        assert {i for i, row in enumerate(pool) if row["kept"]} == set(best) and stat["n_kept"] == k == 9
        kept = [row["reward"] for row in pool if row["kept"]]
        assert stat["threshold"] == min(kept) > max(row["reward"] for row in pool if not row["kept"])
        assert stat["reward_kept_mean"] == pytest.approx(sum(kept) / k)
        assert stat["reward_mean"] == pytest.approx(sum(row["reward"] for row in pool) / len(pool))


def test_loss_is_logged_parameters_change_and_kl_grows_from_zero(tmp_path: Path):
    import torch

    from alpacafarm.prompts import format_prompt
    from alpacafarm.sampling import Sample
    from alpacafarm_methods.quark.trainer import training_example

    trainer = tiny_trainer(tmp_path / "a", rounds=3, steps_per_round=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    stats = trainer.round_stats
    # The last round's kept samples, re-tokenized: the trained policy has drifted from the reference on them.
    tokenizer = trainer.tokenizer
    kept_rows = [row for row in read_pool(tmp_path / "a/round_3/pool.jsonl") if row["kept"]]
    prompts = [tokenizer(format_prompt(row["instruction"], row["input"] or None))["input_ids"]
               for row in kept_rows]
    responses = [tokenizer(row["output"])["input_ids"] + [tokenizer.eos_token_id] for row in kept_rows]
    examples = [training_example(Sample(prompt, response, row["output"], True), train_eos=trainer.args.train_eos)
                for prompt, response, row in zip(prompts, responses, kept_rows, strict=True)]
    after = trainer.measure(examples)
    assert after["tokens"] > 0 and after["kl"] > 1e-3

    fresh = tiny_trainer(tmp_path / "fresh")  # policy == reference
    start = fresh.measure(examples)
    assert start["kl"] == pytest.approx(0.0, abs=1e-6) and start["nll"] > 0
    batch = fresh.data_collator(examples[:4])
    loss = fresh.compute_loss(fresh.model, batch)
    with torch.no_grad():
        nll, kl, mask, _ = fresh.token_terms(fresh.model, batch)
    assert float(kl[mask].abs().max()) < 1e-6
    assert float(loss) == pytest.approx(float(nll[mask].mean()), rel=1e-5)  # the KL term adds nothing yet

    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    references = zip(trainer.ref_model.parameters(), fresh.ref_model.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in references)
    steps = step_entries(trainer)
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5, 6] and [e["round"] for e in steps] == [1, 1, 2, 2, 3, 3]
    for stat in stats:
        mine = [e for e in steps if e["round"] == stat["round"]]
        assert len(mine) == stat["steps"] == 2  # steps_per_round: two steps of 16 draws from the 8 kept
        assert all(e["loss"] == pytest.approx(e["nll"] + 0.05 * e["kl"]) for e in mine)  # NLL + kl_coef x KL
        assert stat["train_loss"] == pytest.approx(sum(e["loss"] for e in mine) / 2) and stat["kl"] >= 0
        assert all(e["reward"] == stat["reward_mean"] for e in mine)
    assert stats[0]["kl"] < stats[-1]["kl"]


def test_each_round_takes_one_optimizer_step_on_the_step_batch_cycling_through_the_kept(tmp_path: Path):
    """Released: keep floor(pool / 4), then one optimizer step of step_batch_size draws, in micro-batches; all of
    it inside one train() call."""
    import torch
    from transformers import TrainerCallback

    trainer = tiny_trainer(tmp_path, rounds=2, prompts_per_round=6, rollouts_per_prompt=5,  # pool of 30
                           warmup_steps=0)
    assert trainer.accelerator.gradient_accumulation_steps == 2 and trainer.state.max_steps == 2  # 16 = 2 x 8

    class Events(TrainerCallback):
        seen: list[tuple[str, int]] = []

        def on_train_begin(self, args, state, control, **kwargs):
            Events.seen.append(("begin", state.global_step))

        def on_step_end(self, args, state, control, **kwargs):
            Events.seen.append(("step", state.global_step))

        def on_train_end(self, args, state, control, **kwargs):
            Events.seen.append(("end", state.global_step))

    trainer.add_callback(Events)
    rows, datasets, updates = [], [], []
    loss_terms, optimizer_step, real_step = trainer.loss_terms, trainer.optimizer_step, trainer.optimizer.step

    def spy_loss(model, inputs, *args, **kwargs):
        rows.append(int(inputs["input_ids"].shape[0]))
        return loss_terms(model, inputs, *args, **kwargs)

    def spy_step(examples):
        datasets.append(list(examples))
        return optimizer_step(examples)

    def spy_update(*args, **kwargs):  # the optimizer's own step: called per micro-batch, updates once per step
        before = [p.detach().clone() for p in trainer.model.parameters()]
        real_step(*args, **kwargs)
        updates.append(any(not torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True)))

    trainer.loss_terms, trainer.optimizer_step, trainer.optimizer.step = spy_loss, spy_step, spy_update
    trainer.train()
    stats = trainer.round_stats
    assert Events.seen == [("begin", 0), ("step", 1), ("step", 2), ("end", 2)]  # one training loop
    assert [s["n_pool"] for s in stats] == [30, 30] and [s["n_kept"] for s in stats] == [7, 7]  # floor(7.5)
    assert [s["steps"] for s in stats] == [1, 1] and updates == [False, True, False, True]  # one step per round
    assert [s["n_trained"] for s in stats] == [16, 16] and rows == [8, 8, 8, 8]  # 2 micro-batches per step
    for r, dataset in enumerate(datasets, start=1):
        kept = [row for row in read_pool(tmp_path / f"round_{r}/pool.jsonl") if row["kept"]]
        tokenizer = trainer.tokenizer
        drawn = [tokenizer.decode([t for t, label in zip(ex["input_ids"], ex["labels"], strict=True)
                                   if label != -100], skip_special_tokens=True).strip() for ex in dataset]
        # Cycling through a shuffled order: two full passes over the 7 kept, then 2 of a third pass.
        assert sorted(drawn[:7]) == sorted(drawn[7:14]) == sorted(row["output"] for row in kept)
        assert set(drawn[14:]) <= {row["output"] for row in kept} and len(drawn) == 16


def test_draw_order_is_seeded_passes_of_fresh_permutations():
    from alpacafarm_methods.quark.selection import draw_order

    order = draw_order(128, 256, seed=3)
    assert sorted(order[:128]) == sorted(order[128:]) == list(range(128))  # the released 256 from 128
    assert order[:128] != order[128:] and order == draw_order(128, 256, seed=3) != draw_order(128, 256, 4)
    assert draw_order(5, 3, seed=0) == draw_order(5, 10, seed=0)[:3]


def test_a_step_is_the_token_mean_of_the_step_batch_however_it_is_split_into_micro_batches(tmp_path: Path):
    """One optimizer step on four responses of different lengths, as one micro-batch of 4 or four accumulated
    micro-batches of 1: the same loss, gradient norm and updated weights, and the loss is ``(sum of NLL + kl_coef x
    sum of KL) / targets of the whole step batch``, the gradient norm that of this loss computed by hand. An empty
    prompt's first response token has no position before it, so it is not a target (12 targets, not 13).
    Averaging each micro-batch's own mean (a one-token response weighted like a six-token one), dropping the
    accumulation's rescaling or counting unshifted labels fails it."""
    import torch

    from alpacafarm.testing import tiny_causal_lm, tiny_tokenizer
    from alpacafarm_methods.quark.trainer import build_quark_trainer

    examples = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]},  # empty prompt: 2 targets
                {"input_ids": [5, 6, 7, 8, 9, 10, 11], "labels": [-100, 6, 7, 8, 9, 10, 11]},  # 6
                {"input_ids": [12, 13, 14, 15], "labels": [-100, -100, -100, 15]},  # 1
                {"input_ids": [16, 17, 18, 19, 20], "labels": [-100, -100, 18, 19, 20]}]  # 3
    steps, weights = {}, {}
    for micro in (4, 1):
        tokenizer = tiny_tokenizer()
        args = quark_args(tmp_path / str(micro), per_device_train_batch_size=micro, step_batch_size=4,
                          warmup_steps=0, kl_coef=0.5)
        trainer = build_quark_trainer(args, tiny_causal_lm(tokenizer), tokenizer, INSTRUCTIONS, e_share,
                                      ref_model=tiny_causal_lm(tokenizer, seed=1))  # KL > 0 from the start
        assert trainer.accelerator.gradient_accumulation_steps == 4 // micro
        whole = trainer.data_collator(examples)
        with torch.no_grad():
            nll, kl, mask, _ = trainer.token_terms(trainer.model, whole)
        assert int(mask.sum()) == 12 and float(kl[mask].mean()) > 1e-3
        expected = float((nll[mask].sum() + 0.5 * kl[mask].sum()) / 12)
        trainer.compute_loss(trainer.model, whole).backward()
        norm = float(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]).norm())
        trainer.model.zero_grad()
        steps[micro] = trainer.optimizer_step(examples)
        weights[micro] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        assert steps[micro]["tokens"] == 12 and steps[micro]["loss"] == pytest.approx(expected, rel=1e-5)
        assert steps[micro]["grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert steps[1]["loss"] == pytest.approx(steps[4]["loss"], rel=1e-6)
    for name, tensor in weights[4].items():
        torch.testing.assert_close(weights[1][name], tensor, rtol=0, atol=1e-5, msg=name)  # steps of 5e-3


def test_gradient_accumulation_is_derived_from_the_step_batch(tmp_path: Path):
    from alpacafarm.errors import UserError

    sizes = {"step_batch_size": 32, "per_device_train_batch_size": 4}
    assert tiny_trainer(tmp_path, **sizes).accelerator.gradient_accumulation_steps == 8
    assert tiny_trainer(tmp_path, **sizes, gradient_accumulation_steps=8).accelerator.gradient_accumulation_steps == 8
    with pytest.raises(UserError, match="gradient_accumulation_steps is derived"):
        tiny_trainer(tmp_path, **sizes, gradient_accumulation_steps=2)


def test_learning_rate_decays_to_zero_over_all_rounds(tmp_path: Path):
    trainer = tiny_trainer(tmp_path, INSTRUCTIONS[:8], rounds=4, lr_scheduler_type="linear", warmup_steps=0)
    trainer.train()
    rates = [e["learning_rate"] for e in step_entries(trainer)]  # the rate each step used
    # One optimizer step per round, so one scheduler step per round: 5e-3 x (1, 3/4, 1/2, 1/4), then 0.
    assert rates == pytest.approx([5e-3, 3.75e-3, 2.5e-3, 1.25e-3])
    assert all(a > b for a, b in itertools.pairwise(rates))  # one schedule, not restarted each round
    assert [s["learning_rate"] for s in trainer.round_stats] == rates
    assert trainer.lr_scheduler.get_last_lr()[0] == 0.0


def test_learning_rate_warms_up_over_the_first_five_rounds_by_default(tmp_path: Path):
    trainer = tiny_trainer(tmp_path, INSTRUCTIONS[:8], rounds=7, prompts_per_round=2, rollouts_per_prompt=4,
                           max_new_tokens=4, step_batch_size=8)
    trainer.train()
    rates = [e["learning_rate"] for e in step_entries(trainer)]
    # The released script's --warmup_steps 5 (one scheduler step per round): 0, 1/5, ..., 4/5, 1, then 1/2.
    assert rates == pytest.approx([5e-3 * f for f in (0, 0.2, 0.4, 0.6, 0.8, 1.0, 0.5)])


def test_the_pool_is_rebuilt_every_round(tmp_path: Path):
    datasets, scored = [], []

    def score(records, completions):
        scored.append(list(completions))
        return e_share(records, completions)

    trainer = tiny_trainer(tmp_path, reward=score, rounds=3, prompts_per_round=4)
    optimizer_step = trainer.optimizer_step

    def spy_step(examples):
        datasets.append(list(examples))
        return optimizer_step(examples)

    trainer.optimizer_step = spy_step
    trainer.train()
    tokenizer = trainer.tokenizer
    pools = [read_pool(tmp_path / f"round_{r}/pool.jsonl") for r in (1, 2, 3)]
    for pool, dataset, texts in zip(pools, datasets, scored, strict=True):
        assert len(pool) == len(texts) == 16  # 4 prompts x 4 rollouts, never more: nothing accumulates
        assert [row["output"] for row in pool] == texts
        kept = [row for row in pool if row["kept"]]
        assert len(kept) == 4 and len(dataset) == 16  # 16 draws: four passes over the 4 kept
        targets = [[t for t, label in zip(ex["input_ids"], ex["labels"], strict=True) if label != -100]
                   for ex in dataset]
        trained = [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in targets]
        assert sorted(trained) == sorted(row["output"] for row in kept for _ in range(4))
    # Fresh rollouts on new prompts each round (4 of the 16 instructions at a time, cycling a seeded order).
    assert len({row["instruction"] for pool in pools for row in pool}) == 12
    assert not {row["output"] for row in pools[0]} & {row["output"] for row in pools[1]}


def test_mean_pool_reward_rises_across_rounds(tmp_path: Path):
    trainer = tiny_trainer(tmp_path, rounds=8, prompts_per_round=16, top_quantile=0.25, max_new_tokens=12,
                           steps_per_round=4, step_batch_size=8, lr_scheduler_type="constant")
    trainer.train()
    stats = trainer.round_stats
    rewards = [s["reward_mean"] for s in stats]
    print("pool reward per round:", [round(r, 4) for r in rewards])
    assert rewards[-1] > 1.4 * rewards[0]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.03
    assert all(s["reward_kept_mean"] > s["reward_mean"] for s in stats)


# ------------------------------------------------------------------------------------------------ models


def test_lora_policy_has_no_reference_copy(tiny_model_dir: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch):
    import torch

    import alpacafarm.model_loading as modeling
    from alpacafarm.model_loading import load_tokenizer
    from alpacafarm_methods.quark.method import load_policy_and_reference
    from alpacafarm_methods.quark.trainer import build_quark_trainer

    loads = []
    real = modeling.load_causal_lm
    monkeypatch.setattr(modeling, "load_causal_lm", lambda *a, **k: loads.append(a) or real(*a, **k))
    args = quark_args(tmp_path, learning_rate=5e-2)
    full = ModelSpec(name=tiny_model_dir)
    policy, reference, from_adapters = load_policy_and_reference(full, tiny_model_dir, args)
    assert reference is not None and len(loads) == 2 and not from_adapters  # full fine-tuning: a frozen copy

    loads.clear()
    spec = ModelSpec.model_validate({"name": tiny_model_dir, "lora": {"r": 4, "alpha": 8}})
    policy, reference, _ = load_policy_and_reference(spec, tiny_model_dir, args)
    assert reference is None and len(loads) == 1 and hasattr(policy, "disable_adapter")
    trainer = build_quark_trainer(quark_args(tmp_path, learning_rate=5e-2), policy,
                                  load_tokenizer(spec, tiny_model_dir), INSTRUCTIONS[:8], e_share)
    assert trainer.ref_model is None
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" not in n}
    examples = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]}]
    assert trainer.measure(examples)["kl"] == pytest.approx(0.0, abs=1e-7)  # lora_B starts at zero
    trainer.train()
    assert trainer.measure(examples)["kl"] > 0  # the reference is the same network with the adapters off
    assert all(torch.equal(p, base[n]) for n, p in policy.named_parameters() if "lora_" not in n)


def test_policy_trains_float32_master_weights_against_a_reference_in_the_model_dtype(tiny_model_dir: str,
                                                                                       tmp_path: Path):
    import torch

    from alpacafarm.model_loading import load_tokenizer
    from alpacafarm_methods.quark.method import load_policy_and_reference
    from alpacafarm_methods.quark.trainer import build_quark_trainer

    args = quark_args(tmp_path, rounds=1, prompts_per_round=4)
    spec = ModelSpec(name=tiny_model_dir, dtype="bfloat16")
    policy, reference, _ = load_policy_and_reference(spec, tiny_model_dir, args)
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
    trainer = build_quark_trainer(args, policy, load_tokenizer(spec, tiny_model_dir), INSTRUCTIONS[:4], e_share,
                                  ref_model=reference)
    trainer.train()  # mixed dtypes train (on a CPU)
    stats = trainer.round_stats
    assert stats[0]["steps"] == 1 and stats[0]["kl"] >= 0
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}

    lora = ModelSpec.model_validate({"name": tiny_model_dir, "dtype": "bfloat16", "lora": {"r": 4, "alpha": 8}})
    policy, reference, _ = load_policy_and_reference(lora, tiny_model_dir, args)
    assert reference is None
    trainable = {p.dtype for p in policy.parameters() if p.requires_grad}
    frozen = {p.dtype for p in policy.parameters() if not p.requires_grad}
    assert trainable == {torch.float32} and frozen == {torch.bfloat16}


def test_sft_adapters_are_merged_into_the_policy_base(tiny_model_dir: str, tmp_path: Path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from alpacafarm_methods.quark.method import load_policy_and_reference

    sft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                         LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                    init_lora_weights=False))
    sft.save_pretrained(tmp_path / "sft")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = sft(input_ids=ids).logits
    spec = ModelSpec.model_validate({"name": tiny_model_dir, "lora": {"r": 4, "alpha": 8}})
    policy, reference, from_adapters = load_policy_and_reference(spec, str(tmp_path / "sft"),
                                                                 quark_args(tmp_path))
    assert from_adapters and reference is None
    with torch.no_grad(), policy.disable_adapter():
        assert torch.allclose(policy(input_ids=ids).logits, expected, atol=1e-5)  # reference = the SFT model


# ----------------------------------------------------------------------------------------------- the pipeline


def test_recipe_writes_model_metrics_and_pools_and_outputs_generate_from_it(tiny_model_dir: str,
                                                                            tmp_path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    artifacts = run_recipe(quark_recipe(tmp_path, tiny_model_dir, extra_model=", dtype: bfloat16"), tmp_path / "run")
    stage = tmp_path / "run/stages/quark"
    artifact = artifacts["quark"]
    assert artifact.kind == "model" and Path(artifact.path) == stage / "model"
    assert (stage / "model/model.safetensors").is_file() and (stage / "model/tokenizer.json").is_file()
    saved = AutoModelForCausalLM.from_pretrained(stage / "model", dtype="auto")
    assert {p.dtype for p in saved.parameters()} == {torch.bfloat16}  # trained in float32, saved in the dtype
    metrics = json.loads((stage / "metrics.json").read_text())
    assert metrics["rounds"] == 2 and metrics["reference"] == "frozen_copy" and metrics["kept_per_round"] == 4
    assert metrics["trained_per_round"] == 8 and metrics["steps"] == 2
    assert [r["round"] for r in metrics["per_round"]] == [1, 2]
    for key in ("reward_mean", "reward_kept_mean", "threshold", "train_loss", "kl"):
        assert all(isinstance(r[key], float) for r in metrics["per_round"]), key
    assert any("loss" in e and e["round"] == 2 for e in metrics["log_history"])
    for r in (1, 2):
        pool = read_pool(stage / f"round_{r}/pool.jsonl")
        assert len(pool) == 8 and sum(row["kept"] for row in pool) == 4
    outputs = [json.loads(line) for line in Path(artifacts["outputs"].path).read_text().splitlines()]
    assert len(outputs) == 8 and all("output" in row for row in outputs)
    manifest = json.loads((tmp_path / "run/stages/outputs/manifest.json").read_text())
    assert manifest["inputs"]["sft_model"]["from"] == "quark"


def test_recipe_with_lora_saves_adapters_that_generate_outputs_loads(tiny_model_dir: str, tmp_path: Path):
    recipe = quark_recipe(tmp_path, tiny_model_dir, extra_model=", lora: {r: 4, alpha: 8}")
    artifacts = run_recipe(recipe, tmp_path / "run", ("stages.quark.config.rounds=1",))
    model_dir = Path(artifacts["quark"].path)
    assert (model_dir / "adapter_config.json").is_file() and not (model_dir / "model.safetensors").exists()
    assert artifacts["quark"].metadata["reference"] == "adapter_disabled"
    assert artifacts["outputs"].metadata["n_outputs"] == 8


def test_4bit_policy_trains_adapters_against_the_reward_model(tiny_model_dir: str, tmp_path: Path):
    """QLoRA: a 4-bit base with LoRA adapters, scored by a reward model loaded the way the method loads it."""
    pytest.importorskip("bitsandbytes")
    import torch
    from safetensors.torch import load_file

    from alpacafarm.model_loading import load_tokenizer, save_model
    from alpacafarm.rewards import RewardScorer
    from alpacafarm_methods.quark.method import load_policy_and_reference
    from alpacafarm_methods.quark.trainer import build_quark_trainer

    spec = ModelSpec.model_validate({"name": tiny_model_dir, "quantization": "4bit",
                                     "lora": {"r": 4, "alpha": 8}})
    policy, reference, _ = load_policy_and_reference(spec, tiny_model_dir, quark_args(tmp_path))
    assert reference is None
    scorer = RewardScorer.from_path(tiny_model_dir, spec)  # a (random-head) classifier on the tiny model
    args = quark_args(tmp_path, rounds=2, prompts_per_round=4, learning_rate=5e-2, warmup_steps=0)
    trainer = build_quark_trainer(args, policy, load_tokenizer(spec, tiny_model_dir), INSTRUCTIONS[:4], scorer)
    lora = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_B" in n}
    trainer.train()
    stats = trainer.round_stats
    assert [s["steps"] for s in stats] == [1, 1] and stats[0]["n_kept"] == 4
    assert stats[1]["kl"] > 0  # round 2 trains a policy that round 1 moved from the adapter-free reference
    assert any(not torch.equal(p, lora[n]) for n, p in policy.named_parameters() if "lora_B" in n)
    checkpoint = load_file(str(tmp_path / "checkpoint-2/model.safetensors"))
    assert checkpoint and all("lora_" in name for name in checkpoint)  # not the 4-bit base
    save_model(trainer.policy, trainer.tokenizer, tmp_path / "model")
    assert (tmp_path / "model/adapter_config.json").is_file()


def test_quantization_without_lora_is_a_clear_error(tiny_model_dir: str, tmp_path: Path):
    from alpacafarm.errors import UserError
    from alpacafarm_methods.quark.method import load_policy_and_reference

    spec = ModelSpec.model_validate({"name": tiny_model_dir, "quantization": "4bit"})
    with pytest.raises(UserError, match="add lora"):
        load_policy_and_reference(spec, tiny_model_dir, quark_args(tmp_path))



# ------------------------------------------------------------------------------------------- checkpoints, resume

#: rtol / atol of "the resumed run ends with the uninterrupted run's weights": the same float32 operations in the
#: same order, so in practice bit-equal; the tolerance allows for a different summation order on other hardware.
RESUME_RTOL, RESUME_ATOL = 1e-4, 1e-5


def assert_same_weights(a: dict[str, Any], b: dict[str, Any]) -> None:
    import torch

    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=RESUME_RTOL, atol=RESUME_ATOL, msg=name)


def test_round_checkpoints_hold_the_trained_tensors_optimizer_and_stats_and_resume_to_the_same_weights(
        tmp_path: Path):
    """Every round writes checkpoint-<round> with accelerate's save_state (the newest save_total_limit = 2 kept);
    resuming from one skips its rounds and ends with the uninterrupted run's weights and statistics; a damaged
    newest one is skipped for the one before."""
    from safetensors.torch import load_file

    from alpacafarm.training import checkpoint_problem, resume_checkpoint

    settings = {"rounds": 3, "prompts_per_round": 4, "warmup_steps": 1}
    whole = tiny_trainer(tmp_path / "whole", **settings)
    whole.train()
    final = {n: p.detach().clone() for n, p in whole.model.named_parameters()}
    folders = sorted(p.name for p in (tmp_path / "whole").iterdir() if p.name.startswith("checkpoint"))
    assert folders == ["checkpoint-2", "checkpoint-3"]  # save_total_limit 2: checkpoint-1 rotated out
    checkpoint = tmp_path / "whole/checkpoint-2"
    assert checkpoint_problem(checkpoint) is None
    tensors = load_file(str(checkpoint / "model.safetensors"))
    assert set(tensors) == {n for n, p in whole.model.named_parameters() if p.requires_grad}
    assert (checkpoint / "optimizer.bin").is_file()  # accelerate's name for the optimizer state
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and [e["round"] for e in state["log_history"] if "n_pool" in e] == [1, 2]

    # A damaged newest checkpoint (killed while writing, disk full): the pipeline resumes from the one before.
    damaged = tmp_path / "whole/checkpoint-3/model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-100])
    assert "truncated" in checkpoint_problem(damaged.parent)
    (tmp_path / "whole/checkpoint-4.partial").mkdir()  # a half-written one is never a candidate

    class Context:
        stage, stage_dir, resuming = "quark", tmp_path / "whole", True
        logger = __import__("logging").getLogger("test")

    assert resume_checkpoint(Context()) == str(checkpoint)

    resumed = tiny_trainer(tmp_path / "resumed", **settings)
    sampled = []
    sample_pool = resumed.sample_pool
    resumed.sample_pool = lambda indices, round_: sampled.append(round_) or sample_pool(indices, round_)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert sampled == [3] and not (tmp_path / "resumed/round_1").exists()  # only round 3 ran
    stats, whole_stats = resumed.round_stats, whole.round_stats
    assert [s["round"] for s in stats] == [1, 2, 3] and stats[:2] == whole_stats[:2]
    timeless = [{k: v for k, v in s.items() if not k.endswith("_seconds")} for s in (stats[2], whole_stats[2])]
    assert timeless[0] == pytest.approx(timeless[1], rel=RESUME_RTOL, abs=RESUME_ATOL)  # the schedule replayed too
    assert resumed.lr_scheduler.get_last_lr() == pytest.approx(whole.lr_scheduler.get_last_lr())
    assert_same_weights({n: p.detach() for n, p in resumed.model.named_parameters()}, final)


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path: Path):
    from alpacafarm.errors import UserError
    from alpacafarm.testing import tiny_causal_lm, tiny_tokenizer
    from alpacafarm_methods.quark.trainer import build_quark_trainer

    tiny_trainer(tmp_path / "run", rounds=1, prompts_per_round=2).train()
    tokenizer = tiny_tokenizer()
    wider = build_quark_trainer(quark_args(tmp_path / "other", rounds=1), tiny_causal_lm(tokenizer, num_layers=3),
                                tokenizer, INSTRUCTIONS, e_share, ref_model=tiny_causal_lm(tokenizer, num_layers=3))
    with pytest.raises(UserError, match=r"checkpoint-1 does not match this model \(\d+ tensors missing, "
                                        r"e\.g\. model\.layers\.2\."):
        wider.train(resume_from_checkpoint=tmp_path / "run/checkpoint-1")


def test_step_metrics_go_to_the_report_to_trackers(tmp_path: Path):
    """``report_to: tensorboard``: every logged step goes to the trackers under ``quark/`` at the run's optimizer
    step (in the pipeline ``output_dir`` is the stage folder), and every round's statistics at its last step."""
    from alpacafarm.testing import tensorboard_scalars

    trainer = tiny_trainer(tmp_path, rounds=2, prompts_per_round=4, steps_per_round=2, report_to=["tensorboard"])
    trainer.train()
    scalars = tensorboard_scalars(tmp_path)
    steps = {tag: [s for s, _ in pairs] for tag, pairs in scalars.items()}
    values = {tag: [v for _, v in pairs] for tag, pairs in scalars.items()}
    for key in ("loss", "nll", "kl", "grad_norm", "learning_rate", "reward"):
        assert sorted(steps[f"quark/{key}"]) == [1, 2, 3, 4], (key, sorted(steps))  # two steps in each of 2 rounds
    assert values["quark/loss"] == pytest.approx([e["loss"] for e in step_entries(trainer)])
    assert sorted(steps["quark/round/reward_mean"]) == [2, 4]
    assert values["quark/round/reward_mean"] == pytest.approx([s["reward_mean"] for s in trainer.round_stats])


#: Runs a recipe in a child process whose Quark stage dies (os._exit, no clean-up, as under SIGKILL) when it
#: starts sampling round 2, i.e. just after checkpoint-1 was written.
DIE_IN_ROUND_2 = """
import os, sys
import torch
torch.set_num_threads(1)
from alpacafarm_methods.quark.trainer import QuarkTrainer
from alpacafarm.testing import run_recipe
sample_pool, calls = QuarkTrainer.sample_pool, []
def sample_or_die(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        os._exit(9)
    return sample_pool(*args, **kwargs)
QuarkTrainer.sample_pool = sample_or_die
run_recipe(sys.argv[1], sys.argv[2])
"""


@pytest.mark.slow
def test_a_killed_stage_resumes_after_its_last_round_and_ends_with_the_uninterrupted_weights(
        tiny_model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import subprocess
    import sys

    from safetensors.torch import load_file

    from alpacafarm_methods.quark.trainer import QuarkTrainer

    recipe = quark_recipe(tmp_path, tiny_model_dir)
    recipe.write_text(recipe.read_text().replace("rounds: 2,", "rounds: 3, warmup_steps: 1,"))
    run, stage = tmp_path / "killed", tmp_path / "killed/stages/quark"
    died = subprocess.run([sys.executable, "-c", DIE_IN_ROUND_2, str(recipe), str(run)], capture_output=True,
                          text=True, timeout=600)
    assert died.returncode == 9, died.stderr[-3000:]
    assert json.loads((stage / "manifest.json").read_text())["status"] == "running"
    assert (stage / "checkpoint-1/trainer_state.json").is_file() and not (stage / "checkpoint-2").exists()
    first_pool = (stage / "round_1/pool.jsonl").read_bytes()

    sampled: list[int] = []
    sample_pool = QuarkTrainer.sample_pool
    monkeypatch.setattr(QuarkTrainer, "sample_pool", lambda *a, **k: sampled.append(1) or sample_pool(*a, **k))
    artifacts = run_recipe(recipe, run)  # the same command again: the pipeline re-runs the "running" stage
    assert len(sampled) == 2  # rounds 2 and 3 only: round 1's pool was not sampled again
    assert (stage / "round_1/pool.jsonl").read_bytes() == first_pool
    metrics = json.loads((stage / "metrics.json").read_text())
    assert metrics["resumed_after_round"] == 1 and artifacts["quark"].metadata["resumed_after_round"] == 1
    assert [r["round"] for r in metrics["per_round"]] == [1, 2, 3] and metrics["steps"] == 3
    log = "\n".join(p.read_text() for p in run.rglob("*.log"))
    assert "resumed from checkpoint-1: rounds 1-1 done, continuing at round 2" in log

    monkeypatch.setattr(QuarkTrainer, "sample_pool", sample_pool)
    run_recipe(recipe, tmp_path / "whole")
    whole = tmp_path / "whole/stages/quark"

    def timeless(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in rounds]

    uninterrupted = timeless(json.loads((whole / "metrics.json").read_text())["per_round"])
    for resumed, expected in zip(timeless(metrics["per_round"]), uninterrupted, strict=True):
        assert resumed == pytest.approx(expected, rel=RESUME_RTOL, abs=RESUME_ATOL)
    assert_same_weights(load_file(str(stage / "model/model.safetensors")),
                        load_file(str(whole / "model/model.safetensors")))
    for r in (2, 3):  # the same pools: sampled from the same weights with the round's seed
        assert read_pool(stage / f"round_{r}/pool.jsonl") == read_pool(whole / f"round_{r}/pool.jsonl")


def test_a_lora_checkpoint_holds_the_adapters_only_and_resumes_to_the_same_adapters(tiny_model_dir: str,
                                                                                      tmp_path: Path):
    from safetensors.torch import load_file

    from alpacafarm.model_loading import load_tokenizer
    from alpacafarm_methods.quark.method import load_policy_and_reference
    from alpacafarm_methods.quark.trainer import build_quark_trainer

    spec = ModelSpec.model_validate({"name": tiny_model_dir, "lora": {"r": 4, "alpha": 8}})

    def trainer(folder: str) -> Any:
        import transformers

        transformers.set_seed(0)  # the new adapters' initialisation
        args = quark_args(tmp_path / folder, rounds=2, prompts_per_round=4, learning_rate=5e-2, warmup_steps=0)
        policy, _, _ = load_policy_and_reference(spec, tiny_model_dir, args)
        return build_quark_trainer(args, policy, load_tokenizer(spec, tiny_model_dir), INSTRUCTIONS[:8], e_share)

    whole = trainer("whole")
    whole.train()
    saved = load_file(str(tmp_path / "whole/checkpoint-1/model.safetensors"))
    assert saved and all("lora_" in name for name in saved)  # the frozen base is not in a checkpoint
    resumed = trainer("resumed")
    resumed.train(resume_from_checkpoint=tmp_path / "whole/checkpoint-1")
    assert [s["round"] for s in resumed.round_stats] == [1, 2]
    assert resumed.round_stats[1]["kl"] == pytest.approx(whole.round_stats[1]["kl"], rel=RESUME_RTOL)
    assert_same_weights(resumed.trained_tensors(), whole.trained_tensors())


def test_the_per_instruction_cut_keeps_each_instructions_best_where_the_pool_cut_keeps_the_easy_prompts():
    from alpacafarm_methods.quark.selection import top_quantile, top_quantile_per_group

    # instruction "easy" scores high whatever is answered; "hard" low: the pool-wide cut keeps only "easy"'s
    rewards = [5.0, 4.0, 4.5, 3.9, 0.2, -1.0, 0.1, -0.5]
    groups = ["easy"] * 4 + ["hard"] * 4
    assert top_quantile(rewards, 0.25) == [0, 2]
    assert top_quantile_per_group(rewards, groups, 0.25) == [0, 4]
    assert top_quantile_per_group(rewards, groups, 0.5) == [0, 2, 4, 6]
    assert top_quantile_per_group([1.0, 1.0, 0.0], ["a", "a", "b"], 0.25) == [0, 2]  # at least one each, ties early


def test_quantile_scope_instruction_keeps_each_prompts_best_rollout_in_the_pool_files(tmp_path: Path):
    def score(records, completions):
        return [len(c) + sum(map(ord, c)) % 97 / 100 for c in completions]

    trainer = tiny_trainer(tmp_path, reward=score, quantile_scope="instruction", top_quantile=0.25)
    trainer.train()
    for stat in trainer.round_stats:
        pool = read_pool(tmp_path / f"round_{stat['round']}" / "pool.jsonl")
        by_prompt: dict[int, list[dict[str, Any]]] = {}
        for row in pool:
            by_prompt.setdefault(row["record_index"], []).append(row)
        assert len(by_prompt) == 8 and stat["n_kept"] == 8
        for rows in by_prompt.values():
            kept = [row for row in rows if row["kept"]]
            assert len(kept) == 1 and kept[0]["reward"] == max(row["reward"] for row in rows)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"quantile_scope": "batch"}, "quantile_scope must be one of pool, instruction, not 'batch'"),
    ({"quantile_scope": "instruction", "rollouts_per_prompt": 1}, "quantile_scope: instruction needs"),
])
def test_a_bad_quantile_scope_is_a_one_line_error(tmp_path: Path, overrides: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        quark_args(tmp_path, **overrides)
