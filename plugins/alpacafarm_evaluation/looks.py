"""How many times a world's held-out instructions have been looked at: the looks ledger.

A held-out split is only held out while nobody chooses anything after seeing it. Every evaluation the ``win_rate``
evaluator runs on a run's instruction splits is recorded here, in ``looks.sqlite`` beside the annotation cache
(:func:`alpacafarm.paths.cache_dir`), shared by every run on the machine that uses that cache:

- **The world** an evaluation looks at is the hash of what fixes its figures: the held-out instructions themselves
  (so the data and the split's seed and sizes), the evaluation judge (its recipe block and what its labels depend
  on, as the pipeline fingerprints it; a budget is not part of it) and the evaluation's own settings that choose
  the pairs (references, their field, ``max_instructions``). Two runs of one recipe share a world; another gold,
  another seed of the split or other references are another world.
- **Which split** an evaluation looked at is read off the judged instructions: any of the split's held-out
  instructions (``test.jsonl``, else ``eval.jsonl``) makes it a *held-out* look; else any validation instruction a
  *validation* look, counted apart; an evaluation on neither (no split stage, or instructions outside it) is not
  counted, and its table says so.
- **A look** is an evaluation that judged at least one system the world had not seen on that split: a system is
  its stage's name and *settings* (the stage's method, config, seed, model and judge, and its inputs' settings in
  turn, as the stages' manifests record them; not the code version, so upgrading alpacafarm is not a retry). A
  resumed, repeated or re-printed evaluation of systems already seen adds no look.
- **A retry** is a held-out look at a stage whose settings differ from those of an earlier held-out look at the
  same stage name in the same world: the choice was (or may have been) made after seeing the held-out row. Its
  row is marked in the results table, with the number of earlier held-out looks at that stage.

Budgets are chosen on ``split: validation`` (validation looks cost nothing here); the held-out table is judged once.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError

LEDGER_FILE = "looks.sqlite"
HELD_OUT, VALIDATION = "held_out", "validation"
#: Fingerprint parts of a stage that are not its settings: a new version of the code is not a new choice.
_NOT_SETTINGS = ("code", "plugin_version")
#: How long a second process waits for another's write (seconds): looks are recorded in milliseconds.
_LOCK_TIMEOUT_S = 30.0
_SCHEMA = """
CREATE TABLE IF NOT EXISTS looks (id INTEGER PRIMARY KEY AUTOINCREMENT, world TEXT NOT NULL, split TEXT NOT NULL,
                                  at TEXT NOT NULL, run_dir TEXT NOT NULL, stage TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS looked (look INTEGER NOT NULL REFERENCES looks(id), system TEXT NOT NULL,
                                   stage TEXT NOT NULL, settings TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS looks_world ON looks (world, split);
CREATE INDEX IF NOT EXISTS looked_look ON looked (look);
"""


def digest(payload: Any) -> str:
    """SHA-256 of ``payload`` as canonical JSON."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def instruction_key(record: dict[str, Any]) -> str:
    """The key of an instruction record (instruction and input, stripped), as the split deduplicates them."""
    return f"{str(record.get('instruction', '')).strip()}\x00{str(record.get('input') or '').strip()}"


@dataclass(frozen=True)
class Splits:
    """The instruction keys of a run's held-out and validation splits."""

    held_out: frozenset[str]
    validation: frozenset[str]

    def which(self, judged: Iterable[str]) -> str | None:
        """The split an evaluation of the ``judged`` instruction keys looked at (see the module), or None."""
        keys = set(judged)
        if keys & self.held_out:
            return HELD_OUT
        if keys & self.validation:
            return VALIDATION
        return None


def world_of(splits: Splits, judge: Any, settings: dict[str, Any]) -> str:
    """The world's fingerprint: its held-out instructions, its judge, the evaluation's pair-choosing settings."""
    return digest({"held_out": sorted(splits.held_out), "judge": judge, "evaluation": settings})


def stage_settings(run_dir: Path, stage: str, _seen: tuple[str, ...] = ()) -> str:
    """The settings of a finished stage (see the module): its manifest's fingerprint parts less the code, and
    its inputs' settings in turn (a data source or the base model: its recorded identity). A stage without a
    readable manifest is its name alone."""
    path = run_dir / "stages" / stage / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return digest({"stage": stage, "manifest": None})
    parts = {k: v for k, v in (manifest.get("fingerprint_parts") or {}).items() if k not in _NOT_SETTINGS}
    upstream: dict[str, Any] = {}
    for name, wired in sorted((manifest.get("inputs") or {}).items()):
        source = str((wired or {}).get("from"))
        if source in _seen or not (run_dir / "stages" / source / "manifest.json").is_file():
            upstream[name] = {"from": source, "id": (wired or {}).get("id") if source not in _seen else None}
        else:
            upstream[name] = stage_settings(run_dir, source, (*_seen, stage))
    return digest({"own": parts, "inputs": upstream})


@dataclass
class LookSummary:
    """What the ledger says about one evaluation: the split it looked at, its world (a short id), how many looks
    that world has had on each split, this evaluation's ordinal (None: it saw only systems seen before, no new
    look), and per stage name the number of earlier held-out looks at other settings of that stage (retries)."""

    split: str | None
    world: str | None = None
    held_out_looks: int = 0
    validation_looks: int = 0
    look: int | None = None
    retried: dict[str, int] = field(default_factory=dict)
    ledger: str | None = None

    def caption(self) -> str:
        """One line for the results table's title."""
        if self.split is None:
            return "looks not counted: the judged instructions are on no instruction split of this run"
        counts = f"held-out looks {self.held_out_looks}, validation looks {self.validation_looks}"
        split = "held out" if self.split == HELD_OUT else "validation"
        which = f"look {self.look}" if self.look is not None else "no new look (every system seen before)"
        text = f"{split}: {which}; world {self.world[:8] if self.world else '?'}: {counts}"
        if self.retried:
            text += "; ‡ settings changed after an earlier held-out look at that stage"
        return text

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class LooksLedger:
    """The looks ledger (see the module): one SQLite file, safe for several processes at once."""

    def __init__(self, path: str | Path | None = None) -> None:
        from alpacafarm.paths import cache_dir

        self.path = Path(path) if path is not None else cache_dir() / LEDGER_FILE

    def _connect(self) -> sqlite3.Connection:
        from alpacafarm.paths import user_path

        with user_path(self.path, "open the looks ledger"):
            connection = sqlite3.connect(self.path, timeout=_LOCK_TIMEOUT_S, isolation_level=None)
        try:
            connection.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            connection.close()
            raise UserError(f"looks ledger {self.path}: {exc} (a file that is not this ledger? move it away; "
                            "the held-out looks it counted are then forgotten)") from None
        return connection

    def record(self, world: str, split: str, run_dir: Path, stage: str,
               systems: Sequence[tuple[str, str, str]]) -> LookSummary:
        """Record an evaluation of ``systems`` (system name, stage name, stage settings) on ``split`` of ``world``
        when it judged a system not seen there before; return what the ledger then says (see :class:`LookSummary`)."""
        connection = self._connect()
        try:
            connection.execute("BEGIN IMMEDIATE")  # count and insert as one step against concurrent evaluations
            seen = set(connection.execute(
                "SELECT looked.stage, looked.settings FROM looked JOIN looks ON looked.look = looks.id "
                "WHERE looks.world = ? AND looks.split = ?", (world, split)).fetchall())
            retried: dict[str, int] = {}
            if split == HELD_OUT:
                for _, stage_name, settings in systems:
                    (earlier,) = connection.execute(
                        "SELECT COUNT(DISTINCT looks.id) FROM looked JOIN looks ON looked.look = looks.id "
                        "WHERE looks.world = ? AND looks.split = ? AND looked.stage = ? AND looked.settings != ?",
                        (world, HELD_OUT, stage_name, settings)).fetchone()
                    if earlier:
                        retried[stage_name] = int(earlier)
            look: int | None = None
            if any((stage_name, settings) not in seen for _, stage_name, settings in systems):
                cursor = connection.execute(
                    "INSERT INTO looks (world, split, at, run_dir, stage) VALUES (?, ?, ?, ?, ?)",
                    (world, split, datetime.now(timezone.utc).isoformat(timespec="seconds"), str(run_dir), stage))
                look_id = cursor.lastrowid
                connection.executemany("INSERT INTO looked (look, system, stage, settings) VALUES (?, ?, ?, ?)",
                                       [(look_id, name, stage, settings) for name, stage, settings in systems])
                (look,) = connection.execute("SELECT COUNT(*) FROM looks WHERE world = ? AND split = ? AND id <= ?",
                                             (world, split, look_id)).fetchone()
            counts = dict(connection.execute("SELECT split, COUNT(*) FROM looks WHERE world = ? GROUP BY split",
                                             (world,)).fetchall())
            connection.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            raise UserError(f"looks ledger {self.path}: {exc}: the held-out looks of this evaluation cannot be "
                            "counted") from None
        finally:
            connection.close()
        return LookSummary(split, world, int(counts.get(HELD_OUT, 0)), int(counts.get(VALIDATION, 0)), look,
                           retried, str(self.path))

    def looks(self, world: str) -> list[dict[str, Any]]:
        """Every recorded look of ``world``, oldest first, with the systems each judged."""
        connection = self._connect()
        try:
            rows = connection.execute("SELECT id, split, at, run_dir, stage FROM looks WHERE world = ? ORDER BY id",
                                      (world,)).fetchall()
            found = []
            for look_id, split, at, run_dir, stage in rows:
                systems = connection.execute("SELECT system, stage, settings FROM looked WHERE look = ? ORDER BY rowid",
                                             (look_id,)).fetchall()
                found.append({"split": split, "at": at, "run_dir": run_dir, "stage": stage,
                              "systems": [{"system": s, "stage": st, "settings": se} for s, st, se in systems]})
            return found
        finally:
            connection.close()
