"""``ppo``: Proximal Policy Optimization against the surrogate reward model, as a TRL-style trainer of our own.

TRL no longer ships a PPO trainer, so this module implements the AlpacaFarm variant (paper Section 3.4,
Appendices A.2 and B.1) from the algorithm:

* each PPO step samples a rollout batch of responses from the policy (temperature sampling, left-padded
  prompts formatted by :func:`alpacafarm.prompts.format_prompt`) on the unlabeled instructions;
* the reward of a response is the reward model's score on its last token minus a per-token KL penalty
  ``kl_coef * (log p_policy - log p_SFT)`` (a fixed coefficient: 0.002 for simulated feedback, 0.02 for human);
* advantages come from GAE with ``gamma = lambda = 1`` and are whitened over the whole rollout batch (not per
  mini-batch, the paper's first modification); the value model starts from the reward model (its second);
* the policy and the value model then take ``ppo_epochs`` passes of clipped-loss updates over mini-batches.

Two model layouts share one trainer: without LoRA a trainable policy, a frozen reference copy and a value model
(the reward model's backbone and head); with ``lora:`` (and optionally ``quantization: 4bit``) in the recipe's
model block, ONE base model carries a trainable ``policy`` adapter, a trainable ``value`` adapter with a value
head, and a frozen ``reward`` adapter with the reward head, and the reference is the base with its adapters
disabled, so a 7B model trains on one 24 GB GPU.

The trainer follows ``transformers.Trainer``'s conventions: a ``TrainingArguments`` subclass for its config,
``TrainerState``/``log_history``, ``TrainerCallback`` events (``on_step_end``, ``on_log``, ``on_save``, ...),
``checkpoint-N`` folders every ``save_steps`` and ``train(resume_from_checkpoint=...)``.
"""

from __future__ import annotations

import contextlib
import math
import random
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainingArguments

from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, StageContext
from alpacafarm.seeding import stable_seed
from alpacafarm.prompts import format_prompt
from alpacafarm_trl import ppo_core
from alpacafarm_trl.ppo_models import (
    PolicyAndValue,
    SeparateModels,
    ValueModel,
    _enable_checkpointing,
    build_shared_models,
)
from alpacafarm_trl.training import apply_device_defaults, limit, resume_checkpoint, stage_training_args

#: ``reward_fn(records, completions, response_token_ids) -> scores``: one score per completion.
RewardFunction = Callable[[Sequence[dict[str, Any]], Sequence[str], Sequence[Sequence[int]]], Sequence[float]]

#: Adapters on the shared base in the LoRA layout; the first two train.

#: Keys of every per-step log entry (besides ``step``), in the order they are documented.
LOG_KEYS = (
    "score", "reward", "kl", "non_score_reward", "entropy", "response_length", "eos_fraction",
    "policy_loss", "value_loss", "loss", "clip_fraction", "value_clip_fraction", "approx_kl",
    "value_mean", "return_mean", "grad_norm", "rollout_time", "update_time",
    "learning_rate", "epoch",
)


# --------------------------------------------------------------------------------------------------- config


