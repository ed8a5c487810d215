"""Every error a user can cause is one line naming the culprit, exit status 2, no traceback; secrets never echo.

Each test runs the real CLI in a fresh, offline process. The one-line form is checked strictly: the whole of
stderr is a single ``error: ...`` line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import fake_distribution

from alpacafarm.testing import offline_environment, write_records

REPO_ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-proj-Xq7vT2mLp9RwZ4kN8sHd3JfY6cBg1AeU5oIi0"
HEX_KEY = "9f2c4e7a1b3d5f60a8c2e4f6b1d3a5c7"
SPLIT = "stages:\n  - name: split\n    method: split_instructions\n"
PAIRS = [{"instruction": "Say hi", "output_1": "hi", "output_2": "Hello there, nice to meet you."}]


@pytest.fixture
def cli(tmp_path: Path):
    """``cli(*args, env=..., cwd=...)``: ``python -m alpacafarm ARGS`` offline, with its own cache directory."""

    def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        full = {**os.environ, **offline_environment(tmp_path / "hf_home"),
                "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "200", **(env or {})}
        return subprocess.run([*prefix, sys.executable, "-m", "alpacafarm", *args], capture_output=True, text=True,
                              env=full, cwd=cwd or REPO_ROOT, timeout=300)

    return run


def one_error_line(result: subprocess.CompletedProcess, *culprits: str) -> str:
    """The single ``error:`` line that is all of stderr, after checking exit status 2 and no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for culprit in culprits:
        assert culprit in lines[0], (culprit, lines[0])
    return lines[0]


def pairs_file(tmp_path: Path) -> Path:
    return write_records(tmp_path / "pairs.json", PAIRS)


def full_device(tmp_path: Path) -> Path:
    """A path whose writes fail with ENOSPC: /dev/full, or (as root, who could replace /dev/full by mistake) a
    private copy of it made with mknod."""
    if os.geteuid() != 0:
        if not os.path.exists("/dev/full"):
            pytest.skip("no /dev/full on this system: a full disk cannot be simulated")
        return Path("/dev/full")
    copy = tmp_path / "full"
    try:
        os.mknod(copy, 0o666 | 0o020000, os.makedev(1, 7))  # character device 1,7 = full
    except OSError as exc:
        pytest.skip(f"cannot create a /dev/full device node: {exc}")
    return copy


# ----------------------------------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("block", ["config", "inputs"])
def test_a_key_with_no_value_names_its_line(tmp_path: Path, cli, block: str):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\n{SPLIT}    {block}:\n", encoding="utf-8")
    line = one_error_line(cli("recipe", "check", str(recipe)), "r.yaml:5", f"stages[0].{block}", "has no value")
    assert f"nothing after '{block}:'" in line


def test_a_plugin_block_with_no_value_names_its_line(tmp_path: Path, cli):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nannotator:\n  name: offline\n  config:\n{SPLIT}", encoding="utf-8")
    one_error_line(cli("recipe", "check", str(recipe)), "r.yaml:4", "annotator.config", "has no value")


def test_a_recipe_that_is_not_utf8_names_the_file_and_line(tmp_path: Path, cli):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes(f"name: r\ndescription: caf\xe9\n{SPLIT}".encode("latin-1"))
    one_error_line(cli("recipe", "check", str(recipe)), "latin1.yaml", "not UTF-8", "line 2")
    top = tmp_path / "top.yaml"  # through an include too
    top.write_text("include: latin1.yaml\nname: t\n", encoding="utf-8")
    one_error_line(cli("recipe", "check", str(top)), "latin1.yaml", "not UTF-8")


def test_a_data_file_that_is_not_utf8_names_the_file(tmp_path: Path, cli):
    data = tmp_path / "pairs.jsonl"
    data.write_bytes(b'{"instruction": "a", "output_1": "b", "output_2": "c"}\n{"instruction": "caf\xe9"}\n')
    one_error_line(cli("annotate", str(data), "--annotator", "offline", "-o", str(tmp_path / "out.json")),
                   "pairs.jsonl", "not UTF-8", "line 2")


# --------------------------------------------------------------------------------------------- paths and disks


@pytest.mark.slow
def test_a_run_directory_that_is_a_file(tmp_path: Path, cli):
    blocker = tmp_path / "taken"
    blocker.write_text("a file, not a run directory\n")
    recipe = REPO_ROOT / "recipes" / "quickstart.yaml"
    one_error_line(cli("run", str(recipe), "--output-dir", str(blocker)), str(blocker), "is a file")
    # the same for a run directory below a file (what a read-only disk test does as root: see below)
    one_error_line(cli("run", str(recipe), "--output-dir", str(blocker / "run")), str(blocker), "is a file")
    assert blocker.read_text() == "a file, not a run directory\n"


