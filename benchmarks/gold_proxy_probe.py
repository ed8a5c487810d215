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

``--features rating`` (the state after a rating question appended to the answer) and ``--features mean`` (the
answer's mean hidden state, two blocks below the top) try other frozen features (2026-11-28, same 382 answers,
noiseless / noisy labels): organisation 0.84 / 0.79 and 0.75 / 0.62, the gold 0.55-0.57 and 0.49-0.57.

``--gold module:function`` probes any other gold as well. A sentiment gold (VADER's compound score of the answer,
``vaderSentiment`` 3.3.2, a function of two lines; within-instruction standard deviation 0.27, overall 0.46) is
no easier (2026-11-28, weight decay 0.1 / 1, noiseless / noisy): last-token features 0.545-0.554 / 0.555,
mean features 0.613-0.630 / 0.563-0.573. At a few hundred distinct answers the frozen 135M features rank little beyond
length and layout.

``--top-blocks K`` also trains the top K transformer blocks with the head (on the hidden states entering them,
computed once; 4 epochs of 16 pairs at learning rate 1e-4, head 1e-3) on the gold, for ``--folds`` folds: can a
proxy with trainable layers see the rubric? Measured with K = 2 on one fold: 0.566 from noisy labels, 0.614 from
clean ones (about 10 minutes a fold on 2 loaded cores).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any


def distinct_texts(preferences: Path) -> tuple[Any, str, Any, dict[str, tuple[dict[str, Any], str]]]:
    """The SFT model's spec, folder and tokenizer, and every distinct (prompt + answer + EOS) text of the preference
    file with its record and answer, as the reward-model stage reads them."""
    from alpacafarm.model_loading import load_tokenizer
    from alpacafarm.model_sources import resolve_model_path
    from alpacafarm.prompts import PromptFormat
    from alpacafarm.recipe import ModelSpec
    from alpacafarm.rewards import with_eos

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
    return spec, path, tokenizer, texts


#: Appended after the answer for ``--features rating``: the model is asked to judge the answer it just read, and the
#: head reads the state where it would start its verdict (SmolLM2's chat markup).
RATING_QUESTION = ("\n<|im_start|>user\nHow good was your answer, from 1 to 10?<|im_end|>\n<|im_start|>assistant\n"
                   "My answer deserves a")


def features(preferences: Path, max_length: int, kind: str = "last") -> tuple[Any, list[dict[str, Any]], list[str]]:
    """Frozen features of every distinct (prompt, answer) of the preference file: ``last``, the final hidden state
    at the last real token, as the reward-model stage reads it; ``rating``, the same after :data:`RATING_QUESTION`
    is appended; ``mean``, the mean over the answer's tokens of the hidden states entering the top two blocks;
    ``answer``, the final hidden states averaged over the answer's tokens (what ``pooling: mean`` reads)."""
    import torch

    from alpacafarm.model_loading import load_classifier
    from alpacafarm.prompts import PromptFormat
    from alpacafarm.rewards import last_token_features

    spec, path, tokenizer, texts = distinct_texts(preferences)
    model = load_classifier(spec, path)
    keys = list(texts)
    if kind == "answer":  # what a reward model with pooling: mean reads
        from alpacafarm.prompts import PromptFormat
        from alpacafarm.rewards import answer_mean_features

        prompt = PromptFormat.for_model(spec.prompt_format, path, tokenizer)
        prompts = [prompt(r["instruction"], r["input"]) for r, _ in texts.values()]
        matrix = answer_mean_features(model, tokenizer, prompts, [a for _, a in texts.values()], batch_size=16,
                                      max_length=max_length)
    elif kind == "mean":
        prompt = PromptFormat.for_model(spec.prompt_format, path, tokenizer)
        base, rows = model.base_model, []
        with torch.inference_mode():
            for key, (record, _) in texts.items():
                ids = tokenizer(key, return_tensors="pt", truncation=True, max_length=max_length)["input_ids"]
                start = len(tokenizer(prompt(record["instruction"], record["input"]))["input_ids"])
                states = base(input_ids=ids, output_hidden_states=True).hidden_states[len(base.layers) - 2][0]
                rows.append(states[min(start, len(states) - 2):-1].mean(0).float())  # the answer, not the EOS
        matrix = torch.stack(rows)
    else:
        keys = [k + RATING_QUESTION for k in keys] if kind == "rating" else keys
        matrix = last_token_features(model, tokenizer, keys, batch_size=16,
                                     max_length=None if kind == "rating" else max_length)  # keep the question whole
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


