"""The ``win_rate`` evaluator: the pipeline's final ``evaluate`` stage.

Its ``policy`` input is the artifact of the evaluated stage: one system per
:class:`~alpacafarm.artifacts.System` it hands on, else its outputs file (read with
:meth:`~alpacafarm.method.StageContext.outputs`). Its artifact hands the gate what it judged (``judged``: one
:class:`~alpacafarm.artifacts.JudgedSystem` per system, naming its ``annotations.json``) and a ``table``. The
outputs are paired with reference outputs, judged by the recipe's evaluation annotator (``evaluation.annotator``, else
``annotator``), and scored (see ``metrics.py``).

A system with more pairs without a label than ``max_unlabelled_fraction`` (failed: the judge got no answer;
unparsed: its answer could not be read; ties are labels) fails the stage with one line naming the endpoint and
the first error; the stage is not recorded complete, and the next run re-asks only what is missing (the judged
pairs are cached). Within the tolerance, unlabelled pairs are dropped from the win-rate and counted
(``n_unparsed``; ``n_failed`` of them got no answer), and the metrics carry the judge's ledger for the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alpacafarm.annotation import Annotator, ProgressCallback, aannotate_replicate, check_unlabelled
from alpacafarm.annotation_cache import LedgerTotals
from alpacafarm.artifact_names import ArtifactName
from alpacafarm.method import Artifact, JudgedSystem, Method, StageContext, System, Table
from alpacafarm.recipe import DataSource
from alpacafarm.rewards import DEFAULT_ENSEMBLE_COEFFICIENT, EnsembleRule
from alpacafarm.types import Annotation, Pair


class WinRateConfig(BaseModel):
    """``evaluation.config`` of a recipe using ``evaluator: win_rate``."""

    model_config = ConfigDict(extra="forbid")

    references: DataSource | None = Field(
        default_factory=lambda: DataSource(builtin="alpaca_eval_sample"),
        description="reference outputs (output_1 of every pair); default: the bundled AlpacaEval sample")
    reference_field: str = Field("reference", description="the references' text field ('output' is the fallback)")
    max_instructions: int | None = Field(None, ge=1, description="evaluate only the first N matched instructions")
    max_unlabelled_fraction: float = Field(
        0.05, ge=0.0, le=1.0, description="the stage fails when more of a system's pairs than this have no label "
        "(failed or unparsed); what was judged is cached, so a re-run asks only for the rest")
    ensemble: EnsembleRule = Field("mean", description="the proxy column's rule for an ensemble reward model")
    ensemble_coefficient: float = Field(DEFAULT_ENSEMBLE_COEFFICIENT, ge=0.0,
                                        description="uncertainty_weighted: the members' variance is weighted by this")


@dataclass
class Candidate:
    """One system being evaluated: its name, the stage it came from, its output records, and what its stage handed
    on about it (:class:`~alpacafarm.artifacts.System`: n, step, proxy reward, KL); a stage that hands on no
    systems is one candidate named after the stage."""

    name: str
    stage: str
    outputs: list[dict[str, Any]]
    declared: System | None = None

    @property
    def n(self) -> int | None:
        return self.declared.n if self.declared else None

    @property
    def step(self) -> int | None:
        return self.declared.step if self.declared else None

    @property
    def proxy_reward(self) -> float | None:
        return self.declared.proxy_reward if self.declared else None

    @property
    def train_reward(self) -> float | None:
        return self.declared.train_reward if self.declared else None


class WinRateEvaluator(Method):
    """Win-rate of the evaluated stages' outputs against reference outputs, judged by the recipe's annotator.

    Evaluates one system (``evaluation.policy: <stage>``) or several (a list of stages; a stage whose artifact
    hands on ``systems``, such as ``best_of_n``, contributes one system per entry). Writes ``results.csv`` /
    ``results.json`` (system, win-rate ± SE, avg length, proxy reward) and, when systems carry ``n``, the
    ``results.png`` curve of win-rate and proxy reward against n. The proxy reward is the mean reward-model
    score of a system's outputs: recorded by its stage (best-of-n), else scored here with the run's latest
    ``reward_model`` when the recipe trained one.
    """

    config_class = WinRateConfig
    requires = (ArtifactName.POLICY,)
    # the splits: which split a look is at (``looks.py``)
    optional = (ArtifactName.REWARD_MODEL, ArtifactName.INSTRUCTION_SPLITS)
    produces = ("judged", "table")
    provides = ArtifactName.EVALUATION
    annotator_role = "evaluation"

    def systems(self, context: StageContext) -> list[Candidate]:
        """Every evaluated system, in the recipe's order."""
        from alpacafarm.data import read_records

        evaluation = context.recipe.evaluation
        default_stage = (evaluation.policy if evaluation and isinstance(evaluation.policy, str) else None) \
            or context.recipe.stages[-1].name
        found: list[Candidate] = []
        for key, artifact in context.inputs.items():
            if key != "policy" and not key.startswith("policy:"):
                continue
            stage = key.split(":", 1)[1] if ":" in key else default_stage
            for system in artifact.systems:  # checked when its stage ended: each names an outputs file
                found.append(Candidate(system.name, stage, read_records(Path(system.outputs)), system))
            if not artifact.systems:
                found.append(Candidate(stage, stage, context.outputs(key)))
        names = [s.name for s in found]
        for system in found:  # two stages listing the same system name: qualify both with their stage
            if names.count(system.name) > 1:
                system.name = f"{system.stage}/{system.name}"
        return found

    def run(self, context: StageContext) -> Artifact:
        """Pair, judge, score every system; writes annotations, metrics and the results table into the stage folder."""
        from alpacafarm.data import write_json
        from alpacafarm_evaluation.metrics import metrics_table
        from alpacafarm_evaluation.pairing import annotate_and_score, load_references, pair_outputs
        from alpacafarm_evaluation.results import proxy_rewards, results_rows, results_table, write_results

        config: WinRateConfig = self.config
        systems = self.systems(context)
        references = load_references(config.references, config.reference_field)
        single = len(systems) == 1
        annotator = RecordingAnnotator(context.make_annotator("evaluation"))
        judged: list[JudgedSystem] = []
        evaluated: list[tuple[Candidate, dict[str, Any], list[dict[str, Any]], dict[str, float]]] = []
        try:
            paired = [pair_outputs(system.outputs, references, config.max_instructions, f"{system.name} outputs",
                                   generator=system.name) for system in systems]
            prefetch(annotator.inner, [pairs for pairs, _ in paired])
            for system, (pairs, skipped) in zip(systems, paired, strict=True):
                if skipped["n_unmatched"] or skipped["n_extra_samples"]:
                    context.logger.warning(
                        "%s: %s: skipped %d of %d outputs without a reference instruction and %d extra samples",
                        context.stage, system.name, skipped["n_unmatched"], len(system.outputs),
                        skipped["n_extra_samples"])
                out_dir = (context.stage_dir if single
                           else context.stage_dir / "systems" / system.name.replace("/", "__"))
                before = annotator.usage()
                metrics = annotate_and_score(pairs, annotator, out_dir, skipped)
                outcomes = check_unlabelled(annotator.last, config.max_unlabelled_fraction,
                                            f"stage {context.stage!r}: {system.name} (judge {annotator.name!r})")
                after = annotator.usage()
                paid = LedgerTotals(after.requests - before.requests, after.tokens_in - before.tokens_in,
                                    after.tokens_out - before.tokens_out, after.price_usd - before.price_usd)
                metrics.update(n_failed=outcomes.failed, ledger=paid.to_json())
                write_json(out_dir / "metrics.json", metrics)
                per_instruction = instruction_scores(out_dir / "annotations.json")
                context.logger.info("%s: %s win-rate %.2f ± %.2f over %d pairs", context.stage, system.name,
                                    metrics["win_rate"] or 0.0, metrics["standard_error"] or 0.0, metrics["n_total"])
                evaluated.append((system, metrics, pairs, per_instruction))
                judged.append(JudgedSystem(system.name, system.stage, str(out_dir / "annotations.json"),
                                           metrics["win_rate"], metrics["standard_error"]))
        finally:
            annotator.close()
        rewards = proxy_rewards(context, [(s, pairs) for s, _, pairs, _ in evaluated],
                               ensemble=(config.ensemble, config.ensemble_coefficient))
        golds = [gold_scores(annotator.inner, pairs) for _, _, pairs, _ in evaluated]
        kls = [policy_kl(system) for system, _, _, _ in evaluated]
        rows = results_rows([(s, m, per) for s, m, _, per in evaluated], rewards, golds, kls)
        looks = count_look(context, config, [(s, pairs) for s, _, pairs, _ in evaluated])
        for row in rows:
            row["retried_after_looks"] = looks.retried.get(row["stage"])
        files = write_results(rows, context.stage_dir, looks=looks.to_json())
        judge = evaluated[0][1]["annotator"]
        reference = evaluated[0][1]["reference"]
        context.logger.info("%s: %s", context.stage, looks.caption())
        if single:
            metrics = {**evaluated[0][1], "proxy_reward": rows[0]["proxy_reward"], "results": files,
                       "looks": looks.to_json()}
            title = f"win-rate of {metrics.get('generator')} vs {reference} (judge: {judge}); {looks.caption()}"
            return Artifact("evaluation", str(context.stage_dir / "metrics.json"), metrics, judged=judged,
                            table=Table(**metrics_table(metrics, title)))
        table = results_table(rows, f"win-rate vs {reference} (judge: {judge}); {looks.caption()}")
        return Artifact("evaluation", files["json"], {"annotator": judge, "reference": reference, "results": files,
                                                      "looks": looks.to_json()},
                        judged=judged, table=Table(**table))


