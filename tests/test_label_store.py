"""The labelling session's store, sampling and report (issue 39), without a server: what the page relies on."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import pytest

from alpacafarm import cli
from alpacafarm.errors import UserError
from alpacafarm_validation.label_cli import export_records
from alpacafarm_validation.label_pairs import LabelPair, pairs_from_outputs, read_pairs, sample
from alpacafarm_validation.label_report import build_report, cohen_kappa
from alpacafarm_validation.label_store import LabelRejected, LabelStore, Settings, preference_of

DEMO = Path(__file__).resolve().parents[1] / "plugins" / "alpacafarm_validation" / "data" / "label_demo_pairs.jsonl"


def make_pairs(n: int, systems: tuple[str, ...] = ("a", "b", "c")) -> list[LabelPair]:
    return [LabelPair(f"instruction {i}", "", f"reference answer {i}", f"answer {i} of {systems[i % len(systems)]}"
                      + " longer" * (i % 3), "ref", systems[i % len(systems)]) for i in range(n)]


def label_all(store: LabelStore, labeller: str, choose) -> list[str]:
    """Label everything the store offers ``labeller``; returns the pair ids in the order they were served."""
    seen = []
    while not (served := store.next_pair(labeller))["done"]:
        seen.append(served["pair_id"])
        store.record(labeller, served["pair_id"], served["ticket"], choose(served), "")
    return seen


def test_sampling_gives_every_comparison_the_same_share() -> None:
    pairs = read_pairs(DEMO)
    assert len(pairs) == 40
    chosen = sample(pairs, 30, seed=0)
    shares = Counter(p.generator_2 for p in chosen)
    assert len(shares) == 4 and max(shares.values()) - min(shares.values()) <= 1
    assert [p.id for p in chosen] == [p.id for p in sample(pairs, 30, seed=0)]  # seeded
    assert [p.id for p in chosen] != [p.id for p in sample(pairs, 30, seed=1)]


def test_outputs_files_give_system_vs_reference_and_system_vs_system(tmp_path: Path) -> None:
    for name in ("sys_a", "sys_b"):
        rows = [{"instruction": f"q{i}", "input": "", "output": f"{name} says {i}", "reference": f"ref {i}"}
                for i in range(4)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    pairs = pairs_from_outputs([tmp_path / "sys_a.jsonl", tmp_path / "sys_b.jsonl"])
    assert Counter(p.group for p in pairs) == {("reference", "sys_a"): 4, ("reference", "sys_b"): 4,
                                               ("sys_a", "sys_b"): 4}
    assert Counter(p.group for p in sample(pairs, 6, 0)) == {("reference", "sys_a"): 2, ("reference", "sys_b"): 2,
                                                             ("sys_a", "sys_b"): 2}


def test_each_labeller_gets_overlap_plus_a_share_never_a_pair_twice(tmp_path: Path) -> None:
    pairs = make_pairs(20)
    store = LabelStore.create_or_resume(tmp_path, pairs, Settings(seed=3, overlap=0.2))
    overlap = {p["id"] for p in store.pairs() if p["overlap"]}
    assert len(overlap) == 4
    first = label_all(store, "ann", lambda s: "first")
    assert len(first) == len(set(first)) == 20  # alone, ann gets everything
    second = label_all(store, "bob", lambda s: "second")
    assert set(second) == overlap  # the others are labelled already: bob gets the overlap only
    labels = store.labels()
    assert len(labels) == 24 and len({(r["labeller"], r["pair_id"]) for r in labels}) == 24


def test_sides_are_randomised_per_labeller_and_mapped_back(tmp_path: Path) -> None:
    pairs = make_pairs(30)
    store = LabelStore.create_or_resume(tmp_path, pairs, Settings(overlap=1.0))
    by_id = {p.id: p for p in pairs}
    for who in ("ann", "bob"):
        # always pick the answer that is the reference (output_1), whichever side it is shown on
        label_all(store, who, lambda s: "first" if by_id[s["pair_id"]].output_1 == s["first"] else "second")
    rows = store.labels()
    assert {r["preference"] for r in rows} == {1}
    swapped = {(r["labeller"], r["pair_id"]): r["swapped"] for r in rows}
    assert 0.25 < sum(swapped.values()) / len(swapped) < 0.75
    assert any(swapped[("ann", i)] != swapped[("bob", i)] for i in by_id)
    assert preference_of("first", True) == 2 and preference_of("second", True) == 1
    assert preference_of("tie", False) == 0 and preference_of("skip", True) is None


def test_a_reload_serves_the_same_pair_and_bad_requests_change_nothing(tmp_path: Path) -> None:
    store = LabelStore.create_or_resume(tmp_path, make_pairs(5), Settings())
    served = store.next_pair("ann")
    assert store.next_pair("ann")["pair_id"] == served["pair_id"]  # reload: same pair, same ticket
    assert store.next_pair("ann")["ticket"] == served["ticket"]
    cases = [(("ann", "0" * 16, served["ticket"], "first"), 404),  # unknown pair
             (("ann", served["pair_id"], "forged-ticket", "first"), 403),  # forged ticket
             (("bob", served["pair_id"], served["ticket"], "first"), 403),  # someone else's ticket
             (("ann", served["pair_id"], served["ticket"], "best"), 400)]  # no such choice
    for args, status in cases:
        with pytest.raises(LabelRejected) as caught:
            store.record(*args, "")
        assert caught.value.status == status
    assert store.labels() == []
    store.record("ann", served["pair_id"], served["ticket"], "tie", "")
    with pytest.raises(LabelRejected) as caught:  # a replay of the same request
        store.record("ann", served["pair_id"], served["ticket"], "first", "")
    assert caught.value.status == 409 and [r["preference"] for r in store.labels()] == [0]


def test_two_labellers_at_once_never_share_a_non_overlap_pair(tmp_path: Path) -> None:
    store = LabelStore.create_or_resume(tmp_path, make_pairs(40), Settings(overlap=0.0))
    seen: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    def work(who: str) -> None:
        try:
            seen[who] = label_all(LabelStore(store.path), who, lambda s: "first")
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(who,)) for who in ("ann", "bob", "cyd")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    every = [i for ids in seen.values() for i in ids]
    assert len(every) == len(set(every)) == 40  # each pair labelled once, by one of them


def test_resuming_with_other_pairs_or_settings_is_refused(tmp_path: Path) -> None:
    LabelStore.create_or_resume(tmp_path, make_pairs(5), Settings())
    assert LabelStore.create_or_resume(tmp_path, make_pairs(5), Settings()).path.is_file()
    with pytest.raises(UserError, match="other pairs"):
        LabelStore.create_or_resume(tmp_path, make_pairs(6), Settings())
    with pytest.raises(UserError, match="--overlap"):
        LabelStore.create_or_resume(tmp_path, make_pairs(5), Settings(overlap=0.5))
    with pytest.raises(UserError, match="no labelling session"):
        LabelStore.open(tmp_path / "elsewhere")
    with pytest.raises(UserError, match=r"--overlap must be a fraction in \[0, 1\], got 1.5"):
        LabelStore.create_or_resume(tmp_path / "new", make_pairs(5), Settings(overlap=1.5))
    assert not (tmp_path / "new").exists() and not (tmp_path / "elsewhere").exists()  # refused before writing


def test_cohen_kappa_known_values() -> None:
    assert cohen_kappa([1, 1, 2, 2], [1, 1, 2, 2]) == 1.0
    assert cohen_kappa([1, 2, 1, 2], [2, 1, 2, 1]) == -1.0
    # 2x2 table [[20, 5], [10, 15]]: po = 0.7, pe = 0.5 * 0.6 + 0.5 * 0.4 = 0.5, kappa = 0.4
    a = [1.0] * 25 + [2.0] * 25
    b = [1.0] * 20 + [2.0] * 5 + [1.0] * 10 + [2.0] * 15
    assert cohen_kappa(a, b) == pytest.approx(0.4)
    assert cohen_kappa([1, 1], [1, 1]) is None


def test_report_measures_agreement_kappa_length_and_spearman(tmp_path: Path) -> None:
    pairs = make_pairs(30)
    store = LabelStore.create_or_resume(tmp_path, pairs, Settings(overlap=0.2))
    by_id = {p.id: p for p in pairs}
    system_rank = {"a": 1, "b": 0, "c": 2}  # humans: c best, a middle, b worst; b and c beat the reference

    def human(served: dict) -> str:
        pair = by_id[served["pair_id"]]
        wins = int(pair.id, 16) % 3 < system_rank[pair.generator_2]
        system_text = pair.output_2
        return "first" if (served["first"] == system_text) == wins else "second"

    label_all(store, "ann", human)
    label_all(store, "bob", human)
    rows = store.labels()
    agree = {(p.instruction, p.output_1, p.output_2): [2.0 if int(p.id, 16) % 3 < system_rank[p.generator_2]
                                                       else 1.0] for p in pairs}
    opposite = {k: [3.0 - v[0]] for k, v in agree.items()}
    report = build_report(rows, {"same": agree, "opposite": opposite}, n_bootstrap=200)
    assert report["human_human"]["agreement"] == 1.0 and report["human_human"]["kappa"] == 1.0
    assert report["simulators"]["same"]["agreement"] == 1.0 and report["simulators"]["same"]["kappa"] == 1.0
    assert report["simulators"]["opposite"]["agreement"] == 0.0
    assert report["win_rates"]["left_out"] == ["ref"]
    assert report["win_rates"]["simulators"]["same"]["spearman"] == pytest.approx(1.0)
    assert report["win_rates"]["simulators"]["opposite"]["spearman"] == pytest.approx(-1.0)
    same, opposite = (report["simulators"][n]["p_prefer_longer"] for n in ("same", "opposite"))
    assert 0 < same < 1 and same + opposite == pytest.approx(1.0)  # every pair has a longer answer: flips exactly
    assert 0 < report["humans"]["p_prefer_longer"] < 1


def test_export_is_what_compare_agreement_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = LabelStore.create_or_resume(tmp_path / "s", make_pairs(10), Settings(overlap=1.0))
    label_all(store, "ann", lambda s: "first")
    label_all(store, "bob", lambda s: "skip" if s["progress"]["labelled"] + s["progress"]["skipped"] == 0 else "first")
    records = export_records(store.labels())
    assert sum(r["preference"] is None for r in records) == 1 and {r["shown_first"] for r in records} == {
        "output_1", "output_2"}
    assert cli.main(["label", "export", "--dir", str(tmp_path / "s"), "-o", str(tmp_path / "human.json")]) == 0
    assert json.loads((tmp_path / "human.json").read_text()) == records
    capsys.readouterr()
    assert cli.main(["compare", "--agreement", str(tmp_path / "human.json"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["counts"]["pairs"] == 9 and result["counts"]["human_missing"] == 1


def test_report_command_reads_annotator_labels_and_prints_json(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    store = LabelStore.create_or_resume(tmp_path / "s", make_pairs(12), Settings(overlap=0.25))
    label_all(store, "ann", lambda s: "first")
    label_all(store, "bob", lambda s: "first")
    humans = export_records(store.labels())
    sim = [{**r, "preference": 1} for r in humans if r["labeller"] == "ann"]  # a judge that always picks output_1
    (tmp_path / "sim.json").write_text(json.dumps(sim))
    capsys.readouterr()
    assert cli.main(["label", "report", "--dir", str(tmp_path / "s"), "--annotator-labels", str(tmp_path / "sim.json"),
                     "--json", "--n-bootstrap", "20", "--plot", str(tmp_path / "r.png")]) == 0
    report = json.loads(capsys.readouterr().out)
    expected = sum(r["preference"] == 1 for r in humans) / len(humans)
    assert report["simulators"]["sim.json"]["agreement"] == pytest.approx(expected)
    assert report["simulators"]["sim.json"]["n_human_labels"] == 15 and report["human_human"]["pairs"] == 3
    assert (tmp_path / "r.png").stat().st_size > 1000 and report["plot"] == str(tmp_path / "r.png")
    assert cli.main(["label", "report", "--dir", str(tmp_path / "nowhere"), "--annotator-labels", "x.json"]) == 2
    assert "no labelling session" in capsys.readouterr().err


def test_report_gives_intervals_and_warns_below_the_minimum_of_shared_pairs(tmp_path: Path) -> None:
    """Issue 62 (4): agreement and kappa carry bootstrap intervals; fewer than 20 shared pairs is a warning."""
    pairs = make_pairs(30)
    store = LabelStore.create_or_resume(tmp_path, pairs, Settings(overlap=0.2))
    label_all(store, "ann", lambda s: "first")
    label_all(store, "bob", lambda s: "first" if int(s["pair_id"], 16) % 3 else "second")
    sim = {(p.instruction, p.output_1, p.output_2): [1.0 + (int(p.id, 16) % 2)] for p in pairs}
    report = build_report(store.labels(), {"sim": sim}, n_bootstrap=300)
    human_human, row = report["human_human"], report["simulators"]["sim"]
    assert human_human["pairs"] == 6
    low, high = human_human["agreement_interval"]
    assert low <= human_human["agreement"] <= high and high - low > 0.1  # 6 pairs: wide
    assert human_human["kappa_interval"] is None or human_human["kappa_interval"][0] <= human_human["kappa_interval"][1]
    assert row["agreement_interval"][0] <= row["agreement"] <= row["agreement_interval"][1]
    assert row["kappa_interval"][0] <= row["kappa"] <= row["kappa_interval"][1]
    assert report["min_shared_pairs"] == 20 and "only 6 pairs" in report["warnings"][0]


def test_the_default_overlap_gives_the_minimum_of_shared_pairs(tmp_path: Path) -> None:
    """Issue 62 (4): 10% of 30 pairs was 3 shared pairs; the default now gives 20 (or all, or 10% if more)."""
    for n, shared in ((30, 20), (12, 12), (400, 40)):
        store = LabelStore.create_or_resume(tmp_path / str(n), make_pairs(n), Settings())
        assert sum(p["overlap"] for p in store.pairs()) == shared


def test_both_bad_counts_as_a_tie_and_is_kept_apart_in_the_export(tmp_path: Path) -> None:
    store = LabelStore.create_or_resume(tmp_path, make_pairs(2), Settings())
    label_all(store, "ann", lambda s: "both_bad")
    records = export_records(store.labels())
    assert [(r["choice"], r["preference"]) for r in records] == [("both_bad", 0), ("both_bad", 0)]
    assert preference_of("both_bad", True) == 0


def test_report_lines_fit_80_columns(tmp_path: Path) -> None:
    """Issue 62 (9): the report's title is one line of its own, not a table title wrapped at 80 columns."""
    from conftest import run_cli

    store = LabelStore.create_or_resume(tmp_path / "s", make_pairs(12), Settings(overlap=0.25))
    label_all(store, "ann", lambda s: "first")
    label_all(store, "bob", lambda s: "first")
    sim = [{**r, "preference": 1} for r in export_records(store.labels()) if r["labeller"] == "ann"]
    (tmp_path / "sim.json").write_text(json.dumps(sim))
    result = run_cli("label", "report", "--dir", str(tmp_path / "s"), "--annotator-labels", str(tmp_path / "sim.json"),
                     "--n-bootstrap", "50", "--plot", str(tmp_path / "r.png"), env={"COLUMNS": "80"})
    shown = result.stdout + result.stderr
    assert result.returncode == 0, shown
    assert "agreement with 2 labeller(s): 12 pairs, 15 labels, 0 skipped\n" in shown
    assert "95% bootstrap intervals" in shown and "warning: only 3 pairs" in shown
    table_lines = [line for line in shown.splitlines() if "│" in line or "┃" in line]
    assert table_lines and max(len(line) for line in table_lines) <= 80


