"""``alpacafarm bench RECIPE --baseline FILE``: the CI gate that blocks a change whose win-rate regresses.

It runs a benchmark recipe through the normal pipeline (fixed seeds, data and judge; finished stages are skipped,
as with ``alpacafarm run``: a stage re-runs when its method's or judge's code changed, even under the same plugin
version; ``--force`` re-runs them all), reads every evaluated system's per-instruction outcomes, and compares
each system with the committed baseline file on the same instructions (:mod:`alpacafarm_evaluation.gate_stats`:
a one-sided paired non-inferiority test of the win-rate against the reference). Identical outputs (same hashes
on every instruction) pass at once.

What a baseline holds and how the benchmark is fingerprinted (judge, data, recipe) is
:mod:`alpacafarm_evaluation.bench_baseline`.

A changed fingerprint is its own verdict, STALE: the comparison would not mean anything; ``--update-baseline``
writes a new baseline (the pull request then shows its diff). Exit status: 0 PASS, 1 FAIL, 3 INCONCLUSIVE,
4 STALE, 2 a user error (as for every command), 5 the run crashed (traceback printed; no verdict).

Where bench writes (the ``--report`` file, the ``--baseline`` file it updates) is checked before the benchmark runs
(:func:`check_writes`): a refusal after the run would lose its verdict.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from alpacafarm import exit_status
from alpacafarm.errors import UserError
from alpacafarm.validated_input import finite, json_ready
from alpacafarm_evaluation.bench_baseline import (
    BenchRun,
    SystemOutcomes,
    baseline_json,
    data_fingerprint,
    digest,
    judge_identity,
    judge_probe,
    outcomes_of,
    pick_probe,
    protocol_of,
    read_baseline,
    stale_reasons,
)
from alpacafarm_evaluation.gate_stats import (
    DEFAULT_ALPHA,
    DEFAULT_MARGIN,
    DEFAULT_POWER,
    EXIT_CODES,
    FAIL,
    INCONCLUSIVE,
    PASS,
    PROTOCOL_BOUNDS,
    STALE,
    BaselinePower,
    baseline_power,
    family_alpha,
    non_inferiority,
    paired_differences,
    worst,
)

#: Exit status when the benchmark run itself crashed (a bug, not a user error): no verdict.
EXIT_CRASH = exit_status.CRASHED
EVALUATION_STAGE = "evaluate"


# ------------------------------------------------------------------------------------------------ running


def judged_records(artifact: Any) -> dict[str, list[dict[str, Any]]]:
    """Each evaluated system's judged pairs, from the evaluation's hand-off (``judged``: one
    :class:`~alpacafarm.artifacts.JudgedSystem` per system, naming its annotations file)."""
    if not artifact.judged:
        raise UserError("bench: the evaluation stage handed on no judged systems (Artifact.judged); a benchmark "
                        "recipe needs an evaluator that does, such as win_rate (evaluation.evaluator: win_rate)")
    return {system.name: json.loads(Path(system.annotations).read_text(encoding="utf-8"))
            for system in artifact.judged}


def run_benchmark(recipe: str, overrides: list[str], output_dir: str | None,
                  probe: list[dict[str, Any]] | None = None, force: bool = False) -> BenchRun:
    """Run the recipe's pipeline, then read outcomes and fingerprints. ``probe``: the baseline's judge probe
    (re-judged now); None picks a new one from this run's judged pairs. ``force`` re-runs every stage."""
    from alpacafarm.pipeline import Pipeline, package_versions
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import load_recipe
    from alpacafarm.run_directory import named_run_folder

    registry = get_registry()
    loaded = load_recipe(recipe, overrides, registry)
    if loaded.recipe.evaluation is None:
        raise UserError(f"bench: recipe {recipe} has no 'evaluation:' block; a benchmark evaluates its systems")
    judge = judge_identity(loaded, registry)
    run_dir = Path(output_dir) if output_dir else named_run_folder(loaded.recipe.name, Path("runs") / "bench")
    started = time.perf_counter()
    pipeline = Pipeline(loaded, registry, run_dir)
    outcomes = {o.name: o for o in pipeline.run(force=("all",) if force else ())}
    records = judged_records(outcomes[EVALUATION_STAGE].artifact)
    probe = pick_probe(records) if probe is None else probe
    judge = {**judge, "probe_labels": judge_probe(loaded, registry, probe)}
    protocol = protocol_of(loaded.recipe)
    return BenchRun(
        recipe=str(recipe), recipe_name=loaded.recipe.name, overrides=list(overrides), run_dir=str(pipeline.run_dir),
        systems={name: outcomes_of(name, rows) for name, rows in records.items()},
        fingerprints={"judge": digest(judge), "data": data_fingerprint(records), "recipe": digest(protocol)},
        judge=judge, protocol=protocol, probe=probe, versions=package_versions(),
        plugin_versions=dict(sorted(registry.plugin_versions.items())), seconds=time.perf_counter() - started,
        records=records, loaded=loaded, registry=registry)