@dataclass
class PPOMethodConfig(TrainingArguments):
    """Every ``transformers.TrainingArguments`` field, plus PPO's.

    Defaults are the paper's (Appendix B.1): 512 rollouts per PPO step in 2 epochs of mini-batches of 256,
    learning rate 1e-5 decaying linearly to 0, gradient clipping at norm 1, 10 passes over the prompts,
    ``gamma = lambda = 1``, a fixed KL coefficient of 0.002 (simulated feedback; 0.02 for human feedback).
    A PPO step is one rollout batch: ``max_steps`` counts PPO steps, ``total_episodes`` counts rollouts, and
    otherwise ``num_train_epochs`` passes over the prompts decide the length. ``per_device_train_batch_size``
    is the micro-batch of every forward pass; gradients accumulate over a mini-batch (so
    ``gradient_accumulation_steps`` is not used). Dropout is turned off (it would bias the PPO ratio).
    The optimizer is AdamW with the arguments' betas, epsilon and weight decay (``optim`` is not used);
    checkpoints follow ``save_strategy: steps`` / ``save_steps`` / ``save_total_limit``. The clip ranges and
    ``vf_coef`` are not given by the paper; 0.2 / 0.2 / 0.1 are common PPO settings (our assumption).
    """

    split: str = field(default="train", metadata={"help": "file (or metadata key) of the instruction_splits input"})
    max_instructions: int | None = field(default=None, metadata={"help": "use the first N prompts only"})
    rollout_batch_size: int = field(default=512, metadata={"help": "responses sampled per PPO step"})
    mini_batch_size: int = field(default=256, metadata={"help": "rollouts per optimizer step"})
    ppo_epochs: int = field(default=2, metadata={"help": "passes over each rollout batch"})
    generation_batch_size: int = field(default=32, metadata={"help": "prompts per generate() call"})
    total_episodes: int | None = field(default=None, metadata={"help": "total rollouts (overrides num_train_epochs)"})
    kl_coef: float = field(default=0.002, metadata={"help": "per-token KL penalty coefficient (fixed)"})
    cliprange: float = field(default=0.2, metadata={"help": "policy ratio clip range"})
    cliprange_value: float = field(default=0.2, metadata={"help": "value clip range around the rollout values"})
    vf_coef: float = field(default=0.1, metadata={"help": "weight of the value loss"})
    gamma: float = field(default=1.0, metadata={"help": "discount of GAE"})
    lam: float = field(default=1.0, metadata={"help": "lambda of GAE"})
    whiten_rewards: bool = field(default=False, metadata={"help": "whiten per-token rewards over the batch (mean kept)"})
    reward_scale: float = field(default=1.0, metadata={"help": "multiply reward-model scores by this"})
    reward_clip: float | None = field(default=None, metadata={"help": "clip scaled scores to [-c, c]"})
    missing_eos_penalty: float | None = field(default=None, metadata={"help": "subtract from responses without EOS"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of the rollouts"})
    max_new_tokens: int = field(default=300, metadata={"help": "longest response"})
    max_prompt_length: int | None = field(default=None, metadata={"help": "skip prompts with more tokens"})
    score_batch_size: int = field(default=8, metadata={"help": "batch size of reward-model scoring"})

    learning_rate: float = 1e-5
    num_train_epochs: float = 10.0
    lr_scheduler_type: str = "linear"
    logging_steps: float = 1
    save_steps: float = 20
    bf16: bool | None = None
    gradient_checkpointing: bool | None = None

    def __post_init__(self) -> None:
        positive = ("rollout_batch_size", "mini_batch_size", "ppo_epochs", "generation_batch_size", "max_new_tokens",
                    "score_batch_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.rollout_batch_size % self.mini_batch_size:
            raise ValueError(f"rollout_batch_size ({self.rollout_batch_size}) must be a multiple of "
                             f"mini_batch_size ({self.mini_batch_size})")
        if self.temperature <= 0:
            raise ValueError("temperature must be positive: PPO samples from the policy")
        if self.kl_coef < 0 or self.cliprange <= 0 or self.cliprange_value <= 0 or self.vf_coef < 0:
            raise ValueError("kl_coef and vf_coef must be >= 0; cliprange and cliprange_value > 0")
        for name in ("max_instructions", "total_episodes", "max_prompt_length"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.fp16:
            raise ValueError("fp16 is not supported by the PPO trainer; use bf16 (automatic on a suitable GPU)")
        apply_device_defaults(self)
        super().__post_init__()


# --------------------------------------------------------------------------------------------------- rollouts


@dataclass
class Batch:
    """A micro-batch of prompt + response token sequences: prompts left-padded, responses right-padded."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor


def left_pad(queries: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to one width (generation appends on the right): ``(input_ids, attention_mask)``."""
    width = max(len(q) for q in queries)
    ids = torch.full((len(queries), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, query in enumerate(queries):
        ids[row, width - len(query):] = torch.tensor(query, dtype=torch.long)
        mask[row, width - len(query):] = 1
    return ids.to(device), mask.to(device)


def collate(queries: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
            device: torch.device | str = "cpu") -> Batch:
    """Pack prompts (left-padded to a common start of the response) and responses (right-padded).

    Position ids count real tokens only, as ``generate`` does with left padding, so a forward pass here sees
    the same positions as the sampling pass did.
    """
    n_query = max(len(q) for q in queries)
    n_response = max(max(len(r) for r in responses), 1)
    ids = torch.full((len(queries), n_query + n_response), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (query, response) in enumerate(zip(queries, responses, strict=True)):
        ids[row, n_query - len(query):n_query] = torch.tensor(query, dtype=torch.long)
        mask[row, n_query - len(query):n_query] = 1
        if response:
            ids[row, n_query:n_query + len(response)] = torch.tensor(response, dtype=torch.long)
            mask[row, n_query:n_query + len(response)] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    return Batch(ids, mask, positions, ids[:, n_query:], mask[:, n_query:].float())


@dataclass
class Rollouts:
    """One PPO step's samples and everything computed from them (per-token tensors ``[n, max response]``)."""

    records: list[dict[str, Any]]
    queries: list[list[int]]
    responses: list[list[int]]
    texts: list[str]
    ended: list[bool]
    scores: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    entropy: torch.Tensor
    rewards: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None


def scorer_reward(scorer: Any, batch_size: int = 8) -> RewardFunction:
    """A reward function scoring completions with a :class:`~alpacafarm_trl.scoring.RewardScorer`."""

    def reward(records: Sequence[dict[str, Any]], completions: Sequence[str], _ids: Sequence[Sequence[int]]) -> list[float]:
        return scorer.score_records(records, completions, batch_size=batch_size)

    reward.scorer = scorer  # type: ignore[attr-defined]
    return reward


# --------------------------------------------------------------------------------------------------- trainer


class PPOTrainer:
    """PPO on prompt records with a reward function; checkpoints and callbacks like ``transformers.Trainer``.

    ``reward_fn(records, completions, response_ids)`` returns one score per completion; the method passes the
    reward model (:func:`scorer_reward`), tests may pass any callable.
    """

    def __init__(self, args: PPOMethodConfig, models: PolicyAndValue, tokenizer: Any, records: Sequence[dict[str, Any]],
                 reward_fn: RewardFunction, *, prompt_format: str = "alpaca", callbacks: Sequence[Any] | None = None) -> None:
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
        self.eos_ids = self._eos_ids()
        self.records, self.queries, self.n_skipped = self._tokenize_prompts(records, prompt_format)

        self.max_steps = self._max_steps()
        self.updates_per_step = args.ppo_epochs * (args.rollout_batch_size // args.mini_batch_size)
        self.params = models.trainable_parameters()
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=args.learning_rate,
                                           betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                           weight_decay=args.weight_decay)
        total_updates = self.max_steps * self.updates_per_step
        self.lr_scheduler = get_scheduler(args.lr_scheduler_type, self.optimizer,
                                          num_warmup_steps=args.get_warmup_steps(total_updates),
                                          num_training_steps=total_updates,
                                          scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})
        self.state = TrainerState(max_steps=self.max_steps, logging_steps=self._interval(args.logging_steps),
                                  save_steps=self._interval(args.save_steps), num_train_epochs=math.ceil(self._passes()),
                                  train_batch_size=args.rollout_batch_size)
        self.control = TrainerControl()
        handlers = [DefaultFlowCallback, *get_reporting_integration_callbacks(args.report_to), *(callbacks or [])]
        self.callback_handler = CallbackHandler(handlers, models.policy_module, tokenizer, self.optimizer,
                                                self.lr_scheduler)
        self.control = self.callback_handler.on_init_end(args, self.state, self.control)

    # ---------------------------------------------------------------- setup helpers

    def add_callback(self, callback: Any) -> None:
        self.callback_handler.add_callback(callback)

    def _eos_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        config = getattr(self.models.policy_module, "generation_config", None)
        configured = getattr(config, "eos_token_id", None)
        ids.update(configured if isinstance(configured, list) else [configured])
        return sorted(i for i in ids if i is not None)

    def _tokenize_prompts(self, records: Sequence[dict[str, Any]], style: str) -> tuple[list[dict], list[list[int]], int]:
        kept, queries, skipped = [], [], 0
        texts = []
        for record in records:
            if not record.get("instruction"):
                raise UserError(f"a PPO prompt record has no 'instruction' (fields: {', '.join(sorted(record))})")
            texts.append(format_prompt(record["instruction"], record.get("input") or None, style=style,
                                       tokenizer=self.tokenizer))
        bos = self.tokenizer.bos_token
        # As in generation: a chat template already carries its special tokens.
        add_special = not (bos and all(t.startswith(bos) for t in texts))
        encoded = self.tokenizer(texts, add_special_tokens=add_special)["input_ids"] if texts else []
        for record, ids in zip(records, encoded, strict=True):
            if self.args.max_prompt_length is not None and len(ids) > self.args.max_prompt_length:
                skipped += 1
                continue
            kept.append(dict(record))
            queries.append(list(ids))
        if not kept:
            raise UserError(f"no PPO prompts left ({len(records)} given, {skipped} longer than max_prompt_length)")
        return kept, queries, skipped

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

    def _truncate(self, tokens: list[int]) -> tuple[list[int], bool]:
        for i, token in enumerate(tokens):
            if token in self.eos_ids:
                return tokens[:i + 1], True
        return tokens, False

    def _micro_batches(self, indices: Sequence[int], lengths: Sequence[int]) -> Iterator[list[int]]:
        size = self.args.per_device_train_batch_size
        ordered = sorted(indices, key=lambda i: -lengths[i])  # similar lengths together: less padding
        for start in range(0, len(ordered), size):
            yield ordered[start:start + size]

    @torch.no_grad()
    def rollout(self, step: int) -> Rollouts:
        """Sample, score and evaluate one rollout batch (no gradients)."""
        from transformers import GenerationConfig

        args = self.args
        self.models.set_training(False)
        indices = self.prompt_indices(step)
        records = [self.records[i] for i in indices]
        queries = [self.queries[i] for i in indices]
        generation_config = GenerationConfig(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
                                             max_new_tokens=args.max_new_tokens, pad_token_id=self.pad_id,
                                             eos_token_id=self.eos_ids, bos_token_id=self.tokenizer.bos_token_id)
        torch.manual_seed(stable_seed(args.seed, "ppo-rollout", step))
        responses: list[list[int]] = []
        ended: list[bool] = []
        with self._autocast():
            for start in range(0, len(queries), args.generation_batch_size):
                input_ids, attention_mask = left_pad(queries[start:start + args.generation_batch_size], self.pad_id,
                                                     self.models.device)
                output = self.models.generate(input_ids=input_ids, attention_mask=attention_mask,
                                              generation_config=generation_config)
                prompt_width = input_ids.shape[1]
                for row in output[:, prompt_width:].tolist():
                    tokens, done = self._truncate(row)
                    responses.append(tokens)
                    ended.append(done)
        texts = [self.tokenizer.decode(r, skip_special_tokens=True).strip() for r in responses]
        scores = torch.tensor([float(s) for s in self.reward_fn(records, texts, responses)], dtype=torch.float32)
        if len(scores) != len(texts):
            raise ValueError(f"the reward function returned {len(scores)} scores for {len(texts)} completions")

        n, width = len(responses), max(len(r) for r in responses)
        mask = torch.zeros(n, width)
        logprobs, ref_logprobs, values, entropy = (torch.zeros(n, width) for _ in range(4))
        lengths = [len(q) + len(r) for q, r in zip(queries, responses, strict=True)]
        with self._autocast():
            for chunk in self._micro_batches(range(n), lengths):
                batch = collate([queries[i] for i in chunk], [responses[i] for i in chunk], self.pad_id, self.models.device)
                tokens = batch.response_ids
                logits = self.models.policy_logits(batch).float() / args.temperature
                policy_lp = ppo_core.logprobs_of(logits, tokens)
                chunk_entropy = ppo_core.entropy_of(logits)
                del logits
                ref_lp = ppo_core.logprobs_of(self.models.reference_logits(batch).float() / args.temperature, tokens)
                chunk_values = self.models.values(batch)
                r = tokens.shape[1]
                for j, i in enumerate(chunk):
                    mask[i, :r] = batch.response_mask[j].cpu()
                    logprobs[i, :r] = policy_lp[j].cpu()
                    ref_logprobs[i, :r] = ref_lp[j].cpu()
                    values[i, :r] = chunk_values[j].cpu()
                    entropy[i, :r] = chunk_entropy[j].cpu()
        return Rollouts(records, queries, responses, texts, ended, scores, mask, logprobs * mask, ref_logprobs * mask,
                        values * mask, entropy * mask)

    def compute_advantages(self, rollouts: Rollouts) -> Rollouts:
        """Scores → shaped per-token rewards → GAE advantages (whitened over the batch) and returns."""
        args = self.args
        scores = rollouts.scores.clone()
        if args.missing_eos_penalty is not None:
            scores -= args.missing_eos_penalty * (1.0 - torch.tensor(rollouts.ended, dtype=torch.float32))
        scores = scores * args.reward_scale
        if args.reward_clip is not None:
            scores = scores.clamp(-args.reward_clip, args.reward_clip)
        rewards, kl = ppo_core.kl_penalized_rewards(scores, rollouts.logprobs, rollouts.ref_logprobs, rollouts.mask,
                                                    args.kl_coef)
        if args.whiten_rewards:
            rewards = ppo_core.masked_whiten(rewards, rollouts.mask, shift_mean=False)
        advantages, returns = ppo_core.compute_gae(rewards, rollouts.values, rollouts.mask, gamma=args.gamma, lam=args.lam)
        rollouts.rewards, rollouts.kl = rewards, kl
        rollouts.advantages = ppo_core.masked_whiten(advantages, rollouts.mask)
        rollouts.returns = returns
        return rollouts

    # ---------------------------------------------------------------- update

    def update(self, rollouts: Rollouts, step: int) -> dict[str, float]:
        """``ppo_epochs`` passes of clipped policy and value updates over shuffled mini-batches."""
        args = self.args
        self.models.set_training(True)
        device = self.models.device
        n = len(rollouts.responses)
        lengths = [len(q) + len(r) for q, r in zip(rollouts.queries, rollouts.responses, strict=True)]
        generator = torch.Generator().manual_seed(stable_seed(args.seed, "ppo-minibatches", step))
        sums = dict.fromkeys(("policy_loss", "value_loss", "clip_fraction", "value_clip_fraction", "approx_kl"), 0.0)
        tokens_seen, grad_norms, n_updates = 0.0, [], 0
        for _ in range(args.ppo_epochs):
            order = torch.randperm(n, generator=generator).tolist()
            for start in range(0, n, args.mini_batch_size):
                mini = order[start:start + args.mini_batch_size]
                n_tokens = rollouts.mask[mini].sum().clamp(min=1).to(device)
                self.optimizer.zero_grad(set_to_none=True)
                for chunk in self._micro_batches(mini, lengths):
                    batch = collate([rollouts.queries[i] for i in chunk], [rollouts.responses[i] for i in chunk],
                                    self.pad_id, device)
                    r = batch.response_ids.shape[1]
                    pick = (lambda t, c=chunk, width=r: t[c, :width].to(device))  # noqa: E731
                    mask = batch.response_mask
                    with self._autocast():
                        logits = self.models.policy_logits(batch)
                    new_logprobs = ppo_core.logprobs_of(logits.float() / args.temperature, batch.response_ids)
                    del logits
                    old_logprobs = pick(rollouts.logprobs)
                    policy = ppo_core.clipped_policy_loss(new_logprobs, old_logprobs, pick(rollouts.advantages), mask,
                                                          args.cliprange, denominator=n_tokens)
                    policy.loss.backward()
                    with self.models.value_scope():  # the backward recomputes checkpointed layers: same adapter
                        with self._autocast():
                            new_values = self.models.values(batch)
                        value = ppo_core.clipped_value_loss(new_values, pick(rollouts.values), pick(rollouts.returns),
                                                            mask, args.cliprange_value, denominator=n_tokens)
                        (args.vf_coef * value.loss).backward()
                    count = float(mask.sum())
                    tokens_seen += count
                    sums["policy_loss"] += float(policy.loss.detach()) * float(n_tokens)
                    sums["value_loss"] += float(value.loss.detach()) * float(n_tokens)
                    sums["clip_fraction"] += float(policy.clip_fraction) * count
                    sums["value_clip_fraction"] += float(value.clip_fraction) * count
                    sums["approx_kl"] += float(ppo_core.approx_policy_kl(new_logprobs.detach(), old_logprobs, mask)) * count
                grad_norm = torch.nn.utils.clip_grad_norm_(list(self.params.values()), args.max_grad_norm)
                grad_norms.append(float(grad_norm))
                self.optimizer.step()
                self.lr_scheduler.step()
                n_updates += 1
        stats = {k: v / max(tokens_seen, 1.0) for k, v in sums.items()}
        stats["loss"] = stats["policy_loss"] + args.vf_coef * stats["value_loss"]
        stats["grad_norm"] = sum(grad_norms) / len(grad_norms)
        return stats

    def rollout_stats(self, rollouts: Rollouts) -> dict[str, float]:
        mask = rollouts.mask
        kl = rollouts.kl.sum(-1)
        non_score = -self.args.kl_coef * kl
        return {
            "score": float(rollouts.scores.mean()),
            "kl": float(kl.mean()),
            "non_score_reward": float(non_score.mean()),
            "reward": float((rollouts.scores + non_score).mean()),
            "entropy": float(ppo_core.masked_mean(rollouts.entropy, mask)),
            "response_length": float(mask.sum(-1).mean()),
            "eos_fraction": sum(rollouts.ended) / len(rollouts.ended),
            "value_mean": float(ppo_core.masked_mean(rollouts.values, mask)),
            "return_mean": float(ppo_core.masked_mean(rollouts.returns, mask)),
        }

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

        from alpacafarm_trl.training import logger

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
        metrics = {"train_runtime": round(runtime, 4), "train_steps_per_second": round(steps_run / runtime, 4) if runtime else 0.0,
                   "train_loss": train_loss, "epoch": state.epoch}
        state.log_history.append({**metrics, "step": state.global_step})
        self.control = handler.on_train_end(self.args, state, control)
        return TrainOutput(state.global_step, train_loss, metrics)

    def log(self, logs: dict[str, float]) -> None:
        """Append a log entry (with learning rate, epoch and step) and fire ``on_log``."""
        logs = {**logs, "learning_rate": float(self.lr_scheduler.get_last_lr()[0]), "epoch": round(float(self.state.epoch), 4)}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)
        self.control.should_log = False

    def _save_checkpoint(self) -> Path:
        """``checkpoint-N/``: trained weights (policy and value), optimizer, scheduler, RNG states, trainer state."""
        import numpy as np

        output_dir = Path(self.args.output_dir)
        final = output_dir / f"checkpoint-{self.state.global_step}"
        partial = output_dir / f"{final.name}.partial"  # renamed when complete: a crash leaves no half checkpoint
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        torch.save({k: p.detach().cpu() for k, p in self.params.items()}, partial / "trainable.pt")
        torch.save(self.optimizer.state_dict(), partial / "optimizer.pt")
        torch.save(self.lr_scheduler.state_dict(), partial / "scheduler.pt")
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        torch.save(rng, partial / "rng_state.pth")
        self.state.save_to_json(str(partial / "trainer_state.json"))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        self._rotate_checkpoints(output_dir)
        return final

    def _rotate_checkpoints(self, output_dir: Path) -> None:
        limit_ = self.args.save_total_limit
        if not limit_ or limit_ < 1:
            return
        checkpoints = sorted((p for p in output_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                             key=lambda p: int(p.name.split("-")[-1]))
        for old in checkpoints[:-limit_]:
            shutil.rmtree(old, ignore_errors=True)

    def _load_checkpoint(self, path: Path) -> None:
        import numpy as np
        from transformers.trainer_callback import TrainerState

        saved = torch.load(path / "trainable.pt", map_location="cpu", weights_only=True)
        missing = sorted(set(self.params) - set(saved))
        if missing:
            raise UserError(f"checkpoint {path} does not match this model ({len(missing)} tensors missing, e.g. {missing[0]})")
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(saved[name].to(param.device, param.dtype))
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=self.models.device, weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        rng = torch.load(path / "rng_state.pth", weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["cpu"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.state = TrainerState.load_from_json(str(path / "trainer_state.json"))
        self.state.max_steps = self.max_steps


# --------------------------------------------------------------------------------------------------- building


def build_ppo_trainer(config: PPOMethodConfig, spec: Any, sft_path: str, reward_path: str,
                      records: Sequence[dict[str, Any]], *, reward_fn: RewardFunction | None = None,
                      callbacks: Sequence[Any] | None = None, logger: Any = None) -> PPOTrainer:
    """A ready :class:`PPOTrainer` from the recipe's model block, the SFT model and the reward model folders.

    ``config`` must carry its final ``output_dir`` (see :func:`stage_training_args`). Without ``reward_fn`` the
    reward is the reward model's score (a :class:`~alpacafarm_trl.scoring.RewardScorer`).
    """
    from transformers import set_seed

    from alpacafarm.modeling import load_causal_lm, load_tokenizer
    from alpacafarm_trl.scoring import RewardScorer, load_classifier

    set_seed(config.seed)  # new adapters are randomly initialised: same seed, same run
    tokenizer = load_tokenizer(spec, sft_path)
    if spec.lora is None:
        if spec.quantization is not None:
            raise UserError("PPO cannot train quantized weights: add 'lora:' to the model block to use quantization")
        policy = load_causal_lm(spec, sft_path)
        reference = load_causal_lm(spec, sft_path)
        value = ValueModel.from_classifier(load_classifier(spec, reward_path))
        if config.gradient_checkpointing:
            _enable_checkpointing(policy)
            _enable_checkpointing(value.backbone)
        models: PolicyAndValue = SeparateModels(policy, reference, value)
        reward_classifier = None
    else:
        models = build_shared_models(spec, sft_path, reward_path, gradient_checkpointing=bool(config.gradient_checkpointing),
                                     logger=logger)
        reward_classifier = models.reward_classifier() if models.reward_head is not None else None
    if reward_fn is None:
        reward_tokenizer = load_tokenizer(spec, reward_path)
        classifier = reward_classifier if reward_classifier is not None else load_classifier(spec, reward_path)
        scorer = RewardScorer(classifier, reward_tokenizer, prompt_format=spec.prompt_format)
        reward_fn = scorer_reward(scorer, config.score_batch_size)
    return PPOTrainer(config, models, tokenizer, records, reward_fn, prompt_format=spec.prompt_format,
                      callbacks=callbacks)


# --------------------------------------------------------------------------------------------------- method


class _ProgressCallback(TrainerCallback):
    """Advances the stage's progress bar by one per PPO step."""

    def __init__(self, advance: Callable[..., None]) -> None:
        self.advance = advance

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step:
            self.advance(state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.advance(1)


class PPO(Method):
    """PPO of the SFT policy against the reward model on the unlabeled prompts; writes ``model/`` and metrics."""

    config_class = PPOMethodConfig
    requires = ("sft_model", "reward_model", "instruction_splits")
    provides = "policy_model"
    description = "PPO against the surrogate reward model with a per-token KL penalty to the SFT model (our trainer)"

    def run(self, context: StageContext) -> Artifact:
        from alpacafarm.data import write_json
        from alpacafarm.modeling import save_model
        from alpacafarm_trl.scoring import is_adapter_folder

        spec = context.recipe.model
        args = stage_training_args(self.config, context)
        sft_path = context.input("sft_model").path
        reward_path = context.input("reward_model").path
        records = limit(context.records("instruction_splits", args.split), args.max_instructions)
        trainer = build_ppo_trainer(args, spec, sft_path, reward_path, records, logger=context.logger)
        context.logger.info("stage %s: PPO for %d steps of %d rollouts on %d prompts (%d skipped as too long)",
                            context.stage, trainer.max_steps, args.rollout_batch_size, len(trainer.queries),
                            trainer.n_skipped)
        with context.progress("PPO steps", trainer.max_steps) as advance:
            trainer.add_callback(_ProgressCallback(advance))
            result = trainer.train(resume_from_checkpoint=resume_checkpoint(context))
        model_dir = Path(context.stage_dir) / "model"
        merge = bool(spec.lora and (spec.merge_adapters or is_adapter_folder(sft_path)))
        save_model(trainer.models.policy_export(), trainer.tokenizer, model_dir, merge_adapters=merge)
        steps = [e for e in trainer.state.log_history if "score" in e]
        metrics: dict[str, Any] = {
            "steps": int(trainer.state.global_step), "train_loss": round(float(result.training_loss), 6),
            "train_runtime_s": round(float(result.metrics.get("train_runtime", 0.0)), 3),
            "n_prompts": len(trainer.queries), "n_prompts_skipped": trainer.n_skipped,
            "first_score": steps[0]["score"] if steps else None, "final_score": steps[-1]["score"] if steps else None,
            "final_kl": steps[-1]["kl"] if steps else None, "lora": spec.lora is not None, "merged": merge,
        }
        write_json(Path(context.stage_dir) / "metrics.json", {**metrics, "log_history": trainer.state.log_history})
        return Artifact("model", str(model_dir), metrics)
