"""The validation plugin: rank correlations (paper Table 2 / Figure 3) and annotator agreement, bias, variance."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli
from scipy import stats

from alpacafarm import cli
from alpacafarm.errors import UserError
from alpacafarm_validation.agreement import AgreementConfig, AgreementValidator, measure, mode, self_variance
from alpacafarm_validation.correlations import (
    PAPER_TABLE2,
    RankCorrelationConfig,
    RankCorrelationValidator,
    _kendall_b,
    correlate,
    plot,
)

TRAINED = {"PPO", "Best-of-1024", "Expert Iteration", "SFT 52k", "SFT 10k", "Binary FeedME"}


def read_table2() -> list[dict[str, str]]:
    with PAPER_TABLE2.open(encoding="utf-8", newline="") as fh:
        return list(csv.DictReader(fh))


def write_csv(path: Path, rows: list[dict[str, object]]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The real ``alpacafarm`` CLI, in this process (cheaper than a subprocess)."""
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- Table 2 / Figure 3 -----------------------------------------------------------------------------------------


#: The reference copy of the paper's Table 2 beside the repository (``../shared/data``, see its SOURCES.md).
SHARED_TABLE2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "alpacafarm_paper" / "table2.csv"


def test_shipped_table2_is_the_papers() -> None:
    rows = read_table2()
    assert len(rows) == 13 and {r["system"] for r in rows} >= TRAINED


@pytest.mark.skipif(not SHARED_TABLE2.is_file(), reason=f"no reference data beside the repository: {SHARED_TABLE2}")
def test_shipped_table2_is_byte_identical_to_the_reference_copy() -> None:
    assert PAPER_TABLE2.read_bytes() == SHARED_TABLE2.read_bytes()