# ------------------------------------------------------------------------------------------------ comparing


def compare(run: BenchRun, baseline: dict[str, Any], margin: float, alpha: float, power: float) -> dict[str, Any]:
    """The gate's report: verdict, per-system tests, stale reasons; JSON-ready."""
    reasons = stale_reasons(run, baseline)
    names = [n for n in baseline["systems"] if n in run.systems]
    per_system_alpha = family_alpha(alpha, len(names))
    systems = []
    for name in names:
        base = SystemOutcomes.from_json(name, baseline["systems"][name])
        cand = run.systems[name]
        identical = base.outputs == cand.outputs
        row: dict[str, Any] = {"system": name, "baseline_win_rate": base.win_rate, "win_rate": cand.win_rate,
                               "identical": identical,
                               "n_changed_outputs": sum(cand.outputs.get(k) != h for k, h in base.outputs.items())}
        differences = paired_differences(cand.scores, base.scores)
        if len(differences) < 2:
            row.update(n=len(differences), verdict=INCONCLUSIVE if not reasons else STALE,
                       note="fewer than 2 instructions in common")
        else:
            test = non_inferiority(differences, margin, per_system_alpha, power, identical=identical)
            row.update(test.to_json())
        if reasons:
            row["verdict"] = STALE
        systems.append(row)
    verdict = STALE if reasons else worst([row["verdict"] for row in systems])
    return {"verdict": verdict, "exit_code": EXIT_CODES[verdict], "stale": reasons, "systems": systems,
            "margin": margin, "alpha": alpha, "alpha_per_system": per_system_alpha, "power": power,
            "recipe": run.recipe, "recipe_name": run.recipe_name, "overrides": run.overrides,
            "run_dir": run.run_dir, "seconds": round(run.seconds, 1), "fingerprints": run.fingerprints,
            "baseline_fingerprints": baseline["fingerprints"], "baseline_created_at": baseline.get("created_at"),
            "versions": run.versions, "baseline_versions": baseline.get("versions", {})}


# ------------------------------------------------------------------------------------------------ reporting

MEANING = {
    PASS: "no regression beyond the margin (non-inferiority shown, or identical outputs)",
    FAIL: "win-rate regressed: a significant drop whose size may exceed the margin",
    INCONCLUSIVE: "the benchmark cannot tell: its interval holds both no change and a drop of the margin",
    STALE: "the baseline does not describe this benchmark any more (judge, data, recipe or systems changed)",
}


