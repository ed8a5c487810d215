"""``reward_pairs``: preference pairs the reward model labels — the best and the worst of n samples per instruction.

The SFT model answers every instruction of a split ``n`` times; the reward model (the proxy fitted on the
simulated annotators' labels) scores each sample; the highest-scoring sample is preferred to the lowest-scoring
one. The result is a preference dataset like ``preference_data``'s, so every direct-alignment method (``dpo``,
``ipo``, ``simpo``, ``orpo``, ``kto``) and ``binary_feedme`` can learn from it (``inputs: {preferences:
reward_pairs}``). It is how the reward model's knowledge reaches methods that have no reward in their loss: the
synthetic preferences of West-of-N (Pace et al. 2024: best against worst of N by a reward model) and the
on-policy pairs that DPO and SimPO recipes use in practice (Meng et al. 2024, SimPO's instruct setting: the
best and worst of 5 samples by a reward model; Xiong et al. 2024, iterative DPO with a reward model).

Against the annotators' own pairs: no annotation is paid for (the reward model was fitted once), the reward model
can be asked about as many samples as there is time to draw (``n`` samples of as many instructions as the split
holds, where the annotators labelled a few hundred pairs), and a pair's two answers are as far apart as the
reward model sees them — where the annotators' pairs are two random samples, a quarter of them with a flipped
label (the paper's label noise). What it cannot do is know more than the reward model: its pairs carry the proxy's
errors, which the gold-preference world measures (``docs/gold.md``).

An instruction whose samples all score the same (or whose best and worst are the same text) gives no pair and is
counted; when no instruction gives one (a reward model that scores everything alike), the stage fails instead of
completing with an empty dataset. Which of the two answers is ``output_1`` is a coin seeded by the stage's seed
and the instruction, so no position carries the preference.

A stage that needs ``preferences`` and names no input takes the latest stage that provides them: after a
``reward_pairs`` stage, a method meant to learn from the annotators' pairs says so (``inputs: {preferences:
preferences}``), and one meant to learn from these names this stage.

Files (in the stage folder)::

    samples.jsonl        every sample: instruction, input, sample_index, output, reward
    preferences.jsonl    one pair per instruction: output_1, output_2, preference (1 or 2), reward_1, reward_2,
                         annotator "reward_model"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.data import write_jsonl
from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, Ranks, StageContext
from alpacafarm.reward_selection import mean
from alpacafarm.seeding import stable_uniform
from alpacafarm_methods.sampling.best_of_n import RankedSamplesConfig, ranked_samples


class RewardPairsConfig(RankedSamplesConfig):
    """:class:`~alpacafarm_methods.sampling.best_of_n.RankedSamplesConfig` on the training split: ``n`` samples
    per instruction, the best and the worst kept as a pair."""

    split: str = Field("train", description="file of the instruction splits to sample on")
    n: int = Field(16, ge=2, description="samples per instruction; the best and the worst make its pair")


def best_and_worst(group: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The highest- and lowest-reward samples of one instruction (the earliest on a tie), or None when no pair
    ranks: every reward equal, or the two texts the same."""
    indices = range(len(group))
    best = group[max(indices, key=lambda i: (group[i]["reward"], -i))]
    worst = group[min(indices, key=lambda i: (group[i]["reward"], i))]
    if best["reward"] == worst["reward"] or best["output"] == worst["output"]:
        return None
    return best, worst


def ranked_pair(record: dict[str, Any], best: dict[str, Any], worst: dict[str, Any], coin: float) -> dict[str, Any]:
    """A preference record for ``best`` over ``worst``: ``best`` is ``output_1`` when ``coin`` (in [0, 1)) is below
    one half."""
    first, second = (best, worst) if coin < 0.5 else (worst, best)
    return {"instruction": record["instruction"], "input": record.get("input") or "",
            "output_1": first["output"], "output_2": second["output"], "preference": 1 if first is best else 2,
            "reward_1": first["reward"], "reward_2": second["reward"], "annotator": "reward_model",
            "outcome": "labelled"}


def ranked_pairs(records: Sequence[dict[str, Any]], samples: Sequence[Sequence[dict[str, Any]]], seed: int,
                 where: str) -> list[dict[str, Any]]:
    """One :func:`ranked_pair` per record whose samples rank (its position coin drawn from ``seed`` and the record's
    index); a :class:`~alpacafarm.errors.UserError` naming ``where`` when none does."""
    pairs = []
    for index, (record, group) in enumerate(zip(records, samples, strict=True)):
        ranked = best_and_worst(group)
        if ranked is not None:
            pairs.append(ranked_pair(record, *ranked, stable_uniform(seed, "reward_pairs", index)))
    if not pairs:
        raise UserError(f"{where}: the reward model ranks no two samples of any of the {len(records)} instructions "
                        "(every sample of each scored alike, or the same text): no preference pair to write")
    return pairs


class RewardPairs(Method):
    """Best-against-worst of n samples per instruction, ranked by the reward model: a preference dataset."""

    config_class = RewardPairsConfig
    requires = (ArtifactName.SFT_MODEL, ArtifactName.REWARD_MODEL, ArtifactName.INSTRUCTION_SPLITS)
    provides = ArtifactName.PREFERENCES
    ranks = Ranks.ALL  # sampling and scoring are split across ranks

    def run(self, context: StageContext) -> Artifact:
        config: RewardPairsConfig = self.config
        records, samples, seconds = ranked_samples(context, config, f"reward pairs, {config.n} samples")
        path = context.stage_dir / "preferences.jsonl"
        if not context.is_main:
            return Artifact("dataset", str(path))
        pairs = ranked_pairs(records, samples, context.seed, f"stage {context.stage!r}")
        margins = [abs(p["reward_1"] - p["reward_2"]) for p in pairs]
        write_jsonl(context.stage_dir / "samples.jsonl", [s for group in samples for s in group])
        write_jsonl(path, pairs)
        context.logger.info("stage %s: %d pairs from %d instructions x %d samples, mean reward margin %.4f",
                            context.stage, len(pairs), len(records), config.n, mean(margins))
        return Artifact("dataset", str(path), {
            "n_pairs": len(pairs), "n_instructions": len(records),
            "instructions_without_pair": len(records) - len(pairs),
            "n_samples": sum(len(g) for g in samples), "mean_reward_margin": round(mean(margins), 6),
            "mean_sample_reward": round(mean([s["reward"] for g in samples for s in g]), 6),
            "mean_preferred_reward": round(mean([max(p["reward_1"], p["reward_2"]) for p in pairs]), 6),
            "sampling_seconds": round(seconds, 2)})