def test_table2_through_the_real_cli() -> None:
    result = run_cli("compare", str(PAPER_TABLE2), "--x", "simulated", "--y", "human", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert round(out["spearman"], 2) == 0.98  # paper §4.2
    assert (out["n"], out["n_skipped"]) == (10, 3)
    assert set(out["skipped"]) == {"DPO", "Quark", "Binary Reward Conditioning"}
    # the paper's two rank mismatches: ChatGPT vs PPO, SFT 52k vs SFT 10k
    assert {m["name"] for m in out["mismatches"]} == {"ChatGPT", "PPO", "SFT 52k", "SFT 10k"}
    for metric in ("spearman", "pearson", "kendall", "r2", "slope"):
        lo, hi = out["intervals"][metric]
        assert lo <= out[metric] <= hi

    trained = run_cli("compare", str(PAPER_TABLE2), "--x", "simulated", "--y", "human", "--json",
                      "--filter", "trained_by_authors=1")
    assert trained.returncode == 0, trained.stderr
    out = json.loads(trained.stdout)
    assert (round(out["spearman"], 2), round(out["r2"], 2)) == (0.94, 0.83)
    assert (out["n"], out["n_skipped"]) == (6, 3)


def test_table2_in_process() -> None:
    everything = correlate(read_table2(), RankCorrelationConfig(x="simulated", y="human", n_bootstrap=0))
    assert round(everything.spearman, 2) == 0.98 and everything.n == 10 and everything.n_skipped == 3
    trained_rows = [r for r in read_table2() if r["system"] in TRAINED]
    trained = RankCorrelationValidator(RankCorrelationConfig(x="simulated", y="human", n_bootstrap=200)).validate(
        trained_rows)
    assert (round(trained.spearman, 2), round(trained.r2, 2), trained.n) == (0.94, 0.83, 6)
    # same selection through the filter, on the full table
    filtered = correlate(read_table2(), RankCorrelationConfig(x="simulated", y="human", n_bootstrap=0,
                                                              filters={"trained_by_authors": "1"}))
    assert filtered.names == trained.names and filtered.n_skipped == 3


# --- correlations -------------------------------------------------------------------------------------------------


def random_table(n: int, seed: int) -> list[dict[str, object]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(50, 10, n)
    y = 0.8 * x + rng.normal(0, 6, n)
    return [{"system": f"s{i}", "a": float(a), "b": float(b)} for i, (a, b) in enumerate(zip(x, y, strict=True))]


def test_correlations_equal_scipy_on_random_data() -> None:
    rows = random_table(25, seed=3)
    x = np.array([r["a"] for r in rows])
    y = np.array([r["b"] for r in rows])
    result = correlate(rows, RankCorrelationConfig(x="a", y="b", n_bootstrap=0))
    assert result.spearman == pytest.approx(stats.spearmanr(x, y).statistic)
    assert result.pearson == pytest.approx(stats.pearsonr(x, y).statistic)
    assert result.kendall == pytest.approx(stats.kendalltau(x, y).statistic)
    slope, intercept = np.polyfit(x, y, 1)
    assert (result.slope, result.intercept) == (pytest.approx(slope), pytest.approx(intercept))
    # R² of the least-squares line = 1 - SSE/SST = Pearson²
    sse = float(((y - (slope * x + intercept)) ** 2).sum())
    sst = float(((y - y.mean()) ** 2).sum())
    assert result.r2 == pytest.approx(1 - sse / sst) == pytest.approx(result.pearson ** 2)


def test_vectorised_kendall_matches_scipy_with_ties() -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, size=(50, 9)).astype(float)  # many ties, as in bootstrap resamples
    y = x + rng.integers(0, 3, size=(50, 9))
    ok = (np.ptp(x, axis=1) > 0) & (np.ptp(y, axis=1) > 0)
    expected = [stats.kendalltau(a, b, variant="b").statistic for a, b in zip(x[ok], y[ok], strict=True)]
    assert _kendall_b(x[ok], y[ok]) == pytest.approx(expected)


def test_bootstrap_intervals_contain_estimate_and_are_seeded() -> None:
    rows = random_table(30, seed=1)
    config = RankCorrelationConfig(x="a", y="b", n_bootstrap=2000, seed=7)
    first, again = correlate(rows, config), correlate(rows, config)
    other = correlate(rows, config.model_copy(update={"seed": 8}))
    assert first.intervals == again.intervals and first.intervals != other.intervals
    assert first.n_bootstrap_used == 2000
    for metric, (lo, hi) in first.intervals.items():
        assert lo < getattr(first, metric) < hi, metric


def test_bootstrap_skips_degenerate_resamples() -> None:
    rows = [{"system": "a", "x": 1, "y": 1}, {"system": "b", "x": 2, "y": 3}, {"system": "c", "x": 3, "y": 2}]
    result = correlate(rows, RankCorrelationConfig(x="x", y="y", n_bootstrap=500, seed=0))
    # 3 systems: 3 of the 27 equally likely resamples repeat one system (constant x): ~1/9 are skipped
    assert 0 < 500 - result.n_bootstrap_used < 100
    assert all(np.isfinite(v).all() for v in result.intervals.values())


def test_rank_mismatches_and_skipped_rows() -> None:
    rows = [
        {"system": "A", "sim": 40, "human": 50},
        {"system": "B", "sim": 30, "human": 20},  # rank 2 by sim, 3 by human
        {"system": "C", "sim": 20, "human": 25},  # rank 3 by sim, 2 by human
        {"system": "D", "sim": 10, "human": 5},
        {"system": "E", "sim": 35, "human": ""},  # no human number: skipped, counted
        {"system": "F", "sim": None, "human": 7},
    ]
    result = correlate(rows, RankCorrelationConfig(x="sim", y="human", n_bootstrap=0))
    assert result.names == ["A", "B", "C", "D"] and (result.n_skipped, result.skipped) == (2, ["E", "F"])
    assert [(m["name"], m["rank_x"], m["rank_y"]) for m in result.mismatches] == [("B", 2, 3), ("C", 3, 2)]
    # d² = 1 + 1 -> Spearman = 1 - 6·2 / (4·15) = 0.8
    assert result.spearman == pytest.approx(0.8)


def test_plot_writes_a_readable_png(tmp_path: Path) -> None:
    import matplotlib.image

    result = correlate(read_table2(), RankCorrelationConfig(x="simulated", y="human", n_bootstrap=0))
    path = plot(result, tmp_path / "figs" / "figure3.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_cli_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "fig.png"
    code, _, err = in_process(capsys, "compare", "paper", "--x", "simulated", "--y", "human", "--plot", str(png),
                              "--n-bootstrap", "100")
    assert code == 0 and "spearman" in err and "SFT 10k" in err  # rich prints tables on stderr
    assert png.read_bytes()[:4] == b"\x89PNG"


# --- errors -------------------------------------------------------------------------------------------------------


def test_cli_missing_column_exits_2_listing_columns() -> None:
    result = run_cli("compare", str(PAPER_TABLE2), "--x", "simulated", "--y", "humans")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:")
    assert "'humans'" in lines[0] and "'human'" in lines[0] and "'trained_by_authors'" in lines[0]


@pytest.mark.parametrize(("rows", "args", "culprit"), [
    ([{"system": "a", "x": "1", "y": "high"}], ["--x", "x", "--y", "y"], "'high'"),
    ([{"system": "a", "x": 1, "y": 2}, {"system": "b", "x": 2, "y": 1}], ["--x", "x", "--y", "y"], "at least 3 rows"),
    ([{"system": s, "x": 1, "y": i} for i, s in enumerate("abc")], ["--x", "x", "--y", "y"], "'x' is constant"),
    ([{"system": "a", "x": 1, "y": 2}], ["--x", "x", "--y", "y", "--filter", "kind=1"], "'kind'"),
    ([{"system": "a", "x": 1, "y": 2}], ["--x", "x", "--y", "y", "--filter", "kind"], "COLUMN=VALUE"),
])
def test_cli_table_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], rows, args, culprit) -> None:
    table = write_csv(tmp_path / "t.csv", rows)
    code, out, err = in_process(capsys, "compare", str(table), *args)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error:") and culprit in lines[0]


