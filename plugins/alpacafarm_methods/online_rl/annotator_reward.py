"""The recipe's annotator as the reward of GRPO and RLOO: ask the simulated annotators while the policy trains.

The reward of a completion is the annotator's verdict on the pair (reference answer, completion), in the
evaluator's convention (``output_1`` the reference, ``output_2`` the completion): a preference ``p`` (1, 2, 0 for
a tie, or AlpacaEval's weighted ``1 + P(completion better)`` when the annotator gives probabilities) becomes the
score ``p - 1`` in [0, 1] (a tie 0.5): the probability that the completion beats the reference. The reference is

* ``annotator_reference: recorded``: the prompt record's own answer (``reference_field``, default ``reference``:
  Davinci003's answer in the AlpacaFarm evaluation data and the bundled sample);
* ``annotator_reference: sft``: one answer of the SFT model per prompt, sampled once before training (same
  temperature, top-p and length as the trainer's rollouts) and kept in the stage folder
  (``annotator_references.jsonl``: a resumed stage reuses it).

Every request goes through the annotation engine: cached (a pair already judged is never paid again, across steps,
runs and processes), in the ledger, and stopped by the annotator's ``max_cost_usd`` (one line, exit status 2). One
annotator is built for the stage (on the main process), so one budget covers it. Under several processes every
rank's completions are gathered, judged in one call on the main process, and scattered back.

Cost: TRL scores a generation batch at a time; every completion is one pair. A generation batch holds
``per_device_train_batch_size * gradient_accumulation_steps * processes`` completions (``generation_batch_size``
when set), i.e. (that / ``num_generations``) prompts x ``num_generations`` completions, and serves one optimizer
step (``steps_per_generation`` micro-batches; TRL reuses it ``num_iterations`` times). So a run asks for about
``max_steps * prompts per step * num_generations`` pairs; identical completions of a prompt cost one, and a
completion equal to its reference is a tie that costs nothing. ``metrics.json`` reports the pairs asked, the paid
requests, the dollars, and the pairs per optimizer step.

A batch with more pairs without a label (failed or unparsed) than ``max_unlabelled_fraction`` fails the stage
(one line naming the endpoint, exit status 1); within the tolerance an unlabelled completion's reward is None,
which TRL treats as unscorable (no advantage), and it is counted.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.method import StageContext
from alpacafarm.stage_attempts import AttemptTotals

ANNOTATOR_REFERENCES = ("recorded", "sft")
REFERENCES_FILE = "annotator_references.jsonl"


def preference_score(preference: Any) -> float | None:
    """``p - 1`` in [0, 1] for a preference in [1, 2] (the completion, ``output_2``, winning is 1), 0.5 for a tie,
    None without a label."""
    if preference is None:
        return None
    value = float(preference)
    if value == 0.0:
        return 0.5
    if not 1.0 <= value <= 2.0:
        raise ValueError(f"preference must be 0 (tie), in [1, 2] or null, got {preference!r}")
    return value - 1.0


class AnnotatorReward:
    """A TRL reward function (``prompts, completions, **columns -> list[float | None]``) that asks the recipe's
    feedback annotator how each completion compares with its row's ``reference`` column."""

    __name__ = "annotator"  # TRL logs rewards/annotator/mean

    def __init__(self, context: StageContext, max_unlabelled_fraction: float) -> None:
        self.context = context
        self.max_unlabelled_fraction = max_unlabelled_fraction
        self.annotator: Any = None
        self.calls = 0
        self.pairs = 0
        self.cached = 0
        self.unlabelled = 0
        self.seconds = 0.0
        self.usage: dict[str, Any] | None = None  # the annotator's ledger figures, kept when it is closed
        # what earlier attempts of a resumed stage asked and paid: metrics.json counts every attempt
        self.attempts = AttemptTotals(context.stage_dir, context.resuming, context.is_main)

    def __call__(self, prompts: list[Any], completions: list[Any], instruction: list[str], input: list[str],
                 reference: list[str] | None = None, log_metric: Any = None, **_: Any) -> list[float | None]:
        from alpacafarm import distributed

        if reference is None:
            raise UserError(f"stage {self.context.stage!r}: the annotator reward needs a 'reference' column")
        texts = [c if isinstance(c, str) else str(c[-1].get("content", "")) for c in completions]
        local = list(zip(instruction, input, reference, texts, strict=True))
        shards = distributed.all_gather_object(local, f"stage {self.context.stage!r}: annotator reward")
        everything = [row for shard in shards for row in shard]
        before = self.pairs, self.cached
        scores = distributed.run_on_main(lambda: self._judge(everything),
                                         f"stage {self.context.stage!r}: annotator reward")
        start = sum(len(shard) for shard in shards[:distributed.rank()])
        if log_metric is not None and self.context.is_main:
            log_metric("annotator/pairs", float(self.pairs - before[0]))
            log_metric("annotator/cached", float(self.cached - before[1]))
        return scores[start:start + len(local)]

    def _judge(self, rows: list[tuple[str, str, str, str]]) -> list[float | None]:
        """The scores of ``(instruction, input, reference, completion)`` rows (on the main process)."""
        from alpacafarm.annotation import check_unlabelled
        from alpacafarm.types import Pair

        if self.annotator is None:
            self.annotator = self.context.make_annotator("feedback")
        started = time.perf_counter()
        pairs = [Pair(instruction, reference, completion, x or "")
                 for instruction, x, reference, completion in rows]
        try:
            annotations = self.annotator.annotate(pairs)
        finally:  # a call stopped by the budget or a failing endpoint has paid for some requests: keep them
            self.seconds += time.perf_counter() - started
            self._record()
        summary = check_unlabelled(annotations, self.max_unlabelled_fraction,
                                   f"stage {self.context.stage!r}: annotator reward "
                                   f"(annotator {self.annotator.name!r})")
        self.calls += 1
        self.pairs += len(pairs)
        self.cached += sum(bool(a.cached) for a in annotations)
        self.unlabelled += summary.unlabelled
        self._record()
        return [preference_score(a.preference) for a in annotations]

    def _record(self) -> None:
        usage = self.annotator.usage().to_json() if self.annotator is not None else (self.usage or {})
        self.attempts.update({"calls": self.calls, "pairs": self.pairs, "cached": self.cached,
                              "unlabelled": self.unlabelled, **usage})

    def summary(self, steps: int, log_history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """What the annotator reward asked and cost over every attempt of the stage (the main process's figures),
        for ``metrics.json``. ``pairs_per_step`` comes from the steps' own logged counts (``log_history``, restored
        with a checkpoint) when there are any: after a resume, pairs over steps would mix attempts."""
        self._record()
        totals = self.attempts.totals()
        per_step = [e["annotator/pairs"] for e in log_history or () if "annotator/pairs" in e]
        pairs_per_step = (sum(per_step) / len(per_step) if per_step else
                          totals.get("pairs", 0) / steps if steps else None)
        ledger = {k: totals.get(k, 0) for k in ("requests", "tokens_in", "tokens_out", "cost_usd")}
        return {"calls": totals.get("calls", 0), "pairs": totals.get("pairs", 0), "cached": totals.get("cached", 0),
                "unlabelled": totals.get("unlabelled", 0), "attempts": totals["attempts"],
                "pairs_per_step": None if pairs_per_step is None else round(pairs_per_step, 3), "ledger": ledger,
                "cost_usd": ledger["cost_usd"], "annotation_seconds": round(self.seconds, 2)}

    def close(self) -> None:
        if self.annotator is not None:
            self.usage = self.annotator.usage().to_json()
            self.annotator.close()
            self.annotator = None


def attach_references(context: StageContext, config: Any, records: list[dict[str, Any]],
                      rows: list[dict[str, str]]) -> None:
    """Give every prompt row its ``reference`` answer (``config.annotator_reference``: see the module)."""
    if config.annotator_reference == "recorded":
        field = config.reference_field
        missing = [i for i, r in enumerate(records) if not isinstance(r.get(field), str) or not r[field].strip()]
        if missing:
            raise UserError(f"stage {context.stage!r}: annotator_reference is 'recorded' but {len(missing)} of "
                            f"{len(records)} prompt records have no {field!r} answer (first: record {missing[0]}); "
                            "set reference_field, or annotator_reference: sft")
        answers = [r[field] for r in records]
    else:
        answers = sft_references(context, config, records)
    for row, answer in zip(rows, answers, strict=True):
        row["reference"] = answer


def sft_references(context: StageContext, config: Any, records: list[dict[str, Any]]) -> list[str]:
    """One SFT-model answer per record (sampled like the trainer's rollouts), kept in the stage folder."""
    from alpacafarm import distributed
    from alpacafarm.data import read_records, write_jsonl
    from alpacafarm.generation import SamplingConfig

    path = Path(context.stage_dir) / REFERENCES_FILE
    if distributed.broadcast_object(context.resuming and path.is_file()):
        kept = read_records(path)
        if [(r["instruction"], r.get("input") or "") for r in kept] == \
                [(r["instruction"], r.get("input") or "") for r in records]:
            context.logger.info("stage %s: SFT reference answers kept from %s", context.stage, path)
            return [r["output"] for r in kept]
    sampling = SamplingConfig(n=1, temperature=config.temperature, top_p=config.top_p,
                              max_new_tokens=config.max_completion_length or 256,
                              batch_size=config.reference_batch_size, seed=context.seed)
    rows, _ = context.generate_on_ranks("transformers", None, records, sampling, "SFT reference answers")
    if context.is_main:
        write_jsonl(path, [{"instruction": r["instruction"], "input": r.get("input") or "", "output": r["output"]}
                           for r in rows])
    return [r["output"] for r in rows]
