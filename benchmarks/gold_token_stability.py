"""Is a gold a property of the answer or of the token it stops on? Prints how much a score moves when an answer
loses its last few tokens.

A preference a policy can learn scores an answer about alike when one token at its end is cut; a score read off the
hidden state of the answer's last token may not: that state is mostly about predicting the next token, and where a
sample stops (an EOS, or the ``max_new_tokens`` cut that ends most 64-token SmolLM2 answers) is chance. Best-of-n
gains on such a score by selection (the proxy reads the same state), while a trained policy cannot make its answers
stop on favourable tokens. For up to ``--answers`` distinct answers of a preference file this scores each answer
whole and with its last 1, 3 and 8 tokens removed, by the gold (``--gold module:function``, default the gold world's
gold reward model) and, with ``--reward-model``, by a reward model folder (a ``reward_model`` stage's ``model/``),
and prints, per cut, the correlation with the whole answer's score, the mean change and the standard deviation of
the change beside the scores' own standard deviation.

    python benchmarks/gold_token_stability.py runs/learning-core-val/stages/preferences/preferences.jsonl \\
        --reward-model runs/learning-core-val/stages/reward_model/model

Measured 2026-11-28 (2-core CPU, 96 answers of 64 SmolLM2 tokens at most, sampled at temperature 0.7): the gold
reward model (``alpacafarm_annotators.gold_head:preference_head``) correlates 0.51 with itself one token shorter;
the change has standard deviation 0.79 against the scores' 0.79 (docs/gold.md, "Why the trained methods do not
learn it"). The answer gold (``gold_head:answer_head``) 0.998, its ``pooling: mean`` proxy 0.999.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

CUTS = (1, 3, 8)


def answers_of(preferences: Path, limit: int) -> list[tuple[dict[str, Any], str]]:
    """The first ``limit`` distinct (record, answer) pairs of a preference file, in file order."""
    seen: dict[tuple[str, str, str], dict[str, Any]] = {}
    for line in preferences.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        record = {"instruction": row["instruction"], "input": row.get("input") or ""}
        for key in ("output_1", "output_2"):
            seen.setdefault((record["instruction"], record["input"], row[key]), record)
    return [(record, key[2]) for key, record in list(seen.items())[:limit]]


def cut_variants(tokenizer: Any, answers: list[tuple[dict[str, Any], str]]) -> list[tuple[int, int, dict, str]]:
    """(answer index, tokens cut, record, text) for every answer whole (0) and shorter by each of :data:`CUTS`."""
    rows = []
    for i, (record, answer) in enumerate(answers):
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        rows.append((i, 0, record, answer))
        for cut in CUTS:
            if len(ids) > cut:
                rows.append((i, cut, record, tokenizer.decode(ids[:-cut])))
    return rows


def stability(scores: dict[tuple[int, int], float], n: int) -> list[dict[str, float]]:
    """Per cut: answers compared, correlation with the whole answer's score, mean and sd of the change."""
    import numpy as np

    whole = np.array([scores[(i, 0)] for i in range(n)])
    out = []
    for cut in CUTS:
        kept = [i for i in range(n) if (i, cut) in scores]
        a, b = whole[kept], np.array([scores[(i, cut)] for i in kept])
        out.append({"cut": cut, "answers": len(kept), "correlation": float(np.corrcoef(a, b)[0, 1]),
                    "mean_change": float(np.mean(b - a)), "sd_change": float(np.std(b - a)),
                    "sd_scores": float(np.std(whole))})
    return out


