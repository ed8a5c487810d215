"""The faults of issue 41 as fault-injection scenarios (``python benchmarks/fault_injection.py --scenarios issue41``),
each through the real CLI in its own process: a key the server echoes transformed, run names that leave ``runs/``,
a gate turned off by one edit, includes that fan out, alias bombs in ``--set`` and in a template file, a locked
cache, tampered baselines, absurd trainer values and generation sizes, ``plugin new`` names already in use, and
(issue 61) ``bench`` writes onto a file it did not write (a README, the recipe, the baseline as ``--report``, a
symbolic link, a folder under a file) and manifests whose hand-offs leave the run folder.

Printed, each should be 0: key leaks (any form of the key on the console or in an output file), run folders
created outside ``runs/``, gates turned off (a tampered protocol that did not exit 2), files written outside their
place (a file ``bench`` should have left alone that changed, a link's target written; a manifest naming a file
outside its run folder that ``--plan`` called intact or a run accepted), hangs (a command past its time limit),
tracebacks, and wrong exit statuses (a refused input must exit 2: :mod:`alpacafarm.exit_status`).

Raising a budget (a resumed online_dpo or GRPO stage) and metrics after a resume need real training stages: they are
tested in ``tests/test_budget_resume.py`` (marked slow), not here.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from alpacafarm.testing.openai_server import FakeOpenAIServer, Fault, echo_forms

REPO = Path(__file__).resolve().parents[1]
KEY = "local-gateway-token-7Qx2Lm9Pz4Kw8Rt1"
LIMIT_S = 60.0  # a refused input answers in seconds; past this a command counts as a hang
BOMB = "[&a [x,x,x,x,x,x,x,x,x]" + "".join(
    f", &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi", strict=True)) + "]"
RECIPE = "name: r\nstages:\n  - {name: split, method: split_instructions}\n"


@dataclass
class Tally:
    key_leaks: int = 0
    escapes: int = 0
    gates_off: int = 0
    misplaced: int = 0
    hangs: int = 0
    tracebacks: int = 0
    wrong_status: int = 0
    notes: list[str] = field(default_factory=list)


def _run(tally: Tally, what: str, args: list[str], *, cwd: Path = REPO, env: dict[str, str] | None = None,
         expect: int = 2) -> subprocess.CompletedProcess | None:
    """``alpacafarm ARGS``; counts a hang, a traceback and an exit status other than ``expect``."""
    started = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-m", "alpacafarm", *args], cwd=cwd, capture_output=True,
                                text=True, timeout=LIMIT_S, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        tally.hangs += 1
        tally.notes.append(f"{what}: still running after {LIMIT_S:g}s")
        return None
    took = time.monotonic() - started
    tally.tracebacks += "Traceback" in result.stderr
    if result.returncode != expect:
        tally.wrong_status += 1
        tally.notes.append(f"{what}: exit {result.returncode}, expected {expect}")
    error = next((line for line in result.stderr.splitlines() if line.startswith("error:")), "(no error line)")
    print(f"  {what}: exit {result.returncode} in {took:.1f}s: {error[:110]}")
    return result


def echoed_key(root: Path, tally: Tally) -> None:
    pairs = root / "pairs.jsonl"
    pairs.write_text(json.dumps({"instruction": "Say hi", "output_1": "hi", "output_2": "Hello there."}) + "\n")
    forms = "+".join(echo_forms(KEY))
    for status in (401, 500):
        out = root / f"echo-{status}.json"
        with FakeOpenAIServer(lambda body, s=status: Fault("echo_key", status=s, echo=forms)) as server:
            result = _run(tally, f"key echoed in {len(echo_forms(KEY))} forms, HTTP {status}",
                          ["annotate", str(pairs), "--annotator", "gpt4_b1_noex", "--base-url", server.base_url,
                           "--set", "max_retries=1", "--set", "retry_backoff_s=0.01", "-o", str(out)],
                          env={"OPENAI_API_KEY": KEY, "ALPACAFARM_CACHE_DIR": str(root / "cache")},
                          expect=2 if status == 401 else 1)  # a refused key is the user's to fix; a 500 failed work
        written = out.read_text() if out.exists() else ""
        text = (result.stdout + result.stderr if result else "") + written
        leaked = [name for name, form in echo_forms(KEY).items() if form.lower() in text.lower()]
        tally.key_leaks += len(leaked)
        if leaked:
            tally.notes.append(f"HTTP {status}: the key leaked as {', '.join(leaked)}")


def run_names(root: Path, tally: Tally) -> None:
    work = root / "names" / "a" / "b"
    work.mkdir(parents=True)
    (work / "r.yaml").write_text(RECIPE)
    for name in ("../../escape", str(root / "names" / "absolute"), ""):
        _run(tally, f"run --set name={name!r}", ["run", "r.yaml", "--set", f"name={name}"], cwd=work)
    made = [p for p in (root / "names").rglob("*") if p.is_dir() and p.name in ("escape", "absolute", "runs")]
    tally.escapes += len(made)
    tally.notes += [f"run folder created: {p}" for p in made]


def tampered_baselines(root: Path, tally: Tally) -> None:
    base = json.loads((REPO / "benchmarks/baselines/best_of_n.json").read_text())

    def edited(what: str, edit: Callable[[dict], None]) -> None:
        data = json.loads(json.dumps(base))
        edit(data)
        path = root / "baseline.json"
        path.write_text(json.dumps(data))
        result = _run(tally, f"bench, baseline {what}",
                      ["bench", "recipes/bench/best_of_n.yaml", "--baseline", str(path), "--json"])
        if result is not None and result.returncode in (0, 1, 3):  # a verdict on a tampered protocol
            tally.gates_off += 1

    edited("gate.margin 1e9", lambda d: d["gate"].update(margin=1e9))
    edited("gate.margin NaN", lambda d: d["gate"].update(margin=math.nan))
    edited("gate.margin -5", lambda d: d["gate"].update(margin=-5))
    edited("gate.margin '5'", lambda d: d["gate"].update(margin="5"))
    edited("gate.alpha 2", lambda d: d["gate"].update(alpha=2))
    edited("gate.power -1", lambda d: d["gate"].update(power=-1))
    edited("gate a list", lambda d: d.update(gate=[5]))
    edited("protocol a list", lambda d: d.update(protocol=[]))
    edited("judge_probe damaged", lambda d: d["judge_probe"][0].pop("instruction"))
    edited("a NaN score", lambda d: next(iter(next(iter(d["systems"].values()))["instructions"].values())).update(
        score=math.nan))
    deep = root / "deep.json"
    deep.write_text('{"format": "alpacafarm-bench-baseline/1", "gate": ' + "[" * 100_000 + "]" * 100_000 + "}")
    result = _run(tally, "bench, baseline nested 100k deep",
                  ["bench", "recipes/bench/best_of_n.yaml", "--baseline", str(deep)])
    tally.gates_off += result is not None and result.returncode in (0, 1, 3)
    for flag, value in (("--margin", "inf"), ("--alpha", "0.9"), ("--power", "0.01")):
        result = _run(tally, f"bench {flag} {value}", ["bench", "recipes/bench/best_of_n.yaml", "--baseline",
                                                       "benchmarks/baselines/best_of_n.json", flag, value])
        tally.gates_off += result is not None and result.returncode in (0, 1, 3)


def yaml_bombs(root: Path, tally: Tally) -> None:
    recipe = root / "r.yaml"
    recipe.write_text(RECIPE + "annotator: offline\n")
    for key in ("extra_field", "stages.split.config.backend_config", "annotator.config.overrides"):
        _run(tally, f"alias bomb in --set {key}", ["recipe", "check", str(recipe), "--set", f"{key}={BOMB}"])
    template = root / "t.yaml"
    template.write_text(f"system: hi\nbomb: {BOMB}\n")
    _run(tally, "alias bomb in a template file",
         ["annotate", str(root / "pairs.jsonl"), "--annotator", "gpt4_b1_noex", "--base-url", "http://127.0.0.1:9/v1",
          "--set", f"template={template}", "-o", str(root / "t.json")],
         env={"OPENAI_API_KEY": KEY, "ALPACAFARM_CACHE_DIR": str(root / "cache")})
    fan = root / "fan"
    fan.mkdir()
    for i in range(10):  # each file includes the next ten times: 10^10 reads
        includes = "" if i == 9 else "include: [" + ", ".join([f"f{i + 1}.yaml"] * 10) + "]\n"
        (fan / f"f{i}.yaml").write_text(includes + f"description: level {i}\n")
    (fan / "r.yaml").write_text("include: f0.yaml\n" + RECIPE)
    _run(tally, "includes that fan out (10 x 10 x ...)", ["recipe", "check", str(fan / "r.yaml")])


def locked_cache(root: Path, tally: Tally) -> None:
    from alpacafarm.annotation_cache import AnnotationCache

    cache = AnnotationCache(root / "locked" / "annotations.sqlite")
    other = sqlite3.connect(cache.path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:  # the default bound (5 s per operation): a hang would be SQLite's old 60 s per operation
        result = _run(tally, "a cache locked by another program (default bound)",
                      ["annotate", str(root / "pairs.jsonl"), "--annotator", "gpt4_b1_noex", "--base-url",
                       "http://127.0.0.1:9/v1", "-o", str(root / "l.json")],
                      env={"OPENAI_API_KEY": KEY, "ALPACAFARM_CACHE_DIR": str(root / "locked")})
    finally:
        other.execute("ROLLBACK")
        other.close()
    if result is not None and f"pid {os.getpid()}" not in result.stderr:
        tally.notes.append("locked cache: the holding process is not named")


def refused_values(root: Path, tally: Tally) -> None:
    prefs = root / "prefs.jsonl"
    prefs.write_text(json.dumps({"instruction": "a", "output_1": "x", "output_2": "y", "preference": 1}) + "\n")
    for config in ("{learning_rate: -1}", "{per_device_train_batch_size: 0}", "{gradient_accumulation_steps: 0}",
                   "{max_length: 1}"):
        recipe = root / "dpo.yaml"
        recipe.write_text(f"name: r\nmodel: {{name: smollm2-135m-instruct}}\n"
                          f"data:\n  preferences: {{path: {prefs}}}\n"
                          f"stages:\n  - {{name: dpo, method: dpo, config: {config}}}\n")
        _run(tally, f"recipe check, dpo {config}", ["recipe", "check", str(recipe)])
    recipe = root / "long.yaml"  # 1e23 as an integer: it passed --plan, and the stage sampled until killed
    recipe.write_text(SPLIT_RECIPE.replace("stages:", "model: {name: smollm2-135m-instruct}\nstages:")
                      + "  - {name: gen, method: generate_outputs, config: {sampling: {max_new_tokens: "
                      + str(10**23) + "}}}\n")
    _run(tally, "run --plan, sampling.max_new_tokens 10^23", ["run", str(recipe), "--plan", "--output-dir",
                                                             str(root / "long-run")])
    recipe = root / "flip.yaml"
    recipe.write_text(RECIPE + "annotator: {name: offline_ann, config: {p_label_flip: 1.5}}\n")
    _run(tally, "recipe check, p_label_flip 1.5", ["recipe", "check", str(recipe)])
    for name in ("alpacafarm-methods", "os", "json", "torch", "trl"):
        _run(tally, f"plugin new {name}", ["plugin", "new", name, "--dir", str(root)])


SPLIT_RECIPE = ("name: r\ndata:\n  instructions: {builtin: alpaca_eval_sample, limit: 8}\nstages:\n"
                "  - {name: split, method: split_instructions, config: {eval_size: 2}}\n")


def bench_writes(root: Path, tally: Tally) -> None:
    """``bench`` onto files it must leave alone: each refused before the benchmark runs (exit 2), the file intact."""
    work = root / "bench-writes"
    work.mkdir()
    recipe = work / "bench.yaml"  # a copy: the refusal comes before the recipe is read, and the repository's stays safe
    recipe.write_text((REPO / "recipes/bench/best_of_n.yaml").read_text())
    baseline = work / "baseline.json"
    baseline.write_text((REPO / "benchmarks/baselines/best_of_n.json").read_text())
    readme = work / "README.md"
    readme.write_text("# My plugin\n\nHand-written notes.\n")
    elsewhere = work / "elsewhere.md"
    elsewhere.write_text("not the report's\n")
    (work / "gate.md").symlink_to(elsewhere)
    (work / "taken").write_text("a file, not a folder\n")
    guarded = [recipe, baseline, readme, elsewhere]
    before = {p: p.read_bytes() for p in guarded}
    run_dir = ["--output-dir", str(work / "run")]  # were one to run, its files stay here
    for what, args in (
            ("bench --update-baseline onto a README", ["--baseline", "README.md", "--update-baseline"]),
            ("bench --update-baseline onto the recipe", ["--baseline", "bench.yaml", "--update-baseline"]),
            ("bench --report equal to --baseline", ["--baseline", "baseline.json", "--report", "baseline.json"]),
            ("bench --report through a symbolic link", ["--baseline", "baseline.json", "--report", "gate.md"]),
            ("bench --report in a folder under a file", ["--baseline", "baseline.json", "--report", "taken/g.md"])):
        _run(tally, what, ["bench", "bench.yaml", *args, *run_dir], cwd=work)
    changed = [p.name for p in guarded if p.read_bytes() != before[p]]
    tally.misplaced += len(changed) + (work / "run").exists()
    tally.notes += [f"bench changed {name}" for name in changed]


def manifest_paths(root: Path, tally: Tally) -> None:
    """A finished split whose manifest (or a link in its folder) points its hand-off outside the run folder."""
    work = root / "manifests"
    work.mkdir()
    (work / "r.yaml").write_text(SPLIT_RECIPE)
    evil = work / "evil" / "eval.jsonl"
    evil.parent.mkdir()
    evil.write_text(json.dumps({"instruction": "INJECTED"}) + "\n")

    def tampered(what: str, change: Callable[[Path], None]) -> None:
        out = work / f"run-{len(list(work.glob('run-*')))}"
        _run(tally, f"run (before: {what})", ["run", "r.yaml", "--output-dir", str(out)], cwd=work, expect=0)
        change(out)
        plan = _run(tally, f"run --plan, {what}", ["run", "r.yaml", "--output-dir", str(out), "--plan"], cwd=work)
        again = _run(tally, f"run, {what}", ["run", "r.yaml", "--output-dir", str(out)], cwd=work)
        trusted = (plan is not None and "intact" in plan.stdout) or (again is not None and again.returncode == 0)
        tally.misplaced += trusted
        if trusted:
            tally.notes.append(f"manifest {what}: trusted")

    def token(out: Path) -> None:
        manifest = out / "stages/split/manifest.json"
        data = json.loads(manifest.read_text())
        data["artifact"]["files"]["eval"] = "${run_dir}/../evil/eval.jsonl"
        manifest.write_text(json.dumps(data))

    def link(out: Path) -> None:  # to a copy with the same bytes: sizes and hashes match, "intact" before issue 61
        copy = evil.parent / f"{out.name}.jsonl"
        copy.write_bytes((out / "stages/split/eval.jsonl").read_bytes())
        (out / "stages/split/eval.jsonl").unlink()
        (out / "stages/split/eval.jsonl").symlink_to(copy)

    tampered("files.eval = ${run_dir}/../evil/eval.jsonl", token)
    tampered("eval.jsonl a link out of the run folder", link)


def issue41_scenarios() -> Tally:
    started = time.monotonic()
    tally = Tally()
    print("issue 41 faults, each through the real CLI:")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for scenario in (echoed_key, run_names, tampered_baselines, yaml_bombs, locked_cache, refused_values,
                         bench_writes, manifest_paths):
            scenario(root, tally)
    print(f"key leaks:                     {tally.key_leaks}")
    print(f"run folders outside runs/:     {tally.escapes}")
    print(f"gates turned off:              {tally.gates_off}")
    print(f"files written outside their place: {tally.misplaced}")
    print(f"hangs:                         {tally.hangs}")
    print(f"tracebacks:                    {tally.tracebacks}")
    print(f"wrong exit statuses:           {tally.wrong_status}")
    for note in tally.notes:
        print(f"  note: {note}")
    print(f"time: {time.monotonic() - started:.1f}s")
    return tally


if __name__ == "__main__":
    issue41_scenarios()
