"""The ``win_rate`` evaluator: the pipeline's final ``evaluate`` stage.

Its ``policy`` input is the artifact of the evaluated stage: an outputs file (JSONL/JSON records with
``instruction``, optional ``input``, ``output``), or a folder whose metadata key ``outputs`` names that file
(``outputs.jsonl`` is tried otherwise). The outputs are paired with reference outputs, judged by the recipe's
evaluation annotator (``evaluation.annotator``, else ``annotator``), and scored (see ``metrics.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, StageContext
from alpacafarm.recipe import DataSource

DEFAULT_OUTPUTS_FILE = "outputs.jsonl"


class WinRateConfig(BaseModel):
    """``evaluation.config`` of a recipe using ``evaluator: win_rate``."""

    model_config = ConfigDict(extra="forbid")

    references: DataSource | None = Field(
        default_factory=lambda: DataSource(builtin="alpaca_eval_sample"),
        description="reference outputs (output_1 of every pair); default: the bundled AlpacaEval sample")
    reference_field: str = Field("reference", description="the references' text field ('output' is the fallback)")
    max_instructions: int | None = Field(None, ge=1, description="evaluate only the first N matched instructions")


class WinRateEvaluator(Method):
    """Win-rate of the evaluated stage's outputs against reference outputs, judged by the recipe's annotator."""

    config_class = WinRateConfig
    requires = ("policy",)
    provides = "evaluation"
    annotator_role = "evaluation"
    description = "win-rate of a system's outputs against reference outputs, with standard error"

    def _outputs(self, context: StageContext) -> list[dict[str, Any]]:
        """The records of the policy artifact's outputs file."""
        artifact = context.input("policy")
        if artifact.kind == "data_source":
            return context.records("policy")
        path = Path(artifact.path) if artifact.path else None
        if path is None or not path.exists():
            raise UserError(f"stage {context.stage!r}: the evaluated stage's artifact ({artifact.kind}) has no outputs "
                            "file; generating outputs from a model lands with the training-backbone issue")
        if path.is_dir():
            if "outputs" in artifact.metadata:
                return context.records("policy", "outputs")
            if (path / DEFAULT_OUTPUTS_FILE).is_file():
                return context.records("policy", DEFAULT_OUTPUTS_FILE)
            raise UserError(f"stage {context.stage!r}: {path} is a folder without {DEFAULT_OUTPUTS_FILE} and its "
                            "artifact has no 'outputs' metadata naming the outputs file (a model folder cannot be "
                            "evaluated until generation lands with the training-backbone issue)")
        return context.records("policy")

    def run(self, context: StageContext) -> Artifact:
        """Pair, judge, score; writes annotations.json and metrics.json into the stage folder."""
        from alpacafarm_evaluation.metrics import metrics_table
        from alpacafarm_evaluation.pairing import annotate_and_score, load_references, pair_outputs

        config = self.config if isinstance(self.config, WinRateConfig) else WinRateConfig.model_validate(self.config or {})
        outputs = self._outputs(context)
        references = load_references(config.references, config.reference_field)
        policy = context.inputs["policy"]
        evaluation = context.recipe.evaluation
        stage_name = (evaluation.policy if evaluation else None) or context.recipe.stages[-1].name
        pairs, skipped = pair_outputs(outputs, references, config.max_instructions, f"policy ({policy.path})",
                                      generator=stage_name)
        if skipped["n_unmatched"] or skipped["n_extra_samples"]:
            context.logger.warning("%s: skipped %d of %d outputs without a reference instruction and %d extra samples",
                                   context.stage, skipped["n_unmatched"], len(outputs), skipped["n_extra_samples"])
        annotator = context.make_annotator("evaluation")
        try:
            metrics = annotate_and_score(pairs, annotator, context.stage_dir, skipped)
        finally:
            annotator.close()
        title = f"win-rate of {metrics.get('generator')} vs {metrics['reference']} (judge: {metrics['annotator']})"
        context.logger.info("%s: win-rate %.2f ± %.2f over %d pairs", context.stage, metrics["win_rate"] or 0.0,
                            metrics["standard_error"] or 0.0, metrics["n_total"])
        return Artifact("evaluation", str(context.stage_dir / "metrics.json"),
                        {**metrics, "table": metrics_table(metrics, title)})
