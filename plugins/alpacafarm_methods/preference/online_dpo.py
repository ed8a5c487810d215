"""``online_dpo``: DPO on the current policy's own samples, labelled by the recipe's annotator while it trains.

Not in the paper (its DPO learns from pairs collected once, before training). Online AI feedback (Guo et al. 2024,
"Direct Language Model Alignment from Online AI Feedback") and iterative DPO (Xiong et al. 2024) ask the annotator
during training instead. Each of ``rounds`` rounds:

1. takes the next ``prompts_per_round`` instructions of the split (in order, wrapping around when they run out);
2. samples ``k`` answers to each from the *current* policy (round 1: the SFT model), at ``temperature``;
3. pairs them (``adjacent``: (s0, s1), (s2, s3), ...; ``all``: every pair; duplicates dropped) and has the recipe's
   feedback annotator (``annotator:``, any of them: an API pool, the offline pool with label noise) label the
   pairs through the annotation engine: cached, paid once, in the ledger, stopped by the annotator's
   ``max_cost_usd`` (a one-line error, exit status 2);
4. takes DPO steps (TRL's ``DPOTrainer``, its sigmoid loss by default) on the labelled pairs, starting from the
   current policy, against the reference: ``reference: sft`` (online DPO: always the SFT model) or ``previous``
   (iterative DPO: the policy the round started from). ``steps_per_round`` optimizer steps (default: ``max_steps``
   if set, else ``num_train_epochs`` over the round's pairs);

then the round's policy is the next round's sampler. Ties and pairs without a label carry no ranking and are not
trained on (counted); a round without a single ranked pair fails the stage. More pairs without a label than
``max_unlabelled_fraction`` fail the stage with one line naming the endpoint (exit status 1).

Files (in the stage folder)::

    round_<r>/pairs.jsonl        the round's pairs with their labels (written as soon as they are labelled)
    round_<r>/model/             the policy after the round (the last round's is the stage's output)
    round_<r>/metrics.json       the round's training log, labels and annotation cost
    round_<r>/round_complete.json

Resuming (a killed or failed run, re-run without ``--force``): a complete round is kept; a round whose pairs were
labelled trains on its recorded labels (nothing is sampled or asked again); any other round starts over, and its
labels come from the annotation cache where the same pairs were already paid for. Intermediate rounds' models are
saved in float32 (the master weights; a bfloat16 copy would round away small DPO updates between rounds); the
last one in the model block's ``save_dtype``.

Annotation cost: ``prompts_per_round * (k // 2)`` pairs a round with ``adjacent`` pairing (``k (k-1) / 2`` per
prompt with ``all``), times ``rounds``: the same budget as ``preference_data`` on ``rounds * prompts_per_round``
instructions with the same ``k`` and pairing.

Several processes: sampling is split across ranks (transformers backend), the main process annotates and writes,
every rank trains (TRL's trainer, accelerate) and the main process saves.
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trl import DPOConfig

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.errors import UserError
from alpacafarm.generation import SamplingConfig
from alpacafarm.method import Artifact, Method, Ranks, StageContext
from alpacafarm.recipe import GenerationBackendOptions
from alpacafarm.training import TrainingDefaults

ROUND_DONE = "round_complete.json"
PAIRS_FILE = "pairs.jsonl"
REFERENCES = ("sft", "previous")
PAIRINGS = ("adjacent", "all")


@dataclass
class OnlineDPOMethodConfig(TrainingDefaults, DPOConfig, GenerationBackendOptions):
    """Rounds, sampling and pairing, the reference, and every ``trl.DPOConfig`` / ``TrainingArguments`` field
    (applied to each round's DPO steps).

    Defaults: DPO's ``beta`` 0.1 and the released DPO script's learning rate 1e-6 and 512-token sequences; one
    epoch over each round's pairs; a constant learning rate (each round is a fresh trainer: a decaying schedule
    would restart every round). ``bf16`` and activation checkpointing are automatic; ``output_dir`` is the stage
    folder.
    """

    rounds: int = field(default=3, metadata={"help": "sample -> annotate -> DPO rounds"})
    prompts_per_round: int = field(default=64, metadata={"help": "instructions sampled each round"})
    k: int = field(default=2, metadata={"help": "samples per instruction (from the current policy)"})
    pairing: str = field(default="adjacent", metadata={"help": "'adjacent': (s0,s1),(s2,s3)...; 'all': every pair"})
    steps_per_round: int | None = field(default=None, metadata={
        "help": "optimizer steps per round (default: max_steps if set, else num_train_epochs over the round's pairs)"})
    reference: str = field(default="sft", metadata={
        "help": "'sft': the SFT model is the reference every round (online DPO); 'previous': the policy the round "
                "started from (iterative DPO)"})
    split: str = field(default="train", metadata={"help": "file (or named file) of the instruction_splits input"})
    max_instructions: int | None = field(default=None, metadata={"help": "use the first N instructions only"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (the paper's pairs: 1.0)"})
    top_p: float = 1.0
    max_new_tokens: int = field(default=300, metadata={"help": "longest sampled answer, tokens"})
    generation_batch_size: int = field(default=8, metadata={"help": "instructions per generation batch (x k)"})
    max_unlabelled_fraction: float = field(default=0.05, metadata={
        "help": "a round fails when more of its pairs than this have no label (failed or unparsed)"})

    beta: float = 0.1
    learning_rate: float = 1e-6
    num_train_epochs: float = 1.0
    lr_scheduler_type: str = "constant"
    max_length: int | None = 512
    logging_steps: float = 1

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.prompts_per_round < 1:
            raise ValueError("rounds and prompts_per_round must be at least 1")
        if self.k < 2:
            raise ValueError("k must be at least 2 (a pair needs two samples)")
        if self.pairing not in PAIRINGS:
            raise ValueError(f"pairing must be one of {', '.join(PAIRINGS)}, got {self.pairing!r}")
        if self.reference not in REFERENCES:
            raise ValueError(f"reference must be one of {', '.join(REFERENCES)}, got {self.reference!r}")
        if self.steps_per_round is not None and self.steps_per_round < 1:
            raise ValueError("steps_per_round must be at least 1")
        if self.max_instructions is not None and self.max_instructions < 1:
            raise ValueError("max_instructions must be at least 1")
        if not 0.0 <= self.max_unlabelled_fraction <= 1.0:
            raise ValueError("max_unlabelled_fraction must be in [0, 1]")
        if self.max_new_tokens < 1 or self.generation_batch_size < 1:
            raise ValueError("max_new_tokens and generation_batch_size must be at least 1")
        super().__post_init__()

    def sampling(self, seed: int) -> SamplingConfig:
        return SamplingConfig(n=self.k, temperature=self.temperature, top_p=self.top_p,
                              max_new_tokens=self.max_new_tokens, batch_size=self.generation_batch_size, seed=seed)


def round_prompts(records: list[dict[str, Any]], r: int, per_round: int) -> list[dict[str, Any]]:
    """Round ``r``'s instructions (1-based): the next ``per_round`` of ``records`` in order, wrapping around."""
    start = (r - 1) * per_round
    return [records[i % len(records)] for i in range(start, start + per_round)]


