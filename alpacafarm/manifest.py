"""What a stage manifest records about the files a finished stage produced, and how the record is checked.

A complete stage's manifest (format :data:`MANIFEST_FORMAT`) holds ``outputs``: every file of its artifact that
lies inside the run directory (the artifact's path — a file, or a folder walked recursively —, the paths of
its typed hand-offs and any run-directory path its metadata names), keyed by its path relative to the run
directory, with its size, modification time (ns) and SHA-256::

    "outputs": {"stages/sft/model/model.safetensors": {"size": 1234, "mtime_ns": 1712..., "sha256": "ab12..."}}

Hashes are computed once, when the stage finishes. A later check compares size and mtime only; a file whose
mtime moved (a copy that did not keep times, a touch) is hashed again and counts as intact when its content is
the same — the pipeline then stores the new mtime, so the next check is fast again. A missing file, another
size or another hash means the stage re-runs. Trainer checkpoints (``checkpoint-N/``) and the manifest itself
are never part of the outputs: deleting checkpoints of a finished stage re-runs nothing.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from alpacafarm.artifacts import Artifact, run_relative
from alpacafarm.data import file_sha256

#: 1: no ``outputs`` record (alpacafarm before issue 13); 2: ``outputs``, run-relative paths, ``fingerprint_parts``;
#: 3: the artifact's typed hand-offs (:mod:`alpacafarm.artifacts`) and its ``output_id`` outside ``metadata``.
MANIFEST_FORMAT = 3
#: Folders inside an artifact folder that are not outputs (trainer checkpoints, half-written ones).
_SKIPPED_DIRS = re.compile(r"^checkpoint-\d+($|\.)")
_SKIPPED_FILES = {"manifest.json", "manifest.json.tmp"}


def recorded_output_id(manifest: dict[str, Any] | None) -> str | None:
    """The ``output_id`` a complete stage's manifest recorded (manifests before typed hand-offs: in metadata)."""
    artifact = (manifest or {}).get("artifact") or {}
    return artifact.get("output_id") or (artifact.get("metadata") or {}).get("output_id")


def artifact_roots(artifact: Artifact, run_dir: Path) -> list[str]:
    """The run-relative paths an artifact stands for: its path, the paths of its hand-offs (named files, systems'
    outputs, snapshot folders, judged pairs) and the run-directory paths its metadata names."""
    found: list[str] = []

    def visit(value: Any) -> None:
        if isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)
        elif isinstance(value, str) and os.path.isabs(value) and Path(value).exists():
            relative = run_relative(value, run_dir)
            if relative is not None and relative not in found:
                found.append(relative)

    named = [artifact.path, *artifact.files.values(), *(s.outputs for s in artifact.systems),
             *(s.path for s in artifact.snapshots), *(j.annotations for j in artifact.judged)]
    for path in named:
        if path is not None and Path(path).exists():
            relative = run_relative(str(path), run_dir)
            if relative is not None and relative not in found:
                found.append(relative)
    visit(artifact.metadata)
    return found


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    out = []
    for current, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not _SKIPPED_DIRS.match(d))
        out.extend(Path(current) / f for f in sorted(files) if f not in _SKIPPED_FILES)
    return out


def _entry(path: Path, sha256: str | None = None) -> dict[str, Any]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256 or file_sha256(path)}


def record_outputs(artifact: Any, run_dir: Path) -> dict[str, dict[str, Any]]:
    """The ``outputs`` record of a finished stage's artifact (hashes every file once)."""
    record: dict[str, dict[str, Any]] = {}
    for root in artifact_roots(artifact, run_dir):
        absolute = run_dir / root
        files = _files(absolute)
        if absolute.is_dir() and not files:
            record[root] = {"dir": True}
        for file in files:
            record.setdefault(file.relative_to(run_dir).as_posix(), _entry(file))
    return record


def check_outputs(record: dict[str, dict[str, Any]], run_dir: Path) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Check recorded outputs; returns (problems, the record with refreshed mtimes of files whose content held).

    Problems read ``missing: stages/x/file`` or ``changed: stages/x/file`` (first few, then a count).
    """
    missing, changed = [], []
    refreshed = dict(record)
    for name, entry in record.items():
        path = run_dir / name
        if entry.get("dir"):
            if not path.is_dir():
                missing.append(name)
            continue
        try:
            stat = path.stat()
        except OSError:
            missing.append(name)
            continue
        if stat.st_size != entry.get("size"):
            changed.append(name)
        elif stat.st_mtime_ns != entry.get("mtime_ns"):
            digest = file_sha256(path)
            if digest != entry.get("sha256"):
                changed.append(name)
            else:
                refreshed[name] = _entry(path, digest)
    problems = []
    for label, names in (("missing", missing), ("changed", changed)):
        if names:
            more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
            problems.append(f"{label}: {', '.join(names[:3])}{more}")
    return problems, refreshed