def held_out_share(scores: list[float], target: list[float], test: list[list[int]]) -> float:
    """The share of the held-out pairs (targets more than 0.05 apart) that ``scores`` rank as ``target`` does."""
    clean = [(c, r) for c, r in labelled_pairs(test, target, 0.0, None, seed=0) if abs(target[c] - target[r]) > 0.05]
    if not clean:
        sys.exit("gold_proxy_probe: a held-out fold has no pair whose targets differ by more than 0.05; "
                 "give it a preference file with more instructions")
    return sum(scores[c] > scores[r] for c, r in clean) / len(clean)


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
        accuracies.append(held_out_share(scores, target, test))
    return sum(accuracies) / len(accuracies)


def top_scores(base: Any, trained: tuple[Any, Any, Any], entering: list[Any], indices: list[int]) -> Any:
    """Scores of the texts ``indices`` through the trained top blocks, norm and head (32 at a time, right-padded;
    each read at the token before its EOS, where the sequence classifier reads)."""
    import torch

    layers, norm, head = trained
    out = []
    for start in range(0, len(indices), 32):
        part = indices[start:start + 32]
        h = torch.nn.utils.rnn.pad_sequence([entering[i] for i in part], batch_first=True)
        positions = torch.arange(h.shape[1]).unsqueeze(0).expand(len(part), -1)
        rotary = base.rotary_emb(h, positions)
        for layer in layers:
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
            h = h[0] if isinstance(h, tuple) else h
        last = torch.tensor([entering[i].shape[0] - 2 for i in part])
        out.append(head(norm(h)[torch.arange(len(part)), last]).squeeze(-1))
    return torch.cat(out)


def top_block_accuracy(preferences: Path, max_length: int, blocks: int, target_fn: Any, *, folds: int,
                       noise: float, temperature: float | None, epochs: int = 4) -> list[float]:
    """Held-out clean-pair accuracy (per fold) of the top ``blocks`` transformer blocks, the final norm and a
    score head trained with the Bradley-Terry loss on ``target_fn``'s labels. The hidden states entering those
    blocks are computed once per text (right padding under causal attention: a real token never sees a pad)."""
    import copy

    import torch

    from alpacafarm.model_loading import load_classifier

    spec, path, tokenizer, texts = distinct_texts(preferences)
    tokenizer.padding_side = "right"
    keys = list(texts)
    base = load_classifier(spec, path).eval().base_model
    depth = len(base.layers)
    entering: list[Any] = [None] * len(keys)
    with torch.inference_mode():
        order = sorted(range(len(keys)), key=lambda i: -len(keys[i]))
        for start in range(0, len(order), 16):
            chunk = order[start:start + 16]
            batch = tokenizer([keys[i] for i in chunk], return_tensors="pt", truncation=True, max_length=max_length,
                              padding=True)
            states = base(input_ids=batch["input_ids"], output_hidden_states=True).hidden_states[depth - blocks]
            for row, i in enumerate(chunk):
                entering[i] = states[row, :int(batch["attention_mask"][row].sum())].clone()
    records, answers = [texts[k][0] for k in keys], [texts[k][1] for k in keys]
    target = target_fn(records, answers)
    by_instruction: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        by_instruction.setdefault(record["instruction"] + "\x00" + record["input"], []).append(i)
    groups = list(by_instruction.values())
    order = list(range(len(groups)))
    random.Random(0).shuffle(order)
    accuracies = []
    for fold in range(folds):
        torch.manual_seed(fold)
        layers, norm = copy.deepcopy(base.layers[depth - blocks:]), copy.deepcopy(base.norm)
        head = torch.nn.Linear(base.config.hidden_size, 1, bias=False)
        torch.nn.init.zeros_(head.weight)
        optimizer = torch.optim.AdamW([{"params": [*layers.parameters(), *norm.parameters()], "lr": 1e-4},
                                       {"params": head.parameters(), "lr": 1e-3}], weight_decay=0.0)

        test = [groups[g] for g in order[fold::4]]
        train = [groups[g] for g in order if g not in order[fold::4]]
        pairs = labelled_pairs(train, target, noise, temperature, seed=fold)
        rng = random.Random(fold)
        for _ in range(epochs):
            rng.shuffle(pairs)
            for start in range(0, len(pairs), 16):
                chunk = pairs[start:start + 16]
                both = top_scores(base, (layers, norm, head), entering, [c for c, _ in chunk] + [r for _, r in chunk])
                loss = -torch.nn.functional.logsigmoid(both[:len(chunk)] - both[len(chunk):]).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        with torch.no_grad():
            scores = top_scores(base, (layers, norm, head), entering, list(range(len(keys)))).tolist()
        accuracies.append(held_out_share(scores, target, test))
    return accuracies


