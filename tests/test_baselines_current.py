"""The committed gate baselines still describe their benchmark recipes: a protocol fingerprint that no longer
matches makes the gate STALE (exit 4) at the end of a 7-minute run; this finds it in milliseconds. The gold
baseline went STALE when ``evaluation.inputs`` joined the recipe schema (its empty default is no new protocol)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("baseline", "recipe"), [("gold", "recipes/bench/gold.yaml"),
                                                  ("best_of_n", "recipes/bench/best_of_n.yaml"),
                                                  ("online_dpo", "recipes/bench/online_dpo.yaml")])
def test_a_committed_baseline_matches_its_recipe_s_protocol(baseline: str, recipe: str):
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import load_recipe
    from alpacafarm_evaluation.bench_baseline import digest, protocol_of

    loaded = load_recipe(REPO / recipe, [], get_registry())
    stored = json.loads((REPO / "benchmarks" / "baselines" / f"{baseline}.json").read_text(encoding="utf-8"))
    protocol = protocol_of(getattr(loaded, "recipe", loaded))
    changed = sorted(k for k in protocol if protocol[k] != stored["protocol"].get(k))
    assert digest(protocol) == stored["fingerprints"]["recipe"], f"{baseline}.json: recipe changed: {changed}"
