"""A labelling session's SQLite store: its pairs and settings, who holds which pair, the labels and their history.

Every change is one ``BEGIN IMMEDIATE`` transaction on a WAL database with ``synchronous=FULL``, committed before
the page hears back; so a killed server loses no label the page saw acknowledged, and concurrent labellers
(threads of one server, or several servers on one folder) serialise on SQLite's lock. A request that finds the
lock taken waits for it (SQLite's busy timeout, then retries with a pause, up to :data:`BUSY_DEADLINE_S`), so
load never turns into errors; a store that cannot be written (disk full, read-only, failing) raises
:class:`StoreUnavailable`, one line naming the store and the cause, and nothing is half-written.

Serving is indexed, never a scan of the pairs: each labeller walks the pairs in sampling order from a start drawn
per labeller (seeded), and the first pair they may have is found through a partial index of the pairs still
wanted (overlap pairs, and others with fewer than ``labels_per_pair`` labels). A pair shown to someone is theirs
for ``lease_s`` seconds (the page renews it while open, and releases it when the tab closes or the pair is
skipped). Labels are the current state; ``label_events`` keeps every label and every undo, the old kept.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from alpacafarm.errors import UserError
from alpacafarm.seeding import stable_hash
from alpacafarm_validation.label_identity import LabelRejected
from alpacafarm_validation.label_pairs import LabelPair

__all__ = ["CHOICES", "LabelRejected", "LabelStore", "Settings", "StoreUnavailable", "preference_of"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pairs (
    id TEXT PRIMARY KEY, position INTEGER NOT NULL UNIQUE, instruction TEXT NOT NULL, input TEXT NOT NULL,
    output_1 TEXT NOT NULL, output_2 TEXT NOT NULL, generator_1 TEXT, generator_2 TEXT, overlap INTEGER NOT NULL,
    n_labels INTEGER NOT NULL DEFAULT 0
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
CREATE TABLE IF NOT EXISTS label_events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, action TEXT NOT NULL, labeller TEXT NOT NULL, pair_id TEXT NOT NULL,
    swapped INTEGER NOT NULL, choice TEXT NOT NULL, preference INTEGER, reason TEXT NOT NULL, created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS labellers (
    key TEXT PRIMARY KEY, name TEXT NOT NULL, token_hash TEXT UNIQUE, created REAL NOT NULL, revoked REAL
);
CREATE INDEX IF NOT EXISTS labels_by_pair ON labels (pair_id);
CREATE INDEX IF NOT EXISTS assignments_by_pair ON assignments (pair_id);
CREATE INDEX IF NOT EXISTS pairs_by_state ON pairs (overlap, n_labels);
"""
#: What the page may send. "both_bad" (neither answer is acceptable) counts as a tie in the preference.
CHOICES = ("first", "second", "tie", "both_bad", "skip")
STORE_NAME = "labels.sqlite"
SCHEMA_VERSION = 2
#: How long a request waits in all for SQLite's lock before it is answered 503 (it never is under normal load).
BUSY_DEADLINE_S = 120.0
T = TypeVar("T")


class StoreUnavailable(UserError):
    """The store cannot be written or read (disk full, read-only, I/O error, lock never free): one line naming the
    store and the cause; the page gets it as a 503 with the JSON error shape."""

    status = 503

    def __init__(self, message: str, condition: str) -> None:
        super().__init__(message)
        self.condition = condition


@dataclass(frozen=True)
class Settings:
    """How pairs are shared among labellers; fixed when the session is created."""

    seed: int = 0
    overlap: float | None = None  # fraction every labeller sees; None: enough for MIN_SHARED_PAIRS (see below)
    labels_per_pair: int = 1  # labels wanted on each other pair
    lease_s: float = 120.0  # a shown pair is kept for its labeller this long unless the page renews it
    source: str = ""