class RecordingAnnotator(Annotator):
    """The stage's judge, keeping the annotations of its last call (their outcomes decide the tolerance check)."""

    accepts_replicate = True  # passed on to the judge, which may refuse replicate k > 0 itself

    def __init__(self, inner: Annotator) -> None:
        self.inner = inner
        self.name = inner.name
        self.last: list[Annotation] = []

    async def aannotate(self, pairs: Sequence[Pair], progress: ProgressCallback | None = None, *,
                        replicate: int = 0) -> list[Annotation]:
        self.last = await aannotate_replicate(self.inner, pairs, progress, replicate)
        return self.last

    def usage(self) -> LedgerTotals:
        return self.inner.usage()

    def close(self) -> None:
        self.inner.close()


def count_look(context: StageContext, config: WinRateConfig,
               systems: Sequence[tuple[Candidate, list[dict[str, Any]]]]) -> Any:
    """Record this evaluation in the looks ledger (``looks.py``) when it judged instructions of the run's
    ``instruction_splits`` input, and return what the ledger says (a :class:`~alpacafarm_evaluation.looks.
    LookSummary`; split None when there is no split input or the judged instructions lie on none of its splits)."""
    from alpacafarm.annotation import label_identity, without_run_limits
    from alpacafarm_evaluation.looks import LooksLedger, LookSummary, Splits, instruction_key, stage_settings, world_of

    if "instruction_splits" not in context.inputs:
        return LookSummary(None)
    files = context.input("instruction_splits").files
    held_out = "test" if "test" in files else "eval"
    if held_out not in files:
        return LookSummary(None)
    splits = Splits(frozenset(instruction_key(r) for r in context.records("instruction_splits", held_out)),
                    frozenset(instruction_key(r) for r in context.records("instruction_splits", "validation"))
                    if "validation" in files else frozenset())
    split = splits.which(instruction_key(p) for _, pairs in systems for p in pairs)
    if split is None:
        return LookSummary(None)
    ref = context.annotator_ref("evaluation")
    judge = {"judge": without_run_limits(ref.model_dump(mode="json")), "labels": label_identity(context.registry,
                                                                                                 ref.name)}
    settings = {"references": config.references.model_dump(mode="json") if config.references else None,
                "reference_field": config.reference_field, "max_instructions": config.max_instructions}
    judged = [(s.name, s.stage, stage_settings(context.run_dir, s.stage)) for s, _ in systems]
    return LooksLedger().record(world_of(splits, judge, settings), split, context.run_dir, context.stage, judged)


