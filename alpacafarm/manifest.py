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

Every path a manifest names for its run stays inside the run directory (:func:`outside_run_path`, applied to
every manifest the pipeline reads): an outputs entry, a run-relative artifact path, a ``${run_dir}/...`` token
and every hand-off. One outside it (``${run_dir}/../evil/eval.jsonl``, a link out of the folder) would be read
by the next stage without ever being checked: such a manifest is refused in one line, never called intact.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from alpacafarm.artifacts import RUN_DIR_TOKEN, Artifact, handoff_paths, inside_run, run_relative
from alpacafarm.data import file_sha256

#: The format of the stage manifests this alpacafarm writes, and the only one it reads: a manifest of another
#: format is refused in one line naming it (:class:`alpacafarm.pipeline.Pipeline` reads them).
MANIFEST_FORMAT = 3
#: Folders inside an artifact folder that are not outputs (trainer checkpoints, half-written ones).
_SKIPPED_DIRS = re.compile(r"^checkpoint-\d+($|\.)")
_SKIPPED_FILES = {"manifest.json", "manifest.json.tmp"}


def recorded_output_id(manifest: dict[str, Any] | None) -> str | None:
    """The ``output_id`` a complete stage's manifest recorded."""
    return ((manifest or {}).get("artifact") or {}).get("output_id")


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


def _token_strings(value: Any, where: str) -> list[tuple[str, str]]:
    """``(field, text)`` of every ``${run_dir}/...`` string in a manifest's artifact, with its dotted field."""
    if isinstance(value, str):
        return [(where, value)] if value.startswith(RUN_DIR_TOKEN + "/") else []
    if isinstance(value, dict):
        return [found for k, v in value.items() for found in _token_strings(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [found for i, v in enumerate(value) for found in _token_strings(v, f"{where}[{i}]")]
    return []


def outside_run_path(manifest: Any, run_dir: Path) -> tuple[str, str] | None:
    """``(field, path)`` of the first path a stage manifest names outside ``run_dir`` (``..`` and symbolic links
    resolved: :func:`~alpacafarm.artifacts.inside_run`), or None when all stay inside. Checked: the ``outputs``
    record's names, a run-relative ``artifact.path``, every ``${run_dir}/...`` string of the artifact, and every
    hand-off path of the artifact as it reads. An absolute ``artifact.path`` may name a model elsewhere (a folder
    or hub ID given in a config): it is the artifact's only field that may; a relative one without
    ``path_base: run_dir`` (a hub ID) may not hold a ``..`` part."""
    if not isinstance(manifest, dict):
        return None
    outputs = manifest.get("outputs")
    for name in outputs if isinstance(outputs, dict) else ():
        if not isinstance(name, str) or os.path.isabs(name) or not inside_run(run_dir / name, run_dir):
            return f"outputs[{name!r}]", str(name)
    data = manifest.get("artifact")
    if not isinstance(data, dict):
        return None
    path = data.get("path")
    relative = isinstance(path, str) and not os.path.isabs(path)
    if relative and data.get("path_base") == "run_dir" and not inside_run(run_dir / path, run_dir):
        return "artifact.path", path  # run-relative, as Artifact.from_json reads it
    if relative and data.get("path_base") != "run_dir" and ".." in Path(path).parts:
        return "artifact.path", path  # no model or hub ID climbs out of a folder: only a hand edit writes this
    for where, text in _token_strings(data, "artifact"):
        if not inside_run(run_dir / text[len(RUN_DIR_TOKEN) + 1:], run_dir):
            return where, text
    try:
        artifact = Artifact.from_json(data, run_dir)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None  # an artifact that does not read: the pipeline names that when it reads it
    for where, value in handoff_paths(artifact):
        if not inside_run(value, run_dir):
            return f"artifact.{where}", value
    return None
