"""What the helpful gold reads besides GPT-4's head: whether an answer answers *its* instruction.

:func:`read_answers` reads ``prompt + answer + EOS`` once with the frozen SFT model and returns, per answer, the
final hidden states averaged over the answer's tokens (the features the mean head and the mean-pooled proxy read;
an empty answer is its EOS) and the log-probability of each of the answer's tokens and its EOS (the model's
language-model head is its tied input embedding). :func:`relevance` is the pointwise mutual information of the
answer and its instruction over the answer's first :data:`WINDOW` tokens, divided by the window,

    sum over t < WINDOW of ( log p(token t | instruction, ...) - log p(token t | the empty instruction, ...) ) / WINDOW

(a shorter answer counts 0 for the tokens it lacks): how much more the instruction makes the answer likely than no
instruction at all. It is what a person checks first, and what GPT-4's judgments between two on-topic answers
never varied. Measured per token on 40 Davinci003 answers cut to 45 words: +0.79 nats for the real answer, -0.19
to -0.40 for a refusal, generic filler and another instruction's answer, -4.75 for the empty answer (ending at
once is unlikely after a real question) and +2.92 for an echo of the instruction (copying is likely):
:func:`echo_share` measures the copying, which the gold discounts.

Why a window: a mean over all of an answer's tokens let cutting it to its opening third win (+0.56 sd on Zephyr's
answers: openings are the most instruction-specific part), and a sum would pay for length; over the window,
padding and formatting past it buy nothing, and cutting into it costs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from alpacafarm.readings import ReadingStore

#: The instruction an answer is compared with: none (an empty user turn of the chat template).
NEUTRAL = ("", "")
#: Relevance is read over an answer's first 32 tokens (see the module).
WINDOW = 32


def read_answers(model: Any, tokenizer: Any, prompts: Sequence[str], answers: Sequence[str], *, batch_size: int,
                 max_length: int, features: bool = True, share_prompts: bool = True,
                 window: int | None = None, store: ReadingStore | None = None) -> tuple[Any, list[list[float]]]:
    """``(mean features [n, hidden] or None, the log-probability of each of an answer's tokens and its EOS)`` of
    ``prompt + answer + EOS`` (truncated to ``max_length`` tokens; a text cut inside its prompt counts the last
    token as its answer). Each distinct text once.

    Answers to one prompt share one pass over it (``share_prompts``): the prompt's keys and values and its last
    state (which predicts the answer's first token) are computed once per batch of its answers, and the answers
    are read after them; the same numbers as reading each text whole (``share_prompts=False``), to float rounding.
    The neutral reading (:data:`NEUTRAL`) is one prompt for every answer, so its pass is nearly all answer.
    ``window``: only the first ``window`` of an answer's log-probabilities are returned (what :func:`relevance`
    reads), and with ``features=False`` the answer is read no further (a causal model's earlier states do not
    depend on later tokens, so the numbers are the same).

    ``store`` (:mod:`alpacafarm.readings`): what it holds for these weights is not read again, and what is read
    is kept. An answer whose features it holds (a mean-pooled reward model with the same weights and dtype read
    it) but not enough log-probabilities is read only up to ``window`` for them."""
    import torch

    from alpacafarm.rewards import with_eos

    if not getattr(model.config, "tie_word_embeddings", False):
        raise ValueError("gold relevance: the frozen model's language-model head is not its input embedding "
                         "(tie_word_embeddings is false), so it cannot be read off the classifier's backbone")
    texts = [with_eos(p + a, tokenizer.eos_token) for p, a in zip(prompts, answers, strict=True)]
    starts = {p: len(tokenizer(p)["input_ids"]) for p in dict.fromkeys(prompts)}
    keys = list(dict.fromkeys(zip(texts, (starts[p] for p in prompts), strict=True)))
    ids = {key: tokenizer(key[0])["input_ids"][:max_length] for key in keys}
    done: dict[tuple[str, int], tuple[Any, list[float]]] = {}
    fresh: list[tuple[str, int]] = keys
    log_probs_only: list[tuple[str, int]] = []
    stored_keys: dict[tuple[str, int], str] = {}
    if store is not None:
        from alpacafarm.readings import fingerprint, reading_key

        model_print = fingerprint(model.base_model)
        stored_keys = {key: reading_key(model_print, ids[key], key[1]) for key in keys}
        found = store.get(stored_keys.values())
        fresh = []
        for key in keys:
            row = found.get(stored_keys[key])
            need = _log_prob_count(ids[key], key[1], window)
            have_features = row is not None and (row.features is not None or not features)
            if have_features and row.log_probs is not None and len(row.log_probs) >= need:
                done[key] = (row.features if features else None, row.log_probs[:need])
            elif have_features:
                log_probs_only.append(key)
            else:
                fresh.append(key)
    embedding = model.get_input_embeddings().weight.float()
    computed = _read(_Reading(model.base_model, embedding, tokenizer, features, window), fresh, ids, batch_size,
                     share_prompts, cut=window if (window is not None and not features) else None)
    if log_probs_only:  # the features are stored: the log-probabilities need the answer's first tokens only
        computed.update(_read(_Reading(model.base_model, embedding, tokenizer, False, window), log_probs_only, ids,
                              batch_size, share_prompts, cut=window))
    if stored_keys:
        from alpacafarm.readings import Reading

        store.put({stored_keys[k]: Reading(features=v[0], log_probs=v[1]) for k, v in computed.items()})
        for key in log_probs_only:
            computed[key] = (found[stored_keys[key]].features if features else None, computed[key][1])
    done.update(computed)
    rows = [done[(t, starts[p])] for t, p in zip(texts, prompts, strict=True)]
    matrix = torch.stack([r[0] for r in rows]) if features and rows else None
    return matrix, [r[1] for r in rows]


def _log_prob_count(ids: Sequence[int], start: int, window: int | None) -> int:
    """How many log-probabilities :class:`_Reading` returns for the text ``ids`` whose answer starts at ``start``."""
    if 0 < start < len(ids):
        count = len(ids) - start
    else:  # read whole: from the state before the answer's first token (the last token, if the prompt was cut)
        first = min(start, len(ids) - 1)
        count = len(ids) - max(first - 1, 0) - 1
    return count if window is None else min(window, count)


def _read(reading: _Reading, keys: Sequence[tuple[str, int]], ids: dict[tuple[str, int], list[int]],
          batch_size: int, share_prompts: bool, cut: int | None) -> dict[tuple[str, int], tuple[Any, list[float]]]:
    """``reading``'s rows of ``keys``: answers after their shared prompt, the rest whole, longest first; ``cut``:
    each text read only to ``cut`` tokens past its prompt."""
    import torch

    from alpacafarm.rewards import pack_groups

    if cut is not None:
        ids = {key: ids[key][:key[1] + cut] for key in keys}
    by_prompt: dict[tuple[int, ...], list[tuple[str, int]]] = {}
    alone = []
    for key in keys:
        start = key[1]
        if share_prompts and 0 < start < len(ids[key]):  # an answer token fits after the whole prompt
            by_prompt.setdefault(tuple(ids[key][:start]), []).append(key)
        else:
            alone.append(key)
    for prompt_ids in [p for p, group in by_prompt.items() if len(group) == 1]:
        # a prompt with one answer (a reference answer) gains nothing from its own pass: batched whole with the
        # others it is read faster (128 Davinci003 answers in float32 on AVX2: 31 s whole, 42 s one by one)
        alone.extend(by_prompt.pop(prompt_ids))
    done: dict[tuple[str, int], tuple[Any, list[float]]] = {}
    with torch.inference_mode():
        for batch in pack_groups(list(by_prompt.values()), batch_size, lambda key: key[1]):
            chunk = [key for group in batch for key in group]
            prompts = [ids[group[0]][:group[0][1]] for group in batch]
            owners = [g for g, group in enumerate(batch) for _ in group]
            done.update(zip(chunk, reading.after_prompts(prompts, owners, [ids[k] for k in chunk]), strict=True))
        order = sorted(alone, key=lambda k: -len(ids[k]))
        for begin in range(0, len(order), batch_size):
            chunk = order[begin:begin + batch_size]
            done.update(zip(chunk, reading.whole([ids[k] for k in chunk], [k[1] for k in chunk]), strict=True))
    return done


class _Reading:
    """One frozen model's passes for :func:`read_answers`: texts read whole, or answers read after their prompt."""

    def __init__(self, backbone: Any, embedding: Any, tokenizer: Any, features: bool, window: int | None) -> None:
        self.backbone, self.embedding, self.tokenizer = backbone, embedding, tokenizer
        self.pad_id, self.device = tokenizer.pad_token_id, embedding.device
        self.features, self.window = features, window

    def _row(self, before: Any, states: Any, answer_ids: list[int]) -> tuple[Any, list[float]]:
        """An answer's pooled states and per-token log-probabilities: ``before[j]`` predicts ``answer_ids[j]``."""
        import torch

        scored = len(answer_ids) if self.window is None else min(self.window, len(answer_ids))
        targets = torch.tensor(answer_ids[:scored], device=self.device)
        log_probs = (before[:scored] @ self.embedding.T).log_softmax(dim=-1)
        per_token = log_probs.gather(-1, targets[:, None])[:, 0].tolist()
        pooled = _mean_states(states, answer_ids, self.tokenizer) if self.features else None
        return pooled, per_token

    def whole(self, rows: list[list[int]], starts: list[int]) -> list[tuple[Any, list[float]]]:
        import torch

        width = max(len(i) for i in rows)
        input_ids = torch.tensor([i + [self.pad_id] * (width - len(i)) for i in rows], device=self.device)
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in rows], device=self.device)
        hidden = self.backbone(input_ids=input_ids, attention_mask=mask).last_hidden_state.float()
        out = []
        for row, (row_ids, start) in enumerate(zip(rows, starts, strict=True)):
            first = min(start, len(row_ids) - 1)
            # the answer's tokens are predicted from the state before each: positions first-1 .. len-2
            before = hidden[row, max(first - 1, 0):len(row_ids) - 1]
            out.append(self._row(before, hidden[row, first:len(row_ids)], row_ids[max(first - 1, 0) + 1:]))
        return out

    def after_prompts(self, prompts: list[list[int]], owners: list[int],
                      rows: list[list[int]]) -> list[tuple[Any, list[float]]]:
        """Rows ``rows[j]`` (whole token lists) read after their prompt ``prompts[owners[j]]``, in one batch."""
        import torch

        from alpacafarm.rewards import states_after_prompts

        answers = [i[len(prompts[o]):] for i, o in zip(rows, owners, strict=True)]
        last, hidden = states_after_prompts(self.backbone, prompts, owners, answers, self.pad_id, self.device)
        last, hidden = last.float(), hidden.float()
        out = []
        for row, answer in enumerate(answers):
            before = torch.cat([last[row:row + 1], hidden[row, :len(answer) - 1]])
            out.append(self._row(before, hidden[row, :len(answer)], answer))
        return out


