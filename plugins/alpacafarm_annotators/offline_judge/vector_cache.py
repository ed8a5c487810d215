"""Vectors kept on disk between runs (the judge's MiniLM embeddings and language-model readings, with ``cache_dir``):
``<prefix>_NNNNN.npz`` chunks of (key, vector) rows, added to and never rewritten."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["VectorCache", "load_chunks", "save_chunk"]


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


class VectorCache:
    """Vectors by key, in memory and, with a folder, on disk as ``<prefix>_NNNNN.npz`` chunks (read once, on first
    use). Without a folder the memory is bounded: it is emptied when ``size`` vectors would be exceeded."""

    def __init__(self, folder: Path | None, prefix: str, size: int) -> None:
        self.folder, self.prefix, self.size = folder, prefix, size
        self.vectors: dict[str, np.ndarray] = {}
        self._disk_read = False

    def missing(self, keys: list[str]) -> set[str]:
        """The keys without a vector (after reading the disk chunks once)."""
        if not self._disk_read and self.folder is not None:
            self._disk_read = True
            self.vectors.update(load_chunks(self.folder, self.prefix))
        return {k for k in keys if k not in self.vectors}

    def make_room(self, count: int) -> None:
        """Empty the memory if ``count`` new vectors would take it past ``size`` (only without a folder)."""
        if self.folder is None and len(self.vectors) + count > self.size:
            self.vectors.clear()

    def add(self, keys: list[str], vecs: list[np.ndarray]) -> None:
        """Keep these vectors, and add them to the disk as one chunk."""
        self.vectors.update(zip(keys, vecs, strict=True))
        save_chunk(self.folder, self.prefix, keys, vecs)

    def stack(self, keys: list[str]) -> np.ndarray:
        return np.stack([self.vectors[k] for k in keys])