def _f(value: Any, digits: int = 1, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _p(value: Any) -> str:
    return "-" if value is None else ("<0.001" if value < 0.001 else f"{value:.3f}")


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for s in report["systems"]:
        if s["identical"] or s.get("ci_low") is None:  # nothing to test: no interval, no p-value
            rows.append([s["system"], str(s.get("n", "-")), _f(s["baseline_win_rate"]), _f(s["win_rate"]),
                         "identical" if s["identical"] else "-", "-", "-", "-", s["verdict"]])
            continue
        rows.append([s["system"], str(s["n"]), _f(s["baseline_win_rate"]), _f(s["win_rate"]),
                     _f(s["delta"], signed=True), f"[{s['ci_low']:+.1f}, {s['ci_high']:+.1f}]", _p(s["p_value"]),
                     _f(s["mde"]), s["verdict"]])
    return rows


COLUMNS = ["system", "n", "base %", "now %", "Δ", "CI", "p", "MDE", "verdict"]


def protocol_changes(baseline: dict[str, float], used: dict[str, float]) -> list[str]:
    """``["margin 5 -> 10"]``: where the protocol the gate used differs from the one its baseline records."""
    return [f"{k} {baseline[k]:g} -> {v:g}" for k, v in used.items() if v != baseline[k]]


def summary_line(report: dict[str, Any]) -> str:
    changes = report.get("protocol_changes") or []
    changed = f"; NOT the baseline's protocol: {', '.join(changes)}" if changes else ""
    return (f"{report['verdict']}: {MEANING[report['verdict']]} (margin {report['margin']:g} points, alpha "
            f"{report['alpha']:g}, {report['alpha_per_system']:.3g} per system{changed}; exit {report['exit_code']})")


def markdown(report: dict[str, Any]) -> str:
    """A report ready to post on a pull request."""
    icon = {PASS: "✅", FAIL: "❌", INCONCLUSIVE: "⚠️", STALE: "🕰️"}[report["verdict"]]
    lines = [f"## {icon} alpacafarm bench: {report['verdict']} — `{report['recipe']}`", "",
             summary_line(report), ""]
    if report["stale"]:
        lines += ["**Stale baseline:**", *[f"- {r}" for r in report["stale"]], "",
                  "Write a new baseline with `alpacafarm bench RECIPE --baseline FILE --update-baseline` and "
                  "commit it (reviewers see its diff).", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(report)]
    lines += ["", f"base % / now %: win-rate against the reference in the baseline and now; Δ: their paired "
              f"difference on the same instructions (points); CI: the two-sided "
              f"{100 * (1 - 2 * report['alpha_per_system']):.1f}% interval (each bound one-sided at "
              f"{report['alpha_per_system']:.3g}); p: the one-sided non-inferiority p-value (H0: Δ <= "
              f"-{report['margin']:g}); MDE: the regression detected with {report['power']:.0%} power "
              "(points).", "",
              f"Run: {report['seconds']:.0f} s; run directory `{report['run_dir']}`; baseline of "
              f"{report.get('baseline_created_at') or '?'}."]
    changed = {k: (report["baseline_versions"].get(k), v) for k, v in report["versions"].items()
               if report["baseline_versions"].get(k) not in (None, v)}
    if changed:
        lines.append("Package versions since the baseline: " + ", ".join(
            f"{k} {a} → {b}" for k, (a, b) in sorted(changed.items())))
    return "\n".join(lines) + "\n"


def show(report: dict[str, Any]) -> None:
    from alpacafarm.console import console, print_table

    print_table(f"alpacafarm bench {report['recipe_name']}: {report['verdict']}", COLUMNS, table_rows(report))
    for reason in report["stale"]:
        console().print(f"[yellow]stale: {reason}[/yellow]", highlight=False, soft_wrap=True)
    console().print(summary_line(report), highlight=False, soft_wrap=True)


def show_power(estimates: list[BaselinePower]) -> None:
    """One line per system: the new baseline's estimated minimum detectable effect against the margin."""
    from alpacafarm.console import console

    for e in estimates:
        enough = "enough" if not e.underpowered else f"about {e.needed} needed"
        console().print(f"{e.system}: estimated MDE {e.mde:.1f} points on {e.n} instructions (margin "
                        f"{e.margin:g}; {enough}; re-run correlation {e.correlation:.2f})", highlight=False,
                        soft_wrap=True)


def check_power(estimates: list[BaselinePower], allowed: bool) -> None:
    """Refuse a baseline that cannot see a regression of the margin, unless ``--allow-underpowered``."""
    weak = [e for e in estimates if e.underpowered]
    if not weak or allowed:
        return
    e = max(weak, key=lambda x: x.mde)
    needed = f"about {e.needed} instructions" if e.needed else "more instructions"
    raise UserError(f"bench: baseline not written: {e.system}'s estimated minimum detectable effect is {e.mde:.1f} "
                    f"points, above the margin {e.margin:g} ({e.n} instructions; {needed} would do): the gate would "
                    "answer INCONCLUSIVE to real regressions; evaluate more instructions, raise --margin, or pass "
                    "--allow-underpowered")


# ------------------------------------------------------------------------------------------------ command


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="alpacafarm bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a benchmark recipe and compare every evaluated system with a committed baseline "
                    "(paired non-inferiority test). Exit: 0 PASS, 1 FAIL, 3 INCONCLUSIVE, 4 STALE, 2 usage error, "
                    "5 crash (no verdict).")
    parser.add_argument("recipe", help="benchmark recipe, e.g. recipes/bench/best_of_n.yaml")
    parser.add_argument("--baseline", required=True, metavar="FILE", help="the committed baseline JSON")
    parser.add_argument("--update-baseline", action="store_true",
                        help="write FILE from this run (after showing the comparison, if FILE exists; an existing "
                             "FILE must be a baseline bench wrote); exit 0")
    parser.add_argument("--allow-underpowered", action="store_true",
                        help="with --update-baseline: write the baseline even when its estimated minimum detectable "
                             "effect exceeds the margin (the gate will then answer INCONCLUSIVE to real regressions)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe value, e.g. --set stages.best_of_n.method=my_best_of_n")
    parser.add_argument("--output-dir", help="run directory (default: runs/bench/<recipe name>)")
    parser.add_argument("--force", action="store_true",
                        help="re-run every stage (finished stages are otherwise reused when their fingerprint, "
                             "which covers the plugins' source code, is unchanged)")
    parser.add_argument("--margin", type=float, help=f"non-inferiority margin in win-rate points (default: the "
                        f"baseline's, else {DEFAULT_MARGIN:g})")
    parser.add_argument("--alpha", type=float, help=f"the gate's level (default: the baseline's, else "
                        f"{DEFAULT_ALPHA:g}); divided among the systems")
    parser.add_argument("--power", type=float, help=f"power at which the MDE is reported (default "
                        f"{DEFAULT_POWER:g})")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    parser.add_argument("--report", metavar="FILE.md", help="write a Markdown report (for a pull request)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show library logs and progress bars")
    args = parser.parse_args(argv)
    for name, (low, high, open_low, open_high) in PROTOCOL_BOUNDS.items():  # as a baseline's gate is checked
        if getattr(args, name) is not None:
            finite(getattr(args, name), lambda message, n=name: UserError(
                f"--{n} {message} (docs/ci-gate.md: the gate's protocol is bounded)"), low=low, high=high,
                open_low=open_low, open_high=open_high)
    return args


