"""How much faster do the frozen SmolLM2 features come when answers to one prompt share its pass? Prints seconds per
answer both ways, on the same texts, in one process.

A gold-world run reads SmolLM2-135M-Instruct's hidden states averaged over each answer (``answer_mean_features``)
for many answers to one prompt: a preference stage's k samples (the gold labels them, the head-only reward model
reads them), best-of-n's n samples. This takes ``--instructions`` AlpacaEval instructions with ``--k`` systems'
answers each (Davinci003's reference and ``results/*/model_outputs.json`` under ``--data``, cut to
``--answer-tokens`` tokens, as a 64-token SFT sample is) and times, in one process on the same texts:

- ``whole``: every text in one pass, batches longest first (each text alone, as before the prompt was shared);
- ``shared``: each prompt once, its keys and values reused by its k answers;

and prints the largest difference between the ``whole`` and ``shared`` rows (float rounding only). Then the same for
the helpful gold's two readings (``gold_relevance.read_answers``: the answer after its own instruction, for the
features and log-probabilities, and after the neutral instruction, for the log-probabilities): ``before``, each
text read whole and the neutral reading to the answer's end (the code before issue 65); ``after``, prompts shared
and the neutral reading stopped at the relevance window. Throughput is printed in answers per second.

    python benchmarks/feature_sharing.py --data ../shared/data --instructions 24 --k 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def answers_by_instruction(data: Path, instructions: int, k: int) -> list[tuple[str, list[str]]]:
    """The first ``instructions`` AlpacaEval instructions with ``k`` systems' answers each (the shared data, read by
    ``tools/offline_judge_data.load_data``: Davinci003's reference and ``results/*/model_outputs.json``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from offline_judge_data import load_data

    loaded = load_data(data, max_instructions=instructions)
    systems = sorted(loaded.outputs)[:k]
    if len(systems) < k:
        raise SystemExit(f"feature_sharing: {len(systems)} systems' outputs under {data}, need --k {k}")
    return [(i, [loaded.outputs[s][i] for s in systems]) for i in loaded.instructions
            if all(i in loaded.outputs[s] for s in systems)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--instructions", type=int, default=24)
    parser.add_argument("--k", type=int, default=8, help="answers per instruction (best-of-n's n)")
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)

    import torch

    from alpacafarm.rewards import answer_mean_features
    from alpacafarm_annotators.gold_head import MEAN_HEAD_FILE, frozen_model

    head = json.loads(MEAN_HEAD_FILE.read_text(encoding="utf-8"))
    model, tokenizer, prompt = frozen_model(head["model"])
    prompts: list[str] = []
    answers: list[str] = []
    for instruction, outputs in answers_by_instruction(args.data, args.instructions, args.k):
        for output in outputs:
            prompts.append(prompt(instruction, ""))
            ids = tokenizer(output, add_special_tokens=False)["input_ids"][:args.answer_tokens]
            answers.append(tokenizer.decode(ids))
    tokens = sum(len(tokenizer(p + a)["input_ids"]) for p, a in zip(prompts, answers, strict=True))
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    print(f"{len(answers)} answers ({args.instructions} instructions x {args.k}), {tokens / len(answers):.0f} tokens "
          f"each on average, {prompt_tokens / len(answers):.0f} of them the prompt; torch threads "
          f"{torch.get_num_threads()}")

    def timed(share: bool) -> tuple[float, Any]:
        start = time.perf_counter()
        rows = answer_mean_features(model, tokenizer, prompts, answers, batch_size=args.batch_size,
                                    max_length=int(head["max_length"]), share_prompts=share)
        return time.perf_counter() - start, rows

    timed(False)  # warm-up (the first batches of a process are slower)
    whole_s, whole = timed(False)
    shared_s, shared = timed(True)
    for name, seconds in (("whole", whole_s), ("shared", shared_s)):
        print(f"{name:>7}: {seconds / len(answers):.4f} s per answer ({seconds:.1f} s)")
    gap = float((whole - shared).abs().max())
    print(f"shared / whole: {shared_s / whole_s:.2f}; largest |whole - shared| {gap:.2e} (feature scale "
          f"{float(whole.abs().mean()):.2f}); {len(answers) / whole_s:.1f} -> {len(answers) / shared_s:.1f} "
          "answers/s")
    gold_readings(model, tokenizer, prompt, prompts, answers, args.batch_size, int(head["max_length"]))


def gold_readings(model: Any, tokenizer: Any, prompt: Any, prompts: list[str], answers: list[str], batch_size: int,
                  max_length: int) -> None:
    """The helpful gold's two readings of every answer, before and after issue 65, timed on the same texts."""
    from alpacafarm_annotators.gold_relevance import NEUTRAL, WINDOW, read_answers, relevance

    neutral_prompts = [prompt(*NEUTRAL)] * len(answers)

    def timed(after: bool) -> tuple[float, Any, list[float]]:
        window = WINDOW if after else None
        start = time.perf_counter()
        features, own = read_answers(model, tokenizer, prompts, answers, batch_size=batch_size,
                                     max_length=max_length, share_prompts=after, window=window)
        _, neutral = read_answers(model, tokenizer, neutral_prompts, answers, batch_size=batch_size,
                                  max_length=max_length, features=False, share_prompts=after, window=window)
        return time.perf_counter() - start, features, relevance(own, neutral, WINDOW)

    before_s, before_features, before_relevance = timed(False)
    after_s, after_features, after_relevance = timed(True)
    for name, seconds in (("before", before_s), ("after", after_s)):
        print(f"gold {name:>6}: {len(answers) / seconds:.1f} answers/s ({seconds:.1f} s)")
    gap = max(abs(a - b) for a, b in zip(before_relevance, after_relevance, strict=True))
    print(f"gold after / before: {after_s / before_s:.2f}; largest |before - after| features "
          f"{float((before_features - after_features).abs().max()):.2e}, relevance {gap:.2e} nats")


if __name__ == "__main__":
    main()
