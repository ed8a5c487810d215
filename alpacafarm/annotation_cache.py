"""The annotation cache and cost ledger: one SQLite file shared by every run (``$ALPACAFARM_CACHE_DIR``).

- ``annotations``: content-addressed labels (key = hash of the annotator's fingerprint, the pair as sent and, for
  a repeated annotation, its replicate index: replicate k > 0 is a label of its own, requested and paid once).
  A batch's labels are committed together with its ledger row as soon as the response is parsed, so a killed
  run loses at most the batches that were in flight, and no label is ever paid for twice.
- ``requests``: the ledger, one row per paid request: tokens in/out, price, latency, attempts.

WAL mode and a busy timeout make concurrent writers (several processes annotating at once) safe. No secret is
ever written here: the annotator fingerprint holds the model and prompt, never the endpoint's key.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alpacafarm.paths import cache_dir
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
"""


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


class AnnotationCache:
    """Thread-safe access to the cache file (one SQLite connection per thread)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else cache_dir() / "annotations.sqlite"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        with self._connect() as db:
            db.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA busy_timeout=60000")
            self._local.db = db
        return db

    def get_many(self, keys: Sequence[str]) -> dict[str, Annotation]:
        """Cached annotations for the keys that have one."""
        found: dict[str, Annotation] = {}
        db = self._connect()
        for start in range(0, len(keys), 500):
            chunk = list(keys[start:start + 500])
            marks = ",".join("?" * len(chunk))
            rows = db.execute(
                f"SELECT key, annotator, preference, raw_completion, tokens_in, tokens_out, price_usd, latency_s "
                f"FROM annotations WHERE key IN ({marks})", chunk).fetchall()
            for key, annotator, preference, raw, t_in, t_out, price, latency in rows:
                found[key] = Annotation(preference, annotator, raw, t_in, t_out, price, latency, cached=True)
        return found

    def record_batch(self, annotator: str, model: str, entries: Iterable[tuple[str, Annotation]], *,
                     tokens_in: int, tokens_out: int, price_usd: float, latency_s: float, attempts: int,
                     parsed: bool) -> str:
        """Store one paid request and its labels in a single transaction; returns the request id."""
        request_id = uuid.uuid4().hex
        now = time.time()
        entries = list(entries)
        db = self._connect()
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("INSERT INTO requests VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                       (request_id, annotator, model, len(entries), tokens_in, tokens_out, price_usd, latency_s,
                        attempts, int(parsed), now))
            db.executemany(
                "INSERT OR REPLACE INTO annotations VALUES (?,?,?,?,?,?,?,?,?,?)",
                [(key, a.annotator, a.preference, a.raw_completion, a.tokens_in, a.tokens_out, a.price_usd,
                  a.latency_s, request_id, now) for key, a in entries])
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return request_id

    def ledger(self, annotator: str | None = None, since: float | None = None) -> LedgerTotals:
        """Totals of the paid requests (optionally of one annotator, and since a UNIX time)."""
        query = ("SELECT COUNT(*), COALESCE(SUM(tokens_in),0), COALESCE(SUM(tokens_out),0), COALESCE(SUM(price_usd),0) "
                 "FROM requests WHERE 1=1")
        args: list[Any] = []
        if annotator is not None:
            query += " AND annotator = ?"
            args.append(annotator)
        if since is not None:
            query += " AND created >= ?"
            args.append(since)
        n, t_in, t_out, price = self._connect().execute(query, args).fetchone()
        return LedgerTotals(n, t_in, t_out, price)

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None
