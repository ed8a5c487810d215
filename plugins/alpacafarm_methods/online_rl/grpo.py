"""``grpo``: Group Relative Policy Optimization of the SFT model with TRL's GRPOTrainer (not in the paper).

Each prompt gets ``num_generations`` sampled completions; a completion's advantage is its reward minus its
group's mean (divided by the group's standard deviation, ``scale_rewards: group``), and the policy takes clipped
policy-gradient steps with a KL penalty ``beta`` to the SFT model. No value model (unlike PPO). The reward is
the recipe's reward model, rule rewards and/or the recipe's annotator asked while training (see
:mod:`alpacafarm_methods.online_rl.base` and :mod:`alpacafarm_methods.online_rl.annotator_reward`).
"""

from __future__ import annotations

from dataclasses import dataclass

from trl import GRPOConfig

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.method import Artifact, Method, Ranks, StageContext
from alpacafarm_methods.online_rl.base import OnlineRLOptions, run_online_rl


@dataclass
class GRPOMethodConfig(OnlineRLOptions, GRPOConfig):
    """Every ``trl.GRPOConfig`` / ``TrainingArguments`` field, plus the reward sources and the prompts to use.

    Defaults are TRL's except: ``beta`` 0.04 instead of TRL's 0 (DeepSeekMath's GRPO value, and TRL's former
    default): AlpacaFarm optimises a learned, over-optimisable reward model, and every RLHF method of the paper
    keeps the policy near the SFT model (PPO's KL penalty), so the reference stays on by default;
    ``max_completion_length`` 300 (the paper's models answer in under 300 tokens, as PPO's ``max_new_tokens``);
    ``logging_steps`` 1 (every step's reward goes into ``metrics.json``).
    Kept from TRL: 8 completions per prompt, learning rate 1e-6, temperature 1 (on-policy sampling), the
    ``dapo`` loss and group-scaled rewards. ``per_device_train_batch_size * gradient_accumulation_steps`` (or
    ``generation_batch_size``) must be a multiple of ``num_generations``. ``bf16`` and activation
    checkpointing are automatic; generation uses transformers (``use_vllm`` is TRL's, untested here).
    """

    beta: float = 0.04
    max_completion_length: int | None = 300


class GRPO(Method):
    """GRPO from the SFT model against the reward model and/or rules; writes ``model/`` and ``metrics.json``."""

    config_class = GRPOMethodConfig
    requires = (ArtifactName.SFT_MODEL, ArtifactName.INSTRUCTION_SPLITS)
    optional = (ArtifactName.REWARD_MODEL,)
    provides = ArtifactName.POLICY_MODEL
    #: with ``use_annotator: true`` the recipe's feedback annotator is a reward: changing the judge re-runs the stage
    annotator_role = "feedback"
    #: TRL's trainer distributes through accelerate (each rank samples and scores its share of the completions,
    #: the reward model loaded on every rank); the main process saves.
    ranks = Ranks.ALL

    def run(self, context: StageContext) -> Artifact:
        from trl import GRPOTrainer

        return run_online_rl(context, self.config, GRPOTrainer, "GRPO")