def preference_of(choice: str, swapped: bool) -> int | None:
    """The canonical preference (1: output_1, 2: output_2, 0: tie or both bad, None: skipped) of a choice made on
    the page, where ``swapped`` means output_2 was shown first."""
    if choice in ("tie", "both_bad"):
        return 0
    if choice == "skip":
        return None
    first_is_1 = not swapped
    return 1 if (choice == "first") == first_is_1 else 2


def _condition(exc: sqlite3.Error) -> str:
    name = getattr(exc, "sqlite_errorname", "") or ""
    text = f"{name} {exc}".lower()
    if "busy" in text or "locked" in text:
        return "busy"
    if "full" in text:
        return "disk full"
    if "readonly" in text or "read-only" in text:
        return "read-only"
    if "cantopen" in text or "unable to open" in text:
        return "cannot open"
    if "ioerr" in text or "i/o" in text:
        return "I/O error"
    return "error"


def _why_read_only(path: Path) -> str:
    """The real cause of a store SQLite cannot write: a read-only file system, or permissions."""
    folder = path.parent
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return f"the file system holding {folder} is mounted read-only"
    except OSError:
        pass
    for target in (folder, path):
        if target.exists() and not os.access(target, os.W_OK):
            return f"no write permission on {target}"
    return "SQLite can only read it"


