"""The PPO trainer: Proximal Policy Optimization against a reward function, TRL-style, of our own.

TRL no longer ships a PPO trainer, so this module implements the AlpacaFarm variant (paper Section 3.4,
Appendices A.2 and B.1) from the algorithm, checked against the released implementation
(``tests/test_ppo_oracle.py``):

* each PPO step samples a rollout batch of responses from the policy on the unlabeled instructions with the
  one core sampler (:func:`alpacafarm.sampling.sample`), the prompts written by
  :class:`alpacafarm.prompts.PromptFormat` for the SFT model folder (so a folder trained behind a control token,
  such as reward conditioning's ``<good>``, is sampled behind it);
* the reward of a response is the reward function's score on its last token minus a per-token KL penalty
  ``kl_coef * max(log p_policy - log p_SFT, 0)`` (clamped at zero as released; ``kl_penalty: k1`` for the plain
  estimate);
* the shaped rewards are whitened over the whole rollout batch padded to ``max_new_tokens`` columns, their mean
  kept, and GAE (``gamma = lambda = 1``) runs over every column, as released: returns do not depend on a
  response's length (:func:`~alpacafarm_methods.ppo.advantages.advantages_and_returns`); advantages are whitened
  over the whole rollout batch (the paper's first modification); the critic is the reward model's backbone with a new
  zero-initialised value head (its second, as released: :mod:`alpacafarm_methods.ppo.models`);
* the policy and the critic then take ``ppo_epochs`` passes of clipped-loss updates over mini-batches, one
  loss and one backward for both.

**Several processes.** The policy and critic are one :class:`~alpacafarm_methods.ppo.models.ActorCritic` module
prepared once by an ``accelerate.Accelerator`` with the optimizer: the launch config alone picks DDP, FSDP2 or
DeepSpeed ZeRO-2/3, and this file names none of them. Every rank samples a share of each rollout batch's
generation batches (the batches one process forms, so the responses are one process's), scores and evaluates an
equal share of the rows, and the rows are gathered so every rank holds the whole rollout batch: whitening is over
the whole batch, as in one process. In the update every rank takes an equal share of each mini-batch; the loss
is scaled so that accelerate's gradient averaging over ranks and micro-batches gives the gradient of the
mini-batch's token mean: one process's step. With the same global batch, 1 and N processes give the same
weights up to floating-point summation order (``tests/test_ppo_distributed.py``).

The trainer follows ``transformers.Trainer``'s conventions: a ``TrainingArguments`` subclass for its config
(:mod:`alpacafarm_methods.ppo.config`), ``TrainerState``/``log_history``, ``TrainerCallback`` events, per-step
metrics through ``accelerator.log`` to the ``report_to`` trackers, ``checkpoint-N`` folders every ``save_steps``
through the one checkpoint path of our own loops (:func:`alpacafarm.training.save_checkpoint`, which is
``accelerator.save_state``) and ``train(resume_from_checkpoint=...)`` (:func:`alpacafarm.training.load_checkpoint`).
The maths a step runs live in :mod:`alpacafarm_methods.ppo.advantages` and :mod:`alpacafarm_methods.ppo.losses`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from alpacafarm.errors import UserError
from alpacafarm.prompts import PromptFormat
from alpacafarm.rewards import RewardFunction
from alpacafarm.sampling import Sample, sample, stop_token_ids, tokenize_prompts
from alpacafarm.seeding import stable_seed
from alpacafarm.training import load_checkpoint, save_checkpoint
from alpacafarm_methods.ppo.advantages import advantages_and_returns, kl_penalized_rewards, masked_whiten
from alpacafarm_methods.ppo.config import PPOMethodConfig
from alpacafarm_methods.ppo.losses import (
    approx_policy_kl,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_of,
    logprobs_of,
)
from alpacafarm_methods.ppo.models import PolicyAndValue
from alpacafarm_methods.ppo.rollouts import Rollouts, collate, rollout_means

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
        policy = models.actor_critic.policy
        self.params = models.trainable_parameters()
        frozen = models.frozen_modules()
        self.prompt_format = PromptFormat(prompt_format, tokenizer) if isinstance(prompt_format, str) else prompt_format
        self.records, self.queries, self.n_skipped = self._tokenize_prompts(records)
        self.max_steps = self._max_steps()
        self.eos_ids = stop_token_ids(policy, tokenizer)

        self.accelerator = self._accelerator()
        self.world = self.accelerator.num_processes
        self._check_processes()
        device = self.accelerator.device
        for module in frozen:
            if next(module.parameters()).device != device:
                module.to(device)
        optimizer = torch.optim.AdamW(list(self.params.values()), lr=args.learning_rate,
                                      betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                      weight_decay=args.weight_decay)
        # Stepped once per PPO step, as released (every update of a step uses one rate), by us: accelerate's
        # scheduler wrapper would step it once per process
        self.lr_scheduler = get_scheduler(args.lr_scheduler_type, optimizer,
                                          num_warmup_steps=args.get_warmup_steps(self.max_steps),
                                          num_training_steps=self.max_steps,
                                          scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})
        self.model, self.optimizer = self.accelerator.prepare(models.actor_critic, optimizer)
        self.state = TrainerState(max_steps=self.max_steps, logging_steps=self._interval(args.logging_steps),
                                  save_steps=self._interval(args.save_steps),
                                  num_train_epochs=math.ceil(self._passes()),
                                  train_batch_size=args.rollout_batch_size)
        self.control = TrainerControl()
        self.callback_handler = CallbackHandler([DefaultFlowCallback, *(callbacks or [])], policy, tokenizer,
                                                self.optimizer, self.lr_scheduler)
        self.control = self.callback_handler.on_init_end(args, self.state, self.control)

    # ---------------------------------------------------------------- setup helpers

    def _accelerator(self) -> Any:
        """The one Accelerator (:func:`alpacafarm.training.trainer_accelerator`): the launch config's distribution,
        micro-batches accumulated over a mini-batch."""
        from alpacafarm import distributed
        from alpacafarm.training import trainer_accelerator

        return trainer_accelerator(self.args, self._micro_steps(distributed.world_size()), project="ppo")

    def _micro_steps(self, world: int) -> int:
        """Micro-batches per rank per mini-batch: the gradient accumulation of one optimizer step."""
        return max(1, math.ceil(self.args.mini_batch_size // max(world, 1) / self.args.per_device_train_batch_size))

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
        args, world = self.args, self.world
        for name in ("rollout_batch_size", "mini_batch_size"):
            if getattr(args, name) % world:
                raise UserError(f"ppo: {name} {getattr(args, name)} is not a multiple of the {world} processes "
                                "(each takes an equal share of it)")

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

    def _share(self, n: int) -> list[int]:
        """This rank's contiguous, equal share of ``n`` rows (``n`` is a multiple of the process count)."""
        size = n // self.world
        start = self.accelerator.process_index * size
        return list(range(start, start + size))

    def sample_step(self, step: int) -> tuple[list[dict[str, Any]], list[Sample]]:
        """The records of step ``step`` and one response to each, sampled from the policy as it is now.

        Seeded by the step (and, inside the sampler, by the batch), so a resumed run samples the same. The
        generation batches are those one process forms, split across ranks and gathered: every rank gets every
        sample, the same as one process's (:func:`~alpacafarm.sampling.sample` with ``sharded``).
        """
        args = self.args
        indices = self.prompt_indices(step)
        with self.accelerator.autocast():
            samples = sample(self.policy, self.tokenizer, [self.queries[i] for i in indices], n=1,
                             temperature=args.temperature, top_p=1.0, max_new_tokens=args.max_new_tokens,
                             batch_size=args.generation_batch_size, seed=stable_seed(args.seed, "ppo-rollout", step),
                             stop_ids=self.eos_ids, sharded=True, synced=True)
        return [self.records[i] for i in indices], [s[0] for s in samples]

    @torch.no_grad()
    def rollout(self, step: int) -> Rollouts:
        """Sample, score and evaluate one rollout batch (no gradients); every rank ends with all of it."""
        from alpacafarm import distributed

        args = self.args
        self.model.eval()
        records, samples = self.sample_step(step)
        mine = self._share(len(samples))
        texts = [samples[i].text for i in mine]
        scores = [float(s) for s in self.reward_fn([records[i] for i in mine], texts)]
        if len(scores) != len(texts):
            raise ValueError(f"the reward function returned {len(scores)} scores for {len(texts)} completions")
        queries, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
        lengths = [len(q) + len(r) for q, r in zip(queries, responses, strict=True)]
        rows: dict[int, dict[str, torch.Tensor]] = {}
        for chunk in self._micro_batches(mine, lengths):
            batch = collate([queries[i] for i in chunk], [responses[i] for i in chunk], self.pad_id,
                            self.accelerator.device)
            logits, values = self.model(**vars(batch))
            logits = logits.float() / args.temperature
            with self.accelerator.autocast():
                ref_logits = self.models.reference_logits(batch).float() / args.temperature
            terms = {"logprobs": logprobs_of(logits, batch.response_ids), "entropy": entropy_of(logits),
                     "ref_logprobs": logprobs_of(ref_logits, batch.response_ids), "values": values.float()}
            del logits, ref_logits
            for j, i in enumerate(chunk):
                width = len(responses[i])
                rows[i] = {k: v[j, :width].cpu() for k, v in terms.items()}
        for i, score in zip(mine, scores, strict=True):
            rows[i]["score"] = torch.tensor(score)
        if self.world > 1:  # a small gather: every rank holds the whole rollout batch
            for part in distributed.all_gather_object(rows, "ppo rollout"):
                rows.update(part)
        n, width = len(samples), max(len(r) for r in responses)
        mask = torch.zeros(n, width)
        tensors = {k: torch.zeros(n, width) for k in ("logprobs", "ref_logprobs", "values", "entropy")}
        for i in range(n):
            mask[i, :len(responses[i])] = 1.0
            for key, tensor in tensors.items():
                tensor[i, :len(responses[i])] = rows[i][key]
        scores_all = torch.stack([rows[i]["score"] for i in range(n)]).float()
        return Rollouts(records, samples, scores_all, mask, tensors["logprobs"], tensors["ref_logprobs"],
                        tensors["values"], tensors["entropy"], positions=list(range(n)))

    def compute_advantages(self, rollouts: Rollouts) -> Rollouts:
        """Scores → shaped per-token rewards → GAE advantages (whitened over the batch) and returns."""
        args = self.args
        scores = rollouts.scores.clone()
        if args.missing_eos_penalty is not None:
            scores -= args.missing_eos_penalty * (1.0 - torch.tensor(rollouts.ended, dtype=torch.float32))
        scores = scores * args.reward_scale
        if args.reward_clip is not None:
            scores = scores.clamp(-args.reward_clip, args.reward_clip)
        rewards, kl, penalized_kl = kl_penalized_rewards(
            scores, rollouts.logprobs, rollouts.ref_logprobs, rollouts.mask, args.kl_coef, penalty=args.kl_penalty)
        advantages, returns = advantages_and_returns(
            rewards, rollouts.values, rollouts.mask, response_length=args.max_new_tokens, gamma=args.gamma,
            lam=args.lam, whiten_rewards=args.whiten_rewards)
        rollouts.rewards, rollouts.kl, rollouts.penalized_kl, rollouts.returns = rewards, kl, penalized_kl, returns
        rollouts.advantages = masked_whiten(advantages, rollouts.mask)
        return rollouts

    # ---------------------------------------------------------------- update

    def update(self, rollouts: Rollouts, step: int) -> dict[str, float]:
        """``ppo_epochs`` passes of clipped policy and value updates over shuffled mini-batches of the whole
        rollout batch (one permutation per pass, the same on every rank). Each rank takes an equal, strided share
        of each mini-batch; its loss is the sum over its tokens divided by the mini-batch's token count on all
        ranks, times the process count and the accumulation steps that accelerate averages over: the gradient
        is the mini-batch's token mean, as in one process."""
        args, accelerator = self.args, self.accelerator
        self.model.train()
        device = accelerator.device
        queries, responses = rollouts.queries, rollouts.responses
        n = len(responses)
        lengths = [len(q) + len(r) for q, r in zip(queries, responses, strict=True)]
        generator = torch.Generator().manual_seed(stable_seed(args.seed, "ppo-minibatches", step))
        sums = dict.fromkeys(("policy_loss", "value_loss", "clip_fraction", "value_clip_fraction",
                              "approx_kl", "tokens_seen"), 0.0)
        grad_norms = []
        scale = self.world * accelerator.gradient_accumulation_steps
        for _ in range(args.ppo_epochs):
            order = torch.randperm(n, generator=generator).tolist()
            for start in range(0, n, args.mini_batch_size):
                mini = order[start:start + args.mini_batch_size]
                n_tokens = float(rollouts.mask[mini].sum()) or 1.0
                mine = mini[accelerator.process_index::self.world]
                for chunk in self._micro_batches(mine, lengths):
                    with accelerator.accumulate(self.model):
                        batch = collate([queries[i] for i in chunk], [responses[i] for i in chunk], self.pad_id,
                                        device)
                        r = batch.response_ids.shape[1]
                        pick = (lambda t, c=chunk, width=r: t[c, :width].to(device))  # noqa: E731
                        mask = batch.response_mask
                        logits, new_values = self.model(**vars(batch))
                        new_logprobs = logprobs_of(logits.float() / args.temperature, batch.response_ids)
                        del logits
                        old_logprobs = pick(rollouts.logprobs)
                        policy = clipped_policy_loss(new_logprobs, old_logprobs, pick(rollouts.advantages), mask,
                                                     args.cliprange, denominator=n_tokens)
                        value = clipped_value_loss(new_values.float(), pick(rollouts.values), pick(rollouts.returns),
                                                   mask, args.cliprange_value, denominator=n_tokens)
                        accelerator.backward(scale * (policy.loss + args.vf_coef * value.loss))
                        if accelerator.sync_gradients:
                            norm = accelerator.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
                            grad_norms.append(float(norm) if norm is not None else float("nan"))
                        self.optimizer.step()
                        self.optimizer.zero_grad()
                    count = float(mask.sum())
                    sums["tokens_seen"] += count
                    sums["policy_loss"] += float(policy.loss.detach()) * n_tokens
                    sums["value_loss"] += float(value.loss.detach()) * n_tokens
                    sums["clip_fraction"] += float(policy.clip_fraction) * count
                    sums["value_clip_fraction"] += float(value.clip_fraction) * count
                    approx_kl = approx_policy_kl(new_logprobs.detach(), old_logprobs, mask)
                    sums["approx_kl"] += float(approx_kl) * count
        sums = sum_across_ranks(sums)
        tokens_seen = sums.pop("tokens_seen")
        stats = {k: v / max(tokens_seen, 1.0) for k, v in sums.items()}
        stats["loss"] = stats["policy_loss"] + args.vf_coef * stats["value_loss"]
        stats["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        stats["learning_rate"] = float(self.lr_scheduler.get_last_lr()[0])  # the rate this step's updates used
        self.lr_scheduler.step()
        return stats

    def rollout_stats(self, rollouts: Rollouts) -> dict[str, float]:
        return rollout_means(rollouts, self.args.kl_coef)

    def step(self, step: int) -> dict[str, float]:
        """One PPO step: rollouts, advantages, updates. Returns its statistics."""
        started = time.perf_counter()
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
                self._save_checkpoint()
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
        for tracker in self.accelerator.trackers:  # not end_training(): it ends the pipeline's process group too
            tracker.finish()
        return TrainOutput(state.global_step, train_loss, metrics)

    def log(self, logs: dict[str, float]) -> None:
        """Append a log entry (with learning rate, epoch and step), send it to the trackers, fire ``on_log``."""
        logs = {**logs, "epoch": round(float(self.state.epoch), 4)}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.accelerator.log({f"ppo/{k}": v for k, v in logs.items()}, step=self.state.global_step)
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)
        self.control.should_log = False

    @property
    def policy(self) -> Any:
        """The trained policy, unwrapped from what ``accelerate`` prepared."""
        return self.accelerator.unwrap_model(self.model).policy

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained policy's full weights (call on every rank: sharded ones are gathered); an empty dict off the
        main process where the launch config gathers to it only. What
        :func:`alpacafarm.model_loading.save_model` writes (its ``state_dict``)."""
        state = self.accelerator.get_state_dict(self.model)
        if state is None:
            return {}
        return {k.removeprefix("policy."): v for k, v in state.items() if k.startswith("policy.")}

    def _save_checkpoint(self) -> Path:
        """``checkpoint-N/`` (:func:`alpacafarm.training.save_checkpoint`): the trained tensors (not a LoRA
        layout's frozen bases), the optimizer, the RNG states and the trainer state."""
        return save_checkpoint(self.accelerator, self.state, self.args.output_dir, trained_tensors_of=self.model,
                               limit=self.args.save_total_limit)

    def _load_checkpoint(self, path: Path) -> None:
        """Restore weights, optimizer and step count from ``checkpoint-N/`` (written by :meth:`_save_checkpoint`
        under the same launch config); the learning-rate schedule is replayed to its step (it is a function of
        the step alone, and replaying it unpickles nothing)."""
        self.state = load_checkpoint(self.accelerator, path, trained_tensors_of=self.model,
                                     lr_scheduler=self.lr_scheduler, max_steps=self.max_steps)


def sum_across_ranks(sums: dict[str, float]) -> dict[str, float]:
    """``sums`` added up over every rank (one all-reduce, float64); unchanged for one process."""
    from alpacafarm import distributed

    if distributed.world_size() == 1:
        return dict(sums)
    totals = torch.tensor(list(sums.values()), dtype=torch.float64)
    distributed.all_reduce_sum(totals)
    return dict(zip(sums, totals.tolist(), strict=True))
