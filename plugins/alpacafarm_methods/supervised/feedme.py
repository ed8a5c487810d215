"""``binary_feedme``: supervised fine-tuning of the SFT model on the preferred output of every preference pair.

Paper Section 3.4 and Appendix A.1: OpenAI's FeedME fine-tunes on outputs that labellers rated 7/7; its pairwise
adaptation ("binary FeedME") continues supervised fine-tuning of the SFT model on the chosen response of each
pair. Pairs without a ranking (ties, unparsed annotations) are dropped and counted. The paper gives no separate
hyperparameters for it, so the defaults are those of the SFT step
(:class:`~alpacafarm_methods.supervised.sft.SFTMethodConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, Ranks, StageContext
from alpacafarm.policy_training import build_sft_trainer_on_rows, train_and_save_policy
from alpacafarm.preference_rows import preferred_demonstrations
from alpacafarm.training import limit, stage_training_args
from alpacafarm.training_rows import prompt_completion_rows
from alpacafarm_methods.supervised.sft import SFTMethodConfig


@dataclass
class FeedMEConfig(SFTMethodConfig):
    """Every ``trl.SFTConfig`` / ``TrainingArguments`` field with the SFT step's defaults (Appendix B).

    ``train_split`` names the preferences file of a ``preference_data`` stage; ``max_examples`` counts usable
    pairs (after ties and unparsed annotations are dropped); ``response_field`` is not used.
    """

    train_split: str = field(
        default="preferences", metadata={"help": "file (or named file) of the preferences input"}
    )


def build_feedme_trainer(
    config: FeedMEConfig,
    spec: Any,
    model_path: str,
    records: list[dict[str, Any]],
    *,
    callbacks: list[Any] | None = None,
) -> tuple[Any, int]:
    """A ready ``SFTTrainer`` on the preferred outputs of ``records``, and how many pairs had no preference."""
    from alpacafarm.model_loading import load_tokenizer

    demonstrations, dropped = preferred_demonstrations(records)
    rows = prompt_completion_rows(
        limit(demonstrations, config.max_examples),
        response_field="output",
        style=spec.prompt_format,
        tokenizer=load_tokenizer(spec, model_path),
    )
    if not rows:
        raise UserError(f"there is nothing to train on: none of the {len(records)} preference pairs has a usable "
                        "preference (ties and unlabelled pairs are dropped)")
    return build_sft_trainer_on_rows(config, spec, model_path, rows, callbacks=callbacks), dropped


class BinaryFeedME(Method):
    """Fine-tunes the SFT model on the chosen output of each pair; writes ``model/`` and ``metrics.json``."""

    config_class = FeedMEConfig
    requires = (ArtifactName.SFT_MODEL, ArtifactName.PREFERENCES)
    provides = ArtifactName.POLICY_MODEL
    ranks = Ranks.ALL  # TRL's trainer distributes through accelerate; the main process saves

    def run(self, context: StageContext) -> Artifact:

        spec = context.recipe.model
        args = stage_training_args(self.config, context)
        model_path = context.input("sft_model").path
        trainer, dropped = build_feedme_trainer(
            args, spec, model_path, context.records("preferences", args.train_split)
        )
        context.logger.info(
            "stage %s: binary FeedME on %d preferred outputs (%d pairs without a preference)",
            context.stage,
            len(trainer.train_dataset),
            dropped,
        )
        return train_and_save_policy(context, trainer, spec, model_path, dropped)
