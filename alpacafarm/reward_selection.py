"""Sampling, scoring with the reward model, and picking the best sample.

Part of the method helpers (with :mod:`alpacafarm.training_rows` and :mod:`alpacafarm.policy_training`): what the
built-in methods call themselves, public so that a plugin imports these, never a built-in.

:func:`sample_and_score` — ``n`` samples per record, each with its reward; :func:`score_groups` — rows scored by the
reward model (``context.reward_function()``) and grouped per record, in batches that do not depend on the number of
processes (:func:`score_rows`, :func:`score_batches`); :func:`best_index` and :func:`select` — the winner among the
first ``n`` samples (the earliest on a tie); :func:`mark_finished` — which samples were cut at ``max_new_tokens``
(from :attr:`alpacafarm.generation.Generator.last_finished`); :func:`mean`.

Under several processes the helpers that split work across ranks (:func:`score_rows`, :func:`score_groups` with a
``batch_size``) are collectives that every rank must call, as :meth:`~alpacafarm.method.StageContext.generate_on_ranks`
is: a method that uses them sets ``ranks = Ranks.ALL`` (:class:`alpacafarm.method.Ranks`), as the built-in ones and
the ``alpacafarm plugin new`` template do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.generation import Generator, SamplingConfig, generate_records
from alpacafarm.rewards import RewardFunction, RewardScorer


def best_index(rewards: Sequence[float], n: int) -> int:
    """Index of the highest reward among the first ``n`` samples; the earliest wins a tie (deterministic)."""
    window = list(rewards[:n])
    if not window:
        raise ValueError("no samples to choose from")
    return max(range(len(window)), key=lambda i: (window[i], -i))


def sample_and_score(generator: Generator, reward: RewardFunction, records: Sequence[dict[str, Any]],
                     sampling: SamplingConfig, *, progress: Callable[[int], None] | None = None
                     ) -> list[list[dict[str, Any]]]:
    """``sampling.n`` samples per record, each with its ``reward``; one list of samples per record, in order."""
    rows = generate_records(generator, list(records), sampling, progress=progress)
    return score_groups(reward, records, rows, sampling.n)


def score_batches(reward: RewardFunction, rows: Sequence[dict[str, Any]], batch_size: int) -> list[list[int]]:
    """The scoring batches of ``rows`` (lists of row indices): longest text first, ``batch_size`` a batch.

    The same batches whatever the number of processes, so that a batch's scores do not depend on it (the reward
    model pads a batch to its longest text). With a :class:`~alpacafarm.rewards.RewardScorer` the order is the one
    it sorts by itself (:meth:`~alpacafarm.rewards.RewardScorer.full_text`), so one process scores exactly as it
    would all rows at once; any other reward function is ordered by the length of instruction, input and output.
    A mean-pooled scorer's batches keep the answers to one prompt together (consecutive, longest first), so that
    it reads each prompt once per batch of them."""
    if isinstance(reward, RewardScorer):
        lengths = [len(reward.full_text(row, row["output"])) for row in rows]
    else:
        lengths = [len(row["instruction"]) + len(row.get("input") or "") + len(row["output"]) for row in rows]
    order = sorted(range(len(rows)), key=lambda i: -lengths[i])
    if isinstance(reward, RewardScorer) and reward.pooling == "mean":
        # A mean-pooled scorer reads a prompt once for the answers to it in one batch: keep each instruction's
        # samples together (instructions in order of their longest text), not sorted among every other
        # instruction's by length, where best-of-8's samples of one prompt rarely met in a batch (issue 65).
        groups: dict[str, list[int]] = {}
        for i in order:
            groups.setdefault(reward.prompt_of(rows[i]), []).append(i)
        order = [i for group in groups.values() for i in group]
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def score_rows(reward: RewardFunction, rows: Sequence[dict[str, Any]], batch_size: int, where: str = "",
               progress: Any = None) -> list[float]:
    """The reward of every row, its :func:`score_batches` split across ranks (batch ``b`` on rank ``b mod world``)
    and gathered on every rank: the same scores as one process. ``progress``: a progress line
    (:meth:`StageContext.progress <alpacafarm.method.StageContext.progress>`), advanced by the rows this rank
    scores (its total set to them)."""
    from alpacafarm import distributed

    batches, world = score_batches(reward, rows, batch_size), distributed.world_size()
    mine = batches[distributed.rank()::world]
    if progress is not None:
        progress.update(total=sum(len(batch) for batch in mine))
    scored = []
    for batch in mine:
        scored.append(reward([rows[i] for i in batch], [rows[i]["output"] for i in batch]))
        if progress is not None:
            progress(len(batch))
    scores: list[float] = [0.0] * len(rows)
    for rank_, values in enumerate(distributed.all_gather_object(scored, where)):
        for batch, batch_scores in zip(batches[rank_::world], values, strict=True):
            for i, value in zip(batch, batch_scores, strict=True):
                scores[i] = float(value)
    return scores


def score_groups(reward: RewardFunction, records: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]],
                 n: int, batch_size: int | None = None, where: str = "", progress: Any = None,
                 ) -> list[list[dict[str, Any]]]:
    """``rows`` (``n`` samples per record, in order) scored and grouped per record; with ``batch_size``, in the
    batches of :func:`score_rows` across ranks (every rank gets every score), advancing ``progress`` as they go."""
    rewards = (reward(list(rows), [row["output"] for row in rows]) if batch_size is None
               else score_rows(reward, rows, batch_size, where, progress))
    grouped: list[list[dict[str, Any]]] = [[] for _ in records]
    for i, (row, value) in enumerate(zip(rows, rewards, strict=True)):
        grouped[i // n].append({**row, "reward": float(value)})
    return grouped


def select(samples: Sequence[Sequence[dict[str, Any]]], n: int) -> list[dict[str, Any]]:
    """The best of the first ``n`` samples of every instruction (a copy carrying ``n``)."""
    chosen = []
    for group in samples:
        best = group[best_index([s["reward"] for s in group], n)]
        chosen.append({**best, "n": n})
    return chosen


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def mark_finished(samples: list[list[dict[str, Any]]], generator: Any, backend: str) -> None:
    """Set ``finished`` on every sample: False when it was cut at ``max_new_tokens``.

    ``samples`` are grouped per instruction as :func:`sample_and_score` returns them,
    right after the one ``generate`` call that made them, whose :attr:`~alpacafarm.generation.Generator.last_finished`
    they match (a stop token for transformers, ``finish_reason`` for OpenAI-compatible servers and vLLM).
    """
    finished = getattr(generator, "last_finished", None) or ()
    if len(finished) != len(samples) or any(len(f) != len(g) for f, g in zip(finished, samples, strict=True)):
        raise UserError(f"the generation backend {backend!r} does not report which completions "
                        "were cut at max_new_tokens (Generator.last_finished); a cut winner must not be trained "
                        "to stop there")
    for flags, group in zip(finished, samples, strict=True):
        for flag, sample in zip(flags, group, strict=True):
            sample["finished"] = bool(flag)
