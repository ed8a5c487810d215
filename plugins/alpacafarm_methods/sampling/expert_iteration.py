"""``expert_iteration``: best-of-n on unlabeled instructions, then supervised fine-tuning on the winners.

Paper Appendix A.2: "first perform best-of-n sampling and store the generated samples; then fine-tune p_SFT on
these samples with supervised learning" — one round with n = 16 in the paper (Appendix E.2). ``rounds`` > 1
repeats it: round r samples from round r-1's model and, with ``init: previous`` (the default), continues
training it; ``init: sft`` restarts every round from the SFT model.

A winner that was cut at ``max_new_tokens`` is not an answer that ends: its training target gets no EOS (an
EOS there would teach the model to stop mid-sentence), while a winner that stopped on its own ends with EOS as
in SFT. ``truncated_winners: drop`` leaves cut winners out of the fine-tuning instead. (Ours: the released
implementation appends EOS to every target.) The backend says which samples were cut
(:attr:`alpacafarm.generation.Generator.last_finished`: no stop token with transformers, ``finish_reason:
length`` from an OpenAI-compatible server or vLLM); a backend that cannot tell is an error. The rows are
tokenized here, because TRL's ``SFTTrainer`` appends EOS to every text completion it is given.

``selection: random`` is the control that tells selection from fine-tuning (ours, not the paper's): each
instruction's fine-tuning target is one of its ``n`` samples drawn uniformly (seeded by the stage seed and the
round), scored all the same, with every other setting unchanged. A policy that gains as much from it as from the
best of ``n`` learns from the fine-tuning on its own samples, not from the reward model's choice.

Files (in the stage folder), all kept as artifacts of the run::

    round_<r>/samples.jsonl    every sample with its reward and ``finished`` (False: cut at max_new_tokens)
    round_<r>/winners.jsonl    the best (or, ``selection: random``, a random) sample per instruction (with
                               ``finished``): the round's SFT data
    round_<r>/model/           the round's model (the last round's is the stage's output)
    round_<r>/metrics.json     the round's training log and reward figures

A round whose ``model/`` is complete is not redone when an interrupted stage resumes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alpacafarm.artifact_names import ArtifactName
from alpacafarm.errors import UserError
from alpacafarm.generation import SamplingConfig
from alpacafarm.method import Artifact, Method, Ranks, StageContext
from alpacafarm.model_loading import save_model
from alpacafarm.policy_training import build_sft_trainer_on_rows
from alpacafarm.recipe import GenerationBackendOptions
from alpacafarm.reward_selection import mark_finished, mean, score_groups, select
from alpacafarm.rewards import EnsembleOptions, check_ensemble
from alpacafarm.training import stage_training_args, train_summary
from alpacafarm.training_progress import training_progress
from alpacafarm.training_rows import training_rows
from alpacafarm_methods.supervised.sft import SFTMethodConfig

ROUND_DONE = "round_complete.json"
TRUNCATED_WINNERS = ("keep", "drop")
#: What a round fine-tunes on: the reward model's best of n (expert iteration) or one drawn at random (its control).
SELECTIONS = ("best", "random")


@dataclass
class ExpertIterationConfig(SFTMethodConfig, EnsembleOptions, GenerationBackendOptions):
    """Best-of-n settings, rounds, and every ``trl.SFTConfig`` field for the fine-tuning of each round."""

    rounds: int = field(default=1, metadata={"help": "best-of-n + SFT rounds (the paper: 1)"})
    n: int = field(default=16, metadata={"help": "samples per instruction; the best one is kept (paper: 16)"})
    split: str = field(default="train", metadata={"help": "file of the instruction splits to sample on"})
    max_instructions: int | None = field(default=None, metadata={"help": "use the first N instructions only"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (paper: 1.0 for reranking)"})
    top_p: float = field(default=0.9, metadata={
        "help": "nucleus sampling threshold (released decoding: 0.9; the paper states none for its models)"})
    max_new_tokens: int = 300
    generation_batch_size: int = field(default=4, metadata={"help": "instructions per generation batch (x n samples)"})
    score_batch_size: int = 8
    init: str = field(default="previous", metadata={"help": "'previous': round r fine-tunes round r-1's model; "
                                                            "'sft': every round fine-tunes the SFT model"})
    selection: str = field(default="best", metadata={
        "help": "'best': each instruction's best of n by the reward model (expert iteration); 'random': one of its n "
                "drawn at random (the control: the same fine-tuning without the reward model's choice)"})
    truncated_winners: str = field(default="keep", metadata={
        "help": "winners cut at max_new_tokens: 'keep' (trained on, without EOS) or 'drop' (not trained on)"})

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.n < 1:
            raise ValueError("rounds and n must be at least 1")
        if self.init not in ("previous", "sft"):
            raise ValueError("init must be 'previous' or 'sft'")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}")
        if self.truncated_winners not in TRUNCATED_WINNERS:
            raise ValueError(f"truncated_winners must be one of {', '.join(TRUNCATED_WINNERS)}")
        check_ensemble(self.ensemble, self.ensemble_coefficient)
        super().__post_init__()

    def sampling(self, seed: int) -> SamplingConfig:
        return SamplingConfig(n=self.n, temperature=self.temperature, top_p=self.top_p,
                              max_new_tokens=self.max_new_tokens, batch_size=self.generation_batch_size, seed=seed)


def pick_random(samples: list[list[dict[str, Any]]], n: int, seed: int) -> list[dict[str, Any]]:
    """One of the first ``n`` samples of every instruction, drawn uniformly with ``seed`` (a copy carrying ``n``)."""
    import random

    rng = random.Random(seed)
    return [{**group[rng.randrange(min(n, len(group)))], "n": n} for group in samples]


def winners_as_demonstrations(winners: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The SFT records of a round: instruction, input, the winning sample as ``output``, and ``finished``."""
    return [{"instruction": w["instruction"], "input": w.get("input") or "", "output": w["output"],
             "reward": w["reward"], "finished": bool(w.get("finished", True))} for w in winners]


