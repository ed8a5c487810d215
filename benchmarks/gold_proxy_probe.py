"""Can the proxy reward model learn the gold? Prints how well a head-only reward model ranks held-out answers.

The proxy of the gold world (``recipes/learning.yaml``) is the head-only reward model: a Bradley-Terry head on the
SFT model's frozen last-token features (``plugins/alpacafarm_methods/reward_model/head.py``). Best-of-n, expert
iteration, PPO, Quark, GRPO and RLOO can only gain on the gold what this head can rank. This probe computes the
features of a run's preference samples once, then, cross-validated by instruction (4 folds), fits the head exactly
as the stage does (300 full-batch steps, learning rate 1e-2) on pairs labelled from a target score — noisy
(Bradley-Terry at ``--temperature`` plus ``--noise``, as the gold annotator labels) or clean (the higher score
wins) — and prints the share of held-out pairs (scores differing by more than 0.05) it ranks as the target does.
Targets: the built-in gold and each of its parts. 0.5 is chance.

    python benchmarks/gold_proxy_probe.py runs/learning-val2/stages/preferences/preferences.jsonl

Measured (2026-11-28, 96 validation-run training instructions x 4 samples, 382 distinct texts): 0.52-0.60 for
the gold and every part, noisy or clean labels, weight decay 0.01 to 10 (docs/gold.md).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any


def features(preferences: Path, max_length: int) -> tuple[Any, list[dict[str, Any]], list[str]]:
    """Last-token features of every distinct (prompt, answer) of the preference file, as the stage reads them."""
    from alpacafarm.model_loading import load_classifier, load_tokenizer
    from alpacafarm.model_sources import resolve_model_path
    from alpacafarm.prompts import PromptFormat
    from alpacafarm.recipe import ModelSpec
    from alpacafarm.rewards import with_eos
    from alpacafarm_methods.reward_model.head import last_token_features

    spec = ModelSpec(name="smollm2-135m-instruct", dtype="float32", device="cpu", prompt_format="chat_template")
    path = resolve_model_path(spec.name)
    tokenizer = load_tokenizer(spec, path)
    prompt = PromptFormat.for_model(spec.prompt_format, path, tokenizer)
    texts: dict[str, tuple[dict[str, Any], str]] = {}
    for line in preferences.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        record = {"instruction": row["instruction"], "input": row.get("input") or ""}
        for answer in (row["output_1"], row["output_2"]):
            texts.setdefault(with_eos(prompt(record["instruction"], record["input"]) + answer, tokenizer.eos_token),
                             (record, answer))
    model = load_classifier(spec, path)
    matrix = last_token_features(model, tokenizer, list(texts), batch_size=16, max_length=max_length)
    return matrix, [r for r, _ in texts.values()], [a for _, a in texts.values()]


def labelled_pairs(groups: list[list[int]], target: list[float], noise: float, temperature: float | None,
                   seed: int) -> list[tuple[int, int]]:
    """(chosen, rejected) for every pair within an instruction whose targets differ: clean (temperature None) or
    Bradley-Terry at ``temperature`` with ``noise`` (a fair coin with probability 2 x noise)."""
    rng = random.Random(seed)
    pairs = []
    for group in groups:
        for a, i in enumerate(group):
            for j in group[a + 1:]:
                if target[i] == target[j]:
                    continue
                second_wins = target[j] > target[i]
                if temperature is not None:
                    z = max(-50.0, min(50.0, (target[j] - target[i]) / temperature))
                    second_wins = rng.random() < 1 / (1 + math.exp(-z))
                if noise and rng.random() < 2 * noise:
                    second_wins = rng.random() < 0.5
                pairs.append((j, i) if second_wins else (i, j))
    return pairs


def held_out_accuracy(matrix: Any, groups: list[list[int]], target: list[float], *, weight_decay: float,
                      noise: float, temperature: float | None) -> float:
    """Mean over 4 instruction folds of the held-out clean-pair accuracy of a head fitted on the other folds."""
    from alpacafarm_methods.reward_model.head import fit_head

    order = list(range(len(groups)))
    random.Random(0).shuffle(order)
    accuracies = []
    for fold in range(4):
        test = [groups[g] for g in order[fold::4]]
        train = [groups[g] for g in order if g not in order[fold::4]]
        pairs = labelled_pairs(train, target, noise, temperature, seed=fold)
        weight, _ = fit_head(matrix, [c for c, _ in pairs], [r for _, r in pairs], learning_rate=1e-2, steps=300,
                             weight_decay=weight_decay, seed=0)
        scores = (matrix @ weight.reshape(-1)).tolist()
        clean = [(c, r) for c, r in labelled_pairs(test, target, 0.0, None, seed=0)
                 if abs(target[c] - target[r]) > 0.05]
        accuracies.append(sum(scores[c] > scores[r] for c, r in clean) / max(1, len(clean)))
    return sum(accuracies) / len(accuracies)


def main(argv: list[str] | None = None) -> int:
    from alpacafarm_annotators.gold_functions import coverage, helpfulness, organisation, repeated_phrases

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preferences", type=Path, help="a preference_data stage's preferences.jsonl")
    parser.add_argument("--max-length", type=int, default=192)
    parser.add_argument("--noise", type=float, default=0.25)
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, nargs="+", default=[0.01, 0.1, 1.0, 10.0])
    args = parser.parse_args(argv)
    matrix, records, answers = features(args.preferences, args.max_length)
    by_instruction: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        by_instruction.setdefault(record["instruction"] + "\x00" + record["input"], []).append(i)
    groups = list(by_instruction.values())
    targets = {"gold (helpfulness)": helpfulness(records, answers),
               "coverage": [coverage(r, a) for r, a in zip(records, answers, strict=True)],
               "organisation": [organisation(a) for a in answers],
               "repetition": [-float(repeated_phrases(a)) for a in answers]}
    print(f"{len(answers)} distinct answers of {len(groups)} instructions; held-out clean-pair accuracy of the head")
    print(f"{'target':20s} {'labels':8s} " + " ".join(f"wd {wd:<6g}" for wd in args.weight_decay))
    for name, target in targets.items():
        for labels, noise, temperature in (("noisy", args.noise, args.temperature), ("clean", 0.0, None)):
            cells = [held_out_accuracy(matrix, groups, target, weight_decay=wd, noise=noise, temperature=temperature)
                     for wd in args.weight_decay]
            print(f"{name:20s} {labels:8s} " + " ".join(f"{c:<9.3f}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
