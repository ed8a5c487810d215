"""The PPO trainer: Proximal Policy Optimization against a reward function, TRL-style, of our own.

TRL no longer ships a PPO trainer, so this module implements the AlpacaFarm variant (paper Section 3.4,
Appendices A.2 and B.1) from the algorithm:

* each PPO step samples a rollout batch of responses from the policy on the unlabeled instructions with the
  one core sampler (:func:`alpacafarm.sampling.sample`: temperature sampling, left-padded prompts), the
  prompts written by :class:`alpacafarm.prompts.PromptFormat` for the SFT model folder (so a folder trained
  behind a control token, such as reward conditioning's ``<good>``, is sampled behind it);
* the reward of a response is the reward function's score (the reward model's, an
  :class:`alpacafarm.rewards.RewardScorer`) on its last token minus a per-token KL penalty
  ``kl_coef * max(log p_policy - log p_SFT, 0)`` (a fixed coefficient: 0.002 for simulated feedback, 0.02 for
  human feedback; clamped at zero as in the released implementation, ``kl_penalty: k1`` for the plain
  estimate);
* the shaped per-token rewards are whitened over the rollout batch, their mean kept (``whiten_rewards``, the
  released implementation); advantages come from GAE with ``gamma = lambda = 1`` and are whitened over the
  whole rollout batch (not per mini-batch, the paper's first modification); the value model starts as the
  reward model in every model layout (its second);
* the policy and the value model then take ``ppo_epochs`` passes of clipped-loss updates over mini-batches.

Under several processes (``--num-processes N``) every rank holds the whole models, samples its generation batches
(the responses one process samples), and scores and evaluates its share of the rollouts; whitening and logged
means are over the whole batch, gradients are summed across ranks: one process's step. The main process saves.
Launched with an FSDP2 accelerate config the policy and value model are sharded across the ranks instead of copied
(:mod:`alpacafarm_trl.ppo_sharding`: the same step, its gradients reduce-scattered as sums); with a DeepSpeed
ZeRO-2/3 config they train through one DeepSpeed engine (:mod:`alpacafarm_trl.ppo_zero`, the same step again).

The models come in two layouts (:mod:`alpacafarm_trl.ppo_models`, built by :mod:`alpacafarm_trl.ppo_build`):
separate policy, reference and value models, or with ``lora:`` (and optionally ``quantization: 4bit``) ONE base
carrying the ``policy`` adapter (and the critic's, when the reward model is LoRA adapters on that base). The
trainer follows ``transformers.Trainer``'s conventions: a ``TrainingArguments`` subclass for its config
(:mod:`alpacafarm_trl.ppo_config`), ``TrainerState``/``log_history``, ``TrainerCallback`` events
(``on_step_end``, ``on_log``, ``on_save``, ...), ``checkpoint-N`` folders every ``save_steps`` and
``train(resume_from_checkpoint=...)``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from alpacafarm.errors import UserError
from alpacafarm.modeling import loading_whole
from alpacafarm.prompts import PromptFormat
from alpacafarm.rewards import RewardFunction
from alpacafarm.sampling import Sample, sample, stop_token_ids, tokenize_prompts
from alpacafarm.seeding import stable_seed
from alpacafarm_trl import ppo_checkpoint, ppo_core, ppo_sharding
from alpacafarm_trl.ppo_build import build_models
from alpacafarm_trl.ppo_config import PPOMethodConfig
from alpacafarm_trl.ppo_core import Rollouts, collate
from alpacafarm_trl.ppo_models import PolicyAndValue
from alpacafarm_trl.ppo_zero import zero_sharding

#: Keys of every per-step log entry (besides ``step``), in the order they are documented. ``kl`` is the sampled
#: KL of a response from the reference (sum of ``log p - log p_ref`` over its tokens), ``penalized_kl`` the
#: sum the penalty was charged on (per token clamped at zero with ``kl_penalty: clamped``), ``non_score_reward``
#: the penalty applied (``-kl_coef * penalized_kl``) and ``reward`` the score plus it (before whitening); all
#: are means over the rollouts of the logging window.
LOG_KEYS = (
    "score", "reward", "kl", "penalized_kl", "non_score_reward", "entropy", "response_length", "eos_fraction",
    "policy_loss", "value_loss", "loss", "clip_fraction", "value_clip_fraction", "approx_kl",
    "value_mean", "return_mean", "grad_norm", "rollout_time", "update_time",
    "learning_rate", "epoch",
)


class PPOTrainer:
    """PPO on prompt records with a reward function; checkpoints and callbacks like ``transformers.Trainer``.

    ``reward_fn(records, completions)`` (an :data:`alpacafarm.rewards.RewardFunction`) returns one score per
    completion; the method passes the reward model (an :class:`~alpacafarm.rewards.RewardScorer`), tests may
    pass any callable. ``prompt_format`` writes the prompts: a :class:`~alpacafarm.prompts.PromptFormat` (with
    the SFT folder's conditioning, see :func:`build_ppo_trainer`) or a style name (no conditioning).
    """

    def __init__(self, args: PPOMethodConfig, models: PolicyAndValue, tokenizer: Any,
                 records: Sequence[dict[str, Any]], reward_fn: RewardFunction, *,
                 prompt_format: PromptFormat | str = "alpaca",
                 callbacks: Sequence[Any] | None = None) -> None:
        from transformers import get_scheduler
        from transformers.integrations import get_reporting_integration_callbacks
        from transformers.trainer_callback import (
            CallbackHandler,
            DefaultFlowCallback,
            TrainerControl,
            TrainerState,
        )

        self.args = args
        self.models = models
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = stop_token_ids(models.policy_module, tokenizer)
        if isinstance(prompt_format, str):
            prompt_format = PromptFormat(prompt_format, tokenizer)
        self.prompt_format = prompt_format
        self.records, self.queries, self.n_skipped = self._tokenize_prompts(records)

        self.max_steps = self._max_steps()
        self._check_processes()
        # An FSDP2 or ZeRO-2/3 launch config: the policy and value model sharded
        self.sharding = zero_sharding(models) or ppo_sharding.shard_models(models)
        self.updates_per_step = args.ppo_epochs * (args.rollout_batch_size // args.mini_batch_size)
        self.params = models.trainable_parameters()
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=args.learning_rate,
                                           betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                           weight_decay=args.weight_decay)
        self.sharding.prepare(self.optimizer, args)  # DeepSpeed: one engine over the policy and value model
        total_updates = self.max_steps * self.updates_per_step
        self.lr_scheduler = get_scheduler(args.lr_scheduler_type, self.optimizer,
                                          num_warmup_steps=args.get_warmup_steps(total_updates),
                                          num_training_steps=total_updates,
                                          scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})
        self.state = TrainerState(max_steps=self.max_steps, logging_steps=self._interval(args.logging_steps),
                                  save_steps=self._interval(args.save_steps),
                                  num_train_epochs=math.ceil(self._passes()),
                                  train_batch_size=args.rollout_batch_size)
        self.control = TrainerControl()
        reporting = get_reporting_integration_callbacks(args.report_to)
        handlers = [DefaultFlowCallback, *reporting, *(callbacks or [])]
        self.callback_handler = CallbackHandler(handlers, models.policy_module, tokenizer, self.optimizer,
                                                self.lr_scheduler)
        self.control = self.callback_handler.on_init_end(args, self.state, self.control)

    # ---------------------------------------------------------------- setup helpers

    def add_callback(self, callback: Any) -> None:
        self.callback_handler.add_callback(callback)

    def _tokenize_prompts(self, records: Sequence[dict[str, Any]]) -> tuple[list[dict], list[list[int]], int]:
        for record in records:
            if not record.get("instruction"):
                raise UserError(f"a PPO prompt record has no 'instruction' "
                                f"(fields: {', '.join(sorted(record))})")
        encoded = tokenize_prompts(self.tokenizer, self.prompt_format.records(records))
        kept, queries, skipped = [], [], 0
        for record, ids in zip(records, encoded, strict=True):
            if self.args.max_prompt_length is not None and len(ids) > self.args.max_prompt_length:
                skipped += 1
                continue
            kept.append(dict(record))
            queries.append(ids)
        if not kept:
            raise UserError(f"no PPO prompts left ({len(records)} given, {skipped} longer than "
                            "max_prompt_length)")
        return kept, queries, skipped

    def _check_processes(self) -> None:
        from alpacafarm.distributed import world_size

        if self.args.rollout_batch_size < world_size():
            raise UserError(f"ppo: rollout_batch_size {self.args.rollout_batch_size} is smaller than the "
                            f"{world_size()} processes (each rolls out a share of it)")

    def _passes(self) -> float:
        return self.max_steps * self.args.rollout_batch_size / len(self.queries)

    def _max_steps(self) -> int:
        args = self.args
        if args.max_steps and args.max_steps > 0:
            return int(args.max_steps)
        episodes = args.total_episodes or args.num_train_epochs * len(self.queries)
        return max(1, int(episodes // args.rollout_batch_size))

    def _interval(self, value: float) -> int:
        return max(1, math.ceil(self.max_steps * value)) if value < 1 else int(value)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.args.bf16 and self.models.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def prompt_indices(self, step: int) -> list[int]:
        """The prompts of PPO step ``step`` (0-based): seeded shuffles of the prompt set, one per pass.

        A function of the step alone, so a resumed run samples exactly what the interrupted one would have.
        """
        n, size = len(self.queries), self.args.rollout_batch_size
        indices: list[int] = []
        permutations: dict[int, list[int]] = {}
        for position in range(step * size, (step + 1) * size):
            epoch = position // n
            if epoch not in permutations:
                generator = torch.Generator().manual_seed(stable_seed(self.args.seed, "ppo-prompts", epoch))
                permutations[epoch] = torch.randperm(n, generator=generator).tolist()
            indices.append(permutations[epoch][position % n])
        return indices

    # ---------------------------------------------------------------- rollout

    def _micro_batches(self, indices: Sequence[int], lengths: Sequence[int]) -> Iterator[list[int]]:
        size = self.args.per_device_train_batch_size
        ordered = sorted(indices, key=lambda i: -lengths[i])  # similar lengths together: less padding
        for start in range(0, len(ordered), size):
            yield ordered[start:start + size]

    def sample_step(self, step: int) -> tuple[list[dict[str, Any]], list[Sample], list[int]]:
        """This rank's records of step ``step``, one response to each sampled from the policy as it is now,
        and their positions in the step's whole rollout batch (all of it, in order, for one process).

        Seeded by the step (and, inside the sampler, by the batch), so a resumed run samples the same. The
        generation batches are split across ranks and gathered (:func:`~alpacafarm.sampling.sharded_across_ranks`:
        the responses one process samples); each rank keeps a contiguous share of the rollout batch.
        """
        from alpacafarm import distributed
        from alpacafarm.sampling import sharded_across_ranks

        args = self.args
        indices = self.prompt_indices(step)
        with self._autocast(), sharded_across_ranks():
            samples = sample(self.models.policy_module, self.tokenizer, [self.queries[i] for i in indices],
                             n=1, temperature=args.temperature, top_p=1.0, max_new_tokens=args.max_new_tokens,
                             batch_size=args.generation_batch_size,
                             seed=stable_seed(args.seed, "ppo-rollout", step), stop_ids=self.eos_ids,
                             generate=self.models.generate)
        positions = distributed.shard_indices(len(indices))
        return [self.records[indices[p]] for p in positions], [samples[p][0] for p in positions], positions

    @torch.no_grad()
    def rollout(self, step: int) -> Rollouts:
        """Sample, score and evaluate one rollout batch (no gradients)."""
        args = self.args
        self.models.set_training(False)
        records, samples, positions = self.sample_step(step)
        texts = [s.text for s in samples]
        scores = torch.tensor([float(s) for s in self.reward_fn(records, texts)], dtype=torch.float32)
        if len(scores) != len(texts):
            raise ValueError(f"the reward function returned {len(scores)} scores for {len(texts)} "
                             "completions")

        queries, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
        n, width = len(responses), max(len(r) for r in responses)
        mask = torch.zeros(n, width)
        logprobs, ref_logprobs, values, entropy = (torch.zeros(n, width) for _ in range(4))
        lengths = [len(q) + len(r) for q, r in zip(queries, responses, strict=True)]
        with self._autocast():
            for chunk in self._micro_batches(range(n), lengths):
                batch = collate([queries[i] for i in chunk], [responses[i] for i in chunk], self.pad_id,
                                self.models.device)
                tokens = batch.response_ids
                logits = self.models.policy_logits(batch).float() / args.temperature
                policy_lp = ppo_core.logprobs_of(logits, tokens)
                chunk_entropy = ppo_core.entropy_of(logits)
                del logits
                ref_logits = self.models.reference_logits(batch).float() / args.temperature
                ref_lp = ppo_core.logprobs_of(ref_logits, tokens)
                del ref_logits
                chunk_values = self.models.values(batch)
                r = tokens.shape[1]
                for j, i in enumerate(chunk):
                    mask[i, :r] = batch.response_mask[j].cpu()
                    logprobs[i, :r] = policy_lp[j].cpu()
                    ref_logprobs[i, :r] = ref_lp[j].cpu()
                    values[i, :r] = chunk_values[j].cpu()
                    entropy[i, :r] = chunk_entropy[j].cpu()
        return Rollouts(records, samples, scores, mask, logprobs * mask, ref_logprobs * mask, values * mask,
                        entropy * mask, positions=positions)

    def compute_advantages(self, rollouts: Rollouts) -> Rollouts:
        """Scores → shaped per-token rewards → GAE advantages (whitened over the batch) and returns."""
        args = self.args
        scores = rollouts.scores.clone()
        if args.missing_eos_penalty is not None:
            scores -= args.missing_eos_penalty * (1.0 - torch.tensor(rollouts.ended, dtype=torch.float32))
        scores = scores * args.reward_scale
        if args.reward_clip is not None:
            scores = scores.clamp(-args.reward_clip, args.reward_clip)
        rewards, kl, penalized_kl = ppo_core.kl_penalized_rewards(
            scores, rollouts.logprobs, rollouts.ref_logprobs, rollouts.mask, args.kl_coef, penalty=args.kl_penalty)
        advantages, returns = ppo_core.advantages_and_returns(
            rewards, rollouts.values, rollouts.mask, response_length=args.max_new_tokens, gamma=args.gamma,
            lam=args.lam, whiten_rewards=args.whiten_rewards)
        rollouts.rewards, rollouts.kl, rollouts.penalized_kl, rollouts.returns = rewards, kl, penalized_kl, returns
        rollouts.advantages = ppo_core.masked_whiten(advantages, rollouts.mask)
        return rollouts

    # ---------------------------------------------------------------- update

    def update(self, rollouts: Rollouts, step: int) -> dict[str, float]:
        """``ppo_epochs`` passes of clipped policy and value updates over shuffled mini-batches of the whole
        rollout batch (one permutation; each rank backpropagates the rows it holds, over the mini-batch's token
        count on all ranks, and gradients are summed across ranks before clipping: one process's update)."""
        args = self.args
        self.models.set_training(True)
        device = self.models.device
        queries, responses = rollouts.queries, rollouts.responses
        local_of = {p: i for i, p in enumerate(rollouts.positions or range(len(responses)))}
        n = int(ppo_core.sum_across_ranks({"n": float(len(responses))})["n"])
        lengths = [len(q) + len(r) for q, r in zip(queries, responses, strict=True)]
        generator = torch.Generator().manual_seed(stable_seed(args.seed, "ppo-minibatches", step))
        sums = dict.fromkeys(("policy_loss", "value_loss", "clip_fraction", "value_clip_fraction",
                              "approx_kl", "tokens_seen"), 0.0)
        grad_norms = []
        params = list(self.params.values())
        for _ in range(args.ppo_epochs):
            order = torch.randperm(n, generator=generator).tolist()
            for start in range(0, n, args.mini_batch_size):
                mini = [local_of[p] for p in order[start:start + args.mini_batch_size] if p in local_of]
                n_tokens = torch.tensor(ppo_core.sum_across_ranks({"tokens": float(rollouts.mask[mini].sum())})[
                    "tokens"], dtype=torch.float32).clamp(min=1).to(device)
                self.sharding.zero_grad(self.optimizer)
                for chunk in self.sharding.even(self._micro_batches(mini, lengths), mini[0] if mini else 0):
                    batch = collate([queries[i] for i in chunk], [responses[i] for i in chunk], self.pad_id,
                                    device)
                    if isinstance(chunk, ppo_sharding.Padding):  # keeps sharded collectives in step: no tokens
                        batch.response_mask.zero_()
                    r = batch.response_ids.shape[1]
                    pick = (lambda t, c=chunk, width=r: t[c, :width].to(device))  # noqa: E731
                    mask = batch.response_mask
                    with self._autocast():
                        logits = self.models.policy_logits(batch)
                    new_logprobs = ppo_core.logprobs_of(logits.float() / args.temperature, batch.response_ids)
                    del logits
                    old_logprobs = pick(rollouts.logprobs)
                    advantages = pick(rollouts.advantages)
                    policy = ppo_core.clipped_policy_loss(new_logprobs, old_logprobs, advantages, mask,
                                                          args.cliprange, denominator=n_tokens)
                    self.sharding.backward(policy.loss, last=False)
                    # The backward recomputes checkpointed layers: it must run with the same adapter active.
                    with self.models.value_scope():
                        with self._autocast():
                            new_values = self.models.values(batch)
                        old_values, returns = pick(rollouts.values), pick(rollouts.returns)
                        value = ppo_core.clipped_value_loss(new_values, old_values, returns, mask,
                                                            args.cliprange_value, denominator=n_tokens)
                        self.sharding.backward(args.vf_coef * value.loss)
                    count = float(mask.sum())
                    sums["tokens_seen"] += count
                    sums["policy_loss"] += float(policy.loss.detach()) * float(n_tokens)
                    sums["value_loss"] += float(value.loss.detach()) * float(n_tokens)
                    sums["clip_fraction"] += float(policy.clip_fraction) * count
                    sums["value_clip_fraction"] += float(value.clip_fraction) * count
                    approx_kl = ppo_core.approx_policy_kl(new_logprobs.detach(), old_logprobs, mask)
                    sums["approx_kl"] += float(approx_kl) * count
                # summed across ranks, clipped together, stepped (DeepSpeed: by its engine)
                grad_norms.append(self.sharding.step(self.optimizer, params, args.max_grad_norm))
                self.lr_scheduler.step()
        sums = ppo_core.sum_across_ranks(sums)
        tokens_seen = sums.pop("tokens_seen")
        stats = {k: v / max(tokens_seen, 1.0) for k, v in sums.items()}
        stats["loss"] = stats["policy_loss"] + args.vf_coef * stats["value_loss"]
        stats["grad_norm"] = sum(grad_norms) / len(grad_norms)
        return stats

    def rollout_stats(self, rollouts: Rollouts) -> dict[str, float]:
        return ppo_core.rollout_means(rollouts, self.args.kl_coef)

    def step(self, step: int) -> dict[str, float]:
        """One PPO step: rollouts, advantages, updates. Returns its statistics."""
        started = time.perf_counter()
        with self.sharding.gathered():  # sharded policy and value whole for the rollout (no-op unsharded)
            rollouts = self.compute_advantages(self.rollout(step))
        rolled = time.perf_counter()
        stats = {**self.rollout_stats(rollouts), **self.update(rollouts, step)}
        stats["rollout_time"] = rolled - started
        stats["update_time"] = time.perf_counter() - rolled
        return stats

    # ---------------------------------------------------------------- loop, logging, checkpoints

    def train(self, resume_from_checkpoint: str | None = None) -> Any:
        """Run PPO steps until ``max_steps``; returns ``transformers.trainer_utils.TrainOutput``."""
        from transformers.trainer_utils import TrainOutput

        from alpacafarm.training import logger

        if resume_from_checkpoint:
            self._load_checkpoint(Path(resume_from_checkpoint))
        state, control, handler = self.state, self.control, self.callback_handler
        control = handler.on_train_begin(self.args, state, control)
        started = time.perf_counter()
        window: list[dict[str, float]] = []
        losses: list[float] = []
        first_step = state.global_step
        while state.global_step < state.max_steps and not control.should_training_stop:
            control = handler.on_step_begin(self.args, state, control)
            stats = self.step(state.global_step)
            state.global_step += 1
            state.epoch = state.global_step * self.args.rollout_batch_size / len(self.queries)
            window.append(stats)
            losses.append(stats["loss"])
            control = handler.on_step_end(self.args, state, control)
            if control.should_log:
                self.log({k: sum(s[k] for s in window) / len(window) for k in window[0]})
                window.clear()
            if control.should_save:
                self._save_checkpoint()  # every rank (sharded weights are gathered); the main process writes
                control = handler.on_save(self.args, state, control)
                control.should_save = False
            if not all(math.isfinite(v) for v in stats.values()):
                logger.warning("PPO step %d produced a non-finite statistic: %s", state.global_step, stats)
        runtime = time.perf_counter() - started
        steps_run = state.global_step - first_step
        train_loss = sum(losses) / len(losses) if losses else 0.0
        metrics = {"train_runtime": round(runtime, 4),
                   "train_steps_per_second": round(steps_run / runtime, 4) if runtime else 0.0,
                   "train_loss": train_loss, "epoch": state.epoch}
        state.log_history.append({**metrics, "step": state.global_step})
        self.control = handler.on_train_end(self.args, state, control)
        return TrainOutput(state.global_step, train_loss, metrics)

    def log(self, logs: dict[str, float]) -> None:
        """Append a log entry (with learning rate, epoch and step) and fire ``on_log``."""
        logs = {**logs, "learning_rate": float(self.lr_scheduler.get_last_lr()[0]),
                "epoch": round(float(self.state.epoch), 4)}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)
        self.control.should_log = False

    def _save_checkpoint(self) -> Path | None:
        """``checkpoint-N/`` (:mod:`alpacafarm_trl.ppo_checkpoint`): every rank calls it, the main one writes."""
        return ppo_checkpoint.save_checkpoint(self)

    def _load_checkpoint(self, path: Path) -> None:
        ppo_checkpoint.load_checkpoint(self, path)


def build_ppo_trainer(config: PPOMethodConfig, spec: Any, sft_path: str, reward_path: str,
                      records: Sequence[dict[str, Any]], *, reward_fn: RewardFunction | None = None,
                      callbacks: Sequence[Any] | None = None, logger: Any = None) -> PPOTrainer:
    """A ready :class:`PPOTrainer` from the recipe's model block, the SFT model and the reward model folders.

    ``config`` must carry its final ``output_dir`` (see :func:`~alpacafarm.training.stage_training_args`).
    Prompts are written for the SFT folder (its ``prompt_format`` and conditioning file, see
    :meth:`alpacafarm.prompts.PromptFormat.for_model`). Without ``reward_fn`` the reward is the reward model's
    score (an :class:`~alpacafarm.rewards.RewardScorer`), run by the reward model the layout already holds when it
    holds one (the ``reward`` adapter on the shared base, or the critic's backbone with its adapter off).
    """
    from transformers import set_seed

    from alpacafarm.modeling import load_classifier, load_tokenizer
    from alpacafarm.rewards import RewardScorer

    set_seed(config.seed)  # new adapters are randomly initialised: same seed, same run
    tokenizer = load_tokenizer(spec, sft_path)
    with loading_whole():  # under ZeRO-3 too: the engine partitions what it trains, the frozen models stay whole
        models = build_models(spec, sft_path, reward_path, logger=logger,
                              gradient_checkpointing=bool(config.gradient_checkpointing))
        if reward_fn is None:
            reward_classifier = models.reward_model()  # scored by what the layout holds, when it holds the RM
            if reward_classifier is None:
                reward_classifier = load_classifier(spec, reward_path)  # frozen: the model block's dtype
            reward_fn = RewardScorer(reward_classifier, load_tokenizer(spec, reward_path),
                                     prompt_format=spec.prompt_format, batch_size=config.score_batch_size)
    prompt_format = PromptFormat.for_model(spec.prompt_format, sft_path, tokenizer)
    return PPOTrainer(config, models, tokenizer, records, reward_fn, prompt_format=prompt_format,
                      callbacks=callbacks)
