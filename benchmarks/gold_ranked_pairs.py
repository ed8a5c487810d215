"""The gold's own best against its worst answer per instruction, as a preference file a DPO stage can read: the
cleanest pairs a run's samples hold, to tell whether DPO is held back by its labels or by its pairs.

    python benchmarks/gold_ranked_pairs.py RUN/stages/preferences/preferences.jsonl pairs.jsonl \
        [--gold alpacafarm_annotators.gold_head:answer_head]

Reads every distinct answer of each instruction in a ``preference_data`` file (or any file of ``output_1`` /
``output_2`` records), scores them with the gold (no label noise) and writes one pair per instruction, the
highest-scoring answer preferred to the lowest (instructions whose answers all score alike give none). It prints
the number of pairs and their mean gold margin. A recipe reads the file as a data source::

    data: {gold_pairs: {path: pairs.jsonl}}
    stages: [..., {name: dpo, method: dpo, inputs: {preferences: gold_pairs}}]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))


def main(argv: list[str] | None = None) -> int:
    from alpacafarm.data import read_records, write_jsonl
    from alpacafarm.registry import import_target
    from alpacafarm_methods.sampling.reward_pairs import best_and_worst

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preferences", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--gold", default="alpacafarm_annotators.gold_head:answer_head")
    args = parser.parse_args(argv)
    gold = import_target(args.gold, "gold function")

    answers: dict[tuple[str, str], list[str]] = {}
    for record in read_records(args.preferences):
        group = answers.setdefault((record["instruction"], record.get("input") or ""), [])
        group.extend(o for o in (record["output_1"], record["output_2"]) if o not in group)
    keys = [key for key, group in answers.items() for _ in group]
    texts = [text for group in answers.values() for text in group]
    scores = gold([{"instruction": k[0], "input": k[1]} for k in keys], texts)

    scored: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for key, text, score in zip(keys, texts, scores, strict=True):
        scored.setdefault(key, []).append({"output": text, "reward": float(score)})
    pairs, margins = [], []
    for (instruction, input_), group in scored.items():
        ranked = best_and_worst(group)  # the reward_pairs stage's rule, the gold as the reward
        if ranked is not None:
            best, worst = ranked
            pairs.append({"instruction": instruction, "input": input_, "output_1": best["output"],
                          "output_2": worst["output"], "preference": 1, "annotator": "gold"})
            margins.append(best["reward"] - worst["reward"])
    write_jsonl(args.out, pairs)
    print(f"{len(pairs)} pairs from {len(scored)} instructions, mean gold margin "
          f"{sum(margins) / max(len(margins), 1):.3f} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