def sample_round(context: StageContext, config: Any, policy_path: str, records: list[dict[str, Any]],
                 sampling: SamplingConfig, r: int, *, shard: bool) -> list[dict[str, Any]]:
    """One round's samples (``config.n`` per record, in order), each marked ``finished``; with ``shard`` the
    batches are split across ranks (every rank gets all rows, the same as one process's)."""
    from alpacafarm.generation import TransformersGenerator, generate_records

    generator = context.registry.create("generation_backend", config.backend, config.backend_config,
                                        spec=context.recipe.model, model_path=policy_path)
    if isinstance(generator, TransformersGenerator):
        generator.sharded = shard
    try:
        with context.progress(f"round {r}: best-of-{config.n} sampling", len(records)) as advance:
            rows = generate_records(generator, records, sampling, progress=advance)
        groups = [rows[i:i + config.n] for i in range(0, len(rows), config.n)]
        mark_finished(groups, generator, config.backend)
    finally:
        generator.close()
    return rows


class ExpertIteration(Method):
    """Rounds of best-of-n sampling with the reward model and SFT on the winners; writes the final ``model/``."""

    config_class = ExpertIterationConfig
    requires = (ArtifactName.SFT_MODEL, ArtifactName.REWARD_MODEL, ArtifactName.INSTRUCTION_SPLITS)
    provides = ArtifactName.POLICY_MODEL
    #: Under several processes: sampling is split across ranks (transformers backend; another backend samples on
    #: the main process), the main process scores and writes, every rank trains (TRL's trainer, accelerate).
    ranks = Ranks.ALL

    def run(self, context: StageContext) -> Artifact:
        from alpacafarm import distributed
        from alpacafarm.data import write_json, write_jsonl
        from alpacafarm.model_loading import load_tokenizer

        config: ExpertIterationConfig = self.config
        spec = context.recipe.model
        sft_path = context.input("sft_model").path
        records = context.records("instruction_splits", config.split)[: config.max_instructions]
        if not records:
            raise UserError(f"expert_iteration: the {config.split!r} split has no instructions")
        reward = context.reward_function(batch_size=config.score_batch_size, ensemble=config.ensemble,
                                         ensemble_coefficient=config.ensemble_coefficient) if context.is_main else None
        policy_path, rounds = sft_path, []
        for r in range(1, config.rounds + 1):
            round_dir = Path(context.stage_dir) / f"round_{r}"
            model_dir = round_dir / "model"
            if distributed.broadcast_object(context.resuming and (round_dir / ROUND_DONE).is_file()):
                context.logger.info("stage %s: round %d already complete, kept", context.stage, r)
                rounds.append(json.loads((round_dir / ROUND_DONE).read_text(encoding="utf-8")))
                policy_path = str(model_dir)
                continue
            if context.is_main:
                shutil.rmtree(round_dir, ignore_errors=True)
                (round_dir / "trainer").mkdir(parents=True)  # made here: the trainer of every rank would make it
            start_from = sft_path if config.init == "sft" else policy_path
            tokenizer = load_tokenizer(spec, start_from)
            sampling = config.sampling(context.seed + r)

            if config.backend == "transformers":  # every rank samples its share of the batches
                rows = sample_round(context, config, policy_path, records, sampling, r, shard=True)
            else:  # a server or vLLM: sampled once, on the main process
                rows = distributed.run_on_main(functools.partial(sample_round, context, config, policy_path, records,
                                                                 sampling, r, shard=False), context.stage)
            samples = distributed.run_on_main(functools.partial(score_groups, reward, records, rows, config.n),
                                              context.stage)
            winners = (select(samples, config.n) if config.selection == "best"
                       else pick_random(samples, config.n, context.seed + r))
            demonstrations = winners_as_demonstrations(winners)
            if context.is_main:
                write_jsonl(round_dir / "samples.jsonl", [s for group in samples for s in group])
                write_jsonl(round_dir / "winners.jsonl", demonstrations)
            truncated = sum(not d["finished"] for d in demonstrations)
            if config.truncated_winners == "drop":
                demonstrations = [d for d in demonstrations if d["finished"]]
            if not demonstrations:
                raise UserError(f"expert_iteration: round {r}: every winner was cut at max_new_tokens="
                                f"{config.max_new_tokens}; raise it or set truncated_winners: keep")

            args = dataclasses.replace(stage_training_args(config, context), output_dir=str(round_dir / "trainer"),
                                       response_field="output", max_examples=None)
            rows = training_rows(demonstrations, tokenizer, spec.prompt_format)
            trainer = build_sft_trainer_on_rows(args, spec, start_from, rows)
            context.logger.info("stage %s: round %d, SFT on %d %s-of-%d outputs (%d cut at the token limit, "
                                "%s; mean reward %.4f vs %.4f per sample)",
                                context.stage, r, len(demonstrations), config.selection, config.n, truncated,
                                "left out" if config.truncated_winners == "drop" else "trained without EOS",
                                mean([w["reward"] for w in winners]), mean([s["reward"] for g in samples for s in g]))
            with training_progress(trainer, context, f"round {r}: SFT on the winners"):
                result = trainer.train()
            # every rank (ZeRO-3 gathers the weights); the main process writes
            save_model(trainer.model, trainer.processing_class, model_dir, spec, start_from=start_from,
                       logger=context.logger)
            if context.is_main:
                shutil.rmtree(round_dir / "trainer", ignore_errors=True)  # checkpoints of a finished round
            summary = {"round": r, "n_instructions": len(records), "n": config.n, "selection": config.selection,
                       "mean_sample_reward": round(mean([s["reward"] for g in samples for s in g]), 6),
                       "mean_winner_reward": round(mean([w["reward"] for w in winners]), 6),
                       "winner_avg_length": round(mean([len(w["output"]) for w in winners]), 1),
                       "n_truncated_winners": truncated, "truncated_winners": config.truncated_winners,
                       "n_trained": len(rows),
                       **train_summary(trainer, result)}
            if context.is_main:
                write_json(round_dir / "metrics.json", {**summary, "log_history": trainer.state.log_history})
                write_json(round_dir / ROUND_DONE, summary)
            distributed.barrier(f"stage {context.stage!r} round {r}")  # the next round loads the saved model
            rounds.append(summary)
            policy_path = str(model_dir)
            del trainer
        del reward
        if context.is_main:
            write_json(Path(context.stage_dir) / "metrics.json", {"rounds": rounds})
        return Artifact("model", policy_path, {"rounds": len(rounds), "final_round": rounds[-1],
                                               "round_dirs": [f"round_{i}" for i in range(1, len(rounds) + 1)]})
