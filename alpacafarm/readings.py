"""Readings of frozen models, stored once per machine: ``$ALPACAFARM_CACHE_DIR/readings.sqlite``.

A *reading* is what a frozen model's final layer says about one tokenised text ``prompt + answer + EOS``: the final
hidden states averaged over the answer (the features a mean-pooled reward model and the gold's head read) and the
log-probabilities of the answer's first tokens (what the gold's relevance reads). Several parts of one run read the
same texts with the same weights: the gold labels the preference stage's samples, then the head-only reward model
reads the same samples' features; best-of-n's reward model reads every candidate, then the gold reads the winners.
Where the weights and their dtype agree (a CPU without native bfloat16 reads both in float32), the second reading is
the first one's row, not a second forward pass (issue 65: on such a CPU the reward-model stage read 381 answers the
gold had just read).

The key of a row is a hash of :data:`READING_VERSION`, the weights' fingerprint (:func:`fingerprint`: every tensor of
the backbone, its name, dtype, shape and bytes), the text's token ids and where its answer starts. A row holds
``features`` and ``log_probs``, each written once: the first reading to compute a field writes it (``INSERT OR
IGNORE``, then an update of an empty field only), and every later reader takes the stored field, so a killed run
that resumes reads the numbers its first attempt stored, and two readers of one text read one number. A stored
value equals a fresh reading to float rounding (batches of other shapes round differently), as readings of one
text in two batches already do.

Only callers that pass a store use one (the helpful gold, the head-only reward model and :class:`~alpacafarm.
rewards.RewardScorer` pass :func:`default_store`); a test or a benchmark that times the forward passes passes none.
SQLite's refusals are one-line :class:`ReadingStoreError`\\ s naming the file.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alpacafarm.annotation_cache import enter_wal
from alpacafarm.errors import UserError
from alpacafarm.paths import cache_dir, make_dir
from alpacafarm.processes import lock_timeout_s

#: Changes whenever what a reading means changes (the pooling rule, what the log-probabilities are of), so rows of
#: an older definition are never read as this one's.
READING_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS readings (
    key TEXT PRIMARY KEY,
    features BLOB,
    log_probs BLOB
);
"""


class ReadingStoreError(UserError):
    """The readings file could not be opened, read or written (one line naming it)."""


@dataclass(frozen=True)
class Reading:
    """One stored row: the answer's averaged final states (float32, or None when not read yet) and its first
    log-probabilities (None when not read yet)."""

    features: Any = None
    log_probs: list[float] | None = None


_fingerprints: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], str]] = weakref.WeakKeyDictionary()


def fingerprint(backbone: Any) -> str:
    """A hash of every tensor of ``backbone`` (parameters and buffers: name, dtype, shape, bytes): two models with
    the same weights in the same dtype share readings, any changed weight or dtype does not. Computed once per
    module while its tensors are unchanged (their storage and in-place version counters are checked each call)."""
    import torch

    tensors = list(backbone.state_dict(keep_vars=True).items())
    state = tuple((name, t.data_ptr(), t._version, t.dtype, tuple(t.shape)) for name, t in tensors)
    known = _fingerprints.get(backbone)
    if known is not None and known[0] == state:
        return known[1]
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in tensors:
        value = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        if value.numel():
            digest.update(value.reshape(-1).view(torch.uint8).numpy())
    _fingerprints[backbone] = (state, digest.hexdigest())
    return _fingerprints[backbone][1]


def reading_key(model_fingerprint: str, ids: Sequence[int], start: int) -> str:
    """The row of the text ``ids`` (its answer from ``start``) read by the model with ``model_fingerprint``."""
    digest = hashlib.blake2b(digest_size=20)
    digest.update(f"{READING_VERSION}|{model_fingerprint}|{start}|".encode())
    digest.update(",".join(map(str, ids)).encode())
    return digest.hexdigest()


class ReadingStore:
    """Thread-safe access to a readings file (one SQLite connection per thread, WAL, bounded lock waits)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._local = threading.local()
        make_dir(self.path.parent, "readings directory")
        with self._errors("open"):
            self._connect().executescript(SCHEMA)

    def _errors(self, action: str) -> _Errors:
        return _Errors(self.path, action)

    def _connect(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            if self.path.is_dir():
                raise ReadingStoreError(f"readings store {self.path}: is a directory, not a file; move it away or "
                                        "set $ALPACAFARM_CACHE_DIR")
            wait = lock_timeout_s()
            db = sqlite3.connect(self.path, timeout=wait, isolation_level=None)
            try:
                db.execute(f"PRAGMA busy_timeout={int(wait * 1000)}")
                enter_wal(db, wait)  # two processes opening a new store together (ranks of one stage)
                db.execute("PRAGMA synchronous=NORMAL")
            except BaseException:
                db.close()
                raise
            self._local.db = db
        return db

    def get(self, keys: Iterable[str]) -> dict[str, Reading]:
        """The stored rows among ``keys`` (a key never written is absent)."""
        import torch

        keys = list(dict.fromkeys(keys))
        found: dict[str, Reading] = {}
        with self._errors("read"):
            db = self._connect()
            for begin in range(0, len(keys), 500):
                chunk = keys[begin:begin + 500]
                marks = ",".join("?" * len(chunk))
                for key, features, log_probs in db.execute(
                        f"SELECT key, features, log_probs FROM readings WHERE key IN ({marks})", chunk):
                    found[key] = Reading(
                        None if features is None else torch.frombuffer(bytearray(features), dtype=torch.float32),
                        None if log_probs is None else torch.frombuffer(bytearray(log_probs),
                                                                        dtype=torch.float32).tolist())
        return found

    def put(self, rows: dict[str, Reading]) -> None:
        """Store each row's fields that are not stored yet (a field already written is kept: first write wins), in
        one transaction."""
        import torch

        def blob(value: Any) -> bytes | None:
            if value is None:
                return None
            return torch.as_tensor(value, dtype=torch.float32).reshape(-1).contiguous().numpy().tobytes()

        values = [(key, blob(r.features), blob(r.log_probs)) for key, r in rows.items()]
        if not values:
            return
        with self._errors("write"):
            db = self._connect()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany("INSERT OR IGNORE INTO readings (key) VALUES (?)", [(k,) for k, _, _ in values])
                db.executemany("UPDATE readings SET features = coalesce(features, ?), "
                               "log_probs = coalesce(log_probs, ?) WHERE key = ?",
                               [(f, p, k) for k, f, p in values])
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise


class _Errors:
    """SQLite's refusals as one line naming the file."""

    def __init__(self, path: Path, action: str) -> None:
        self.path, self.action = path, action

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, _tb: Any) -> bool:
        if isinstance(exc, sqlite3.Error):
            raise ReadingStoreError(f"readings store {self.path}: could not {self.action} it ({exc}); check the "
                                    "file or set $ALPACAFARM_CACHE_DIR") from exc
        return False


_stores: dict[Path, ReadingStore] = {}


def default_store() -> ReadingStore:
    """The machine's store, ``cache_dir()/readings.sqlite`` (one object per path and process)."""
    path = cache_dir() / "readings.sqlite"
    if path not in _stores:
        _stores[path] = ReadingStore(path)
    return _stores[path]
