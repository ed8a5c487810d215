"""``reward_model``: a Bradley-Terry surrogate reward model fitted on pairwise preferences with TRL's RewardTrainer.

Appendix A.2 of the paper: a classifier initialised from the SFT model is trained to maximise
``log sigmoid(R(x, y_chosen) - R(x, y_rejected))``. A seeded held-out share of the pairs measures how often the
model ranks the preferred output higher (``eval_accuracy``), scored with the same :class:`RewardScorer`
that later stages use, so the figure describes exactly what they will see.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl import RewardConfig

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.errors import UserError
from alpacafarm.method import Artifact, Method, Ranks, StageContext
from alpacafarm.model_loading import load_classifier, save_model
from alpacafarm.preference_rows import preference_rows, split_pairs
from alpacafarm.readings import default_store
from alpacafarm.rewards import POOLINGS, RewardScorer
from alpacafarm.training import (
    TrainingDefaults,
    fp32_master_weights,
    limit,
    resume_checkpoint,
    stage_training_args,
    train_summary,
)
from alpacafarm.training_progress import training_progress


@dataclass
class RewardModelConfig(TrainingDefaults, RewardConfig):
    """Every ``trl.RewardConfig`` / ``TrainingArguments`` field, plus the held-out split.

    Defaults follow the released script (``examples/scripts/reward_modeling.sh``; the paper states no reward-model
    settings): learning rate 3e-6, one epoch; its batch of 16 (1 per GPU x 2 accumulation x 8 GPUs) and cosine
    schedule with 3% warm-up are set in ``recipes/reward_model.yaml`` (a batch is per process here).
    ``bf16`` and gradient checkpointing are automatic (see ``alpacafarm.training``); ``output_dir`` is always the
    stage folder.
    """

    eval_fraction: float = field(default=0.1, metadata={"help": "share of the pairs held out for accuracy"})
    max_examples: int | None = field(default=None, metadata={"help": "use the first N usable pairs only"})
    score_batch_size: int = field(default=8, metadata={"help": "batch size when scoring the held-out pairs"})
    trainable_layers: int | None = field(default=None, metadata={
        "help": "train only the top N transformer blocks (and the final norm and score head); None: all. "
                "A CPU saving: backward then stops N blocks below the head (about 2.5x faster with N=4 of 30). "
                "0: the score head only, fitted on features computed once per distinct text (reward_head.py)"})

    ensemble_size: int = field(default=1, metadata={
        "help": "k > 1: an ensemble of k reward models (Coste et al. 2024), k heads on the frozen backbone, each "
                "on a bootstrap resample of the pairs; needs trainable_layers: 0. Consumers choose how members "
                "combine (their ensemble field: mean | worst | uncertainty_weighted)"})

    pooling: str = field(default="last", metadata={
        "help": "where the head reads the backbone: last (the answer's last token, as a transformers sequence "
                "classifier does) or mean (averaged over the answer's tokens: one token more or less barely moves "
                "it; benchmarks/gold_token_stability.py); mean needs trainable_layers: 0"})

    learning_rate: float = 3e-6
    num_train_epochs: float = 1.0
    max_length: int | None = 512

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError("eval_fraction must be in [0, 1)")
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError("max_examples must be at least 1")
        if self.trainable_layers is not None and self.trainable_layers < 0:
            raise ValueError("trainable_layers must be at least 0")
        if self.ensemble_size < 1:
            raise ValueError("ensemble_size must be at least 1")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {self.pooling!r}")
        if self.pooling != "last" and self.trainable_layers != 0:
            raise ValueError(f"pooling: {self.pooling} is a head on frozen features: set trainable_layers: 0 (a "
                             "fine-tuned reward model reads the last token, as TRL's RewardTrainer trains it)")
        if self.ensemble_size > 1 and self.trainable_layers != 0:
            raise ValueError("ensemble_size > 1 is built as k heads on the frozen backbone: set trainable_layers: 0 "
                             "(an ensemble of fine-tuned reward models is not built; TRL's RewardTrainer trains one "
                             "output)")
        super().__post_init__()


def pairwise_accuracy(scorer: RewardScorer, pairs: list[dict[str, str]], batch_size: int) -> dict[str, float]:
    """Share of pairs where score(chosen) > score(rejected), and the mean margin."""
    prompts = [p["prompt"] for p in pairs]
    chosen = scorer.score_answers(prompts, [p["chosen"] for p in pairs], batch_size=batch_size)
    rejected = scorer.score_answers(prompts, [p["rejected"] for p in pairs], batch_size=batch_size)
    wins = [c > r for c, r in zip(chosen, rejected, strict=True)]
    margins = [c - r for c, r in zip(chosen, rejected, strict=True)]
    return {"eval_accuracy": sum(wins) / len(wins), "eval_margin": sum(margins) / len(margins)}


def freeze_below(model: Any, trainable_layers: int) -> int:
    """Freeze every parameter except the top ``trainable_layers`` blocks, the final norm and the score head.

    Returns the number of trainable parameters. The blocks are the backbone's ``layers`` (Llama, Mistral, Qwen,
    SmolLM), ``h`` (GPT-2 style) or ``blocks`` list.
    """
    backbone = model.base_model
    blocks = next((getattr(backbone, name) for name in ("layers", "h", "blocks") if hasattr(backbone, name)), None)
    if blocks is None:
        raise UserError(f"trainable_layers: cannot find the transformer blocks of {type(model).__name__}")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    keep = [*(blocks[len(blocks) - trainable_layers:] if trainable_layers else []), model.score]
    for name in ("norm", "ln_f", "final_layer_norm"):
        if hasattr(backbone, name):
            keep.append(getattr(backbone, name))
    for module in keep:
        for parameter in module.parameters():
            parameter.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def build_reward_trainer(config: RewardModelConfig, spec: Any, model_path: str, rows: list[dict[str, str]],
                         *, callbacks: list[Any] | None = None) -> Any:
    """A ready ``RewardTrainer`` on prompt/chosen/rejected ``rows``, the classifier initialised from ``model_path``.

    Shared by the method and the overhead benchmark.
    """
    from datasets import Dataset
    from transformers import set_seed
    from trl import RewardTrainer

    from alpacafarm.model_loading import load_tokenizer, lora_config

    tokenizer = load_tokenizer(spec, model_path)
    # The score head (and LoRA adapters) are drawn before the Trainer seeds itself: seed first, or the reward
    # model depends on whatever ran before in the process (a resumed run would train a different one).
    set_seed(config.seed)
    model = load_classifier(spec, model_path, trainable=True)
    model.config.pad_token_id = tokenizer.pad_token_id  # the head reads the last token that is not padding
    if config.trainable_layers is not None:
        if spec.lora is not None:
            raise UserError("trainable_layers and a lora block both choose what trains: use one of them")
        freeze_below(model, config.trainable_layers)
    trainer = RewardTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                            processing_class=tokenizer, peft_config=lora_config(spec, task_type="SEQ_CLS"),
                            callbacks=callbacks)
    fp32_master_weights(trainer.model)
    return trainer


class RewardModel(Method):
    """Trains the surrogate reward model; writes ``model/`` and ``metrics.json`` (held-out accuracy)."""

    config_class = RewardModelConfig
    requires = (ArtifactName.SFT_MODEL, ArtifactName.PREFERENCES)
    provides = ArtifactName.REWARD_MODEL
    ranks = Ranks.ALL  # TRL's trainer distributes through accelerate; the main process saves and evaluates

    def run(self, context: StageContext) -> Artifact:
        from alpacafarm.data import write_json
        from alpacafarm.model_loading import load_tokenizer

        spec = context.recipe.model
        args = stage_training_args(self.config, context)
        model_path = context.input("sft_model").path
        records = context.records("preferences", "preferences")
        rows, dropped = preference_rows(records, style=spec.prompt_format, tokenizer=load_tokenizer(spec, model_path))
        rows = limit(rows, args.max_examples)
        train_rows, eval_rows = split_pairs(rows, args.eval_fraction, context.seed)
        if args.trainable_layers == 0:
            return self._run_head_only(context, args, model_path, rows, train_rows, eval_rows, dropped)
        trainer = build_reward_trainer(args, spec, model_path, train_rows)
        context.logger.info("stage %s: reward model on %d pairs (%d held out, %d without a preference)",
                            context.stage, len(trainer.train_dataset), len(eval_rows), dropped)
        with training_progress(trainer, context, "training (reward model)"):
            result = trainer.train(resume_from_checkpoint=resume_checkpoint(context))
        model_dir = Path(context.stage_dir) / "model"
        # The policy's rule: adapters trained on an adapter-folder SFT model are saved merged, so the folder
        # reloads as the model that was trained (its adapters alone would name the pre-SFT base). Every rank
        # calls it (ZeRO-3 gathers the weights); the main process writes, and scores below.
        merged = save_model(trainer.model, trainer.processing_class, model_dir, spec, start_from=model_path,
                            logger=context.logger)
        if not context.is_main:
            return Artifact("model", str(model_dir))
        metrics: dict[str, Any] = {
            **train_summary(trainer, result), "merged": merged, "n_pairs": len(rows), "n_train": len(train_rows),
            "n_train_within_max_length": len(trainer.train_dataset), "n_eval": len(eval_rows),
            "n_dropped_no_preference": dropped,
        }
        if eval_rows:
            scorer = RewardScorer.from_path(str(model_dir), spec, max_length=args.max_length,
                                            readings=default_store())
            metrics.update({k: round(v, 6)
                            for k, v in pairwise_accuracy(scorer, eval_rows, args.score_batch_size).items()})
        write_json(Path(context.stage_dir) / "metrics.json", {**metrics, "log_history": trainer.state.log_history})
        return Artifact("model", str(model_dir), metrics)

    def _run_head_only(self, context: StageContext, args: RewardModelConfig, model_path: str,
                       rows: list[dict[str, str]], train_rows: list[dict[str, str]],
                       eval_rows: list[dict[str, str]], dropped: int) -> Artifact:
        """``trainable_layers: 0``: features once per distinct text, then the head (see ``reward_head``).
        No trainer: it runs on the main process alone."""
        from alpacafarm.data import write_json
        from alpacafarm_methods.reward_model.head import train_head_only

        spec = context.recipe.model
        if spec.lora is not None or spec.quantization is not None:
            raise UserError("trainable_layers: 0 trains the score head only; remove the lora/quantization block "
                            "or set trainable_layers to null")
        if not context.is_main:
            return Artifact("model", str(Path(context.stage_dir) / "model"))
        context.logger.info("stage %s: head-only reward model on %d pairs (%d held out, %d without a preference)",
                            context.stage, len(train_rows), len(eval_rows), dropped)
        with context.progress("reward model: features", None) as advance:
            model, tokenizer, fitted = train_head_only(args, spec, model_path, train_rows, seed=context.seed,
                                                       progress=advance)
        model_dir = Path(context.stage_dir) / "model"
        save_model(model, tokenizer, model_dir, spec, start_from=model_path)
        history = fitted.pop("log_history")
        metrics: dict[str, Any] = {**fitted, "head_only": True, "n_pairs": len(rows), "n_train": len(train_rows),
                                   "n_eval": len(eval_rows), "n_dropped_no_preference": dropped}
        if eval_rows:
            scorer = RewardScorer.from_path(str(model_dir), spec, max_length=args.max_length,
                                            readings=default_store())
            metrics.update({k: round(v, 6)
                            for k, v in pairwise_accuracy(scorer, eval_rows, args.score_batch_size).items()})
        write_json(Path(context.stage_dir) / "metrics.json", {**metrics, "log_history": history})
        return Artifact("model", str(model_dir), metrics)
