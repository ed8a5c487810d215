"""Where the minutes go (issue 60): each stage's seconds, its work and its FLOP rate against this CPU's matmul peak.

Runs ``alpacafarm run RECIPE`` in a fresh run directory and a fresh cache folder (the machine's converted models
and OpenVINO exports linked, as ``quickstart_times.py`` does) with ``stage_probe.py`` installed in that process,
then prints per stage:

- seconds (the manifest's), tokens through torch (every embedding lookup, padding included) and of them with
  gradients on, tokens through OpenVINO (prompts prefilled once, tokens generated);
- GFLOP: torch's own count of its matrix products and attention (``FlopCounterMode``, forward and backward), plus
  OpenVINO's tokens times twice the model's linear weights (an estimate: attention over the context not counted);
- GFLOP/s over the stage's seconds and as a share of the **peak**: the best float32 matrix-product rate torch
  reaches on this machine with all its threads (square products of 1,024 to 3,072, measured first, in the same
  environment as the run). OpenVINO sampling in bfloat16 on a CPU that has it natively can pass 100% of that
  float32 peak.

A stage at a few percent of the peak spends its time outside matrix products (loading, Python, small batches,
annotation); one near it is compute-bound and gains only from doing less work. Processes that a stage launches
(``distributed`` stages, torchrun) are not probed: their stage shows its seconds and no work.

    python benchmarks/stage_profile.py recipes/quickstart.yaml --out /tmp/profile [--without-native-bf16] [--set K=V]

``--without-native-bf16`` holds torch to AVX2 and float32 as ``quickstart_times.py`` does (OpenVINO is not held).
The counters cost a few percent of the run (a Python call per operator); time a recipe with ``quickstart_times.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from quickstart_times import fresh_cache, held_back

ROOT = Path(__file__).resolve().parents[1]
PEAK = """
import time, torch
best = 0.0
for n in (1024, 2048, 3072):
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start, k = time.perf_counter(), 0
    while time.perf_counter() - start < 1.5:
        a @ b
        k += 1
    best = max(best, 2 * n ** 3 * k / (time.perf_counter() - start))
print(best / 1e9, torch.get_num_threads())
"""


def matmul_peak(env: dict[str, str]) -> tuple[float, int]:
    """The best float32 matrix-product GFLOP/s of torch on this machine in ``env``, and its thread count."""
    done = subprocess.run([sys.executable, "-c", PEAK], env=dict(os.environ, **env), capture_output=True, text=True,
                          check=True)
    rate, threads = done.stdout.split()
    return float(rate), int(threads)


def token_flops(recipe: Path, overrides: list[str]) -> int:
    """Twice the linear weights of the recipe's model (a forward pass's FLOPs per token, attention aside)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from alpacafarm.model_sources import resolve_model_path
    from alpacafarm.recipe import load_recipe

    loaded = load_recipe(str(recipe), overrides=overrides)
    config = AutoConfig.from_pretrained(resolve_model_path(loaded.recipe.model.name))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    if getattr(config, "tie_word_embeddings", False) and not any(
            isinstance(m, torch.nn.Linear) and m is model.get_output_embeddings() for m in model.modules()):
        linear += model.get_input_embeddings().weight.numel()
    return 2 * linear


def profile(recipe: Path, out: Path, overrides: list[str], env: dict[str, str]) -> tuple[list[dict], list[dict]]:
    """Run the recipe with the probe; the stages' manifests and the probe's samples."""
    if out.exists():
        raise SystemExit(f"stage_profile: {out} exists; give a new --out")
    cache = fresh_cache(out / "cache")
    samples_file = out / "probe.json"
    argv = ["alpacafarm", "run", str(recipe), "--output-dir", str(out / "run")]
    for override in overrides:
        argv += ["--set", override]
    child = (f"import sys, runpy; sys.path.insert(0, {str(Path(__file__).parent)!r}); import stage_probe; "
             f"stage_probe.install({str(samples_file)!r}); sys.argv = {argv!r}; "
             "runpy.run_module('alpacafarm', run_name='__main__', alter_sys=True)")
    environment = dict(os.environ, **env, ALPACAFARM_CACHE_DIR=str(cache),
                       ALPACAFARM_PROBE_TOKEN_FLOPS=str(token_flops(recipe, overrides)))
    done = subprocess.run([sys.executable, "-c", child], env=environment, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"stage_profile: the run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    manifests = [json.loads(p.read_text(encoding="utf-8"))
                 for p in sorted((out / "run" / "stages").glob("*/manifest.json"))]
    return (sorted(manifests, key=lambda m: (m.get("started_at") or "", m.get("finished_at") or "")),
            json.loads(samples_file.read_text(encoding="utf-8")))


def at(samples: list[dict], moment: float) -> dict:
    """The last sample taken at or before ``moment`` (zeros before the first)."""
    seen = {k: 0 for k in ("flops", "tokens", "grad_tokens", "ov_tokens", "ov_flops")}
    for sample in samples:
        if sample["t"] > moment:
            break
        seen = sample
    return seen


def stage_rows(manifests: list[dict], samples: list[dict]) -> list[dict]:
    rows = []
    for manifest in manifests:
        if not manifest.get("started_at") or not manifest.get("finished_at"):
            continue
        start = datetime.fromisoformat(manifest["started_at"]).timestamp()
        end = datetime.fromisoformat(manifest["finished_at"]).timestamp() + 1  # manifests keep whole seconds
        before, after = at(samples, start), at(samples, end)
        work = {k: after[k] - before[k] for k in ("flops", "tokens", "grad_tokens", "ov_tokens", "ov_flops")}
        rows.append({"stage": manifest["stage"], "seconds": float(manifest.get("duration_s") or 0.0), **work})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="a new folder (run, cache, probe samples)")
    parser.add_argument("--without-native-bf16", action="store_true",
                        help="torch held to AVX2 and float32 inference (see quickstart_times.py)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    env, overrides = held_back(args.without_native_bf16, args.overrides)
    peak, threads = matmul_peak(env)
    print(f"peak: {peak:.1f} GFLOP/s (torch float32 matrix products, {threads} threads"
          f"{', held to AVX2' if env else ''})", flush=True)
    manifests, samples = profile(args.recipe, args.out, overrides, env)
    rows = stage_rows(manifests, samples)
    header = (f"{'stage':<26}{'s':>8}{'torch tokens':>14}{'with grad':>11}{'OV tokens':>11}{'GFLOP':>9}"
              f"{'GFLOP/s':>9}{'of peak':>9}")
    print(header)
    for row in [*rows, {"stage": "all stages", **{k: sum(r[k] for r in rows) for k in rows[0] if k != "stage"}}]:
        flops = (row["flops"] + row["ov_flops"]) / 1e9
        rate = flops / row["seconds"] if row["seconds"] else 0.0
        print(f"{row['stage']:<26}{row['seconds']:>8.1f}{row['tokens']:>14,}{row['grad_tokens']:>11,}"
              f"{row['ov_tokens']:>11,}{flops:>9.0f}{rate:>9.1f}{rate / peak:>9.0%}")
    (args.out / "profile.json").write_text(json.dumps({"peak_gflops": peak, "threads": threads, "stages": rows},
                                                      indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
