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
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))


def main(argv: list[str] | None = None) -> int:
    from alpacafarm.registry import import_target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preferences", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--gold", default="alpacafarm_annotators.gold_head:answer_head")
    args = parser.parse_args(argv)
    gold = import_target(args.gold, "gold function")

    answers: dict[tuple[str, str], list[str]] = {}
    for line in args.preferences.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        group = answers.setdefault((record["instruction"], record.get("input") or ""), [])
        group.extend(o for o in (record["output_1"], record["output_2"]) if o not in group)
    keys = [key for key, group in answers.items() for _ in group]
    texts = [text for group in answers.values() for text in group]
    scores = gold([{"instruction": k[0], "input": k[1]} for k in keys], texts)

    scored: dict[tuple[str, str], list[tuple[float, str]]] = {}
    for key, text, score in zip(keys, texts, scores, strict=True):
        scored.setdefault(key, []).append((float(score), text))
    pairs, margins = [], []
    for (instruction, input_), group in scored.items():
        (low, worst), (high, best) = min(group), max(group)
        if high > low:
            pairs.append({"instruction": instruction, "input": input_, "output_1": best, "output_2": worst,
                          "preference": 1, "annotator": "gold"})
            margins.append(high - low)
    args.out.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    print(f"{len(pairs)} pairs from {len(scored)} instructions, mean gold margin "
          f"{sum(margins) / max(len(margins), 1):.3f} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
