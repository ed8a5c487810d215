"""Training in float32 against bfloat16 autocast on this CPU (``bf16: true``): seconds, and with ``--judge`` what
each side learns, both sides in one run on the same inputs.

One ``alpacafarm run`` (one run folder, one SFT model, one preference set, one proxy): ``recipes/learning.yaml``'s
split, preference and reward-model stages, then each chosen stage — DPO (a TRL Trainer), PPO (our own Accelerator
loop) and GRPO (TRL's online trainer) by default — twice, ``<name>_float32`` (``bf16: false``) and ``<name>_bf16``
(``bf16: true``), from one seed (the same batches). ``--steps N`` cuts each to N optimizer steps (timing);
``--steps 0`` keeps learning.yaml's budget. It prints each stage's seconds (the manifest's, model loading included),
seconds per step and the float32/bf16 ratio. ``--judge`` also samples every trained policy on the 64 validation
instructions (never the held-out ones) with its KL and judges them with learning.yaml's evaluation beside the SFT
row: whether autocast costs any learning (the run prints the table; ``stages/evaluate/results.csv``).

On a CPU without AVX512-BF16 or AMX, ``bf16: true`` trains in float32 with a note (the ratio is then ~1).

    python benchmarks/training_precision.py --out runs/bench/training-precision [--steps 4] [--stages dpo ppo grpo]
    python benchmarks/training_precision.py --out runs/bench/precision-judged --steps 0 --judge --stages dpo rloo
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PRECISIONS = (("float32", False), ("bf16", True))


def bench_recipe(stages: list[str], steps: int, judge: bool) -> dict:
    """learning.yaml with its split, preference and reward-model stages, then each of ``stages`` twice (and, with
    ``judge``, their validation outputs and the evaluation)."""
    recipe = yaml.safe_load((REPO / "recipes" / "learning.yaml").read_text(encoding="utf-8"))
    by_name = {stage["name"]: stage for stage in recipe["stages"]}
    kept = [by_name[name] for name in ("split", "preferences", "reward_model")]
    if not judge:
        kept[1] = {**kept[1], "config": {**kept[1]["config"], "max_instructions": 32}}
    outputs = by_name["dpo_outputs"]["config"]
    policy = []
    if judge:
        kept.append({**by_name["sft_outputs"], "config": {**by_name["sft_outputs"]["config"], "split": "validation"}})
        policy.append("sft_outputs")
    for name in stages:
        stage = by_name[name]
        config = dict(stage["config"])
        if "max_steps" not in config:
            raise SystemExit(f"stage {name} has no max_steps: this benchmark times optimizer steps")
        if steps:
            config["max_steps"] = steps
        config.pop("snapshot_steps", None)
        config["seed"] = 7  # one seed for both sides (a stage's own seed derives from its name): the same batches
        for precision, bf16 in PRECISIONS:
            trained = f"{name}_{precision}"
            kept.append({**stage, "name": trained, "config": {**config, "bf16": bf16}})
            if judge:
                kept.append({"name": f"{trained}_outputs", "method": "generate_outputs",
                             "inputs": {"sft_model": trained, "kl_reference": "base_model"},
                             "config": {**outputs, "split": "validation"}})
                policy.append(f"{trained}_outputs")
    recipe["stages"] = kept
    recipe["name"] = "training-precision"
    if judge:
        recipe["evaluation"]["policy"] = policy
    else:
        recipe.pop("evaluation", None)
    return recipe


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per stage (0: learning.yaml's own)")
    parser.add_argument("--stages", nargs="+", default=["dpo", "ppo", "grpo"])
    parser.add_argument("--judge", action="store_true", help="sample and judge every policy on validation")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    recipe_path = args.out / "training-precision.yaml"
    recipe = bench_recipe(args.stages, args.steps, args.judge)
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    run_dir = args.out / "run"
    command = [str(Path(sys.executable).with_name("alpacafarm")), "run", str(recipe_path), "--output-dir", str(run_dir)]
    subprocess.run(command, check=True, env=os.environ.copy())
    seconds = {}
    for manifest_path in sorted((run_dir / "stages").glob("*/manifest.json")):
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        seconds[manifest["stage"]] = float(manifest.get("duration_s") or 0.0)
    steps = {stage["name"]: stage["config"]["max_steps"] for stage in recipe["stages"]
             if "max_steps" in stage["config"]}
    print(f"\n{'stage':<18}{'steps':>6}{'float32 s':>11}{'bf16 s':>9}{'s/step fp32':>13}{'s/step bf16':>13}"
          f"{'ratio':>7}")
    for name in args.stages:
        fp32, bf16 = seconds[f"{name}_float32"], seconds[f"{name}_bf16"]
        n = steps[f"{name}_float32"]
        print(f"{name:<18}{n:>6}{fp32:>11.1f}{bf16:>9.1f}{fp32 / n:>13.2f}{bf16 / n:>13.2f}{fp32 / bf16:>7.2f}")


if __name__ == "__main__":
    main()