def sample_pairs(samples: list[str], pairing: str) -> list[tuple[str, str]]:
    """Pairs of distinct, non-empty samples (duplicates dropped first, order kept): they would only ever tie."""
    unique = list(dict.fromkeys(s for s in samples if s.strip()))
    if pairing == "all":
        return list(itertools.combinations(unique, 2))
    return [(unique[i], unique[i + 1]) for i in range(0, len(unique) - 1, 2)]


def round_steps(config: OnlineDPOMethodConfig) -> int:
    """Optimizer steps per round: ``steps_per_round``, else ``max_steps`` (-1: the epochs decide)."""
    return config.steps_per_round if config.steps_per_round is not None else config.max_steps


def pairs_per_round(config: OnlineDPOMethodConfig) -> int:
    """Pairs a round asks for at most (fewer when samples repeat): its annotation budget."""
    per_prompt = config.k // 2 if config.pairing == "adjacent" else config.k * (config.k - 1) // 2
    return config.prompts_per_round * per_prompt


class RoundAnnotator:
    """The recipe's feedback annotator, built once (on the main process) and shared by every round, so one
    ``max_cost_usd`` covers the stage; ``close()`` at the end."""

    def __init__(self, context: StageContext) -> None:
        from alpacafarm.stage_attempts import AttemptTotals

        self.context = context
        self.annotator: Any = None
        self.cached = 0
        # what earlier attempts of a resumed stage paid (their rounds may have been cut short): metrics.json counts
        # every attempt
        self.attempts = AttemptTotals(context.stage_dir, context.resuming, context.is_main)

    def label(self, examples: list[dict[str, Any]], r: int, max_unlabelled_fraction: float) -> dict[str, Any]:
        """Label ``examples`` in place (preference, annotator, outcome, ...); returns the round's annotation figures."""
        from alpacafarm.annotation import check_unlabelled
        from alpacafarm.types import Pair

        if self.annotator is None:
            self.annotator = self.context.make_annotator("feedback")
        annotator = self.annotator
        before = annotator.usage()
        started = time.perf_counter()
        try:
            with self.context.progress(f"round {r}: annotating ({annotator.name})", len(examples)) as advance:
                annotations = annotator.annotate([Pair.from_record(e) for e in examples], lambda n, cost: advance(n))
            self.cached += sum(bool(a.cached) for a in annotations)
        finally:  # a round stopped by the budget or a failing endpoint has paid for some requests: keep them
            self.record()
        after = annotator.usage()
        outcomes = check_unlabelled(annotations, max_unlabelled_fraction,
                                    f"stage {self.context.stage!r} round {r} (annotator {annotator.name!r})")
        for example, annotation in zip(examples, annotations, strict=True):
            example.update(preference=annotation.preference, annotator=annotation.annotator, noise=annotation.noise,
                           price_usd=annotation.price_usd, outcome=annotation.outcome, cached=annotation.cached)
        return {"requests": after.requests - before.requests, "cost_usd": round(after.price_usd - before.price_usd, 6),
                "tokens_in": after.tokens_in - before.tokens_in, "tokens_out": after.tokens_out - before.tokens_out,
                "n_cached": sum(bool(a.cached) for a in annotations), "outcomes": outcomes.counts,
                "annotation_seconds": round(time.perf_counter() - started, 2)}

    def record(self) -> None:
        """This attempt's figures so far into the stage's attempts file."""
        usage = self.annotator.usage().to_json() if self.annotator is not None else {}
        self.attempts.update({**usage, "n_cached": self.cached})

    def totals(self) -> dict[str, Any]:
        """Requests, tokens, dollars and cache hits over every attempt of the stage, and how many attempts."""
        self.record()
        return self.attempts.totals()

    def close(self) -> None:
        if self.annotator is not None:
            self.record()
            self.annotator.close()
            self.annotator = None


