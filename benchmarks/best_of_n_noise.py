"""Best-of-n win-rate against n for reward models trained on preferences with different label noise.

    python benchmarks/best_of_n_noise.py --run runs/quickstart-offline-judge [--noise 0 0.25 0.35 0.45] \\
        [--json out.json]

Reuses the samples of a run of recipes/quickstart-offline-judge.yaml, so every noise level sees exactly the same
answers: the preference pairs of its ``preferences`` stage are relabelled by the offline pool with ``p_label_flip``
= each noise level (the flipped pairs are nested: a pair flipped at 25% is also flipped at 35%), a head-only reward
model is fitted on each labelling exactly as that recipe's ``reward_model`` stage does (``trainable_layers: 0``,
same settings), the ``best_of_n`` stage's samples are rescored, and best-of-n for every n is judged against the
references by the noiseless offline judge. Prints win-rate ± SE, the paired difference to n = 1 (± its paired SE)
and the mean proxy reward per (noise, n) — the paper's Figure 13 (over-optimization grows with label noise) at CPU
scale.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="runs/quickstart-offline-judge",
                        help="a finished run of recipes/quickstart-offline-judge.yaml")
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.25, 0.35, 0.45])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    from alpacafarm.data import read_records
    from alpacafarm.model_loading import load_classifier, load_tokenizer
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import load_recipe
    from alpacafarm.reward_selection import select
    from alpacafarm.rewards import last_token_features, with_eos
    from alpacafarm.types import Pair
    from alpacafarm_evaluation.evaluator import instruction_scores
    from alpacafarm_evaluation.pairing import annotate_and_score, load_references, pair_outputs
    from alpacafarm_evaluation.results import paired_difference
    from alpacafarm_methods.reward_model.head import fit_head
    from alpacafarm_methods.reward_model.method import preference_rows

    run = Path(args.run)
    loaded = load_recipe(run / "recipe.yaml")
    spec = loaded.recipe.model
    rm_config = loaded.stage_configs["reward_model"]
    pairs = read_records(run / "stages" / "preferences" / "preferences.jsonl")
    samples = read_records(run / "stages" / "best_of_n" / "samples.jsonl")
    registry = get_registry()
    model_path = spec.name
    tokenizer = load_tokenizer(spec, model_path)

    # Features once for every distinct text: the preference answers and the best-of-n samples.
    def full_text(record: dict, output: str) -> str:
        from alpacafarm.prompts import format_prompt

        prompt = format_prompt(record["instruction"], record.get("input") or None, style=spec.prompt_format,
                               tokenizer=tokenizer)
        return with_eos(prompt + output, tokenizer.eos_token)

    sample_texts = [full_text(s, s["output"]) for s in samples]
    texts = list(dict.fromkeys([*sample_texts, *(full_text(p, p[f"output_{i}"]) for p in pairs for i in (1, 2))]))
    index = {t: i for i, t in enumerate(texts)}
    model = load_classifier(spec.for_inference(), model_path)
    features = last_token_features(model, tokenizer, texts, batch_size=16, max_length=rm_config.max_length)
    del model

    references = load_references()
    judge = registry.get("annotator", "offline")({})
    results = []
    groups: dict[str, list[dict]] = {}
    for s in samples:
        groups.setdefault(s["instruction"] + "\x00" + (s.get("input") or ""), []).append(s)
    ns = sorted({1, *[n for n in (1, 2, 4, 8, 16, 32) if n <= min(len(g) for g in groups.values())]})
    for noise in args.noise:
        pool = registry.get("annotator", "offline_ann")({"p_label_flip": noise})
        labels = pool.annotate([Pair.from_record(p) for p in pairs])
        pool.close()
        labelled = [{**p, "preference": a.preference} for p, a in zip(pairs, labels, strict=True)]
        rows, _ = preference_rows(labelled, style=spec.prompt_format, tokenizer=tokenizer)
        chosen = [index[with_eos(r["prompt"] + r["chosen"], tokenizer.eos_token)] for r in rows]
        rejected = [index[with_eos(r["prompt"] + r["rejected"], tokenizer.eos_token)] for r in rows]
        steps = rm_config.max_steps if rm_config.max_steps and rm_config.max_steps > 0 else \
            round(rm_config.num_train_epochs * 100)
        weight, _ = fit_head(features, chosen, rejected, learning_rate=rm_config.learning_rate, steps=steps,
                             weight_decay=rm_config.weight_decay, seed=0)
        rewards = (features @ weight).tolist()
        scored = [[{**s, "reward": rewards[index[full_text(s, s["output"])]]} for s in g] for g in groups.values()]
        baseline = None
        for n in ns:
            chosen_outputs = select(scored, n)
            paired, skipped = pair_outputs(chosen_outputs, references, None, f"best_of_{n}", generator=f"best_of_{n}")
            with tempfile.TemporaryDirectory() as tmp:
                metrics = annotate_and_score(paired, judge, Path(tmp), skipped)
                per_instruction = instruction_scores(Path(tmp) / "annotations.json")
            baseline = baseline or per_instruction
            delta, paired_se = paired_difference(per_instruction, baseline)
            results.append({"noise": noise, "n": n, "win_rate": metrics["win_rate"],
                            "standard_error": metrics["standard_error"], "delta_vs_n1": delta,
                            "paired_standard_error": paired_se, "n_total": metrics["n_total"],
                            "proxy_reward": sum(c["reward"] for c in chosen_outputs) / len(chosen_outputs),
                            "avg_length": metrics["avg_length"]})
    judge.close()

    print(f"best-of-n on {len(groups)} instructions of {run} ({len(pairs)} preference pairs, judge: offline)")
    print(f"{'noise':>6} {'n':>3} {'win-rate':>9} {'± SE':>6} {'Δ vs n=1':>9} {'± paired':>9} "
          f"{'proxy':>8} {'avg len':>8}")
    for r in results:
        print(f"{r['noise']:>6.2f} {r['n']:>3} {r['win_rate']:>9.2f} {r['standard_error']:>6.2f} "
              f"{r['delta_vs_n1']:>9.2f} {r['paired_standard_error'] or 0.0:>9.2f} {r['proxy_reward']:>8.3f} "
              f"{r['avg_length']:>8.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
