"""The Quark trainer and its rounds: sample a pool, score it, keep the top quantile, train with NLL + KL.

:class:`QuarkTrainer` is a ``transformers.Trainer`` whose loss on the kept samples is
``NLL + kl_coef * KL(policy || reference)``, the KL being the exact per-token divergence of the two
next-token distributions at each response position, averaged over response tokens. :func:`run_rounds` is the
loop of the best-quantile variant (see :mod:`alpacafarm_methods.quark.method`): each round samples a fresh pool with the
one core sampler (:func:`alpacafarm.sampling.sample`) on prompts written by
:class:`alpacafarm.prompts.PromptFormat`, scores it with a reward function, keeps the top ``top_quantile``
(rounded down) and takes ``steps_per_round`` optimizer steps of ``step_batch_size`` examples drawn by cycling
through the kept samples in a seeded shuffled order; the pool is then discarded.

**Checkpoints.** After every ``save_rounds`` rounds :meth:`QuarkTrainer.save_round` writes ``checkpoint-<round>/``
in the stage folder: the trained tensors (``model.safetensors``: the parameters that require gradients, or the
LoRA adapters), the optimizer state (``optimizer.pt``), the statistics of the rounds so far (``rounds.json``) and a
``trainer_state.json`` whose ``global_step`` is the optimizer steps taken (the learning-rate schedule's position).
It is written as ``checkpoint-<round>.partial`` by the main process and renamed when whole. A killed stage resumes
with :meth:`QuarkTrainer.load_round`: every rank loads the tensors and the optimizer state, the schedule is
replayed to its step, and :func:`run_rounds` skips the finished rounds (each round's prompts, sampling and draw
order are seeded by the round). Not ``accelerator.save_state``: the Trainer prepares the model and optimizer inside
each ``train()``, so before the first resumed round the accelerator holds nothing to load into. Under DeepSpeed
ZeRO or FSDP (tensors or optimizer state sharded) no checkpoint is written and a resume is refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import Trainer

from alpacafarm.errors import UserError
from alpacafarm.prompts import PromptFormat
from alpacafarm.rewards import RewardFunction
from alpacafarm.sampling import Sample, sample, tokenize_prompts
from alpacafarm.seeding import stable_seed
from alpacafarm_methods.quark.config import QuarkMethodConfig

IGNORE_INDEX = -100
#: Files of a round checkpoint (see the module docstring); trainer_state.json is written last, as trainers do.
TRAINED_TENSORS, OPTIMIZER_STATE, ROUND_STATS = "model.safetensors", "optimizer.pt", "rounds.json"


def kept_count(pool_size: int, quantile: float) -> int:
    """How many of a pool form its top ``quantile``: ``floor(quantile * pool_size)``, at least one.

    Rounded down as in the released implementation, whose top bin of ``b`` holds ``pool_size // b`` samples
    (128 of 512 for its 4 bins); at least one, so a tiny pool still trains.
    """
    return min(pool_size, max(1, math.floor(round(quantile * pool_size, 9))))


def top_quantile(rewards: Sequence[float], quantile: float) -> list[int]:
    """Indices (ascending) of the ``kept_count`` highest rewards; ties at the threshold go to earlier ones."""
    ranked = sorted(range(len(rewards)), key=lambda i: (-rewards[i], i))
    return sorted(ranked[:kept_count(len(rewards), quantile)])


def draw_order(n_kept: int, n_draws: int, seed: int) -> list[int]:
    """``n_draws`` indices into the kept samples: passes over them, each a fresh seeded permutation, cut at
    ``n_draws`` (the released trainer's shuffled, cycling loader: 256 draws from 128 kept are two passes)."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < n_draws:
        permutation = list(range(n_kept))
        rng.shuffle(permutation)
        order.extend(permutation)
    return order[:n_draws]


def training_example(sample: Sample, *, train_eos: bool) -> dict[str, list[int]]:
    """Prompt + response ids; only the response is a target (the prompt's labels are ignored).

    With ``train_eos`` false (``QuarkMethodConfig.train_eos``'s default, as released) a finished sample's stop
    token is left out, so Quark never trains it: the released trainer decodes its rollouts without special
    tokens and re-tokenizes the text, so its kept samples carry no EOS.
    """
    response = sample.response_ids[:-1] if sample.finished and not train_eos else sample.response_ids
    return {"input_ids": sample.prompt_ids + response,
            "labels": [IGNORE_INDEX] * len(sample.prompt_ids) + response}


class PadCollator:
    """Right-pads ``input_ids`` (pad id) and ``labels`` (ignored) and builds the attention mask. ``shift_labels``
    are the targets of positions 0..T-2 (``labels[:, 1:]``): the loss reads them, and the Trainer counts them (its
    public rule for a collator that shifts) for the token count of an accumulated batch."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, list[int]]]) -> dict[str, Any]:
        import torch

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
    import torch

    log_p = torch.log_softmax(policy_logits.float(), dim=-1)
    log_q = torch.log_softmax(reference_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


class QuarkTrainer(Trainer):
    """A ``Trainer`` with loss ``NLL(kept samples) + kl_coef * KL(policy || reference)`` per response token.

    ``ref_model`` is a frozen reference; ``None`` means the policy is a peft model whose reference is itself
    with the adapters disabled. Each round sets ``train_dataset`` to the round's draws, in order (the sampler
    is sequential: :func:`draw_order` already shuffled them), and calls :meth:`train` again for ``max_steps``
    (= ``steps_per_round``) optimizer steps: the optimizer is kept, and the learning-rate schedule is built
    once for ``rounds`` times the steps of a round, so the rate decays over the whole run.
    """

    loss_is_scaled_for_ga = True  # compute_loss divides by the response tokens of the whole accumulated batch

    def __init__(self, *args: Any, ref_model: Any = None, rounds: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ref_model = ref_model
        self.rounds = rounds
        # Count the response tokens of each accumulated batch (the collator's shift_labels) for compute_loss.
        self.model_accepts_loss_kwargs = True
        if ref_model is None and not hasattr(self.accelerator.unwrap_model(self.model), "disable_adapter"):
            raise ValueError("QuarkTrainer needs a ref_model unless the policy is a peft model with adapters")
        self._log_terms = [0.0, 0.0, 0]    # nll sum, kl sum, tokens since the last log
        self.round_terms = [0.0, 0.0, 0]   # the same since reset_round_terms()
        self.resumed_steps = 0             # optimizer steps a loaded checkpoint had taken (replayed by the schedule)
        self.steps_before_round = 0        # optimizer steps of the rounds before this one (set by run_rounds)

    def reset_round_terms(self) -> None:
        self.round_terms = [0.0, 0.0, 0]

    def round_means(self) -> dict[str, float | None]:
        nll, kl, tokens = self.round_terms
        return {"nll": nll / tokens if tokens else None, "kl": kl / tokens if tokens else None}

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        from torch.utils.data import SequentialSampler

        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        from transformers import get_scheduler

        # Built once, for every round: train() keeps a scheduler it did not build itself.
        if self.lr_scheduler is None:
            total = num_training_steps * self.rounds
            self.lr_scheduler = get_scheduler(
                self.args.lr_scheduler_type, optimizer=optimizer or self.optimizer,
                num_warmup_steps=self.args.get_warmup_steps(total), num_training_steps=total,
                scheduler_specific_kwargs=self.args.lr_scheduler_kwargs or {})
            with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": a replay, on purpose
                warnings.simplefilter("ignore")
                for _ in range(self.resumed_steps):
                    self.lr_scheduler.step()
        return self.lr_scheduler

    # ---------------------------------------------------------------- round checkpoints

    def checkpoints_whole(self) -> bool:
        """Whether the trained tensors and the optimizer state are whole on the main process (one process or plain
        data parallelism), so a round checkpoint can be written and loaded."""
        return not (self.is_deepspeed_enabled or self.is_fsdp_enabled)

    def trained_tensors(self) -> dict[str, Any]:
        """The policy's parameters that train (all of them, or the LoRA adapters), by their unwrapped names."""
        model = self.accelerator.unwrap_model(self.model)
        return {name: p for name, p in model.named_parameters() if p.requires_grad}

    def save_round(self, out_dir: str | Path, round_: int, stats: Sequence[dict[str, Any]]) -> Path:
        """Write ``checkpoint-<round_>/`` (see the module docstring) and keep the newest ``save_total_limit``;
        call on every rank after the round's training, the main process writes."""
        import torch
        from safetensors.torch import save_file
        from transformers.trainer_callback import TrainerState

        from alpacafarm.data import write_json
        from alpacafarm.training import rotate_checkpoints

        final = Path(out_dir) / f"checkpoint-{round_}"
        partial = final.with_name(f"{final.name}.partial")
        self.accelerator.wait_for_everyone()  # every rank has finished the round's optimizer steps
        if self.accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            save_file({n: p.detach().to("cpu").contiguous() for n, p in self.trained_tensors().items()},
                      str(partial / TRAINED_TENSORS))
            torch.save(self.optimizer.state_dict(), partial / OPTIMIZER_STATE)
            write_json(partial / ROUND_STATS, list(stats))
            steps = self.args.steps_per_round
            TrainerState(global_step=round_ * steps, max_steps=self.rounds * steps,
                         log_history=[{**e, "round": s["round"]} for s in stats for e in s["log_history"]],
                         ).save_to_json(str(partial / "trainer_state.json"))
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
            rotate_checkpoints(out_dir, self.args.save_total_limit)
        self.accelerator.wait_for_everyone()
        return final

    def load_round(self, path: str | Path) -> list[dict[str, Any]]:
        """Restore a ``checkpoint-<round>/`` written by :meth:`save_round` (call on every rank before the next
        round): the trained tensors, the optimizer state and the schedule's position; returns the statistics of the
        finished rounds. Tensors are read with safetensors and the optimizer state with ``weights_only=True``."""
        import torch
        from safetensors.torch import load_file
        from transformers.trainer_callback import TrainerState

        path = Path(path)
        if not self.checkpoints_whole():
            raise UserError(f"quark: cannot resume from {path.name} here: the launch config shards the weights or "
                            "the optimizer (DeepSpeed ZeRO or FSDP), which Quark's round checkpoints do not hold; "
                            "re-run with the launch config that wrote it, or start the stage again")
        if self.lr_scheduler is not None:
            raise ValueError("load_round must be called before the first round trains")
        tensors = load_file(str(path / TRAINED_TENSORS))
        trained = self.trained_tensors()
        if set(tensors) != set(trained):
            differ = sorted(set(tensors) ^ set(trained))
            raise UserError(f"quark: {path} does not match this model ({len(differ)} trained tensors differ, "
                            f"e.g. {differ[0]})")
        with torch.no_grad():
            for name, parameter in trained.items():
                parameter.copy_(tensors[name])
        if self.optimizer is None:
            self.create_optimizer()  # the one train() would build; it keeps an existing optimizer
        self.optimizer.load_state_dict(torch.load(path / OPTIMIZER_STATE, map_location="cpu", weights_only=True))
        state = TrainerState.load_from_json(str(path / "trainer_state.json"))
        self.resumed_steps = int(state.global_step)
        return json.loads((path / ROUND_STATS).read_text(encoding="utf-8"))

    def reference_logits(self, model: Any, input_ids: Any, attention_mask: Any) -> Any:
        """The reference's logits, without gradients (and in eval mode: no dropout, no checkpointing)."""
        import torch

        with torch.no_grad():
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
        """Per-token NLL and KL at the response positions, the response mask, and the policy's outputs."""
        input_ids, attention_mask, targets = inputs["input_ids"], inputs["attention_mask"], inputs["shift_labels"]
        outputs = model(input_ids=input_ids, attention_mask=attention_mask)
        logits = outputs.logits[:, :-1]
        mask = targets != IGNORE_INDEX
        log_probs = logits.float().log_softmax(dim=-1)
        nll = -log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        reference = self.reference_logits(model, input_ids, attention_mask)[:, :-1]
        kl = token_kl(logits, reference)
        return nll, kl, mask, outputs

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        nll, kl, mask, outputs = self.token_terms(model, inputs)
        mask = mask.to(nll.dtype)
        nll_sum, kl_sum = (nll * mask).sum(), (kl * mask).sum()
        tokens = mask.sum()
        denominator = num_items_in_batch if num_items_in_batch is not None else tokens.clamp(min=1)
        loss = (nll_sum + self.args.kl_coef * kl_sum) / denominator
        summed = self.args.average_tokens_across_devices and num_items_in_batch is not None
        if summed and self.args.world_size > 1:
            loss = loss * self.accelerator.num_processes  # the token count was summed over processes
        if model.training:
            n = int(tokens.item())
            for terms in (self._log_terms, self.round_terms):
                terms[0] += float(nll_sum.detach().item())
                terms[1] += float(kl_sum.detach().item())
                terms[2] += n
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        nll, kl, tokens = self._log_terms
        if "loss" in logs and tokens:
            logs = {**logs, "nll": round(nll / tokens, 6), "kl": round(kl / tokens, 6)}
            self._log_terms = [0.0, 0.0, 0]
        # Each round's train() counts its steps from 0; the log entries and the report_to trackers get the run's
        # optimizer step, so the rounds follow one another on one axis.
        round_step = self.state.global_step
        self.state.global_step = self.steps_before_round + round_step
        try:
            super().log(logs, start_time)
        finally:
            self.state.global_step = round_step

    def measure(self, examples: Sequence[dict[str, list[int]]], batch_size: int = 8) -> dict[str, float]:
        """Mean per-token NLL and KL(policy || reference) over ``examples``, in eval mode, not training."""
        import torch

        model = self.model
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
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


