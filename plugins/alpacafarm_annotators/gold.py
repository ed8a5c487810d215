"""The ``gold`` annotator: a simulated human whose preference comes from a known pointwise score.

A gold-preference world (Gao et al. 2023, "Scaling laws for reward model overoptimization"; Coste et al. 2024,
"Reward model ensembles help mitigate overoptimization", run on AlpacaFarm with its 25% label noise) replaces the
LLM judge by a scoring function ``gold(records, answers) -> scores`` that anyone can read. The preference between
two answers is Bradley-Terry in the gold scores:

    P(output_2 ≻ output_1) = sigmoid((gold(output_2) - gold(output_1)) / temperature)

and the label is, by ``mode``:

- ``sample``: drawn from that probability (a seeded draw keyed on the unordered pair, so ``(a, b)`` and ``(b, a)``
  get mirrored labels and every process draws the same);
- ``threshold``: the higher score wins (a noiseless judge of hard labels);
- ``continuous``: ``1 + P(output_2 ≻ output_1)`` in [1, 2] (AlpacaEval 2's weighted preference; the evaluation's
  win-rate is then the expected gold win-rate, free of the coin flip of a hard label).

Equal scores (and identical answers) are a tie (``0``, counted 0.5 in every win-rate). On top, the paper's label
noise as the pools apply it (``noise``: with probability ``2 * noise`` the label is a fair coin, so it is flipped
with probability ``noise``).

A gold function is a ``module:function`` target (``gold:``): it takes the instruction records (``instruction``,
``input``) and the answers, and returns one finite float per answer; write one in a few lines (docs/gold.md).
The evaluator reads the scores themselves through :meth:`GoldAnnotator.score` (the evaluation's mean gold score
per system, with its paired standard error against the first system).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from alpacafarm.annotation import ProgressCallback, ScoringAnnotator, identical_tie
from alpacafarm.errors import UserError
from alpacafarm.seeding import stable_hash, stable_uniform
from alpacafarm.types import Annotation, Pair

#: ``gold(records, answers) -> scores``: one finite float per answer, higher is better.
GoldFunction = Callable[[Sequence[dict[str, Any]], Sequence[str]], Sequence[float]]


class GoldAnnotatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gold: str = Field("alpacafarm_annotators.gold_functions:helpfulness",
                      description="the gold score: a 'module:function' taking (records, answers), returning floats")
    temperature: float = Field(0.1, gt=0.0, description="Bradley-Terry temperature: P(b beats a) = "
                               "sigmoid((gold(b) - gold(a)) / temperature); smaller is closer to the threshold")
    mode: Literal["sample", "threshold", "continuous"] = Field(
        "sample", description="sample the label from P, take the higher score, or give 1 + P (weighted preference)")
    noise: float = Field(0.0, ge=0.0, le=0.5, description="label flip probability, as the pools apply it: with "
                         "probability 2 * noise the label is a fair coin (the paper's p_sim^ann: 0.25)")
    seed: int = Field(0, description="seed of the sampled labels and of the noise")
    acceptable_above: float | None = Field(
        None, description="also give each output a pointwise verdict: acceptable when its gold score is at least "
        "this (the binary feedback KTO learns from; noiseless). None: no verdict")


def load_gold(target: str) -> GoldFunction:
    """The gold function a ``module:function`` target names (one line naming the target when it is not one)."""
    from alpacafarm.errors import PluginError
    from alpacafarm.registry import import_target

    try:
        function = import_target(target, what="gold annotator: gold")
    except PluginError as exc:
        raise UserError(str(exc)) from None
    if not callable(function):
        raise UserError(f"gold annotator: gold {target!r} is not callable")
    return function


class GoldAnnotator(ScoringAnnotator):
    """Bradley-Terry preferences in a known gold score, with the paper's label noise (see the module)."""

    config_class = GoldAnnotatorConfig
    accepts_replicate = True

    def __init__(self, config: GoldAnnotatorConfig) -> None:
        self.config = config
        self.name = "gold"
        self.gold = load_gold(config.gold)
        #: (instruction, input, answer) -> gold score: a gold is a function of the answer and its instruction, so
        #: each is scored once per annotator (the evaluation's judging, its mean-gold column and :meth:`prefetch`)
        self._scores: dict[tuple[str, str, str], float] = {}

    def score(self, records: Sequence[dict[str, Any]], answers: Sequence[str]) -> list[float]:
        """The gold score of each answer to its record's instruction (checked: one finite float per answer)."""
        if len(records) != len(answers):
            raise ValueError(f"gold: {len(records)} records but {len(answers)} answers")
        keys = [(r["instruction"], r.get("input") or "", a) for r, a in zip(records, answers, strict=True)]
        todo = list(dict.fromkeys(k for k in keys if k not in self._scores))
        if todo:
            values = list(self.gold([{"instruction": i, "input": x} for i, x, _ in todo], [a for _, _, a in todo]))
            if len(values) != len(todo):
                raise UserError(f"gold {self.config.gold!r} returned {len(values)} scores for {len(todo)} answers")
            bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float))
                   or not math.isfinite(v)]
            if bad:
                raise UserError(f"gold {self.config.gold!r} returned a score that is not a finite number: "
                                f"{bad[0]!r}")
            self._scores.update(zip(todo, (float(v) for v in values), strict=True))
        return [self._scores[k] for k in keys]

    def prefetch(self, records: Sequence[dict[str, Any]], answers: Sequence[str]) -> None:
        """Score them now, in one call (see :meth:`ScoringAnnotator.prefetch`)."""
        self.score(records, answers)

    def probability(self, gold_1: float, gold_2: float) -> float:
        """P(output_2 beats output_1) under the Bradley-Terry model at ``temperature``."""
        z = (gold_2 - gold_1) / self.config.temperature
        return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))

    def _key(self, pair: Pair, replicate: int) -> tuple[Any, ...]:
        low, high = sorted((pair.output_1, pair.output_2))
        return (self.config.seed, pair.instruction, pair.input, low, high, *(("replicate", replicate)
                                                                              if replicate else ()))

    def label(self, pair: Pair, gold_1: float, gold_2: float, replicate: int = 0) -> Annotation:
        """The annotation of one pair from its two gold scores (noise, then the mode's label)."""
        config = self.config
        key = self._key(pair, replicate)
        canonical = pair.output_1 <= pair.output_2  # the draws are made in the canonical (sorted) order
        scores = {"gold_1": gold_1, "gold_2": gold_2}
        acceptable = None if config.acceptable_above is None else \
            (gold_1 >= config.acceptable_above, gold_2 >= config.acceptable_above)
        if config.noise and stable_uniform(*key, "noise") < 2 * config.noise:
            coin = 1 + stable_hash(*key, "coin") % 2
            return Annotation(coin if canonical else 3 - coin, "noise", noise=True, acceptable=acceptable,
                              metadata={"p_label_flip": config.noise, **scores})
        if gold_1 == gold_2:  # a tie in every mode (a weighted win-rate counts it 0.5, as 1.5 would be)
            return Annotation(0, self.name, metadata=scores, acceptable=acceptable)
        p_2 = self.probability(gold_1, gold_2)
        if config.mode == "continuous":
            preference: float | int = 1.0 + p_2
        elif config.mode == "threshold":
            preference = 2 if gold_2 > gold_1 else 1
        else:
            u = stable_uniform(*key, "label")  # P(the canonical second output wins) compared with one draw
            p_high = p_2 if canonical else 1.0 - p_2
            high_wins = u < p_high
            preference = (2 if high_wins else 1) if canonical else (1 if high_wins else 2)
        return Annotation(preference, self.name, metadata=scores, acceptable=acceptable)

    async def aannotate(self, pairs: Sequence[Pair], progress: ProgressCallback | None = None, *,
                        replicate: int = 0) -> list[Annotation]:
        ties = [identical_tie(p, self.name) for p in pairs]
        todo = [i for i, t in enumerate(ties) if t is None]
        records = [{"instruction": pairs[i].instruction, "input": pairs[i].input} for i in todo]
        scores = self.score(records + records, [pairs[i].output_1 for i in todo] + [pairs[i].output_2 for i in todo])
        results: list[Annotation] = []
        labelled = {i: self.label(pairs[i], scores[j], scores[j + len(todo)], replicate) for j, i in enumerate(todo)}
        for i, tie in enumerate(ties):
            results.append(tie if tie is not None else labelled[i])
        if progress:
            progress(len(pairs), 0.0)
        return results

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "gold", **self.config.model_dump()}
