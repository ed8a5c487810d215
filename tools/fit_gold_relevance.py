"""Fit the helpful gold's weights (a maintainer tool: it needs the shared data folder and a run's SFT samples).

    python tools/fit_gold_relevance.py --data ../shared/data --sft-samples RUN/stages/preferences/preferences.jsonl \
        --out plugins/alpacafarm_annotators/gold_helpful_smollm2.json [--cache FILE]

The helpful gold (``alpacafarm_annotators.gold_head:helpful_head``) is the mean head (``gold_head_smollm2_mean.json``,
GPT-4's AlpacaEval judgments read off SmolLM2's averaged answer states, length projected out; kept as fitted) plus
``beta`` times the answer's relevance to its instruction (per token over its first 32 tokens, clipped) discounted
by its echo share, minus ``gamma`` times the echo share. ``beta`` and ``gamma`` (and the head's own weight,
divided out) are one logistic regression on score differences over two kinds of pairs (the contrasts' total
weight against the judgments': ``--contrast-weight``, default 0.5):

- GPT-4's judgments (``results/*/alpaca_eval_gpt4/annotations.json``) on ``--instructions`` of the head's own 200
  instructions (the first 200 of the file; ties left out);
- contrasts any person makes, on the same instructions: Davinci003's answer beats the empty answer, generic
  filler, a refusal, another instruction's Davinci003 answer, and an echo of the instruction (fixed texts below;
  the tests probe other texts of each family and families not named here).

Instructions of the bundled AlpacaEval sample are never used (the tests use them). It prints the agreement with
GPT-4's judgments on ``--held-out`` instructions after the first 200 (neither the head nor these weights saw them),
for the head alone and for the helpful gold, and the mean score of each contrast family against the real answer.
The score is standardised (mean 0, sd 1) over the SFT samples (``--sft-samples``, a ``preference_data`` stage's
file), as the head is. Scores are computed once and kept in ``--cache``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from fit_gold_head import judgments, sft_samples  # the sibling tool's readers

HEAD_FILE = "gold_head_smollm2_mean.json"
RELEVANCE_CLIP = (-6.0, 6.0)
#: The contrasts the weights are fitted on (the tests use other texts of each family).
GENERIC = ("That is a great question. There are many factors to consider, and the answer depends on your "
           "situation. It is important to think carefully and consult reliable sources.",
           "There are many different ways to approach this, and each has its own advantages and disadvantages. "
           "Ultimately, the best choice depends on your specific needs and goals.")
REFUSALS = ("I'm sorry, but I can't help with that request.",
            "As an AI language model, I am unable to provide an answer to this question.")


def parts(items: list[tuple[str, str]], cache: Path | None, name: str) -> list[tuple[float, float, float]]:
    """(head score, relevance, echo share) of each (instruction, answer), as ``helpful_head`` computes them."""
    from alpacafarm_annotators import gold_head
    from alpacafarm_annotators.gold_relevance import NEUTRAL, WINDOW, echo_share, read_answers, relevance

    path = cache.with_suffix(f".{name}.tokens.json") if cache is not None else None
    stored = json.loads(path.read_text(encoding="utf-8")) if path is not None and path.is_file() else None
    if stored is not None and [tuple(x) for x in stored["items"]] == items:  # the per-token log-probabilities kept
        return [(h, r, echo_share({"instruction": i}, a)) for (i, a), h, r in
                zip(items, stored["head"], relevance(stored["own"], stored["neutral"], WINDOW), strict=True)]
    model, tokenizer, prompt, (weight, bias), head, _ = gold_head._scorer(Path(gold_head.__file__).with_name(HEAD_FILE))
    size = int(head["max_length"])
    answers = [a for _, a in items]
    features, own = read_answers(model, tokenizer, [prompt(i, "") for i, _ in items], answers, batch_size=16,
                                 max_length=size)
    _, neutral = read_answers(model, tokenizer, [prompt(*NEUTRAL)] * len(items), answers, batch_size=16,
                              max_length=size, features=False)
    heads = (features @ weight + bias).tolist()
    if path is not None:
        path.write_text(json.dumps({"items": items, "head": heads, "own": own, "neutral": neutral}), encoding="utf-8")
    return [(float(h), float(r), echo_share({"instruction": i}, a)) for (i, a), h, r in
            zip(items, heads, relevance(own, neutral, WINDOW), strict=True)]


def raw(part: tuple[float, float, float], beta: float, gamma: float) -> float:
    head, related, echo = part
    return head + beta * min(max(related, RELEVANCE_CLIP[0]), RELEVANCE_CLIP[1]) * (1 - echo) - gamma * echo


def fit(pairs: list[tuple[tuple[float, float, float], tuple[float, float, float], float]]) -> tuple[float, float]:
    """(beta, gamma) of a logistic regression of ``winner ≻ loser`` on the difference of (head, relevance term,
    -echo), the head's coefficient divided out; ``pairs``: (winner parts, loser parts, weight)."""
    import torch

    def row(p: tuple[float, float, float]) -> list[float]:
        head, related, echo = p
        return [head, min(max(related, RELEVANCE_CLIP[0]), RELEVANCE_CLIP[1]) * (1 - echo), -echo]

    x = torch.tensor([[a - b for a, b in zip(row(won), row(lost), strict=True)] for won, lost, _ in pairs])
    weights = torch.tensor([w for _, _, w in pairs])
    coef = torch.zeros(3, requires_grad=True)
    optimizer = torch.optim.LBFGS([coef], max_iter=500, line_search_fn="strong_wolfe")

    def closure() -> Any:
        optimizer.zero_grad()
        loss = (torch.nn.functional.softplus(-(x @ coef)) * weights).sum() / weights.sum() + 1e-3 * (coef ** 2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    a, b, c = coef.tolist()
    if a <= 0:
        sys.exit(f"fit_gold_relevance: the head's fitted weight is {a:.3f} (not positive): GPT-4's judgments "
                 "did not carry the fit; more --instructions?")
    return b / a, c / a


def main(argv: list[str] | None = None) -> int:
    from alpacafarm.data import load_source
    from alpacafarm.recipe import DataSource
    from alpacafarm_annotators.gold_relevance import WINDOW

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--sft-samples", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--instructions", type=int, default=80, help="of the head's 200, to fit the weights on")
    parser.add_argument("--held-out", type=int, default=80, help="instructions after the first 200, to measure on")
    parser.add_argument("--contrast-weight", type=float, default=0.5,
                        help="the contrasts' total weight against the GPT-4 pairs' (1: equal)")
    parser.add_argument("--max-relevance-correlation", type=float, default=0.7,
                        help="raise the relevance weight until an answer's score under its own instruction "
                             "correlates at most this much with its score under another (on the fit instructions)")
    parser.add_argument("--cache", type=Path)
    args = parser.parse_args(argv)
    if not args.sft_samples.is_file():
        sys.exit(f"fit_gold_relevance: --sft-samples {args.sft_samples} is not a file")

    held = {r["instruction"] for r in load_source(DataSource(builtin="alpaca_eval_sample"))}
    rows = [r for r in judgments(args.data, 805) if r[0] not in held]
    order = list(dict.fromkeys(r[0] for r in judgments(args.data, 805)))
    head_set = set(order[:200])
    fit_on = [i for i in order[:200] if i not in held][:args.instructions]
    measure_on = set([i for i in order[200:] if i not in held][:args.held_out])
    fit_set = set(fit_on)
    train = [r for r in rows if r[0] in fit_set]
    test = [r for r in rows if r[0] in measure_on]
    assert not measure_on & head_set

    reference = {i: a for i, a, _, _ in train}  # Davinci003's answer (output_1 of every judged pair)
    families: dict[str, list[tuple[str, str]]] = {
        "empty": [(i, "") for i in fit_on],
        "generic": [(i, GENERIC[k % len(GENERIC)]) for k, i in enumerate(fit_on)],
        "refusal": [(i, REFUSALS[k % len(REFUSALS)]) for k, i in enumerate(fit_on)],
        "other instruction's answer": [(i, reference[fit_on[(k + 1) % len(fit_on)]]) for k, i in enumerate(fit_on)],
        "echo": [(i, i) for i in fit_on],
    }
    both = train + test
    judged_items = list(dict.fromkeys([(i, a) for i, a, _, _ in both] + [(i, b) for i, _, b, _ in both]))
    contrast_items = list(dict.fromkeys(x for items in families.values() for x in items))
    real_items = [(i, reference[i]) for i in fit_on]
    samples = sft_samples(args.sft_samples)
    computed = dict(zip(judged_items, parts(judged_items, args.cache, "judged"), strict=True))
    computed.update(zip(contrast_items, parts(contrast_items, args.cache, "contrasts"), strict=True))
    sft = parts(samples, args.cache, "sft")

    def winner_loser(r: tuple[str, str, str, int]) -> tuple[Any, Any]:
        i, a, b, p = r
        return (computed[(i, a)], computed[(i, b)]) if p == 1 else (computed[(i, b)], computed[(i, a)])

    gpt4 = [(*winner_loser(r), 1.0) for r in train]
    contrast = [(computed[real], computed[non]) for items in families.values()
                for real, non in zip(real_items, items, strict=True)]
    weight = args.contrast_weight * len(gpt4) / len(contrast)
    beta, gamma = fit(gpt4 + [(won, lost, weight) for won, lost in contrast])
    print(f"fitted on {len(gpt4)} GPT-4 pairs and {len(contrast)} contrasts ({len(fit_on)} instructions): "
          f"beta {beta:.4f}, gamma {gamma:.4f}")
    others = families["other instruction's answer"]  # item k: instruction k+1's answer under instruction k

    def own_other(b: float) -> float:
        """On the fit instructions: the correlation of an answer's score under its own instruction with its score
        under another's (the relevance rule's statistic)."""
        own = [raw(computed[real_items[(k + 1) % len(fit_on)]], b, gamma) for k in range(len(fit_on))]
        return statistics.correlation(own, [raw(computed[item], b, gamma) for item in others])

    logistic_beta, fitted_correlation = beta, own_other(beta)
    if fitted_correlation > args.max_relevance_correlation:
        # the logistic fit weighs relevance by how GPT-4 and the contrasts vary it, not by whether a score moves
        # with the instruction at all: raise beta (on the fit instructions only) until it does
        low, high = beta, beta
        while own_other(high) > args.max_relevance_correlation:
            low, high = high, high * 2
            if high > 100:
                sys.exit("fit_gold_relevance: no relevance weight below 100 meets --max-relevance-correlation")
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (middle, high) if own_other(middle) > args.max_relevance_correlation else (low, middle)
        beta = high
    print(f"own/other-instruction correlation on the fit instructions: {fitted_correlation:.3f} at the logistic "
          f"beta {logistic_beta:.4f}; {own_other(beta):.3f} at beta {beta:.4f} "
          f"(--max-relevance-correlation {args.max_relevance_correlation})")

    values = [raw(p, beta, gamma) for p in sft]
    mean = sum(values) / len(values)
    scale = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    for label, b, g in (("the head alone", 0.0, 0.0), ("the logistic fit", logistic_beta, gamma),
                        ("the helpful gold", beta, gamma)):
        agree = sum(raw(w, b, g) > raw(lo, b, g) for w, lo in (winner_loser(r) for r in test))
        print(f"agreement with GPT-4 on {len(test)} pairs of {len(measure_on)} held-out instructions, "
              f"{label}: {agree / len(test):.3f}")
    for name, items in families.items():
        deltas = [(raw(computed[non], beta, gamma) - raw(computed[real], beta, gamma)) / scale
                  for real, non in zip(real_items, items, strict=True)]
        print(f"  {name}: gold minus the real answer's {sum(deltas) / len(deltas):+.2f} sd (fitted on)")
    document = {
        "head_file": HEAD_FILE, "relevance_weight": round(beta, 6), "echo_weight": round(gamma, 6),
        "relevance_clip": list(RELEVANCE_CLIP), "relevance_window": WINDOW, "mean": round(mean, 6),
        "scale": round(scale, 6),
        "fitted": {"judgments": "alpaca_eval_gpt4 (results/*/alpaca_eval_gpt4/annotations.json)",
                   "instructions": len(fit_on), "gpt4_pairs": len(gpt4), "contrast_weight": args.contrast_weight,
                   "logistic_relevance_weight": round(logistic_beta, 6),
                   "max_relevance_correlation": args.max_relevance_correlation,
                   "contrasts": {k: len(v) for k, v in
                                                                                    families.items()},
                   "standardised_on": f"{len(samples)} SFT samples", "tool": "tools/fit_gold_relevance.py"},
    }
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
