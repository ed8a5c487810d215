"""``ppo``: Proximal Policy Optimization of the SFT model against the surrogate reward model (our trainer).

The method wires the stage: the SFT model, the reward model and the unlabeled instructions go to
:func:`build_ppo_trainer`, training shows one progress line (PPO steps, the loss) and
resumes from the stage's last ``checkpoint-N``, and the trained policy is saved as ``model/`` with
``metrics.json`` (and the SFT folder's prompt conditioning, if it has one: the policy was trained behind it).

Where the pieces live, as in TRL: the config in :mod:`alpacafarm_methods.ppo.config`, the trainer (rollouts,
advantages, updates, checkpoints) in :mod:`alpacafarm_methods.ppo.trainer`, the model layouts (separate models, or
one LoRA base with the policy adapter, and a critic that starts as the reward model) in
:mod:`alpacafarm_methods.ppo.models`, built from the stage's folders by :mod:`alpacafarm_methods.ppo.build`, the
arithmetic in :mod:`alpacafarm_methods.ppo.core`. Trained weights are float32 master copies; the saved policy is
written in the model block's save dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from alpacafarm.method import Artifact, Method, Ranks, StageContext
from alpacafarm.model_loading import loading_whole
from alpacafarm.prompts import PromptConditioning, PromptFormat
from alpacafarm.rewards import RewardFunction
from alpacafarm.training import limit, resume_checkpoint, stage_training_args
from alpacafarm.training_progress import training_progress
from alpacafarm_methods.ppo.build import build_models
from alpacafarm_methods.ppo.config import PPOMethodConfig
from alpacafarm_methods.ppo.trainer import PPOTrainer


def save_trained_policy(trainer: Any, spec: Any, sft_path: str, directory: str | Path,
                        state_dict: dict[str, Any] | None) -> bool:
    """Save the trained policy through :func:`alpacafarm.training.save_trained`; returns whether adapters were
    merged. ``state_dict``: the policy's full weights
    (:meth:`~alpacafarm_methods.ppo.trainer.PPOTrainer.policy_state_dict`,
    gathered whole whatever the launch config)."""
    from alpacafarm.training import save_trained

    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    return save_trained(trainer.models.policy_export(policy), trainer.tokenizer, spec, sft_path, directory,
                        state_dict=state_dict)


#: the stage's folder of policy snapshots (``snapshot_steps``)
SNAPSHOTS = "snapshots"


def save_policy_folder(trainer: Any, spec: Any, sft_path: str, directory: Path, is_main: bool) -> None:
    """The policy as it is now, as a model folder at ``directory`` (written under a temporary name and renamed when
    whole). Call on every rank: sharded weights are gathered; the main process writes."""
    import shutil

    full_state = trainer.policy_state_dict()
    if not is_main:
        return
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    save_trained_policy(trainer, spec, sft_path, partial, state_dict=full_state)
    if trainer.prompt_format.conditioning != PromptConditioning():
        trainer.prompt_format.conditioning.save(partial)
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)


class PolicySnapshots(TrainerCallback):
    """A trainer callback that saves the policy every ``every`` PPO steps as ``<folder>/step-<N>/`` (not at the
    last step: that one is the stage's ``model/``). A resumed stage keeps the snapshots written before the kill."""

    def __init__(self, every: int | None, folder: Path) -> None:
        super().__init__()
        self.every, self.folder = every, folder
        self.save: Any = None  # set once the trainer exists: save(directory)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.every and state.global_step % self.every == 0 and state.global_step < state.max_steps:
            self.save(self.folder / f"step-{state.global_step}")
        return control

    def listed(self, final_step: int) -> dict[str, str]:
        """``{step: folder relative to the stage folder}`` of every whole snapshot, by step; the final policy
        (``model/``) under ``final_step``."""
        if not self.every:
            return {}
        found = {int(p.name.removeprefix("step-")): f"{SNAPSHOTS}/{p.name}" for p in self.folder.glob("step-*")
                 if p.is_dir() and not p.name.endswith(".partial") and (p / "config.json").is_file()}
        return {str(step): found[step] for step in sorted(found)} | {str(final_step): "model"}


def build_ppo_trainer(config: PPOMethodConfig, spec: Any, sft_path: str, reward_path: str,
                      records: Sequence[dict[str, Any]], *, reward_fn: RewardFunction | None = None,
                      callbacks: Sequence[Any] | None = None, logger: Any = None) -> PPOTrainer:
    """A ready :class:`PPOTrainer` from the recipe's model block, the SFT model and the reward model folders.

    ``config`` must carry its final ``output_dir`` (see :func:`~alpacafarm.training.stage_training_args`).
    Prompts are written for the SFT folder (its ``prompt_format`` and conditioning file, see
    :meth:`alpacafarm.prompts.PromptFormat.for_model`). Without ``reward_fn`` the reward is the reward model's
    score (an :class:`~alpacafarm.rewards.RewardScorer`), run by the reward model the layout already holds when it
    holds one (the critic's backbone with its adapter off), else loaded frozen on every rank.
    """
    from transformers import set_seed

    from alpacafarm.model_loading import load_classifier, load_tokenizer
    from alpacafarm.rewards import RewardScorer

    set_seed(config.seed)  # new adapters are randomly initialised: same seed, same run
    tokenizer = load_tokenizer(spec, sft_path)
    with loading_whole():  # whole on every rank: accelerate partitions what trains when it prepares it
        models = build_models(spec, sft_path, reward_path, logger=logger,
                              gradient_checkpointing=bool(config.gradient_checkpointing),
                              value_head_init=config.value_head_init)
        if reward_fn is None:
            reward_classifier = models.reward_model()  # scored by what the layout holds, when it holds the RM
            if reward_classifier is None:
                reward_classifier = load_classifier(spec, reward_path)  # frozen: the model block's dtype
            reward_fn = RewardScorer(reward_classifier, load_tokenizer(spec, reward_path),
                                     prompt_format=spec.prompt_format, batch_size=config.score_batch_size,
                                     ensemble=config.ensemble, ensemble_coefficient=config.ensemble_coefficient)
    prompt_format = PromptFormat.for_model(spec.prompt_format, sft_path, tokenizer)
    return PPOTrainer(config, models, tokenizer, records, reward_fn, prompt_format=prompt_format,
                      callbacks=callbacks)


class PPO(Method):
    """PPO of the SFT policy against the reward model on the unlabeled prompts; writes ``model/``, metrics."""

    config_class = PPOMethodConfig
    requires = ("sft_model", "reward_model", "instruction_splits")
    provides = "policy_model"
    description = ("PPO against the surrogate reward model with a per-token KL penalty to the SFT model "
                   "(our trainer)")
    #: Under several processes every rank rolls out its share of each rollout batch and the policy and critic train
    #: through one accelerate Accelerator (see :mod:`alpacafarm_methods.ppo.trainer`); the main process saves.
    ranks = Ranks.ALL

    def run(self, context: StageContext) -> Artifact:
        from alpacafarm import distributed
        from alpacafarm.data import write_json

        spec = context.recipe.model
        args = stage_training_args(self.config, context)
        sft_path = context.input("sft_model").path
        reward_path = context.input("reward_model").path
        records = limit(context.records("instruction_splits", args.split), args.max_instructions)
        snapshots = PolicySnapshots(args.snapshot_steps, Path(context.stage_dir) / SNAPSHOTS)
        trainer = build_ppo_trainer(args, spec, sft_path, reward_path, records, logger=context.logger,
                                    callbacks=[snapshots] if args.snapshot_steps else None)
        snapshots.save = lambda directory: save_policy_folder(trainer, spec, sft_path, directory,
                                                              context.is_main)
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
        snapshot_dirs = snapshots.listed(int(trainer.state.global_step))
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
        if snapshot_dirs:  # relative to the stage folder; the final policy is model/ itself
            scores = {str(e["step"]): e["score"] for e in steps}  # the rollouts' mean reward at each step
            metrics["snapshots"] = snapshot_dirs
            metrics["snapshot_scores"] = {step: scores.get(step) for step in snapshot_dirs}
        write_json(Path(context.stage_dir) / "metrics.json",
                   {**metrics, "log_history": trainer.state.log_history})
        return Artifact("model", str(model_dir), metrics)
