"""Loading and writing records: local JSON/JSONL/CSV files, datasets bundled with alpacafarm, hub datasets."""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from alpacafarm.errors import UserError

if TYPE_CHECKING:
    from alpacafarm.recipe import DataSource

BUILTIN_DIR = Path(__file__).parent / "bundled_data"


def builtin_datasets() -> list[str]:
    """Names of the datasets that ship inside the package (``data: {x: {builtin: NAME}}``)."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.jsonl"))


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records from a ``.json`` file (a list of objects, or pandas' column layouts), ``.jsonl`` or ``.csv`` file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records = []
        with path.open(encoding="utf-8") as fh:
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path}:{number}: not valid JSON: {exc.msg}") from None
    elif suffix == ".json":
        try:
            records = _from_columns(json.loads(path.read_text(encoding="utf-8")), path)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    elif suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as fh:
            records = list(csv.DictReader(fh))
    else:
        raise UserError(f"{path}: unsupported data file type {suffix!r} (use .json, .jsonl or .csv)")
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise UserError(f"{path}: expected a list of records (JSON objects)")
    return records


def _from_columns(data: Any, path: Path) -> Any:
    """pandas writes ``{"col": [v, ...]}`` (orient="list") or ``{"col": {"0": v, ...}}`` (its default)."""
    if not isinstance(data, dict):
        return data
    columns = list(data.values())
    if columns and all(isinstance(c, list) for c in columns):
        if len({len(c) for c in columns}) != 1:
            raise UserError(f"{path}: columns have different lengths; expected a list of records")
        return [dict(zip(data, row, strict=False)) for row in zip(*columns, strict=False)]
    if columns and all(isinstance(c, dict) for c in columns):
        index = list(columns[0])
        if any(list(c) != index for c in columns):
            raise UserError(f"{path}: columns have different indexes; expected a list of records")
        return [{name: data[name][i] for name in data} for i in index]
    raise UserError(f"{path}: expected a list of records (JSON objects), got a single object")


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> int:
    """Write records as JSON lines atomically (a reader never sees half a file); returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    n = 0
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            for record in records:
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
                n += 1
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_fingerprint(source: DataSource) -> str:
    """Identity of a data source: the file's content hash for files, the spec for hub datasets."""
    spec = source.model_dump(mode="json")
    if source.path:
        spec["sha256"] = file_sha256(Path(source.path))
    elif source.builtin:
        spec["sha256"] = file_sha256(_builtin_path(source.builtin))
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _builtin_path(name: str) -> Path:
    path = BUILTIN_DIR / f"{name}.jsonl"
    if not path.is_file():
        from alpacafarm.errors import did_you_mean

        known = builtin_datasets()
        raise UserError(f"unknown builtin dataset {name!r}{did_you_mean(name, known)} (known: {', '.join(known)})")
    return path


def load_source(source: DataSource) -> list[dict[str, Any]]:
    """All records of a recipe data source (``limit`` applied)."""
    if source.path:
        records = read_records(Path(source.path))
    elif source.builtin:
        records = read_records(_builtin_path(source.builtin))
    else:
        records = _load_hub(source)
    return records[: source.limit] if source.limit else records


def _load_hub(source: DataSource) -> list[dict[str, Any]]:
    from alpacafarm.errors import MissingPackageError

    try:
        import datasets
    except ImportError as exc:
        raise MissingPackageError("loading hub datasets needs 'datasets': pip install datasets") from exc
    label = (f"{source.hub}" + (f" ({source.config})" if source.config else "")
             + (f" split {source.split}" if source.split else ""))
    try:
        loaded = datasets.load_dataset(source.hub, source.config, split=source.split or "train")
    except Exception as exc:
        offline = (os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
                   or os.environ.get("HF_DATASETS_OFFLINE", "") not in ("", "0"))
        hint = " (offline mode is on)" if offline else ""
        raise UserError(
            f"cannot load hub dataset {label}{hint}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}; "
            f"use a local file instead: data: {{NAME: {{path: records.jsonl}}}}"
        ) from None
    return [dict(row) for row in loaded]
