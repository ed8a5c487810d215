"""Where a PPO step's time goes on this machine: sampling, reward scoring, the rollout's forward passes, the update.

Builds the ``ppo`` method's trainer (:func:`alpacafarm_methods.ppo.method.build_ppo_trainer`, as the stage does)
on the offline model (SmolLM2-135M-Instruct) and a reward model folder a run trained, with the PPO settings of
``recipes/learning.yaml`` unless overridden, runs a few steps on the bundled instructions and prints, per step and
as a median over the steps after the first, the seconds spent in each phase. The trainer's own ``rollout_time``
and ``update_time`` are the totals; sampling and scoring are timed by wrapping the trainer's ``sample_step`` and
reward function, so the rest of the rollout is its three forward passes (policy with value head, reference).

    python benchmarks/ppo_step_profile.py runs/learning-reward-pairs/stages/reward_model/model --steps 3

Measure on a quiet machine: every phase is CPU-bound, and another job on 2 cores slows it several-fold.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: recipes/learning.yaml's ppo stage
LEARNING_PPO = {"rollout_batch_size": 16, "mini_batch_size": 8, "ppo_epochs": 1, "per_device_train_batch_size": 8,
                "generation_batch_size": 16, "temperature": 0.7, "max_new_tokens": 64, "learning_rate": 3.0e-5,
                "warmup_steps": 0, "kl_coef": 0.02, "save_strategy": "no"}


class Timed:
    """A callable that adds the seconds each call of ``target`` takes to ``spent[-1]`` under ``key``."""

    def __init__(self, target: Any, key: str, spent: list[dict[str, float]]) -> None:
        self.target, self.key, self.spent = target, key, spent

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.target(*args, **kwargs)
        finally:
            self.spent[-1][self.key] = self.spent[-1].get(self.key, 0.0) + time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reward_model", help="a reward model folder (a reward_model stage's model/)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a PPO setting (e.g. --set rollout_batch_size=32); values parsed as YAML")
    parser.add_argument("--instructions", type=int, default=64)
    args = parser.parse_args()

    import torch
    import yaml

    from alpacafarm.data import load_source
    from alpacafarm.recipe import DataSource, ModelSpec
    from alpacafarm_methods.ppo.config import PPOMethodConfig
    from alpacafarm_methods.ppo.method import build_ppo_trainer

    settings = dict(LEARNING_PPO)
    for item in args.set:
        key, _, value = item.partition("=")
        settings[key] = yaml.safe_load(value)
    spec = ModelSpec(name="smollm2-135m-instruct", dtype="float32", device="cpu", prompt_format="chat_template",
                     inference_dtype="bfloat16_if_native")
    records = load_source(DataSource(builtin="alpaca_eval_sample"))[:args.instructions]
    spent: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as out:
        config = PPOMethodConfig(output_dir=out, max_steps=args.steps, logging_steps=1, **settings)
        trainer = build_ppo_trainer(config, spec, spec.name, args.reward_model, records)
        trainer.sample_step = Timed(trainer.sample_step, "sampling", spent)
        trainer.reward_fn = Timed(trainer.reward_fn, "scoring", spent)
        for step in range(args.steps):
            spent.append({})
            stats = trainer.step(step)
            phases = spent[-1]
            phases["forward passes"] = stats["rollout_time"] - phases["sampling"] - phases["scoring"]
            phases["update"] = stats["update_time"]
            phases["step"] = stats["rollout_time"] + stats["update_time"]
            print(f"step {step}: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()), flush=True)
    steady = spent[1:] or spent
    print(f"\nPPO step on {torch.get_num_threads()} threads, {settings['rollout_batch_size']} rollouts of at most "
          f"{settings['max_new_tokens']} tokens, mini-batches of {settings['mini_batch_size']} "
          f"(median of {len(steady)} step(s){' after the first' if len(spent) > 1 else ''}):")
    for key in steady[0]:
        value = statistics.median(s[key] for s in steady)
        share = value / statistics.median(s["step"] for s in steady)
        print(f"  {key:<15} {value:7.1f} s" + ("" if key == "step" else f"  {share:5.0%}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
