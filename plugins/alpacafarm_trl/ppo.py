"""``ppo``: Proximal Policy Optimization of the SFT model against the surrogate reward model (our trainer).

The method wires the stage: the SFT model, the reward model and the unlabeled instructions go to
:func:`alpacafarm_trl.ppo_trainer.build_ppo_trainer`, training shows one progress line (PPO steps, the loss) and
resumes from the stage's last ``checkpoint-N``, and the trained policy is saved as ``model/`` with
``metrics.json`` (and the SFT folder's prompt conditioning, if it has one: the policy was trained behind it).

Where the pieces live, as in TRL: the config in :mod:`alpacafarm_trl.ppo_config`, the trainer (rollouts,
advantages, updates, checkpoints) in :mod:`alpacafarm_trl.ppo_trainer`, the model layouts (separate models, or
one LoRA base with the policy adapter, and a critic that starts as the reward model) in
:mod:`alpacafarm_trl.ppo_models`, built from the stage's folders by :mod:`alpacafarm_trl.ppo_build`, the
arithmetic in :mod:`alpacafarm_trl.ppo_core`. Trained weights are float32 master copies; the saved policy is
written in the model block's save dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alpacafarm.method import Artifact, Method, StageContext
from alpacafarm.prompts import PromptConditioning
from alpacafarm.train_progress import training_progress
from alpacafarm.training import limit, resume_checkpoint, stage_training_args
from alpacafarm_trl.ppo_config import PPOMethodConfig
from alpacafarm_trl.ppo_trainer import build_ppo_trainer


def save_trained_policy(trainer: Any, spec: Any, sft_path: str, directory: str | Path,
                        state_dict: dict[str, Any] | None) -> bool:
    """Save the trained policy through :func:`alpacafarm.training.save_trained`; returns whether adapters were
    merged. ``state_dict``: the policy's full weights (:meth:`~alpacafarm_trl.ppo_trainer.PPOTrainer.policy_state_dict`,
    gathered whole whatever the launch config)."""
    from alpacafarm.training import save_trained

    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    return save_trained(trainer.models.policy_export(policy), trainer.tokenizer, spec, sft_path, directory,
                        state_dict=state_dict)


class PPO(Method):
    """PPO of the SFT policy against the reward model on the unlabeled prompts; writes ``model/``, metrics."""

    config_class = PPOMethodConfig
    requires = ("sft_model", "reward_model", "instruction_splits")
    provides = "policy_model"
    description = ("PPO against the surrogate reward model with a per-token KL penalty to the SFT model "
                   "(our trainer)")
    #: Under several processes every rank rolls out its share of each rollout batch and the policy and critic train
    #: through one accelerate Accelerator (see :mod:`alpacafarm_trl.ppo_trainer`); the main process saves.
    all_ranks = True

    def run(self, context: StageContext) -> Artifact:
        from alpacafarm import distributed
        from alpacafarm.data import write_json

        spec = context.recipe.model
        args = stage_training_args(self.config, context)
        sft_path = context.input("sft_model").path
        reward_path = context.input("reward_model").path
        records = limit(context.records("instruction_splits", args.split), args.max_instructions)
        trainer = build_ppo_trainer(args, spec, sft_path, reward_path, records, logger=context.logger)
        context.logger.info("stage %s: PPO for %d steps of %d rollouts on %d prompts "
                            "(%d skipped as too long)", context.stage, trainer.max_steps,
                            args.rollout_batch_size, len(trainer.queries), trainer.n_skipped)
        with training_progress(trainer, context, "PPO steps"):
            result = trainer.train(resume_from_checkpoint=resume_checkpoint(context))
        model_dir = Path(context.stage_dir) / "model"
        full_state = trainer.policy_state_dict()  # every rank: gathered whole where the weights are sharded
        if not context.is_main:
            return Artifact("model", str(model_dir))
        merge = save_trained_policy(trainer, spec, sft_path, model_dir, state_dict=full_state)
        if trainer.prompt_format.conditioning != PromptConditioning():  # trained behind it: sample behind it
            trainer.prompt_format.conditioning.save(model_dir)
        steps = [e for e in trainer.state.log_history if "score" in e]
        metrics: dict[str, Any] = {
            "steps": int(trainer.state.global_step), "train_loss": round(float(result.training_loss), 6),
            "train_runtime_s": round(float(result.metrics.get("train_runtime", 0.0)), 3),
            "n_prompts": len(trainer.queries), "n_prompts_skipped": trainer.n_skipped,
            "first_score": steps[0]["score"] if steps else None,
            "final_score": steps[-1]["score"] if steps else None,
            "final_kl": steps[-1]["kl"] if steps else None, "lora": spec.lora is not None, "merged": merge,
            "world_size": distributed.world_size(),
        }
        write_json(Path(context.stage_dir) / "metrics.json",
                   {**metrics, "log_history": trainer.state.log_history})
        return Artifact("model", str(model_dir), metrics)
