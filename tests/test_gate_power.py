"""benchmarks/gate_power.py: the power a gate of a finished run's systems would have, and the instructions its
rule (MDE at most a third of the smallest gain) would need."""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_program():
    spec = importlib.util.spec_from_file_location("gate_power", ROOT / "benchmarks" / "gate_power.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(run: Path, n: int, copies: int = 1, gain: float = 0.06, status: str = "complete") -> None:
    """Three judged systems on ``n`` instructions (each repeated ``copies`` times under new names, so the scores'
    spread is the same and only n grows): a base, a system ``gain`` better on average, one twice that, each handed
    on by an evaluation stage whose manifest says ``status``."""
    rng = random.Random(0)
    base = [min(max(rng.gauss(0.5, 0.2), 0.01), 0.99) for _ in range(n)]
    noise = [[rng.gauss(0.0, 0.12) for _ in range(n)] for _ in range(2)]
    systems = {"sft_outputs": base,
               "trained": [min(max(b + gain + e, 0.0), 1.0) for b, e in zip(base, noise[0], strict=True)],
               "best/best_of_8": [min(max(b + 2 * gain + e, 0.0), 1.0) for b, e in zip(base, noise[1], strict=True)]}
    from alpacafarm.artifacts import Artifact, JudgedSystem

    stage = run / "stages" / "evaluate"
    judged = []
    for name, values in systems.items():
        folder = stage / "systems" / name.replace("/", "__")
        folder.mkdir(parents=True)
        records = [{"instruction": f"instruction {i} copy {c}", "input": "", "output_1": "reference",
                    "output_2": f"{name} {i}", "preference": 1.0 + v}
                   for c in range(copies) for i, v in enumerate(values)]
        (folder / "annotations.json").write_text(json.dumps(records), encoding="utf-8")
        judged.append(JudgedSystem(name, name.split("/")[0], str(folder / "annotations.json")))
    # the evaluation's hand-off, recorded as a finished stage records it
    artifact = Artifact("evaluation", str(stage), judged=judged)
    (stage / "manifest.json").write_text(json.dumps({"status": status, "artifact": artifact.to_json(run)}),
                                         encoding="utf-8")


def test_the_instructions_it_says_are_needed_bring_the_mde_under_a_third_of_the_smallest_gain(tmp_path, capsys):
    program = load_program()
    write_run(tmp_path / "small", 64)
    assert program.main([str(tmp_path / "small"), "--base", "sft_outputs"]) == 0
    out = capsys.readouterr().out
    needed = int(re.search(r"about (\d+) instructions would be needed", out).group(1))
    mde, third = (float(x) for x in re.search(r"largest MDE ([\d.]+) against a third of the smallest gain ([\d.]+)",
                                               out).groups())
    assert mde > third
    assert "best_of_8" in out and "trained" in out

    copies = -(-needed // 64)        # the same instructions' spread, at least the number it named
    write_run(tmp_path / "large", 64, copies=copies)
    assert program.main([str(tmp_path / "large"), "--base", "sft_outputs"]) == 0
    out = capsys.readouterr().out
    assert ": met" in out, out


def test_a_system_that_was_not_judged_is_named_and_exits_2(tmp_path, capsys):
    program = load_program()
    write_run(tmp_path, 16)
    assert program.main([str(tmp_path), "--base", "sft_outputs", "--systems", "ppo_outputs@48"]) == 2
    err = capsys.readouterr().err
    assert "ppo_outputs@48" in err and "trained" in err
    assert program.main([str(tmp_path / "nowhere"), "--base", "sft_outputs"]) == 2
    assert "is missing: run the recipe's evaluation to the end first" in capsys.readouterr().err
    write_run(tmp_path / "interrupted", 16, status="running")   # annotations on disk, the stage not finished
    assert program.main([str(tmp_path / "interrupted"), "--base", "sft_outputs"]) == 2
    assert "status 'running'" in capsys.readouterr().err


def test_systems_are_named_as_the_evaluation_named_them(tmp_path, capsys):
    """A best-of-n system is ``stage/best_of_n`` in the results; its folder's name is not what the user types."""
    program = load_program()
    write_run(tmp_path, 32)
    assert program.main([str(tmp_path), "--base", "sft_outputs", "--systems", "best/best_of_8"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("best/best_of_8 ")


def test_gains_are_paired_differences_in_points(tmp_path, capsys):
    program = load_program()
    write_run(tmp_path, 200, gain=0.05)
    assert program.main([str(tmp_path), "--base", "sft_outputs", "--systems", "trained"]) == 0
    line = next(li for li in capsys.readouterr().out.splitlines() if li.startswith("trained"))
    gain = float(line.split()[2])
    assert 3.5 < gain < 6.5      # +5 points by construction, less where the clip at 0 and 1 bites
