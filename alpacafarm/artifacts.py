"""What one stage hands the next: the :class:`Artifact` a method returns and the typed hand-offs it carries.

A stage's ``run`` returns an :class:`Artifact`: a ``kind`` (a word for people, see :data:`ARTIFACT_KINDS`), a
``path`` (the file or folder later stages read) and, as declared types, whatever a later stage needs to know about it:

- ``files`` (``dict[str, str]``): a folder's named files (``split_instructions``: ``train``, ``eval``), read by
  ``context.records(name, "train")``;
- ``systems`` (``list[System]``): several systems of outputs (``best_of_n``: one per n; ``generate_outputs`` with
  ``snapshots: true``: one per step); the evaluation judges each one;
- ``snapshots`` (``list[Snapshot]``): policies saved during training (PPO's ``snapshot_steps``);
  ``generate_outputs`` with ``snapshots: true`` samples each one;
- ``judged`` (``list[JudgedSystem]``): what an evaluation judged (``win_rate``); the gate (``alpacafarm bench``)
  reads each one's judged pairs;
- ``table`` (:class:`Table`): a results table, printed by ``alpacafarm run`` at the end;
- ``metadata`` (``dict[str, Any]``): the stage's own figures for people (counts, metrics, timings), stored in its
  manifest; no other stage reads them.

Every path is a path on this machine, as ``path`` is (absolute, or relative to the working directory). A
manifest stores those inside the run directory relative to it (``${run_dir}/stages/x/file``), so a copied or
moved run directory still resolves them. Every hand-off path lies inside the run directory (:func:`inside_run`:
``..`` and symbolic links resolved), where the manifest records and checks its content: one outside it is
refused when the stage ends and when a manifest is read (:func:`alpacafarm.manifest.outside_run_path`). Only
``path`` may name something elsewhere (a model folder or hub ID given in a config).

A method that always fills some of these declares them (``Method.produces = ("systems",)``). When its stage
ends, the pipeline checks the artifact (:func:`handoff_problem`): every declared hand-off present, every file and
folder named exists (a snapshot is a model folder, a system's outputs a file), system names and snapshot steps
unique, numbers finite; a malformed hand-off fails the stage in one line naming it, and the stage is not
recorded complete.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: How a manifest writes a run-directory path of an artifact (``${run_dir}/stages/x/file``), so that a copied or
#: moved run directory resolves it in its new place.
RUN_DIR_TOKEN = "${run_dir}"

#: The kinds of artifact the built-in stages hand on, and what each one's ``path`` is. ``kind`` is a word for
#: people (the run's summary table shows it); a plugin may use its own.
ARTIFACT_KINDS = {
    "model": "a model folder: full weights (config.json) or adapters (adapter_config.json naming their base, "
             "itself possibly an adapter folder), with its tokenizer; loaded with the recipe's model block "
             "(context.generator, context.reward_function, alpacafarm.model_loading.load_merged_causal_lm)",
    "dataset": "a JSONL file of records (a preference set: instruction, input, output_1, output_2, preference), "
               "or a folder of such files named in ``files``",
    "outputs": "an outputs file (JSONL: instruction, input, output, ...), or a folder whose ``systems`` name "
               "several",
    "evaluation": "an evaluation's results file, with ``judged`` and ``table``",
    "report": "a summary file for people",
    "data_source": "a recipe's data source (the pipeline's own: ``source`` holds it)",
}

@dataclass(frozen=True)
class System:
    """One system of outputs a stage hands the evaluation: its name, its outputs file (JSONL records with
    ``instruction``, ``input``, ``output``) and what the stage knows about it."""

    name: str
    outputs: str
    #: samples per instruction it chose among (best-of-n's n): the evaluation plots win-rate against n
    n: int | None = None
    #: the training step of a policy snapshot: the evaluation plots win-rate against the step
    step: int | None = None
    #: mean reward-model score of its outputs as the stage scored them (else the evaluation scores them)
    proxy_reward: float | None = None
    #: the stage's training reward there (PPO: the rollouts' mean score over the steps since the snapshot before)
    train_reward: float | None = None
    #: its KL to the reference model when the stage knows it (best-of-n: ``log n - (n - 1)/n``), and its SE
    kl: float | None = None
    kl_se: float | None = None


@dataclass(frozen=True)
class Snapshot:
    """A policy saved during training: its step, its model folder, the training reward of the steps that led there."""

    step: int
    path: str
    train_reward: float | None = None


@dataclass(frozen=True)
class JudgedSystem:
    """One system an evaluation judged: its name, the stage it came from, the file of its judged pairs (a JSON
    list of ``instruction``, ``input``, ``output_1``, ``output_2``, ``preference``), its win-rate ± SE."""

    name: str
    stage: str
    annotations: str
    win_rate: float | None = None
    standard_error: float | None = None


@dataclass(frozen=True)
class Table:
    """A results table ``alpacafarm run`` prints when the run ends."""

    title: str
    columns: list[str]
    rows: list[list[Any]]


#: The path fields of each hand-off type (stored run-relative in a manifest).
_PATH_FIELDS: dict[type, tuple[str, ...]] = {System: ("outputs",), Snapshot: ("path",), JudgedSystem: ("annotations",)}
_LISTS: dict[str, type] = {"systems": System, "snapshots": Snapshot, "judged": JudgedSystem}
#: The typed fields a method may declare in ``Method.produces``.
HANDOFFS = ("files", "systems", "snapshots", "judged", "table")


@dataclass
class Artifact:
    """What a stage produced: a ``kind`` (:data:`ARTIFACT_KINDS`), a ``path``, the typed hand-offs later stages
    read, and ``metadata``, the stage's own figures for people."""

    kind: str
    path: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    systems: list[System] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    judged: list[JudgedSystem] = field(default_factory=list)
    table: Table | None = None
    #: a recipe data source (``kind == "data_source"``; set by the pipeline)
    source: Any = None
    #: set by the pipeline when the stage completes: a later stage's fingerprint includes it
    output_id: str | None = None

    def to_json(self, run_dir: Path) -> dict[str, Any]:
        """JSON for a manifest. Paths inside the run directory are stored relative to it (the artifact's path
        with ``path_base: run_dir``; the hand-offs' and metadata's paths as ``${run_dir}/...``), so a run
        directory can be copied or moved; an existing path outside it is stored absolute; anything else (a hub
        ID) as it is."""
        path, base = self.path, None
        if path is not None:
            relative = run_relative(path, run_dir)
            if relative is not None:
                path, base = relative, "run_dir"
            elif Path(path).exists():
                path = str(Path(path).absolute())
        data: dict[str, Any] = {"kind": self.kind, "path": path, "metadata": _map_strings(
            self.metadata, lambda s: _run_token(s, run_dir))}
        if base:
            data["path_base"] = base
        if self.files:
            data["files"] = {k: _path_token(v, run_dir) for k, v in self.files.items()}
        for name in _LISTS:
            items = getattr(self, name)
            if items:
                data[name] = [_item_json(item, run_dir) for item in items]
        if self.table is not None:
            data["table"] = dataclasses.asdict(self.table)
        if self.source is not None:
            data["source"] = self.source.model_dump(mode="json")
        if self.output_id is not None:
            data["output_id"] = self.output_id
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], run_dir: Path) -> Artifact:
        """The artifact of a manifest, its run-directory paths resolved under ``run_dir`` (where it is now)."""
        path = data.get("path")
        if path is not None and not Path(path).is_absolute() and data.get("path_base") == "run_dir":
            path = str(run_dir / path)
        metadata = _map_strings(dict(data.get("metadata") or {}), lambda s: _from_token(s, run_dir))
        try:
            artifact = cls(data["kind"], path, metadata,
                           files={k: _from_token(v, run_dir) for k, v in (data.get("files") or {}).items()},
                           output_id=data.get("output_id"))
            for name, item_cls in _LISTS.items():
                setattr(artifact, name, [_item_from_json(item_cls, item, run_dir) for item in data.get(name) or []])
            if data.get("table") is not None:
                artifact.table = Table(**data["table"])
            if data.get("source") is not None:
                from alpacafarm.recipe import DataSource

                artifact.source = DataSource.model_validate(data["source"])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"artifact of kind {data.get('kind')!r} does not read: {exc}") from None
        return artifact


