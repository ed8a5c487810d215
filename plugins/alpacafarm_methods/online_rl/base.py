"""What ``grpo`` and ``rloo`` share: config fields, the reward sources, the prompt dataset, and the run itself.

Both wrap a TRL online trainer that samples ``num_generations`` completions per prompt from the policy, scores
them with ``reward_funcs`` and updates the policy against a per-prompt baseline. Our side is only the plumbing:

* Reward: the recipe's reward model (:meth:`~alpacafarm.method.StageContext.reward_function`, the scorer that
  best-of-n, PPO and the evaluation use) and/or rule-based rewards named ``"module:function"``, each a
  :data:`~alpacafarm.rewards.RewardFunction` ``(records, completions) -> scores``. :class:`TRLReward` adapts one to
  TRL's convention (keyword arguments: the completions and the dataset's columns), summed with ``reward_weights``.
  ``use_annotator: true`` adds the recipe's annotator itself (P(completion beats a reference answer), asked while
  training; cached, in the ledger, budgeted:
  :mod:`alpacafarm_methods.online_rl.annotator_reward`, with its cost per step).
* Prompts: the SFT model folder's :class:`~alpacafarm.prompts.PromptFormat` (with its conditioning), as plain
  strings (TRL's "standard" format), so training samples exactly the prompts generation and scoring use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, StageContext
from alpacafarm.rewards import EnsembleOptions, check_ensemble
from alpacafarm.training import TrainingDefaults
from alpacafarm_methods.online_rl.annotator_reward import ANNOTATOR_REFERENCES


@dataclass
class OnlineRLOptions(TrainingDefaults, EnsembleOptions):
    """Fields of both configs; inherit it first: ``@dataclass class X(OnlineRLOptions, trl.XConfig)``."""

    split: str = field(default="train", metadata={"help": "file (or named file) of the instruction_splits input"})
    max_instructions: int | None = field(default=None, metadata={"help": "use the first N prompts only"})
    use_reward_model: bool = field(default=True, metadata={"help": "score with the recipe's reward model"})
    rule_rewards: list[str] = field(default_factory=list, metadata={
        "help": "rule rewards as 'module:function', each (records, completions) -> list[float]"})
    score_batch_size: int = field(default=8, metadata={"help": "batch size of reward-model scoring"})
    score_max_length: int | None = field(default=None, metadata={"help": "truncate scored texts to N tokens"})
    use_annotator: bool = field(default=False, metadata={
        "help": "reward = the recipe's annotator's P(completion beats a reference answer), asked while training"})
    annotator_reference: str = field(default="recorded", metadata={
        "help": "the annotator reward's reference: 'recorded' (the prompt record's reference_field) or 'sft' "
                "(one SFT-model answer per prompt, sampled before training)"})
    reference_field: str = field(default="reference", metadata={"help": "the prompt records' reference answer"})
    reference_batch_size: int = field(default=8, metadata={"help": "prompts per batch when sampling SFT references"})
    max_unlabelled_fraction: float = field(default=0.05, metadata={
        "help": "the annotator reward fails the stage when more of a batch's pairs than this have no label"})
    logging_steps: float = 1  # TRL's 10: the reward of every step goes into metrics.json (as PPO's)

    def __post_init__(self) -> None:
        if self.max_instructions is not None and self.max_instructions < 1:
            raise ValueError("max_instructions must be at least 1")
        if self.annotator_reference not in ANNOTATOR_REFERENCES:
            raise ValueError(f"annotator_reference must be {' or '.join(map(repr, ANNOTATOR_REFERENCES))}, "
                             f"got {self.annotator_reference!r}")
        check_ensemble(self.ensemble, self.ensemble_coefficient)
        if not 0.0 <= self.max_unlabelled_fraction <= 1.0:
            raise ValueError("max_unlabelled_fraction must be in [0, 1]")
        bad = [t for t in self.rule_rewards if t.count(":") != 1]
        if bad:
            raise ValueError(f"rule_rewards: {bad[0]!r} is not of the form 'module:function'")
        # TRL derives steps_per_generation from generation_batch_size and then refuses both being set, which is what
        # dataclasses.replace (stage_training_args) hands back: re-derive it, and insist only on agreement.
        given = self.steps_per_generation if self.generation_batch_size is not None else None
        if given is not None:
            self.steps_per_generation = None
        super().__post_init__()
        if given is not None and given != self.steps_per_generation:
            raise ValueError(f"steps_per_generation ({given}) disagrees with generation_batch_size "
                             f"({self.generation_batch_size}); set only one of them")


class TRLReward:
    """A :data:`~alpacafarm.rewards.RewardFunction` called the TRL way (records rebuilt from the row columns)."""

    def __init__(self, name: str, function: Any) -> None:
        self.__name__ = name  # TRL logs rewards/<name>/mean
        self.function = function

    def __call__(self, prompts: list[Any], completions: list[str], instruction: list[str], input: list[str],
                 **_: Any) -> list[float]:
        records = [{"instruction": i, "input": x} for i, x in zip(instruction, input, strict=True)]
        return [float(score) for score in self.function(records, list(completions))]


def reward_sources(context: StageContext, config: Any) -> list[Any]:
    """The reward model (if wired and wanted), the rule rewards and the annotator (if wanted), in that order (as
    ``reward_weights``)."""
    from alpacafarm.registry import import_target

    sources = []
    if config.use_reward_model:
        if "reward_model" not in context.inputs:
            raise UserError(f"stage {context.stage!r}: use_reward_model is true but no reward_model input is wired; "
                            "add a reward_model stage before it, or set use_reward_model: false and name rule_rewards")
        scorer = context.reward_function(batch_size=config.score_batch_size, max_length=config.score_max_length,
                                         ensemble=config.ensemble, ensemble_coefficient=config.ensemble_coefficient)
        sources.append(TRLReward("reward_model", scorer))
    for target in config.rule_rewards:
        name = target.rpartition(":")[2].rpartition(".")[2]
        name = target if name in [s.__name__ for s in sources] else name
        sources.append(TRLReward(name, import_target(target, what=f"stage {context.stage!r}: rule_rewards")))
    if config.use_annotator:
        from alpacafarm_methods.online_rl.annotator_reward import AnnotatorReward

        context.annotator_ref("feedback")  # a recipe without an annotator fails here, before any model loads
        sources.append(AnnotatorReward(context, config.max_unlabelled_fraction))
    if not sources:
        raise UserError(f"stage {context.stage!r} has no reward source: wire a reward_model stage "
                        "(use_reward_model: true), name rule_rewards ('module:function') or set use_annotator: true")
    if config.reward_weights is not None and len(config.reward_weights) != len(sources):
        raise UserError(f"stage {context.stage!r}: {len(config.reward_weights)} reward_weights for "
                        f"{len(sources)} reward sources ({', '.join(s.__name__ for s in sources)})")
    return sources


def prompt_rows(records: list[dict[str, Any]], fmt: Any, tokenizer: Any) -> list[dict[str, str]]:
    """``{"prompt", "instruction", "input"}`` per record. TRL tokenizes standard prompts with the tokenizer's
    special tokens, so a BOS the chat template already wrote is dropped from the text (it comes back once)."""
    bos = tokenizer.bos_token
    adds_bos = bool(bos) and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]
    rows = []
    for record in records:
        prompt = fmt(record["instruction"], record.get("input"))
        rows.append({"prompt": prompt[len(bos):] if adds_bos and prompt.startswith(bos) else prompt,
                     "instruction": record["instruction"], "input": record.get("input") or ""})
    return rows


def run_online_rl(context: StageContext, config: Any, trainer_class: Any, algorithm: str) -> Artifact:
    """Train the SFT model with ``trainer_class`` (GRPOTrainer / RLOOTrainer); writes ``model/``, ``metrics.json``."""
    from datasets import Dataset
    from transformers import set_seed

    from alpacafarm.data import write_json
    from alpacafarm.model_loading import (
        is_adapter_folder,
        load_merged_causal_lm,
        load_tokenizer,
        lora_config,
        save_model,
    )
    from alpacafarm.prompts import PromptFormat
    from alpacafarm.training import (
        fp32_master_weights,
        limit,
        resume_checkpoint,
        stage_training_args,
        train_summary,
    )
    from alpacafarm.training_progress import training_progress
    from alpacafarm_methods.online_rl.annotator_reward import AnnotatorReward, attach_references

    spec, model_path = context.recipe.model, context.input("sft_model").path
    args = stage_training_args(config, context)
    records = limit(context.records("instruction_splits", args.split), args.max_instructions)
    if not records or any(not r.get("instruction") for r in records):
        raise UserError(f"stage {context.stage!r}: the instruction_splits input ({args.split!r}) has no records, "
                        "or a record without an 'instruction'")
    if spec.lora is None and args.beta and is_adapter_folder(model_path):
        # TRL would build the reference from the config's base model name, i.e. the model before SFT.
        raise UserError(f"stage {context.stage!r}: full fine-tuning with beta > 0 from an adapter folder needs the "
                        "SFT adapters merged (merge_adapters: true) or model.lora set")
    rewards = reward_sources(context, args)
    tokenizer = load_tokenizer(spec, model_path)
    rows = prompt_rows(records, PromptFormat.for_model(spec.prompt_format, model_path, tokenizer), tokenizer)
    annotator = next((r for r in rewards if isinstance(r, AnnotatorReward)), None)
    if annotator is not None:
        attach_references(context, args, records, rows)
    set_seed(args.seed)  # fresh LoRA adapters are drawn before the Trainer seeds itself
    trainer = trainer_class(model=load_merged_causal_lm(spec, model_path, trainable=True), reward_funcs=rewards,
                            args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                            peft_config=lora_config(spec))
    fp32_master_weights(trainer.model)
    context.logger.info("stage %s: %s on %d prompts, %d completions each, beta %g, rewards: %s", context.stage,
                        algorithm, len(rows), args.num_generations, args.beta, ", ".join(r.__name__ for r in rewards))
    try:
        with training_progress(trainer, context, f"training ({algorithm})"):
            result = trainer.train(resume_from_checkpoint=resume_checkpoint(context))
    finally:
        if annotator is not None:
            annotator.close()
    model_dir = Path(context.stage_dir) / "model"
    merged = save_model(trainer.model, trainer.processing_class, model_dir, spec, start_from=model_path,
                        logger=context.logger)  # every rank; the main one writes
    if not context.is_main:
        return Artifact("model", str(model_dir))
    logged = [e["reward"] for e in trainer.state.log_history if e.get("reward") is not None]
    metrics = {**train_summary(trainer, result), "reward_first": logged[0] if logged else None,
               "reward_last": logged[-1] if logged else None, "n_prompts": len(rows),
               "num_generations": args.num_generations, "beta": args.beta,
               "reward_sources": [r.__name__ for r in rewards], "lora": spec.lora is not None, "merged": merged}
    if annotator is not None:
        metrics["annotator"] = {"reference": args.annotator_reference, **annotator.summary(trainer.state.global_step,
                                                                                 trainer.state.log_history)}
    write_json(Path(context.stage_dir) / "metrics.json", {**metrics, "log_history": trainer.state.log_history})
    return Artifact("model", str(model_dir), metrics)
