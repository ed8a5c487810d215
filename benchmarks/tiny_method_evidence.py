"""Tiny-model evidence that each learning method learns what it should, and the float32-master-weights figure.

Every method runs through the real pipeline (``alpacafarm.testing.run_recipe``: recipe, stage, method, the
stage's ``metrics.json``) on a tiny random-init Llama (2 layers, hidden 64, the testing kit's tokenizer) on the
CPU, with a fixed seed. The figures are read back from what the stages wrote:

* precision: the share of weight entries that 20 SFT steps at lr 1e-5 change, ``model.dtype`` float32 vs
  bfloat16 (saved with ``save_dtype: float32``, so the file holds the float32 master copy), and, for scale, the
  same run with the weights themselves in bfloat16 (the behaviour before master copies; simulated by casting the
  SFT trainer's model to bfloat16 before training);
* sft: first vs last logged training loss on short demonstrations;
* reward_model, ppo, quark, grpo, rloo: one recipe. The reward model learns a preference set (a polite on-topic
  answer beats a curt refusal) and is scored on held-out pairs; the four RL stages then each start from the tiny
  model and optimise that reward model's score of 8-token completions (its mean per step or round, first vs last);
* dpo: TRL's logged implicit-reward accuracy and margin on the same preference set, first vs last steps.

    python benchmarks/tiny_method_evidence.py                 # the table (2-3 minutes on 2 CPU cores)
    python benchmarks/tiny_method_evidence.py --json          # the same figures as JSON
    python benchmarks/tiny_method_evidence.py --out runs/tiny-evidence   # keep the run folders

Nothing is asserted: a method that does not learn in its budget shows it in the table ("learned" applies the
simple test stated in each row's legend). Progress bars and trainer logs go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import textwrap
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SEED = 7
#: the precision run (tests/test_precision.py): 20 AdamW steps at the paper's learning rate, constant schedule
PRECISION_SFT = {"max_steps": 20, "per_device_train_batch_size": 2, "learning_rate": 1e-5,
                 "lr_scheduler_type": "constant", "warmup_steps": 0, "logging_steps": 5, "save_strategy": "no"}
#: shared by the TRL online trainers (GRPO, RLOO)
ONLINE = {"bf16": False, "report_to": "none", "logging_steps": 1, "save_strategy": "no", "warmup_steps": 0,
          "lr_scheduler_type": "constant", "max_steps": 64, "per_device_train_batch_size": 16,
          "num_generations": 4, "max_completion_length": 8, "learning_rate": 5e-2}
WINDOW = 5  # steps (or Quark rounds) averaged at each end of a noisy curve


# ------------------------------------------------------------------------------------------ data


def sft_records(n: int) -> list[dict[str, str]]:
    return [{"instruction": f"Name the colour number {i}.", "input": "" if i % 3 else "a short list",
             "output": f"Colour {i} is blue."} for i in range(n)]


def precision_records() -> list[dict[str, str]]:
    return [{"instruction": f"Name colour number {i}.", "input": "", "output": f"Colour {i} is a shade of blue."}
            for i in range(8)]


def preference_records(n: int) -> list[dict[str, Any]]:
    """The tests' learnable preference set (helpful on-topic answer vs curt refusal)."""
    from alpacafarm.testing import learnable_preferences

    return learnable_preferences(n)


def prompt_records(n: int) -> list[dict[str, str]]:
    return [{"instruction": f"Tell me something about topic number {i}.", "input": "" if i % 3 else "briefly"}
            for i in range(n)]


# ------------------------------------------------------------------------------------------ running recipes


@dataclass
class Stage:
    """What one stage left behind: its artifact's metadata, ``metrics.json`` and its duration."""

    path: Path
    metadata: dict[str, Any]
    metrics: dict[str, Any]
    seconds: float

    def history(self, key: str) -> list[float]:
        return [float(e[key]) for e in self.metrics.get("log_history", []) if key in e]


@dataclass
class Row:
    method: str
    figures: dict[str, Any]
    summary: str
    meaning: str
    learned: bool | None = None
    seconds: float = 0.0
    error: str | None = None


