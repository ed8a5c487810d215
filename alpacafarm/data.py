"""Loading and writing records: local JSON/JSONL/CSV files, datasets bundled with alpacafarm, hub datasets."""

from __future__ import annotations

import csv
import errno
import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from alpacafarm.errors import UserError
from alpacafarm.paths import make_dir, not_utf8, user_path

if TYPE_CHECKING:
    from alpacafarm.recipe import DataSource

BUILTIN_DIR = Path(__file__).parent / "bundled_data"
#: The paper's Table 2 (win-rates against Davinci003, simulated and human; source in bundled_data/SOURCES.md).
PAPER_TABLE2 = BUILTIN_DIR / "paper_table2.csv"


def builtin_datasets() -> list[str]:
    """Names of the datasets that ship inside the package (``data: {x: {builtin: NAME}}``)."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.jsonl"))


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records from a ``.json`` file (a list of objects, or pandas' column layouts), ``.jsonl`` or ``.csv`` file.

    A file that cannot be read (permissions, not UTF-8, a folder) is a one-line UserError naming it.
    """
    path = Path(path)
    try:
        with user_path(path, "read"):
            records = _read_records(path)
    except UnicodeDecodeError:
        raise not_utf8(path) from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise UserError(f"{path}: expected a list of records (JSON objects)")
    for number, record in enumerate(records, start=1):
        for key, value in record.items():
            if isinstance(value, str) and _SURROGATE.search(value):  # JSON's "\ud800" escape: not Unicode text
                raise UserError(f"{path}: record {number}, field {key!r}: holds a lone surrogate "
                                f"({_SURROGATE.search(value)[0].encode('unicode_escape').decode()}), which is not "
                                "valid Unicode; fix the text")
    return records


_SURROGATE = re.compile("[\ud800-\udfff]")


def _read_records(path: Path) -> Any:
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
                except RecursionError:  # nesting deeper than Python's stack: never a record
                    raise UserError(f"{path}:{number}: JSON nested too deeply") from None
        return records
    if suffix == ".json":
        try:
            return _from_columns(json.loads(path.read_text(encoding="utf-8")), path)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
        except RecursionError:  # nesting deeper than Python's stack: never a records file
            raise UserError(f"{path}: JSON nested too deeply") from None
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as fh:
            return list(csv.DictReader(fh))
    raise UserError(f"{path}: unsupported data file type {suffix!r} (use .json, .jsonl or .csv)")


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
    """Write records as JSON lines atomically (a reader never sees half a file); returns the count. A NaN or
    infinite number is a one-line UserError naming the file and the record's field (JSON has no NaN)."""
    def lines() -> Iterable[str]:
        for number, record in enumerate(records, start=1):
            yield _dumps(record, path, f"line {number}") + "\n"

    return _write_text(Path(path), lines())


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically; a NaN or infinite number is a one-line UserError naming the file and the key (a
    diverged loss or score must fail its stage, never be written as the invalid token ``NaN``)."""
    _write_text(Path(path), [_dumps(data, path, None, indent=2) + "\n"])


def _dumps(data: Any, path: Path, where: str | None, indent: int | None = None) -> str:
    try:
        return json.dumps(data, indent=indent, ensure_ascii=False, default=str, allow_nan=False)
    except ValueError:
        key = _non_finite(data)
        if key is None:
            raise
        at = f"{where}, " if where else ""
        raise UserError(f"{path}: {at}{key or '(the value)'} is not a finite number (NaN or infinity): the "
                        "computation that produced it diverged") from None


def _non_finite(data: Any, prefix: str = "") -> str | None:
    """The path (``a.b[2]``) of the first NaN or infinite float in ``data``, or None."""
    import math

    if isinstance(data, float):
        return None if math.isfinite(data) else prefix
    if isinstance(data, dict):
        for key, value in data.items():
            found = _non_finite(value, f"{prefix}.{key}" if prefix else str(key))
            if found is not None:
                return found
    if isinstance(data, list | tuple):
        for i, value in enumerate(data):
            found = _non_finite(value, f"{prefix}[{i}]")
            if found is not None:
                return found
    return None


def _write_text(path: Path, chunks: Iterable[str]) -> int:
    """Write ``chunks`` to ``path`` through a temporary file renamed over it; returns how many were written.

    A path that exists and is neither a file nor a folder (``/dev/stdout``, a named pipe) is written directly:
    it cannot be replaced. The file system's refusals (a folder at ``path``, no permission, disk full) are a
    one-line UserError naming ``path``.
    """
    with user_path(path, "write"):
        if path.exists() and not path.is_file() and not path.is_dir():
            with path.open("w", encoding="utf-8") as fh:
                return _write_chunks(fh, chunks)
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        make_dir(path.parent)
        tmp = path.with_suffix(path.suffix + ".tmp")
        try:
            with tmp.open("w", encoding="utf-8") as fh:
                n = _write_chunks(fh, chunks)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return n


def _write_chunks(fh: Any, chunks: Iterable[str]) -> int:
    n = 0
    for chunk in chunks:
        fh.write(chunk)
        n += 1
    return n


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