def check_writes(args: argparse.Namespace) -> None:
    """Where bench may write, checked before the benchmark runs (a refusal after the run would lose its verdict):
    the ``--report`` file and, with ``--update-baseline``, the ``--baseline`` file each pass
    :func:`alpacafarm.paths.check_write_place` (no symbolic link, not a folder, a writable folder, made when
    missing); neither is the other or the recipe; and an existing baseline is replaced only when it is a baseline
    bench wrote (a README or a recipe given by mistake is refused, never overwritten). One line, exit 2."""
    from alpacafarm.paths import check_write_place

    recipe, baseline = Path(args.recipe), Path(args.baseline)
    if args.update_baseline:
        check_write_place(baseline, "--baseline", not_same_as={"the recipe": recipe})
        if baseline.exists():
            try:
                read_baseline(baseline)
            except UserError as exc:
                raise UserError(f"{exc}; --update-baseline replaces only a baseline bench wrote, and leaves this "
                                "file as it is: delete it, or give another --baseline") from None
    if args.report:
        check_write_place(Path(args.report), "--report", not_same_as={"--baseline": baseline, "the recipe": recipe})


def main(argv: list[str]) -> int:
    """``alpacafarm bench``: returns the exit status of the verdict."""
    args = parse_args(argv)
    check_writes(args)
    baseline_path = Path(args.baseline)
    # without --update-baseline the baseline must be there; with it, an existing one (checked above) is shown for
    # comparison before it is replaced
    baseline = read_baseline(baseline_path) if not args.update_baseline or baseline_path.exists() else None
    gate = {"margin": DEFAULT_MARGIN, "alpha": DEFAULT_ALPHA, "power": DEFAULT_POWER, **(baseline or {}).get(
        "gate", {})}  # read_baseline checked its values
    margin = args.margin if args.margin is not None else gate["margin"]
    alpha = args.alpha if args.alpha is not None else gate["alpha"]
    power = args.power if args.power is not None else gate["power"]
    from alpacafarm.library_logs import route_library_output

    route_library_output(verbose=args.verbose)
    try:
        run = run_benchmark(args.recipe, args.overrides, args.output_dir,
                            probe=None if baseline is None else baseline["judge_probe"], force=args.force)
    except (UserError, OSError, KeyboardInterrupt):
        raise  # one line, exit 2 (or 130), as for every command
    except Exception as exc:  # a crash is no verdict: loud, and never mistaken for FAIL (exit 1)
        import sys
        import traceback

        traceback.print_exc()
        print(f"error: the benchmark run crashed ({type(exc).__name__}: {exc}); no verdict (exit {EXIT_CRASH})",
              file=sys.stderr)
        return EXIT_CRASH
    report = compare(run, baseline, margin, alpha, power) if baseline is not None else None
    if report is not None:  # a protocol other than the baseline's is said in the verdict's first line
        report["protocol_changes"] = protocol_changes(gate, {"margin": margin, "alpha": alpha, "power": power})
    estimates: list[BaselinePower] = []
    if args.update_baseline:
        from alpacafarm.data import write_json

        estimates = baseline_power({n: s.scores for n, s in run.systems.items()}, margin, alpha, power)
        show_power(estimates)
        check_power(estimates, args.allow_underpowered)
        if baseline is not None:
            run.reprobe()  # the new baseline's probe comes from its own judged pairs
        write_json(baseline_path, {**baseline_json(run, margin, alpha, power),
                                   "power_estimate": [e.to_json() for e in estimates]})
    if report is not None:
        if args.report:
            from alpacafarm.paths import write_text_replacing

            write_text_replacing(args.report, markdown(report), "--report")
        if args.json:
            print(json.dumps(json_ready({**report, "baseline_updated": args.update_baseline}), sort_keys=True,
                             allow_nan=False))
        else:
            show(report)
    elif args.json:
        print(json.dumps(json_ready({"verdict": None, "baseline_updated": True, "systems": {
            n: {"win_rate": s.win_rate, "n": len(s.scores)} for n, s in run.systems.items()},
            "power_estimate": [e.to_json() for e in estimates]}), sort_keys=True, allow_nan=False))
    if args.update_baseline:
        from alpacafarm.console import console

        console().print(f"baseline written: {baseline_path} ({len(run.systems)} system(s), "
                        f"{run.seconds:.0f} s)", highlight=False, soft_wrap=True)
        return 0
    return report["exit_code"]
