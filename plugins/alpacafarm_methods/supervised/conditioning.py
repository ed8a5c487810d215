"""``binary_reward_conditioning``: supervised fine-tuning on both outputs of each pair, each behind a control token.

Paper Section 3.4 and Appendix A.1: for every pair, the concatenation ``[x, y_chosen]`` is prepended with a
positive control token and ``[x, y_rejected]`` with a negative one, giving a demonstration set twice the size
of the preference data; at test time the model is sampled conditioned on the positive token.

Here the token starts the whole training text, before the formatted prompt (``<good>\\n`` + prompt + response),
and only the response is trained on, as in SFT. The stage writes ``alpacafarm_generation.json`` into its
model folder (see :class:`alpacafarm.prompts.PromptConditioning`) with the positive token as
``prompt_prefix``: every later stage that generates from the folder (``generate_outputs`` with
``inputs: {sft_model: <this stage>}``, best-of-n, ...) is then conditioned on it, and since it is part of the
prompt it never appears in an output.

The control tokens are plain-text markers, not new vocabulary entries, so that:

- they need no new embedding rows (with LoRA/QLoRA new embeddings would stay untrained), and work with every
  tokenizer;
- they tokenize the same way at training and at generation time: both build the text with the same
  :meth:`~alpacafarm.prompts.PromptConditioning.apply`, the marker starts the text (nothing before it can
  merge into it) and it ends in a newline, which byte-level BPE pre-tokenizers keep apart from the next word
  and SentencePiece encodes as its own byte piece, so the marker's tokens do not depend on what follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, Ranks, StageContext
from alpacafarm.policy_training import build_sft_trainer_on_rows, train_and_save_policy
from alpacafarm.preference_rows import preference_rows
from alpacafarm.prompts import PromptConditioning
from alpacafarm.training import limit, stage_training_args
from alpacafarm_methods.supervised.sft import SFTMethodConfig

GOOD_TOKEN = "<good>"
BAD_TOKEN = "<bad>"


@dataclass
class RewardConditioningConfig(SFTMethodConfig):
    """Every ``trl.SFTConfig`` / ``TrainingArguments`` field with the SFT step's defaults, plus the control tokens.

    ``max_examples`` counts usable pairs (each gives two training examples); ``response_field`` is not used.
    """

    train_split: str = field(
        default="preferences", metadata={"help": "file (or named file) of the preferences input"}
    )
    good_token: str = field(
        default=GOOD_TOKEN, metadata={"help": "marker before the preferred output's example"}
    )
    bad_token: str = field(default=BAD_TOKEN, metadata={"help": "marker before the other output's example"})

    def __post_init__(self) -> None:
        if not self.good_token.strip() or not self.bad_token.strip():
            raise ValueError("good_token and bad_token must not be empty")
        if self.good_token == self.bad_token:
            raise ValueError("good_token and bad_token must differ")
        super().__post_init__()


def control_conditioning(token: str) -> PromptConditioning:
    """The conditioning of one control token: the token and a newline before the formatted prompt."""
    return PromptConditioning(prompt_prefix=f"{token}\n")


def conditioned_rows(
    records: list[dict[str, Any]],
    *,
    good_token: str,
    bad_token: str,
    style: str,
    tokenizer: Any,
    max_pairs: int | None = None,
) -> tuple[list[dict[str, str]], int]:
    """Preference records → two ``{"prompt", "completion"}`` rows per usable pair, and how many pairs were dropped.

    The preferred output follows the good token, the other output the bad token; completions end with EOS.
    """
    pairs, dropped = preference_rows(records, style=style, tokenizer=tokenizer)
    good, bad = control_conditioning(good_token), control_conditioning(bad_token)
    eos = tokenizer.eos_token or ""
    rows = []
    for pair in limit(pairs, max_pairs):
        for conditioning, output in ((good, pair["chosen"]), (bad, pair["rejected"])):
            rows.append(
                {
                    "prompt": conditioning.apply(pair["prompt"]),
                    "completion": output if output.endswith(eos) else output + eos,
                }
            )
    return rows, dropped


def build_conditioning_trainer(
    config: RewardConditioningConfig,
    spec: Any,
    model_path: str,
    records: list[dict[str, Any]],
    *,
    callbacks: list[Any] | None = None,
) -> tuple[Any, int]:
    """A ready ``SFTTrainer`` on the control-token rows of ``records``, and how many pairs had no preference."""
    from alpacafarm.model_loading import load_tokenizer

    rows, dropped = conditioned_rows(
        records,
        good_token=config.good_token,
        bad_token=config.bad_token,
        style=spec.prompt_format,
        tokenizer=load_tokenizer(spec, model_path),
        max_pairs=config.max_examples,
    )
    if not rows:
        raise UserError(f"there is nothing to train on: none of the {len(records)} preference pairs has a usable "
                        "preference (ties and unlabelled pairs are dropped)")
    return build_sft_trainer_on_rows(config, spec, model_path, rows, callbacks=callbacks), dropped


class BinaryRewardConditioning(Method):
    """SFT on good-token + chosen and bad-token + rejected; the saved model generates behind the good token."""

    config_class = RewardConditioningConfig
    requires = (ArtifactName.SFT_MODEL, ArtifactName.PREFERENCES)
    provides = ArtifactName.POLICY_MODEL
    ranks = Ranks.ALL  # TRL's trainer distributes through accelerate; the main process saves

    def run(self, context: StageContext) -> Artifact:

        spec = context.recipe.model
        args = stage_training_args(self.config, context)
        model_path = context.input("sft_model").path
        records = context.records("preferences", args.train_split)
        trainer, dropped = build_conditioning_trainer(args, spec, model_path, records)
        context.logger.info(
            "stage %s: binary reward conditioning on %d examples (%d pairs without a preference)",
            context.stage,
            len(trainer.train_dataset),
            dropped,
        )
        conditioning = control_conditioning(args.good_token)
        return train_and_save_policy(
            context, trainer, spec, model_path, dropped,
            extra={"good_token": args.good_token, "bad_token": args.bad_token,
                   "prompt_prefix": conditioning.prompt_prefix},
            conditioning=conditioning,
        )