def sample_round(context: StageContext, config: OnlineDPOMethodConfig, policy_path: str,
                 prompts: list[dict[str, Any]], sampling: SamplingConfig, r: int) -> list[dict[str, Any]]:
    """``k`` samples per prompt from the policy in ``policy_path``, in order (every rank gets all of them)."""
    from alpacafarm import distributed
    from alpacafarm.generation import TransformersGenerator, generate_records

    sharded = config.backend == "transformers"  # every rank samples its share of the batches

    def generate() -> list[dict[str, Any]]:
        generator = context.registry.create("generation_backend", config.backend, config.backend_config,
                                            spec=context.recipe.model, model_path=policy_path)
        if isinstance(generator, TransformersGenerator):
            generator.sharded = sharded
        try:
            with context.progress(f"round {r}: sampling {config.k} per prompt", len(prompts)) as advance:
                return generate_records(generator, prompts, sampling, progress=advance)
        finally:
            generator.close()

    if sharded:
        return generate()
    return distributed.run_on_main(generate, f"stage {context.stage!r} round {r}: sampling ({config.backend})")


def pair_examples(prompts: list[dict[str, Any]], rows: list[dict[str, Any]], config: OnlineDPOMethodConfig,
                  r: int) -> list[dict[str, Any]]:
    """The round's unlabelled pairs: ``output_1``/``output_2`` from each prompt's samples."""
    examples = []
    for index, record in enumerate(prompts):
        samples = [row["output"] for row in rows[index * config.k:(index + 1) * config.k]]
        for out_1, out_2 in sample_pairs(samples, config.pairing):
            examples.append({"instruction": record["instruction"], "input": record.get("input") or "",
                             "output_1": out_1, "output_2": out_2, "round": r})
    return examples


def round_checkpoint(context: StageContext, trainer_dir: Path) -> str | None:
    """The newest readable checkpoint an interrupted attempt of this round's trainer left, if any."""
    from alpacafarm.training import resume_checkpoint

    view = SimpleNamespace(stage_dir=trainer_dir, resuming=context.resuming, logger=context.logger,
                           stage=context.stage)
    return resume_checkpoint(view)


