"""How often the CI gate (``alpacafarm bench``) cries wolf under noise alone, and what it can detect.

What it simulates: "the same method, run again with other seeds". A best-of-n run records N samples per held-out
instruction with their rewards (``stages/best_of_n/samples.jsonl``); every sample is judged once against the
reference by the benchmark's own judge. A trial then shuffles each instruction's N samples (a fresh seed) and
splits them into two disjoint halves of k = N/2: the *baseline* is best-of-k and best-of-1 of the first half, the
*candidate* the same method on the second half. Both are scored by the recorded judgments and compared exactly as
``alpacafarm bench`` compares them (paired non-inferiority test per system, alpha shared among the systems). Over
many trials, the share of FAIL verdicts is the false-alarm rate, to be set against alpha. Draws come from the
recorded pool of N samples rather than from the model, so the rate is conditional on that pool (samples of a
temperature-1 policy are exchangeable, which is what makes the halves two independent "seeds").

The same trials with a regressed candidate (worst-of-k of the second half: the lowest-reward sample, the bug the
gate tests plant) give the gate's power against that regression. The minimum detectable effect printed is the
mean over trials of ``(t + z_power) · SE`` (see ``alpacafarm_evaluation.gate_stats``).

Sources of the recorded pool:

* ``--run-dir DIR``: a finished run of a best-of-n benchmark recipe (e.g. ``alpacafarm bench
  recipes/bench/best_of_n.yaml --set stages.best_of_n.config.n=8 ...`` leaves ``runs/bench/<name>``); the run's own
  evaluation judge and references judge the samples;
* ``--tiny`` (default without ``--run-dir``): the tiny random-init setup of ``tests/test_bench.py`` (tiny LM, a fixed
  tiny reward model that both reranks and judges, the LM's own samples as references), in seconds.

    python benchmarks/gate_false_alarm.py --tiny --trials 2000
    python benchmarks/gate_false_alarm.py --run-dir runs/bench/bench-best-of-n --trials 2000
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "plugins")]


def judged_pool_from_run(run_dir: Path) -> tuple[list[list[tuple[float, float]]], str]:
    """Per instruction, the recorded samples as (reward, judged score vs the reference)."""
    from alpacafarm.data import read_records
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import load_recipe
    from alpacafarm.types import Pair
    from alpacafarm_evaluation.metrics import scores
    from alpacafarm_evaluation.pairing import load_references

    registry = get_registry()
    loaded = load_recipe(run_dir / "recipe.yaml", [], registry)
    config = loaded.stage_configs["evaluate"]
    references = load_references(config.references, config.reference_field)
    samples = read_records(run_dir / "stages" / "best_of_n" / "samples.jsonl")
    ref = loaded.recipe.annotator_for("evaluation")
    judge = registry.create("annotator", ref.name, loaded.annotator_configs.get("evaluation", ref.config))
    pairs = [Pair(s["instruction"], references.find(s["instruction"], s.get("input") or "")["text"], s["output"],
                  s.get("input") or "") for s in samples]
    try:
        labels = [a.preference for a in judge.annotate(pairs)]
    finally:
        judge.close()
    pool: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for sample, score in zip(samples, scores(labels), strict=True):
        if score is not None:
            pool.setdefault((sample["instruction"], sample.get("input") or ""), []).append((sample["reward"], score))
    return list(pool.values()), f"run {run_dir} (judge {ref.name})"


def judged_pool_tiny(n_instructions: int, n_samples: int) -> tuple[list[list[tuple[float, float]]], str]:
    """The tiny setup: a tiny LM's samples, reranked and judged by one fixed tiny reward model."""
    from alpacafarm.data import BUILTIN_DIR, read_records
    from alpacafarm.generation import SamplingConfig, generate_records
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import ModelSpec
    from alpacafarm.rewards import RewardScorer
    from alpacafarm.testing import save_tiny_causal_lm, tiny_sequence_classifier, tiny_tokenizer

    work = Path(tempfile.mkdtemp(prefix="gate-false-alarm-"))
    lm = save_tiny_causal_lm(work / "lm")
    tokenizer = tiny_tokenizer()
    tiny_sequence_classifier(tokenizer, seed=1).save_pretrained(work / "rm")
    tokenizer.save_pretrained(work / "rm")
    spec = ModelSpec(name=lm, dtype="float32", device="cpu", prompt_format="chat_template")
    records = read_records(BUILTIN_DIR / "alpaca_eval_sample.jsonl")[:n_instructions]
    generator = get_registry().create("generation_backend", "transformers", None, spec=spec, model_path=lm)
    rows = generate_records(generator, records, SamplingConfig(n=n_samples + 1, temperature=1.0, max_new_tokens=8,
                                                               batch_size=32, seed=3))
    generator.close()
    scorer = RewardScorer.from_path(str(work / "rm"), spec, batch_size=64)
    rewards = scorer(rows, [r["output"] for r in rows])
    pool = []
    for i in range(len(records)):
        group = list(zip(rows[i * (n_samples + 1):(i + 1) * (n_samples + 1)],
                         rewards[i * (n_samples + 1):(i + 1) * (n_samples + 1)], strict=True))
        (_, reference_reward), samples = group[0], group[1:]  # the first sample is the reference answer
        pool.append([(r, 1.0 if r > reference_reward else 0.5 if r == reference_reward else 0.0)
                     for _, r in samples])
    return pool, f"tiny setup ({n_instructions} instructions, {n_samples} samples each, judge = reward model)"


