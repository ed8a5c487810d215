"""The example third-party plugin (``tests/plugins/alpacafarm_example``), built and called as alpacafarm does.

In-process: its hooks register lazy, described targets and ``Registry.create`` builds each of them (the
``register_test_plugin`` pattern CONTRIBUTING.md recommends to plugin authors). In fresh processes, with the
plugin pip-installed on ``PYTHONPATH``: ``alpacafarm plugins``, ``alpacafarm annotate --annotator
prefer_longer``, and ``alpacafarm run`` of a recipe with ``echo_longest`` as a stage and ``length_win_rate``
judged by ``prefer_longer`` as its evaluation. Nothing here imports torch.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import EXAMPLE_PLUGIN, REPO_ROOT, run_cli

from alpacafarm.testing import write_records

REGISTERS = {"annotator": ["prefer_longer"], "command": ["example-hello"], "evaluator": ["length_win_rate"],
             "method": ["echo_longest"]}
HOOK_KINDS = {"register_methods": "method", "register_annotators": "annotator",
              "register_evaluators": "evaluator", "register_commands": "command"}


@pytest.fixture
def env(example_plugin_site: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(example_plugin_site)}


@pytest.fixture
def example_module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The plugin's hook module, imported from its source folder (no dist-info: no entry point sees it)."""
    monkeypatch.syspath_prepend(str(EXAMPLE_PLUGIN))
    return importlib.import_module("alpacafarm_example")


@pytest.fixture
def registry(example_module: ModuleType, register_test_plugin, monkeypatch: pytest.MonkeyPatch):
    """The process registry with the example plugin registered in-process (and not also from an install)."""
    from alpacafarm.plugins import DISABLE_AUTOLOAD_ENV, get_registry

    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, "1")  # built-ins still load; a pip-installed copy would clash
    register_test_plugin(example_module, "example")
    return get_registry()


# ------------------------------------------------------------------------------------------------ in-process


def test_hooks_register_lazy_described_targets(example_module: ModuleType):
    seen: list[tuple[str, str, object, str]] = []
    for hook, kind in HOOK_KINDS.items():

        def register(name: str, target: object, *, description: str = "", _kind: str = kind) -> None:
            seen.append((_kind, name, target, description))

        getattr(example_module, hook)(register=register)
    expected = [(kind, name) for kind, names in REGISTERS.items() for name in names]
    assert sorted((kind, name) for kind, name, _, _ in seen) == sorted(expected)
    for kind, name, target, description in seen:
        assert isinstance(target, str) and target.startswith("alpacafarm_example.") and ":" in target, name
        assert description, f"{kind} {name!r} has no description"


def test_registry_builds_each_kind_with_its_base_class(registry):
    from alpacafarm.annotation import Annotator
    from alpacafarm.method import Method

    method = registry.create("method", "echo_longest", {"max_chars": 5})
    assert isinstance(method, Method) and method.config.max_chars == 5
    assert (method.requires, method.provides) == (("instructions",), "policy_outputs")

    evaluator = registry.create("evaluator", "length_win_rate", {"reference_field": "output"})
    assert isinstance(evaluator, Method) and evaluator.requires == ("policy",)
    assert (evaluator.provides, evaluator.annotator_role) == ("evaluation", "evaluation")
    assert evaluator.config.reference_field == "output"
    assert evaluator.config.references.builtin == "alpaca_eval_sample"

    annotator = registry.create("annotator", "prefer_longer", {"tie_margin": 2})
    assert isinstance(annotator, Annotator) and annotator.name == "prefer_longer"
    assert annotator.config.tie_margin == 2
    assert registry.entry("annotator", "prefer_longer").plugin == "example"