def answer_features(rows: list[tuple[int, int, dict, str]], kind: str, max_length: int) -> Any:
    """SmolLM2's final hidden states for each row's answer, read as the golds read them
    (:func:`gold_head.features_of`: ``last``, the answer's last token, where the last-token gold and proxy read;
    ``mean``, averaged over the answer's tokens) or at the appended EOS (``eos``: a fixed token, so only attention
    carries the answer there)."""
    import torch

    from alpacafarm_annotators.gold_head import features_of, frozen_model, text_of

    model, tokenizer, prompt = frozen_model("smollm2-135m-instruct")
    if kind != "eos":
        return features_of(model, tokenizer, prompt, [r[2] for r in rows], [r[3] for r in rows], pooling=kind,
                           max_length=max_length)
    out = []
    with torch.inference_mode():  # one text at a time: no padding, so the EOS is the last position
        for _, _, record, answer in rows:
            text = text_of(prompt, tokenizer.eos_token, record, answer)
            ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_length)["input_ids"]
            out.append(model.base_model(input_ids=ids).last_hidden_state[0, -1])
    return torch.stack(out).float()


def direction_stability(features: Any, rows: list[tuple[int, int, dict, str]], n: int, components: int = 32) -> float:
    """Mean over the top ``components`` principal directions of the whole answers' features of the correlation
    between an answer's projection and its projection one token shorter: how stable any head in that span is."""
    import numpy as np

    index = {(r[0], r[1]): k for k, r in enumerate(rows)}
    kept = [i for i in range(n) if (i, 1) in index]
    whole = features[[index[(i, 0)] for i in kept]].numpy()
    cut = features[[index[(i, 1)] for i in kept]].numpy()
    mean = whole.mean(0)
    _, _, vt = np.linalg.svd(whole - mean, full_matrices=False)
    a, b = (whole - mean) @ vt[:components].T, (cut - mean) @ vt[:components].T
    return float(np.mean([np.corrcoef(a[:, j], b[:, j])[0, 1] for j in range(components)]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preferences", type=Path, help="a preference_data stage's preferences.jsonl")
    parser.add_argument("--gold", default="alpacafarm_annotators.gold_head:preference_head", metavar="MODULE:FUNCTION")
    parser.add_argument("--reward-model", type=Path, help="also a reward model folder (a reward_model stage's model/)")
    parser.add_argument("--answers", type=int, default=96)
    parser.add_argument("--max-length", type=int, default=192)
    parser.add_argument("--features", nargs="*", choices=("last", "eos", "mean"), default=[],
                        help="also: how stable is any head on these frozen features (top 32 principal directions)")
    args = parser.parse_args(argv)

    from alpacafarm.model_loading import load_tokenizer
    from alpacafarm.model_sources import resolve_model_path
    from alpacafarm.recipe import ModelSpec
    from alpacafarm.registry import import_target
    from alpacafarm.rewards import RewardScorer

    spec = ModelSpec(name="smollm2-135m-instruct", dtype="float32", device="cpu", prompt_format="chat_template")
    tokenizer = load_tokenizer(spec, resolve_model_path(spec.name))
    answers = answers_of(args.preferences, args.answers)
    rows = cut_variants(tokenizer, answers)
    records, texts = [r[2] for r in rows], [r[3] for r in rows]
    scorers = {args.gold: import_target(args.gold, "gold")}
    if args.reward_model is not None:
        scorers[f"reward model {args.reward_model}"] = RewardScorer.from_path(
            str(args.reward_model), spec, max_length=args.max_length, batch_size=16)
    for name, scorer in scorers.items():
        values = [float(v) for v in scorer(records, texts)]
        scores = {(r[0], r[1]): v for r, v in zip(rows, values, strict=True)}
        print(f"{name} ({len(answers)} answers)")
        for row in stability(scores, len(answers)):
            print(f"  last {row['cut']} token(s) cut: correlation with the whole answer {row['correlation']:.3f}; "
                  f"change {row['mean_change']:+.3f} +- {row['sd_change']:.3f} (sd); scores' sd {row['sd_scores']:.3f}")
    one_cut = [r for r in rows if r[1] in (0, 1)]
    for kind in args.features:
        value = direction_stability(answer_features(one_cut, kind, args.max_length), one_cut, len(answers))
        print(f"{kind} features: top 32 principal directions, mean correlation with one token fewer {value:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
