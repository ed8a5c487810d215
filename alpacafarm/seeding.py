"""Deterministic draws from text: the same value in every process and on every machine (unlike ``hash()``).

One hash serves every seeded choice in alpacafarm: stage seeds, sampling batches, pool assignment, label noise.
"""

from __future__ import annotations

import hashlib


def stable_hash(*parts: object) -> int:
    """A 64-bit integer from the parts' text (SHA-256 of the parts joined by the unit separator)."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def stable_seed(*parts: object) -> int:
    """A 31-bit seed (what ``torch.manual_seed`` and ``random.Random`` accept everywhere) from the same hash."""
    return (stable_hash(*parts) >> 32) & 0x7FFFFFFF


def stable_uniform(*parts: object) -> float:
    """A number in [0, 1) drawn deterministically from the parts."""
    return stable_hash(*parts) / 2**64
