"""Per-step overhead of training through alpacafarm (the ``sft`` / ``reward_model`` methods) vs calling TRL directly.

Both paths train the same model on the same rows with the same trainer settings. The direct path is written
from scratch with transformers + TRL (no alpacafarm model loading, config class or pipeline); the alpacafarm
path runs the method inside the pipeline, exactly as ``alpacafarm run`` does.

Steady-state time per step comes from a probe around ``transformers.Trainer.training_step`` (the same probe on
both paths): the interval between consecutive step starts, the first ``--skip`` steps left out, median over
the rest, in wall time and in CPU time of the training thread (the steadier figure when other processes share
the CPU). Repetitions are interleaved (alpacafarm, TRL, TRL, alpacafarm, ...) and their medians reported.

    python benchmarks/trainer_overhead.py                      # tiny random model, seconds
    python benchmarks/trainer_overhead.py --model smollm2-135m-instruct --steps 8 --skip 2 --batch-size 1 --repeats 2

Goal: overhead within 3% (it is the same trainer; anything more is something alpacafarm added per step).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SEED = 7


def sft_records(n: int) -> list[dict[str, str]]:
    return [{"instruction": f"Describe item number {i} in one sentence.", "input": "" if i % 2 else f"item {i}",
             "output": f"Item {i} is a small, useful object that people keep on their desks."} for i in range(n)]


def preference_records(n: int) -> list[dict[str, Any]]:
    return [{"instruction": f"Say something kind about topic {i}.", "input": "",
             "output_1": f"Topic {i} is wonderful and worth learning about.", "output_2": f"No. Topic {i}.",
             "preference": 1 + i % 2} for i in range(n)]


def common_args(steps: int, batch_size: int, max_length: int) -> dict[str, Any]:
    """Trainer settings shared by both paths (recipe config on one side, TRL config on the other)."""
    return {"max_steps": steps, "per_device_train_batch_size": batch_size, "learning_rate": 1e-4,
            "logging_steps": 10, "save_strategy": "no", "max_length": max_length, "seed": SEED,
            "lr_scheduler_type": "constant", "disable_tqdm": True}


# ------------------------------------------------------------------------------------------ alpacafarm path


def via_alpacafarm(kind: str, model: str, steps: int, batch_size: int, max_length: int, work: Path) -> float:
    """Run the method in the pipeline; returns the trainer's ``train_runtime`` in seconds."""
    import yaml

    from alpacafarm.pipeline import Pipeline
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import load_recipe
    from alpacafarm.testing import write_records

    run = Path(tempfile.mkdtemp(dir=work))
    if kind == "sft":
        data = {"sft_data": {"path": str(write_records(run / "sft.jsonl", sft_records(64)))}}
        config = common_args(steps, batch_size, max_length)
    else:
        data = {"preferences": {"path": str(write_records(run / "prefs.jsonl", preference_records(72)))}}
        config = {**common_args(steps, batch_size, max_length), "eval_fraction": 0.0}
    recipe = {"name": "overhead", "model": {"name": model, "dtype": "float32", "device": "cpu"}, "data": data,
              "stages": [{"name": kind, "method": kind, "config": config}]}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    outcomes = Pipeline(load_recipe(run / "recipe.yaml"), get_registry(), run / "run").run()
    return float(outcomes[-1].artifact.metadata["train_runtime_s"])


# ------------------------------------------------------------------------------------------ direct TRL path


