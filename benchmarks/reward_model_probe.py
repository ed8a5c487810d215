"""How well does a head-only reward model fitted on a preference set rank answers the way the noiseless judge does?

    python benchmarks/reward_model_probe.py --judged runs/compare-val \\
        --preferences runs/compare-final runs/prefs07:48 [--weight-decay 10 1 0.1] [--json out.json]

For each preference set (a run directory whose ``preferences`` stage is read; ``:N`` keeps its first N
instructions) a head-only reward model is fitted exactly as the ``reward_model`` stage with ``trainable_layers: 0``
fits it (same features, learning rate and steps as the judged run's ``reward_model`` config; the weight decay is
varied), then scored two ways:

1. **cross-validated by instruction**: the instructions split into ``--folds`` groups, a head fitted on the pairs of
   the others, its accuracy on the held-out group's pairs that the pool's judge labelled (not its noise member,
   which labels at random: ``noise: true`` on the record), averaged over folds;
2. **on the answers a policy gives**: every pair of answers to the same instruction in the judged run's
   ``evaluate`` stage (the systems it evaluated, each answer with the noiseless judge's probability of beating the
   reference) whose probabilities differ by more than ``--min-gap``: the share the head orders as the judge does
   (± its binomial SE). That is what best-of-n, expert iteration and PPO depend on.

With ``--trainable-layers N`` the reward model trains its top N blocks with TRL's ``RewardTrainer`` instead (as
the stage does with that setting; ``--learning-rate``, ``--epochs``, batch 8, cosine schedule) on all the pairs,
and only (2) is reported (minutes per fit on a CPU, so no cross-validation).

Use a judged run that evaluated validation instructions (``evaluate_on: validation``), so choosing a preference
set with this probe never looks at the held-out instructions.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--judged", required=True, help="a finished run whose evaluate stage judged several systems")
    parser.add_argument("--preferences", nargs="+", required=True, help="run directories (RUN or RUN:N instructions)")
    parser.add_argument("--weight-decay", type=float, nargs="+", default=[10.0, 1.0, 0.1])
    parser.add_argument("--folds", type=int, default=4)
    parser.add_argument("--min-gap", type=float, default=0.1, help="smallest judge-probability gap that makes a pair")
    parser.add_argument("--trainable-layers", type=int, help="train the top N blocks instead of the head alone")
    parser.add_argument("--learning-rate", type=float, default=2e-5, help="with --trainable-layers")
    parser.add_argument("--epochs", type=float, default=2.0, help="with --trainable-layers")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    from alpacafarm.data import read_records
    from alpacafarm.model_loading import load_classifier, load_tokenizer
    from alpacafarm.preference_rows import preference_rows, winner
    from alpacafarm.prompts import format_prompt
    from alpacafarm.recipe import load_recipe
    from alpacafarm.rewards import last_token_features, with_eos
    from alpacafarm_methods.reward_model.head import STEPS_PER_EPOCH, fit_head

    judged = Path(args.judged)
    loaded = load_recipe(judged / "recipe.yaml")
    spec = loaded.recipe.model
    rm_config = loaded.stage_configs["reward_model"]
    steps = rm_config.max_steps if rm_config.max_steps and rm_config.max_steps > 0 else \
        round(rm_config.num_train_epochs * STEPS_PER_EPOCH)
    tokenizer = load_tokenizer(spec, spec.name)
    features: dict[str, object] = {}
    backbone: list[object] = []  # the frozen model behind the head's features, loaded on first use

    def full_text(record: dict, output: str) -> str:
        prompt = format_prompt(record["instruction"], record.get("input") or None, style=spec.prompt_format,
                               tokenizer=tokenizer)
        return with_eos(prompt + output, tokenizer.eos_token)

    def key(record: dict) -> str:
        return record["instruction"] + "\x00" + (record.get("input") or "")

    def vectors(texts: list[str]):
        import torch

        new = [t for t in dict.fromkeys(texts) if t not in features]
        if new:
            if not backbone:
                backbone.append(load_classifier(spec.for_inference(), spec.name))
            computed = last_token_features(backbone[0], tokenizer, new, batch_size=16, max_length=rm_config.max_length)
            features.update(zip(new, computed, strict=True))
        return torch.stack([features[t] for t in texts])

    # The policy's answers: pairs within an instruction ordered by the noiseless judge's probability.
    answers: dict[str, list[tuple[str, float]]] = {}
    for path in sorted((judged / "stages" / "evaluate" / "systems").glob("*/annotations.json")):
        for a in json.loads(path.read_text(encoding="utf-8")):
            answers.setdefault(key(a), []).append((full_text(a, a["output_2"]), float(a["preference"]) - 1.0))
    policy_pairs = [(x, y) if px > py else (y, x) for group in answers.values()
                    for (x, px), (y, py) in itertools.combinations(group, 2) if abs(px - py) > args.min_gap and x != y]
    if not policy_pairs:
        raise SystemExit(f"{judged}: no two judged answers to one instruction differ by more than {args.min_gap} "
                         "(is it a finished run whose evaluate stage judged several systems?)")

    def fit(pairs: list[tuple[str, str]], weight_decay: float):
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        index = {t: i for i, t in enumerate(texts)}
        weight, _ = fit_head(vectors(texts), [index[c] for c, _ in pairs], [index[r] for _, r in pairs],
                             learning_rate=rm_config.learning_rate, steps=steps, weight_decay=weight_decay, seed=0)
        return weight

    def accuracy(weight, pairs: list[tuple[str, str]]) -> float:
        chosen = vectors([c for c, _ in pairs]) @ weight
        rejected = vectors([r for _, r in pairs]) @ weight
        return float((chosen > rejected).float().mean())

    def trained_accuracy(rows: list[dict[str, str]]) -> float:
        from alpacafarm.rewards import RewardScorer
        from alpacafarm_methods.reward_model.method import RewardModelConfig, build_reward_trainer, pairwise_accuracy

        with tempfile.TemporaryDirectory() as tmp:
            config = RewardModelConfig(output_dir=tmp, trainable_layers=args.trainable_layers,
                                       learning_rate=args.learning_rate, num_train_epochs=args.epochs,
                                       per_device_train_batch_size=8, max_length=rm_config.max_length,
                                       lr_scheduler_type="cosine", save_strategy="no", report_to=[], seed=0)
            trainer = build_reward_trainer(config, spec, spec.name, rows)
            trainer.train()
            trainer.save_model(f"{tmp}/model")
            tokenizer.save_pretrained(f"{tmp}/model")
            scorer = RewardScorer.from_path(f"{tmp}/model", spec, max_length=rm_config.max_length)
            # The pairs' texts are whole (prompt, answer and EOS): an empty prompt scores them as they are.
            return pairwise_accuracy(scorer, [{"prompt": "", "chosen": c, "rejected": r} for c, r in policy_pairs],
                                     batch_size=16)["eval_accuracy"]

    results = []
    for source in args.preferences:
        run, _, limit = source.partition(":")
        records = read_records(Path(run) / "stages" / "preferences" / "preferences.jsonl")
        keys = list(dict.fromkeys(key(r) for r in records))
        if limit:
            keep = set(keys[: int(limit)])
            records, keys = [r for r in records if key(r) in keep], keys[: int(limit)]
        labelled = []
        for r in records:
            won = winner(r.get("preference"))
            if won is not None:
                labelled.append((key(r), full_text(r, r[f"output_{won}"]), full_text(r, r[f"output_{3 - won}"]),
                                 bool(r.get("noise"))))
        if args.trainable_layers is not None:
            on_policy = trained_accuracy(preference_rows(records, style=spec.prompt_format, tokenizer=tokenizer)[0])
            results.append({"preferences": source, "n_instructions": len(keys), "n_pairs": len(labelled),
                            "trainable_layers": args.trainable_layers, "learning_rate": args.learning_rate,
                            "epochs": args.epochs, "policy_accuracy": on_policy,
                            "policy_se": math.sqrt(on_policy * (1 - on_policy) / len(policy_pairs)),
                            "n_policy_pairs": len(policy_pairs)})
            print(f"{source}: {len(keys)} instructions, {len(labelled)} pairs, top {args.trainable_layers} blocks "
                  f"trained (lr {args.learning_rate:g}, {args.epochs:g} epochs): policy answers {on_policy:.3f} ± "
                  f"{results[-1]['policy_se']:.3f} ({len(policy_pairs)} pairs)", flush=True)
            continue
        shuffled = list(keys)
        random.Random(0).shuffle(shuffled)
        for weight_decay in args.weight_decay:
            folds = []
            for fold in range(args.folds):
                held = set(shuffled[fold::args.folds])
                weight = fit([(c, r) for k, c, r, _ in labelled if k not in held], weight_decay)
                folds.append(accuracy(weight, [(c, r) for k, c, r, noise in labelled if k in held and not noise]))
            weight = fit([(c, r) for _, c, r, _ in labelled], weight_decay)
            on_policy = accuracy(weight, policy_pairs)
            results.append({"preferences": source, "n_instructions": len(keys), "n_pairs": len(labelled),
                            "noise_share": sum(x[3] for x in labelled) / len(labelled), "weight_decay": weight_decay,
                            "cv_accuracy": sum(folds) / len(folds), "policy_accuracy": on_policy,
                            "policy_se": math.sqrt(on_policy * (1 - on_policy) / len(policy_pairs)),
                            "n_policy_pairs": len(policy_pairs)})
            print(f"{source}: {len(keys)} instructions, {len(labelled)} pairs, weight decay {weight_decay:g}: "
                  f"CV accuracy (judge-labelled pairs) {results[-1]['cv_accuracy']:.3f}; policy answers "
                  f"{on_policy:.3f} ± {results[-1]['policy_se']:.3f} ({len(policy_pairs)} pairs)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
