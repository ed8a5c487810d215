"""``quark``: the best-quantile variant of Quark that AlpacaFarm evaluates (paper Section 3.4, A.2, Appendix B.2).

Each round (a "Quark step" in the paper):

1. take the round's prompts from the training instructions (a seeded order, cycled: ``prompts_per_round`` at a
   time, the paper's rollout batch of 512) and sample ``rollouts_per_prompt`` responses each from the *current*
   policy;
2. score every rollout with the surrogate reward model (:class:`alpacafarm_trl.scoring.RewardScorer`);
3. keep the top ``top_quantile`` of the pool by reward (the best bin; the other bins are not trained on);
4. train the policy on the kept samples with ``NLL + kl_coef * KL(policy || reference)``, the reference being the
   SFT model and the KL the exact per-token divergence of the two next-token distributions at each response
   position of the kept samples, averaged over response tokens;
5. discard the pool: the next round samples a fresh one (the paper's change to Quark, B.2: constant cost per round).

Quark's control tokens play no part in the best-quantile variant (only one bin is trained on, so there is nothing to
condition on) and, following B.2, there is no entropy term. The optimizer and the learning-rate schedule span the
whole run (the peak rate decays to 0 over all rounds), not one round.

With ``lora:`` in the model block the policy is the SFT model plus fresh LoRA adapters and the reference is the
same network with the adapters switched off (``with model.disable_adapter():``): there is no second copy of the
model. Without LoRA a frozen copy of the SFT model is the reference.

Files: ``round_<r>/pool.jsonl`` (every rollout of round ``r``, 1-based, with its reward and whether it was kept),
``metrics.json`` (per-round statistics and the trainer's log history) and ``model/``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainingArguments

from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, StageContext
from alpacafarm.seeding import stable_seed
from alpacafarm.prompts import format_prompt
from alpacafarm_trl.training import apply_device_defaults, stage_training_args

#: ``score(records, completions) -> rewards``: the method uses the reward model; tests of the loop may inject one.
ScoreFn = Callable[[Sequence[dict[str, Any]], Sequence[str]], list[float]]
IGNORE_INDEX = -100


@dataclass
class QuarkMethodConfig(TrainingArguments):
    """Every ``transformers.TrainingArguments`` field (they apply to each round's training), plus the rollout loop.

    Defaults follow Appendix B.2: KL coefficient 0.05, peak learning rate 3e-6 decaying linearly to 0 over the
    whole run, 512 rollouts per round, 2 epochs over each round's kept samples, gradient clipping at norm 1,
    390 rounds (10 passes over the 20k unlabeled instructions). The share kept (``top_quantile`` 0.2, one of
    five reward bins), the sampling temperature (1.0) and ``max_new_tokens`` (300, the paper's decoding cap)
    are our assumptions: the paper does not state them for Quark. ``num_train_epochs`` / ``max_steps`` count per
    round; ``output_dir`` is always the stage folder; checkpoints are off (a round's trainer state cannot resume
    the rollout loop).
    """

    rounds: int = field(default=390, metadata={"help": "rollout-score-train rounds (the paper's Quark steps)"})
    prompts_per_round: int | None = field(
        default=512, metadata={"help": "instructions sampled per round, cycling through a seeded order (None: all)"})
    rollouts_per_prompt: int = field(default=1, metadata={"help": "samples drawn per instruction in a round"})
    top_quantile: float = field(default=0.2, metadata={"help": "share of each round's pool kept (highest rewards)"})
    kl_coef: float = field(default=0.05, metadata={"help": "beta: weight of KL(policy || SFT reference)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of the rollouts"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling threshold of the rollouts"})
    max_new_tokens: int = field(default=300, metadata={"help": "longest rollout, in tokens"})
    generation_batch_size: int = field(default=16, metadata={"help": "prompts per generate() call"})
    score_batch_size: int = field(default=16, metadata={"help": "texts per reward-model forward pass"})
    split: str = field(default="train", metadata={"help": "file (or metadata key) of the instruction splits input"})
    max_instructions: int | None = field(default=None, metadata={"help": "use the first N instructions only"})

    learning_rate: float = 3e-6
    lr_scheduler_type: str = "linear"
    num_train_epochs: float = 2.0
    max_grad_norm: float = 1.0
    logging_steps: float = 1
    save_strategy: str = "no"
    bf16: bool | None = None
    gradient_checkpointing: bool | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.rounds >= 1, "rounds must be at least 1"),
            (self.prompts_per_round is None or self.prompts_per_round >= 1, "prompts_per_round must be at least 1"),
            (self.rollouts_per_prompt >= 1, "rollouts_per_prompt must be at least 1"),
            (0.0 < self.top_quantile <= 1.0, "top_quantile must be in (0, 1]"),
            (self.kl_coef >= 0.0, "kl_coef must be non-negative"),
            (self.temperature > 0.0, "temperature must be positive (rollouts are sampled)"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.max_new_tokens >= 1, "max_new_tokens must be at least 1"),
            (self.generation_batch_size >= 1, "generation_batch_size must be at least 1"),
            (self.score_batch_size >= 1, "score_batch_size must be at least 1"),
            (self.max_instructions is None or self.max_instructions >= 1, "max_instructions must be at least 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        apply_device_defaults(self)
        super().__post_init__()


# ------------------------------------------------------------------------------------------------ rollouts


@dataclass
class Rollout:
    """One sampled response: the exact token ids the policy produced (the training example) and its text."""

    prompt_ids: list[int]
    response_ids: list[int]
    text: str
    finished: bool  # ended with an EOS token (not cut at max_new_tokens)


def stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """EOS ids that end a response: the tokenizer's and the generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return ids


def sample_rollouts(model: Any, tokenizer: Any, prompts: Sequence[str], *, n: int, temperature: float, top_p: float,
                    max_new_tokens: int, batch_size: int, seed: int) -> list[list[Rollout]]:
    """``n`` sampled responses per prompt from ``model`` as it is now, in the prompts' order.

    Batched with left padding, longest prompts first; each batch is seeded from ``seed`` and its position, so a
    round's pool is reproducible. A response is cut after its first EOS (which is kept: the policy learns to stop).
    """
    import torch

    stops = stop_token_ids(model, tokenizer)
    bos = tokenizer.bos_token
    add_special = not (bos and all(p.startswith(bos) for p in prompts))  # chat templates carry their own BOS
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    results: list[list[Rollout]] = [[] for _ in prompts]
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    try:
        for start in range(0, len(order), batch_size):
            indices = order[start:start + batch_size]
            batch = tokenizer([prompts[i] for i in indices], return_tensors="pt", padding=True,
                              add_special_tokens=add_special).to(device)
            torch.manual_seed(stable_seed(seed, start))
            with torch.no_grad():
                output = model.generate(**batch, do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                                        max_new_tokens=max_new_tokens, num_return_sequences=n, use_cache=True,
                                        pad_token_id=tokenizer.pad_token_id)
            width = batch["input_ids"].shape[1]
            for row, index in enumerate(indices):
                mask = batch["attention_mask"][row].bool()
                prompt_ids = batch["input_ids"][row][mask].tolist()
                for j in range(n):
                    generated = output[row * n + j, width:].tolist()
                    end = next((k for k, token in enumerate(generated) if token in stops), None)
                    response = generated if end is None else generated[:end + 1]
                    text = tokenizer.decode(response, skip_special_tokens=True).strip()
                    results[index].append(Rollout(prompt_ids, response, text, end is not None))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return results


def kept_count(pool_size: int, quantile: float) -> int:
    """How many of a pool form its top ``quantile``: ``ceil(quantile * pool_size)``, at least one."""
    return min(pool_size, max(1, math.ceil(round(quantile * pool_size, 9))))


def top_quantile(rewards: Sequence[float], quantile: float) -> list[int]:
    """Indices (ascending) of the ``kept_count`` highest rewards; ties at the threshold go to the earlier index."""
    ranked = sorted(range(len(rewards)), key=lambda i: (-rewards[i], i))
    return sorted(ranked[:kept_count(len(rewards), quantile)])


def training_example(rollout: Rollout) -> dict[str, list[int]]:
    """Prompt + response ids; only the response is a target (the prompt's labels are ignored)."""
    return {"input_ids": rollout.prompt_ids + rollout.response_ids,
            "labels": [IGNORE_INDEX] * len(rollout.prompt_ids) + rollout.response_ids}


class PadCollator:
    """Right-pads ``input_ids`` (pad id) and ``labels`` (ignored) and builds the attention mask."""

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
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "attention_mask": torch.tensor(mask)}


# ------------------------------------------------------------------------------------------------ the trainer


def token_kl(policy_logits: Any, reference_logits: Any) -> Any:
    """KL(policy || reference) of the next-token distributions at every position (float32, shape ``[..., ]``)."""
    import torch

    log_p = torch.log_softmax(policy_logits.float(), dim=-1)
    log_q = torch.log_softmax(reference_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


class QuarkTrainer(Trainer):
    """A ``Trainer`` whose loss is ``NLL(kept samples) + kl_coef * KL(policy || reference)`` per response token.

    ``ref_model`` is a frozen reference; ``None`` means the policy is a peft model whose reference is itself with
    the adapters disabled. Each round sets ``train_dataset`` and calls :meth:`train` again: the optimizer is kept,
    and the learning-rate schedule is built once for ``rounds`` times the first round's steps (every round keeps
    the same number of samples), so the rate decays over the whole run.
    """

    loss_is_scaled_for_ga = True  # compute_loss divides by the response tokens of the whole accumulated batch

    def __init__(self, *args: Any, ref_model: Any = None, rounds: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ref_model = ref_model
        self.rounds = rounds
        # Count the response tokens of each accumulated batch (labels shifted by one) for compute_loss.
        self.model_accepts_loss_kwargs = True
        self._loss_shifts_labels = True
        if ref_model is None and not hasattr(self.accelerator.unwrap_model(self.model), "disable_adapter"):
            raise ValueError("QuarkTrainer needs a ref_model unless the policy is a peft model with adapters")
        self._log_terms = [0.0, 0.0, 0]    # nll sum, kl sum, tokens since the last log
        self.round_terms = [0.0, 0.0, 0]   # the same since reset_round_terms()

    def reset_round_terms(self) -> None:
        self.round_terms = [0.0, 0.0, 0]

    def round_means(self) -> dict[str, float | None]:
        nll, kl, tokens = self.round_terms
        return {"nll": nll / tokens if tokens else None, "kl": kl / tokens if tokens else None}

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        from transformers import get_scheduler

        if self.lr_scheduler is None:  # built once (``_created_lr_scheduler`` stays False, so train() keeps it)
            total = num_training_steps * self.rounds
            self.lr_scheduler = get_scheduler(
                self.args.lr_scheduler_type, optimizer=optimizer or self.optimizer,
                num_warmup_steps=self.args.get_warmup_steps(total), num_training_steps=total,
                scheduler_specific_kwargs=self.args.lr_scheduler_kwargs or {})
        return self.lr_scheduler

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
        input_ids, attention_mask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["labels"]
        outputs = model(input_ids=input_ids, attention_mask=attention_mask)
        logits = outputs.logits[:, :-1]
        targets = labels[:, 1:]
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
        if self.args.average_tokens_across_devices and num_items_in_batch is not None and self.args.world_size > 1:
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
        super().log(logs, start_time)

    def measure(self, examples: Sequence[dict[str, list[int]]], batch_size: int = 8) -> dict[str, float]:
        """Mean per-token NLL and KL(policy || reference) over ``examples``, in eval mode, without training."""
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
                    batch = {k: v.to(device) for k, v in self.data_collator(list(examples[start:start + batch_size])).items()}
                    nll, kl, mask, _ = self.token_terms(model, batch)
                    nll_sum += float((nll * mask).sum())
                    kl_sum += float((kl * mask).sum())
                    tokens += int(mask.sum())
        finally:
            model.train(was_training)
        return {"nll": nll_sum / max(tokens, 1), "kl": kl_sum / max(tokens, 1), "tokens": tokens}


def build_quark_trainer(args: QuarkMethodConfig, model: Any, tokenizer: Any, ref_model: Any = None) -> QuarkTrainer:
    """A :class:`QuarkTrainer` for ``args.rounds`` rounds; its dataset is set per round by :func:`run_rounds`."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if ref_model is not None:
        ref_model.eval().requires_grad_(False)
        if getattr(ref_model, "hf_device_map", None) is None and getattr(ref_model, "quantization_method", None) is None:
            ref_model.to(args.device)
    return QuarkTrainer(model=model, args=args, data_collator=PadCollator(tokenizer.pad_token_id),
                        processing_class=tokenizer, ref_model=ref_model, rounds=args.rounds)


# ------------------------------------------------------------------------------------------------ the rounds


def round_prompts(n_records: int, args: QuarkMethodConfig, seed: int) -> list[list[int]]:
    """Record indices of every round: a seeded order of all records, taken ``prompts_per_round`` at a time and
    wrapping around, so every round has the same number of prompts (and of kept samples)."""
    order = list(range(n_records))
    random.Random(seed).shuffle(order)
    per_round = min(args.prompts_per_round or n_records, n_records)
    return [[order[(r * per_round + j) % n_records] for j in range(per_round)] for r in range(args.rounds)]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def run_rounds(trainer: QuarkTrainer, records: Sequence[dict[str, Any]], score: ScoreFn, *, out_dir: str | Path,
               prompt_format: str = "alpaca", seed: int = 0, logger: Any = None,
               progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """The Quark loop: per round sample a fresh pool, score it, keep the top quantile, train; returns round stats.

    Writes ``round_<r>/pool.jsonl`` under ``out_dir``. Nothing survives a round but the policy's weights and the
    optimizer: the pool, its scores and the kept set are rebuilt from scratch every time.
    """
    from alpacafarm.data import write_jsonl

    args: QuarkMethodConfig = trainer.args
    tokenizer = trainer.processing_class
    if not records:
        raise UserError("quark: the instruction split is empty")
    prompts = [format_prompt(r["instruction"], r.get("input") or None, style=prompt_format, tokenizer=tokenizer)
               for r in records]
    stats: list[dict[str, Any]] = []
    for r, indices in enumerate(round_prompts(len(records), args, stable_seed(seed, "quark-prompts")), start=1):
        started = time.perf_counter()
        rollouts = sample_rollouts(trainer.model, tokenizer, [prompts[i] for i in indices], n=args.rollouts_per_prompt,
                                   temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                                   batch_size=args.generation_batch_size, seed=stable_seed(seed, "quark-round", r))
        pool = [(i, j, rollout) for i, samples in zip(indices, rollouts, strict=True) for j, rollout in enumerate(samples)]
        generated = time.perf_counter()
        rewards = [float(x) for x in score([records[i] for i, _, _ in pool], [ro.text for _, _, ro in pool])]
        if len(rewards) != len(pool):
            raise ValueError(f"the scorer returned {len(rewards)} rewards for {len(pool)} rollouts")
        kept = top_quantile(rewards, args.top_quantile)
        kept_set = set(kept)
        scored = time.perf_counter()
        write_jsonl(Path(out_dir) / f"round_{r}" / "pool.jsonl", [
            {"round": r, "record_index": i, "sample_index": j, "instruction": records[i]["instruction"],
             "input": records[i].get("input") or "", "output": ro.text, "reward": reward, "kept": k in kept_set,
             "finished": ro.finished, "n_tokens": len(ro.response_ids)}
            for k, ((i, j, ro), reward) in enumerate(zip(pool, rewards, strict=True))])

        trainer.train_dataset = [training_example(pool[k][2]) for k in kept]
        trainer.reset_round_terms()
        result = trainer.train()
        terms = trainer.round_means()
        kept_rewards = [rewards[k] for k in kept]
        stat = {
            "round": r, "n_prompts": len(indices), "n_pool": len(pool), "n_kept": len(kept),
            "reward_mean": _mean(rewards), "reward_kept_mean": _mean(kept_rewards), "threshold": min(kept_rewards),
            "reward_max": max(rewards), "train_loss": float(result.training_loss), "nll": terms["nll"],
            "kl": terms["kl"], "steps": int(trainer.state.global_step),
            "learning_rate": float(trainer.lr_scheduler.get_last_lr()[0]),
            "response_tokens_mean": _mean([len(ro.response_ids) for _, _, ro in pool]),
            "finished_rate": _mean([float(ro.finished) for _, _, ro in pool]),
            "seconds": {"rollout": round(generated - started, 3), "score": round(scored - generated, 3),
                        "train": round(time.perf_counter() - scored, 3)},
            "log_history": [dict(entry) for entry in trainer.state.log_history],
        }
        stats.append(stat)
        if logger is not None:
            logger.info("quark round %d/%d: pool reward %.4f, kept %.4f (threshold %.4f, %d of %d), "
                        "loss %.4f, nll %.4f, kl %.5f", r, args.rounds, stat["reward_mean"], stat["reward_kept_mean"],
                        stat["threshold"], len(kept), len(pool), stat["train_loss"], terms["nll"] or 0.0,
                        terms["kl"] or 0.0)
        if progress is not None:
            progress(1)
        del rollouts, pool, rewards, kept  # the pool is discarded: the next round samples a fresh one
        trainer.train_dataset = None
    return stats


# ------------------------------------------------------------------------------------------------ models


def _load_sft_causal_lm(spec: Any, path: str) -> tuple[Any, bool]:
    """The SFT policy as plain weights, and whether it came from an adapter folder (merged into its base here)."""
    from alpacafarm.modeling import load_causal_lm
    from alpacafarm_trl.scoring import is_adapter_folder

    if not is_adapter_folder(path):
        return load_causal_lm(spec, path), False
    from peft import PeftConfig, PeftModel

    base = load_causal_lm(spec, PeftConfig.from_pretrained(path).base_model_name_or_path)
    return PeftModel.from_pretrained(base, path).merge_and_unload(), True


def load_policy_and_reference(spec: Any, sft_path: str, args: QuarkMethodConfig) -> tuple[Any, Any, bool]:
    """``(policy, reference or None, sft_was_adapters)`` for the recipe's model block.

    Full fine-tuning: the policy and a second, frozen copy of the SFT model. LoRA/QLoRA: the SFT model with new
    trainable adapters, and no reference model (the trainer disables the adapters to get the reference).
    """
    from alpacafarm.modeling import lora_config

    if spec.quantization is not None and spec.lora is None:
        raise UserError(f"quark: quantization: {spec.quantization} trains adapters only; add lora: to the model block")
    policy, from_adapters = _load_sft_causal_lm(spec, sft_path)
    if spec.lora is None:
        reference, _ = _load_sft_causal_lm(spec, sft_path)
        return policy, reference, from_adapters
    from peft import get_peft_model, prepare_model_for_kbit_training

    if spec.quantization is not None:
        policy = prepare_model_for_kbit_training(policy, use_gradient_checkpointing=bool(args.gradient_checkpointing))
    elif args.gradient_checkpointing:
        policy.enable_input_require_grads()  # frozen embeddings: checkpointed blocks need an input with a gradient
    return get_peft_model(policy, lora_config(spec)), None, from_adapters


class Quark(Method):
    """Quark (best quantile, fresh pool per round) against the surrogate reward model; writes ``model/``."""

    config_class = QuarkMethodConfig
    requires = ("sft_model", "reward_model", "instruction_splits")
    provides = "policy_model"
    description = "Quark, best-quantile variant: sample, score with the reward model, train on the top quantile + KL"

    def run(self, context: StageContext) -> Artifact:
        from alpacafarm.data import write_json
        from alpacafarm.modeling import load_tokenizer, save_model
        from alpacafarm_trl.scoring import RewardScorer

        spec = context.recipe.model
        save_strategy = getattr(self.config.save_strategy, "value", self.config.save_strategy)
        if save_strategy != "no":
            context.logger.warning("stage %s: save_strategy %r ignored; Quark rounds are not resumable from "
                                   "trainer checkpoints", context.stage, save_strategy)
        args = stage_training_args(self.config, context, save_strategy="no")
        records = context.records("instruction_splits", args.split)[: args.max_instructions]
        if not records:
            raise UserError(f"stage {context.stage}: the instruction split {args.split!r} is empty")
        sft_path = context.input("sft_model").path
        tokenizer = load_tokenizer(spec, sft_path)
        policy, reference, from_adapters = load_policy_and_reference(spec, sft_path, args)
        scorer = RewardScorer.from_path(context.input("reward_model").path, spec)

        def score(batch_records: Sequence[dict[str, Any]], completions: Sequence[str]) -> list[float]:
            return scorer.score_records(batch_records, completions, batch_size=args.score_batch_size)

        trainer = build_quark_trainer(args, policy, tokenizer, reference)
        context.logger.info("stage %s: Quark for %d rounds on %d instructions (%s reference)", context.stage,
                            args.rounds, len(records), "adapter-disabled" if reference is None else "frozen copy")
        with context.progress("quark rounds", args.rounds) as advance:
            rounds = run_rounds(trainer, records, score, out_dir=context.stage_dir, prompt_format=spec.prompt_format,
                                seed=context.seed, logger=context.logger, progress=advance)

        # New adapters on an SFT model that was itself adapters cannot name their base: save merged weights then.
        merge = bool(spec.lora) and (spec.merge_adapters or from_adapters)
        if merge and from_adapters and not spec.merge_adapters:
            context.logger.info("stage %s: the SFT model was LoRA adapters; saving merged weights", context.stage)
        tokenizer.padding_side = "right"
        model_dir = Path(context.stage_dir) / "model"
        save_model(trainer.model, tokenizer, model_dir, merge_adapters=merge)
        first, last = rounds[0], rounds[-1]
        metrics = {
            "rounds": len(rounds), "n_instructions": len(records), "pool_size": first["n_pool"],
            "kept_per_round": first["n_kept"], "reward_mean_first": first["reward_mean"],
            "reward_mean_last": last["reward_mean"], "reward_kept_mean_last": last["reward_kept_mean"],
            "kl_last": last["kl"], "train_loss_last": last["train_loss"],
            "steps": sum(s["steps"] for s in rounds), "lora": spec.lora is not None, "merged": merge,
            "reference": "adapter_disabled" if reference is None else "frozen_copy",
            "seconds": round(sum(sum(s["seconds"].values()) for s in rounds), 3),
        }
        per_round = [{k: v for k, v in s.items() if k != "log_history"} for s in rounds]
        log_history = [{**entry, "round": s["round"]} for s in rounds for entry in s["log_history"]]
        write_json(Path(context.stage_dir) / "metrics.json",
                   {**metrics, "per_round": per_round, "log_history": log_history})
        return Artifact("model", str(model_dir), metrics)