def permission_checked() -> tuple[str, ...]:
    """A command prefix under which folder permissions apply: none for a user; for root, ``setpriv`` without the
    capabilities that let root write anywhere (skip where that is not possible)."""
    if os.geteuid() != 0:
        return ()
    prefix = ("setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--")
    try:
        subprocess.run([*prefix, "true"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("running as root without setpriv (or it may not drop capabilities): root writes into read-only "
                    "folders; test_a_run_directory_that_is_a_file covers the path error")
    return prefix


def test_a_read_only_folder_names_the_path(tmp_path: Path, cli):
    prefix = permission_checked()
    folder = tmp_path / "ro"
    folder.mkdir()
    pairs = pairs_file(tmp_path)
    folder.chmod(0o555)
    try:
        result = cli("run", "recipes/quickstart.yaml", "--output-dir", str(folder / "run"), prefix=prefix)
        one_error_line(result, str(folder / "run"), "permission denied")
        result = cli("compare", "paper", "--x", "simulated", "--y", "human", "--plot", str(folder / "p.png"),
                     prefix=prefix)
        one_error_line(result, str(folder / "p.png"), "permission denied")
        result = cli("annotate", str(pairs), "--annotator", "offline", "-o", str(folder / "out.json"), prefix=prefix)
        one_error_line(result, str(folder / "out.json"), "permission denied")  # checked before annotating
    finally:
        folder.chmod(0o755)


def test_a_cache_directory_under_a_file_names_the_variable(tmp_path: Path, cli):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = cli("annotate", str(pairs_file(tmp_path)), "--annotator", "offline_ann", "-o", str(tmp_path / "o.json"),
                 env={"ALPACAFARM_CACHE_DIR": str(blocker / "cache")})  # a pool opens the annotation cache
    one_error_line(result, "$ALPACAFARM_CACHE_DIR", str(blocker / "cache"), "is a file")


def test_a_full_disk_names_the_path_and_enospc(tmp_path: Path, cli):
    full = full_device(tmp_path)
    result = cli("compare", "paper", "--x", "simulated", "--y", "human", "--n-bootstrap", "10", "--plot", str(full))
    one_error_line(result, f"cannot write {full}", "no space left on device (ENOSPC)")


@pytest.mark.slow
def test_annotate_into_a_full_disk_names_the_path(tmp_path: Path, cli):
    """The atomic writer writes straight into a device it cannot replace (``-o /dev/stdout`` works too)."""
    full = full_device(tmp_path)
    result = cli("annotate", str(pairs_file(tmp_path)), "--annotator", "offline", "-o", str(full))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: cannot write {full}: no space left on device (ENOSPC): free some space or choose "
                      "another location"]
    assert full.exists() and not full.is_file()  # still the device, not replaced by a file


def test_annotate_output_that_is_a_directory(tmp_path: Path, cli):
    out = tmp_path / "outdir"
    out.mkdir()
    result = cli("annotate", str(pairs_file(tmp_path)), "--annotator", "offline", "-o", str(out))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(out) in errors[0] and "is a directory" in errors[0], result.stderr


def test_annotate_output_that_is_a_directory_fails_before_annotating(tmp_path: Path, cli):
    out = tmp_path / "outdir"
    out.mkdir()
    one_error_line(cli("annotate", str(pairs_file(tmp_path)), "--annotator", "offline", "-o", str(out)), str(out))


def test_evaluate_output_directory_that_is_a_file_fails_before_judging(tmp_path: Path, cli):
    from alpacafarm.data import BUILTIN_DIR, read_records

    first = read_records(BUILTIN_DIR / "alpaca_eval_sample.jsonl")[0]  # an instruction with a reference answer
    outputs = write_records(tmp_path / "outputs.json", [{"instruction": first["instruction"],
                                                         "input": first.get("input", ""), "output": "An answer."}])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = cli("evaluate", "--outputs", str(outputs), "--annotator", "offline", "-o", str(blocker))
    one_error_line(result, f"cannot create output directory {blocker}", "is a file")


# ------------------------------------------------------------------------------------------------------- flags


def test_set_max_concurrency_on_the_offline_annotator_names_the_flag(tmp_path: Path, cli):
    """The example of ``annotate --help`` with an annotator that has no such field."""
    result = cli("annotate", str(pairs_file(tmp_path)), "--annotator", "offline", "-o", str(tmp_path / "o.json"),
                 "--set", "max_concurrency=4")
    one_error_line(result, "'offline'", "--set max_concurrency")


def test_set_max_concurrency_on_a_pool_of_offline_judges_is_not_silently_ignored(tmp_path: Path, cli):
    result = cli("annotate", str(pairs_file(tmp_path)), "--annotator", "offline_ann", "-o", str(tmp_path / "o.json"),
                 "--set", "max_concurrency=4")
    one_error_line(result, "'offline_ann'", "max_concurrency", "would do nothing")
    assert not (tmp_path / "o.json").exists()


# ----------------------------------------------------------------------------------------------------- secrets


@pytest.mark.parametrize("annotator", ["gpt4_b5", "alpacafarm_ann"])
@pytest.mark.parametrize("key", [KEY, HEX_KEY], ids=["sk-key", "hex-key"])
def test_a_key_pasted_as_the_env_name_is_never_echoed(tmp_path: Path, cli, annotator: str, key: str):
    result = cli("annotate", str(pairs_file(tmp_path)), "--annotator", annotator, "-o", str(tmp_path / "o.json"),
                 "--set", f"api_key_env={key}")
    one_error_line(result, "api_key_env", "looks like a key itself", "environment variable")
    assert key not in result.stderr + result.stdout


@pytest.mark.parametrize("key", [KEY, HEX_KEY], ids=["sk-key", "hex-key"])
def test_a_key_pasted_instead_of_a_setting_is_never_echoed(tmp_path: Path, cli, key: str):
    result = cli("annotate", str(pairs_file(tmp_path)), "--annotator", "gpt4_b5", "-o", str(tmp_path / "o.json"),
                 "--set", key)
    one_error_line(result, "--set", "KEY=VALUE")
    assert key not in result.stderr + result.stdout


def test_a_key_in_a_recipe_or_an_override_is_never_echoed(tmp_path: Path, cli):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nannotator:\n  name: gpt4_b5\n  config: {{api_key_env: {KEY}}}\n"
                      f"data:\n  instructions: {{builtin: alpaca_eval_sample}}\n{SPLIT}")
    result = cli("recipe", "check", str(recipe))
    one_error_line(result, "r.yaml:4", "annotator.config.api_key_env", "looks like a key itself")
    ok = tmp_path / "ok.yaml"
    ok.write_text(f"name: ok\ndata:\n  instructions: {{builtin: alpaca_eval_sample}}\n{SPLIT}")
    results = [
        cli("recipe", "check", str(ok), "--set", "annotator.name=gpt4_b5",
            "--set", f"annotator.config.api_key_env={KEY}"),
        cli("recipe", "check", str(ok), "--set", f"stages.nope.config.api_key={KEY}"),  # an override that fails
        cli("recipe", "check", str(ok), "--set", KEY),  # a key pasted without a name
    ]
    for result in results:
        one_error_line(result)
        assert KEY not in result.stderr + result.stdout


