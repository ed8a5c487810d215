"""Could a finished run's systems be gated? The minimum detectable effect (MDE) a committed baseline of them would
have, against each system's gain over a base system, and how many instructions the issue's rule (MDE at most a
third of the smallest gated effect) would need.

    python benchmarks/gate_power.py RUN --base sft_outputs [--systems best_of_8 ppo_outputs@48 ...]

RUN is a run directory whose ``evaluate`` stage finished; its systems and their judged pairs are read from that
stage's recorded hand-off (``manifest.json``: the systems' annotations), as ``alpacafarm bench`` reads them, and
scored as bench scores them (``outcomes_of``: 1 win, 0.5 tie, 0 loss; a weighted preference with a continuous
judge). The MDE is bench's own estimate (``gate_stats.baseline_power``: a re-run that redraws every output, alpha
shared among the gated systems, power 0.8), as ``bench --update-baseline`` would print it for these systems. The
gain is the paired difference to the base. Instructions needed: the MDE shrinks as 1/sqrt(n), so
``n · (MDE / (gain / 3))²`` with the smallest gain and the largest MDE. It prints one line per system and the
verdict; it reads, never runs, a stage. A run directory without a finished evaluation, or a system it did not
judge, is named on one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))


def judged_scores(run: Path) -> dict[str, dict[str, float]]:
    """Per-instruction scores of every system the run's finished evaluation judged, as bench reads and scores them."""
    from alpacafarm.artifacts import Artifact
    from alpacafarm.errors import UserError
    from alpacafarm_evaluation.bench import EVALUATION_STAGE, judged_records
    from alpacafarm_evaluation.bench_baseline import outcomes_of

    manifest_path = run / "stages" / EVALUATION_STAGE / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8")) if manifest_path.is_file() else None
    if manifest is None or manifest.get("status") != "complete":
        state = "missing" if manifest is None else f"status {manifest.get('status')!r}"
        raise UserError(f"{manifest_path} is {state}: run the recipe's evaluation to the end first")
    artifact = Artifact.from_json(manifest["artifact"], run)
    return {name: outcomes_of(name, rows).scores for name, rows in judged_records(artifact).items()}


def main(argv: list[str] | None = None) -> int:
    from alpacafarm.errors import UserError
    from alpacafarm_evaluation.gate_stats import baseline_power
    from alpacafarm_evaluation.results import paired_difference

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a run directory with a finished evaluate stage")
    parser.add_argument("--base", required=True, help="the system every gain is read against (e.g. sft_outputs)")
    parser.add_argument("--systems", nargs="+", help="the systems to gate (default: every judged system but --base)")
    args = parser.parse_args(argv)

    try:
        scores = judged_scores(args.run)
    except UserError as e:
        print(f"gate_power: {e}", file=sys.stderr)
        return 2
    names = args.systems or [n for n in scores if n != args.base]
    missing = [n for n in [args.base, *names] if n not in scores]
    if missing:
        print(f"gate_power: no judged system {', '.join(missing)} in {args.run} (judged: {', '.join(scores)})",
              file=sys.stderr)
        return 2
    gated = {n: scores[n] for n in [args.base, *names]}
    gains = {n: paired_difference(scores[n], scores[args.base]) for n in names}
    estimates = {e.system: e for e in baseline_power(gated)}
    print(f"{'system':34s} {'n':>4s} {'gain ± paired SE':>18s} {'MDE':>6s} {'gain / 3':>8s}")
    for n in names:
        gain, se = gains[n]
        print(f"{n:34s} {estimates[n].n:4d} {gain:+8.1f} ± {se:<7.1f} {estimates[n].mde:6.1f} {gain / 3:8.1f}")
    smallest = min(gain for gain, _ in gains.values())
    worst = max(e.mde for e in estimates.values())
    n_now = min(e.n for e in estimates.values())
    if smallest <= 0:
        print(f"smallest gain {smallest:+.1f} points: nothing to gate against (a gate needs a gain over the base)")
        return 0
    needed = math.ceil(n_now * (worst / (smallest / 3)) ** 2)
    verdict = "met" if worst <= smallest / 3 else f"not met: about {needed} instructions would be needed"
    print(f"largest MDE {worst:.1f} against a third of the smallest gain {smallest / 3:.1f} ({n_now} instructions, "
          f"correlation {estimates[args.base].correlation:.2f}): {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
