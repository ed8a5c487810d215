"""``best_of_n``: sample n outputs per instruction, score them with the reward model, keep the best.

Paper Section 3.4 / Appendix A.2: best-of-n sampling is an inference-time policy that turns a surrogate reward
model into better outputs without training. The largest ``n`` is sampled once; every smaller ``n`` in
``n_values`` is evaluated on the *prefix* of the same samples (best of the first n), so one run gives the paper's
curve of win-rate against n and against proxy reward (Figure 4) at the cost of the largest n alone — and the
curve is monotone in the proxy reward by construction, as it should be.

Files (in the stage folder)::

    samples.jsonl         every sample: instruction, input, sample_index, output, reward
    best_of_<n>.jsonl     for each n: the chosen output per instruction (with its reward and sample_index)

The artifact's ``systems`` metadata lists the per-n files, so a recipe's evaluation (``evaluation.policy``
naming this stage) evaluates every n and plots the curve; ``outputs`` names the largest n's file, the default
policy when only one system is evaluated.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from alpacafarm.data import write_jsonl
from alpacafarm.generation import Generator, SamplingConfig, generate_records
from alpacafarm.method import Artifact, Method, StageContext
from alpacafarm.rewards import RewardFunction


def powers_of_two(n_max: int) -> list[int]:
    """1, 2, 4, ... up to ``n_max``, and ``n_max`` itself when it is not a power of two."""
    values, n = [], 1
    while n < n_max:
        values.append(n)
        n *= 2
    return [*values, n_max]


class BestOfNConfig(BaseModel):
    """Which instructions, how many samples, how to sample and score them.

    Sampling defaults: temperature 1.0 (the paper, Section 4.1: best-of-n reranks samples at 1.0 for diversity)
    and top_p 0.9 (the released decoding, ``HFDecodingArguments`` in ``alpaca_farm/inference/decode.py``; the
    paper states no top_p for its own models, 1.0 for the API baselines).
    """

    model_config = ConfigDict(extra="forbid")

    split: str = Field("eval", description="file of the instruction splits to answer (eval: a decoding policy)")
    max_instructions: int | None = Field(None, ge=1)
    n: int = Field(16, ge=1, description="the largest n: samples drawn per instruction (the paper sweeps up to 1024)")
    n_values: list[int] | None = Field(None, description="the n evaluated on prefixes; default 1, 2, 4, ..., n")
    sampling: SamplingConfig = Field(
        default_factory=lambda: SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=256),
        description="n is taken from the field above; a sampling block given replaces the default (unset fields "
                    "take SamplingConfig's own defaults, top_p 1.0)")
    score_batch_size: int = Field(8, ge=1)
    backend: str = "transformers"
    backend_config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_n_values(self) -> BestOfNConfig:
        if self.n_values is not None:
            bad = [v for v in self.n_values if not 1 <= v <= self.n]
            if bad or not self.n_values:
                raise ValueError(f"n_values must be between 1 and n={self.n} (got {self.n_values})")
        return self

    def resolved_n_values(self) -> list[int]:
        return sorted(set(self.n_values)) if self.n_values else powers_of_two(self.n)


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
    model pads a batch to its longest text). With a reward model's scorer the order is the one it sorts by itself
    (its full text), so one process scores exactly as it would all rows at once."""
    full_text = getattr(reward, "full_text", None)
    lengths = [len(full_text(row, row["output"])) if full_text is not None
               else len(row["instruction"]) + len(row.get("input") or "") + len(row["output"]) for row in rows]
    order = sorted(range(len(rows)), key=lambda i: -lengths[i])
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def score_rows(reward: RewardFunction, rows: Sequence[dict[str, Any]], batch_size: int, where: str = "") -> list[float]:
    """The reward of every row, its :func:`score_batches` split across ranks (batch ``b`` on rank ``b mod world``)
    and gathered on every rank: the same scores as one process."""
    from alpacafarm import distributed

    batches, world = score_batches(reward, rows, batch_size), distributed.world_size()
    mine = batches[distributed.rank()::world]
    scored = [reward([rows[i] for i in batch], [rows[i]["output"] for i in batch]) for batch in mine]
    scores: list[float] = [0.0] * len(rows)
    for rank_, values in enumerate(distributed.all_gather_object(scored, where)):
        for batch, batch_scores in zip(batches[rank_::world], values, strict=True):
            for i, value in zip(batch, batch_scores, strict=True):
                scores[i] = float(value)
    return scores


def score_groups(reward: RewardFunction, records: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]],
                 n: int, batch_size: int | None = None, where: str = "") -> list[list[dict[str, Any]]]:
    """``rows`` (``n`` samples per record, in order) scored and grouped per record; with ``batch_size``, in the
    batches of :func:`score_rows` across ranks (every rank gets every score)."""
    rewards = (reward(list(rows), [row["output"] for row in rows]) if batch_size is None
               else score_rows(reward, rows, batch_size, where))
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


class BestOfN(Method):
    """Best-of-n outputs for every n in the sweep, from one set of samples; proxy reward per n in the metadata."""

    config_class = BestOfNConfig
    requires = ("sft_model", "reward_model", "instruction_splits")
    provides = "policy_outputs"
    all_ranks = True  # sampling is split across ranks

    def run(self, context: StageContext) -> Artifact:
        config: BestOfNConfig = self.config
        records = context.records("instruction_splits", config.split)[: config.max_instructions]
        sampling = config.sampling.model_copy(update={"n": config.n, "seed": config.sampling.seed + context.seed})
        started = time.perf_counter()
        # Sampling and scoring are split across ranks, each in batches that do not depend on the number of
        # processes (the same samples and scores as one process); the main process alone writes the files.
        rows, _ = context.generate_on_ranks(config.backend, config.backend_config, records, sampling,
                                            f"best-of-{config.n}: sampling")
        reward = context.reward_function(batch_size=config.score_batch_size)
        samples = score_groups(reward, records, rows, config.n, config.score_batch_size,
                               f"stage {context.stage!r}: scoring")
        if not context.is_main:
            return Artifact("outputs", str(context.stage_dir))
        seconds = time.perf_counter() - started
        write_jsonl(context.stage_dir / "samples.jsonl", [s for group in samples for s in group])
        systems: dict[str, dict[str, Any]] = {}
        for n in config.resolved_n_values():
            chosen = select(samples, n)
            name = f"best_of_{n}"
            write_jsonl(context.stage_dir / f"{name}.jsonl", chosen)
            systems[name] = {"outputs": f"{name}.jsonl", "n": n,
                             "proxy_reward": round(mean([c["reward"] for c in chosen]), 6),
                             "avg_length": round(mean([len(c["output"]) for c in chosen]), 1)}
            context.logger.info("stage %s: best-of-%d mean proxy reward %.4f", context.stage, n,
                                systems[name]["proxy_reward"])
        largest = f"best_of_{max(config.resolved_n_values())}"
        return Artifact("outputs", str(context.stage_dir), {
            "outputs": systems[largest]["outputs"], "systems": systems, "n_instructions": len(records),
            "n_samples": sum(len(g) for g in samples), "sampling_seconds": round(seconds, 2)})
