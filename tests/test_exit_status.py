"""One exit-status rule for the whole CLI (issue 41): the module, its documentation page and the commands agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import REPO_ROOT, run_cli

from alpacafarm import exit_status
from alpacafarm.annotation import AnnotationFailed
from alpacafarm.errors import UserError


def test_the_docs_page_and_the_module_state_the_same_rule():
    page = (REPO_ROOT / "docs/exit-status.md").read_text(encoding="utf-8")
    rows = {int(code): name for code, name in re.findall(r"^\| (\d+) \| (\w+) \|", page, re.M)}
    assert rows == exit_status.EXIT_STATUSES
    assert "exit-status.md" in (REPO_ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def test_errors_and_verdicts_take_their_status_from_the_rule():
    from alpacafarm_evaluation.bench import EXIT_CRASH
    from alpacafarm_evaluation.gate_stats import EXIT_CODES

    assert UserError.exit_code == exit_status.USER_ERROR and AnnotationFailed.exit_code == exit_status.FAILED
    assert EXIT_CODES == {"PASS": exit_status.OK, "FAIL": exit_status.FAILED,
                          "INCONCLUSIVE": exit_status.INCONCLUSIVE, "STALE": exit_status.STALE}
    assert EXIT_CRASH == exit_status.CRASHED


@pytest.mark.parametrize("args", [
    ("run", "no-such-recipe.yaml"),
    ("recipe", "check", "no-such-recipe.yaml"),
    ("recipe", "check", "recipes/quickstart.yaml", "--set", "name=../x"),
    ("plugin", "new", "json"),
    ("bench", "recipes/bench/best_of_n.yaml", "--baseline", "no-such-baseline.json"),
    ("bench", "recipes/bench/best_of_n.yaml", "--baseline", "benchmarks/baselines/best_of_n.json", "--margin", "inf"),
    ("annotate", "no-such-pairs.jsonl", "--annotator", "offline"),
], ids=["run", "recipe-check", "run-name", "plugin-new", "bench-baseline", "bench-margin", "annotate"])
def test_a_refused_input_is_status_2_in_one_line_for_every_command(tmp_path: Path, args: tuple[str, ...]):
    result = run_cli(*[str(a) for a in args], env={"ALPACAFARM_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == exit_status.USER_ERROR, (result.returncode, result.stderr)
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr


def test_success_is_status_0(tmp_path: Path):
    result = run_cli("plugins", "--json")
    assert result.returncode == exit_status.OK and json.loads(result.stdout)["plugins"]