def handoff_problem(artifact: Artifact, produces: tuple[str, ...] = (), run_dir: Path | None = None) -> str | None:
    """Why an artifact's hand-offs cannot be read by the stages after it, or None: one of ``produces`` (what its
    method declares) missing, a field of the wrong type, a named file or folder that does
    not exist or (given ``run_dir``) lies outside the run directory, a duplicate system name or snapshot step, a
    number that is not finite."""
    for name in produces:
        if not getattr(artifact, name, None):
            return f"{name} is empty, though its method declares it (Method.produces = {produces!r})"
    if not isinstance(artifact.files, dict) or not all(
            isinstance(k, str) and isinstance(v, str | os.PathLike) for k, v in artifact.files.items()):
        return "files must be a dict of names to paths"
    for key, file in artifact.files.items():
        if not Path(file).is_file():
            return f"files[{key!r}] names {file}, which is not a file"
    for name, item_cls in _LISTS.items():
        items = getattr(artifact, name)
        if not isinstance(items, list) or not all(isinstance(item, item_cls) for item in items):
            return (f"{name} must be a list of alpacafarm.artifacts.{item_cls.__name__}, got "
                    f"{type(items).__name__}" + ("" if not isinstance(items, list) or not items else
                                                 f" of {type(items[0]).__name__}"))
        for i, item in enumerate(items):
            problem = _item_problem(item)
            if problem:
                return f"{name}[{i}] {problem}"
    names = [s.name for s in artifact.systems]
    steps = [s.step for s in artifact.snapshots]
    for label, values in (("system name", names), ("snapshot step", steps)):
        twice = [v for v in values if values.count(v) > 1]
        if twice:
            return f"{label} {twice[0]!r} appears twice"
    for where, value in handoff_paths(artifact) if run_dir is not None else ():
        if not inside_run(value, run_dir):
            return (f"{where} names {value}, outside the run folder {run_dir} (a stage hands on files it wrote in "
                    "its run folder, whose manifest records and checks them)")
    if artifact.table is not None:
        table = artifact.table
        if not isinstance(table, Table):
            return f"table must be an alpacafarm.artifacts.Table, got {type(table).__name__}"
        if any(not isinstance(row, list | tuple) or len(row) != len(table.columns) for row in table.rows):
            return f"table {table.title!r} has a row whose length is not its {len(table.columns)} columns"
    return None


