"""Text features of the offline judge: what an output looks like as text, without looking at who wrote it.

Deterministic and cheap on a CPU:

* fluency from a word n-gram model of recorded answers (:class:`NGramTables`): the share of words and of adjacent
  word pairs that real answers use. Word salad, random words and invented words score low. It is a fixed table
  fitted on many systems' answers, not a language model's likelihood, so a policy cannot raise it by sampling
  what it itself finds likely; the same tables say which word stems are common (the key-word coverage);
* text statistics (:func:`text_stats`): length, structure, repetition, refusals, a clean ending, word order, and
  how much of the output is copied from the instruction.
"""

from __future__ import annotations

import base64
import itertools
import math
import re
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["STAT_NAMES", "STOPWORDS", "NGramTables", "text_stats", "word_order", "words"]

_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?|\d+")
_REFUSAL = re.compile(
    r"(as an ai( language model)?|i'?m sorry,? but|i am sorry,? but"
    r"|i cannot (provide|answer|fulfill|help)|i can'?t (provide|answer|help)"
    r"|i'?m not able to|i am not able to"
    r"|i do not have (access|the ability)|i don'?t have (access|the ability))",
    re.IGNORECASE,
)
_LIST_ITEM = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+", re.MULTILINE)
# A finished answer ends with one of these (sentence end, closing bracket/quote, code fence, emphasis, a number).
_CLEAN_END = re.compile(r"""[.!?:;)\]}"'`*>|0-9]\s*$""")
# Word order without a table: a sentence end is followed by a capital (or a number, a symbol), and a sentence or
# clause does not end on a function word. Shuffled words break both; real prose and code rarely do.
_SENTENCE_STOP = re.compile(r"""[a-z)\]][.!?]["')\]]*$""")
_CLAUSE_STOP = re.compile(r"""^["'(\[]*([A-Za-z]+)[,.;:!?]["')\]]*$""")
_FUNCTION_WORDS = frozenset(
    ["the", "a", "an", "of", "to", "and", "or", "in", "on", "for", "with", "by", "at", "from", "as", "is", "are",
     "was", "were", "be", "that", "this", "its", "their", "your", "our", "my", "his", "her", "which", "than", "into"]
)


#: words too common to say what an instruction is about (the nearest-instruction search and the key-word
#: coverage ignore them)
STOPWORDS = frozenset(
    ["a", "an", "the", "and", "or", "of", "to", "in", "on", "for", "with", "by", "at", "from", "as", "is", "are",
     "was", "were", "be", "it", "its", "this", "that", "what", "which", "who", "how", "why", "when", "where", "do",
     "does", "did", "can", "could", "should", "would", "will", "i", "you", "me", "my", "your", "we", "our", "they",
     "them", "their", "please", "give", "write", "list", "make", "provide", "describe", "explain", "tell", "some",
     "any", "all"]
)
#: words match by their first letters (a crude stem: "recipes" and "recipe", "scattering" and "scatter")
STEM_LETTERS = 5
#: a stem found in at least this share of answers is common; an instruction's rarer words say what it is about
COMMON_SHARE = 0.02
#: weight of a common content word in the key-word coverage (a rare one weighs 1)
COMMON_WEIGHT = 0.2

def words(text: str) -> list[str]:
    """Lower-cased word tokens (letters, apostrophes inside words); every number becomes ``0``."""
    return ["0" if w[0].isdigit() else w for w in _WORD.findall(text.lower())]


def _hash(token: str, bits: int) -> int:
    return zlib.crc32(token.encode("utf-8")) & ((1 << bits) - 1)


def _bigrams(tokens: Sequence[str]) -> list[str]:
    return [f"{a} {b}" for a, b in itertools.pairwise(tokens)]


def stems(text: str) -> set[str]:
    return {w[:STEM_LETTERS] for w in words(text)}


