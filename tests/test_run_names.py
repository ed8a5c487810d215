"""A recipe's name is one folder name: ``runs/<name>`` never lands outside ``runs/`` (issue 41, case 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from alpacafarm.errors import RecipeError, UserError
from alpacafarm.recipe import load_recipe
from alpacafarm.run_directory import named_run_folder

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = "name: ok\nstages:\n  - {name: split, method: split_instructions}\n"


@pytest.mark.parametrize("name", ["../../escape", "..", ".", "/tmp/absolute", "", "  ", "a/b", "a\\b", "tab\there",
                                  "new\nline", " padded"])
def test_a_name_that_is_not_one_folder_name_is_refused(tmp_path: Path, name: str):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE, encoding="utf-8")
    with pytest.raises(RecipeError, match=r"^--set: name: must"):
        load_recipe(recipe, [f"name={name!r}".replace("'", '"') if "\\" not in name else f"name='{name}'"])
    with pytest.raises(UserError, match="recipe name"):
        named_run_folder(name, tmp_path / "runs")


def test_run_with_an_escaping_name_writes_nothing_outside_runs(tmp_path: Path):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    recipe = work / "r.yaml"
    recipe.write_text(RECIPE, encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "alpacafarm", "run", str(recipe), "--set", "name=../../escape"],
                            capture_output=True, text=True, cwd=work, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "name" in result.stderr
    assert not (tmp_path / "escape").exists() and not (work / "runs").exists()


def test_an_ordinary_name_is_a_folder_inside_runs(tmp_path: Path):
    assert named_run_folder("dpo-v2.1_test", tmp_path / "runs") == tmp_path / "runs" / "dpo-v2.1_test"
