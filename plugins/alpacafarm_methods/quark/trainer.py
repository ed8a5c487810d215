"""The Quark trainer: one training loop on one accelerate Accelerator, each round sampled inside it.

:class:`QuarkTrainer` runs the best-quantile variant (see :mod:`alpacafarm_methods.quark.method`) in one
:meth:`~QuarkTrainer.train` call, as TRL's online trainers sample inside theirs. Each round:

1. **sample** a fresh pool from the policy as it is now, with the one core sampler
   (:func:`alpacafarm.sampling.sample`), on the round's prompts written by :class:`alpacafarm.prompts.PromptFormat`;
2. **score** it with the reward function;
3. **quantize**: keep the top ``top_quantile``, rounded down as released;
4. take ``steps_per_round`` **optimizer steps** of ``step_batch_size`` examples drawn by cycling through the kept
   samples in a seeded shuffled order (which prompts, samples and order: :mod:`alpacafarm_methods.quark.selection`),
   with the loss ``NLL + kl_coef * KL(policy || reference)`` (:meth:`QuarkTrainer.compute_loss`): the KL is the
   exact per-token divergence of the two next-token distributions at each response position, and the loss is the
   token mean over the whole step batch however it is split into micro-batches and processes.

The pool is then discarded. The optimizer and the learning-rate schedule span the whole run
(``rounds * steps_per_round`` optimizer steps).

**Several processes.** The policy and the optimizer are prepared once by the one Accelerator
(:func:`alpacafarm.training.trainer_accelerator`): the launch config alone picks DDP, FSDP or DeepSpeed, and this
file names none of them. Every rank samples a share of the pool's generation batches (gathered: the pool one
process samples), scores a share of it (gathered), and holds the whole kept set; each micro-batch of a step batch
goes to one rank (micro-batch ``j`` to rank ``j mod processes``), and the loss is scaled so that accelerate's
averaging over ranks and accumulated micro-batches leaves the gradient of the step batch's token mean.

**Conventions of ``transformers.Trainer``:** the config is a ``TrainingArguments`` subclass
(:mod:`alpacafarm_methods.quark.config`); ``TrainerState`` / ``log_history``; ``TrainerCallback`` events (so
:func:`alpacafarm.training_progress.training_progress` shows one progress line); per-step metrics through
``accelerator.log`` to the ``report_to`` trackers (``quark/<key>``); ``train(resume_from_checkpoint=...)``.

**Checkpoints** go through the one checkpoint path of our own loops (:func:`alpacafarm.training.save_checkpoint`
and :func:`~alpacafarm.training.load_checkpoint`, as PPO's): at the end of every ``save_rounds``-th round,
``checkpoint-<step>/`` (the run's optimizer step: the round with the released one step per round) holds what
``accelerator.save_state`` writes (the trained tensors only — all weights, or the LoRA adapters —, the optimizer, the
RNG states; under DeepSpeed or FSDP their own sharded files) and ``trainer_state.json`` (the step, and the log
history, whose round entries are the finished rounds' statistics); the newest ``save_total_limit`` are kept.
``train(resume_from_checkpoint=...)`` loads one under the same launch config, replays the learning-rate schedule to
its step and starts at the next round: each round's prompts, sampling and draw order are seeded by the round, so a
resumed run ends with the uninterrupted run's weights.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from alpacafarm import distributed
from alpacafarm.errors import UserError
from alpacafarm.prompts import PromptFormat
from alpacafarm.rewards import RewardFunction
from alpacafarm.sampling import Sample, sample, tokenize_prompts
from alpacafarm.seeding import stable_seed
from alpacafarm.training import load_checkpoint, save_checkpoint
from alpacafarm_methods.quark.config import QuarkMethodConfig
from alpacafarm_methods.quark.selection import draw_order, round_prompts, top_quantile, top_quantile_per_group

logger = logging.getLogger("alpacafarm")

IGNORE_INDEX = -100
#: Keys of a round's log entry (besides ``step``, the run's optimizer step at its end): its statistics, which
#: :attr:`QuarkTrainer.round_stats` lists and a checkpoint's ``trainer_state.json`` carries.
ROUND_KEYS = ("round", "n_prompts", "n_pool", "n_kept", "n_trained", "reward_mean", "reward_kept_mean", "threshold",
              "reward_max", "train_loss", "nll", "kl", "steps", "learning_rate", "response_tokens_mean",
              "finished_rate", "rollout_seconds", "score_seconds", "train_seconds")


def training_example(sample: Sample, *, train_eos: bool) -> dict[str, list[int]]:
    """Prompt + response ids; only the response is a target (the prompt's labels are ignored).

    With ``train_eos`` false (``QuarkMethodConfig.train_eos``'s default, as released) a finished sample's stop
    token is left out, so Quark never trains it: the released trainer decodes its rollouts without special
    tokens and re-tokenizes the text, so its kept samples carry no EOS.
    """
    response = sample.response_ids[:-1] if sample.finished and not train_eos else sample.response_ids
    return {"input_ids": sample.prompt_ids + response,
            "labels": [IGNORE_INDEX] * len(sample.prompt_ids) + response}


def target_count(example: dict[str, list[int]]) -> int:
    """The tokens the loss reads in ``example``: its labels at positions 1.. (position 0 has nothing before it)."""
    return sum(label != IGNORE_INDEX for label in example["labels"][1:])


def accumulation_steps(args: QuarkMethodConfig, processes: int) -> int:
    """Micro-batches per process per optimizer step: ``step_batch_size / (per_device_train_batch_size x
    processes)``. A ``gradient_accumulation_steps`` other than 1 must agree with it."""
    micro = args.per_device_train_batch_size * processes
    if args.step_batch_size % micro:
        raise UserError(f"quark: step_batch_size {args.step_batch_size} is not a multiple of "
                        f"per_device_train_batch_size x processes = {micro}")
    accumulation = args.step_batch_size // micro
    if args.gradient_accumulation_steps not in (1, accumulation):
        raise UserError(f"quark: gradient_accumulation_steps is derived from step_batch_size "
                        f"({args.step_batch_size} = {accumulation} x {micro}); leave it unset, not "
                        f"{args.gradient_accumulation_steps}")
    return accumulation


class PadCollator:
    """Right-pads ``input_ids`` (pad id) and ``labels`` (ignored) and builds the attention mask; ``shift_labels``
    are the targets of positions 0..T-2 (``labels[:, 1:]``), which the loss reads."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, list[int]]]) -> dict[str, Any]:
        width = max(len(f["input_ids"]) for f in features)
        ids, labels, mask = [], [], []
        for feature in features:
            padding = width - len(feature["input_ids"])
            ids.append(feature["input_ids"] + [self.pad_token_id] * padding)
            labels.append(feature["labels"] + [IGNORE_INDEX] * padding)
            mask.append([1] * len(feature["input_ids"]) + [0] * padding)
        labels_tensor = torch.tensor(labels)
        return {"input_ids": torch.tensor(ids), "labels": labels_tensor, "shift_labels": labels_tensor[:, 1:],
                "attention_mask": torch.tensor(mask)}


def token_kl(policy_logits: Any, reference_logits: Any) -> Any:
    """KL(policy || reference) of the next-token distributions at every position (float32, ``[...]``)."""
    log_p = torch.log_softmax(policy_logits.float(), dim=-1)
    log_q = torch.log_softmax(reference_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


class QuarkTrainer:
    """Quark's rounds (sample, score, keep the top quantile, optimizer steps) in one :meth:`train` call.

    ``model`` is the policy; ``ref_model`` a frozen reference, or ``None`` where the policy is a peft model whose
    reference is itself with the adapters disabled. ``reward_fn(records, completions)`` (an
    :data:`alpacafarm.rewards.RewardFunction`) scores the rollouts. ``prompt_format`` writes the prompts: a
    :class:`~alpacafarm.prompts.PromptFormat` (the method's carries the SFT folder's conditioning) or a style name.
    Pools (``round_<r>/pool.jsonl``) and checkpoints go to ``args.output_dir``.
    """

    def __init__(self, args: QuarkMethodConfig, model: Any, tokenizer: Any, records: Sequence[dict[str, Any]],
                 reward_fn: RewardFunction, *, ref_model: Any = None, prompt_format: PromptFormat | str = "alpaca",
                 callbacks: Sequence[Any] | None = None) -> None:
        from transformers import get_scheduler, set_seed
        from transformers.trainer_callback import (
            CallbackHandler,
            DefaultFlowCallback,
            TrainerControl,
            TrainerState,
        )

        from alpacafarm.model_loading import enable_activation_checkpointing
        from alpacafarm.training import trainer_accelerator

        if not records:
            raise UserError("quark: the instruction split is empty")
        if ref_model is None and not hasattr(model, "disable_adapter"):
            raise ValueError("QuarkTrainer needs a ref_model unless the policy is a peft model with adapters")
        set_seed(args.seed)
        self.args, self.tokenizer, self.reward_fn = args, tokenizer, reward_fn
        self.records = [dict(record) for record in records]
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.data_collator = PadCollator(tokenizer.pad_token_id)
        if isinstance(prompt_format, str):
            prompt_format = PromptFormat(prompt_format, tokenizer)
        self.prompt_format = prompt_format
        self.queries = tokenize_prompts(tokenizer, prompt_format.records(self.records))
        self.max_steps = args.rounds * args.steps_per_round

        self.accelerator = trainer_accelerator(args, accumulation_steps(args, distributed.world_size()),
                                               project="quark")
        self.world = self.accelerator.num_processes
        if args.gradient_checkpointing:
            enable_activation_checkpointing(model)
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
            placed = getattr(ref_model, "hf_device_map", None) is not None
            if not placed and getattr(ref_model, "quantization_method", None) is None:
                ref_model.to(self.accelerator.device)
        optimizer = self._optimizer(model)
        # Stepped once per optimizer step, by us (accelerate's scheduler wrapper would step it once per process).
        self.lr_scheduler = get_scheduler(args.lr_scheduler_type, optimizer,
                                          num_warmup_steps=args.get_warmup_steps(self.max_steps),
                                          num_training_steps=self.max_steps,
                                          scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.state = TrainerState(max_steps=self.max_steps, logging_steps=self._interval(args.logging_steps),
                                  num_train_epochs=1, train_batch_size=args.step_batch_size)
        self.callback_handler = CallbackHandler([DefaultFlowCallback, *(callbacks or [])], self.policy, tokenizer,
                                                self.optimizer, self.lr_scheduler)
        self.control = self.callback_handler.on_init_end(args, self.state, TrainerControl())

    # ---------------------------------------------------------------- setup

    def _optimizer(self, model: Any) -> Any:
        """The optimizer ``transformers.Trainer`` builds from the same arguments (``optim``, betas, epsilon): weight
        decay on the trained weights, none on biases and normalisation weights."""
        from transformers import Trainer
        from transformers.trainer_pt_utils import get_parameter_names

        decay = set(get_parameter_names(model, [torch.nn.LayerNorm],
                                        [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]))
        trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for name, p in trained if name in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for name, p in trained if name not in decay], "weight_decay": 0.0}]
        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, model)
        return optimizer_cls(groups, **kwargs)

    def _interval(self, value: float) -> int:
        return max(1, math.ceil(self.max_steps * value)) if value < 1 else int(value)

    def add_callback(self, callback: Any) -> None:
        self.callback_handler.add_callback(callback)

    @property
    def policy(self) -> Any:
        """The policy as loaded (the prepared model unwrapped)."""
        return self.accelerator.unwrap_model(self.model)

    @property
    def round_stats(self) -> list[dict[str, Any]]:
        """The statistics of every finished round (:data:`ROUND_KEYS`), in order: the round entries of the log."""
        return [entry for entry in self.state.log_history if "n_pool" in entry]

    def trained_tensors(self) -> dict[str, Any]:
        """The policy's parameters that train (all of them, or the LoRA adapters), by their unwrapped names."""
        return {name: p for name, p in self.policy.named_parameters() if p.requires_grad}

    # ---------------------------------------------------------------- the loss

    def reference_logits(self, model: Any, input_ids: Any, attention_mask: Any) -> Any:
        """The reference's logits, without gradients (and in eval mode: no dropout, no checkpointing)."""
        with torch.no_grad(), self.accelerator.autocast():
            if self.ref_model is not None:
                return self.ref_model(input_ids=input_ids, attention_mask=attention_mask).logits
            policy = self.accelerator.unwrap_model(model)
            was_training = policy.training
            policy.eval()
            try:
                with policy.disable_adapter():
                    return policy(input_ids=input_ids, attention_mask=attention_mask).logits
            finally:
                policy.train(was_training)

    def token_terms(self, model: Any, inputs: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
        """Per-token NLL and KL at the response positions, the response mask, and the policy's outputs.

        Both are of the distributions the rollouts were sampled from: policy and reference logits divided by the
        rollout ``temperature``, as the released trainer's policy forward divides them (``rl_models.py``), so at
        the recipe's 0.7 the loss is that of the tempered policy, not of the raw logits."""
        input_ids, attention_mask, targets = inputs["input_ids"], inputs["attention_mask"], inputs["shift_labels"]
        outputs = model(input_ids=input_ids, attention_mask=attention_mask)
        temperature = float(self.args.temperature)
        logits = outputs.logits[:, :-1].float() / temperature
        mask = targets != IGNORE_INDEX
        log_probs = logits.log_softmax(dim=-1)
        nll = -log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        reference = self.reference_logits(model, input_ids, attention_mask)[:, :-1].float() / temperature
        kl = token_kl(logits, reference)
        return nll, kl, mask, outputs

    def compute_loss(self, model: Any, inputs: dict[str, Any], tokens: float | None = None) -> Any:
        """``(sum of NLL + kl_coef * sum of KL) / tokens`` over the batch's response tokens; ``tokens`` (default:
        the batch's own) is the token count of the whole step batch the batch is a part of."""
        return self.loss_terms(model, inputs, tokens)[0]

    def loss_terms(self, model: Any, inputs: dict[str, Any], tokens: float | None = None) -> tuple[Any, Any, Any]:
        """:meth:`compute_loss` and the batch's NLL and KL sums (detached)."""
        nll, kl, mask, _ = self.token_terms(model, inputs)
        mask = mask.to(nll.dtype)
        nll_sum, kl_sum = (nll * mask).sum(), (kl * mask).sum()
        denominator = tokens if tokens is not None else mask.sum().clamp(min=1)
        return (nll_sum + self.args.kl_coef * kl_sum) / denominator, nll_sum.detach(), kl_sum.detach()

    def measure(self, examples: Sequence[dict[str, list[int]]], batch_size: int = 8) -> dict[str, float]:
        """Mean per-token NLL and KL(policy || reference) over ``examples``, in eval mode, not training."""
        model = self.policy
        was_training = model.training
        model.eval()
        device = self.accelerator.device
        nll_sum = kl_sum = 0.0
        tokens = 0
        try:
            with torch.no_grad():
                for start in range(0, len(examples), batch_size):
                    collated = self.data_collator(list(examples[start:start + batch_size]))
                    batch = {k: v.to(device) for k, v in collated.items()}
                    nll, kl, mask, _ = self.token_terms(model, batch)
                    nll_sum += float((nll * mask).sum())
                    kl_sum += float((kl * mask).sum())
                    tokens += int(mask.sum())
        finally:
            model.train(was_training)
        return {"nll": nll_sum / max(tokens, 1), "kl": kl_sum / max(tokens, 1), "tokens": tokens}

    # ---------------------------------------------------------------- one round's parts

    def sample_pool(self, indices: Sequence[int], round_: int) -> list[list[Sample]]:
        """``rollouts_per_prompt`` samples for each of the records ``indices`` from the policy as it is now (eval
        mode), seeded by the round; the generation batches split across processes and gathered."""
        args, policy = self.args, self.policy
        was_training = policy.training
        policy.eval()
        try:
            with self.accelerator.autocast():
                return sample(policy, self.tokenizer, [self.queries[i] for i in indices], n=args.rollouts_per_prompt,
                              temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                              batch_size=args.generation_batch_size, seed=stable_seed(args.seed, "quark-round", round_),
                              sharded=self.world > 1, synced=True)
        finally:
            policy.train(was_training)

    def score(self, pool: Sequence[tuple[int, int, Sample]], round_: int) -> list[float]:
        """The reward of every ``(record, sample index, sample)`` of the pool; each process scores a share."""

        def score_part(part: list[tuple[int, int, Sample]]) -> list[float]:
            rewards = [float(x) for x in self.reward_fn([self.records[i] for i, _, _ in part],
                                                        [s.text for _, _, s in part])]
            if len(rewards) != len(part):
                raise ValueError(f"the reward function returned {len(rewards)} rewards for {len(part)} rollouts")
            return rewards

        return distributed.map_sharded(score_part, pool, where=f"quark round {round_}: scoring")

    def optimizer_step(self, examples: Sequence[dict[str, list[int]]]) -> dict[str, float]:
        """One optimizer step on the step batch ``examples``: micro-batches of ``per_device_train_batch_size``,
        micro-batch ``j`` on process ``j mod processes``; the gradient is that of the step batch's token mean.
        Returns the step's loss, NLL and KL (token means over every process), grad norm and learning rate."""
        args, accelerator = self.args, self.accelerator
        self.model.train()
        tokens = float(sum(target_count(example) for example in examples)) or 1.0
        size = args.per_device_train_batch_size
        chunks = [examples[start:start + size] for start in range(0, len(examples), size)]
        # accelerate divides each micro-batch's loss by the accumulation steps and averages the gradient over the
        # processes: the scale undoes both, leaving the sum over the step batch divided by its token count.
        scale = self.world * accelerator.gradient_accumulation_steps
        sums = torch.zeros(2, dtype=torch.float64)
        grad_norm = float("nan")
        learning_rate = float(self.lr_scheduler.get_last_lr()[0])  # the rate this step uses
        for chunk in chunks[accelerator.process_index::self.world]:
            with accelerator.accumulate(self.model):
                batch = {k: v.to(accelerator.device) for k, v in self.data_collator(list(chunk)).items()}
                loss, nll_sum, kl_sum = self.loss_terms(self.model, batch, tokens)
                accelerator.backward(scale * loss)
                if accelerator.sync_gradients and args.max_grad_norm and args.max_grad_norm > 0:
                    norm = accelerator.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
                    grad_norm = float(norm) if norm is not None else float("nan")
                self.optimizer.step()
                self.optimizer.zero_grad()
            sums += torch.stack([nll_sum.double().cpu(), kl_sum.double().cpu()])
        self.lr_scheduler.step()
        nll, kl = (float(v) / tokens for v in distributed.all_reduce_sum(sums))
        return {"loss": nll + args.kl_coef * kl, "nll": nll, "kl": kl, "tokens": tokens, "grad_norm": grad_norm,
                "learning_rate": learning_rate}

    def run_round(self, round_: int, indices: Sequence[int]) -> None:
        """Round ``round_`` (1-based) on the records ``indices``: sample, score, keep the top quantile, take
        ``steps_per_round`` optimizer steps; logs each step and the round, writes ``round_<r>/pool.jsonl``."""
        from alpacafarm.data import write_jsonl

        args, state = self.args, self.state
        started = time.perf_counter()
        groups = self.sample_pool(indices, round_)
        pool = [(i, j, s) for i, group in zip(indices, groups, strict=True) for j, s in enumerate(group)]
        generated = time.perf_counter()
        rewards = self.score(pool, round_)
        kept = (top_quantile_per_group(rewards, [i for i, _, _ in pool], args.top_quantile)
                if args.quantile_scope == "instruction" else top_quantile(rewards, args.top_quantile))
        kept_set = set(kept)
        scored = time.perf_counter()
        if self.accelerator.is_main_process:
            write_jsonl(Path(args.output_dir) / f"round_{round_}" / "pool.jsonl", [
                {"round": round_, "record_index": i, "sample_index": j,
                 "instruction": self.records[i]["instruction"], "input": self.records[i].get("input") or "",
                 "output": s.text, "reward": reward, "kept": k in kept_set, "finished": s.finished,
                 "n_tokens": len(s.response_ids)}
                for k, ((i, j, s), reward) in enumerate(zip(pool, rewards, strict=True))])

        examples = [training_example(pool[k][2], train_eos=args.train_eos) for k in kept]
        draws = [examples[k] for k in draw_order(len(examples), args.steps_per_round * args.step_batch_size,
                                                 stable_seed(args.seed, "quark-order", round_))]
        reward_mean = _mean(rewards)
        steps, window = [], []
        for s in range(args.steps_per_round):
            self.control = self.callback_handler.on_step_begin(args, state, self.control)
            step = self.optimizer_step(draws[s * args.step_batch_size:(s + 1) * args.step_batch_size])
            state.global_step += 1
            state.epoch = state.global_step / self.max_steps
            steps.append(step)
            window.append(step)
            self.control = self.callback_handler.on_step_end(args, state, self.control)
            if self.control.should_log:
                tokens = sum(w["tokens"] for w in window)
                self.log({"loss": _mean([w["loss"] for w in window]),
                          "nll": sum(w["nll"] * w["tokens"] for w in window) / tokens,
                          "kl": sum(w["kl"] * w["tokens"] for w in window) / tokens,
                          "grad_norm": _mean([w["grad_norm"] for w in window]),
                          "learning_rate": window[-1]["learning_rate"], "reward": reward_mean, "round": round_})
                window.clear()
        tokens = sum(step["tokens"] for step in steps)
        kept_rewards = [rewards[k] for k in kept]
        self.log({
            "round": round_, "n_prompts": len(indices), "n_pool": len(pool), "n_kept": len(kept),
            "n_trained": len(draws), "reward_mean": reward_mean, "reward_kept_mean": _mean(kept_rewards),
            "threshold": min(kept_rewards), "reward_max": max(rewards),
            "train_loss": _mean([step["loss"] for step in steps]),
            "nll": sum(step["nll"] * step["tokens"] for step in steps) / tokens,
            "kl": sum(step["kl"] * step["tokens"] for step in steps) / tokens,
            "steps": len(steps), "learning_rate": steps[-1]["learning_rate"],
            "response_tokens_mean": _mean([len(s.response_ids) for _, _, s in pool]),
            "finished_rate": _mean([float(s.finished) for _, _, s in pool]),
            "rollout_seconds": round(generated - started, 3), "score_seconds": round(scored - generated, 3),
            "train_seconds": round(time.perf_counter() - scored, 3)}, tracker_prefix="quark/round/")
        stat = self.round_stats[-1]
        logger.info("quark round %d/%d: pool reward %.4f, kept %.4f (threshold %.4f, %d of %d), loss %.4f, nll %.4f, "
                    "kl %.5f", round_, args.rounds, stat["reward_mean"], stat["reward_kept_mean"], stat["threshold"],
                    len(kept), len(pool), stat["train_loss"], stat["nll"], stat["kl"])

    # ---------------------------------------------------------------- the loop, logging, checkpoints

    def train(self, resume_from_checkpoint: str | Path | None = None) -> Any:
        """Every round, in one loop (resumed after the rounds of ``resume_from_checkpoint``, a ``checkpoint-<step>``
        folder this trainer wrote); returns ``transformers.trainer_utils.TrainOutput``."""
        from transformers.trainer_utils import TrainOutput

        args = self.args
        if resume_from_checkpoint:
            self._load_checkpoint(Path(resume_from_checkpoint))
        done = self.state.global_step // args.steps_per_round
        if done:
            logger.info("quark: resumed from %s: rounds 1-%d done, continuing at round %d",
                        Path(resume_from_checkpoint).name, done, done + 1)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        started = time.perf_counter()
        schedule = round_prompts(len(self.records), args, stable_seed(args.seed, "quark-prompts"))
        for round_ in range(done + 1, args.rounds + 1):
            self.run_round(round_, schedule[round_ - 1])
            if args.save_rounds > 0 and round_ % args.save_rounds == 0:
                self._save_checkpoint()
                self.control = self.callback_handler.on_save(args, self.state, self.control)
        runtime = time.perf_counter() - started
        losses = [s["train_loss"] for s in self.round_stats]
        train_loss = _mean(losses) if losses else 0.0
        metrics = {"train_runtime": round(runtime, 4), "train_loss": train_loss}
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        for tracker in self.accelerator.trackers:  # not end_training(): it ends the pipeline's process group too
            tracker.finish()
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def log(self, logs: dict[str, float], *, tracker_prefix: str = "quark/") -> None:
        """Append a log entry (with the run's optimizer step), send it to the trackers (under ``tracker_prefix``),
        fire ``on_log``."""
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.accelerator.log({f"{tracker_prefix}{k}": v for k, v in logs.items()}, step=self.state.global_step)
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)
        self.control.should_log = False

    def policy_state_dict(self) -> dict[str, Any] | None:
        """The trained policy's full state dict (call on every rank: weights a launch config shards are gathered
        whole); ``None`` or empty off the main process where they are gathered to it only."""
        return self.accelerator.get_state_dict(self.model)

    def _save_checkpoint(self) -> Path:
        """``checkpoint-<step>/`` at the end of a round (:func:`alpacafarm.training.save_checkpoint`: the trained
        tensors, optimizer and RNG states through ``accelerator.save_state``, then ``trainer_state.json``)."""
        return save_checkpoint(self.accelerator, self.state, self.args.output_dir, trained_tensors_of=self.model,
                               limit=self.args.save_total_limit)

    def _load_checkpoint(self, path: Path) -> None:
        """Restore a checkpoint of :meth:`_save_checkpoint` (:func:`alpacafarm.training.load_checkpoint`: the trained
        tensors, optimizer, RNG states and the state with the finished rounds' statistics); the learning-rate
        schedule is replayed to its step (a function of the step alone: replaying it unpickles nothing)."""
        if self.state.global_step:
            raise ValueError("a checkpoint is loaded before the first round trains")
        self.state = load_checkpoint(self.accelerator, path, trained_tensors_of=self.model,
                                     lr_scheduler=self.lr_scheduler, max_steps=self.max_steps)


def build_quark_trainer(args: QuarkMethodConfig, model: Any, tokenizer: Any, records: Sequence[dict[str, Any]],
                        reward_fn: RewardFunction, *, ref_model: Any = None,
                        prompt_format: PromptFormat | str = "alpaca",
                        callbacks: Sequence[Any] | None = None) -> QuarkTrainer:
    """A :class:`QuarkTrainer` (``args`` built right before it: see
    :func:`alpacafarm.training.stage_training_args`)."""
    return QuarkTrainer(args, model, tokenizer, records, reward_fn, ref_model=ref_model, prompt_format=prompt_format,
                        callbacks=callbacks)
