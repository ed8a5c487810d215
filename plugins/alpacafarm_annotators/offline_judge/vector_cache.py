"""Vectors kept on disk between runs (the judge's MiniLM embeddings and language-model readings, with ``cache_dir``):
``<prefix>_NNNNN.npz`` chunks of (key, vector) rows, added to and never rewritten."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["load_chunks", "save_chunk"]


def load_chunks(cache_dir: Path, prefix: str) -> dict[str, np.ndarray]:
    """Every vector saved under ``cache_dir`` as ``<prefix>_NNNNN.npz`` chunks, by key."""
    found: dict[str, np.ndarray] = {}
    for path in sorted(cache_dir.glob(f"{prefix}_*.npz")):
        with np.load(path) as data:
            for key, vec in zip(data["keys"], data["vecs"], strict=True):
                found[str(key)] = vec
    return found


def save_chunk(cache_dir: Path | None, prefix: str, keys: list[str], vecs: list[np.ndarray]) -> None:
    """Add one ``<prefix>_NNNNN.npz`` chunk of (key, vector) rows under ``cache_dir`` (nothing without a folder)."""
    if cache_dir is None or not keys:
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    index = len(list(cache_dir.glob(f"{prefix}_*.npz")))
    np.savez(cache_dir / f"{prefix}_{index:05d}.npz", keys=np.array(keys), vecs=np.stack(vecs))
