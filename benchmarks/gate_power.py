"""Could a finished run's systems be gated? The minimum detectable effect (MDE) a committed baseline of them would
have, against each system's gain over a base system, and how many instructions the issue's rule (MDE at most a
third of the smallest gated effect) would need.

    python benchmarks/gate_power.py RUN --base sft_outputs [--systems best_of_8 ppo_outputs@48 ...]

RUN is a run directory whose ``evaluate`` stage judged the systems (``stages/evaluate/systems/*/annotations.json``).
The MDE is ``alpacafarm bench``'s own estimate (``gate_stats.baseline_power``: a re-run that redraws every output,
alpha shared among the gated systems, power 0.8), computed as ``bench --update-baseline`` would on these systems.
The gain is the paired difference of per-instruction scores (1 win, 0.5 draw, 0 loss; a weighted preference with a
continuous judge). Instructions needed: the MDE shrinks as 1/sqrt(n), so ``n · (MDE / (effect / 3))²`` with the
smallest gain among the gated systems. It prints one line per system and the verdict; it reads, never runs, a stage.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))


def main(argv: list[str] | None = None) -> int:
    from alpacafarm_evaluation.evaluator import instruction_scores
    from alpacafarm_evaluation.gate_stats import baseline_power
    from alpacafarm_evaluation.results import paired_difference

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a run directory with a finished evaluate stage")
    parser.add_argument("--base", required=True, help="the system every gain is read against (e.g. sft_outputs)")
    parser.add_argument("--systems", nargs="+", help="the systems to gate (default: every judged system but --base)")
    args = parser.parse_args(argv)

    judged = args.run / "stages" / "evaluate" / "systems"
    if not judged.is_dir():
        print(f"gate_power: {judged} does not exist: run the recipe's evaluation first", file=sys.stderr)
        return 2
    found = {d.name: d / "annotations.json" for d in sorted(judged.iterdir()) if (d / "annotations.json").is_file()}
    names = [s.replace("/", "__") for s in (args.systems or [n for n in found if n != args.base.replace("/", "__")])]
    missing = [n for n in [args.base.replace("/", "__"), *names] if n not in found]
    if missing:
        print(f"gate_power: no judged system {', '.join(missing)} in {judged} (judged: {', '.join(found)})",
              file=sys.stderr)
        return 2
    scores = {n: instruction_scores(found[n]) for n in names}
    base = instruction_scores(found[args.base.replace("/", "__")])
    gains = {n: paired_difference(scores[n], base) for n in names}
    estimates = {e.system: e for e in baseline_power({**scores, args.base.replace("/", "__"): base})}
    print(f"{'system':34s} {'n':>4s} {'gain ± paired SE':>18s} {'MDE':>6s} {'gain / 3':>8s}")
    for n in names:
        gain, se = gains[n]
        print(f"{n:34s} {estimates[n].n:4d} {gain:+8.1f} ± {se:<7.1f} {estimates[n].mde:6.1f} {gain / 3:8.1f}")
    smallest = min(gains[n][0] for n in names)
    worst = max(estimates[n].mde for n in [*names, args.base.replace("/", "__")])
    n_now = estimates[names[0]].n
    if smallest <= 0:
        print(f"smallest gain {smallest:+.1f} points: nothing to gate against (a gate needs a gain over the base)")
        return 0
    needed = math.ceil(n_now * (worst / (smallest / 3)) ** 2)
    verdict = "met" if worst <= smallest / 3 else f"not met: about {needed} instructions would be needed"
    print(f"largest MDE {worst:.1f} against a third of the smallest gain {smallest / 3:.1f} ({n_now} instructions, "
          f"correlation {estimates[names[0]].correlation:.2f}): {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