def test_cli_missing_files_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = in_process(capsys, "compare", str(tmp_path / "none.csv"), "--x", "a", "--y", "b")
    assert code == 2 and err.count("\n") == 1 and "none.csv" in err
    code, _, err = in_process(capsys, "compare", str(tmp_path / "humans.json"), "--agreement")
    assert code == 2 and err.count("\n") == 1 and "humans.json" in err


# --- agreement, bias, variance ------------------------------------------------------------------------------------


def rec(instruction: str, out1: str, out2: str, *labels: object) -> list[dict[str, object]]:
    return [{"instruction": instruction, "output_1": out1, "output_2": out2, "preference": p, "annotator_index": i}
            for i, p in enumerate(labels)]


# Pair A: output_2 is the longer one; pair B: output_1 is the longer one.
PAIR_A = ("A", "short", "much longer")
PAIR_B = ("B", "a longer output", "tiny")
HUMANS = [
    *rec(*PAIR_A, 1, 1, 1, 2),
    *rec(*PAIR_B, 2, 2, 2, 1),
    *rec("C", "x", "y", 1, None),  # one label left (the null is counted as missing): not scorable
]
ANNOTATOR = [*rec(*PAIR_A, 1, 1, 1, 2), *rec(*PAIR_B, 1, 1, 1, 1), *rec("unmatched", "p", "q", 2)]


def test_agreement_bias_variance_by_hand() -> None:
    result = AgreementValidator(AgreementConfig(seed=0)).validate(HUMANS, ANNOTATOR)
    humans, annotator = result.humans, result.annotator
    assert annotator is not None
    # humans, leave-one-out. A = [1,1,1,2]: the three 1s face the majority of [1,1,2] = 1 (agree), the 2 faces
    # [1,1,1] = 1 (disagree): 3/4. B = [2,2,2,1] likewise 3/4. Agreement (3/4 + 3/4)/2 = 0.75; variance 0.25.
    assert humans["agreement"] == pytest.approx(0.75)
    assert (humans["variance"], humans["bias"]) == (pytest.approx(0.25), 0.0)
    # P(longer), humans: A picks the longer (2) once of 4, B picks the longer (1) once of 4: 2/8
    # P(first), humans: A has three 1s, B one 1: 4/8
    assert (humans["p_prefer_longer"], humans["p_prefer_first"]) == (0.25, 0.5)
    # annotator vs held-out human majorities: on A every majority of 3 humans is 1 and the annotator's labels
    # [1,1,1,2] agree 3 times of 4; on B every majority is 2 and its labels [1,1,1,1] never agree: (3/4 + 0)/2
    assert annotator["agreement"] == pytest.approx(0.375)
    # bias: annotator mode vs human mode: A 1 vs 1 (0), B 1 vs 2 (1): (0 + 1)/2
    assert annotator["bias"] == pytest.approx(0.5)
    # variance: A [1,1,1,2] one vs rest errs once of 4 (0.25); B [1,1,1,1] never (0): (0.25 + 0)/2
    assert annotator["variance"] == pytest.approx(0.125)
    # P(longer): A's single 2 and all four 1s of B pick the longer output: 5/8; P(first): 3 + 4 of 8
    assert (annotator["p_prefer_longer"], annotator["p_prefer_first"]) == (0.625, 0.875)
    assert result.counts == {"pairs": 2, "human_labels": 8, "human_missing": 1, "pairs_single_label": 1,
                             "annotator_labels": 8, "annotator_missing": 0, "annotator_repeats": 0,
                             "annotator_pairs_matched": 2,
                             "annotator_pairs_unmatched": 1, "human_pairs_unlabelled": 0}