def test_prefer_longer_labels_pairs_as_evaluation_calls_it(registry):
    from alpacafarm.types import Pair

    pairs = [Pair("a", "short", "much longer"), Pair("b", "abcdef", "abc"), Pair("c", "abcd", "wxyz"),
             Pair("d", "same answer ", " same answer"), Pair("e", "abcde", "abc")]
    progress: list[tuple[int, float]] = []
    strict = registry.create("annotator", "prefer_longer", {})
    annotations = strict.annotate(pairs, lambda n, cost: progress.append((n, cost)))
    assert [a.preference for a in annotations] == [2, 1, 0, 0, 1]
    assert {a.annotator for a in annotations} == {"prefer_longer"} and progress == [(5, 0.0)]
    assert annotations[3].metadata == {"reason": "identical outputs"}  # identical_tie: never judged
    assert [a.metadata.get("length_difference") for a in annotations] == [-6, 3, 0, None, 2]

    lenient = registry.create("annotator", "prefer_longer", {"tie_margin": 2})
    assert [a.preference for a in lenient.annotate(pairs)] == [2, 1, 0, 0, 0]


def test_bad_config_blocks_are_one_line_errors(registry):
    from alpacafarm.errors import RecipeError

    with pytest.raises(RecipeError, match="unknown key 'colour'"):
        registry.create("annotator", "prefer_longer", {"colour": "red"})
    with pytest.raises(RecipeError, match="tie_margin must be at least 0, got -1"):
        registry.create("annotator", "prefer_longer", {"tie_margin": -1})
    with pytest.raises(RecipeError, match="unknown key 'reference'; did you mean 'references'"):
        registry.create("evaluator", "length_win_rate", {"reference": {"path": "refs.json"}})


# ---------------------------------------------------------------------------------------- fresh processes


def test_plugins_json_lists_exactly_what_it_registers(env: dict[str, str]):
    result = run_cli("plugins", "--json", env=env)
    assert result.returncode == 0, result.stderr
    example = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}["example"]
    assert example["distribution"] == "alpacafarm-example" and example["version"] == "0.3.0"
    assert example["module"] == "alpacafarm_example" and not example["builtin"] and example["error"] is None
    assert example["registers"] == REGISTERS