def best(samples: list[tuple[float, float]], lowest: bool = False) -> float:
    """The judged score of the highest- (or lowest-) reward sample; the earliest wins a tie."""
    key = (lambda i: (-samples[i][0], i)) if lowest else (lambda i: (samples[i][0], -i))
    return samples[max(range(len(samples)), key=key)][1]


def trial(pool: list[list[tuple[float, float]]], k: int, rng: random.Random, regressed: bool,
          margin: float, alpha: float, power: float) -> tuple[str, list[float], list[float]]:
    """One trial: the gate's verdict, each system's MDE, and the MDE ``--update-baseline`` estimates from the
    baseline half alone (before any candidate exists)."""
    from alpacafarm_evaluation.gate_stats import baseline_power, family_alpha, non_inferiority, worst

    systems: dict[str, tuple[list[float], list[float]]] = {"best_of_1": ([], []), f"best_of_{k}": ([], [])}
    for samples in pool:
        shuffled = rng.sample(samples, len(samples))
        first, second = shuffled[:k], shuffled[k:2 * k]
        systems["best_of_1"][0].append(first[0][1])
        systems["best_of_1"][1].append(second[0][1])
        systems[f"best_of_{k}"][0].append(best(first))
        systems[f"best_of_{k}"][1].append(best(second, lowest=regressed))
    level = family_alpha(alpha, len(systems))
    tests = [non_inferiority([100 * (c - b) for b, c in zip(base, cand, strict=True)], margin, level, power)
             for base, cand in systems.values()]
    estimates = baseline_power({name: {str(i): v for i, v in enumerate(base)} for name, (base, _) in systems.items()},
                               margin, alpha, power)
    return worst([t.verdict for t in tests]), [t.mde for t in tests], [e.mde for e in estimates]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, help="a finished best-of-n benchmark run (samples.jsonl)")
    parser.add_argument("--tiny", action="store_true", help="the tiny random-init setup (default without --run-dir)")
    parser.add_argument("--instructions", type=int, default=96, help="--tiny: held-out instructions")
    parser.add_argument("--samples", type=int, default=8, help="--tiny: samples per instruction (N)")
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--margin", type=float, default=5.0)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--power", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    pool, source = (judged_pool_from_run(args.run_dir) if args.run_dir
                    else judged_pool_tiny(args.instructions, args.samples))
    k = min(len(s) for s in pool) // 2
    if k < 1:
        sys.exit("every instruction needs at least 2 judged samples")
    seconds = time.perf_counter() - started
    print(f"pool: {source}: {len(pool)} instructions, halves of k = {k} samples ({seconds:.0f} s)")
    print(f"gate: margin {args.margin:g} points, alpha {args.alpha:g} shared by 2 systems (best_of_1, best_of_{k})")
    for regressed in (False, True):
        rng = random.Random(args.seed)
        counts = {"PASS": 0, "FAIL": 0, "INCONCLUSIVE": 0}
        mdes: list[float] = []
        estimated: list[float] = []
        for _ in range(args.trials):
            verdict, trial_mdes, trial_estimates = trial(pool, k, rng, regressed, args.margin, args.alpha, args.power)
            counts[verdict] += 1
            mdes.extend(trial_mdes)
            estimated.extend(trial_estimates)
        rates = {v: c / args.trials for v, c in counts.items()}
        se = (rates["FAIL"] * (1 - rates["FAIL"]) / args.trials) ** 0.5
        what = (f"regressed candidate (worst-of-{k}): power (FAIL rate)" if regressed
                else "same method, other seeds: false-alarm rate (FAIL rate)")
        print(f"{what} = {rates['FAIL']:.4f} ± {se:.4f} over {args.trials} trials"
              + ("" if regressed else f" (alpha = {args.alpha:g}: {'OK' if rates['FAIL'] <= args.alpha else 'ABOVE'})"))
        print(f"  PASS {rates['PASS']:.3f}  INCONCLUSIVE {rates['INCONCLUSIVE']:.3f}  FAIL {rates['FAIL']:.3f};"
              f"  mean MDE {sum(mdes) / len(mdes):.1f} points (at {args.power:.0%} power)")
        if not regressed:
            print(f"  --update-baseline's estimate from the baseline alone: mean MDE "
                  f"{sum(estimated) / len(estimated):.1f} points")


if __name__ == "__main__":
    main()