# ----------------------------------------------------------------------------------------------------- plugins


@pytest.fixture
def clashing_site(tmp_path: Path) -> Path:
    """A third-party plugin named to sort before every built-in that claims a built-in's method name."""
    site = tmp_path / "site"
    source = ("from alpacafarm import hookimpl\n\n@hookimpl\ndef register_methods(register):\n"
              "    register('clash_only', 'alpacafarm.method:Method')\n"
              "    register('split_instructions', 'alpacafarm.method:Method')\n")
    fake_distribution(site, "aaa-clash", {"aaa_clash": "aaa_clash"}, {"aaa_clash": source})
    return site


def test_a_plugin_claiming_a_taken_name_stops_every_command_with_one_line_naming_both(clashing_site: Path, cli):
    env = {"PYTHONPATH": str(clashing_site)}
    error = ("error: plugin name clash: plugin 'aaa_clash' (aaa-clash) registers method 'split_instructions', which "
             "plugin 'data' registers too; duplicate names are an error: uninstall one of the two plugins, or leave "
             "'aaa_clash' out of ALPACAFARM_PLUGINS")
    for args in (["--help"], ["recipe", "check", "recipes/quickstart.yaml"], ["run", "recipes/quickstart.yaml"]):
        result = cli(*args, env=env)
        assert result.returncode == 2 and result.stderr.strip() == error, result.stderr
    # ``plugins`` lists what is installed, the clash marked, and then stops on it
    listed = cli("plugins", "--json", env=env)
    assert listed.returncode == 2 and listed.stderr.strip() == error
    rows = {p["name"]: p for p in json.loads(listed.stdout)["plugins"]}
    assert rows["aaa_clash"]["clash"] and rows["aaa_clash"]["registers"] == {}
    assert rows["data"]["registers"]["method"] == ["preference_data", "split_instructions"]
    table = cli("plugins", env=env)
    assert table.returncode == 2 and "CLASH: registers method 'split_instructions'" in table.stderr
    assert table.stderr.strip().splitlines()[-1] == error


# ------------------------------------------------------------------------------------------------- leaderboard


def test_leaderboard_with_a_non_numeric_win_rate_names_the_file(tmp_path: Path, cli):
    good, bad = tmp_path / "good" / "metrics.json", tmp_path / "bad" / "metrics.json"
    for path, value in ((good, 40.0), (bad, "high")):
        path.parent.mkdir()
        path.write_text(json.dumps({"win_rate": value, "standard_error": 1.0}))
    result = cli("leaderboard", str(good.parent), str(bad.parent), "-o", str(tmp_path / "board"))
    one_error_line(result, str(bad), "'win_rate' must be a number", "'high'")
