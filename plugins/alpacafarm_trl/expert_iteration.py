"""``expert_iteration``: best-of-n on unlabeled instructions, then supervised fine-tuning on the winners.

Paper Appendix A.2: "first perform best-of-n sampling and store the generated samples; then fine-tune p_SFT on
these samples with supervised learning" — one round with n = 16 in the paper (Appendix E.2). ``rounds`` > 1
repeats it: round r samples from round r-1's model and, with ``init: previous`` (the default), continues
training it; ``init: sft`` restarts every round from the SFT model.

Files (in the stage folder), all kept as artifacts of the run::

    round_<r>/samples.jsonl    every sample with its reward
    round_<r>/winners.jsonl    the SFT data of the round: the best sample per instruction
    round_<r>/model/           the round's model (the last round's is the stage's output)
    round_<r>/metrics.json     the round's training log and reward figures

A round whose ``model/`` is complete is not redone when an interrupted stage resumes.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.generation import SamplingConfig
from alpacafarm.method import Artifact, Method, StageContext
from alpacafarm.training import save_policy, stage_training_args, train_summary
from alpacafarm_trl.best_of_n import mean, sample_and_score, select
from alpacafarm_trl.sft import SFTMethodConfig, build_sft_trainer

ROUND_DONE = "round_complete.json"


@dataclass
class ExpertIterationConfig(SFTMethodConfig):
    """Best-of-n settings, rounds, and every ``trl.SFTConfig`` field for the fine-tuning of each round."""

    rounds: int = field(default=1, metadata={"help": "best-of-n + SFT rounds (the paper: 1)"})
    n: int = field(default=16, metadata={"help": "samples per instruction; the best one is kept (paper: 16)"})
    split: str = field(default="train", metadata={"help": "file of the instruction splits to sample on"})
    max_instructions: int | None = field(default=None, metadata={"help": "use the first N instructions only"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (paper: 1.0 for reranking)"})
    top_p: float = 1.0
    max_new_tokens: int = 300
    generation_batch_size: int = field(default=4, metadata={"help": "instructions per generation batch (x n samples)"})
    score_batch_size: int = 8
    init: str = field(default="previous", metadata={"help": "'previous': round r fine-tunes round r-1's model; "
                                                            "'sft': every round fine-tunes the SFT model"})
    backend: str = field(default="transformers", metadata={"help": "generation backend for the sampling"})
    backend_config: dict[str, Any] = field(default_factory=dict, metadata={"help": "the backend's own options"})

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.n < 1:
            raise ValueError("rounds and n must be at least 1")
        if self.init not in ("previous", "sft"):
            raise ValueError("init must be 'previous' or 'sft'")
        super().__post_init__()

    def sampling(self, seed: int) -> SamplingConfig:
        return SamplingConfig(n=self.n, temperature=self.temperature, top_p=self.top_p,
                              max_new_tokens=self.max_new_tokens, batch_size=self.generation_batch_size, seed=seed)


def winners_as_demonstrations(winners: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The SFT records of a round: instruction, input and the winning sample as ``output``."""
    return [{"instruction": w["instruction"], "input": w.get("input") or "", "output": w["output"],
             "reward": w["reward"]} for w in winners]


class ExpertIteration(Method):
    """Rounds of best-of-n sampling with the reward model and SFT on the winners; writes the final ``model/``."""

    config_class = ExpertIterationConfig
    requires = ("sft_model", "reward_model", "instruction_splits")
    provides = "policy_model"

    def run(self, context: StageContext) -> Artifact:
        from alpacafarm.data import write_json, write_jsonl

        config: ExpertIterationConfig = self.config
        spec = context.recipe.model
        sft_path = context.input("sft_model").path
        records = context.records("instruction_splits", config.split)[: config.max_instructions]
        if not records:
            raise UserError(f"expert_iteration: the {config.split!r} split has no instructions")
        reward = context.reward_function(batch_size=config.score_batch_size)
        policy_path, rounds = sft_path, []
        for r in range(1, config.rounds + 1):
            round_dir = Path(context.stage_dir) / f"round_{r}"
            model_dir = round_dir / "model"
            if context.resuming and (round_dir / ROUND_DONE).is_file():
                context.logger.info("stage %s: round %d already complete, kept", context.stage, r)
                rounds.append(json.loads((round_dir / ROUND_DONE).read_text(encoding="utf-8")))
                policy_path = str(model_dir)
                continue
            shutil.rmtree(round_dir, ignore_errors=True)
            round_dir.mkdir(parents=True)
            generator = context.registry.create("generation_backend", config.backend, config.backend_config,
                                                spec=spec, model_path=policy_path)
            with context.progress(f"round {r}: best-of-{config.n} sampling", len(records)) as advance:
                samples = sample_and_score(generator, reward, records, config.sampling(context.seed + r),
                                           progress=advance)
            generator.close()
            del generator
            winners = select(samples, config.n)
            write_jsonl(round_dir / "samples.jsonl", [s for group in samples for s in group])
            demonstrations = winners_as_demonstrations(winners)
            write_jsonl(round_dir / "winners.jsonl", demonstrations)

            start_from = sft_path if config.init == "sft" else policy_path
            args = dataclasses.replace(stage_training_args(config, context), output_dir=str(round_dir / "trainer"),
                                       response_field="output", max_examples=None)
            trainer = build_sft_trainer(args, spec, start_from, demonstrations)
            context.logger.info("stage %s: round %d, SFT on %d best-of-%d outputs "
                                "(mean reward %.4f vs %.4f per sample)",
                                context.stage, r, len(demonstrations), config.n, mean([w["reward"] for w in winners]),
                                mean([s["reward"] for g in samples for s in g]))
            result = trainer.train()
            save_policy(trainer, spec, start_from, model_dir, context.logger)
            shutil.rmtree(round_dir / "trainer", ignore_errors=True)  # checkpoints of a finished round
            summary = {"round": r, "n_instructions": len(records), "n": config.n,
                       "mean_sample_reward": round(mean([s["reward"] for g in samples for s in g]), 6),
                       "mean_winner_reward": round(mean([w["reward"] for w in winners]), 6),
                       "winner_avg_length": round(mean([len(w["output"]) for w in winners]), 1),
                       **train_summary(trainer, result)}
            write_json(round_dir / "metrics.json", {**summary, "log_history": trainer.state.log_history})
            write_json(round_dir / ROUND_DONE, summary)
            rounds.append(summary)
            policy_path = str(model_dir)
            del trainer
        del reward
        write_json(Path(context.stage_dir) / "metrics.json", {"rounds": rounds})
        return Artifact("model", policy_path, {"rounds": len(rounds), "final_round": rounds[-1],
                                               "round_dirs": [f"round_{i}" for i in range(1, len(rounds) + 1)]})