def test_listing_imports_none_of_its_targets(env: dict[str, str]):
    code = ("import sys\nfrom alpacafarm.cli import main\nmain(['plugins'])\n"
            "mine = sorted(m for m in sys.modules if m.startswith('alpacafarm_example'))\n"
            "print('IMPORTED=' + ','.join(mine))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                            env={**os.environ, **env}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "IMPORTED=alpacafarm_example\n" in result.stdout  # the hook module only: targets are lazy


PAIRS = [
    {"instruction": "a", "output_1": "short", "output_2": "much longer"},  # 5 vs 11 chars: output_2
    {"instruction": "b", "output_1": "abcdef", "output_2": "abc"},  # 6 vs 3: output_1
    {"instruction": "c", "output_1": "abcd", "output_2": "wxyz"},  # equal lengths: tie
    {"instruction": "d", "input": "x", "output_1": "abcde", "output_2": "abcd"},  # 5 vs 4: output_1
]


def _annotate(tmp_path: Path, env: dict[str, str], out_name: str,
              *options: str) -> tuple[subprocess.CompletedProcess, Path]:
    """``alpacafarm annotate pairs.json --annotator prefer_longer -o OUT_NAME [OPTIONS]``, a fresh process."""
    source = write_records(tmp_path / "pairs.json", PAIRS)
    out = tmp_path / out_name
    return run_cli("annotate", str(source), "--annotator", "prefer_longer", "-o", str(out), *options,
                   env=env), out


def test_annotate_command_writes_length_preferences(tmp_path: Path, env: dict[str, str]):
    result, out = _annotate(tmp_path, env, "strict.json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    assert [r["preference"] for r in rows] == [2, 1, 0, 1]
    assert [r["instruction"] for r in rows] == ["a", "b", "c", "d"] and rows[3]["input"] == "x"
    assert {r["annotator"] for r in rows} == {"prefer_longer"} and {r["price_usd"] for r in rows} == {0.0}
    assert json.loads(result.stdout.strip().splitlines()[-1])["ties"] == 1

    # --set reaches the config class
    result, out = _annotate(tmp_path, env, "margin.json", "--set", "tie_margin=1")
    assert result.returncode == 0, result.stderr
    assert [r["preference"] for r in json.loads(out.read_text())] == [2, 1, 0, 0]
    # a shared option this deterministic, free judge has no field for is refused, naming the flag
    result, out = _annotate(tmp_path, env, "seeded.json", "--seed", "3")
    assert result.returncode == 2 and not out.exists()
    assert result.stderr.strip().splitlines() == [
        "error: annotator 'prefer_longer' takes no --seed (its config fields: tie_margin)"]


@pytest.mark.parametrize(("setting", "message"), [
    ("colour=red", "annotator 'prefer_longer' takes no --set colour=... (its config fields: tie_margin)"),
    ("tie_margin=-1", "annotator 'prefer_longer': options: PreferLongerConfig: tie_margin must be at least 0, got -1"),
])
def test_annotate_command_rejects_bad_settings_in_one_line(tmp_path: Path, env: dict[str, str],
                                                           setting: str, message: str):
    result, out = _annotate(tmp_path, env, "out.json", "--set", setting)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {message}"]
    assert not out.exists()


# echo_longest answers with the longest sentence of each reference, cut at 40 characters here
INSTRUCTIONS = [
    {"instruction": "Name the capital of France.", "reference": "Yes. Paris is the capital of France."},
    {"instruction": "Add two and two.", "reference": "Two plus two is four."},
    {"instruction": "Describe the sea.", "input": "in one line",
     "reference": "Wet. The sea is a vast body of salty water covering most of the planet."},
    {"instruction": "Say hello.", "reference": "Hello there!"},
]
ECHOED = ["Paris is the capital of France.", "Two plus two is four.",
          "The sea is a vast body of salty water co", "Hello there!"]
# length_win_rate compares with these (6, 21 and 42 characters; none for "Say hello.")
REFERENCES = [
    {"instruction": "Name the capital of France.", "reference": "Paris."},
    {"instruction": "Add two and two.", "reference": "Two plus two is four."},
    {"instruction": "Describe the sea.", "input": "in one line",
     "reference": "The sea: a vast, salty body of water, deep"},
]


def test_recipe_runs_the_method_and_the_evaluator_with_the_annotator(tmp_path: Path, env: dict[str, str]):
    instructions = write_records(tmp_path / "instructions.jsonl", INSTRUCTIONS)
    references = write_records(tmp_path / "references.json", REFERENCES)
    recipe = tmp_path / "example.yaml"
    recipe.write_text(
        "name: example\n"
        f"data:\n  instructions: {{path: {instructions}}}\n"
        "stages:\n  - name: echo\n    method: echo_longest\n    config: {max_chars: 40}\n"
        "evaluation:\n"
        "  evaluator: length_win_rate\n"
        f"  config: {{references: {{path: {references}}}}}\n"
        "  annotator: {name: prefer_longer, config: {tie_margin: 0}}\n"
    )
    out = tmp_path / "run"
    result = run_cli("run", str(recipe), "--output-dir", str(out), env=env)
    assert result.returncode == 0, result.stderr

    echo = out / "stages" / "echo"
    rows = [json.loads(line) for line in (echo / "outputs.jsonl").read_text().splitlines()]
    assert [r["output"] for r in rows] == ECHOED and rows[2]["input"] == "in one line"
    assert json.loads((echo / "manifest.json").read_text())["artifact"]["metadata"]["n_outputs"] == 4

    evaluate = out / "stages" / "evaluate"
    manifest = json.loads((evaluate / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["inputs"]["policy"]["from"] == "echo"
    # Paris (31 vs 6 chars): win; identical answers: tie; the sea (40 vs 42): loss; no reference: unmatched
    metrics = json.loads((evaluate / "metrics.json").read_text())
    assert metrics == {"annotator": "prefer_longer", "n_pairs": 3, "n_unmatched": 1, "n_wins": 1,
                       "n_losses": 1, "n_ties": 1, "n_unparsed": 0, "win_rate": 50.0, "avg_length": 30.7,
                       "avg_reference_length": 23.0}
    annotations = json.loads((evaluate / "annotations.json").read_text())
    assert [a["output_2"] for a in annotations] == ECHOED[:3]
    assert [a["preference"] for a in annotations] == [2, 0, 1]
    assert "length_win_rate (judge: prefer_longer)" in result.stderr  # the results table (rich console)

    # A new judge config re-runs the evaluation only (annotator_role puts the judge in its fingerprint).
    echo_manifest = (echo / "manifest.json").read_text()
    again = run_cli("run", str(recipe), "--output-dir", str(out),
                    "--set", "evaluation.annotator.config.tie_margin=2", env=env)
    assert again.returncode == 0, again.stderr
    assert (echo / "manifest.json").read_text() == echo_manifest  # skipped: not rewritten
    metrics = json.loads((evaluate / "metrics.json").read_text())
    assert [metrics[k] for k in ("n_wins", "n_ties", "n_losses", "win_rate")] == [1, 2, 0, 66.67]


def test_command_prints_its_greeting_and_is_listed(env: dict[str, str]):
    hello = run_cli("example-hello", "tester", env=env)
    assert hello.returncode == 0 and hello.stdout.strip() == "hello tester from alpacafarm-example"
    assert "say hello from the example plugin" in " ".join(run_cli("--help", env=env).stdout.split())


# ------------------------------------------------------------------------------------------------ public names


def imported_names(source: str) -> list[tuple[str, str]]:
    """``(module, name)`` for every import in ``source`` (name "" for ``import module``)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found += [(node.module or "", alias.name) for alias in node.names]
    return found


def private_imports(source: str, own_package: str) -> list[str]:
    """What a third-party plugin must not import: a built-in plugin's modules (``alpacafarm_*``), or a private
    (``_``-prefixed) module or name of alpacafarm."""
    bad = []
    for module, name in imported_names(source):
        top = module.split(".")[0]
        if top.startswith("alpacafarm_") and top != own_package:
            bad.append(f"{module} (a built-in plugin)")
        elif top == "alpacafarm" and (any(part.startswith("_") for part in module.split(".")) or
                                      name.startswith("_")):
            bad.append(f"{module}:{name} (private)")
    return bad


def test_the_example_plugin_and_the_scaffold_import_only_public_alpacafarm_names(tmp_path: Path):
    from alpacafarm.scaffold import new_plugin

    sources = {path: "alpacafarm_example" for path in (EXAMPLE_PLUGIN / "alpacafarm_example").glob("*.py")}
    scaffold = new_plugin("helper-user", tmp_path)
    sources.update({path: "helper_user" for path in scaffold.rglob("*.py")})
    variant = new_plugin("variant-user", tmp_path, kind="direct-alignment")
    sources.update({path: "variant_user" for path in variant.rglob("*.py")})
    assert len(sources) >= 10
    offending = {str(path): private_imports(path.read_text(encoding="utf-8"), own)
                 for path, own in sources.items()}
    assert {path: bad for path, bad in offending.items() if bad} == {}
    # the scaffold's method is built from the public method helpers, which the built-ins use too
    method = (scaffold / "helper_user" / "method.py").read_text(encoding="utf-8")
    assert ("alpacafarm.reward_selection", "score_groups") in imported_names(method)
    builtin = (REPO_ROOT / "plugins" / "alpacafarm_methods" / "sampling" / "best_of_n.py").read_text(encoding="utf-8")
    assert ("alpacafarm.reward_selection", "score_groups") in imported_names(builtin)
    # the DPO variant subclasses the public stage and config that the built-in dpo is built from
    method = (variant / "variant_user" / "method.py").read_text(encoding="utf-8")
    assert {("alpacafarm.preference_training", "DirectAlignment"),
            ("alpacafarm.preference_training", "DPOMethodConfig")} <= set(imported_names(method))
    builtin = (REPO_ROOT / "plugins" / "alpacafarm_methods" / "preference" / "dpo.py").read_text(encoding="utf-8")
    assert ("alpacafarm.preference_training", "DirectAlignment") in imported_names(builtin)
    # the check itself sees what it must refuse
    assert private_imports("from alpacafarm_methods.sampling.best_of_n import BestOfN\nfrom alpacafarm.x import _y\n"
                           "import alpacafarm._z\n", "mine") == [
        "alpacafarm_methods.sampling.best_of_n (a built-in plugin)", "alpacafarm.x:_y (private)",
        "alpacafarm._z: (private)"]
