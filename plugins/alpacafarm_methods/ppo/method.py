"""``ppo``: Proximal Policy Optimization of the SFT model against the surrogate reward model (our trainer).

Read it top to bottom as the stage runs: :class:`PPO` wires the stage (the SFT model, the reward model and the
unlabeled instructions go to :func:`build_ppo_trainer`; training shows one progress line and resumes from the
stage's last ``checkpoint-N``; :class:`PolicyFolders` writes the trained policy as ``model/``, and snapshots on the
way, with :func:`alpacafarm.model_loading.save_model`, the SFT folder's prompt conditioning included: the policy was
trained behind it). Then, as in TRL, one module per concept: the config (:mod:`alpacafarm_methods.ppo.config`),
the trainer, whose loop runs rollout → advantages → update (:mod:`alpacafarm_methods.ppo.trainer`), one step's
data (:mod:`alpacafarm_methods.ppo.rollouts`), the maths in the order a step uses it
(:mod:`alpacafarm_methods.ppo.advantages`: KL-shaped rewards, whitening, GAE; :mod:`alpacafarm_methods.ppo.losses`:
the clipped losses), and the models, built from the stage's folders (:mod:`alpacafarm_methods.ppo.models`).
Trained weights are float32 master copies; the saved policy is written in the model block's save dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.method import Artifact, Method, Ranks, Snapshot, StageContext
from alpacafarm.model_loading import load_classifier, load_tokenizer, loading_whole, save_model
from alpacafarm.prompts import PromptFormat
from alpacafarm.rewards import RewardFunction, RewardScorer
from alpacafarm.training import limit, resume_checkpoint, stage_training_args
from alpacafarm.training_progress import training_progress
from alpacafarm_methods.ppo.config import PPOMethodConfig
from alpacafarm_methods.ppo.models import build_models
from alpacafarm_methods.ppo.trainer import PPOTrainer

#: the stage's folder of policy snapshots (``snapshot_steps``)
SNAPSHOTS = "snapshots"


class PPO(Method):
    """PPO of the SFT policy against the reward model on the unlabeled prompts; writes ``model/``, metrics."""

    config_class = PPOMethodConfig
    requires = (ArtifactName.SFT_MODEL, ArtifactName.REWARD_MODEL, ArtifactName.INSTRUCTION_SPLITS)
    provides = ArtifactName.POLICY_MODEL
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
        stage_dir = Path(context.stage_dir)
        folders = PolicyFolders(spec, sft_path, every=args.snapshot_steps, stage_dir=stage_dir)
        trainer = build_ppo_trainer(args, spec, sft_path, reward_path, records, logger=context.logger,
                                    callbacks=[folders])
        folders.trainer = trainer  # the trainer whose policy it writes
        context.logger.info("stage %s: PPO for %d steps of %d rollouts on %d prompts "
                            "(%d skipped as too long)", context.stage, trainer.max_steps,
                            args.rollout_batch_size, len(trainer.queries), trainer.n_skipped)
        with training_progress(trainer, context, "PPO steps"):
            result = trainer.train(resume_from_checkpoint=resume_checkpoint(context))
        model_dir, merge = folders.model, folders.merged  # written when training ended
        if not context.is_main:
            return Artifact("model", str(model_dir))
        snapshot_dirs = folders.written
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
        scores = snapshot_rewards(steps, [int(step) for step in snapshot_dirs])
        # relative to the stage folder; the final policy is model/ itself
        handed = [Snapshot(int(step), str(Path(context.stage_dir) / folder), scores.get(int(step)))
                  for step, folder in snapshot_dirs.items()]
        write_json(Path(context.stage_dir) / "metrics.json",
                   {**metrics, "snapshots": snapshot_dirs, "snapshot_scores": {s.step: s.train_reward for s in handed},
                    "log_history": trainer.state.log_history})
        return Artifact("model", str(model_dir), metrics, snapshots=handed)


def snapshot_rewards(steps: Sequence[dict[str, Any]], snapshot_steps: Sequence[int]) -> dict[int, float | None]:
    """The training reward each snapshot is shown with: the mean rollout reward (``score``) over the PPO steps since
    the snapshot before it (after step 0 for the first), so over every rollout that moved the policy there. One
    step's mean over a rollout batch of 16 is mostly noise (0.39 then 0.05 at consecutive snapshots of a run whose
    8-step means were 0.25 and 0.34); None where no logged step falls in the window."""
    scores = {int(e["step"]): float(e["score"]) for e in steps if "score" in e}
    rewards: dict[int, float | None] = {}
    previous = 0
    for step in sorted(snapshot_steps):
        window = [score for s, score in scores.items() if previous < s <= step]
        rewards[step] = sum(window) / len(window) if window else None
        previous = step
    return rewards


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

    set_seed(config.seed)  # new adapters are randomly initialised: same seed, same run
    with loading_whole():  # whole on every rank: accelerate partitions what trains when it prepares it
        models = build_models(spec, sft_path, reward_path, logger=logger,
                              gradient_checkpointing=bool(config.gradient_checkpointing),
                              value_head_init=config.value_head_init)
        if reward_fn is None:
            reward_classifier = models.reward_classifier  # scored by what the layout holds, when it holds the RM
            if reward_classifier is None:
                reward_classifier = load_classifier(spec, reward_path)  # frozen: the model block's dtype
            reward_fn = RewardScorer(reward_classifier, load_tokenizer(spec, reward_path),
                                     prompt_format=spec.prompt_format, batch_size=config.score_batch_size,
                                     ensemble=config.ensemble, ensemble_coefficient=config.ensemble_coefficient)
    tokenizer = load_tokenizer(spec, sft_path)
    prompt_format = PromptFormat.for_model(spec.prompt_format, sft_path, tokenizer)
    return PPOTrainer(config, models, tokenizer, records, reward_fn, prompt_format=prompt_format,
                      callbacks=callbacks)


class PolicyFolders(TrainerCallback):
    """The stage's policy as model folders, written by :func:`alpacafarm.model_loading.save_model` as training goes
    (a trainer callback; set :attr:`trainer` once the trainer exists): a snapshot every ``every`` PPO steps as
    ``snapshots/step-<N>/`` (not at the last step), and the trained policy as ``model/`` when training ends. Each
    folder holds the prompt conditioning the policy was trained behind. A resumed stage keeps the snapshots written
    before the kill. Every rank writes (the weights are gathered whole); the main process writes the files."""

    def __init__(self, spec: Any, sft_path: str, *, every: int | None, stage_dir: Path) -> None:
        super().__init__()
        self.spec, self.sft_path, self.every = spec, sft_path, every
        self.folder, self.model = stage_dir / SNAPSHOTS, stage_dir / "model"
        self.trainer: PPOTrainer | None = None
        self.merged = False  # whether model/ holds adapters merged into full weights
        #: once training ended, ``{step: folder relative to the stage folder}`` of every whole snapshot, by step,
        #: the final policy (``model/``) under the last step; empty without snapshots
        self.written: dict[str, str] = {}

    def write(self, directory: Path) -> bool:
        """The policy as it is now, as a model folder at ``directory``; returns whether adapters were merged."""
        trainer = self.trainer
        if trainer is None:
            raise RuntimeError("PolicyFolders.trainer is not set")
        return save_model(trainer.policy, trainer.tokenizer, directory, self.spec, start_from=self.sft_path,
                          state_dict=trainer.policy_state_dict(), conditioning=trainer.prompt_format.conditioning)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.every and state.global_step % self.every == 0 and state.global_step < state.max_steps:
            self.write(self.folder / f"step-{state.global_step}")
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.merged = self.write(self.model)
        if self.every:
            found = {int(p.name.removeprefix("step-")): f"{SNAPSHOTS}/{p.name}" for p in self.folder.glob("step-*")
                     if p.is_dir() and not p.name.endswith(".partial") and (p / "config.json").is_file()}
            self.written = {str(step): found[step] for step in sorted(found)} | {str(state.global_step): "model"}
        return control
