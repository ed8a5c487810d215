"""How long does README command 1's run take, stage by stage? Runs ``alpacafarm run recipes/quickstart.yaml`` in a
fresh run directory and prints each stage's seconds (from its manifest), the run's wall time and the precision it
chose; with ``--code REF`` it first runs the same recipe on the code of a git ref (a worktree of this checkout, put
first on the import path), so both sides run on this machine, in this sitting, on the same inputs.

``--without-native-bf16`` makes this CPU behave as one without native bfloat16 arithmetic (an AVX2-only EPYC, the
common cloud kind): torch's kernels are held to AVX2 (``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``)
and the recipe's ``bfloat16_if_native`` is answered float32 (``--set model.inference_dtype=float32``, the choice
``alpacafarm.hardware`` makes there). OpenVINO's kernels are not held back (it has no such switch), so sampling
is faster here than on a real AVX2 machine: treat the figure as a lower bound for one.

    python benchmarks/quickstart_times.py --out /tmp/qs-times [--without-native-bf16] [--code HEAD~3] [--set K=V]

The scoring throughput (answers per second, before and after sharing prompts) is ``benchmarks/feature_sharing.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIRS = ("plugins",)


#: What ``--without-native-bf16`` sets (see the module).
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def held_back(without_native_bf16: bool, overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    """The environment and ``--set`` overrides of a run: torch held to AVX2 in float32 when asked, else as is."""
    if not without_native_bf16:
        return {}, list(overrides)
    return dict(AVX2_ENV), [*overrides, "model.inference_dtype=float32"]


def fresh_cache(folder: Path) -> Path:
    """A new, empty cache folder (no annotation, no stored reading, no looks) as on a fresh clone, linking the
    machine's converted models and OpenVINO exports (README command 1 times those; these programs time a run)."""
    from alpacafarm.paths import cache_dir

    folder.mkdir(parents=True)
    for reused in ("models", "openvino"):
        if (cache_dir() / reused).is_dir():
            (folder / reused).symlink_to(cache_dir() / reused)
    return folder


def run(out: Path, overrides: list[str], env: dict[str, str], code: Path | None) -> tuple[float, dict[str, float]]:
    """One run of the quickstart into ``out`` (which must not exist); its wall seconds and each stage's."""
    if out.exists():
        raise SystemExit(f"quickstart_times: {out} exists; give a new --out (a run directory resumes, which would "
                         "time nothing)")
    command = [sys.executable, "-m", "alpacafarm", "run", str((code or ROOT) / "recipes" / "quickstart.yaml"),
               "--output-dir", str(out)]
    for override in overrides:
        command += ["--set", override]
    environment = dict(os.environ, **env, ALPACAFARM_CACHE_DIR=str(fresh_cache(out.with_name(out.name + "-cache"))))
    if code is not None:  # the worktree's packages before this checkout's editable install
        paths = [str(code), *(str(code / d) for d in PLUGIN_DIRS)]
        environment["PYTHONPATH"] = os.pathsep.join([*paths, environment.get("PYTHONPATH", "")])
    if code is not None:  # refuse to time a mix of both checkouts' code
        probe = "import alpacafarm, alpacafarm_annotators; print(alpacafarm.__file__, alpacafarm_annotators.__file__)"
        found = subprocess.run([sys.executable, "-c", probe], env=environment, cwd=code, capture_output=True,
                               text=True).stdout.split()
        if len(found) != 2 or not all(Path(f).resolve().is_relative_to(code.resolve()) for f in found):
            raise SystemExit(f"quickstart_times: --code: the run would import {found or 'nothing'}, not {code}'s")
    started = time.perf_counter()
    done = subprocess.run(command, env=environment, cwd=code or ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"quickstart_times: the run into {out} failed (exit {done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    precision = next((line for line in done.stderr.splitlines() if line.startswith("precision:")), "")
    if precision:
        print(f"  {precision}")
    stages = {}
    for manifest in sorted((out / "stages").glob("*/manifest.json")):
        record = json.loads(manifest.read_text(encoding="utf-8"))
        stages[record["stage"]] = float(record.get("duration_s") or 0.0)
    return wall, stages


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="a new folder; the runs go under it")
    parser.add_argument("--without-native-bf16", action="store_true",
                        help="torch held to AVX2 and float32 inference (see the module)")
    parser.add_argument("--code", help="also run the recipe on this git ref's code first (before)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)

    env, overrides = held_back(args.without_native_bf16, args.overrides)
    sides: list[tuple[str, Path | None]] = [("now", None)]
    if args.code:
        worktree = args.out / "code-before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.code],
                       check=True, capture_output=True)
        sides.insert(0, (f"before ({args.code})", worktree))
    results = {}
    try:
        for name, code in sides:
            print(f"{name}: running the quickstart ...", flush=True)
            results[name] = run(args.out / name.split()[0], overrides, env, code)
    finally:
        if args.code:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(args.out / "code-before")],
                           capture_output=True)
    names = list(results)
    stages = list(dict.fromkeys(s for _, per in results.values() for s in per))
    print(f"{'stage':<26}" + "".join(f"{n:>22}" for n in names))
    for stage in stages:
        print(f"{stage:<26}" + "".join(f"{results[n][1].get(stage, float('nan')):>21.1f}s" for n in names))
    print(f"{'wall (the whole command)':<26}" + "".join(f"{results[n][0]:>21.1f}s" for n in names))


if __name__ == "__main__":
    main()
