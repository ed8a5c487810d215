"""Fit the gold reward model's head (a maintainer tool: it needs the shared data folder and a run's SFT samples).

    python tools/fit_gold_head.py --data ../shared/data --sft-samples RUN/stages/preferences/preferences.jsonl \
        --out plugins/alpacafarm_annotators/gold_head_smollm2.json [--features-cache FILE]
    python tools/fit_gold_head.py ... --pooling mean --cuts 300 \
        --out plugins/alpacafarm_annotators/gold_head_smollm2_mean.json

``--pooling mean`` reads the hidden states averaged over the answer's tokens instead of the last token's
(``gold_head.answer_head``; its proxy is a head-only reward model with ``pooling: mean``). ``--cuts N`` also removes
how the features move when an answer is cut short (step 2 below).

The gold of ``alpacafarm_annotators.gold_head:preference_head`` is ``w · h + b``: ``h`` is SmolLM2-135M-Instruct's
final hidden state at the answer's last token (what the head-only proxy reads), ``w`` a Bradley-Terry head fitted
to GPT-4's recorded judgments (``results/*/alpaca_eval_gpt4/annotations.json``: Davinci003 against seven systems,
the first ``--instructions`` AlpacaEval instructions; ties left out). Then, on the SFT model's own samples
(``--sft-samples``, a ``preference_data`` stage's file):

1. the head is fitted in the span of the top ``--components`` principal directions of those samples' features
   (the directions along which the SFT model's own answers differ most: a proxy fitted on a few hundred noisy
   labels recovers a direction there far better than one among all 576; measured: 32 components, GPT-4
   agreement 0.604 held out, a head-only proxy from 25%-noisy labels ranks it 0.67-0.69; all 576: 0.619 and
   0.62-0.63);
2. length is projected out: with ``c`` the covariance of ``h`` with the answer's length in tokens,
   ``w <- w - (w · c) / (c · c) c``, so the gold's covariance with length over those samples is zero; with
   ``--cuts N``, ``w`` is also made orthogonal to how the features move when an answer is cut to a third or two
   thirds of its words (the slope per token cut and the mean shift, over the SFT samples and N other systems'
   judged answers, which are longer; the bundled AlpacaEval sample's instructions are left out, since
   tests/test_gold_head.py cuts those answers), so that cutting an answer short gains nothing on average;
3. the score is standardised over those samples (mean 0, standard deviation 1: ``w`` and ``b`` rescaled).

It prints the held-out agreement with GPT-4 (5 folds by instruction, before length removal and after), the gold's
correlation with length, and its standard deviation within an instruction against overall, on the SFT samples.
Features are computed once (about 10 minutes on 2 cores for 200 instructions) and kept in ``--features-cache``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m-instruct"
MAX_LENGTH = 192


def judgments(data: Path, instructions: int) -> list[tuple[str, str, str, int]]:
    """(instruction, Davinci003's answer, the other system's answer, GPT-4's preference 1 or 2)."""
    files = sorted(data.glob("tatsu-lab_alpaca_eval/results/*/alpaca_eval_gpt4/annotations.json"))
    if not files:
        sys.exit(f"fit_gold_head: no results/*/alpaca_eval_gpt4/annotations.json under {data}")
    rows = [json.loads(f.read_text(encoding="utf-8")) for f in files]
    keep = set(list(dict.fromkeys(r["instruction"] for r in rows[0]))[:instructions])
    out = []
    for table in rows:
        for r in table:
            if r["instruction"] in keep and r["preference"] in (1, 2) and r["output_1"] != r["output_2"]:
                out.append((r["instruction"], r["output_1"], r["output_2"], int(r["preference"])))
    return out


def sft_samples(path: Path) -> list[tuple[str, str]]:
    """Every distinct (instruction, answer) of a preference file."""
    seen: dict[tuple[str, str], None] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        for answer in (row["output_1"], row["output_2"]):
            seen.setdefault((row["instruction"], answer), None)
    return list(seen)


def features(frozen: tuple[Any, Any, Any], items: list[tuple[str, str]], cache: Path | None, name: str,
             pooling: str = "last") -> Any:
    """The gold's features of each (instruction, answer), read as :func:`gold_head.features_of` reads them."""
    import torch

    from alpacafarm_annotators.gold_head import features_of

    if pooling != "last":
        name = f"{name}-{pooling}"
    if cache is not None and cache.with_suffix(f".{name}.pt").is_file():
        stored = torch.load(cache.with_suffix(f".{name}.pt"))
        if stored["items"] == items:
            return stored["features"]
    model, tokenizer, prompt = frozen
    matrix = features_of(model, tokenizer, prompt, [{"instruction": i} for i, _ in items], [a for _, a in items],
                         pooling=pooling, max_length=MAX_LENGTH)
    if cache is not None:
        torch.save({"items": items, "features": matrix}, cache.with_suffix(f".{name}.pt"))
    return matrix


def length_direction(matrix: Any, lengths: Any) -> Any:
    """The features' covariance with length across answers."""
    centred = matrix - matrix.mean(0)
    return centred.T @ (lengths - lengths.mean()) / len(lengths)


def cut_direction(full: Any, cut: Any, full_lengths: Any, cut_lengths: Any) -> Any:
    """How the features move per token an answer is cut by (the least-squares slope of the feature change on the
    length change over pairs of an answer and its prefix)."""
    shortened = cut_lengths - full_lengths
    return (cut - full).T @ shortened / (shortened @ shortened)


def remove_directions(weight: Any, directions: list[Any]) -> Any:
    """``weight`` minus its component in the span of ``directions`` (the score then does not move along any)."""
    import torch

    basis, _ = torch.linalg.qr(torch.stack(directions, dim=1))
    return weight - basis @ (basis.T @ weight)


def remove_length(weight: Any, matrix: Any, lengths: Any) -> Any:
    """``weight`` minus its component along the features' covariance with length (zero covariance after)."""
    return remove_directions(weight, [length_direction(matrix, lengths)])


def prefixes(items: list[tuple[str, str]], fractions: tuple[float, ...]) -> list[tuple[int, str]]:
    """(index of the answer, its first ``fraction`` of words) for each answer and fraction; answers of fewer
    than 6 words are left out."""
    out = []
    for k, (_, answer) in enumerate(items):
        words = answer.split(" ")
        if len(words) >= 6:
            out.extend((k, " ".join(words[: max(1, round(len(words) * f))])) for f in fractions)
    return out


def fit(matrix: Any, pairs: list[tuple[int, int]], weight_decay: float) -> Any:
    from alpacafarm_methods.reward_model.head import fit_head

    weight, _ = fit_head(matrix, [c for c, _ in pairs], [r for _, r in pairs], learning_rate=1e-2, steps=300,
                         weight_decay=weight_decay, seed=0)
    return weight.reshape(-1)


def main(argv: list[str] | None = None) -> int:
    import torch

    from alpacafarm.data import load_source
    from alpacafarm.recipe import DataSource
    from alpacafarm_annotators.gold_head import frozen_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--sft-samples", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--instructions", type=int, default=200)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--components", type=int, default=32)
    parser.add_argument("--features-cache", type=Path)
    parser.add_argument("--pooling", choices=("last", "mean"), default="last",
                        help="read the answer's last token (the proxy's features) or average over its tokens")
    parser.add_argument("--cuts", type=int, default=0,
                        help="also remove how the score moves when an answer is cut to a third or two thirds of its "
                             "words, over the SFT samples and this many judged answers (0: length across samples only)")
    args = parser.parse_args(argv)
    if not args.sft_samples.is_file():
        sys.exit(f"fit_gold_head: --sft-samples {args.sft_samples} is not a file")

    rows = judgments(args.data, args.instructions)
    texts = list(dict.fromkeys([(i, a) for i, a, _, _ in rows] + [(i, b) for i, _, b, _ in rows]))
    index = {t: k for k, t in enumerate(texts)}
    pairs = [(index[(i, a)], index[(i, b)]) if p == 1 else (index[(i, b)], index[(i, a)]) for i, a, b, p in rows]
    instruction_of = [i for i, _, _, _ in rows]
    frozen = frozen_model(MODEL)  # loaded once
    tokenizer = frozen[1]
    matrix = features(frozen, texts, args.features_cache, "judged", args.pooling)
    samples = sft_samples(args.sft_samples)
    sft = features(frozen, samples, args.features_cache, "sft", args.pooling)

    def length(answers: list[str]) -> Any:
        return torch.tensor([float(len(tokenizer(a)["input_ids"])) for a in answers])

    lengths = length([a for _, a in samples])
    centre = sft.mean(0)
    basis = torch.linalg.svd(sft - centre, full_matrices=False).Vh[:args.components].T  # [hidden, components]

    def project(x: Any) -> Any:  # into the top principal directions of the SFT samples
        return (x - centre) @ basis

    directions = [length_direction(project(sft), lengths)]
    removed_on = f"{len(samples)} SFT samples"
    if args.cuts:
        # Answers cut to a third and two thirds of their words: the SFT samples (64 tokens at most) and, for
        # longer answers, other systems' judged answers on instructions outside the bundled AlpacaEval sample
        # (whose Davinci003 answers tests/test_gold_head.py cuts in half), so the test sees answers never used here.
        held = {r["instruction"] for r in load_source(DataSource(builtin="alpaca_eval_sample"))}
        others = list(dict.fromkeys((i, b) for i, _, b, _ in rows if i not in held))
        others = random.Random(0).sample(others, min(args.cuts, len(others)))
        for name, items, full in (("sft", samples, sft), ("judged", others, matrix[[index[o] for o in others]])):
            cuts = prefixes(items, (1 / 3, 2 / 3))
            cut = features(frozen, [(items[k][0], a) for k, a in cuts], args.features_cache, f"{name}-cut",
                           args.pooling)
            whole = full[[k for k, _ in cuts]]
            directions.append(cut_direction(project(whole), project(cut), length([items[k][1] for k, _ in cuts]),
                                            length([a for _, a in cuts])))
            directions.append((project(cut) - project(whole)).mean(0))
        removed_on += f" and their cuts, {len(others)} judged answers' cuts"
    matrix, sft = project(matrix), project(sft)

    # held-out agreement with GPT-4, folds by instruction
    names = sorted(set(instruction_of))
    random.Random(0).shuffle(names)
    for label, length_free in (("as fitted", False), ("length removed", True)):
        agree = total = 0
        for fold in range(5):
            test = set(names[fold::5])
            train = [p for p, i in zip(pairs, instruction_of, strict=True) if i not in test]
            weight = fit(matrix, train, args.weight_decay)
            if length_free:
                weight = remove_directions(weight, directions)
            scores = matrix @ weight
            held = [p for p, i in zip(pairs, instruction_of, strict=True) if i in test]
            agree += sum(bool(scores[c] > scores[r]) for c, r in held)
            total += len(held)
        print(f"held-out agreement with GPT-4 ({label}): {agree / total:.3f} of {total} pairs")

    weight = remove_directions(fit(matrix, pairs, args.weight_decay), directions)
    scores = sft @ weight
    scale = float(scores.std())
    weight, bias = weight / scale, -float(scores.mean()) / scale
    gold = sft @ weight + bias
    weight, bias = basis @ weight, bias - float(centre @ basis @ weight)  # on the raw features
    by_instruction: dict[str, list[float]] = {}
    for (instruction, _), value in zip(samples, gold.tolist(), strict=True):
        by_instruction.setdefault(instruction, []).append(value)
    within = [v - sum(g) / len(g) for g in by_instruction.values() for v in g]
    print(f"SFT samples: {len(samples)}; gold sd overall {float(gold.std()):.3f}, within an instruction "
          f"{(sum(x * x for x in within) / len(within)) ** 0.5:.3f}; correlation with length "
          f"{float(torch.corrcoef(torch.stack([gold, lengths]))[0, 1]):+.3f}")
    document = {
        "model": MODEL, "max_length": MAX_LENGTH, **({"pooling": args.pooling} if args.pooling != "last" else {}),
        "bias": bias, "weight": [round(float(x), 8) for x in weight],
        "fitted": {"judgments": "alpaca_eval_gpt4 (results/*/alpaca_eval_gpt4/annotations.json)",
                   "instructions": args.instructions, "pairs": len(pairs), "weight_decay": args.weight_decay,
                   "components": args.components,
                   "length_removed_on": removed_on, "tool": "tools/fit_gold_head.py"},
    }
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(document) + "\n", encoding="utf-8")
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
