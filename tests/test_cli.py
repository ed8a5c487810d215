"""The command line in fresh processes: cheap --help, plugin listing, recipe check, third-party and broken plugins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, run_cli

from alpacafarm.cli import main as cli_main


def test_help_imports_neither_torch_nor_trl():
    code = (
        "import sys\n"
        "from alpacafarm.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in ('torch', 'trl', 'transformers', 'pydantic', 'datasets') if m in sys.modules)\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "run" in result.stdout and "plugins" in result.stdout
    assert "HEAVY=\n" in result.stdout


def test_importtime_of_help_shows_no_torch():
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "alpacafarm", "--help"], capture_output=True,
                            text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 0
    imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line}
    assert "alpacafarm" in imported and "pluggy" in imported
    assert not imported & {"torch", "trl", "transformers"}


def test_plugins_json_lists_the_builtins():
    result = run_cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    assert plugins["data"]["builtin"] and plugins["data"]["distribution"] == "alpacafarm"
    assert plugins["data"]["registers"]["method"] == ["preference_data", "split_instructions"]
    assert plugins["models"]["registers"]["method"] == ["inspect_model"]
    assert all(p["error"] is None for p in plugins.values())


@pytest.mark.parametrize("recipe", sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / "recipes").rglob("*.yaml")),
                         ids=str)
def test_every_shipped_recipe_passes_check(recipe: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch):
    # In-process (one TRL import for all of them, not one per recipe); the console command itself is covered by
    # test_recipe_check_from_the_console below.
    monkeypatch.chdir(REPO_ROOT)
    assert cli_main(["recipe", "check", str(recipe)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith(f"ok: {recipe}")
    # Every input that several stages provide is named: an unnamed one takes the latest, which a shipped recipe
    # must not leave to chance (recipes/ensembles.yaml's "single proxy" rows once optimised the ensemble).
    assert "warning:" not in out


def test_recipe_check_from_the_console():
    result = run_cli("recipe", "check", "recipes/quickstart.yaml", cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: recipes/quickstart.yaml")


def fake_distribution(site: Path, name: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """A minimal installed distribution (dist-info + modules) on a folder that goes on PYTHONPATH."""
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[alpacafarm]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    for module, source in modules.items():
        (site / f"{module}.py").write_text(source)


@pytest.fixture
def broken_plugin_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    fake_distribution(site, "alpacafarm-broken", {"broken": "alpacafarm_broken"},
                       {"alpacafarm_broken": "import a_module_that_does_not_exist\n"})
    return site


def test_a_plugin_that_fails_to_import_is_reported_and_the_rest_work(broken_plugin_site: Path):
    env = {"PYTHONPATH": str(broken_plugin_site)}
    result = run_cli("plugins", "--json", env=env)
    assert result.returncode == 0
    plugins = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    error = plugins["broken"]["error"]
    assert "ModuleNotFoundError" in error and "a_module_that_does_not_exist" in error
    assert plugins["data"]["error"] is None
    assert "plugin 'broken' (alpacafarm-broken) failed to load" in result.stderr
    check = run_cli("recipe", "check", "recipes/quickstart.yaml", env=env)
    assert check.returncode == 0, check.stderr


def test_unknown_method_from_a_broken_plugin_exits_2_and_names_it(broken_plugin_site: Path, tmp_path: Path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nstages:\n  - name: s\n    method: broken_method\n")
    out = tmp_path / "run"
    result = run_cli("run", str(recipe), "--output-dir", str(out), env={"PYTHONPATH": str(broken_plugin_site)})
    assert result.returncode == 2
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1
    assert "unknown method 'broken_method'" in error_lines[0] and "broken (ModuleNotFoundError" in error_lines[0]
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_a_plugin_registering_a_taken_name_is_an_error_naming_both(tmp_path: Path):
    """Duplicate names are an error naming both plugins (tests/test_user_errors.py checks every command's output)."""
    site = tmp_path / "site"
    source = ("from alpacafarm import hookimpl\n\n@hookimpl\ndef register_methods(register):\n"
              "    register('split_instructions', 'alpacafarm.method:Method')\n")
    fake_distribution(site, "alpacafarm-clash", {"clash": "alpacafarm_clash"}, {"alpacafarm_clash": source})
    result = run_cli("recipe", "check", "recipes/quickstart.yaml", env={"PYTHONPATH": str(site)})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "error: plugin name clash: plugin 'clash' (alpacafarm-clash) registers method 'split_instructions', which "
        "plugin 'data' registers too; duplicate names are an error: uninstall one of the two plugins, or leave "
        "'clash' out of ALPACAFARM_PLUGINS")
    allowed = run_cli("recipe", "check", "recipes/quickstart.yaml",
                      env={"PYTHONPATH": str(site), "ALPACAFARM_PLUGINS": "someone_else"})
    assert allowed.returncode == 0 and "split_instructions (data)" in allowed.stdout, allowed.stderr