def via_trl(kind: str, model: str, steps: int, batch_size: int, max_length: int, work: Path) -> float:
    """The same training written directly against transformers + TRL; returns ``train_runtime``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from alpacafarm.model_sources import resolve_model_path  # only to find the alias's converted folder
    from alpacafarm.prompts import format_prompt

    path = resolve_model_path(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    args = {**common_args(steps, batch_size, max_length), "output_dir": tempfile.mkdtemp(dir=work), "bf16": False,
            "gradient_checkpointing": False, "report_to": "none"}
    if kind == "sft":
        from trl import SFTConfig, SFTTrainer

        rows = [{"prompt": format_prompt(r["instruction"], r["input"] or None),
                 "completion": r["output"] + tokenizer.eos_token}
                for r in sft_records(64)]
        trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                             args=SFTConfig(**args),
                             train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    else:
        from trl import RewardConfig, RewardTrainer

        rows = []
        for r in preference_records(72):
            win, lose = (r["output_1"], r["output_2"]) if r["preference"] == 1 else (r["output_2"], r["output_1"])
            rows.append({"prompt": format_prompt(r["instruction"]), "chosen": win, "rejected": lose})
        classifier = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
        classifier.config.pad_token_id = tokenizer.pad_token_id
        trainer = RewardTrainer(model=classifier, args=RewardConfig(**args), train_dataset=Dataset.from_list(rows),
                                processing_class=tokenizer)
    return float(trainer.train().metrics["train_runtime"])


# ------------------------------------------------------------------------------------------ measurement


class StepClock:
    """Timestamps at the start of every ``Trainer.training_step`` call (wall and this thread's CPU time).

    The probe wraps the base ``transformers.Trainer.training_step`` (SFTTrainer and RewardTrainer call it through
    ``super()``), so both paths are measured by the same code and neither trainer is changed. The interval
    between two step starts covers the whole loop: batch loading, forward/backward, optimizer, callbacks, logs.
    """

    def __init__(self) -> None:
        self.marks: list[tuple[float, float]] = []

    def install(self) -> None:
        from transformers import Trainer

        original = Trainer.training_step
        marks = self.marks

        def timed(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            marks.append((time.perf_counter(), time.thread_time()))
            return original(trainer, *args, **kwargs)

        Trainer.training_step = timed

    def steady_step(self, skip: int) -> tuple[float, float]:
        """Median (wall, CPU) seconds per step, leaving out the first ``skip`` intervals (start-up)."""
        marks, self.marks[:] = list(self.marks), []
        intervals = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(marks)][skip:]
        if not intervals:
            raise SystemExit("not enough steps: raise --steps or lower --skip")
        # The median ignores the odd step slowed down by another process on the shared CPU.
        return statistics.median(i[0] for i in intervals), statistics.median(i[1] for i in intervals)


CLOCK = StepClock()


def per_step(run: Any, kind: str, args: argparse.Namespace, model: str, work: Path) -> tuple[float, float]:
    """Steady-state (wall, CPU) seconds per step of one training run."""
    with contextlib.redirect_stdout(io.StringIO()):  # the trainers print their log dicts (no tqdm)
        run(kind, model, args.steps, args.batch_size, args.max_length, work)
    return CLOCK.steady_step(args.skip)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder or offline alias (default: a tiny random Llama)")
    parser.add_argument("--methods", default="sft,reward_model")
    parser.add_argument("--steps", type=int, default=40, help="training steps per run")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out (start-up)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadiest on a shared CPU)")
    args = parser.parse_args(argv)
    if args.steps <= args.skip + 1:
        parser.error("--steps must exceed --skip + 1")

    import logging

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    CLOCK.install()
    transformers.logging.set_verbosity_error()
    logging.getLogger("alpacafarm").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="trainer-overhead-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from alpacafarm.testing import save_tiny_causal_lm

            model = save_tiny_causal_lm(work / "tiny")
        label = args.model or "tiny random Llama (2 layers, hidden 64)"
        print(f"model: {label}; {args.steps} steps per run (first {args.skip} skipped), batch {args.batch_size}, "
              f"max_length {args.max_length}, "
              f"torch threads {args.threads}, {args.repeats} interleaved repeats (median)")
        worst = float("-inf")
        for kind in args.methods.split(","):
            ours, direct = [], []
            started = time.perf_counter()
            for repeat in range(args.repeats):
                # ABBA order: whichever runs second in a pair would otherwise always meet the same machine state.
                pair = [(via_alpacafarm, ours), (via_trl, direct)]
                for run, results in pair if repeat % 2 == 0 else pair[::-1]:
                    results.append(per_step(run, kind, args, model, work))
            for index, clock in ((0, "wall"), (1, "CPU ")):
                a = statistics.median(o[index] for o in ours)
                t = statistics.median(d[index] for d in direct)
                overhead = 100.0 * (a - t) / t
                worst = max(worst, overhead)
                print(f"{kind:>13} {clock}: alpacafarm {a * 1000:8.2f} ms/step   TRL direct {t * 1000:8.2f} ms/step   "
                      f"overhead {overhead:+6.2f}%   (range: ours {min(o[index] for o in ours) * 1000:.1f}-"
                      f"{max(o[index] for o in ours) * 1000:.1f}, TRL {min(d[index] for d in direct) * 1000:.1f}-"
                      f"{max(d[index] for d in direct) * 1000:.1f} ms)")
            print(f"{'':>13} ({time.perf_counter() - started:.0f}s)")
    print(f"worst overhead {worst:+.2f}% (goal: within 3%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
