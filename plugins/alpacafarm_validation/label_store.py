"""The store of a human labelling session (``alpacafarm label``): one SQLite file, ``DIR/labels.sqlite``.

Tables:

- ``meta``: the session's settings (seed, overlap, lease, labels per pair, the input it was sampled from).
- ``pairs``: the pairs to label, in canonical orientation (``output_1``, ``output_2`` as in the input), with the
  systems that wrote them (``generator_1``, ``generator_2``; hidden from labellers) and whether the pair is in the
  overlap every labeller sees.
- ``assignments``: which pair was served to which labeller, on which side each answer was shown, and the ticket
  (a random one-use token) the page must send back with the label. A labeller's assignment without a label is their
  current pair: a reload shows it again instead of a new one.
- ``labels``: one row per (labeller, pair), the primary key: a second label of the same pair by the same person
  cannot exist, whatever the requests do.

Durability follows the annotation cache's rules: WAL journal, ``synchronous=FULL`` and one short ``BEGIN IMMEDIATE``
transaction per served pair and per label, committed before the page is answered; so a killed server loses no label
the page saw acknowledged, and concurrent labellers (threads of one server, or several servers on one folder)
serialise on SQLite's lock instead of corrupting anything.
"""

from __future__ import annotations

import json
import math
import secrets
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.seeding import stable_hash
from alpacafarm_validation.label_pairs import LabelPair

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pairs (
    id TEXT PRIMARY KEY, position INTEGER NOT NULL UNIQUE, instruction TEXT NOT NULL, input TEXT NOT NULL,
    output_1 TEXT NOT NULL, output_2 TEXT NOT NULL, generator_1 TEXT, generator_2 TEXT, overlap INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS assignments (
    labeller TEXT NOT NULL, pair_id TEXT NOT NULL REFERENCES pairs (id), ticket TEXT NOT NULL UNIQUE,
    swapped INTEGER NOT NULL, served REAL NOT NULL, PRIMARY KEY (labeller, pair_id)
);
CREATE TABLE IF NOT EXISTS labels (
    labeller TEXT NOT NULL, pair_id TEXT NOT NULL REFERENCES pairs (id), swapped INTEGER NOT NULL,
    choice TEXT NOT NULL, preference INTEGER, reason TEXT NOT NULL, created REAL NOT NULL, ticket TEXT NOT NULL,
    PRIMARY KEY (labeller, pair_id)
);
CREATE INDEX IF NOT EXISTS labels_by_pair ON labels (pair_id);
CREATE INDEX IF NOT EXISTS assignments_by_pair ON assignments (pair_id);
"""
#: What the page may send, and the preference each means in canonical orientation given the side shown.
CHOICES = ("first", "second", "tie", "skip")
STORE_NAME = "labels.sqlite"


class LabelRejected(Exception):
    """A request the store refuses; ``status`` is the HTTP status the page gets (4xx), nothing was changed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Settings:
    """How pairs are shared among labellers; fixed when the session is created."""

    seed: int = 0
    overlap: float = 0.1  # fraction of pairs every labeller sees (human-human agreement is measured on them)
    labels_per_pair: int = 1  # labels wanted on each other pair
    lease_s: float = 600.0  # a served, unlabelled pair is kept for its labeller this long before others may get it
    source: str = ""


def preference_of(choice: str, swapped: bool) -> int | None:
    """The canonical preference (1: output_1, 2: output_2, 0: tie, None: skipped) of a choice made on the page,
    where ``swapped`` means output_2 was shown first."""
    if choice == "tie":
        return 0
    if choice == "skip":
        return None
    first_is_1 = not swapped
    return 1 if (choice == "first") == first_is_1 else 2


class LabelStore:
    """Access to one session's SQLite file; every method opens its own connection (safe from any thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextmanager
    def _db(self, action: str, write: bool = False) -> Iterator[sqlite3.Connection]:
        """A connection; with ``write``, inside one ``BEGIN IMMEDIATE`` transaction committed on success."""
        try:
            db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        except sqlite3.Error as exc:
            raise UserError(f"label store {self.path}: cannot {action}: {exc}") from None
        try:
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA foreign_keys=ON")
            if write:
                db.execute("BEGIN IMMEDIATE")
            yield db
            if write:
                db.execute("COMMIT")
        except BaseException:
            if write and db.in_transaction:
                db.execute("ROLLBACK")
            raise
        finally:
            db.close()

    # ------------------------------------------------------------------------------------------- set-up

    @classmethod
    def open(cls, folder: Path) -> LabelStore:
        """The store of an existing session in ``folder``; a folder without one is an error naming it."""
        path = folder / STORE_NAME
        if not path.is_file():
            raise UserError(f"{folder}: no labelling session here (no {STORE_NAME}); start one with "
                            "alpacafarm label serve PAIRS --dir " + str(folder))
        store = cls(path)
        try:
            with store._db("read") as db:
                if not db.execute("SELECT COUNT(*) FROM pairs").fetchone()[0]:
                    raise UserError(f"{path}: the session holds no pairs")
        except sqlite3.Error as exc:
            raise UserError(f"{path}: not a label store ({exc})") from None
        return store

    @classmethod
    def create_or_resume(cls, folder: Path, pairs: list[LabelPair] | None, settings: Settings) -> LabelStore:
        """Create the session in ``folder`` with ``pairs``, or resume the one there. Resuming with other pairs or
        settings is an error (labels would silently stop meaning what they meant)."""
        from alpacafarm.paths import make_dir

        if pairs is None:
            return cls.open(folder)
        if not 0 <= settings.overlap <= 1:  # before anything is written
            raise UserError(f"--overlap must be a fraction in [0, 1], got {settings.overlap}")
        make_dir(folder, "labelling folder")
        path = folder / STORE_NAME
        store = cls(path)
        try:
            with store._db("create", write=False) as db:
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript(SCHEMA)
            with store._db("create", write=True) as db:
                stored = [r[0] for r in db.execute("SELECT id FROM pairs ORDER BY position")]
                if stored:
                    store._check_same(db, pairs, settings, stored)
                    return store
                overlap = overlap_ids(pairs, settings)
                db.executemany(
                    "INSERT INTO pairs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [(p.id, i, p.instruction, p.input, p.output_1, p.output_2, p.generator_1, p.generator_2,
                      int(p.id in overlap)) for i, p in enumerate(pairs)])
                db.executemany("INSERT INTO meta VALUES (?, ?)",
                               [(k, json.dumps(v)) for k, v in settings.__dict__.items()])
        except sqlite3.Error as exc:
            raise UserError(f"label store {path}: cannot create it: {exc}") from None
        return store

    def _check_same(self, db: sqlite3.Connection, pairs: list[LabelPair], settings: Settings,
                    stored: list[str]) -> None:
        if [p.id for p in pairs] != stored:
            raise UserError(f"{self.path.parent}: this session was started with other pairs ({len(stored)} stored, "
                            f"{len(pairs)} given now, or another sample); resume it with `alpacafarm label serve "
                            f"--dir {self.path.parent}` alone, or give a new --dir")
        old = self.settings(db)
        for key in ("seed", "overlap", "labels_per_pair"):
            if getattr(old, key) != getattr(settings, key):
                raise UserError(f"{self.path.parent}: this session was started with --{key.replace('_', '-')} "
                                f"{getattr(old, key)}, not {getattr(settings, key)}; resume it with the same value")

    def settings(self, db: sqlite3.Connection | None = None) -> Settings:
        if db is None:
            with self._db("read") as own:
                return self.settings(own)
        values = {r["key"]: json.loads(r["value"]) for r in db.execute("SELECT key, value FROM meta")}
        return Settings(**{k: v for k, v in values.items() if k in Settings.__dataclass_fields__})

    # ------------------------------------------------------------------------------------------- serving

    def next_pair(self, labeller: str) -> dict[str, Any]:
        """The pair ``labeller`` should label now (their unlabelled current pair, else a new one reserved for
        them), as the page shows it: answers in the order of their sides, no system names. ``{"done": True}``
        when nothing is left for them. Always with ``progress``."""
        now = time.time()
        with self._db("serve a pair", write=True) as db:
            settings = self.settings(db)
            open_row = db.execute(
                "SELECT a.pair_id, a.ticket, a.swapped FROM assignments a LEFT JOIN labels l "
                "ON l.labeller = a.labeller AND l.pair_id = a.pair_id WHERE a.labeller = ? AND l.pair_id IS NULL "
                "ORDER BY a.served LIMIT 1", (labeller,)).fetchone()
            if open_row is None:
                candidates = self._eligible(db, labeller, settings, now)
                if candidates:
                    pair_id = min(candidates, key=lambda i: stable_hash(settings.seed, "order", labeller, i))
                    swapped = stable_hash(settings.seed, "side", labeller, pair_id) & 1
                    ticket = secrets.token_urlsafe(18)
                    db.execute("INSERT OR REPLACE INTO assignments VALUES (?, ?, ?, ?, ?)",
                               (labeller, pair_id, ticket, swapped, now))
                    open_row = {"pair_id": pair_id, "ticket": ticket, "swapped": swapped}
            progress = self._progress(db, labeller, settings, now)
            if open_row is None:
                return {"done": True, "progress": progress}
            pair = db.execute("SELECT * FROM pairs WHERE id = ?", (open_row["pair_id"],)).fetchone()
        first, second = (pair["output_2"], pair["output_1"]) if open_row["swapped"] else (pair["output_1"],
                                                                                           pair["output_2"])
        return {"done": False, "pair_id": pair["id"], "ticket": open_row["ticket"], "instruction": pair["instruction"],
                "input": pair["input"], "first": first, "second": second, "progress": progress}

    def _eligible(self, db: sqlite3.Connection, labeller: str, settings: Settings, now: float) -> list[str]:
        """Pairs ``labeller`` may get next: overlap pairs they have not labelled; other pairs with fewer than
        ``labels_per_pair`` labels (a skip does not count) that no one else holds under a live lease."""
        rows = db.execute(
            "SELECT p.id FROM pairs p WHERE p.id NOT IN (SELECT pair_id FROM labels WHERE labeller = :who) AND ("
            " p.overlap = 1 OR ("
            "  (SELECT COUNT(*) FROM labels l WHERE l.pair_id = p.id AND l.choice != 'skip') < :per_pair AND"
            "  NOT EXISTS (SELECT 1 FROM assignments a WHERE a.pair_id = p.id AND a.labeller != :who"
            "   AND a.served > :lease_start AND NOT EXISTS (SELECT 1 FROM labels l2 WHERE l2.pair_id = a.pair_id"
            "   AND l2.labeller = a.labeller))))",
            {"who": labeller, "per_pair": settings.labels_per_pair, "lease_start": now - settings.lease_s})
        return [r[0] for r in rows]

    def _progress(self, db: sqlite3.Connection, labeller: str, settings: Settings, now: float) -> dict[str, int]:
        """How many pairs ``labeller`` labelled, and that plus what is left for them (their current pair included,
        even when others labelled it meanwhile): the page's progress bar."""
        done = db.execute("SELECT COUNT(*) FROM labels WHERE labeller = ?", (labeller,)).fetchone()[0]
        current = {r[0] for r in db.execute(
            "SELECT a.pair_id FROM assignments a WHERE a.labeller = ? AND NOT EXISTS (SELECT 1 FROM labels l "
            "WHERE l.labeller = a.labeller AND l.pair_id = a.pair_id)", (labeller,))}
        left = current | set(self._eligible(db, labeller, settings, now))
        return {"done": done, "total": done + len(left)}

    def record(self, labeller: str, pair_id: str, ticket: str, choice: str, reason: str) -> dict[str, int]:
        """Store one label at once (one transaction). Raises :class:`LabelRejected` — and changes nothing — for an
        unknown pair (404), a ticket that was never served for this labeller and pair (403) or one already used
        (409: a replay or a double click)."""
        if choice not in CHOICES:
            raise LabelRejected(400, f"choice must be one of {', '.join(CHOICES)}, got {choice!r}")
        now = time.time()
        with self._db("store a label", write=True) as db:
            if db.execute("SELECT 1 FROM pairs WHERE id = ?", (pair_id,)).fetchone() is None:
                raise LabelRejected(404, f"unknown pair id {pair_id!r}")
            served = db.execute("SELECT labeller, pair_id, swapped FROM assignments WHERE ticket = ?",
                                (ticket,)).fetchone()
            if served is None or served["labeller"] != labeller or served["pair_id"] != pair_id:
                raise LabelRejected(403, "this ticket was not issued for this labeller and pair")
            if db.execute("SELECT 1 FROM labels WHERE labeller = ? AND pair_id = ?",
                          (labeller, pair_id)).fetchone() is not None:
                raise LabelRejected(409, f"pair {pair_id} is already labelled by {labeller}")
            swapped = bool(served["swapped"])
            db.execute("INSERT INTO labels VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (labeller, pair_id, int(swapped), choice, preference_of(choice, swapped), reason, now, ticket))
            return self._progress(db, labeller, self.settings(db), now)

    # ------------------------------------------------------------------------------------------- reading

    def pairs(self) -> list[dict[str, Any]]:
        """Every pair of the session in its canonical orientation, in sampling order."""
        with self._db("read the pairs") as db:
            return [dict(r) for r in db.execute("SELECT * FROM pairs ORDER BY position")]

    def labels(self) -> list[dict[str, Any]]:
        """Every stored label joined with its pair, in the order they were given."""
        with self._db("read the labels") as db:
            rows = db.execute(
                "SELECT l.labeller, l.pair_id, l.swapped, l.choice, l.preference, l.reason, l.created, "
                "p.instruction, p.input, p.output_1, p.output_2, p.generator_1, p.generator_2, p.overlap "
                "FROM labels l JOIN pairs p ON p.id = l.pair_id ORDER BY l.created, l.rowid")
            return [dict(r) for r in rows]


def overlap_ids(pairs: list[LabelPair], settings: Settings) -> set[str]:
    """The ``ceil(overlap * n)`` pairs every labeller sees, drawn with the session's seed."""
    k = math.ceil(settings.overlap * len(pairs))
    ranked = sorted(pairs, key=lambda p: stable_hash(settings.seed, "overlap", p.id))
    return {p.id for p in ranked[:k]}
