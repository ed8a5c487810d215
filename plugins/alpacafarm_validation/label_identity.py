"""Who is labelling: invite links (one token per person, made by ``alpacafarm label invite``) or, on a session
without invites, a typed name.

A person is one row of the store's ``labellers`` table, keyed by their name case-folded with runs of spaces made
one (so "Bob", "bob" and " bob " are one person). An invite's token is stored as its SHA-256 only; the link
carries the token itself. Once a session holds an invite (even a revoked one), every API call needs an invite
token and the person is the token's: a typed name is never an identity again, so nobody labels as someone else.
A revoked invite's labels are kept; its link gets 401. The session's shared access token (``--random-token``) is
kept in the store too, so a restart serves the same link.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import sqlite3
import time

from alpacafarm.errors import UserError

#: A labeller's name: letters, digits, spaces and . _ @ - (it is stored and shown, never used as a path).
NAME = re.compile(r"^[\w .@-]{1,40}$")


class LabelRejected(Exception):
    """A request the store refuses; ``status`` is the HTTP status the page gets (4xx), nothing was changed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def clean_name(value: object) -> str:
    """``value`` as a labeller's name (trimmed), or a 400 naming the rule."""
    if not isinstance(value, str) or not NAME.fullmatch(value.strip()):
        raise LabelRejected(400, "labeller must be a name of 1-40 letters, digits, spaces or . _ @ -")
    return " ".join(value.split())


def name_key(name: str) -> str:
    """The identity of a name: case-folded, spaces collapsed ("Bob" and "bob " are one person)."""
    return " ".join(name.split()).casefold()


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def invite_mode(db: sqlite3.Connection) -> bool:
    """Whether the session uses invite links (it has held at least one invite, revoked or not)."""
    return db.execute("SELECT 1 FROM labellers WHERE token_hash IS NOT NULL LIMIT 1").fetchone() is not None


def identify(db: sqlite3.Connection, token: str | None, typed: object) -> str:
    """The labeller a request acts for. In invite mode: the person whose invite ``token`` is (401 for none, an
    unknown or a revoked one; 403 when ``typed`` names someone else). Otherwise: the person ``typed`` names,
    recorded on first use under that spelling."""
    if invite_mode(db):
        row = None if not token else db.execute("SELECT name, revoked FROM labellers WHERE token_hash = ?",
                                                (token_hash(token),)).fetchone()
        if row is None:
            raise LabelRejected(401, "this session labels by invite link: open the link you were sent "
                                     "(alpacafarm label invite NAME makes one)")
        if row["revoked"] is not None:
            raise LabelRejected(401, "this invite link was revoked: ask for a new one")
        if typed not in (None, "") and name_key(str(typed)) != name_key(row["name"]):
            raise LabelRejected(403, f"this link is {row['name']}'s: labels are stored under the link's name")
        return str(row["name"])
    name = clean_name(typed)
    row = db.execute("SELECT name FROM labellers WHERE key = ?", (name_key(name),)).fetchone()
    if row is not None:
        return str(row["name"])
    db.execute("INSERT INTO labellers (key, name, token_hash, created, revoked) VALUES (?, ?, NULL, ?, NULL)",
               (name_key(name), name, time.time()))
    return name


def invite(db: sqlite3.Connection, name: str) -> str:
    """A new invite token for ``name`` (a person who labelled by typed name keeps their labels). Refused, as a
    :class:`UserError`, when that person already has a live invite."""
    try:
        name = clean_name(name)
    except LabelRejected as exc:
        raise UserError(f"invite {name!r}: {exc}") from None
    token = secrets.token_urlsafe(18)
    row = db.execute("SELECT name, token_hash, revoked FROM labellers WHERE key = ?", (name_key(name),)).fetchone()
    if row is not None and row["token_hash"] is not None and row["revoked"] is None:
        raise UserError(f"{row['name']} already has an invite link; `alpacafarm label revoke {row['name']!r}` "
                        "first to make a new one")
    if row is None:
        db.execute("INSERT INTO labellers (key, name, token_hash, created, revoked) VALUES (?, ?, ?, ?, NULL)",
                   (name_key(name), name, token_hash(token), time.time()))
    else:
        db.execute("UPDATE labellers SET token_hash = ?, revoked = NULL WHERE key = ?",
                   (token_hash(token), name_key(name)))
    return token


def revoke(db: sqlite3.Connection, name: str) -> str:
    """Revoke ``name``'s invite (their labels stay); the stored name. A :class:`UserError` when they have none."""
    row = db.execute("SELECT name, token_hash, revoked FROM labellers WHERE key = ?", (name_key(name),)).fetchone()
    if row is None or row["token_hash"] is None or row["revoked"] is not None:
        raise UserError(f"{name!r} has no live invite link in this session")
    db.execute("UPDATE labellers SET revoked = ? WHERE key = ?", (time.time(), name_key(name)))
    db.execute("UPDATE assignments SET served = 0 WHERE labeller = ?", (row["name"],))  # free their pair
    return str(row["name"])


def valid_page_token(db: sqlite3.Connection, token: str) -> bool:
    """Whether ``token`` is a live invite (it opens the page)."""
    return db.execute("SELECT 1 FROM labellers WHERE token_hash = ? AND revoked IS NULL",
                      (token_hash(token),)).fetchone() is not None
