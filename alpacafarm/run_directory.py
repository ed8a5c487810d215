"""What a run directory is, and the checks that keep a run from losing or trusting the wrong files: the run lock,
refusing a folder that is not a run directory, and whether a stage's manifest and its declared artifact are
usable. :class:`alpacafarm.pipeline.Pipeline` applies them.

Layout of a run directory::

    recipe.yaml            the resolved recipe (includes merged, overrides applied)
    run.json               package versions, seed, command history
    run.log                log of every run in this directory
    stages/<name>/         one folder per stage: its files and manifest.json
    error.log              the last failure, if any
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.method import Artifact
from alpacafarm.recipe import run_name_problem

TRACKED_PACKAGES = ("alpacafarm", "torch", "transformers", "trl", "peft", "accelerate", "datasets", "openai", "pluggy")


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    with (run_dir / ".lock").open("w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another alpacafarm run is using {run_dir}; wait for it or pick --output-dir") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


#: What a run directory may hold before its run.json exists (a run that stopped while setting up).
SETUP_FILES = {".lock", "run.log", "error.log"}


def check_run_directory(run_dir: Path) -> None:
    """Refuse a folder that is not a run directory: it must be new, empty, or hold ``run.json`` (so a run never
    overwrites a ``recipe.yaml`` or anything else it did not write, e.g. ``--output-dir`` given the recipe's own
    folder)."""
    if not run_dir.is_dir() or (run_dir / "run.json").exists():
        return
    others = sorted(p.name for p in run_dir.iterdir() if p.name not in SETUP_FILES)
    if others:
        shown = ", ".join(others[:3]) + (f" (+{len(others) - 3} more)" if len(others) > 3 else "")
        raise UserError(f"{run_dir} is not an alpacafarm run directory (no run.json) and holds {shown}; a run "
                        "writes recipe.yaml, run.json and stages/ there: give --output-dir a new or empty folder")


def manifest_problem(manifest: Any) -> str | None:
    """What makes a stage manifest unusable (its stage then runs again), or None for a usable one (or none)."""
    if manifest is None:
        return None
    if not isinstance(manifest, dict):
        return f"is a JSON {type(manifest).__name__}, not an object"
    if manifest.get("status") == "complete" and not isinstance(manifest.get("artifact"), dict):
        return "says complete but records no artifact"
    if manifest.get("status") == "complete" and not isinstance(manifest.get("outputs"), dict):
        return "says complete but records no outputs"
    if "format" not in manifest:
        return "records no format"
    outputs = manifest.get("outputs")
    if outputs is not None and not (isinstance(outputs, dict) and all(isinstance(v, dict) for v in outputs.values())):
        return "has a malformed outputs record"
    return None


def artifact_problem(artifact: Artifact, run_dir: Path) -> str | None:
    """Why a finished stage's artifact cannot be used by the stages after it, or None. A path inside the run
    directory must exist; a model folder must hold a readable ``config.json`` or ``adapter_config.json``; a
    ``.json`` or ``.jsonl`` file must parse."""
    from alpacafarm.method import run_relative

    if artifact.path is None or run_relative(artifact.path, run_dir) is None:
        return None  # nothing declared here (a hub ID, a path outside the run: the method's responsibility)
    path = Path(artifact.path)
    if not path.exists():
        return f"path {path} does not exist (nothing was written there)"
    if artifact.kind == "model":
        configs = [path / name for name in ("config.json", "adapter_config.json") if (path / name).is_file()]
        if not path.is_dir() or not configs:
            return f"path {path} is not a model folder (no config.json or adapter_config.json)"
        files = configs
    else:
        files = [path] if path.is_file() and path.suffix in (".json", ".jsonl") else []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
            if file.suffix == ".jsonl":
                for line in text.splitlines():
                    if line.strip():
                        json.loads(line)
            else:
                json.loads(text)
        except (OSError, ValueError) as exc:
            return f"file {file} does not load ({type(exc).__name__}: {str(exc)[:120]})"
    return None


#: The folder (relative to the working directory) that holds ``<name>/`` for each run without an explicit folder.
RUNS_ROOT = Path("runs")


def run_directory(loaded: Any, output_dir: str | Path | None, root: Path = RUNS_ROOT) -> Path:
    """Where a recipe's run goes: ``--output-dir``, else its ``output_dir``, else ``<root>/<name>`` (``root``:
    ``runs``). The name is checked again here: the folder must stay inside ``root``."""
    if output_dir or loaded.recipe.output_dir:
        return Path(output_dir or loaded.recipe.output_dir)
    return named_run_folder(loaded.recipe.name, root)


def named_run_folder(name: str, root: Path = RUNS_ROOT) -> Path:
    """``root/name``, refused (one line) unless ``name`` is one folder name that stays inside ``root``."""
    problem = run_name_problem(name)
    folder = root / name
    if problem is not None or folder.resolve().parent != root.resolve():
        raise UserError(f"recipe name {name!r} {problem or 'leaves the runs folder'}")
    return folder


def package_versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    """Installed versions of the packages a run's results depend on (recorded in ``run.json``)."""
    out = {}
    for name in (*TRACKED_PACKAGES, *extra):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out