def _item_problem(item: Any) -> str | None:
    """What is wrong with one System, Snapshot or JudgedSystem (named by the caller), or None."""
    label = repr(item.name) if hasattr(item, "name") else f"step {item.step}"
    for f in dataclasses.fields(item):
        value = getattr(item, f.name)
        if f.name in ("name", "stage") and (not isinstance(value, str) or not value):
            return f"({label}) has no {f.name}"
        if f.name in ("n", "step") and value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                                                or value < (1 if f.name == "n" else 0)):
            return f"({label}) has {f.name} {value!r}: not a whole number >= {1 if f.name == 'n' else 0}"
        if f.type in ("float | None",) and value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)):
            return f"({label}) has {f.name} {value!r}: not a finite number"
    if isinstance(item, Snapshot) and item.step is None:
        return f"({label}) has no step"
    for name in _PATH_FIELDS[type(item)]:
        value = getattr(item, name)
        if not isinstance(value, str | os.PathLike) or not str(value):
            return f"({label}) has no {name} path"
        if isinstance(item, Snapshot):
            folder = Path(value)
            if not folder.is_dir() or not any((folder / f).is_file() for f in ("config.json", "adapter_config.json")):
                return f"({label}): {value} is not a model folder (no config.json or adapter_config.json)"
        elif not Path(value).is_file():
            return f"({label}): its {name} file {value} does not exist"
    return None


