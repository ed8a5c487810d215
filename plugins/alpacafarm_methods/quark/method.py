"""``quark``: the best-quantile variant of Quark that AlpacaFarm evaluates (paper Section 3.4, A.2, B.2).

Each round (a "Quark step" in the paper):

1. take the round's prompts from the training instructions (a seeded order, cycled: ``prompts_per_round`` at
   a time, the paper's rollout batch of 512) and sample ``rollouts_per_prompt`` responses each from the
   *current* policy, behind the SFT folder's prompt conditioning if it has one;
2. score every rollout with the surrogate reward model (``context.reward_function``, a
   :class:`alpacafarm.rewards.RewardScorer`);
3. keep the top ``top_quantile`` of the pool by reward, rounded down (the best of the released run's 4 bins:
   128 of 512; the other bins are not trained on). ``quantile_scope: instruction`` (ours, not released) cuts
   each instruction's rollouts instead: the pool-wide cut, under a reward whose variance lies mostly between
   instructions (the gold world's: ~80%), keeps mostly answers to prompts that score high whatever is answered;
4. take ``steps_per_round`` optimizer steps (released: 1) on the kept samples, each on ``step_batch_size``
   examples (released: 256) drawn by cycling through them in a seeded shuffled order, with
   ``NLL + kl_coef * KL(policy || reference)``, the reference being the SFT model and the KL the exact
   per-token divergence of the two next-token distributions at each response position of the kept samples,
   averaged over response tokens;
5. discard the pool: the next round samples a fresh one (the paper's change to Quark, B.2: constant cost per
   round).

Quark's control tokens play no part in the best-quantile variant (only one bin is trained on, so there is
nothing to condition on) and, following B.2, there is no entropy term. The optimizer and the learning-rate
schedule span the whole run (the peak rate decays linearly to 0 over all rounds), not one round.

The policy trains on float32 master weights (full fine-tuning loads it in float32; LoRA adapters are cast to
float32 on a base kept in the model block's ``dtype``); the frozen reference keeps ``dtype``. The saved model
is written in the block's save dtype (:func:`alpacafarm.model_loading.save_dtype`).

With ``lora:`` in the model block the policy is the SFT model plus fresh LoRA adapters and the reference is
the same network with the adapters switched off (``with model.disable_adapter():``): there is no second copy
of the model. Without LoRA a frozen copy of the SFT model is the reference.

Where the pieces live, as in TRL: the config in :mod:`alpacafarm_methods.quark.config`, the trainer (the rounds in one
training loop on one accelerate Accelerator, like PPO's) in :mod:`alpacafarm_methods.quark.trainer`; this module
loads the models, runs the trainer and saves what it trained.

Files: ``round_<r>/pool.jsonl`` (every rollout of round ``r``, 1-based, with its reward and whether it was
kept), ``checkpoint-<step>/`` every ``save_rounds`` rounds (``accelerator.save_state`` and ``trainer_state.json``; the
newest ``save_total_limit`` kept; a killed stage re-run by the pipeline resumes after the newest readable one, see
:class:`alpacafarm_methods.quark.trainer.QuarkTrainer`), ``metrics.json`` (per-round statistics, the trainer's step
log and the round a resumed attempt started after) and ``model/`` (with the SFT folder's prompt conditioning file,
if it had one: the policy was trained behind it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, Ranks, StageContext
from alpacafarm.prompts import PromptFormat
from alpacafarm.training import resume_checkpoint, stage_training_args
from alpacafarm.training_progress import training_progress
from alpacafarm_methods.quark.config import QuarkMethodConfig
from alpacafarm_methods.quark.trainer import build_quark_trainer

#: A round's timings (seconds) in its statistics.
SECONDS = ("rollout_seconds", "score_seconds", "train_seconds")


def load_policy_and_reference(spec: Any, sft_path: str, args: QuarkMethodConfig) -> tuple[Any, Any, bool]:
    """``(policy, reference or None, sft_was_adapters)`` for the recipe's model block.

    Full fine-tuning: the policy (float32 master weights) and a second, frozen copy of the SFT model in the
    block's ``dtype``. LoRA/QLoRA: the SFT model with new trainable adapters (float32), and no reference model
    (the trainer disables the adapters to get the reference). An SFT adapter folder is merged into its base
    first (:func:`alpacafarm.model_loading.load_merged_causal_lm`).
    """
    from alpacafarm.model_loading import is_adapter_folder, load_merged_causal_lm, lora_config
    from alpacafarm.training import fp32_master_weights

    if spec.quantization is not None and spec.lora is None:
        raise UserError(f"quark: quantization: {spec.quantization} trains adapters only; add lora: to the "
                        "model block")
    from_adapters = is_adapter_folder(sft_path)
    policy = load_merged_causal_lm(spec, sft_path, trainable=True)
    if spec.lora is None:
        fp32_master_weights(policy)
        return policy, load_merged_causal_lm(spec, sft_path), from_adapters
    from peft import get_peft_model, prepare_model_for_kbit_training

    if spec.quantization is not None:
        policy = prepare_model_for_kbit_training(
            policy, use_gradient_checkpointing=bool(args.gradient_checkpointing))
    elif args.gradient_checkpointing:
        # Frozen embeddings: checkpointed blocks need an input that carries a gradient.
        policy.enable_input_require_grads()
    policy = get_peft_model(policy, lora_config(spec))
    fp32_master_weights(policy)  # after peft wrapping, before the trainer builds the optimizer
    return policy, None, from_adapters


class Quark(Method):
    """Quark (best quantile, fresh pool per round) against the surrogate reward model; writes ``model/``."""

    config_class = QuarkMethodConfig
    requires = (ArtifactName.SFT_MODEL, ArtifactName.REWARD_MODEL, ArtifactName.INSTRUCTION_SPLITS)
    provides = ArtifactName.POLICY_MODEL
    #: Under several processes every rank samples a share of the pool's batches (gathered), scores a share, and
    #: trains (the trainer through accelerate); the main process writes (see ``run_rounds``).
    ranks = Ranks.ALL
    description = ("Quark, best-quantile variant: sample, score with the reward model, train on the top "
                   "quantile + KL")

    def run(self, context: StageContext) -> Artifact:
        from alpacafarm.data import write_json
        from alpacafarm.model_loading import load_tokenizer, loading_whole, save_model

        spec = context.recipe.model
        save_strategy = getattr(self.config.save_strategy, "value", self.config.save_strategy)
        if save_strategy != "no":
            context.logger.warning("stage %s: save_strategy %r ignored; Quark writes checkpoint-<step> every "
                                   "save_rounds rounds (%d)", context.stage, save_strategy, self.config.save_rounds)
        args = stage_training_args(self.config, context, save_strategy="no")
        records = context.records("instruction_splits", args.split)[: args.max_instructions]
        if not records:
            raise UserError(f"stage {context.stage}: the instruction split {args.split!r} is empty")
        sft_path = context.input("sft_model").path
        tokenizer = load_tokenizer(spec, sft_path)
        prompt_format = PromptFormat.for_model(spec.prompt_format, sft_path, tokenizer)
        with loading_whole():  # whole on every rank: accelerate partitions what trains when it prepares it
            policy, reference, _ = load_policy_and_reference(spec, sft_path, args)
        reward = context.reward_function(batch_size=args.score_batch_size, ensemble=args.ensemble,
                                         ensemble_coefficient=args.ensemble_coefficient)

        trainer = build_quark_trainer(args, policy, tokenizer, records, reward, ref_model=reference,
                                      prompt_format=prompt_format)
        context.logger.info("stage %s: Quark for %d rounds on %d instructions (%s reference)", context.stage,
                            args.rounds, len(records),
                            "adapter-disabled" if reference is None else "frozen copy")
        resume = resume_checkpoint(context)  # the last round checkpoint an interrupted attempt left
        with training_progress(trainer, context, "training (Quark)"):
            trainer.train(resume_from_checkpoint=resume)
        rounds = trainer.round_stats

        tokenizer.padding_side = "right"
        model_dir = Path(context.stage_dir) / "model"
        # every rank (the weights a launch config shards are gathered whole); the main process writes, with the
        # prompt conditioning the policy was trained behind
        merge = save_model(trainer.policy, tokenizer, model_dir, spec, start_from=sft_path,
                           state_dict=trainer.policy_state_dict(), conditioning=prompt_format.conditioning,
                           logger=context.logger)
        if not context.is_main:
            return Artifact("model", str(model_dir))
        first, last = rounds[0], rounds[-1]
        metrics = {
            "rounds": len(rounds), "n_instructions": len(records), "pool_size": first["n_pool"],
            "kept_per_round": first["n_kept"], "trained_per_round": first["n_trained"],
            "reward_mean_first": first["reward_mean"],
            "reward_mean_last": last["reward_mean"], "reward_kept_mean_last": last["reward_kept_mean"],
            "kl_last": last["kl"], "train_loss_last": last["train_loss"],
            "steps": int(trainer.state.global_step), "lora": spec.lora is not None, "merged": merge,
            "reference": "adapter_disabled" if reference is None else "frozen_copy",
            "seconds": round(sum(s[k] for s in rounds for k in SECONDS), 3),
            "resumed_after_round": int(Path(resume).name.split("-")[1]) // args.steps_per_round if resume else None,
        }
        per_round = [{k: v for k, v in s.items() if k != "step"} for s in rounds]
        log_history = [entry for entry in trainer.state.log_history if "n_pool" not in entry]
        write_json(Path(context.stage_dir) / "metrics.json",
                   {**metrics, "per_round": per_round, "log_history": log_history})
        return Artifact("model", str(model_dir), metrics)