class Runner:
    """Writes a recipe around the tiny model and runs it in-process; stdout (TRL's log dicts) goes to stderr."""

    def __init__(self, work: Path, model: str) -> None:
        self.work, self.model = work, model

    def run(self, name: str, data: dict[str, list[dict[str, Any]]], stages: list[dict[str, Any]],
            **model: Any) -> dict[str, Stage]:
        import yaml

        from alpacafarm.testing import run_recipe, write_records

        folder = self.work / name
        sources = {key: {"path": str(write_records(folder / f"{key}.jsonl", rows))} for key, rows in data.items()}
        recipe = {"name": name, "seed": SEED, "data": sources, "stages": stages,
                  "model": {"name": self.model, "dtype": "float32", "device": "cpu", **model}}
        (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
        with contextlib.redirect_stdout(sys.stderr):
            artifacts = run_recipe(folder / "recipe.yaml", folder / "run")
        out = {}
        for stage, artifact in artifacts.items():
            stage_dir = folder / "run" / "stages" / stage
            metrics = stage_dir / "metrics.json"
            manifest = json.loads((stage_dir / "manifest.json").read_text())
            out[stage] = Stage(Path(artifact.path), dict(artifact.metadata),
                               json.loads(metrics.read_text()) if metrics.is_file() else {},
                               float(manifest.get("duration_s") or 0.0))
        return out


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def ends(values: list[float], window: int) -> tuple[float, float]:
    """Mean of the first and of the last ``window`` values."""
    return mean(values[:window]), mean(values[-window:])


# ------------------------------------------------------------------------------------------ the methods


def changed_share(after: dict[str, Any], before: dict[str, Any]) -> float:
    """Share of the floating-point weight entries (over tensors in both) whose value differs."""
    changed = total = 0
    for name, tensor in after.items():
        if name in before and tensor.is_floating_point():
            changed += int((tensor.float() != before[name].float()).sum())
            total += tensor.numel()
    return changed / total


def pure_bf16_share(runner: Runner) -> float:
    """The same 20 steps with the trained weights themselves in bfloat16 (no master copy): what used to happen."""
    import torch

    from alpacafarm.recipe import ModelSpec
    from alpacafarm_methods.supervised.sft import SFTMethodConfig, build_sft_trainer

    config = SFTMethodConfig(output_dir=str(runner.work / "precision-pure-bf16"), report_to="none",
                             disable_tqdm=True, seed=SEED, **PRECISION_SFT)
    spec = ModelSpec(name=runner.model, dtype="float32", device="cpu")
    trainer = build_sft_trainer(config, spec, runner.model, precision_records())
    trainer.model.to(torch.bfloat16)  # before train(): the optimizer is built on bfloat16 parameters
    before = {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}
    with contextlib.redirect_stdout(sys.stderr):
        trainer.train()
    return changed_share(trainer.model.state_dict(), before)


def precision(runner: Runner) -> list[Row]:
    from safetensors.torch import load_file

    initial = load_file(str(Path(runner.model) / "model.safetensors"))
    moved, seconds = {}, 0.0
    for dtype in ("float32", "bfloat16"):
        stage = runner.run(f"precision-{dtype}", {"sft_data": precision_records()},
                           [{"name": "sft", "method": "sft", "config": PRECISION_SFT}],
                           dtype=dtype, save_dtype="float32")["sft"]
        moved[dtype] = changed_share(load_file(str(stage.path / "model.safetensors")), initial)
        seconds += stage.seconds
    started = time.perf_counter()
    moved["pure_bfloat16_weights"] = pure_bf16_share(runner)
    seconds += time.perf_counter() - started
    ratio = moved["bfloat16"] / moved["float32"] if moved["float32"] else float("nan")
    return [Row("precision", {**moved, "ratio_bf16_to_fp32": ratio},
                f"weights changed: float32 {moved['float32']:.1%}, bfloat16 {moved['bfloat16']:.1%} "
                f"(ratio {ratio:.2f}); pure-bf16 weights {moved['pure_bfloat16_weights']:.1%}",
                "share of weight entries that differ from the initial model after 20 SFT steps at lr 1e-5 "
                "(batch 2, constant schedule) with model.dtype float32 vs bfloat16; 'pure-bf16 weights' is the "
                "same run with the trained weights cast to bfloat16 (no float32 master copy, as before the fix), "
                "counted against their bfloat16 start. learned = bfloat16 >= 0.9 x float32.",
                ratio >= 0.9, seconds)]


def sft(runner: Runner) -> list[Row]:
    config = {"max_steps": 30, "per_device_train_batch_size": 4, "learning_rate": 1e-3, "warmup_steps": 0,
              "logging_steps": 1, "save_strategy": "no"}
    stage = runner.run("sft", {"sft_data": sft_records(16)},
                       [{"name": "sft", "method": "sft", "config": config}])["sft"]
    losses = stage.history("loss")
    first, last = losses[0], losses[-1]
    return [Row("sft", {"loss_first": first, "loss_last": last, "steps": len(losses)},
                f"loss {first:.3f} -> {last:.3f} ({len(losses)} steps)",
                "training loss (response tokens only) at the first and the last logged step; 30 steps, batch 4, "
                "lr 1e-3 on 16 demonstrations. learned = last < first.",
                last < first, stage.seconds)]


def dpo(runner: Runner) -> list[Row]:
    config = {"max_steps": 16, "per_device_train_batch_size": 8, "learning_rate": 1e-3, "warmup_steps": 0,
              "logging_steps": 1, "save_strategy": "no", "eval_fraction": 0.125}
    stage = runner.run("dpo", {"preferences": preference_records(64)},
                       [{"name": "dpo", "method": "dpo", "config": config}])["dpo"]
    w = 3
    acc0, acc1 = ends(stage.history("rewards/accuracies"), w)
    mar0, mar1 = ends(stage.history("rewards/margins"), w)
    loss0, loss1 = ends(stage.history("loss"), w)
    eval_acc, eval_margin = stage.metadata.get("eval_rewards/accuracies"), stage.metadata.get("eval_rewards/margins")
    figures = {"accuracy_step_1": stage.history("rewards/accuracies")[0],
               "margin_step_1": stage.history("rewards/margins")[0],
               "accuracy_first": acc0, "accuracy_last": acc1, "margin_first": mar0, "margin_last": mar1,
               "loss_first": loss0, "loss_last": loss1, "eval_accuracy": eval_acc, "eval_margin": eval_margin,
               "beta": stage.metadata.get("beta")}
    held_out = f"; held-out accuracy {eval_acc:.2f}, margin {eval_margin:.2f}" if eval_acc is not None else ""
    return [Row("dpo", figures,
                f"accuracy {acc0:.2f} -> {acc1:.2f}, margin {mar0:.2f} -> {mar1:.2f}, loss {loss0:.3f} -> "
                f"{loss1:.3f}{held_out}",
                "TRL's rewards/accuracies (share of pairs whose implicit reward beta*log(pi/pi_ref) ranks the chosen "
                "answer first), rewards/margins (chosen - rejected implicit reward) and loss, mean of the first vs "
                f"last {w} of 16 steps (batch 8, lr 1e-3, beta {stage.metadata.get('beta')}); held-out: TRL's "
                "evaluation on 8 unseen pairs. learned = margin and accuracy rise.",
                acc1 > acc0 and mar1 > mar0, stage.seconds)]


def reference_scores(rm_path: Path, model: str) -> tuple[float, float]:
    """The reward model's mean score of polite answers and of refusals to 20 prompts its training never saw."""
    from alpacafarm.recipe import ModelSpec
    from alpacafarm.rewards import RewardScorer

    scorer = RewardScorer.from_path(str(rm_path), ModelSpec(name=model, dtype="float32", device="cpu"))
    unseen = preference_records(220)[200:]
    prompts = [{"instruction": r["instruction"], "input": ""} for r in unseen]
    polite = [r[f"output_{r['preference']}"] for r in unseen]
    refusal = [r[f"output_{3 - r['preference']}"] for r in unseen]
    return mean(scorer.score_records(prompts, polite)), mean(scorer.score_records(prompts, refusal))


def reinforcement(runner: Runner) -> list[Row]:
    """Reward model, then PPO, Quark, GRPO and RLOO against it, in one recipe (each RL stage starts from the tiny
    model: there is no SFT stage)."""
    rm = {"num_train_epochs": 1, "per_device_train_batch_size": 16, "learning_rate": 2e-3, "warmup_steps": 0.1,
          "logging_steps": 1, "save_strategy": "no", "eval_fraction": 0.1}
    ppo = {"max_steps": 48, "rollout_batch_size": 16, "mini_batch_size": 8, "per_device_train_batch_size": 8,
           "generation_batch_size": 16, "max_new_tokens": 8, "learning_rate": 1e-2, "kl_coef": 0.02,
           "logging_steps": 1, "save_strategy": "no", "score_batch_size": 16}
    quark = {"rounds": 60, "prompts_per_round": 16, "rollouts_per_prompt": 4, "max_new_tokens": 8,
             "generation_batch_size": 16, "per_device_train_batch_size": 16, "step_batch_size": 16,
             "learning_rate": 5e-3, "lr_scheduler_type": "constant", "disable_tqdm": True, "score_batch_size": 16}
    stages = runner.run("rl", {"instructions": prompt_records(64), "preferences": preference_records(200)}, [
        {"name": "split", "method": "split_instructions", "config": {"eval_size": 4}},
        {"name": "rm", "method": "reward_model", "config": rm},
        {"name": "ppo", "method": "ppo", "config": ppo},
        {"name": "quark", "method": "quark", "config": quark},
        {"name": "grpo", "method": "grpo", "config": ONLINE},
        {"name": "rloo", "method": "rloo", "config": ONLINE},
    ])
    rows = []

    s = stages["rm"]
    losses = s.history("loss")
    acc, margin = s.metadata["eval_accuracy"], s.metadata.get("eval_margin")
    polite, refusal = reference_scores(s.path, runner.model)
    rows.append(Row("reward_model", {"eval_accuracy": acc, "eval_margin": margin, "n_eval": s.metadata["n_eval"],
                                     "n_train": s.metadata["n_train"], "loss_first": losses[0],
                                     "loss_last": losses[-1], "score_polite": polite, "score_refusal": refusal},
                    f"held-out accuracy {acc:.2f} on {s.metadata['n_eval']} pairs (margin {margin:.2f}); "
                    f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; scores polite {polite:.2f}, refusal {refusal:.2f}",
                    "eval_accuracy: share of held-out pairs (10% of 200) the model scores preferred > rejected "
                    "(chance 0.5), eval_margin their mean score difference; Bradley-Terry loss at the first vs last "
                    "logged step (1 epoch, batch 16, lr 2e-3); scores: its mean score of 20 unseen polite answers and "
                    "of their refusals (the scale of the RL rows' RM scores). learned = eval_accuracy >= 0.9.",
                    acc >= 0.9, s.seconds))

    s = stages["ppo"]
    score0, score1 = ends(s.history("score"), WINDOW)
    kl, penalized = s.history("kl")[-1], s.history("penalized_kl")[-1]
    entropy = s.history("entropy")
    peak = max(s.history("score"))
    rows.append(Row("ppo", {"score_first": score0, "score_last": score1, "score_peak_step": peak,
                            "kl_first": s.history("kl")[0],
                            "kl_final": kl, "penalized_kl_final": penalized, "entropy_first": entropy[0],
                            "entropy_last": entropy[-1], "kl_coef": ppo["kl_coef"]},
                    f"RM score {score0:.3f} -> {score1:.3f} (best step {peak:.3f}); final KL {kl:.2f} "
                    f"(penalized {penalized:.2f}); "
                    f"entropy {entropy[0]:.2f} -> {entropy[-1]:.2f}",
                    f"mean reward-model score of the rollouts, first vs last {WINDOW} of {ppo['max_steps']} PPO "
                    f"steps (16 rollouts of 8 tokens a step, lr 1e-2, kl_coef {ppo['kl_coef']}, defaults otherwise: "
                    "clamped KL penalty, whitened rewards, value model started as the reward model); final KL: the "
                    "last step's summed "
                    "per-token log p - log p_ref (sampled estimate) and the clamped max(., 0) the penalty is charged "
                    "on, in nats per completion; best step: the highest step mean. learned = score rises.",
                    score1 > score0, s.seconds))

    s = stages["quark"]
    per_round = s.metrics.get("per_round", [])
    pool = [float(r["reward_mean"]) for r in per_round]
    kept = [float(r["reward_kept_mean"]) for r in per_round]
    pool0, pool1 = ends(pool, WINDOW)
    rows.append(Row("quark", {"pool_reward_first": pool0, "pool_reward_last": pool1, "round_1": pool[0],
                              "round_last": pool[-1], "round_peak": max(pool), "kept_reward_last": kept[-1],
                              "kl_last": per_round[-1].get("kl"), "rounds": len(pool)},
                    f"pool RM score {pool0:.3f} -> {pool1:.3f} (round 1 {pool[0]:.3f}, round {len(pool)} "
                    f"{pool[-1]:.3f}, best round {max(pool):.3f}); KL {per_round[-1].get('kl') or 0.0:.3f}",
                    "mean reward-model score of each round's fresh pool (16 prompts x 4 rollouts of 8 tokens), mean "
                    f"of the first vs last {WINDOW} of {len(pool)} rounds; defaults otherwise: keep the top 25% (16), "
                    "one optimizer step of step_batch_size 16 per round, lr 5e-3 (constant), kl_coef 0.05; KL: the "
                    "last round's mean per-token KL(policy || reference) over the tokens it trained on; best round: "
                    "the highest round mean. learned = pool score rises.",
                    pool1 > pool0, s.seconds))

    for method in ("grpo", "rloo"):
        s = stages[method]
        rewards = s.history("reward")
        r0, r1 = ends(rewards, WINDOW)
        kls = s.history("kl")
        beta = s.metadata.get("beta")
        figures = {"reward_first": r0, "reward_last": r1, "reward_step_1": rewards[0],
                   "reward_step_last": rewards[-1], "reward_peak_step": max(rewards), "beta": beta,
                   "kl_final": kls[-1] if kls else None}
        kl_text = f"; final KL {kls[-1]:.3f}" if kls else ""
        rows.append(Row(method, figures,
                        f"RM score {r0:.3f} -> {r1:.3f} (best step {max(rewards):.3f}; beta {beta}){kl_text}",
                        "TRL's logged reward (the reward model's mean score of the step's completions), mean of the "
                        f"first vs last {WINDOW} of {ONLINE['max_steps']} steps: 4 prompts x 4 completions of 8 tokens "
                        f"a step, lr 5e-2, beta {beta} (the method's default); KL: TRL's logged KL to the reference "
                        "at the last step (when beta > 0); best step: the highest step mean. learned = reward rises.",
                        r1 > r0, s.seconds))
    return rows


SECTIONS = {"precision": precision, "sft": sft, "dpo": dpo,
            "rl": reinforcement}  # rl: reward_model, ppo, quark, grpo, rloo
SECTION_ROWS = {"precision": ["precision"], "sft": ["sft"], "dpo": ["dpo"],
                "rl": ["reward_model", "ppo", "quark", "grpo", "rloo"]}


# ------------------------------------------------------------------------------------------ report


def print_table(rows: list[Row], header: str, wall: float) -> None:
    print(header)
    print()
    print(f"{'method':<13} {'learned':<8} {'seconds':>7}  figures")
    print("-" * 118)
    for row in rows:
        learned = {True: "yes", False: "NO", None: "-"}[row.learned]
        figures = f"error: {row.error}" if row.error else row.summary
        print(f"{row.method:<13} {learned:<8} {row.seconds:>7.1f}  {figures}")
    print()
    print("What the numbers are (x -> y: start -> end of training):")
    for row in rows:
        print(textwrap.fill(row.meaning, width=118, initial_indent=f"  {row.method:<13}",
                            subsequent_indent=" " * 15))
    print()
    print(f"total wall time {wall:.0f} s")


def jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    parser.add_argument("--out", help="run directory to keep (default: a temporary one, deleted at the end)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: fastest for these tiny models, and steadiest on a shared CPU)")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run (of {', '.join(SECTIONS)})")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if unknown := [s for s in only if s not in SECTIONS]:
        parser.error(f"unknown section(s): {', '.join(unknown)}")

    import logging

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("alpacafarm").setLevel(logging.WARNING)

    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if args.out:
            work = Path(args.out)
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tiny-evidence-")))
        from alpacafarm.testing import save_tiny_causal_lm

        runner = Runner(work, save_tiny_causal_lm(work / "tiny-model"))  # the tests' tiny model (init seed 0)
        rows: list[Row] = []
        for name in only:
            section_started = time.perf_counter()
            print(f"[tiny-evidence] {name} ...", file=sys.stderr, flush=True)
            # The reward model's new score head is drawn from the process's RNG (build_reward_trainer seeds nothing
            # before loading the classifier): seed each section so its figures do not depend on what ran before.
            transformers.set_seed(SEED)
            try:
                rows.extend(SECTIONS[name](runner))
            except Exception as error:  # report it in the table and go on: one failure hides no other figure
                traceback.print_exc()
                seconds = time.perf_counter() - section_started
                rows.extend(Row(method, {}, "", "", None, seconds, f"{type(error).__name__}: {error}")
                            for method in SECTION_ROWS[name])
    wall = time.perf_counter() - started

    header = (f"Tiny-model evidence: random-init Llama (2 layers, hidden 64, 2,048-token BPE; the tests' tiny model), "
              f"CPU, {args.threads} torch thread(s), recipe seed {SEED}, torch {torch.__version__}, "
              f"transformers {transformers.__version__}")
    if args.json:
        print(json.dumps(jsonable({"setting": header, "seed": SEED, "threads": args.threads, "wall_s": wall,
                                   "rows": [asdict(r) for r in rows]}), indent=2))
    else:
        print_table(rows, header, wall)
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