def _mean_states(states: Any, answer_ids: list[int], tokenizer: Any) -> Any:
    """The answer's states averaged as :func:`alpacafarm.rewards.answer_mean_features` averages them: up to its
    last token that is not the pad token (EOS counted where it is not the pad), an empty answer at its EOS."""
    pad = tokenizer.pad_token_id
    real = [k for k, token in enumerate(answer_ids) if token != pad]
    end = (real[-1] + 1) if real else 1
    return states[:end].mean(dim=0).clone()


def relevance(log_probs: Sequence[Sequence[float]], neutral_log_probs: Sequence[Sequence[float]],
              window: int = WINDOW) -> list[float]:
    """The pointwise mutual information of each answer and its instruction over the answer's first ``window``
    tokens (its EOS included when it falls inside), divided by ``window`` (see the module)."""
    # the two readings of one answer differ in length only where max_length cut the one after the longer prompt:
    # its tokens past the cut are not compared
    return [sum(a - b for a, b in zip(own[:window], neutral[:window], strict=False)) / window
            for own, neutral in zip(log_probs, neutral_log_probs, strict=True)]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def echo_share(record: dict[str, Any], answer: str) -> float:
    """The share of the answer's word trigrams (words, for answers under three words) that occur in its
    instruction and input, 0 to 1: an echo of the instruction is 1, a real answer quoting a phrase of it ~0.05."""
    asked = _words(f"{record.get('instruction', '')} {record.get('input') or ''}")
    said = _words(answer)
    n = 3 if len(said) >= 3 else 1
    grams = [tuple(said[k:k + n]) for k in range(len(said) - n + 1)]
    if not grams:
        return 0.0
    known = {tuple(asked[k:k + n]) for k in range(len(asked) - n + 1)}
    return sum(g in known for g in grams) / len(grams)
