"""The offline judge's feature vector of one (instruction, output[, reference]): what its linear head reads.

Columns (:data:`FEATURE_NAMES`, then ``cos_ref`` for the reference head):

* text statistics (:func:`.text_features.text_stats`), with length and layout (:data:`GATED_STATS`) multiplied by
  a gate in [0, 1] that is open only for an output that is on topic and fluent;
* relevance from MiniLM: the cosine to the instruction and hinges below :data:`RELEVANCE_LEVELS`;
* the language model's view (:mod:`.language_model`), through hinges that only penalise: how far the output's mean token
  log-probability falls below :data:`LOGPROB_LEVELS`, the share of nearly impossible tokens, and how far the
  instruction's help in predicting the output (PMI) falls below :data:`PMI_LEVELS`. Nothing rewards text for being
  *more* probable than real answers, so a policy that shares the LM's weights gains nothing from its own taste;
* how far the share of the instruction's key words that the output uses falls below :data:`COVERAGE_LEVELS`
  (:meth:`NGramTables.key_coverage`): the answer to a near-identical question misses the words that set this one
  apart;
* the MiniLM embedding of the output and its elementwise product with the instruction's, both times the gate.

The gate is the product of four ramps from 0 to 1: the cosine to the instruction (:data:`RELEVANCE_RAMP`), the
share of known word pairs (:data:`FLUENCY_RAMP`), the LM's mean log-probability (:data:`LM_FLUENCY_RAMP`) and its
PMI (:data:`LM_RELEVANCE_RAMP`). Without it a long, list-formatted answer to another question, or a long stream of
loosely connected words, outscores a short right answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from alpacafarm_annotators.offline_judge.embeddings import EMBED_DIM, MiniLMEmbedder
from alpacafarm_annotators.offline_judge.language_model import LMScorer
from alpacafarm_annotators.offline_judge.text_features import STAT_NAMES, NGramTables, text_stats

__all__ = ["FEATURE_NAMES", "FIRST_EMBEDDING", "GATED_STATS", "Featurizer", "feature_settings"]

#: hinge features of relevance: how far below each level the output's similarity to the instruction falls
RELEVANCE_LEVELS = (0.2, 0.35, 0.5)
#: hinges of the LM's mean token log-probability (real answers: 5th percentile about -2.4, median -1.7)
LOGPROB_LEVELS = (-2.5, -3.5, -5.0)
#: hinges of the LM's PMI (real answers: 5th percentile about 0.4; answers to other questions below 0)
PMI_LEVELS = (0.0, 0.25, 0.5)
#: hinges of the key-word coverage (:meth:`NGramTables.key_coverage`; strong answers: median about 0.7)
COVERAGE_LEVELS = (0.3, 0.6)
GATED_STATS = ("loglen", "logwords", "nlist", "nlines", "code", "bold")
RELEVANCE_RAMP = (0.2, 0.55)
FLUENCY_RAMP = (0.25, 0.55)
LM_FLUENCY_RAMP = (-3.5, -2.5)
LM_RELEVANCE_RAMP = (0.0, 0.3)
FEATURE_NAMES = (*(f"{name}*gate" if name in GATED_STATS else name for name in STAT_NAMES), "cos_ins",
                 "cos_above_0.8", *(f"cos_below_{level}" for level in RELEVANCE_LEVELS),
                 *(f"lm_logprob_below_{level}" for level in LOGPROB_LEVELS), "lm_surprise",
                 *(f"lm_pmi_below_{level}" for level in PMI_LEVELS),
                 *(f"coverage_below_{level}" for level in COVERAGE_LEVELS),
                 *(f"out_{i}*gate" for i in range(EMBED_DIM)), *(f"prod_{i}*gate" for i in range(EMBED_DIM)))
FIRST_EMBEDDING = len(FEATURE_NAMES) - 2 * EMBED_DIM
_GATED_COLUMNS = [STAT_NAMES.index(name) for name in GATED_STATS]
_KNOWN_BIGRAMS = STAT_NAMES.index("known_bigrams")


def feature_settings() -> dict[str, object]:
    """The definitions of the gate and the hinges, as recorded in a weights document."""
    return {"stats": list(GATED_STATS), "relevance_ramp": list(RELEVANCE_RAMP), "fluency_ramp": list(FLUENCY_RAMP),
            "lm_fluency_ramp": list(LM_FLUENCY_RAMP), "lm_relevance_ramp": list(LM_RELEVANCE_RAMP),
            "relevance_levels": list(RELEVANCE_LEVELS),
            "logprob_levels": list(LOGPROB_LEVELS), "pmi_levels": list(PMI_LEVELS),
            "coverage_levels": list(COVERAGE_LEVELS)}


def _ramp(value: float, bounds: tuple[float, float]) -> float:
    return min(1.0, max(0.0, (value - bounds[0]) / (bounds[1] - bounds[0])))


class Featurizer:
    """Feature vectors (:data:`FEATURE_NAMES`, then ``cos_ref`` when a reference is given) of many outputs."""

    def __init__(self, tables: NGramTables, embedder: MiniLMEmbedder, lm: LMScorer) -> None:
        self.tables, self.embedder, self.lm = tables, embedder, lm

    def __call__(self, items: Sequence[tuple[str, str, str | None]]) -> np.ndarray:
        texts = sorted({t for ins, out, ref in items for t in (ins, out, ref) if t is not None})
        vectors = dict(zip(texts, self.embedder.embed(texts), strict=True))
        lm_values = self.lm.features([(ins, out) for ins, out, _ in items])
        rows = np.zeros((len(items), len(FEATURE_NAMES) + 1), dtype=np.float64)
        for r, (ins, out, ref) in enumerate(items):
            e_ins, e_out = vectors[ins].astype(np.float64), vectors[out].astype(np.float64)
            cos = float(e_ins @ e_out)
            logprob, surprise, pmi = (float(v) for v in lm_values[r])
            stats = text_stats(ins, out, self.tables)
            coverage = self.tables.key_coverage(ins, out)
            gate = (_ramp(cos, RELEVANCE_RAMP) * _ramp(stats[_KNOWN_BIGRAMS], FLUENCY_RAMP)
                    * _ramp(logprob, LM_FLUENCY_RAMP) * _ramp(pmi, LM_RELEVANCE_RAMP))
            for column in _GATED_COLUMNS:
                stats[column] *= gate
            row = [*stats, cos, max(0.0, cos - 0.8),  # so close to the instruction: restating it?
                   *(max(0.0, level - cos) for level in RELEVANCE_LEVELS),
                   *(max(0.0, level - logprob) for level in LOGPROB_LEVELS), surprise,
                   *(max(0.0, level - pmi) for level in PMI_LEVELS),
                   *(max(0.0, level - coverage) for level in COVERAGE_LEVELS)]
            rows[r, :len(row)] = row
            rows[r, len(row):len(row) + EMBED_DIM] = gate * e_out
            rows[r, len(row) + EMBED_DIM:len(FEATURE_NAMES)] = gate * e_ins * e_out
            rows[r, -1] = float(vectors[ref].astype(np.float64) @ e_out) if ref is not None else 0.0
        return rows