def test_win_rates_carry_standard_errors_for_the_plot(tmp_path: Path) -> None:
    """Issue 62 (4): the win-rate scatter has error bars: each system's standard error from its comparisons."""
    pairs = make_pairs(12)
    store = LabelStore.create_or_resume(tmp_path, pairs, Settings(overlap=0.0))
    label_all(store, "ann", lambda s: "first")
    sim = {(p.instruction, p.output_1, p.output_2): [2.0] for p in pairs}
    report = build_report(store.labels(), {"sim": sim}, n_bootstrap=20)
    rates = report["win_rates"]
    assert set(rates["humans_se"]) == set(rates["humans"]) == {"a", "b", "c"}
    for system, rate in rates["humans"].items():
        p = rate / 100
        assert rates["humans_se"][system] == pytest.approx(100 * (p * (1 - p) / 4) ** 0.5)
    assert rates["simulators"]["sim"]["win_rate_se"] == {"a": 0.0, "b": 0.0, "c": 0.0}  # always wins: no spread


def test_a_store_from_before_issue_62_is_served_with_its_labels(tmp_path: Path) -> None:
    """A session written by the earlier schema (no label counts, no history, leases kept after labelling) is
    brought up to date when served: its labels count, and nobody gets a pair labelled already."""
    import sqlite3

    pairs = make_pairs(4)
    with sqlite3.connect(tmp_path / "labels.sqlite") as db:
        db.executescript("""
            CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            CREATE TABLE pairs (id TEXT PRIMARY KEY, position INTEGER NOT NULL UNIQUE, instruction TEXT NOT NULL,
                input TEXT NOT NULL, output_1 TEXT NOT NULL, output_2 TEXT NOT NULL, generator_1 TEXT,
                generator_2 TEXT, overlap INTEGER NOT NULL);
            CREATE TABLE assignments (labeller TEXT NOT NULL, pair_id TEXT NOT NULL, ticket TEXT NOT NULL UNIQUE,
                swapped INTEGER NOT NULL, served REAL NOT NULL, PRIMARY KEY (labeller, pair_id));
            CREATE TABLE labels (labeller TEXT NOT NULL, pair_id TEXT NOT NULL, swapped INTEGER NOT NULL,
                choice TEXT NOT NULL, preference INTEGER, reason TEXT NOT NULL, created REAL NOT NULL,
                ticket TEXT NOT NULL, PRIMARY KEY (labeller, pair_id));""")
        db.executemany("INSERT INTO meta VALUES (?, ?)", [("seed", "0"), ("overlap", "0.0"),
                                                          ("labels_per_pair", "1"), ("lease_s", "600.0")])
        db.executemany("INSERT INTO pairs VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)",
                       [(p.id, i, p.instruction, p.input, p.output_1, p.output_2, p.generator_1, p.generator_2)
                        for i, p in enumerate(pairs)])
        for i, labeller in enumerate(("Ann", "bob")):
            db.execute("INSERT INTO assignments VALUES (?, ?, ?, 0, 1.0)", (labeller, pairs[i].id, f"t{i}"))
            db.execute("INSERT INTO labels VALUES (?, ?, 0, 'first', 1, '', ?, ?)", (labeller, pairs[i].id, i, f"t{i}"))
    store = LabelStore.open(tmp_path, write=True)
    assert store.identify(None, "ann") == "Ann"  # the name as first written; case no longer makes a new person
    seen = label_all(store, "cyd", lambda s: "first")
    assert sorted(seen) == sorted(p.id for p in pairs[2:])  # the two labelled pairs are not served again
    assert store.next_pair("Ann")["progress"]["labelled"] == 1


def test_the_spearman_interval_resamples_pairs_not_systems() -> None:
    """Four systems ranked alike by the humans and a simulator, who disagree on single pairs, on 3 pairs each: rho
    is 1, but an interval from resampling the 4 systems was [1, 1] however few pairs the ranks rest on; resampling
    the pairs is wide."""
    from alpacafarm_validation.label_report import correlation

    humans, systems, sim = {}, {}, {}
    wins = {"s1": 0, "s2": 1, "s3": 2, "s4": 3}  # pairs of 3 each system wins against the reference
    for system, won in wins.items():
        for i in range(3):
            key = (f"instruction {system} {i}", "", "ref", system)
            systems[key] = ("ref", system)
            humans[key] = [("ann", 2.0 if i < won else 1.0)]
            sim[key] = [2.0 if i >= 3 - won else 1.0]  # as many wins, on other pairs: the same ranks
    result = correlation(humans, systems, {"sim": sim}, n_bootstrap=400, seed=0)["simulators"]["sim"]
    assert result["spearman"] == pytest.approx(1.0)
    low, high = result["spearman_interval"]
    assert high == pytest.approx(1.0) and low < 0.9
