"""A scripted team of three for docs/labelling.md's sample report (not people: each 'labeller' picks the longer
side 70% of the time, seeded), on 30 of the bundled demo pairs with the default overlap.

    python tools/label_team_sample.py runs/label-team && alpacafarm label report --dir runs/label-team
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from alpacafarm_validation.label_pairs import read_pairs, sample
from alpacafarm_validation.label_store import LabelStore, Settings

DEMO = Path(__file__).resolve().parents[1] / "plugins" / "alpacafarm_validation" / "data" / "label_demo_pairs.jsonl"


def main(folder: Path) -> None:
    store = LabelStore.create_or_resume(folder, sample(read_pairs(DEMO), 30, seed=0), Settings())
    rng = random.Random(0)
    people = ["ann", "bob", "cleo"]
    done = dict.fromkeys(people, False)
    while not all(done.values()):  # in turns, as a team labelling at once would
        for person in people:
            served = store.next_pair(person)
            if served["done"]:
                done[person] = True
                continue
            longer = "first" if len(served["first"]) >= len(served["second"]) else "second"
            choice = longer if rng.random() < 0.7 else ("second" if longer == "first" else "first")
            store.record(person, served["pair_id"], served["ticket"], choice, "")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