def main(argv: list[str] | None = None) -> int:
    from alpacafarm_annotators.gold_functions import coverage, helpfulness, organisation, repeated_phrases

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preferences", type=Path, help="a preference_data stage's preferences.jsonl")
    parser.add_argument("--max-length", type=int, default=192)
    parser.add_argument("--noise", type=float, default=0.25)
    parser.add_argument("--temperature", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, nargs="+", default=[0.01, 0.1, 1.0, 10.0])
    parser.add_argument("--top-blocks", type=int, default=0,
                        help="also train the top K blocks with the head on the gold (0: the head alone)")
    parser.add_argument("--folds", type=int, default=1, help="folds (of 4) for --top-blocks")
    parser.add_argument("--features", choices=("last", "rating", "mean", "answer"), default="last",
                        help="the head's frozen features (see features()); last: what the reward-model stage reads")
    parser.add_argument("--gold", action="append", default=[], metavar="MODULE:FUNCTION",
                        help="also probe this gold function (records, answers) -> scores, as the gold annotator's "
                             "'gold:' names it; repeatable")
    args = parser.parse_args(argv)
    from alpacafarm.errors import UserError
    from alpacafarm_annotators.gold import load_gold

    try:  # a bad target: one line, before any model loads
        extra = {target: load_gold(target) for target in args.gold}
    except UserError as exc:
        print(f"gold_proxy_probe: {exc}", file=sys.stderr)
        return 2
    if args.top_blocks > 0:
        for labels, noise, temperature in (("noisy", args.noise, args.temperature), ("clean", 0.0, None)):
            accuracies = top_block_accuracy(args.preferences, args.max_length, args.top_blocks, helpfulness,
                                            folds=args.folds, noise=noise, temperature=temperature)
            print(f"top {args.top_blocks} blocks + head, gold, {labels} labels: held-out accuracy "
                  f"{sum(accuracies) / len(accuracies):.3f} (folds: {', '.join(f'{a:.3f}' for a in accuracies)})")
    matrix, records, answers = features(args.preferences, args.max_length, args.features)
    by_instruction: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        by_instruction.setdefault(record["instruction"] + "\x00" + record["input"], []).append(i)
    groups = list(by_instruction.values())
    targets = {"gold (helpfulness)": helpfulness(records, answers),
               "coverage": [coverage(r, a) for r, a in zip(records, answers, strict=True)],
               "organisation": [organisation(a) for a in answers],
               "repetition": [-float(repeated_phrases(a)) for a in answers]}
    targets |= {target: [float(x) for x in fn(records, answers)] for target, fn in extra.items()}
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
