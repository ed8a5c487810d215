"""``length_win_rate``: an evaluator, i.e. the method that runs as a recipe's final ``evaluate`` stage.

It reads the evaluated stage's outputs (its ``policy`` input), pairs each with the reference output for the
same instruction (reference = ``output_1``, system = ``output_2``, AlpacaEval's convention), has the recipe's
evaluation annotator judge the pairs and writes ``annotations.json`` and ``metrics.json``: the win-rate of the
system and the average lengths of both sides, which is what a length-biased judge is checked against.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alpacafarm.data import load_source, write_json
from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, StageContext, Table
from alpacafarm.recipe import DataSource
from alpacafarm.types import Pair


class LengthWinRateConfig(BaseModel):
    """``evaluation.config`` of a recipe with ``evaluator: length_win_rate``."""

    model_config = ConfigDict(extra="forbid")  # a misspelled key is an error naming the recipe's line

    references: DataSource = Field(default_factory=lambda: DataSource(builtin="alpaca_eval_sample"),
                                   description="records with instruction, optional input and a reference")
    reference_field: str = Field("reference", description="the references' text field")


def _key(record: dict[str, Any]) -> tuple[str, str]:
    return str(record["instruction"]).strip(), str(record.get("input") or "").strip()


class LengthWinRate(Method):
    """Win-rate (%) of the evaluated outputs against references: a win scores 1, a tie 0.5, a loss 0."""

    config_class = LengthWinRateConfig
    requires = ("policy",)  # the evaluated stage's artifact (an outputs file)
    provides = "evaluation"
    annotator_role = "evaluation"  # the judge is part of this stage's fingerprint: a new judge re-runs it

    def run(self, context: StageContext) -> Artifact:
        config: LengthWinRateConfig = self.config
        outputs = context.outputs("policy")  # an outputs file, or a folder that names one
        references = {_key(r): str(r[config.reference_field]) for r in load_source(config.references)
                      if isinstance(r.get(config.reference_field), str)}
        matched = [r for r in outputs if _key(r) in references]
        if not matched:
            raise UserError(f"stage {context.stage!r}: none of the {len(outputs)} outputs has a reference")
        pairs = [Pair(r["instruction"], references[_key(r)], str(r["output"]), str(r.get("input") or ""))
                 for r in matched]
        annotator = context.make_annotator("evaluation")
        try:
            annotations = annotator.annotate(pairs)
        finally:
            annotator.close()
        parsed = [float(a.preference) for a in annotations if a.preference is not None]
        scores = [0.5 if p == 0 else p - 1.0 for p in parsed]  # 0 is a tie; some judges return p in [1, 2]
        metrics = {
            "annotator": annotator.name,
            "n_pairs": len(pairs),
            "n_unmatched": len(outputs) - len(matched),
            "n_wins": sum(s > 0.5 for s in scores),
            "n_losses": sum(s < 0.5 for s in scores),
            "n_ties": sum(s == 0.5 for s in scores),
            "n_unparsed": len(pairs) - len(parsed),
            "win_rate": round(100 * sum(scores) / len(scores), 2) if scores else None,
            "avg_length": round(sum(len(p.output_2) for p in pairs) / len(pairs), 1),
            "avg_reference_length": round(sum(len(p.output_1) for p in pairs) / len(pairs), 1),
        }
        write_json(context.stage_dir / "annotations.json",
                   [{"instruction": p.instruction, "input": p.input, "output_1": p.output_1,
                     "output_2": p.output_2, "preference": a.preference}
                    for p, a in zip(pairs, annotations, strict=True)])
        write_json(context.stage_dir / "metrics.json", metrics)
        context.logger.info("%s: win-rate %s over %d pairs (judge %s)", context.stage, metrics["win_rate"],
                            len(pairs), annotator.name)
        table = Table(f"length_win_rate (judge: {annotator.name})",
                      ["n", "wins", "ties", "losses", "win-rate %", "avg len", "avg ref len"],
                      [[len(pairs), metrics["n_wins"], metrics["n_ties"], metrics["n_losses"],
                        metrics["win_rate"], metrics["avg_length"], metrics["avg_reference_length"]]])
        return Artifact("evaluation", str(context.stage_dir / "metrics.json"), metrics, table=table)