class NGramTables:
    """Which words and adjacent word pairs occur (at least ``min_count`` times) in a corpus of real answers, and
    which word stems are common (in at least :data:`COMMON_SHARE` of the answers).

    The n-grams are stored as two hashed bit sets (CRC32 of the token), so the tables are small and lookups are
    exact functions of the text; the common stems as a sorted list. ``fit`` counts a corpus;
    ``to_dict``/``from_dict`` (de)serialise them byte-for-byte.
    """

    def __init__(self, unigram_bits: int, bigram_bits: int, unigrams: np.ndarray, bigrams: np.ndarray,
                 common: Iterable[str] = ()) -> None:
        self.unigram_bits, self.bigram_bits = unigram_bits, bigram_bits
        self.unigrams, self.bigrams = unigrams, bigrams  # bool arrays of length 2**bits
        self.common = frozenset(common)

    @classmethod
    def fit(cls, corpus: Iterable[str], unigram_bits: int = 20, bigram_bits: int = 22,
            min_count: int = 2) -> NGramTables:
        uni: Counter[str] = Counter()
        bi: Counter[str] = Counter()
        documents: Counter[str] = Counter()
        n_texts = 0
        for text in corpus:
            tokens = words(text)
            uni.update(tokens)
            bi.update(_bigrams(tokens))
            documents.update({t[:STEM_LETTERS] for t in tokens})
            n_texts += 1
        unigrams = np.zeros(1 << unigram_bits, dtype=bool)
        bigrams = np.zeros(1 << bigram_bits, dtype=bool)
        for token, count in uni.items():
            if count >= min_count:
                unigrams[_hash(token, unigram_bits)] = True
        for token, count in bi.items():
            if count >= min_count:
                bigrams[_hash(token, bigram_bits)] = True
        common = sorted(stem for stem, count in documents.items() if count >= COMMON_SHARE * n_texts)
        return cls(unigram_bits, bigram_bits, unigrams, bigrams, common)

    def known(self, text: str) -> tuple[float, float]:
        """(share of words that are known, share of adjacent word pairs that are known); 0 for no words/pairs."""
        tokens = words(text)
        if not tokens:
            return 0.0, 0.0
        uni = sum(bool(self.unigrams[_hash(t, self.unigram_bits)]) for t in tokens) / len(tokens)
        pairs = _bigrams(tokens)
        bi = sum(bool(self.bigrams[_hash(p, self.bigram_bits)]) for p in pairs) / len(pairs) if pairs else 0.0
        return uni, bi

    def key_coverage(self, instruction: str, output: str) -> float:
        """Share of the instruction's content words (3+ letters, not stop words; by stem) that the output uses,
        a rare word weighing 1 and a common one :data:`COMMON_WEIGHT`: an answer to a near-identical question
        ("a recipe for X" answered with a recipe for Y) misses the words that set this one apart. 1 when the
        instruction has no content words."""
        keys = {w[:STEM_LETTERS] for w in words(instruction) if len(w) >= 3 and w not in STOPWORDS}
        if not keys:
            return 1.0
        used = stems(output)
        weight = {k: COMMON_WEIGHT if k in self.common else 1.0 for k in keys}
        return sum(weight[k] for k in keys if k in used) / sum(weight.values())

    def to_dict(self) -> dict[str, Any]:
        def pack(bits: np.ndarray) -> str:
            return base64.b64encode(zlib.compress(np.packbits(bits).tobytes(), 9)).decode("ascii")

        return {"unigram_bits": self.unigram_bits, "bigram_bits": self.bigram_bits,
                "unigrams": pack(self.unigrams), "bigrams": pack(self.bigrams), "common": sorted(self.common)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NGramTables:
        def unpack(text: str, bits: int) -> np.ndarray:
            raw = np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype=np.uint8)
            return np.unpackbits(raw)[: 1 << bits].astype(bool)

        return cls(data["unigram_bits"], data["bigram_bits"], unpack(data["unigrams"], data["unigram_bits"]),
                   unpack(data["bigrams"], data["bigram_bits"]), data["common"])


STAT_NAMES = (
    "loglen", "logwords", "nlist", "nlines", "code", "bold", "refusal", "empty",
    "rep4", "dupl_lines", "compress", "clean_end", "copied_words", "copied_bigrams",
    "known_words", "known_bigrams", "short_word_salad", "bigrams_below_0.5", "words_below_0.9",
    "sentence_case", "dangling_function_words",
)


def word_order(output: str) -> tuple[float, float]:
    """(share of sentence ends followed by a capital, a digit or a symbol; share of clause-final words that are
    function words such as "the," or "of."). (1, 0) when the text has no sentence or clause ends."""
    tokens = output.split()
    ends = [nxt for tok, nxt in itertools.pairwise(tokens) if _SENTENCE_STOP.search(tok)]
    cased = sum(not nxt[0].islower() for nxt in ends) / len(ends) if ends else 1.0
    stops = [m.group(1).lower() for m in map(_CLAUSE_STOP.match, tokens) if m]
    dangling = sum(w in _FUNCTION_WORDS for w in stops) / len(stops) if stops else 0.0
    return cased, dangling


def text_stats(instruction: str, output: str, tables: NGramTables) -> list[float]:
    """The embedding-free features of one output for one instruction, in :data:`STAT_NAMES` order."""
    out_words = words(output)
    lines = [line.strip() for line in output.split("\n") if line.strip()]
    grams = [tuple(out_words[i:i + 4]) for i in range(max(0, len(out_words) - 3))]
    raw = output.encode("utf-8")
    ins_words = set(words(instruction))
    ins_bigrams = set(_bigrams(words(instruction)))
    out_bigrams = _bigrams(out_words)
    known_words, known_bigrams = tables.known(output)
    return [
        math.log1p(len(output.strip())),
        math.log1p(len(out_words)),
        math.log1p(len(_LIST_ITEM.findall(output))),
        math.log1p(len(lines)),
        1.0 if "```" in output else 0.0,
        1.0 if "**" in output else 0.0,
        1.0 if _REFUSAL.search(output[:300]) else 0.0,  # a refusal at the start: the task was not done
        1.0 if not out_words else 0.0,
        1.0 - len(set(grams)) / len(grams) if grams else 0.0,  # repeated word 4-grams
        1.0 - len(set(lines)) / len(lines) if lines else 0.0,  # duplicated lines
        # compressed/raw size: loops compress far better than prose (short texts are left at 1)
        len(zlib.compress(raw, 9)) / len(raw) if len(raw) >= 200 else 1.0,
        1.0 if _CLEAN_END.search(output) else 0.0,
        sum(w in ins_words for w in out_words) / len(out_words) if out_words else 0.0,
        sum(b in ins_bigrams for b in out_bigrams) / len(out_bigrams) if out_bigrams else 0.0,
        known_words,
        known_bigrams,
        # the product is high only for real prose: known words in known orders
        known_words * known_bigrams,
        # hinges: prose far below real answers' usual shares of known word pairs / words
        max(0.0, 0.5 - known_bigrams) if out_words else 0.0,
        max(0.0, 0.9 - known_words) if out_words else 0.0,
        *word_order(output),
    ]