def test_single_label_annotator_has_no_variance_and_bias_is_its_disagreement() -> None:
    one_each = [*rec(*PAIR_A, 2), *rec(*PAIR_B, 2)]
    annotator = measure(HUMANS, AgreementConfig(), one_each).annotator
    assert annotator is not None and annotator["variance"] is None
    # A: label 2 vs human majorities 1 -> 0; B: label 2 vs majorities 2 -> 1: agreement 1/2, bias 1/2
    assert (annotator["agreement"], annotator["bias"]) == (0.5, 0.5)


def test_held_out_reference_versus_all_humans() -> None:
    humans = rec("split", "o1", "o2", 1, 1, 2, 2)
    labels = rec("split", "o1", "o2", 1)
    # held out: leaving out a 1 leaves [1,2,2] -> 2 (disagree), leaving out a 2 leaves [1,1,2] -> 1 (agree):
    # 2 of 4 majorities agree -> exactly 0.5, no tie-break involved
    assert measure(humans, AgreementConfig(), labels).annotator["agreement"] == 0.5
    # all 4 humans: a 2-2 split, broken at random: the agreement is 0 or 1 and the same on every call
    outcomes = {measure(humans, AgreementConfig(reference="all", seed=s), labels).annotator["agreement"]
                for s in range(20)}
    assert outcomes == {0.0, 1.0}
    once = measure(humans, AgreementConfig(reference="all", seed=3), labels).annotator
    assert once == measure(humans, AgreementConfig(reference="all", seed=3), labels).annotator
    assert once["bias"] == 1 - once["agreement"]  # bias uses the same (tie-broken) human mode


def test_seeded_tie_break() -> None:
    # 600 pairs labelled [1, 1, 2]: each 1 faces the others [1, 2], a tie broken at random (agree with p = 1/2);
    # the 2 faces [1, 1] and disagrees. Per pair (t0 + t1 + 0)/3, expected (1/2 + 1/2)/3 = 1/3, sd ~ 0.01.
    records = [r for i in range(600) for r in rec(f"q{i}", "o1", "o2", 1, 1, 2)]
    first = measure(records, AgreementConfig(seed=0)).humans["agreement"]
    assert first == pytest.approx(1 / 3, abs=0.05)
    assert measure(records, AgreementConfig(seed=0)).humans["agreement"] == first
    assert measure(records, AgreementConfig(seed=1)).humans["agreement"] != first
    # keyed by pair, not by position: shuffling the pairs changes nothing (each pair keeps its label order,
    # since a label's index within its pair is part of the tie key)
    by_pair: dict[str, list[dict[str, object]]] = {}
    for r in records:
        by_pair.setdefault(str(r["instruction"]), []).append(r)
    keys = list(by_pair)
    random.Random(5).shuffle(keys)
    reordered = [r for k in keys for r in by_pair[k]]
    assert measure(reordered, AgreementConfig(seed=0)).humans["agreement"] == first
    assert mode([1.0, 2.0], "k") == mode([1.0, 2.0], "k") and mode([1.0, 1.0, 2.0], "k") == 1.0


def test_tie_labels_score_half_and_length_ties_are_skipped() -> None:
    # [1, 0]: the 1 faces a tie (1.5) and the tie faces a 1: |1 - 1.5| = 0.5 each -> agreement 0.5
    records = rec("t", "same", "SAME", 1, 0)
    result = measure(records, AgreementConfig())
    assert result.humans["agreement"] == 0.5
    # equal lengths: no label counts for P(longer); P(first) counts the tie as one half: (1 + 0.5)/2
    assert (result.humans["p_prefer_longer"], result.humans["p_prefer_first"]) == (None, 0.75)
    # lengths 4 vs 6 differ by 2: counted with margin 0 (the 2 picks the longer), skipped with margin 2
    records = rec("m", "four", "sixsix", 2, 2)
    assert measure(records, AgreementConfig()).humans["p_prefer_longer"] == 1.0
    assert measure(records, AgreementConfig(length_margin=2)).humans["n_length_decided"] == 0


