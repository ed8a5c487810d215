"""The language model's reads for the offline judge: log-probabilities of continuation tokens after prompts.

:func:`token_logprobs` reads many (prompt, continuation) token sequences. One at a time (``batch_size`` 1) each is
one forward pass over prompt and continuation: the definition. Batched, continuations that share a prompt are read
together: the prompt once, its key/value cache then shared by batches of continuations (right-padded, masked), and
only the positions that predict a continuation token go through the LM head (a 49k-word vocabulary). An
instruction's prompt is read once for all its outputs, the empty prompt of the judge's second read once per call,
and no prompt or padding position pays for the head: about 1.5 times less work than whole sequences batched.

The two agree to float precision, and the scores built on them within 1e-4 (``tests/test_offline_judge.py``).
That takes two measures, because the judge's head amplifies its LM features' noise about 15-fold (a short answer's
PMI is the difference of a few log-probabilities): attention is computed in float64 (:data:`FLOAT64_ATTENTION`),
so its sums round the same whatever the number of keys in the batch; and every matrix product gets at least
:data:`MIN_ROWS` rows (padding), because a product of fewer rows takes another kernel that rounds differently.
With one thread a position's values then do not depend on how it was batched at all; with more, splitting a product
among threads still changes a last bit now and then (about 1e-6 in a log-probability).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

__all__ = ["FLOAT64_ATTENTION", "MIN_ROWS", "token_logprobs", "use_float64_attention"]

#: the name the judge's attention is registered under in transformers
FLOAT64_ATTENTION = "alpacafarm_offline_judge_float64"
#: every matrix product the reads make has at least this many rows (fewer take another kernel)
MIN_ROWS = 32
#: positions whose vocabulary-wide logits are computed at once (bounds memory: 256 x 49k floats = 50 MB)
HEAD_ROWS = 256


def float64_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                      scaling: float | None = None, **kwargs: Any) -> tuple[Any, None]:
    """Scaled dot-product attention computed in float64 and rounded back (transformers' attention signature)."""
    import torch

    batch, heads, q_length, dim = query.shape
    kv_heads, kv_length = key.shape[1], key.shape[2]
    groups = heads // kv_heads  # grouped-query attention: each key/value head serves `groups` query heads
    queries = query.double().reshape(batch, kv_heads, groups * q_length, dim)
    scale = scaling if scaling is not None else dim ** -0.5
    scores = torch.matmul(queries, key.double().transpose(2, 3)) * scale
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :kv_length].repeat(1, 1, groups, 1)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    elif q_length > 1:  # causal: query i is position kv_length - q_length + i
        future = torch.ones(q_length, kv_length, dtype=torch.bool).triu(kv_length - q_length + 1)
        scores = scores.masked_fill(future.repeat(groups, 1), float("-inf"))
    output = torch.matmul(torch.softmax(scores, dim=-1), value.double()).to(query.dtype)
    return output.reshape(batch, heads, q_length, dim).transpose(1, 2).contiguous(), None


def use_float64_attention(model: Any) -> None:
    """Switch ``model`` (a transformers model) to :func:`float64_attention` (registered once, by name)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(FLOAT64_ATTENTION, float64_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(FLOAT64_ATTENTION, eager_mask)  # a 4-D mask always
    model.set_attn_implementation(FLOAT64_ATTENTION)


def token_logprobs(model: Any, pad_id: int, sequences: list[tuple[list[int], list[int]]],
                   batch_size: int) -> list[np.ndarray]:
    """Log-probabilities (float64 arrays) of each continuation's tokens after its prompt (see the module's text);
    an empty continuation gets an empty array. Batches are formed shortest first in a fixed order, so the same
    sequences always make the same batches."""
    import torch

    out: list[np.ndarray] = [np.zeros(0)] * len(sequences)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (prompt, continuation) in enumerate(sequences):
        if continuation:
            groups.setdefault(tuple(prompt), []).append(i)
    reader = _Reader(model, pad_id)
    with torch.inference_mode():
        if batch_size == 1:
            for i in sorted(i for members in groups.values() for i in members):
                prompt, continuation = sequences[i]
                out[i] = reader.read([prompt + continuation], skip=len(prompt))[0]
            return out
        for prompt in sorted(groups, key=lambda p: (len(p), p)):
            members = sorted(groups[prompt], key=lambda i: (len(sequences[i][1]), i))
            # The prompt's last token goes with each continuation (its position predicts the first continuation
            # token); the rest is read once and its key/value cache shared.
            prefix = list(prompt[:-1])
            cache = reader.cache(prefix) if prefix else None
            for start in range(0, len(members), batch_size):
                chunk = members[start:start + batch_size]
                shared = None
                if cache is not None:
                    shared = copy.deepcopy(cache)
                    shared.batch_repeat_interleave(len(chunk))
                values = reader.read([[prompt[-1], *sequences[i][1]] for i in chunk], skip=1, cache=shared,
                                     cached=len(prefix))
                for i, row in zip(chunk, values, strict=True):
                    out[i] = row
    return out


class _Reader:
    def __init__(self, model: Any, pad_id: int) -> None:
        import inspect

        self.decoder, self.head, self.pad_id = model.get_decoder(), model.get_output_embeddings(), pad_id
        # the decoder's cache argument was renamed in transformers 5.x
        self.cache_argument = "cache" if "cache" in inspect.signature(self.decoder.forward).parameters \
            else "past_key_values"

    def cache(self, prefix: list[int]) -> Any:
        """The key/value cache of reading ``prefix``."""
        import torch

        return self.decoder(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values

    def read(self, sequences: list[list[int]], skip: int, cache: Any = None, cached: int = 0) -> list[np.ndarray]:
        """Log-probabilities of the tokens of ``sequences`` after their first ``skip``, in one forward pass (right-
        padded), after ``cached`` tokens already in ``cache`` (a batch of as many rows) when one is given."""
        import torch

        width = max(MIN_ROWS, *(len(s) for s in sequences))
        ids = torch.tensor([s + [self.pad_id] * (width - len(s)) for s in sequences])
        mask = torch.tensor([[1] * (cached + len(s)) + [0] * (width - len(s)) for s in sequences])
        arguments = {self.cache_argument: cache, "use_cache": True} if cache is not None else {}
        hidden = self.decoder(input_ids=ids, attention_mask=mask, **arguments).last_hidden_state
        # the positions that predict a token of interest (each predicts the next token)
        rows = torch.tensor([r for r, s in enumerate(sequences) for _ in range(skip - 1, len(s) - 1)], dtype=torch.long)
        columns = torch.tensor([t for s in sequences for t in range(skip - 1, len(s) - 1)], dtype=torch.long)
        logprobs = np.zeros(len(rows))
        for begin in range(0, len(rows), HEAD_ROWS):
            r, c = rows[begin:begin + HEAD_ROWS], columns[begin:begin + HEAD_ROWS]
            states = hidden[r, c]
            if len(r) < MIN_ROWS:
                states = torch.cat([states, states.new_zeros(MIN_ROWS - len(r), states.shape[1])])
            logits = self.head(states)[:len(r)].float()
            chosen = logits.gather(-1, ids[r, c + 1][:, None])[:, 0]
            logprobs[begin:begin + len(r)] = (chosen - torch.logsumexp(logits, dim=-1)).numpy()
        values, k = [], 0
        for s in sequences:
            values.append(logprobs[k:k + len(s) - skip])
            k += len(s) - skip
        return values
