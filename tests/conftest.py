"""Shared test helpers. The offline environment comes from ``alpacafarm.testing.pytest_plugin`` (pyproject addopts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_PLUGIN = REPO_ROOT / "tests" / "plugins" / "alpacafarm_example"


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m alpacafarm ARGS`` in a fresh process (entry points are read anew)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "alpacafarm", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd or REPO_ROOT, timeout=600)


@pytest.fixture(scope="session")
def example_plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example third-party plugin, pip-installed (no network, no build isolation) into a folder for PYTHONPATH."""
    import shutil

    work = tmp_path_factory.mktemp("example-plugin")
    source = work / "src"
    shutil.copytree(EXAMPLE_PLUGIN, source)  # builds write into the source tree; keep the repository clean
    target = work / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return target