def test_agreement_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    humans = tmp_path / "humans.json"
    humans.write_text(json.dumps(HUMANS))
    labels = tmp_path / "sim.jsonl"
    labels.write_text("".join(json.dumps(r) + "\n" for r in ANNOTATOR))
    # the core CLI cannot forward an option as a plugin command's first word; the positional form works
    code, out, _ = in_process(capsys, "compare", str(humans), "--agreement", "--annotator-labels", str(labels),
                              "--json")
    assert code == 0
    data = json.loads(out)
    assert data["humans"]["agreement"] == 0.75 and data["annotator"]["variance"] == 0.125
    from alpacafarm_validation.cli import main as compare_main

    assert compare_main(["--agreement", str(humans), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["annotator"] is None
    code, _, err = in_process(capsys, "compare", "--", "--agreement", str(humans))
    assert code == 0 and "humans" in err and "0.750" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"instruction": "a", "output_1": "b", "preference": 1}]))
    code, _, err = in_process(capsys, "compare", str(bad), "--agreement")
    assert code == 2 and err.count("\n") == 1 and "'output_2'" in err and "bad.json" in err
    with pytest.raises(UserError, match="preference must be"):
        measure(rec("a", "b", "c", 1, 3), AgreementConfig())


# --- variance from replicate annotations (alpacafarm annotate --replicates K) -----------------------------------


def replicates(instruction: str, out1: str, out2: str, *labels: object) -> list[dict[str, object]]:
    return [{"instruction": instruction, "output_1": out1, "output_2": out2, "preference": p, "replicate": k}
            for k, p in enumerate(labels)]


# A: 4 replicates, plus a record repeating replicate 0 (a pair given twice to annotate: the same annotation);
# B: 2 replicates; C: one label only.
REPLICATES = [*replicates(*PAIR_A, 1, 1, 2, 1), replicates(*PAIR_A, 1)[0], *replicates(*PAIR_B, 2, 2),
              *replicates("C", "x", "y", 1)]


def test_variance_from_replicates_by_hand() -> None:
    result = self_variance(REPLICATES, AgreementConfig())
    # A [1,1,2,1]: each 1 faces the majority of [1,2,1] or [1,1,2] = 1 (agree), the 2 faces [1,1,1] (disagree): 3/4.
    # B [2,2]: each faces the other: 1. Self-agreement (3/4 + 1)/2 = 7/8, variance 1/8. (Had the repeated record
    # been counted, A = [1,1,2,1,1] would agree 4/5 and the variance would read 0.1.)
    assert result["variance"] == pytest.approx(0.125)
    assert (result["pairs"], result["n_labels"], result["labels_per_pair"]) == (2, 6, 3.0)
    assert (result["pairs_single_label"], result["repeats"], result["missing"]) == (1, 1, 0)
    # two replicates per pair: the variance is the share of pairs whose two annotations disagree (2 of 4)
    two = [*replicates("p", "a", "b", 1, 2), *replicates("q", "a", "b", 1, 1), *replicates("r", "a", "b", 2, 2),
           *replicates("s", "a", "b", 2, 1)]
    assert self_variance(two, AgreementConfig())["variance"] == 0.5
    # a deterministic annotator's replicates are all equal: variance 0
    assert self_variance(replicates("p", "a", "b", 2, 2, 2, 2), AgreementConfig())["variance"] == 0.0
    with pytest.raises(UserError, match="--replicates K"):
        self_variance([*replicates("p", "a", "b", 1), *replicates("q", "a", "b", 2)], AgreementConfig())


def test_annotator_variance_against_humans_uses_one_label_per_replicate() -> None:
    annotator = measure(HUMANS, AgreementConfig(), REPLICATES)
    assert annotator.annotator is not None and annotator.annotator["variance"] == pytest.approx(0.125)
    assert annotator.counts["annotator_repeats"] == 1 and annotator.counts["annotator_labels"] == 6
    # records without a replicate field (e.g. several annotators' labels) are all kept, as before
    plain = [{k: v for k, v in r.items() if k != "replicate"} for r in REPLICATES]
    assert measure(HUMANS, AgreementConfig(), plain).counts["annotator_labels"] == 7


def test_variance_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    labels = tmp_path / "sim.json"
    labels.write_text(json.dumps(REPLICATES))
    code, out, _ = in_process(capsys, "compare", str(labels), "--variance", "--json")
    assert code == 0 and json.loads(out)["variance"] == 0.125
    code, _, err = in_process(capsys, "compare", "--", "--variance", str(labels))
    assert code == 0 and "0.125" in err and "variance" in err
    code, _, err = in_process(capsys, "compare", str(labels), "--variance", "--x", "a")
    assert code == 2 and "--variance takes the annotator's labels file only" in err
    from alpacafarm_validation.cli import main as compare_main

    with pytest.raises(SystemExit):
        compare_main(["--help"])
    assert "--replicates 4" in capsys.readouterr().out  # the help says how to measure a variance