def test_autoload_switch_and_allow_list(broken_plugin_site: Path):
    env = {"PYTHONPATH": str(broken_plugin_site), "ALPACAFARM_DISABLE_PLUGIN_AUTOLOAD": "1"}
    names = {p["name"] for p in json.loads(run_cli("plugins", "--json", env=env).stdout)["plugins"]}
    assert "broken" not in names and {"data", "models"} <= names  # built-ins always load
    env = {"PYTHONPATH": str(broken_plugin_site), "ALPACAFARM_PLUGINS": "someone_else"}
    names = {p["name"] for p in json.loads(run_cli("plugins", "--json", env=env).stdout)["plugins"]}
    assert "broken" not in names
    env = {"PYTHONPATH": str(broken_plugin_site), "ALPACAFARM_PLUGINS": "broken"}
    names = {p["name"] for p in json.loads(run_cli("plugins", "--json", env=env).stdout)["plugins"]}
    assert "broken" in names


def test_third_party_plugin_is_listed_and_its_method_runs(example_plugin_site: Path, tmp_path: Path):
    """A smoke test of an installed third-party plugin (tests/test_example_plugin.py checks each part)."""
    env = {"PYTHONPATH": str(example_plugin_site)}
    plugins = {p["name"]: p for p in json.loads(run_cli("plugins", "--json", env=env).stdout)["plugins"]}
    example = plugins["example"]
    assert example["distribution"] == "alpacafarm-example" and example["version"] == "0.3.0"
    assert not example["builtin"] and example["error"] is None
    assert example["registers"] == {"annotator": ["prefer_longer"], "command": ["example-hello"],
                                    "evaluator": ["length_win_rate"], "method": ["echo_longest"]}

    recipe = tmp_path / "third_party.yaml"
    recipe.write_text(
        "name: third_party\n"
        "data:\n  instructions: {builtin: alpaca_eval_sample, limit: 5}\n"
        "annotator: prefer_longer\n"
        "stages:\n  - name: echo\n    method: echo_longest\n    config: {max_chars: 40}\n"
        "evaluation: {evaluator: length_win_rate}\n"
    )
    out = tmp_path / "run"
    result = run_cli("run", str(recipe), "--output-dir", str(out), env=env)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (out / "stages" / "echo" / "outputs.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and all(0 < len(r["output"]) <= 40 for r in rows)
    # every answer is a piece of the (default) reference, so the length judge never prefers it
    metrics = json.loads((out / "stages" / "evaluate" / "metrics.json").read_text())
    assert metrics["annotator"] == "prefer_longer" and metrics["n_pairs"] == 5 and metrics["n_wins"] == 0
    assert metrics["avg_length"] <= 40 < metrics["avg_reference_length"]

    hello = run_cli("example-hello", "tester", env=env)
    assert hello.returncode == 0 and hello.stdout.strip() == "hello tester from alpacafarm-example"
    assert "example-hello" in run_cli("--help", env=env).stdout


def test_plugin_commands_parse_their_own_options():
    result = run_cli("annotate", "--help")
    assert result.returncode == 0 and "usage: alpacafarm annotate" in result.stdout and "--annotator" in result.stdout


def test_debug_shows_the_traceback(tmp_path: Path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("name: x\nstages: []\n")
    plain = run_cli("recipe", "check", str(recipe))
    debug = run_cli("--debug", "recipe", "check", str(recipe))
    assert plain.returncode == debug.returncode == 2
    assert "Traceback" not in plain.stderr and "Traceback" in debug.stderr
    assert "stages" in plain.stderr.strip().splitlines()[-1]


def test_environment_is_offline():
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"