class OnlineDPO(Method):
    """Rounds of sampling from the current policy, annotation and DPO steps; writes each round's ``model/``."""

    config_class = OnlineDPOMethodConfig
    requires = (ArtifactName.SFT_MODEL, ArtifactName.INSTRUCTION_SPLITS)
    provides = ArtifactName.POLICY_MODEL
    annotator_role = "feedback"
    ranks = Ranks.ALL  # sampling split across ranks, annotation on the main process, training on every rank

    def run(self, context: StageContext) -> Artifact:
        from alpacafarm import distributed
        from alpacafarm.data import write_json

        config: OnlineDPOMethodConfig = self.config
        records = context.records("instruction_splits", config.split)[: config.max_instructions]
        if not records or any(not r.get("instruction") for r in records):
            raise UserError(f"stage {context.stage!r}: the instruction_splits input ({config.split!r}) has no "
                            "records, or a record without an 'instruction'")
        needed = config.rounds * config.prompts_per_round
        if needed > len(records):
            context.logger.warning("stage %s: %d rounds x %d prompts need %d instructions, the split has %d: "
                                   "prompts are reused (wrapping around)", context.stage, config.rounds,
                                   config.prompts_per_round, needed, len(records))
        sft_path = context.input("sft_model").path
        policy_path, rounds = sft_path, []
        annotator = RoundAnnotator(context)
        steps = round_steps(config)
        try:  # one line over every round's DPO steps
            with context.progress("training (online DPO)", config.rounds * steps if steps > 0 else None) as line:
                for r in range(1, config.rounds + 1):
                    summary = self._round(context, config, records, r, sft_path, policy_path, annotator, line)
                    rounds.append(summary)
                    policy_path = str(Path(context.stage_dir) / f"round_{r}" / "model")
            paid = annotator.totals() if context.is_main else {}
        finally:
            if context.is_main:
                annotator.close()
        # requests, dollars and cache hits of every attempt (a resumed stage's kept rounds were paid earlier)
        totals = {"n_pairs": sum(s["n_pairs"] for s in rounds), "n_trained": sum(s["n_trained"] for s in rounds),
                  "annotation_requests": paid.get("requests", 0), "annotation_cost_usd": paid.get("cost_usd", 0.0),
                  "n_cached": paid.get("n_cached", 0), "attempts": paid.get("attempts", 1)}
        metadata = {"rounds": len(rounds), "reference": config.reference, "k": config.k, "pairing": config.pairing,
                    "prompts_per_round": config.prompts_per_round, "beta": config.beta, **totals,
                    "final_round": {k: v for k, v in rounds[-1].items() if k != "log_history"},
                    "round_dirs": [f"round_{i}" for i in range(1, len(rounds) + 1)]}
        if context.is_main:
            write_json(Path(context.stage_dir) / "metrics.json", {**metadata, "per_round": rounds})
        distributed.barrier(f"stage {context.stage!r} metrics")
        return Artifact("model", policy_path, metadata)

    def _round(self, context: StageContext, config: OnlineDPOMethodConfig, records: list[dict[str, Any]], r: int,
               sft_path: str, policy_path: str, annotator: RoundAnnotator, line: Any) -> dict[str, Any]:
        """Run (or resume) round ``r`` from the policy in ``policy_path``; returns its summary. Its DPO steps count
        on ``line``, the stage's progress line."""
        from alpacafarm import distributed
        from alpacafarm.data import read_records, write_json, write_jsonl

        round_dir = Path(context.stage_dir) / f"round_{r}"
        state = distributed.broadcast_object(
            "done" if context.resuming and (round_dir / ROUND_DONE).is_file() else
            "labelled" if context.resuming and (round_dir / PAIRS_FILE).is_file() else "new")
        if state == "done":
            context.logger.info("stage %s: round %d already complete, kept", context.stage, r)
            summary = json.loads((round_dir / ROUND_DONE).read_text(encoding="utf-8"))
            line.update(completed=line.completed + summary["steps"])
            return summary
        prompts = round_prompts(records, r, config.prompts_per_round)
        if state == "labelled":
            context.logger.info("stage %s: round %d resumes from its recorded labels (nothing asked again)",
                                context.stage, r)
            examples = read_records(round_dir / PAIRS_FILE)
            annotation = json.loads((round_dir / "annotation.json").read_text(encoding="utf-8"))
        else:
            if context.is_main:
                shutil.rmtree(round_dir, ignore_errors=True)
                round_dir.mkdir(parents=True)
            sampling = config.sampling(context.seed + r)
            rows = sample_round(context, config, policy_path, prompts, sampling, r)
            examples = pair_examples(prompts, rows, config, r)

            def label() -> tuple[list[dict[str, Any]], dict[str, Any]]:
                figures = annotator.label(examples, r, config.max_unlabelled_fraction)
                # the annotation figures first: the pairs file is what marks the round's labels as recorded
                write_json(round_dir / "annotation.json", figures)
                write_jsonl(round_dir / PAIRS_FILE, examples)
                return examples, figures

            examples, annotation = distributed.run_on_main(label, f"stage {context.stage!r} round {r}: annotation")
        return self._train(context, config, examples, annotation, prompts, r, round_dir, sft_path, policy_path, line)

    def _train(self, context: StageContext, config: OnlineDPOMethodConfig, examples: list[dict[str, Any]],
               annotation: dict[str, Any], prompts: list[dict[str, Any]], r: int, round_dir: Path, sft_path: str,
               policy_path: str, line: Any) -> dict[str, Any]:
        """DPO steps on round ``r``'s labelled pairs from ``policy_path`` (counted on ``line``); saves
        ``round_<r>/model``."""
        from alpacafarm import distributed
        from alpacafarm.data import write_json
        from alpacafarm.model_loading import load_tokenizer, save_model
        from alpacafarm.preference_rows import preference_rows
        from alpacafarm.preference_training import REWARD_METRICS, build_dpo_trainer, last_logged
        from alpacafarm.training import stage_seed, stage_training_args, train_summary
        from alpacafarm.training_progress import training_progress

        spec = context.recipe.model
        reference_path = sft_path if config.reference == "sft" else policy_path
        rows, dropped = preference_rows(examples, style=spec.prompt_format, tokenizer=load_tokenizer(spec, policy_path))
        labels = Counter(str(e.get("preference")) for e in examples)
        model_dir = round_dir / "model"
        # the master weights between rounds; the stage's output in the model block's save_dtype
        save_spec = spec if r == config.rounds else spec.model_copy(update={"save_dtype": "float32"})
        summary: dict[str, Any] = {"round": r, "n_prompts": len(prompts), "n_pairs": len(examples),
                                   "n_trained": len(rows), "n_no_ranking": dropped, "labels": dict(labels),
                                   "reference": config.reference, "annotation": annotation}
        if not rows:  # every pair a tie or unlabelled: nothing says which way to move
            raise UserError(f"stage {context.stage!r}: round {r}: none of its {len(examples)} pairs has a ranking "
                            f"(labels: {dict(labels)}); nothing to train on")
        steps = round_steps(config)
        trainer_dir = round_dir / "trainer"
        if context.is_main:
            trainer_dir.mkdir(parents=True, exist_ok=True)  # made here: the trainer of every rank would make it
        args = stage_training_args(config, context, output_dir=str(trainer_dir), max_steps=steps,
                                   seed=stage_seed(config, context) + r)
        trainer = build_dpo_trainer(args, spec, policy_path, rows, reference_path=reference_path)
        context.logger.info("stage %s: round %d, DPO on %d pairs (%d without a ranking), reference %s (%s)",
                            context.stage, r, len(rows), dropped, config.reference, reference_path)
        with training_progress(trainer, context, line=line, count_steps=True):
            result = trainer.train(resume_from_checkpoint=round_checkpoint(context, trainer_dir))
        save_model(trainer.model, trainer.processing_class, model_dir, save_spec, start_from=policy_path,
                   logger=context.logger)  # every rank; the main one writes
        summary.update({**train_summary(trainer, result), **last_logged(trainer.state.log_history, REWARD_METRICS),
                        "n_trained_kept": len(trainer.train_dataset)})
        if context.is_main:
            write_json(round_dir / "metrics.json", {**summary, "log_history": trainer.state.log_history})
            shutil.rmtree(trainer_dir, ignore_errors=True)  # checkpoints of a finished round
        del trainer
        if context.is_main:
            write_json(round_dir / ROUND_DONE, summary)
        distributed.barrier(f"stage {context.stage!r} round {r}")  # the next round loads the saved model
        return summary