def round_training_args(args: QuarkMethodConfig) -> QuarkMethodConfig:
    """``args`` with what a round's ``train()`` needs: ``max_steps`` = ``steps_per_round`` and the gradient
    accumulation that makes ``step_batch_size`` from micro-batches of ``per_device_train_batch_size`` on every
    process. A ``gradient_accumulation_steps`` other than 1 must agree with it."""
    micro = args.per_device_train_batch_size * args.world_size
    if args.step_batch_size % micro:
        raise UserError(f"quark: step_batch_size {args.step_batch_size} is not a multiple of "
                        f"per_device_train_batch_size x processes = {micro}")
    accumulation = args.step_batch_size // micro
    if args.gradient_accumulation_steps not in (1, accumulation):
        raise UserError(f"quark: gradient_accumulation_steps is derived from step_batch_size "
                        f"({args.step_batch_size} = {accumulation} x {micro}); leave it unset, not "
                        f"{args.gradient_accumulation_steps}")
    return dataclasses.replace(args, gradient_accumulation_steps=accumulation, max_steps=args.steps_per_round)


def build_quark_trainer(args: QuarkMethodConfig, model: Any, tokenizer: Any,
                        ref_model: Any = None) -> QuarkTrainer:
    """A :class:`QuarkTrainer` for ``args.rounds`` rounds; :func:`run_rounds` sets its dataset each round."""
    args = round_training_args(args)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if ref_model is not None:
        ref_model.eval().requires_grad_(False)
        placed = getattr(ref_model, "hf_device_map", None) is not None
        if not placed and getattr(ref_model, "quantization_method", None) is None:
            ref_model.to(args.device)
    return QuarkTrainer(model=model, args=args, data_collator=PadCollator(tokenizer.pad_token_id),
                        processing_class=tokenizer, ref_model=ref_model, rounds=args.rounds)


