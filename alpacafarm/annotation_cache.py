"""The annotation cache, cost ledger and claims: one SQLite file shared by every run (``$ALPACAFARM_CACHE_DIR``).

- ``annotations``: content-addressed answers (key = hash of the annotator's fingerprint, the pair as sent and, for
  a repeated annotation, its replicate index: replicate k > 0 is a label of its own, requested and paid once).
  A row holds a label (1, 2, a tie 0) or, with ``outcome = 'unparsed'``, a pair whose *own* answers (asked alone,
  then asked again) could not be read, and ``unparsed_asks``, how many calls gave it up so. A caller that passes
  ``reask_unparsed=R`` is served such a row only once ``unparsed_asks > R`` (it asks again, and pays again, up to
  R later times: a transient failure heals, an unreadable judge does not cost forever).
  Failures (transport, HTTP) are never stored, and neither is a batch's unreadable answer: its pairs are asked
  again one by one. A row with no label and no outcome (written before outcomes existed, when an unreadable batch
  took its neighbours with it) is not served: those pairs are asked again and the row is replaced.
  A request's labels are committed together with its ledger row as soon as the response is parsed, so a killed
  run loses at most the requests that were in flight.
- ``requests``: the ledger, one row per paid completion (a re-ask is a row of its own): tokens in/out, price,
  latency, transport attempts, whether it parsed, the pair keys it was for and the run (annotator instance) that
  paid, so ``ledger(run=...)`` gives one run's requests, tokens and dollars.
- ``claims``: exactly-once payment across processes. Before requesting, a process claims the keys it will pay for
  (:meth:`AnnotationCache.claim`, one transaction: keys already answered are reported done, keys claimed by a live
  owner busy, the rest — unclaimed, or claimed by a dead owner — become its own). The owner's row holds its pid,
  host and a heartbeat it refreshes while it works. Another process that meets a live claim waits for the answer
  (polling) instead of paying. A claim is dead when its pid is gone on this host (SIGKILL included) or its heartbeat
  is older than ``stale_after_s`` (another host, a reused pid); a dead claim is taken over. Answers delete their
  claims in the transaction that stores them; a failed request releases its claims at once.

- ``batches``, ``batch_requests``, ``batch_pairs``: batch submissions (``mode: batch``, see
  :mod:`alpacafarm.annotation_batches`). A pair in an open batch is nobody's to claim: :meth:`AnnotationCache.claim`
  reports it in ``batched`` (its answer comes when the batch is collected), across processes and days.

- Before each request an owner re-checks its claims (:meth:`AnnotationCache.renew`, one transaction that also
  refreshes their heartbeat): a process that was paused (Ctrl-Z, a sleeping laptop) past ``stale_after_s`` and
  lost its claims to another process learns it there and waits for that process's answers instead of paying.

WAL mode and a busy timeout make concurrent writers (several processes annotating at once) safe; the timeout is
bounded (``$ALPACAFARM_CACHE_LOCK_TIMEOUT_S``, default 5 s): a lock held longer fails, naming the process that holds
the file where /proc shows it. No secret is
ever written here: the annotator fingerprint holds the model and prompt, never the endpoint's key. SQLite's
refusals (a corrupt or foreign file, a folder in its place, read-only, locked, full) are a :class:`CacheError`:
one line naming the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.paths import cache_dir
from alpacafarm.processes import HOST, LOCK_TIMEOUT_ENV, claim_alive, lock_holders, lock_timeout_s
from alpacafarm.types import Annotation, Pair

SCHEMA = """
CREATE TABLE IF NOT EXISTS annotations (
    key TEXT PRIMARY KEY, annotator TEXT NOT NULL, preference INTEGER, raw_completion TEXT,
    tokens_in INTEGER NOT NULL, tokens_out INTEGER NOT NULL, price_usd REAL NOT NULL, latency_s REAL NOT NULL,
    request_id TEXT, created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS requests (
    id TEXT PRIMARY KEY, annotator TEXT NOT NULL, model TEXT NOT NULL, n_pairs INTEGER NOT NULL,
    tokens_in INTEGER NOT NULL, tokens_out INTEGER NOT NULL, price_usd REAL NOT NULL, latency_s REAL NOT NULL,
    attempts INTEGER NOT NULL, parsed INTEGER NOT NULL, created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_by_annotator ON requests (annotator, created);
CREATE TABLE IF NOT EXISTS claims (
    key TEXT PRIMARY KEY, owner TEXT NOT NULL, pid INTEGER NOT NULL, host TEXT NOT NULL, claimed REAL NOT NULL,
    heartbeat REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS claims_by_owner ON claims (owner);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, remote_id TEXT, annotator TEXT NOT NULL, model TEXT NOT NULL, endpoint TEXT NOT NULL,
    state TEXT NOT NULL, remote_status TEXT, n_requests INTEGER NOT NULL, n_pairs INTEGER NOT NULL,
    max_cost_usd REAL NOT NULL, cost_usd REAL, input_file_id TEXT, pid INTEGER NOT NULL, host TEXT NOT NULL,
    run TEXT, created REAL NOT NULL, submitted REAL, updated REAL NOT NULL, error TEXT
);
CREATE TABLE IF NOT EXISTS batch_requests (
    batch_id TEXT NOT NULL, custom_id TEXT NOT NULL, keys TEXT NOT NULL, body_sha256 TEXT NOT NULL,
    PRIMARY KEY (batch_id, custom_id)
);
CREATE TABLE IF NOT EXISTS batch_pairs (key TEXT NOT NULL, batch_id TEXT NOT NULL, PRIMARY KEY (key, batch_id));
"""
#: A batch whose pairs nobody else may pay for: recorded (maybe not yet at the provider) or submitted, not collected.
OPEN_BATCH_STATES = ("submitting", "pending")
#: Columns added since the first release (caches written before them are migrated in place).
ADDED_COLUMNS = {"annotations": {"outcome": "TEXT", "unparsed_asks": "INTEGER"},
                 "requests": {"keys": "TEXT", "run": "TEXT"}, "batch_requests": {"tokens_in_bound": "INTEGER"}}
#: Served from the cache: a label, a tie, or a pair given up alone (never a legacy NULL of a poisoned batch).
SERVABLE = "(preference IS NOT NULL OR outcome = 'unparsed')"


def servable(reask_unparsed: int | None) -> str:
    """The SQL condition of a row served from the cache: :data:`SERVABLE`; with ``reask_unparsed`` R, a pair given
    up as unparsed only once R later calls asked again (rows from before the count existed count once)."""
    if reask_unparsed is None:
        return SERVABLE
    return (f"(preference IS NOT NULL OR (outcome = 'unparsed' AND COALESCE(unparsed_asks, 1) > "
            f"{int(reask_unparsed)}))")


class CacheError(UserError):
    """The annotation cache file cannot be used (corrupt, not a database, a folder, read-only, locked, full)."""


def _cache_error(exc: sqlite3.Error, path: Path, action: str) -> CacheError:
    """One line naming the cache file and what SQLite refused, with what to do about it."""
    text = str(exc)
    lowered = text.lower()
    if "not a database" in lowered or "malformed" in lowered or "file is encrypted" in lowered:
        hint = "it is not an intact SQLite database (truncated or another file): move it away to start a new cache"
    elif "unable to open" in lowered:
        hint = ("cannot open it (a folder in its place, or its folder is missing or not writable); "
                f"check the path or set ${'ALPACAFARM_CACHE_DIR'}")
    elif "readonly" in lowered or "read-only" in lowered:
        hint = "it is read-only: make it (and its folder) writable or set $ALPACAFARM_CACHE_DIR"
    elif "locked" in lowered or "busy" in lowered:
        holders = lock_holders(path)
        who = f" ({', '.join(holders)})" if holders else ""
        hint = (f"another program{who} held a lock on it for more than {lock_timeout_s():g} s; close that program "
                f"and retry, or wait longer with ${LOCK_TIMEOUT_ENV}")
    elif "full" in lowered or "disk i/o" in lowered:
        hint = "the disk refused the write (full, a file-size limit, or failing): free some space"
    else:
        hint = "the file is unusable"
    return CacheError(f"annotation cache {path}: cannot {action}: {text} ({hint})")

#: A claim whose heartbeat is older than this is dead even if its pid seems alive (another host, a reused pid).
DEFAULT_STALE_AFTER_S = 120.0


def pair_key(fingerprint: str, pair: Pair, replicate: int = 0) -> str:
    """The content address of one pair as presented to one annotator configuration.

    ``replicate`` k > 0 addresses the k-th independent repeat of that annotation (its own key, so its own
    request); replicate 0 has the key every annotation had before replicates existed, so old caches stay valid.
    """
    import hashlib

    parts: list[object] = [fingerprint, pair.instruction, pair.input, pair.output_1, pair.output_2]
    if replicate:
        parts.append(replicate)
    payload = json.dumps(parts, ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


@dataclass
class LedgerTotals:
    requests: int
    tokens_in: int
    tokens_out: int
    price_usd: float

    def add(self, tokens_in: int, tokens_out: int, price_usd: float, requests: int = 1) -> None:
        self.requests += requests
        self.tokens_in += tokens_in
        self.tokens_out += tokens_out
        self.price_usd += price_usd

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
                "cost_usd": round(self.price_usd, 6)}


@dataclass
class ClaimResult:
    """What :meth:`AnnotationCache.claim` decided for each key."""

    mine: list[str] = field(default_factory=list)  # claimed now: pay for these (then record or release them)
    busy: dict[str, str] = field(default_factory=dict)  # key -> the live owner ("pid 123 on host"): wait
    done: list[str] = field(default_factory=list)  # answered meanwhile: read them with get_many
    taken_over: int = 0  # claims of dead owners among ``mine``
    batched: dict[str, str] = field(default_factory=dict)  # key -> the open batch that will answer it


def enter_wal(db: sqlite3.Connection, wait: float) -> None:
    """``PRAGMA journal_mode=WAL``, retried for up to ``wait`` seconds while another connection holds the lock.

    A new cache file (annotations, readings) is in rollback mode until its first connection switches it. A second
    connection asking for WAL while the first holds the write lock is refused at once: SQLite skips the busy handler
    where waiting could deadlock, so ``busy_timeout`` does not cover it (two processes opening a fresh cache
    together failed 11 times in 400 opens). The holder finishes in milliseconds; after ``wait`` the refusal is the
    usual one-line error.
    """
    deadline = time.monotonic() + wait
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


class AnnotationCache:
    """Thread-safe access to the cache file (one SQLite connection per thread)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else cache_dir() / "annotations.sqlite"
        from alpacafarm.paths import make_dir

        make_dir(self.path.parent, "annotation cache directory")
        self._local = threading.local()
        with self.errors("open"):
            db = self._connect()
            db.executescript(SCHEMA)
            self._migrate(db)

    def errors(self, action: str) -> _Errors:
        """A context in which SQLite's refusals become a :class:`CacheError` naming this file and ``action``."""
        return _Errors(self.path, action, self)

    def _connect(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            if self.path.is_dir():  # sqlite would say only "unable to open database file"
                raise CacheError(f"annotation cache {self.path}: is a directory, not a file; move it away or set "
                                 "$ALPACAFARM_CACHE_DIR")
            wait = lock_timeout_s()  # bounded: a lock held by a stuck program fails in seconds, naming it
            db = sqlite3.connect(self.path, timeout=wait, isolation_level=None)
            try:
                db.execute(f"PRAGMA busy_timeout={int(wait * 1000)}")
                enter_wal(db, wait)
                db.execute("PRAGMA synchronous=NORMAL")
            except BaseException:
                db.close()
                raise
            self._local.db = db
        return db

    @staticmethod
    def _migrate(db: sqlite3.Connection) -> None:
        for table, columns in ADDED_COLUMNS.items():
            have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
            for column, kind in columns.items():
                if column not in have:
                    try:
                        db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
                    except sqlite3.OperationalError as exc:  # another process added it first
                        if "duplicate column" not in str(exc):
                            raise

    def _transaction(self) -> _Transaction:
        return _Transaction(self._connect())

    def connection(self) -> sqlite3.Connection:
        """This thread's connection (autocommit), for the cache's companion tables; wrap its use in :meth:`errors`."""
        return self._connect()

    def transaction(self) -> _Transaction:
        """``with cache.transaction() as db:`` one ``BEGIN IMMEDIATE`` transaction on this thread's connection (for
        the cache's companion tables, :mod:`alpacafarm.annotation_batches`); wrap it in :meth:`errors`."""
        return self._transaction()

    def get_many(self, keys: Sequence[str], reask_unparsed: int | None = None) -> dict[str, Annotation]:
        """Cached answers for the keys that have one (labels, ties, pairs given up as unparsed; with
        ``reask_unparsed``, see :func:`servable`)."""
        with self.errors("read"):
            found: dict[str, Annotation] = {}
            db = self._connect()
            for chunk in _chunks(keys):
                rows = db.execute(
                    f"SELECT key, annotator, preference, raw_completion, tokens_in, tokens_out, price_usd, latency_s, "
                    f"outcome FROM annotations WHERE key IN ({_marks(chunk)}) AND {servable(reask_unparsed)}",
                    chunk).fetchall()
                for key, annotator, preference, raw, t_in, t_out, price, latency, outcome in rows:
                    found[key] = Annotation(preference, annotator, raw, t_in, t_out, price, latency, cached=True,
                                            outcome=outcome or None)
            return found

    def record_batch(self, annotator: str, model: str, entries: Iterable[tuple[str, Annotation]], *,
                     tokens_in: int, tokens_out: int, price_usd: float, latency_s: float, attempts: int,
                     parsed: bool, keys: Sequence[str] | None = None, run: str | None = None,
                     owner: str | None = None) -> str:
        """Store one paid completion and its answers in a single transaction; returns the request id.

        ``keys`` are the pairs the request was for (default: the entries' keys; a batch whose answer did not
        parse stores no entry but names its keys); ``owner``'s claims on the entries are released with them.
        Failed annotations are never stored."""
        with self.errors("store answers in"):
            request_id = uuid.uuid4().hex
            now = time.time()
            entries = [(key, a) for key, a in entries if a.outcome != "failed"]
            keys = list(keys) if keys is not None else [key for key, _ in entries]
            with self._transaction() as db:
                insert_request(db, request_id, now, annotator, model, entries, tokens_in=tokens_in,
                               tokens_out=tokens_out, price_usd=price_usd, latency_s=latency_s, attempts=attempts,
                               parsed=parsed, keys=keys, run=run, owner=owner)
            return request_id

    # ------------------------------------------------------------------------------------------------ claims
    def claim(self, keys: Sequence[str], owner: str, *, stale_after_s: float = DEFAULT_STALE_AFTER_S,
              reask_unparsed: int | None = None) -> ClaimResult:
        """Claim ``keys`` for ``owner`` (this process) in one transaction; see the module for the protocol."""
        with self.errors("claim pairs in"):
            result = ClaimResult()
            now = time.time()
            pid = os.getpid()
            with self._transaction() as db:
                for chunk in _chunks(keys):
                    marks = _marks(chunk)
                    done = {row[0] for row in db.execute(
                        f"SELECT key FROM annotations WHERE key IN ({marks}) AND {servable(reask_unparsed)}", chunk)}
                    held = {row[0]: row[1:] for row in db.execute(
                        f"SELECT key, owner, pid, host, heartbeat FROM claims WHERE key IN ({marks})", chunk)}
                    batched = open_batch_keys(db, chunk)
                    take = []
                    for key in chunk:
                        if key in done:
                            result.done.append(key)
                            continue
                        if key in batched:
                            result.batched[key] = batched[key]
                            continue
                        if key in held:
                            other, other_pid, other_host, heartbeat = held[key]
                            if other != owner and claim_alive(other_pid, other_host, heartbeat, now, stale_after_s):
                                result.busy[key] = f"pid {other_pid} on {other_host}"
                                continue
                            result.taken_over += other != owner
                        take.append((key, owner, pid, HOST, now, now))
                        result.mine.append(key)
                    db.executemany("INSERT OR REPLACE INTO claims VALUES (?,?,?,?,?,?)", take)
            return result

    def renew(self, keys: Sequence[str], owner: str, *, reask_unparsed: int | None = None) -> dict[str, str]:
        """Right before paying for ``keys``: refresh ``owner``'s claims on them in one transaction and return those
        that are no longer ``owner``'s, ``{key: who}`` (``"answered"`` or the other owner). A key whose claim was
        released and that nobody answered is claimed again. After this, no other process can take the claims for
        ``stale_after_s`` seconds, so the request that follows is paid once."""
        lost: dict[str, str] = {}
        now = time.time()
        with self.errors("renew claims in"), self._transaction() as db:
            for chunk in _chunks(keys):
                marks = _marks(chunk)
                done = {row[0] for row in db.execute(
                    f"SELECT key FROM annotations WHERE key IN ({marks}) AND {servable(reask_unparsed)}", chunk)}
                held = {row[0]: row[1:] for row in db.execute(
                    f"SELECT key, owner, pid, host FROM claims WHERE key IN ({marks})", chunk)}
                batched = open_batch_keys(db, chunk)
                for key in chunk:
                    if key in done:
                        lost[key] = "answered"
                    elif key in batched:
                        lost[key] = batched[key]
                    elif key in held and held[key][0] != owner:
                        lost[key] = f"pid {held[key][1]} on {held[key][2]}"
                mine = [key for key in chunk if key not in lost]
                db.executemany("INSERT OR REPLACE INTO claims VALUES (?,?,?,?,?,?)",
                               [(key, owner, os.getpid(), HOST, now, now) for key in mine])
        return lost

    def heartbeat(self, owner: str) -> None:
        """Keep ``owner``'s claims alive."""
        with self.errors("refresh claims in"):
            self._connect().execute("UPDATE claims SET heartbeat = ? WHERE owner = ?", (time.time(), owner))

    def release(self, owner: str, keys: Sequence[str] | None = None) -> None:
        """Give up ``owner``'s claims on ``keys`` (all of them without ``keys``): others may then pay for them."""
        with self.errors("release claims in"):
            db = self._connect()
            if keys is None:
                db.execute("DELETE FROM claims WHERE owner = ?", (owner,))
                return
            for chunk in _chunks(keys):
                db.execute(f"DELETE FROM claims WHERE owner = ? AND key IN ({_marks(chunk)})", [owner, *chunk])

    def claims(self) -> list[dict[str, Any]]:
        """Every claim held now (for inspection and tests)."""
        with self.errors("read claims of"):
            rows = self._connect().execute("SELECT key, owner, pid, host, claimed, heartbeat FROM claims").fetchall()
            names = ("key", "owner", "pid", "host", "claimed", "heartbeat")
            return [dict(zip(names, row, strict=True)) for row in rows]

    # ------------------------------------------------------------------------------------------------ ledger
    def ledger(self, annotator: str | None = None, since: float | None = None, run: str | None = None) -> LedgerTotals:
        """Totals of the paid requests (optionally of one annotator, since a UNIX time, of one run)."""
        with self.errors("read the ledger of"):
            query = ("SELECT COUNT(*), COALESCE(SUM(tokens_in),0), COALESCE(SUM(tokens_out),0), "
                     "COALESCE(SUM(price_usd),0) FROM requests WHERE 1=1")
            args: list[Any] = []
            for column, value in (("annotator", annotator), ("run", run)):
                if value is not None:
                    query += f" AND {column} = ?"
                    args.append(value)
            if since is not None:
                query += " AND created >= ?"
                args.append(since)
            n, t_in, t_out, price = self._connect().execute(query, args).fetchone()
            return LedgerTotals(n, t_in, t_out, price)

    def paid_keys(self, parsed_only: bool = True) -> dict[str, int]:
        """How many ledger rows paid for each pair key (parsed answers only by default): an audit of
        exactly-once payment (a count above 1 is a pair bought twice)."""
        with self.errors("read the ledger of"):
            counts: dict[str, int] = {}
            query = "SELECT keys FROM requests" + (" WHERE parsed = 1" if parsed_only else "")
            for (keys,) in self._connect().execute(query):
                for key in json.loads(keys or "[]"):
                    counts[key] = counts.get(key, 0) + 1
            return counts

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None


def insert_request(db: sqlite3.Connection, request_id: str, now: float, annotator: str, model: str,
                   entries: list[tuple[str, Annotation]], *, tokens_in: int, tokens_out: int, price_usd: float,
                   latency_s: float, attempts: int, parsed: bool, keys: list[str], run: str | None,
                   owner: str | None) -> None:
    """One ledger row and its answers, inside the caller's transaction (``record_batch``; a batch's collection)."""
    db.execute("INSERT INTO requests (id, annotator, model, n_pairs, tokens_in, tokens_out, price_usd, "
               "latency_s, attempts, parsed, created, keys, run) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
               (request_id, annotator, model, len(keys), tokens_in, tokens_out, price_usd, latency_s,
                attempts, int(parsed), now, json.dumps(keys), run))
    # a pair given up as unparsed once more: one more than the row it replaces (legacy rows: 1)
    db.executemany(
        "INSERT OR REPLACE INTO annotations (key, annotator, preference, raw_completion, tokens_in, "
        "tokens_out, price_usd, latency_s, request_id, created, outcome, unparsed_asks) "
        "VALUES (?,?,?,?,?,?,?,?,?,?,?, CASE WHEN ? = 'unparsed' THEN 1 + COALESCE((SELECT "
        "CASE WHEN outcome = 'unparsed' THEN COALESCE(unparsed_asks, 1) ELSE 0 END FROM annotations "
        "WHERE key = ?), 0) END)",
        [(key, a.annotator, a.preference, a.raw_completion, a.tokens_in, a.tokens_out, a.price_usd,
          a.latency_s, request_id, now, a.outcome, a.outcome, key) for key, a in entries])
    if owner is not None and entries:
        db.executemany("DELETE FROM claims WHERE key = ? AND owner = ?", [(key, owner) for key, _ in entries])


def open_batch_keys(db: sqlite3.Connection, keys: Sequence[str]) -> dict[str, str]:
    """{key: "batch <id>"} for the ``keys`` in an open batch (see :data:`OPEN_BATCH_STATES`)."""
    rows = db.execute(
        f"SELECT p.key, COALESCE(b.remote_id, b.id) FROM batch_pairs p JOIN batches b ON b.id = p.batch_id "
        f"WHERE p.key IN ({_marks(keys)}) AND b.state IN ({_marks(OPEN_BATCH_STATES)})",
        [*keys, *OPEN_BATCH_STATES]).fetchall()
    return {key: f"batch {batch}" for key, batch in rows}


class _Errors:
    """Turns ``sqlite3.Error`` inside the block into a :class:`CacheError` (see :meth:`AnnotationCache.errors`)."""

    def __init__(self, path: Path, action: str, cache: AnnotationCache | None = None) -> None:
        self.path, self.action, self.cache = path, action, cache

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, sqlite3.Error):
            error = _cache_error(exc, self.path, self.action)
            db = getattr(self.cache._local, "db", None) if self.cache is not None else None
            if db is not None and "locked" in str(exc).lower():
                # the bound was spent once: clean-up writes on the way out (releasing claims) must not wait again
                with contextlib.suppress(sqlite3.Error):
                    db.execute("PRAGMA busy_timeout=0")
            raise error from exc


class _Transaction:
    """``BEGIN IMMEDIATE`` … ``COMMIT`` (``ROLLBACK`` on any exception) on one connection."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.db.execute("COMMIT")
        elif self.db.in_transaction:  # SQLite already rolled back after some errors (a full disk): keep that error
            self.db.execute("ROLLBACK")


def _chunks(keys: Sequence[str], size: int = 500) -> Iterable[list[str]]:
    for start in range(0, len(keys), size):
        yield list(keys[start:start + size])


def _marks(chunk: Sequence[str]) -> str:
    return ",".join("?" * len(chunk))
