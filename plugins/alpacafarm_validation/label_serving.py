"""Which pair a labeller gets next, and the counts the page shows: indexed queries, never a scan of every pair.

A labeller walks the pairs in sampling order starting at a position drawn from the session's seed and their
name, wrapping round at the end. The first pair they may have is found through the partial index ``pairs_wanted``
(overlap pairs, and other pairs with fewer labels than wanted), checking for each candidate, by primary key and
index, that they have not labelled or skipped it and that nobody else holds a live lease on it. Counts come from
the session's ``counters`` (kept in step with every label and undo) and the labeller's own rows, so a request
costs about the same at 100 or 100,000 pairs.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from alpacafarm.seeding import stable_hash


def _wanted(settings: Any) -> str:
    # the partial index's own WHERE clause, word for word, so SQLite uses the index
    return f"(p.overlap = 1 OR p.n_labels < {int(settings.labels_per_pair)})"


def first_wanted(db: sqlite3.Connection, labeller: str, settings: Any, now: float) -> str | None:
    """The first pair ``labeller`` may be given, from their start position on (then from the beginning): one they
    have not labelled or skipped, an overlap pair or one still short of labels that nobody else holds."""
    n = db.execute("SELECT value FROM counters WHERE name = 'pairs'").fetchone()[0]
    if not n:
        return None
    start = stable_hash(settings.seed, "start", labeller) % n
    query = (f"SELECT p.id FROM pairs p INDEXED BY pairs_wanted WHERE {_wanted(settings).replace('p.', '')} "
             "AND p.position >= :lo AND p.position < :hi "
             "AND NOT EXISTS (SELECT 1 FROM labels l WHERE l.labeller = :who AND l.pair_id = p.id) "
             "AND (p.overlap = 1 OR NOT EXISTS (SELECT 1 FROM assignments a WHERE a.pair_id = p.id "
             "AND a.labeller != :who AND a.served > :lease_start)) ORDER BY p.position LIMIT 1")
    for lo, hi in ((start, n), (0, start)):
        row = db.execute(query, {"who": labeller, "lo": lo, "hi": hi,
                                 "lease_start": now - settings.lease_s}).fetchone()
        if row is not None:
            return str(row[0])
    return None


COUNTERS = ("pairs", "overlap_pairs", "open_other", "session_done")


def recount(db: sqlite3.Connection, settings: Any) -> None:
    """Compute the session's counters from the pairs (once, when a server opens the store)."""
    k = int(settings.labels_per_pair)
    db.execute("CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
    values = db.execute(
        "SELECT COUNT(*), COALESCE(SUM(overlap = 1), 0), COALESCE(SUM(overlap = 0 AND n_labels < ?), 0), "
        "COALESCE(SUM((overlap = 0 AND n_labels >= ?) OR (overlap = 1 AND n_labels >= 2)), 0) FROM pairs",
        (k, k)).fetchone()
    db.executemany("INSERT OR REPLACE INTO counters VALUES (?, ?)", zip(COUNTERS, values, strict=True))


def count_label(db: sqlite3.Connection, pair_id: str, change: int, settings: Any) -> None:
    """Add ``change`` (+1 or -1) to the pair's label count, keeping the session's counters in step."""
    k = int(settings.labels_per_pair)
    overlap, before = db.execute("SELECT overlap, n_labels FROM pairs WHERE id = ?", (pair_id,)).fetchone()
    after = before + change
    db.execute("UPDATE pairs SET n_labels = ? WHERE id = ?", (after, pair_id))
    wanted = 2 if overlap else k
    done_change = int(after >= wanted) - int(before >= wanted)
    open_change = 0 if overlap else int(after < k) - int(before < k)
    for name, delta in (("session_done", done_change), ("open_other", open_change)):
        if delta:
            db.execute("UPDATE counters SET value = value + ? WHERE name = ?", (delta, name))


# CROSS JOIN below keeps the labeller's own rows as the outer loop (SQLite never reorders it): a few rows, not
# every pair of a state.
def progress(db: sqlite3.Connection, labeller: str, settings: Any, now: float) -> dict[str, int]:
    """What the page shows: ``labelled`` and ``skipped`` (this person's, apart), ``left`` (pairs they may still
    get, their current one included; it shrinks as others label, their own counts never do), and the session's
    ``session_done`` (pairs with the labels wanted: ``labels_per_pair``, or 2 on an overlap pair) of
    ``session_pairs``."""
    k = int(settings.labels_per_pair)
    mine = dict(db.execute("SELECT choice = 'skip', COUNT(*) FROM labels WHERE labeller = ? GROUP BY 1",
                           (labeller,)).fetchall())
    counters = dict(db.execute("SELECT name, value FROM counters").fetchall())
    overlap_total = counters["overlap_pairs"]
    overlap_mine = db.execute("SELECT COUNT(*) FROM labels l CROSS JOIN pairs p ON p.id = l.pair_id "
                              "WHERE l.labeller = ? AND p.overlap = 1", (labeller,)).fetchone()[0]
    open_other = counters["open_other"]
    open_mine = db.execute("SELECT COUNT(*) FROM labels l CROSS JOIN pairs p ON p.id = l.pair_id "
                           "WHERE l.labeller = ? AND p.overlap = 0 AND p.n_labels < ?", (labeller, k)).fetchone()[0]
    held = db.execute(
        "SELECT COUNT(DISTINCT a.pair_id) FROM assignments a CROSS JOIN pairs p ON p.id = a.pair_id "
        "WHERE a.labeller != ? AND a.served > ? AND p.overlap = 0 AND p.n_labels < ? "
        "AND NOT EXISTS (SELECT 1 FROM labels l WHERE l.labeller = ? AND l.pair_id = p.id) "
        "AND NOT EXISTS (SELECT 1 FROM assignments b WHERE b.labeller = ? AND b.pair_id = p.id)",
        (labeller, now - settings.lease_s, k, labeller, labeller)).fetchone()[0]
    own_full = db.execute("SELECT COUNT(*) FROM assignments a CROSS JOIN pairs p ON p.id = a.pair_id "
                          "WHERE a.labeller = ? AND p.overlap = 0 AND p.n_labels >= ?", (labeller, k)).fetchone()[0]
    complete, n = counters["session_done"], counters["pairs"]
    return {"labelled": mine.get(0, 0), "skipped": mine.get(1, 0),
            "left": overlap_total - overlap_mine + open_other - open_mine - held + own_full,
            "session_done": complete, "session_pairs": n}


def shown(db: sqlite3.Connection, row: Any, done: dict[str, int]) -> dict[str, Any]:
    """The served pair as the page gets it: answers in the order of the labeller's sides, no system names."""
    pair = db.execute("SELECT * FROM pairs WHERE id = ?", (row["pair_id"],)).fetchone()
    first, second = (pair["output_2"], pair["output_1"]) if row["swapped"] else (pair["output_1"], pair["output_2"])
    return {"done": False, "pair_id": pair["id"], "ticket": row["ticket"], "instruction": pair["instruction"],
            "input": pair["input"], "first": first, "second": second, "progress": done}