def round_prompts(n_records: int, args: QuarkMethodConfig, seed: int) -> list[list[int]]:
    """Record indices of every round: a seeded order of all records, taken ``prompts_per_round`` at a time and
    wrapping around, so every round has the same number of prompts (and of kept samples)."""
    order = list(range(n_records))
    random.Random(seed).shuffle(order)
    per_round = min(args.prompts_per_round or n_records, n_records)
    return [[order[(r * per_round + j) % n_records] for j in range(per_round)] for r in range(args.rounds)]


def sample_pool(model: Any, tokenizer: Any, queries: Sequence[Sequence[int]], args: QuarkMethodConfig, *,
                seed: int, sharded: bool = False) -> list[list[Sample]]:
    """``rollouts_per_prompt`` samples per tokenized prompt from the policy as it is now (in eval mode); with
    ``sharded``, the batches split across ranks and gathered (:func:`alpacafarm.sampling.sample`)."""
    was_training = model.training
    model.eval()
    try:
        return sample(model, tokenizer, queries, n=args.rollouts_per_prompt, temperature=args.temperature,
                      top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                      batch_size=args.generation_batch_size, seed=seed, sharded=sharded)
    finally:
        model.train(was_training)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def run_rounds(trainer: QuarkTrainer, records: Sequence[dict[str, Any]], score: RewardFunction, *,
               out_dir: str | Path, prompt_format: PromptFormat | str = "alpaca", seed: int = 0,
               logger: Any = None, progress: Callable[[int], None] | None = None,
               resume_from: str | Path | None = None) -> list[dict[str, Any]]:
    """The Quark loop: each round sample a fresh pool, score it, keep the top quantile, train; returns stats.

    A round's training is ``steps_per_round`` optimizer steps, each on ``step_batch_size`` examples drawn from
    the kept samples by :func:`draw_order` (seeded by ``seed`` and the round).

    ``prompt_format`` writes the prompts: a :class:`~alpacafarm.prompts.PromptFormat` (the method's carries
    the SFT folder's conditioning) or a style name (no conditioning). ``score`` is an
    :data:`alpacafarm.rewards.RewardFunction`. Writes ``round_<r>/pool.jsonl`` under ``out_dir``. Nothing
    survives a round but the policy's weights and the optimizer: the pool, its scores and the kept set are
    rebuilt from scratch every time.

    Under several processes every rank calls this: the pool's sampling batches are split across ranks and
    gathered (the pool one process samples), each rank scores a share of it, the trainer's steps are data
    parallel (accelerate), the round's NLL and KL are summed over ranks, and the main process writes the pool.

    Every ``save_rounds`` rounds a ``checkpoint-<round>/`` is written under ``out_dir``
    (:meth:`QuarkTrainer.save_round`); ``resume_from`` (such a folder) restores it and starts at the next round,
    the finished rounds' statistics coming back from it.
    """
    from alpacafarm import distributed
    from alpacafarm.data import write_jsonl
    args: QuarkMethodConfig = trainer.args
    tokenizer = trainer.processing_class
    if not records:
        raise UserError("quark: the instruction split is empty")
    if isinstance(prompt_format, str):
        prompt_format = PromptFormat(prompt_format, tokenizer)
    queries = tokenize_prompts(tokenizer, prompt_format.records(records))
    stats: list[dict[str, Any]] = trainer.load_round(resume_from) if resume_from else []
    if stats and logger is not None:
        logger.info("quark: resumed from %s: rounds 1-%d done, continuing at round %d", Path(resume_from).name,
                    len(stats), len(stats) + 1)
    if stats and progress is not None:
        progress(len(stats))
    save = args.save_rounds > 0 and trainer.checkpoints_whole()
    if args.save_rounds > 0 and not save and logger is not None:
        logger.warning("quark: no round checkpoints: the launch config shards the weights or the optimizer "
                       "(DeepSpeed ZeRO or FSDP); a killed stage starts again from round 1")
    schedule = round_prompts(len(records), args, stable_seed(seed, "quark-prompts"))
    for r, indices in enumerate(schedule, start=1):
        if r <= len(stats):  # finished before the checkpoint: its pool is not sampled again
            continue
        started = time.perf_counter()
        groups = sample_pool(trainer.model, tokenizer, [queries[i] for i in indices], args,
                             seed=stable_seed(seed, "quark-round", r), sharded=distributed.world_size() > 1)
        pool = [(i, j, s) for i, group in zip(indices, groups, strict=True) for j, s in enumerate(group)]
        generated = time.perf_counter()

        def score_part(part: list[tuple[int, int, Sample]]) -> list[float]:
            scores = [float(x) for x in score([records[i] for i, _, _ in part], [s.text for _, _, s in part])]
            if len(scores) != len(part):
                raise ValueError(f"the scorer returned {len(scores)} rewards for {len(part)} rollouts")
            return scores

        rewards = distributed.map_sharded(score_part, pool, where=f"quark round {r}: scoring")
        kept = top_quantile(rewards, args.top_quantile)
        kept_set = set(kept)
        scored = time.perf_counter()
        if distributed.is_main():
            write_jsonl(Path(out_dir) / f"round_{r}" / "pool.jsonl", [
                {"round": r, "record_index": i, "sample_index": j, "instruction": records[i]["instruction"],
                 "input": records[i].get("input") or "", "output": s.text, "reward": reward,
                 "kept": k in kept_set, "finished": s.finished, "n_tokens": len(s.response_ids)}
                for k, ((i, j, s), reward) in enumerate(zip(pool, rewards, strict=True))])

        examples = [training_example(pool[k][2], train_eos=args.train_eos) for k in kept]
        draws = draw_order(len(examples), args.steps_per_round * args.step_batch_size,
                           stable_seed(seed, "quark-order", r))
        trainer.train_dataset = [examples[k] for k in draws]
        trainer.reset_round_terms()
        trainer.steps_before_round = (r - 1) * args.steps_per_round
        result = trainer.train()
        if distributed.world_size() > 1:  # every rank's tokens: the round's means over the whole step batches
            parts = distributed.all_gather_object(list(trainer.round_terms), f"quark round {r}")
            trainer.round_terms = [sum(part[k] for part in parts) for k in range(3)]
        terms = trainer.round_means()
        kept_rewards = [rewards[k] for k in kept]
        stat = {
            "round": r, "n_prompts": len(indices), "n_pool": len(pool), "n_kept": len(kept),
            "n_trained": len(draws),
            "reward_mean": _mean(rewards), "reward_kept_mean": _mean(kept_rewards),
            "threshold": min(kept_rewards),
            "reward_max": max(rewards), "train_loss": float(result.training_loss), "nll": terms["nll"],
            "kl": terms["kl"], "steps": int(trainer.state.global_step),
            "learning_rate": float(trainer.lr_scheduler.get_last_lr()[0]),
            "response_tokens_mean": _mean([len(s.response_ids) for _, _, s in pool]),
            "finished_rate": _mean([float(s.finished) for _, _, s in pool]),
            "seconds": {"rollout": round(generated - started, 3), "score": round(scored - generated, 3),
                        "train": round(time.perf_counter() - scored, 3)},
            "log_history": [dict(entry) for entry in trainer.state.log_history],
        }
        stats.append(stat)
        if logger is not None:
            logger.info("quark round %d/%d: pool reward %.4f, kept %.4f (threshold %.4f, %d of %d), "
                        "loss %.4f, nll %.4f, kl %.5f", r, args.rounds, stat["reward_mean"],
                        stat["reward_kept_mean"], stat["threshold"], len(kept), len(pool), stat["train_loss"],
                        terms["nll"] or 0.0, terms["kl"] or 0.0)
        del groups, pool, rewards, kept, examples  # the pool is discarded: the next round samples a fresh one
        trainer.train_dataset = None
        if save and r % args.save_rounds == 0:
            trainer.save_round(out_dir, r, stats)
        if progress is not None:
            progress(1)
    return stats
