"""Every file or value a person may edit goes through one validated loader (issue 41, cases 3, 6-8, 10-13).

Table-driven: each loader is fed the variants an adversarial pass found (non-finite and out-of-range numbers,
wrong types, deep nesting, alias bombs, include fan-out); each must refuse in one line naming the file and the
field, exit status 2, quickly, and never with a traceback.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO_ROOT, run_cli

from alpacafarm.errors import UserError
from alpacafarm.validated_input import json_ready, parse_json
from alpacafarm_evaluation.bench_baseline import read_baseline

BASELINE = REPO_ROOT / "benchmarks/baselines/best_of_n.json"


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        *parents, last = path.split(".")
        node = data
        for part in parents:
            node = node[part] if isinstance(node, dict) else node[int(part)]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return edit


def _first_row(data: dict) -> dict:
    system = next(iter(data["systems"].values()))
    return next(iter(system["instructions"].values()))


#: (id, edit of a valid baseline, text the one-line error must hold)
BASELINE_VARIANTS: list[tuple[str, Callable[[dict], None], str]] = [
    ("margin-1e9", _set("gate.margin", 1e9), "gate.margin: must be in (0, 20]"),
    ("margin-nan", _set("gate.margin", math.nan), "not JSON (NaN is not a finite number)"),
    ("margin-negative", _set("gate.margin", -5), "gate.margin: must be in (0, 20]"),
    ("margin-string", _set("gate.margin", "5"), "gate.margin: must be a number, got a string"),
    ("margin-bool", _set("gate.margin", True), "gate.margin: must be a number, got a boolean"),
    ("alpha-2", _set("gate.alpha", 2), "gate.alpha: must be in [0.001, 0.2]"),
    ("alpha-zero", _set("gate.alpha", 0), "gate.alpha: must be in [0.001, 0.2]"),
    ("power-negative", _set("gate.power", -1), "gate.power: must be in [0.5, 0.99]"),
    ("gate-list", _set("gate", [5, 0.05]), "gate: must be an object, got a list"),
    ("fingerprints-list", _set("fingerprints", ["a"]), "fingerprints: must be an object, got a list"),
    ("fingerprint-number", _set("fingerprints.judge", 3), "fingerprints.judge: must be a string"),
    ("protocol-list", _set("protocol", [1, 2]), "protocol: must be an object, got a list"),
    ("judge-list", _set("judge", []), "judge: must be an object"),
    ("probe-labels-number", _set("judge.probe_labels", 3), "judge.probe_labels: must be a list"),
    ("probe-not-list", _set("judge_probe", {"a": 1}), "judge_probe: must be a list"),
    ("probe-item-number", _set("judge_probe.0", 7), "judge_probe[0]: must be an object"),
    ("probe-missing-output", lambda d: d["judge_probe"][0].pop("output_2"), "judge_probe[0].output_2: missing"),
    ("probe-output-number", _set("judge_probe.0.output_1", 1.5), "judge_probe[0].output_1: must be a string"),
    ("score-nan", lambda d: _first_row(d).update(score=math.nan), "not JSON (NaN is not a finite number)"),
    ("score-infinity", lambda d: _first_row(d).update(score=math.inf), "not JSON (Infinity is not a finite"),
    ("score-7", lambda d: _first_row(d).update(score=7), ".score: must be in [0, 1], got 7"),
    ("score-string", lambda d: _first_row(d).update(score="1"), ".score: must be a number, got a string"),
    ("win-rate-string", lambda d: next(iter(d["systems"].values())).update(win_rate="x"), "win_rate: must be"),
    ("systems-list", _set("systems", []), "systems: must be an object, got a list"),
    ("instructions-list", lambda d: next(iter(d["systems"].values())).update(instructions=[]),
     "instructions: must be an object"),
]


def _write(tmp_path: Path, edit: Callable[[dict], None]) -> Path:
    data = json.loads(BASELINE.read_text(encoding="utf-8"))
    edit(data)
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(data), encoding="utf-8")  # json.dumps writes NaN as a hand edit would
    return path


def test_the_committed_baselines_are_valid():
    for path in sorted((REPO_ROOT / "benchmarks/baselines").glob("*.json")):
        assert read_baseline(path)["gate"]


@pytest.mark.parametrize("edit,message", [v[1:] for v in BASELINE_VARIANTS], ids=[v[0] for v in BASELINE_VARIANTS])
def test_a_tampered_baseline_is_one_line_naming_the_field(tmp_path: Path, edit: Callable, message: str):
    path = _write(tmp_path, edit)
    with pytest.raises(UserError) as caught:
        read_baseline(path)
    text = str(caught.value)
    assert "\n" not in text and str(path) in text and message in text, text


def test_a_baseline_nested_100k_deep_is_refused_at_once(tmp_path: Path):
    path = tmp_path / "deep.json"
    path.write_text('{"format": "alpacafarm-bench-baseline/1", "gate": ' + "[" * 100_000 + "]" * 100_000 + "}")
    started = time.monotonic()
    with pytest.raises(UserError, match=r"nested 100001 levels deep \(at most 64\)"):
        read_baseline(path)
    assert time.monotonic() - started < 2


def test_a_tampered_baseline_exits_2_in_one_line_before_anything_runs(tmp_path: Path):
    """Through the CLI: exit 2 (a refused input), never 1 (CI would read FAIL) nor 5 (a crash)."""
    for edit in (_set("gate.margin", math.nan), _set("judge_probe.0", {"instruction": 3})):
        path = _write(tmp_path, edit)
        result = run_cli("bench", "recipes/bench/best_of_n.yaml", "--baseline", str(path))
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and str(path) in result.stderr


@pytest.mark.parametrize("flag,value", [("--margin", "inf"), ("--margin", "1e9"), ("--margin", "nan"),
                                        ("--alpha", "0.9"), ("--power", "0.1")])
def test_a_gate_flag_outside_its_bounds_is_refused(flag: str, value: str):
    from alpacafarm_evaluation.bench import parse_args

    with pytest.raises(UserError, match=f"{flag} must be (in|a finite number)"):
        parse_args(["r.yaml", "--baseline", "b.json", flag, value])


def test_a_protocol_other_than_the_baselines_is_in_the_first_line():
    from alpacafarm_evaluation.bench import protocol_changes, summary_line

    changes = protocol_changes({"margin": 5.0, "alpha": 0.05, "power": 0.8},
                               {"margin": 10.0, "alpha": 0.05, "power": 0.8})
    report = {"verdict": "PASS", "margin": 10.0, "alpha": 0.05, "alpha_per_system": 0.025, "exit_code": 0,
              "protocol_changes": changes}
    assert "NOT the baseline's protocol: margin 5 -> 10" in summary_line(report)


def test_json_reports_never_hold_bare_nan_or_infinity():
    report = {"verdict": "FAIL", "systems": [{"delta": math.nan, "p_value": math.inf, "n": 3}]}
    text = json.dumps(json_ready(report), allow_nan=False)
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text)["systems"][0] == {"delta": None, "p_value": None, "n": 3}
    with pytest.raises(UserError, match="not JSON"):
        parse_json('{"a": NaN}', "x.json")



# ------------------------------------------------------------------------------------------- YAML: bombs, fan-out
#: Nine levels of nine aliases: 9^9 (387 million) strings once expanded, from a few hundred bytes.
ALIAS_BOMB = "[&a [x,x,x,x,x,x,x,x,x]" + "".join(
    f", &{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi", strict=True)) + "]"
SPLIT_RECIPE = "name: r\nstages:\n  - {name: split, method: split_instructions}\n"


@pytest.mark.parametrize("key", ["extra_field", "stages.split.config.backend_config", "annotator.config.overrides",
                                 "description"])
def test_an_alias_bomb_in_set_is_refused_at_once(tmp_path: Path, key: str):
    from alpacafarm.recipe import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(SPLIT_RECIPE + "annotator: offline\n", encoding="utf-8")
    started = time.monotonic()
    with pytest.raises(UserError, match=r"more than 100,000 values once YAML aliases are expanded"):
        load_recipe(recipe, [f"{key}={ALIAS_BOMB}"])
    assert time.monotonic() - started < 5


def test_an_alias_bomb_in_a_template_file_is_refused_at_once(tmp_path: Path):
    from alpacafarm_annotators.templates import load_template

    template = tmp_path / "t.yaml"
    template.write_text(f"system: hi\nbomb: {ALIAS_BOMB}\n", encoding="utf-8")
    started = time.monotonic()
    with pytest.raises(UserError, match=r"template file .*t\.yaml.*more than 100,000 values"):
        load_template(str(template))
    assert time.monotonic() - started < 5


def test_includes_that_fan_out_are_refused_at_once(tmp_path: Path):
    from alpacafarm.recipe import load_recipe

    for i in range(10):  # each file includes the next ten times: 10^10 reads
        includes = "" if i == 9 else "include: [" + ", ".join([f"f{i + 1}.yaml"] * 10) + "]\n"
        (tmp_path / f"f{i}.yaml").write_text(includes + f"description: level {i}\n", encoding="utf-8")
    (tmp_path / "r.yaml").write_text("include: f0.yaml\n" + SPLIT_RECIPE, encoding="utf-8")
    started = time.monotonic()
    with pytest.raises(UserError, match=r"r\.yaml: more than 64 files read through include"):
        load_recipe(tmp_path / "r.yaml")
    assert time.monotonic() - started < 5


def test_a_set_value_keeps_its_yaml_meaning():
    from alpacafarm.yamlsource import parse_override

    assert parse_override("a.b=2e-5") == (["a", "b"], 2e-5)
    assert parse_override("a='2e-5'") == (["a"], "2e-5")
    assert parse_override("a=[1, {b: c}]") == (["a"], [1, {"b": "c"}])
    assert parse_override("a=: not yaml: [") == (["a"], ": not yaml: [")
    assert parse_override("a=") == (["a"], "")


# ------------------------------------------------------------------------------------------------ plugin new
@pytest.mark.parametrize("name", ["alpacafarm-methods", "alpacafarm_annotators", "os", "json", "torch", "trl",
                                  "pydantic", "transformers", "pluggy", "typing-extensions"])
def test_plugin_new_refuses_a_name_already_in_use(tmp_path: Path, name: str):
    from alpacafarm.scaffold import new_plugin

    with pytest.raises(UserError, match=rf"plugin name '{name}': .*(already|standard-library).*pick another"):
        new_plugin(name, tmp_path)
    assert not (tmp_path / name).exists()


def test_plugin_new_takes_a_fresh_name(tmp_path: Path):
    from alpacafarm.scaffold import package_name

    assert package_name("my-rerank-9f3a") == "my_rerank_9f3a"


# --------------------------------------------------------------------- recipe check refuses what a run would
#: (id, the stage config or annotator block, the one-line error's text)
RUN_REFUSALS = [
    ("lr-negative", "dpo: {learning_rate: -1}", "stages[0].config: DPOMethodConfig: learning_rate must be"),
    ("lr-nan", "dpo: {learning_rate: .nan}", "learning_rate must be a finite number"),
    ("batch-0", "dpo: {per_device_train_batch_size: 0}", "per_device_train_batch_size must be a finite number >= 1"),
    ("accumulation-0", "dpo: {gradient_accumulation_steps: 0}", "gradient_accumulation_steps must be"),
    ("max-length-1", "dpo: {max_length: 1}", "max_length must be a finite number >= 8, got 1"),
    ("max-steps-0", "dpo: {max_steps: 0}", "max_steps must be -1"),
    ("p-label-flip", "annotator: {name: offline_ann, config: {p_label_flip: 1.5}}",
     "annotator.config.p_label_flip: Input should be less than or equal to 0.5"),
    ("concurrency-0", "annotator: {name: gpt4_b1_noex, config: {max_concurrency: 0}}",
     "annotator.config.max_concurrency: Input should be greater than or equal to 1"),
]


@pytest.mark.parametrize("block,message", [v[1:] for v in RUN_REFUSALS], ids=[v[0] for v in RUN_REFUSALS])
def test_recipe_check_refuses_a_value_the_run_would(tmp_path: Path, block: str, message: str):
    from alpacafarm.recipe import load_recipe

    (tmp_path / "prefs.jsonl").write_text('{"instruction": "a", "output_1": "x", "output_2": "y", "preference": 1}\n')
    config = block[len("dpo: "):] if block.startswith("dpo: ") else "{}"
    annotator = block if block.startswith("annotator: ") else "annotator: offline_ann"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nmodel: {{name: smollm2-135m-instruct}}\n{annotator}\n"
                      f"data:\n  preferences: {{path: {tmp_path / 'prefs.jsonl'}}}\n"
                      f"stages:\n  - {{name: dpo, method: dpo, config: {config}}}\n", encoding="utf-8")
    with pytest.raises(UserError) as caught:
        load_recipe(recipe)
    assert "\n" not in str(caught.value) and message in str(caught.value), str(caught.value)


def test_records_and_manifests_nested_too_deeply_are_one_line(tmp_path: Path):
    from alpacafarm.data import read_records

    for name in ("deep.jsonl", "deep.json"):
        path = tmp_path / name
        path.write_text('[{"a": ' + "[" * 100_000 + "]" * 100_000 + "}]\n")
        with pytest.raises(UserError, match="nested too deeply"):
            read_records(path)
