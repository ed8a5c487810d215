"""``rloo``: REINFORCE Leave-One-Out of the SFT model with TRL's RLOOTrainer (not in the paper).

Each prompt gets ``num_generations`` (k) sampled completions; a completion's baseline is the mean reward of the
other k - 1 (Ahmadian et al. 2024), and the KL to the SFT model is subtracted from the sequence reward with
coefficient ``beta`` before the baseline. No value model (unlike PPO). The reward is the recipe's reward model,
rule rewards and/or the recipe's annotator asked while training (see :mod:`alpacafarm_methods.online_rl.base` and
:mod:`alpacafarm_methods.online_rl.annotator_reward`).
"""

from __future__ import annotations

from dataclasses import dataclass

from trl import RLOOConfig

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.method import Artifact, Method, Ranks, StageContext
from alpacafarm_methods.online_rl.base import OnlineRLOptions, run_online_rl


@dataclass
class RLOOMethodConfig(OnlineRLOptions, RLOOConfig):
    """Every ``trl.RLOOConfig`` / ``TrainingArguments`` field, plus the reward sources and the prompts to use.

    Defaults are TRL's except: ``num_generations`` 4 instead of 2 (Ahmadian et al. 2024 report k = 4 ahead of
    k = 2, whose baseline is a single sample); ``max_completion_length`` 300 (the paper's models answer in under
    300 tokens, as PPO's ``max_new_tokens``); ``logging_steps`` 1 (every step's reward goes into
    ``metrics.json``). Kept from TRL: ``beta`` 0.05 (a sequence-level KL penalty in the reward, the counterpart
    of PPO's KL to the SFT model), learning rate 1e-6, temperature 1.
    ``per_device_train_batch_size * gradient_accumulation_steps`` (or ``generation_batch_size``) must be a
    multiple of ``num_generations``. ``bf16`` and activation checkpointing are automatic; generation uses
    transformers (``use_vllm`` is TRL's, untested here).
    """

    num_generations: int | None = 4
    max_completion_length: int | None = 300


class RLOO(Method):
    """RLOO from the SFT model against the reward model and/or rules; writes ``model/`` and ``metrics.json``."""

    config_class = RLOOMethodConfig
    requires = (ArtifactName.SFT_MODEL, ArtifactName.INSTRUCTION_SPLITS)
    optional = (ArtifactName.REWARD_MODEL,)
    provides = ArtifactName.POLICY_MODEL
    #: with ``use_annotator: true`` the recipe's feedback annotator is a reward: changing the judge re-runs the stage
    annotator_role = "feedback"
    #: TRL's trainer distributes through accelerate (each rank samples and scores its share of the completions,
    #: the reward model loaded on every rank); the main process saves.
    ranks = Ranks.ALL

    def run(self, context: StageContext) -> Artifact:
        from trl import RLOOTrainer

        return run_online_rl(context, self.config, RLOOTrainer, "RLOO")