def prefetch(judge: Annotator, systems_pairs: Sequence[Sequence[dict[str, Any]]]) -> None:
    """Let a judge that scores answers one by one (the gold world's gold) score every system's answers and the
    references in one call before the systems are judged one by one: an instruction's answers from every system
    then share one reading of its prompt (issue 65), and each system's judging finds its scores ready."""
    from alpacafarm.annotation import ScoringAnnotator

    if not isinstance(judge, ScoringAnnotator):
        return
    items = dict.fromkeys((p["instruction"], p["input"], p[side]) for pairs in systems_pairs for p in pairs
                          for side in ("output_1", "output_2"))
    judge.prefetch([{"instruction": i, "input": x} for i, x, _ in items], [a for _, _, a in items])


def gold_scores(judge: Annotator, pairs: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """Per-instruction score of the system's answers (``output_2``) when the judge scores answers one by one (a
    :class:`~alpacafarm.annotation.ScoringAnnotator`: the gold world's gold), else None."""
    from alpacafarm.annotation import ScoringAnnotator

    if not isinstance(judge, ScoringAnnotator):
        return None
    records = [{"instruction": p["instruction"], "input": p["input"]} for p in pairs]
    values = judge.score(records, [p["output_2"] for p in pairs])
    return {f"{p['instruction']}\x00{p['input']}": v for p, v in zip(pairs, values, strict=True)}


def policy_kl(system: Candidate) -> tuple[float, float | None] | None:
    """``(KL to the reference model, its SE)`` of a system: as its stage handed it on (best-of-n: in closed form,
    ``log n - (n - 1)/n``, SE 0), else from the log-probabilities its stage wrote with each output
    (``generate_outputs`` with a ``kl_reference`` input); None when neither is known."""
    from alpacafarm.divergence import kl_estimate

    if system.declared is not None and system.declared.kl is not None:
        return system.declared.kl, system.declared.kl_se
    if system.outputs and all("logprob" in r and "reference_logprob" in r for r in system.outputs):
        return kl_estimate([r["logprob"] for r in system.outputs], [r["reference_logprob"] for r in system.outputs])
    return None


def instruction_scores(annotations_path: Path) -> dict[str, float]:
    """Per-instruction score of the evaluated system (1 win, 0.5 draw, 0 loss) from its ``annotations.json``."""
    import json

    from alpacafarm_evaluation.metrics import scores

    records = json.loads(annotations_path.read_text(encoding="utf-8"))
    values = scores([r.get("preference") for r in records])
    return {f"{r['instruction']}\x00{r.get('input') or ''}": v for r, v in zip(records, values, strict=True)
            if v is not None}

