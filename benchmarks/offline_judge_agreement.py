"""Agreement of the offline judge with recorded AlpacaEval GPT-4 judgments.

Usage: python benchmarks/offline_judge_agreement.py [--data-dir ../shared/data]
       [--max-instructions N] [--no-reference]

Prints, for the offline judge and the "prefer the longer output" baseline:
 (a) agreement with GPT-4 on all recorded annotation pairs (GPT-4 ties excluded;
     a judge tie counts 0.5),
 (b) balanced accuracy on length-balanced pairs (char lengths within 25%),
     pooled and averaged within each system,
 (c) Spearman correlation of win-rates vs text_davinci_003 (805 instructions)
     with the AlpacaEval GPT-4 leaderboard, for every system with outputs.
Figures are given on all instructions and on the odd-indexed half, which the
judge's weights were NOT fitted on (they were fitted on the even half).
Reference rule: the first of REFERENCE_SYSTEMS that is neither compared system.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins" / "alpacafarm_annotators"))
from offline_judge import OfflineJudge  # noqa: E402

REFERENCE_SYSTEMS = ("gpt4_1106_preview", "gpt4", "gpt4_0314")
BASELINE = "text_davinci_003"  # generator of alpaca_eval.jsonl outputs


def load(data_dir: Path):
    """Return instructions, davinci003 reference outputs, system outputs, annotations."""
    ref_file = data_dir / "stanford-cs336_spring2024-assignment5-alignment/data/alpaca_eval/alpaca_eval.jsonl"
    rows = [json.loads(line) for line in ref_file.read_text().splitlines() if line.strip()]
    davinci = {r["instruction"]: r["output"] or "" for r in rows}
    results = data_dir / "tatsu-lab_alpaca_eval/results"
    outputs = {
        p.parent.name: {r["instruction"]: r["output"] or "" for r in json.loads(p.read_text())}
        for p in sorted(results.glob("*/model_outputs.json"))
    }
    annotations = []  # (system, instruction, output_1, output_2, gpt4 label 1/2/0)
    for p in sorted(results.glob("*/alpaca_eval_gpt4/annotations.json")):
        for r in json.loads(p.read_text()):
            pref = r["preference"]
            label = 1 if pref == 1 else 2 if pref == 2 else 0
            annotations.append(
                (r["generator_2"], r["instruction"], r["output_1"] or "", r["output_2"] or "", label)
            )
    return list(davinci), davinci, outputs, annotations


def pick_reference(instruction: str, compared: set[str], outputs: dict) -> str | None:
    for system in REFERENCE_SYSTEMS:
        if system not in compared and instruction in outputs.get(system, {}):
            return outputs[system][instruction]
    return None


def credit(pred: np.ndarray, label: np.ndarray) -> np.ndarray:
    return np.where(pred == label, 1.0, np.where(pred == 0, 0.5, 0.0))


def balanced_accuracy(pred: np.ndarray, label: np.ndarray) -> float:
    per_class = [credit(pred[label == c], label[label == c]).mean() for c in (1, 2) if (label == c).any()]
    return float(np.mean(per_class)) if per_class else float("nan")


def longer(o1: str, o2: str) -> int:
    return 1 if len(o1) > len(o2) else 2 if len(o2) > len(o1) else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--max-instructions", type=int, default=None, help="use only the first N instructions")
    parser.add_argument("--no-reference", action="store_true", help="skip the with-reference run")
    args = parser.parse_args()

    instructions, davinci, outputs, annotations = load(args.data_dir)
    if args.max_instructions:
        instructions = instructions[: args.max_instructions]
    index = {ins: i for i, ins in enumerate(instructions)}
    annotations = [a for a in annotations if a[1] in index and a[4] != 0]
    judge = OfflineJudge(cache_size=1_000_000)
    # The second (reference-free) run reuses the cached embeddings, so it is cheap.
    for use_ref in ([] if args.no_reference else [True]) + [False]:
        evaluate(judge, use_ref, instructions, index, davinci, outputs, annotations, args.data_dir)


def evaluate(judge, use_ref, instructions, index, davinci, outputs, annotations, data_dir) -> None:
    """Run (a)-(c) for one reference mode and print the tables."""
    print("\n######## " + (f"WITH reference: first of {REFERENCE_SYSTEMS} that is not a compared system"
          if use_ref else "WITHOUT reference (reference-free weights)"))
    t0 = time.perf_counter()
    pairs = [
        (ins, o1, o2, pick_reference(ins, {BASELINE, s}, outputs) if use_ref else None)
        for s, ins, o1, o2, _ in annotations
    ]
    pred = np.array(judge.judge(pairs))
    n_judged = len(pairs)

    label = np.array([a[4] for a in annotations])
    base = np.array([longer(a[2], a[3]) for a in annotations])
    system = np.array([a[0] for a in annotations])
    odd = np.array([index[a[1]] % 2 == 1 for a in annotations])
    lens = np.array([(len(a[2]), len(a[3])) for a in annotations])
    balanced = lens.min(1) >= 0.75 * lens.max(1)

    # (c) win-rates of every system with outputs vs the davinci003 reference outputs.
    leaderboard_csv = data_dir / ("tatsu-lab_alpaca_eval/src/alpaca_eval/leaderboards/data_AlpacaEval/"
                                  "alpaca_eval_gpt4_leaderboard.csv")
    with leaderboard_csv.open() as f:
        leaderboard = {r[""]: float(r["win_rate"]) / 100 for r in csv.DictReader(f)}
    win = {}  # system -> (judge credits, baseline credits, odd mask)
    for s, outs in outputs.items():
        ins_list = [ins for ins in instructions if ins in outs]
        sys_pairs = [
            (ins, davinci[ins], outs[ins], pick_reference(ins, {BASELINE, s}, outputs) if use_ref else None)
            for ins in ins_list
        ]
        p = np.array(judge.judge(sys_pairs))
        b = np.array([longer(davinci[ins], outs[ins]) for ins in ins_list])
        win[s] = (credit(p, 2), credit(b, 2), np.array([index[i] % 2 == 1 for i in ins_list]))
        n_judged += len(sys_pairs)
    elapsed = time.perf_counter() - t0

    def table(mask_pairs: np.ndarray, sys_half: bool, title: str) -> None:
        print(f"\n== {title} ==")
        print(f"{'metric':58s} {'offline':>8s} {'longer':>8s}")
        m = mask_pairs
        print(f"{f'(a) agreement, all pairs (n={m.sum()}, GPT-4 ties excluded)':58s}"
              f" {credit(pred[m], label[m]).mean():8.3f} {credit(base[m], label[m]).mean():8.3f}")
        mb = m & balanced
        print(f"{f'(b) balanced acc., length-balanced pairs pooled (n={mb.sum()})':58s}"
              f" {balanced_accuracy(pred[mb], label[mb]):8.3f} {balanced_accuracy(base[mb], label[mb]):8.3f}")
        per_sys = sorted(set(system[mb]))
        bj = np.mean([balanced_accuracy(pred[mb & (system == s)], label[mb & (system == s)]) for s in per_sys])
        bb = np.mean([balanced_accuracy(base[mb & (system == s)], label[mb & (system == s)]) for s in per_sys])
        print(f"{f'(b) balanced acc., length-balanced, mean within {len(per_sys)} systems':58s} {bj:8.3f} {bb:8.3f}")
        ranked = sorted((s for s in win if s in leaderboard), key=lambda s: -leaderboard[s])
        # Per-system instruction mask: the held-out (odd) half, or everything.
        keep = {s: win[s][2] if sys_half else np.ones_like(win[s][2]) for s in ranked}
        wj = [win[s][0][keep[s]].mean() for s in ranked]
        wb = [win[s][1][keep[s]].mean() for s in ranked]
        gold = [leaderboard[s] for s in ranked]
        print(f"{f'(c) Spearman of win-rates vs GPT-4 leaderboard ({len(ranked)} systems)':58s}"
              f" {spearmanr(wj, gold).statistic:8.3f} {spearmanr(wb, gold).statistic:8.3f}")
        print(f"   {'system':32s} {'leaderboard':>11s} {'offline':>8s} {'longer':>8s}")
        for s, g, j, b in zip(ranked, gold, wj, wb, strict=True):
            print(f"   {s:32s} {g:11.3f} {j:8.3f} {b:8.3f}")
        missing = sorted(s for s in win if s not in leaderboard)
        if missing:
            print(f"   (not in leaderboard, excluded from (c): {', '.join(missing)})")

    table(np.ones(len(label), bool), False, "all instructions")
    table(odd, True, "held-out half (odd-indexed instructions; weights fitted on even half)")
    print(f"\njudge wall time {elapsed:.1f} s for {n_judged} pairs "
          f"({n_judged / elapsed:.1f} pairs/s incl. MiniLM embedding of "
          f"{len(judge._cache)} unique texts so far, CPU; embeddings cached across runs)")


if __name__ == "__main__":
    main()
