"""``best_of_n``: sample n outputs per instruction, score them with the reward model, keep the best.

Paper Section 3.4 / Appendix A.2: best-of-n sampling is an inference-time policy that turns a surrogate reward
model into better outputs without training. The largest ``n`` is sampled once; every smaller ``n`` in
``n_values`` is evaluated on the *prefix* of the same samples (best of the first n), so one run gives the paper's
curve of win-rate against n and against proxy reward (Figure 4) at the cost of the largest n alone — and the
curve is monotone in the proxy reward by construction, as it should be.

Files (in the stage folder)::

    samples.jsonl         every sample: instruction, input, sample_index, output, reward
    best_of_<n>.jsonl     for each n: the chosen output per instruction (with its reward and sample_index)

The artifact's ``systems`` (:class:`~alpacafarm.artifacts.System`, one per n, with its proxy reward and its KL
to the sampled model in closed form) name the per-n files, so a recipe's evaluation (``evaluation.policy``
naming this stage) evaluates every n and plots the curve.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import ConfigDict, Field, model_validator

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.data import write_jsonl
from alpacafarm.divergence import best_of_n_kl
from alpacafarm.generation import SamplingConfig
from alpacafarm.method import Artifact, Method, Ranks, StageContext, System
from alpacafarm.recipe import GenerationBackendFields
from alpacafarm.reward_selection import mean, score_groups, select
from alpacafarm.rewards import DEFAULT_ENSEMBLE_COEFFICIENT, EnsembleRule


def powers_of_two(n_max: int) -> list[int]:
    """1, 2, 4, ... up to ``n_max``, and ``n_max`` itself when it is not a power of two."""
    values, n = [], 1
    while n < n_max:
        values.append(n)
        n *= 2
    return [*values, n_max]


class RankedSamplesConfig(GenerationBackendFields):
    """Which instructions, how many samples, how to sample and score them: what every method that ranks ``n``
    samples per instruction by the reward model shares (``best_of_n``, ``reward_pairs``).

    Sampling defaults: temperature 1.0 (the paper, Section 4.1: best-of-n reranks samples at 1.0 for diversity)
    and top_p 0.9 (the released decoding, ``HFDecodingArguments`` in ``alpaca_farm/inference/decode.py``; the
    paper states no top_p for its own models, 1.0 for the API baselines).
    """

    model_config = ConfigDict(extra="forbid")

    split: str = Field("eval", description="file of the instruction splits to answer (eval: a decoding policy)")
    max_instructions: int | None = Field(None, ge=1)
    n: int = Field(16, ge=1, description="the largest n: samples drawn per instruction (the paper sweeps up to 1024)")
    sampling: SamplingConfig = Field(
        default_factory=lambda: SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=256),
        description="n is taken from the field above; a sampling block given replaces the default (unset fields "
                    "take SamplingConfig's own defaults, top_p 1.0)")
    score_batch_size: int = Field(8, ge=1)
    ensemble: EnsembleRule = Field("mean", description="how an ensemble reward model's members combine")
    ensemble_coefficient: float = Field(DEFAULT_ENSEMBLE_COEFFICIENT, ge=0.0,
                                        description="uncertainty_weighted: the members' variance is weighted by this")


def ranked_samples(context: StageContext, config: RankedSamplesConfig, what: str
                   ) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]], float]:
    """``(records, samples, seconds)``: ``config.n`` samples of every instruction of ``config.split``, each with
    its ``reward``, grouped per instruction, on every rank.

    Sampling and scoring are split across ranks, each in batches that do not depend on the number of processes
    (the same samples and scores as one process); the caller's main process alone writes files. The sampling
    seed is the block's seed plus the stage's."""
    records = context.records("instruction_splits", config.split)[: config.max_instructions]
    sampling = config.sampling.model_copy(update={"n": config.n, "seed": config.sampling.seed + context.seed})
    started = time.perf_counter()
    rows, _ = context.generate_on_ranks(config.backend, config.backend_config, records, sampling,
                                        f"{what}: sampling")
    reward = context.reward_function(batch_size=config.score_batch_size, ensemble=config.ensemble,
                                     ensemble_coefficient=config.ensemble_coefficient)
    with context.progress(f"{what}: scoring", len(rows)) as line:
        samples = score_groups(reward, records, rows, config.n, config.score_batch_size,
                               f"stage {context.stage!r}: scoring", line)
    return records, samples, time.perf_counter() - started


class BestOfNConfig(RankedSamplesConfig):
    """:class:`RankedSamplesConfig` and the n evaluated on prefixes of the samples."""

    n_values: list[int] | None = Field(None, description="the n evaluated on prefixes; default 1, 2, 4, ..., n")

    @model_validator(mode="after")
    def _check_n_values(self) -> BestOfNConfig:
        if self.n_values is not None:
            bad = [v for v in self.n_values if not 1 <= v <= self.n]
            if bad or not self.n_values:
                raise ValueError(f"n_values must be between 1 and n={self.n} (got {self.n_values})")
        return self

    def resolved_n_values(self) -> list[int]:
        return sorted(set(self.n_values)) if self.n_values else powers_of_two(self.n)


class BestOfN(Method):
    """Best-of-n outputs for every n in the sweep, from one set of samples: one system per n, with its proxy reward."""

    config_class = BestOfNConfig
    requires = (ArtifactName.SFT_MODEL, ArtifactName.REWARD_MODEL, ArtifactName.INSTRUCTION_SPLITS)
    provides = ArtifactName.POLICY_OUTPUTS
    produces = ("systems",)
    ranks = Ranks.ALL  # sampling is split across ranks

    def run(self, context: StageContext) -> Artifact:
        config: BestOfNConfig = self.config
        records, samples, seconds = ranked_samples(context, config, f"best-of-{config.n}")
        if not context.is_main:
            return Artifact("outputs", str(context.stage_dir))
        write_jsonl(context.stage_dir / "samples.jsonl", [s for group in samples for s in group])
        systems: list[System] = []
        lengths: dict[str, float] = {}  # for people reading the manifest: the evaluation measures its own
        for n in config.resolved_n_values():
            chosen = select(samples, n)
            name = f"best_of_{n}"
            write_jsonl(context.stage_dir / f"{name}.jsonl", chosen)
            systems.append(System(name, str(context.stage_dir / f"{name}.jsonl"), n=n,
                                  proxy_reward=round(mean([c["reward"] for c in chosen]), 6), kl=best_of_n_kl(n),
                                  kl_se=0.0))  # the closed form: exact
            lengths[name] = round(mean([len(c["output"]) for c in chosen]), 1)
            context.logger.info("stage %s: best-of-%d mean proxy reward %.4f", context.stage, n,
                                systems[-1].proxy_reward)
        return Artifact("outputs", str(context.stage_dir), {
            "n_instructions": len(records), "n_samples": sum(len(g) for g in samples),
            "sampling_seconds": round(seconds, 2), "avg_length": lengths}, systems=systems)