def handoff_paths(artifact: Artifact) -> Iterator[tuple[str, str]]:
    """``(field, path)`` for every path a later stage reads through the artifact's typed hand-offs
    (``files['eval']``, ``systems[0].outputs``, ``snapshots[1].path``, ``judged[0].annotations``); values that are
    not paths are :func:`handoff_problem`'s to name."""
    if isinstance(artifact.files, dict):
        for key, value in artifact.files.items():
            if isinstance(value, str | os.PathLike):
                yield f"files[{key!r}]", str(value)
    for name, item_cls in _LISTS.items():
        items = getattr(artifact, name)
        for i, item in enumerate(items if isinstance(items, list) else []):
            for path_field in _PATH_FIELDS[item_cls] if isinstance(item, item_cls) else ():
                value = getattr(item, path_field)
                if isinstance(value, str | os.PathLike):
                    yield f"{name}[{i}].{path_field}", str(value)


def inside_run(path: str | os.PathLike, run_dir: Path) -> bool:
    """Whether ``path`` lies inside ``run_dir`` (or is it) once ``..`` and symbolic links are resolved: a
    hand-off or a manifest's path may not leave its run folder (issue 61)."""
    try:
        Path(path).resolve().relative_to(Path(run_dir).resolve())
    except (ValueError, OSError, RuntimeError):  # outside; unresolvable (a link loop: RuntimeError before 3.13)
        return False
    return True


def run_relative(path: str, run_dir: Path) -> str | None:
    """``path`` relative to ``run_dir`` when it lies inside it (POSIX form), else ``None``."""
    try:
        relative = Path(path).resolve().relative_to(run_dir.resolve())
    except (ValueError, OSError):
        return None
    return relative.as_posix() if relative.parts else None


def _path_token(value: str, run_dir: Path) -> str:
    """A hand-off's path as ``${run_dir}/...`` when inside the run directory, else absolute when it exists."""
    relative = run_relative(str(value), run_dir)
    if relative is not None:
        return f"{RUN_DIR_TOKEN}/{relative}"
    return str(Path(value).absolute()) if Path(value).exists() else str(value)


def _from_token(value: str, run_dir: Path) -> str:
    prefix = RUN_DIR_TOKEN + "/"
    return str(run_dir / value[len(prefix):]) if value.startswith(prefix) else value


def _item_json(item: Any, run_dir: Path) -> dict[str, Any]:
    data = dataclasses.asdict(item)
    for name in _PATH_FIELDS[type(item)]:
        data[name] = _path_token(data[name], run_dir)
    return {k: v for k, v in data.items() if v is not None}


def _item_from_json(item_cls: type, data: dict[str, Any], run_dir: Path) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"a {item_cls.__name__} is not a JSON object: {data!r}"[:200])
    values = dict(data)
    for name in _PATH_FIELDS[item_cls]:
        if isinstance(values.get(name), str):
            values[name] = _from_token(values[name], run_dir)
    return item_cls(**values)


def _run_token(value: str, run_dir: Path) -> str:
    """A metadata string naming a path inside the run directory, as ``${run_dir}/...``; others unchanged."""
    if not (os.path.isabs(value) or value.startswith(f"{run_dir}{os.sep}")) or "\n" in value or len(value) > 4096:
        return value
    relative = run_relative(value, run_dir)
    return value if relative is None else f"{RUN_DIR_TOKEN}/{relative}"


def _map_strings(value: Any, fn: Any) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_map_strings(v, fn) for v in value]
    return value
