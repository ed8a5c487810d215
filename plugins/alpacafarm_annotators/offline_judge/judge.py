"""Offline pairwise judge: deterministic, order-independent, network-free, $0.

The default annotator of CPU runs and CI (the simulated human when no LLM judge is available). Each output gets a
scalar score for its instruction; the pair preference is the sign of the score difference, so ``judge(a, b)`` is
exactly the mirror of ``judge(b, a)`` and identical outputs (or equal scores) tie.

The score is a linear head over the features of :mod:`.features`: a small language model's reading of
the output (token log-probabilities given the instruction, and how much the instruction helps predict it; see
:mod:`.language_model`), MiniLM embeddings of instruction and output (their cosine and elementwise product), word and
word-pair fluency against tables of real answers, and text statistics (length, structure, repetition, refusals, a
clean ending, word order, text copied from the instruction); length, layout and the embeddings count only as far
as the output is on topic and fluent (a gate). It was fitted Bradley-Terry (``tools/fit_offline_judge.py``) on recorded
AlpacaEval GPT-4 judgments and on synthetic rivals that must always lose
(word salad, random or invented words, off-topic answers, repetition loops, truncations, restatements of the
instruction). :meth:`OfflineJudge.win_probability` gives the fitted probability that one output beats the other. The
weights ship in ``weights.json`` with their fingerprint (:mod:`.weights`); maintainers refit them with ``python
tools/fit_offline_judge.py --data ../shared/data --out FILE``, and ``weights_file`` loads another file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from alpacafarm_annotators.offline_judge.embeddings import MiniLMEmbedder
from alpacafarm_annotators.offline_judge.text_features import NGramTables
from alpacafarm_annotators.offline_judge.weights import WEIGHTS_FILE, load_weights

__all__ = ["OfflineJudge"]

# Scores are rounded so that float noise from batching can never flip a comparison between two calls; a
# difference below this is a tie anyway.
_SCORE_DECIMALS = 6


class OfflineJudge:
    """Pairwise judge usable without network, API keys or a GPU.

    Pass a strong reference answer per instruction when one exists (from a system other than the two being
    compared) and the reference head is used; otherwise pass ``None``.
    """

    def __init__(
        self,
        embedding_model_dir: str | None = None,
        batch_size: int = 32,
        max_length: int = 128,
        num_threads: int | None = None,
        cache_size: int = 50_000,
        weights_file: str | Path = WEIGHTS_FILE,
        cache_dir: str | Path | None = None,
        lm_batch_size: int = 16,
    ) -> None:
        """Configure the judge; the embedding model is loaded lazily on first use.

        ``max_length`` is the number of MiniLM tokens embedded from the start of each text (the fit used 128).
        ``cache_size`` bounds the number of embeddings kept in memory between calls (about 1.5 kB each);
        ``cache_dir`` keeps them (and the LM readings) on disk instead. ``lm_batch_size`` is the number of outputs
        the language model reads per forward pass (1: each read alone, its prompt included; see
        :class:`~.language_model.LMScorer`).
        """
        from alpacafarm_annotators.offline_judge.features import Featurizer
        from alpacafarm_annotators.offline_judge.language_model import LMScorer

        self.document = load_weights(weights_file)
        self.fingerprint: str = self.document["fingerprint"]
        import numpy as np

        self._weights = {name: np.array(values, dtype=np.float64)
                         for name, values in self.document["weights"].items()}
        self.embedder = MiniLMEmbedder(embedding_model_dir, max_length=max_length, num_threads=num_threads,
                                       cache_dir=cache_dir, cache_size=cache_size, batch_size=batch_size)
        self.lm = LMScorer(num_threads=num_threads, batch_size=lm_batch_size, cache_dir=cache_dir,
                           cache_size=cache_size)
        self._featurize = Featurizer(NGramTables.from_dict(self.document["ngrams"]), self.embedder, self.lm)

    def embed(self, texts: Sequence[str]) -> Any:
        """Unit-norm MiniLM embeddings (a numpy array, one row per text)."""
        return self.embedder.embed(texts)

    # -- scoring --------------------------------------------------------------
    def score_batch(self, items: Sequence[tuple[str, str, str | None]]) -> list[float]:
        """Score many (instruction, output, reference) triples; higher is better.

        Scores are only comparable between outputs judged with the same reference (or both without one).
        """
        if not items:
            return []
        rows = self._featurize([(ins, out or "", ref) for ins, out, ref in items])
        no_ref, with_ref = self._weights["no_reference"], self._weights["reference"]
        scores = []
        for row, (_, _, ref) in zip(rows, items, strict=True):
            value = float(row[: len(no_ref)] @ no_ref) if ref is None else float(row @ with_ref)
            scores.append(round(value, _SCORE_DECIMALS))
        return scores

    def score(self, instruction: str, output: str, reference: str | None = None) -> float:
        """Score one output for an instruction (see :meth:`score_batch`)."""
        return self.score_batch([(instruction, output, reference)])[0]

    def win_probability(self, pairs: Sequence[tuple[str, str, str, str | None]]) -> list[float]:
        """P(output_1 beats output_2) for (instruction, output_1, output_2, reference) tuples.

        The Bradley-Terry probability the head was fitted with: the logistic function of the score difference
        (output_1's minus output_2's). Mirrors exactly (swapping the outputs gives 1 - p) and is 0.5 wherever
        :meth:`judge` says tie; above 0.5 exactly where :meth:`judge` says 1.
        """
        import math

        probabilities = []
        for same, s1, s2 in self._pair_scores(pairs):
            diff = 0.0 if same else s1 - s2
            # the two-sided form keeps p(a, b) + p(b, a) == 1 exactly and never overflows
            probabilities.append(1.0 / (1.0 + math.exp(-diff)) if diff >= 0 else 1.0 - 1.0 / (1.0 + math.exp(diff)))
        return probabilities

    def judge(self, pairs: Sequence[tuple[str, str, str, str | None]]) -> list[int]:
        """Judge (instruction, output_1, output_2, reference) tuples.

        Returns 1 when output_1 is better, 2 when output_2 is better and 0 for a tie (identical outputs or
        exactly equal scores). Never use either compared system's own output as the reference.
        """
        return [0 if same or s1 == s2 else 1 if s1 > s2 else 2 for same, s1, s2 in self._pair_scores(pairs)]

    def _pair_scores(self, pairs: Sequence[tuple[str, str, str, str | None]]) -> list[tuple[bool, float, float]]:
        """(outputs identical, score of output_1, score of output_2) per pair, scored in one batch."""
        items: list[tuple[str, str, str | None]] = []
        for instruction, out_1, out_2, reference in pairs:
            items += [(instruction, out_1 or "", reference), (instruction, out_2 or "", reference)]
        scores = self.score_batch(items)
        return [((out_1 or "") == (out_2 or ""), s1, s2)
                for (_, out_1, out_2, _), s1, s2 in zip(pairs, scores[0::2], scores[1::2], strict=True)]