class LabelStore:
    """Access to one session's SQLite file; every method opens its own connection (safe from any thread)."""

    def __init__(self, path: Path, read_only: str | None = None) -> None:
        self.path = path
        self.read_only = read_only  # None, "ro" (SQLite's read-only mode) or "immutable" (no -wal, no -shm)

    # ------------------------------------------------------------------------------------------- plumbing

    def _connect(self) -> sqlite3.Connection:
        if self.read_only:  # immutable: no -shm or -wal is created, so a read-only folder can still be read
            query = "mode=ro" + ("&immutable=1" if self.read_only == "immutable" else "")
            db = sqlite3.connect(f"{self.path.resolve().as_uri()}?{query}", uri=True, timeout=10.0,
                                 isolation_level=None, check_same_thread=False)
        else:
            db = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA foreign_keys=ON")
        return db

    @contextmanager
    def _db(self, write: bool) -> Iterator[sqlite3.Connection]:
        db = self._connect()
        try:
            if write:
                db.execute("BEGIN IMMEDIATE")
            yield db
            if write:
                db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):  # the first error is the one to report
                    db.execute("ROLLBACK")
            raise
        finally:
            db.close()

    def unavailable(self, action: str, exc: sqlite3.Error) -> StoreUnavailable:
        """The one-line error for a SQLite failure while doing ``action``."""
        condition = _condition(exc)
        cause = {"disk full": "the disk is full", "busy": "the store stayed locked by another process",
                 "read-only": f"it is read-only ({_why_read_only(self.path)})",
                 "cannot open": f"it cannot be opened ({_why_read_only(self.path)})",
                 "I/O error": "the disk reports an I/O error (full or failing?)"}.get(condition, "SQLite error")
        return StoreUnavailable(f"label store {self.path}: cannot {action}: {cause}: {exc}; nothing was changed",
                                condition)

    def run(self, action: str, work: Callable[[sqlite3.Connection], T], write: bool = True) -> T:
        """``work(db)`` in one transaction (with ``write``, ``BEGIN IMMEDIATE`` ... ``COMMIT``), waiting for the
        lock while others hold it; a SQLite failure becomes :class:`StoreUnavailable`, and a
        :class:`LabelRejected` raised by ``work`` rolls everything back."""
        deadline = time.monotonic() + BUSY_DEADLINE_S
        while True:
            try:
                with self._db(write) as db:
                    return work(db)
            except sqlite3.Error as exc:
                if _condition(exc) == "busy" and time.monotonic() < deadline:
                    time.sleep(random.uniform(0.005, 0.05))
                    continue
                raise self.unavailable(action, exc) from None

    # ------------------------------------------------------------------------------------------- set-up

    @classmethod
    def open(cls, folder: Path, write: bool = False) -> LabelStore:
        """The store of an existing session in ``folder``; a folder without one is an error naming it. With
        ``write`` (serving), the store is brought up to date and a write is tried, so a read-only or full disk is
        refused now, in one line naming the path and the cause; without, a read-only store is still read."""
        path = folder / STORE_NAME
        if not path.is_file():
            raise UserError(f"{folder}: no labelling session here (no {STORE_NAME}); start one with "
                            "alpacafarm label serve PAIRS --dir " + str(folder))
        store = cls(path)
        if write:
            store.run("open it for labelling", store._migrate)
            return store
        count = lambda db: db.execute("SELECT COUNT(*) FROM pairs").fetchone()[0]  # noqa: E731
        for mode in (None, "ro", "immutable"):
            store = cls(path, read_only=mode)
            if mode == "immutable":
                wal = path.with_name(path.name + "-wal")
                if wal.is_file() and wal.stat().st_size:
                    raise UserError(f"label store {path}: cannot read it: it is read-only "
                                    f"({_why_read_only(path)}) and {wal.name} holds labels not yet merged into it; "
                                    "copy the folder somewhere writable and read the copy")
            try:
                store._check(store.run("read it", count, write=False))
                return store
            except StoreUnavailable as exc:
                if exc.condition not in ("read-only", "cannot open") or mode == "immutable":
                    raise
        raise AssertionError("unreachable")

    def _check(self, n_pairs: int) -> None:
        if not n_pairs:
            raise UserError(f"{self.path}: the session holds no pairs")

    def _migrate(self, db: sqlite3.Connection) -> None:
        """Bring a store of an older version up to this schema, and prove it can be written."""
        try:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.DatabaseError as exc:
            raise UserError(f"{self.path}: not a label store ({exc})") from None
        if "pairs" not in tables or "meta" not in tables:
            raise UserError(f"{self.path}: not a label store (no pairs table)")
        columns = {r[1] for r in db.execute("PRAGMA table_info(pairs)")}
        if "n_labels" not in columns:  # version 1: count the labels, drop the leases of labelled pairs
            db.execute("ALTER TABLE pairs ADD COLUMN n_labels INTEGER NOT NULL DEFAULT 0")
            db.execute("UPDATE pairs SET n_labels = (SELECT COUNT(*) FROM labels l WHERE l.pair_id = pairs.id "
                       "AND l.choice != 'skip')")
            db.execute("DELETE FROM assignments WHERE EXISTS (SELECT 1 FROM labels l WHERE l.labeller = "
                       "assignments.labeller AND l.pair_id = assignments.pair_id)")
        for statement in SCHEMA.split(";"):
            if statement.strip():
                db.execute(statement)
        if "labellers" not in tables:  # names typed before: one person per case-folded name, first spelling
            from alpacafarm_validation.label_identity import name_key

            for (name,) in db.execute("SELECT labeller FROM labels ORDER BY created").fetchall():
                db.execute("INSERT OR IGNORE INTO labellers VALUES (?, ?, NULL, ?, NULL)",
                           (name_key(name), name, time.time()))
        settings = self.settings(db)
        db.execute(f"CREATE INDEX IF NOT EXISTS pairs_wanted ON pairs (position) WHERE overlap = 1 OR n_labels < "
                   f"{int(settings.labels_per_pair)}")
        db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (json.dumps(SCHEMA_VERSION),))
        from alpacafarm_validation.label_serving import recount

        recount(db, settings)

    @classmethod
    def create_or_resume(cls, folder: Path, pairs: list[LabelPair] | None, settings: Settings) -> LabelStore:
        """Create the session in ``folder`` with ``pairs``, or resume the one there. Resuming with other pairs or
        settings is an error (labels would silently stop meaning what they meant)."""
        from alpacafarm.paths import make_dir

        if pairs is None:
            return cls.open(folder, write=True)
        if settings.overlap is not None and not 0 <= settings.overlap <= 1:  # before anything is written
            raise UserError(f"--overlap must be a fraction in [0, 1], got {settings.overlap}")
        make_dir(folder, "labelling folder")
        path = folder / STORE_NAME
        store = cls(path)
        if path.is_file():
            store = cls.open(folder, write=True)
            store.run("resume it", lambda db: store._check_same(db, pairs, settings), write=False)
            return store

        def create(db: sqlite3.Connection) -> None:
            db.execute("PRAGMA journal_mode=WAL")
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)

        store.run("create it", create, write=False)

        def fill(db: sqlite3.Connection) -> None:
            if db.execute("SELECT COUNT(*) FROM pairs").fetchone()[0]:  # another process was first
                return
            overlap = overlap_ids(pairs, settings)
            db.executemany(
                "INSERT INTO pairs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
                [(p.id, i, p.instruction, p.input, p.output_1, p.output_2, p.generator_1, p.generator_2,
                  int(p.id in overlap)) for i, p in enumerate(pairs)])
            db.executemany("INSERT INTO meta VALUES (?, ?)",
                           [(k, json.dumps(v)) for k, v in settings.__dict__.items()])
            store._migrate(db)

        store.run("create it", fill)
        store.run("resume it", lambda db: store._check_same(db, pairs, settings), write=False)
        return store

    def _check_same(self, db: sqlite3.Connection, pairs: list[LabelPair], settings: Settings) -> None:
        stored = [r[0] for r in db.execute("SELECT id FROM pairs ORDER BY position")]
        if [p.id for p in pairs] != stored:
            raise UserError(f"{self.path.parent}: this session was started with other pairs ({len(stored)} stored, "
                            f"{len(pairs)} given now, or another sample); resume it with `alpacafarm label serve "
                            f"--dir {self.path.parent}` alone, or give a new --dir")
        old = self.settings(db)
        for key in ("seed", "overlap", "labels_per_pair"):
            given = getattr(settings, key)
            if given is not None and getattr(old, key) != given:
                raise UserError(f"{self.path.parent}: this session was started with --{key.replace('_', '-')} "
                                f"{getattr(old, key)}, not {given}; resume it with the same value")

    def settings(self, db: sqlite3.Connection | None = None) -> Settings:
        """The session's settings (as stored when it was created)."""
        if db is None:
            return self.run("read its settings", self.settings, write=False)
        values = {r["key"]: json.loads(r["value"]) for r in db.execute("SELECT key, value FROM meta")}
        return Settings(**{k: v for k, v in values.items() if k in Settings.__dataclass_fields__})

    def meta(self, key: str, default: Any = None) -> Any:
        row = self.run("read it", lambda db: db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone(),
                       write=False)
        return default if row is None else json.loads(row[0])

    def set_meta_once(self, key: str, value: Any) -> Any:
        """``key``'s stored value, storing ``value`` first when there is none (e.g. the session's access token)."""
        def once(db: sqlite3.Connection) -> Any:
            db.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", (key, json.dumps(value)))
            return json.loads(db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()[0])
        return self.run("store a setting", once)

    # ------------------------------------------------------------------------------------------- serving

    def next_pair(self, labeller: str) -> dict[str, Any]:
        """The pair ``labeller`` should label now (their open pair, its lease renewed, else the first pair they may
        have from their start, leased to them), as the page shows it: answers in the order of their sides, no
        system names. ``{"done": True}`` when nothing is left for them. Always with ``progress``."""
        from alpacafarm_validation.label_serving import first_wanted, progress, shown

        def serve(db: sqlite3.Connection) -> dict[str, Any]:
            now = time.time()
            settings = self.settings(db)
            row = db.execute("SELECT pair_id, ticket, swapped FROM assignments WHERE labeller = ? "
                             "ORDER BY served DESC LIMIT 1", (labeller,)).fetchone()
            if row is not None:
                db.execute("UPDATE assignments SET served = ? WHERE ticket = ?", (now, row["ticket"]))
            else:
                pair_id = first_wanted(db, labeller, settings, now)
                if pair_id is not None:
                    row = {"pair_id": pair_id, "ticket": secrets.token_urlsafe(18),
                           "swapped": stable_hash(settings.seed, "side", labeller, pair_id) & 1}
                    db.execute("INSERT OR REPLACE INTO assignments VALUES (?, ?, ?, ?, ?)",
                               (labeller, pair_id, row["ticket"], row["swapped"], now))
            done = progress(db, labeller, settings, now)
            return {"done": True, "progress": done} if row is None else shown(db, row, done)

        return self.run("serve a pair", serve)

    def record(self, labeller: str, pair_id: str, ticket: str, choice: str, reason: str) -> dict[str, int]:
        """Store one label at once (one transaction). Raises :class:`LabelRejected` — and changes nothing — for an
        unknown pair (404), a ticket that was never served for this labeller and pair (403) or one already used
        (409: a replay or a double click; undo first to change a label)."""
        from alpacafarm_validation.label_serving import count_label, progress

        if choice not in CHOICES:
            raise LabelRejected(400, f"choice must be one of {', '.join(CHOICES)}, got {choice!r}")

        def store(db: sqlite3.Connection) -> dict[str, int]:
            now = time.time()
            if db.execute("SELECT 1 FROM pairs WHERE id = ?", (pair_id,)).fetchone() is None:
                raise LabelRejected(404, f"unknown pair id {pair_id!r}")
            served = db.execute("SELECT labeller, pair_id, swapped FROM assignments WHERE ticket = ?",
                                (ticket,)).fetchone()
            if served is None or served["labeller"] != labeller or served["pair_id"] != pair_id:
                if db.execute("SELECT 1 FROM labels WHERE labeller = ? AND pair_id = ? AND ticket = ?",
                              (labeller, pair_id, ticket)).fetchone() is not None:
                    raise LabelRejected(409, f"pair {pair_id} is already labelled by {labeller} (undo to change it)")
                raise LabelRejected(403, "this ticket was not issued for this labeller and pair")
            swapped = bool(served["swapped"])
            preference = preference_of(choice, swapped)
            db.execute("INSERT INTO labels VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (labeller, pair_id, int(swapped), choice, preference, reason, now, ticket))
            db.execute("INSERT INTO label_events (action, labeller, pair_id, swapped, choice, preference, reason, "
                       "created) VALUES ('label', ?, ?, ?, ?, ?, ?, ?)",
                       (labeller, pair_id, int(swapped), choice, preference, reason, now))
            if choice != "skip":
                count_label(db, pair_id, +1, self.settings(db))
            db.execute("DELETE FROM assignments WHERE ticket = ?", (ticket,))  # a skip frees the pair at once
            return progress(db, labeller, self.settings(db), now)

        return self.run("store a label", store)

    def undo(self, labeller: str) -> dict[str, Any]:
        """Take back ``labeller``'s most recent label (recorded as an ``undo`` event; the label event stays) and
        serve that pair to them again, with what they had chosen as ``undone``; the pair they were looking at is
        released. 409 when they have no label left to undo."""
        from alpacafarm_validation.label_serving import count_label, progress, shown

        def take_back(db: sqlite3.Connection) -> dict[str, Any]:
            now = time.time()
            last = db.execute("SELECT * FROM labels WHERE labeller = ? ORDER BY created DESC, rowid DESC LIMIT 1",
                              (labeller,)).fetchone()
            if last is None:
                raise LabelRejected(409, "nothing to undo: you have no labels in this session")
            db.execute("INSERT INTO label_events (action, labeller, pair_id, swapped, choice, preference, reason, "
                       "created) VALUES ('undo', ?, ?, ?, ?, ?, ?, ?)",
                       (labeller, last["pair_id"], last["swapped"], last["choice"], last["preference"],
                        last["reason"], now))
            db.execute("DELETE FROM labels WHERE labeller = ? AND pair_id = ?", (labeller, last["pair_id"]))
            if last["choice"] != "skip":
                count_label(db, last["pair_id"], -1, self.settings(db))
            db.execute("UPDATE assignments SET served = 0 WHERE labeller = ?", (labeller,))
            row = {"pair_id": last["pair_id"], "ticket": secrets.token_urlsafe(18), "swapped": last["swapped"]}
            db.execute("INSERT OR REPLACE INTO assignments VALUES (?, ?, ?, ?, ?)",
                       (labeller, last["pair_id"], row["ticket"], row["swapped"], now))
            out = shown(db, row, progress(db, labeller, self.settings(db), now))
            return out | {"undone": {"choice": last["choice"], "reason": last["reason"]}}

        return self.run("undo a label", take_back)

    def lease(self, labeller: str, ticket: str, renew: bool) -> bool:
        """Renew (the page is open) or release (skipped, tab closed) ``labeller``'s lease of the ticket's pair; a
        released pair may go to others at once, and is still theirs to label if they come back."""
        def change(db: sqlite3.Connection) -> bool:
            cursor = db.execute("UPDATE assignments SET served = ? WHERE ticket = ? AND labeller = ?",
                                (time.time() if renew else 0.0, ticket, labeller))
            return cursor.rowcount > 0

        return self.run("renew a lease" if renew else "release a lease", change)

    def identify(self, token: str | None, typed: object) -> str:
        """The labeller a request acts for (see :mod:`alpacafarm_validation.label_identity`)."""
        from alpacafarm_validation import label_identity

        return self.run("identify the labeller", lambda db: label_identity.identify(db, token, typed))

    # ------------------------------------------------------------------------------------------- reading

    def pairs(self) -> list[dict[str, Any]]:
        """Every pair of the session in its canonical orientation, in sampling order."""
        return self.run("read the pairs", lambda db: [dict(r) for r in db.execute(
            "SELECT * FROM pairs ORDER BY position")], write=False)

    def labels(self) -> list[dict[str, Any]]:
        """Every current label (undone ones left out) joined with its pair, in the order they were given."""
        return self.run("read the labels", lambda db: [dict(r) for r in db.execute(
            "SELECT l.labeller, l.pair_id, l.swapped, l.choice, l.preference, l.reason, l.created, "
            "p.instruction, p.input, p.output_1, p.output_2, p.generator_1, p.generator_2, p.overlap "
            "FROM labels l JOIN pairs p ON p.id = l.pair_id ORDER BY l.created, l.rowid")], write=False)

    def events(self) -> list[dict[str, Any]]:
        """Every label and undo ever made, oldest first (empty for a store older than undo)."""
        def read(db: sqlite3.Connection) -> list[dict[str, Any]]:
            if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'label_events'").fetchone() is None:
                return []
            return [dict(r) for r in db.execute("SELECT * FROM label_events ORDER BY id")]
        return self.run("read the label history", read, write=False)


#: Pairs every labeller sees when ``--overlap`` is not given: at least this many (or all, when fewer), and at
#: least 10% — the minimum the report asks for to state human-human agreement (label_stats.MIN_SHARED_PAIRS).
DEFAULT_OVERLAP_FRACTION = 0.1


def overlap_count(n: int, overlap: float | None) -> int:
    """How many of ``n`` pairs every labeller sees."""
    from alpacafarm_validation.label_stats import MIN_SHARED_PAIRS

    if overlap is None:
        return min(n, max(MIN_SHARED_PAIRS, math.ceil(DEFAULT_OVERLAP_FRACTION * n)))
    return math.ceil(overlap * n)


def overlap_ids(pairs: list[LabelPair], settings: Settings) -> set[str]:
    """The pairs every labeller sees (:func:`overlap_count` of them), drawn with the session's seed."""
    k = overlap_count(len(pairs), settings.overlap)
    ranked = sorted(pairs, key=lambda p: stable_hash(settings.seed, "overlap", p.id))
    return {p.id for p in ranked[:k]}
