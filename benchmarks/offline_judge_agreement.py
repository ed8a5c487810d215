"""Can the offline judge be fooled, and does it agree with GPT-4? Everything on data its weights were not fitted on.

Usage: python benchmarks/offline_judge_agreement.py [--data-dir ../shared/data] [--weights FILE]
       [--skip-smollm2] [--skip-agreement] [--samples-only]

Held-out data: the judge is fitted on 3 instructions in 4 (``is_heldout`` in ``tools/offline_judge_data.py``);
every figure below uses the other quarter (about 200 instructions). GPT-4 agreement is also
leave-one-system-out: for each system with recorded GPT-4 judgments the judge is refitted (same settings as the
shipped weights) without any pair involving that system (its judgments and the synthetic rivals built from its
answers), then scored on that system's held-out pairs.

Prints:
 1. degenerate rivals built from strong systems' answers (one rival per family per instruction): real answer's
    win-rate per family;
 2. SmolLM2-135M-Instruct sampled with the project's sampler at temperature 0.7, 2.0 and 2.5 on 48 held-out
    instructions (96 new tokens) against Davinci003's answers: win-rate;
 3. optimisation pressure: best-of-64 on the judge's score over SmolLM2 samples at temperature 1.2 on 8 held-out
    instructions, against the average sample, the worst and the most fluent on-topic sample: fluency (share of
    words that are whole words of MiniLM's WordPiece vocabulary, which the judge does not use; share of word pairs
    found in answers to held-out instructions, which the judge's tables never counted) and relevance (share of the
    instruction's content words found in the answer), and the picked answers;
 4. GPT-4 agreement (leave-one-system-out, held-out instructions): balanced accuracy on length-balanced pairs
    (lengths within 25%), per system, mean over strong systems, pooled; "prefer the longer" alongside;
 5. Spearman of win-rates against Davinci003 with the AlpacaEval GPT-4 leaderboard: systems with GPT-4
    judgments use their leave-one-out judge, the others the shipped judge;
 6. pairs/s (with MiniLM embedding of unseen texts; and with embeddings cached).
SmolLM2 samples are cached under .cache/offline_judge/smollm2 (gitignored), MiniLM embeddings under
.cache/offline_judge/embeddings, so reruns are fast.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "offline_judge"
sys.path.insert(0, str(REPO / "plugins"))
sys.path.insert(0, str(REPO / "tools"))  # the maintainers' fit of the judge (it needs the shared data, as this does)
import fit_offline_judge  # noqa: E402
import offline_judge_data  # noqa: E402
from offline_judge_data import cached_json, sample_answers  # noqa: E402

from alpacafarm_annotators.offline_judge.features import FEATURE_NAMES, Featurizer  # noqa: E402
from alpacafarm_annotators.offline_judge.judge import OfflineJudge  # noqa: E402
from alpacafarm_annotators.offline_judge.text_features import NGramTables, words  # noqa: E402
from alpacafarm_annotators.offline_judge.weights import WEIGHTS_FILE  # noqa: E402

LEADERBOARD = "tatsu-lab_alpaca_eval/src/alpaca_eval/leaderboards/data_AlpacaEval/alpaca_eval_gpt4_leaderboard.csv"
#: systems whose GPT-4 agreement is averaged as "strong" (AlpacaEval 1 win-rate >= 70%)
STRONG_SYSTEMS = ("gpt4_0314", "gpt-3.5-turbo-0301", "gpt35_turbo_instruct", "llama-2-7b-chat-hf")
STOPWORDS = frozenset("""a an the and or of to in on for with by at from as is are was were be been being it its
this that these those what which who whom how why when where do does did can could should would will shall
may might must
i you he she we they me him her us them my your our their not no yes if then than so such into about over under
please give write list make provide describe explain tell find create using use one two some any all each""".split())  # noqa: SIM905


# ------------------------------------------------------------------------------------------------ helpers
def credit(pred: np.ndarray, label: np.ndarray) -> np.ndarray:
    return np.where(pred == label, 1.0, np.where(pred == 0, 0.5, 0.0))


def balanced_accuracy(pred: np.ndarray, label: np.ndarray) -> float:
    per_class = [credit(pred[label == c], label[label == c]).mean() for c in (1, 2) if (label == c).any()]
    return float(np.mean(per_class)) if per_class else float("nan")


def longer(o1: str, o2: str) -> int:
    return 1 if len(o1) > len(o2) else 2 if len(o2) > len(o1) else 0


def prefs_from_scores(s1: np.ndarray, s2: np.ndarray, same: np.ndarray) -> np.ndarray:
    return np.where(same | (s1 == s2), 0, np.where(s1 > s2, 1, 2))


def relevance(instruction: str, output: str) -> float:
    """Share of the instruction's content words (not stop words, >= 3 letters) that the output uses."""
    keys = {w for w in words(instruction) if len(w) >= 3 and w not in STOPWORDS}
    return len(keys & set(words(output))) / len(keys) if keys else float("nan")


class UnseenBigrams:
    """Share of an answer's adjacent word pairs found in recorded answers the judge never saw: answers to held-out
    instructions other than the ones the SmolLM2 sections sample on (the judge's own tables count fit answers only).
    A measuring stick for word salad and drifting text that the judge's score cannot have been fitted to."""

    def __init__(self, data: offline_judge_data.JudgeData, heldout: list[str], exclude: set[str]) -> None:
        self.pairs = {p for outs in data.outputs.values() for ins in heldout if ins not in exclude and ins in outs
                      for p in itertools.pairwise(words(outs[ins]))}

    def __call__(self, text: str) -> float:
        tokens = words(text)
        pairs = list(itertools.pairwise(tokens))
        return sum(p in self.pairs for p in pairs) / len(pairs) if pairs else 0.0


class WordPieceFluency:
    """Share of an answer's words that are whole words of MiniLM's WordPiece vocabulary (not used by the judge)."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        from alpacafarm_annotators.offline_judge.embeddings import minilm_model_dir

        self.vocab = set(AutoTokenizer.from_pretrained(minilm_model_dir()).get_vocab())

    def __call__(self, text: str) -> float:
        tokens = re.findall(r"[A-Za-z]+", text)
        return sum(t.lower() in self.vocab for t in tokens) / len(tokens) if tokens else 0.0


# ------------------------------------------------------------------------------------------------ SmolLM2
def smollm2_samples(instructions: list[str], temperature: float, n: int, max_new_tokens: int,
                    seed: int = 0) -> list[list[str]]:
    """n samples per instruction from SmolLM2-135M-Instruct (the project's sampler), cached on disk."""
    import hashlib

    key = hashlib.sha1(json.dumps([instructions, temperature, n, max_new_tokens, seed]).encode()).hexdigest()[:16]
    return cached_json(CACHE / "smollm2" / f"t{temperature}_n{n}_{key}.json",
                       lambda: sample_answers(instructions, temperature, n, max_new_tokens, seed,
                                              batch_size=max(1, 32 // n)))


# ------------------------------------------------------------------------------------------------ main
def best_of_n_section(args: argparse.Namespace, judge: OfflineJudge, bon_ins: list[str],
                      davinci: dict[str, str]) -> None:
    """Section 3: best-of-n directly on the judge's score; fluency and relevance measured without the judge."""
    fluency, unseen = WordPieceFluency(), args.unseen_bigrams
    print(f"\n== 3. best-of-{args.bon_n} on the judge's score, SmolLM2 at temperature 1.2, "
          f"{len(bon_ins)} held-out instructions ==")
    groups = smollm2_samples(bon_ins, 1.2, args.bon_n, 96)
    rows = {"best": [], "random": [], "worst": [], "oracle": []}
    picks = []
    for ins, group in zip(bon_ins, groups, strict=True):
        scores = judge.score_batch([(ins, o, None) for o in group])
        best, worst = group[int(np.argmax(scores))], group[int(np.argmin(scores))]
        # the sample an independent reader would pick: the most unseen-corpus word pairs among on-topic samples
        oracle = max(group, key=lambda o: (relevance(ins, o) > 0, unseen(o)))
        picks.append((ins, best))
        for name, chosen in (("best", [best]), ("random", group), ("worst", [worst]), ("oracle", [oracle])):
            rows[name].append((np.mean([fluency(o) for o in chosen]), np.mean([unseen(o) for o in chosen]),
                               np.nanmean([relevance(ins, o) for o in chosen])))
    best_vs = np.array(judge.judge([(ins, davinci[ins], o, None) for ins, o in picks]))
    print(f"{'selection':>22s} {'wordpiece-fluency':>18s} {'unseen-bigrams':>15s} {'relevance':>10s}")
    for name, vals in rows.items():
        arr = np.array(vals)
        label = {"random": "all samples", "oracle": "most fluent on-topic"}.get(name, f"{name} of {args.bon_n}")
        print(f"{label:>22s} {arr[:, 0].mean():18.3f} {arr[:, 1].mean():15.3f} {np.nanmean(arr[:, 2]):10.3f}")
    print(f"best-of-{args.bon_n} win-rate vs Davinci003: {credit(best_vs, np.full(len(best_vs), 2)).mean():.3f}")
    for ins, best in picks[:4]:
        print(f"   Q: {ins[:90]!r}\n   A: {best[:300]!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--weights", type=Path, default=WEIGHTS_FILE, help="weights file (default: shipped)")
    parser.add_argument("--skip-smollm2", action="store_true", help="skip sections 2 and 3 (sampling)")
    parser.add_argument("--skip-best-of-n", action="store_true", help="skip section 3")
    parser.add_argument("--skip-agreement", action="store_true", help="skip sections 4 to 6 (refits, speed)")
    parser.add_argument("--only-best-of-n", action="store_true", help="only section 3")
    parser.add_argument("--samples-only", action="store_true", help="only draw (and cache) the SmolLM2 samples")
    parser.add_argument("--smollm2-instructions", type=int, default=48)
    parser.add_argument("--bon-instructions", type=int, default=8)
    parser.add_argument("--bon-n", type=int, default=64)
    args = parser.parse_args()

    data = offline_judge_data.load_data(args.data_dir)
    heldout = [ins for ins in data.instructions if offline_judge_data.is_heldout(ins)]
    davinci = data.outputs[offline_judge_data.DAVINCI]
    rng = random.Random(1234)
    smol_ins = rng.sample(heldout, min(args.smollm2_instructions, len(heldout)))
    bon_ins = smol_ins[: args.bon_instructions]
    args.unseen_bigrams = UnseenBigrams(data, heldout, set(smol_ins))
    if args.samples_only:
        for temperature in (0.7, 2.0, 2.5):
            smollm2_samples(smol_ins, temperature, 1, 96)
        smollm2_samples(bon_ins, 1.2, args.bon_n, 96)
        return

    cache_dir = CACHE / "embeddings"
    judge = OfflineJudge(weights_file=args.weights, cache_dir=cache_dir)
    doc = judge.document
    print(f"judge weights: {args.weights.name} fingerprint {judge.fingerprint[:16]}  "
          f"(fit: seed {doc['fit']['seed']}, l2 {doc['fit']['l2']}, {doc['fit']['n_pairs']} pairs)")
    print(f"held-out instructions: {len(heldout)} of {len(data.instructions)}")

    if args.only_best_of_n:
        best_of_n_section(args, judge, bon_ins, davinci)
        return

    # 1. degenerate rivals -----------------------------------------------------------------------------------
    print("\n== 1. degenerate rivals built from strong answers (held-out instructions; real answer's win-rate) ==")
    synth = offline_judge_data.synthetic_pairs(data, heldout, seed=10_001)
    prefs = judge.judge([(ins, real, rival, None) for _, _, ins, real, rival in synth])
    fams = np.array([s[0] for s in synth])
    wins = credit(np.array(prefs), np.ones(len(prefs), int))
    print(f"{'family':16s} {'n':>5s} {'real wins':>10s}")
    for family in offline_judge_data.FAMILIES:
        m = fams == family
        print(f"{family:16s} {m.sum():5d} {wins[m].mean():10.3f}")
    worst = [s for s, p in zip(synth, prefs, strict=True) if p != 1][:3]
    for family, source, ins, _, rival in worst:
        print(f"   lost/tied ({family}, {source}): {ins[:60]!r} | rival {rival[:80]!r}")

    # 2/3. SmolLM2 ------------------------------------------------------------------------------------------
    if not args.skip_smollm2:
        print(f"\n== 2. SmolLM2-135M-Instruct vs Davinci003 on {len(smol_ins)} held-out instructions "
              "(96 new tokens) ==")
        fluency = WordPieceFluency()
        print(f"{'temperature':>11s} {'win-rate':>9s} {'wordpiece-fluency':>18s} {'unseen-bigrams':>15s} "
              f"{'relevance':>10s}  example")
        for temperature in (0.7, 2.0, 2.5):
            outs = [s[0] for s in smollm2_samples(smol_ins, temperature, 1, 96)]
            p = np.array(judge.judge([(ins, davinci[ins], o, None) for ins, o in zip(smol_ins, outs, strict=True)]))
            flu = np.mean([fluency(o) for o in outs])
            uns = np.mean([args.unseen_bigrams(o) for o in outs])
            rel = np.nanmean([relevance(i, o) for i, o in zip(smol_ins, outs, strict=True)])
            print(f"{temperature:11.1f} {credit(p, np.full(len(p), 2)).mean():9.3f} {flu:18.3f} {uns:15.3f} "
                  f"{rel:10.3f}  "
                  f"{outs[0][:70]!r}")
    if not args.skip_smollm2 and not args.skip_best_of_n:
        best_of_n_section(args, judge, bon_ins, davinci)

    if args.skip_agreement:
        return
    # 4/5. GPT-4 agreement, leave one system out ---------------------------------------------------------------
    print("\n== 4. agreement with GPT-4 on held-out instructions, leave-one-system-out ==")
    tables = NGramTables.from_dict(doc["ngrams"])
    featurize = Featurizer(tables, judge.embedder, judge.lm)
    fit_instructions = [ins for ins in data.instructions if not offline_judge_data.is_heldout(ins)]
    fit_args = doc["fit"]
    features, pairs = fit_offline_judge.training_set(data, fit_instructions, featurize, fit_args["seed"],
                                             fit_args["synthetic_weight"], fit_args["l2"],
                                             fit_args["embedding_l2_factor"], cache_dir, log=lambda _: None)
    groups_arr = np.array(pairs.group)
    heldout_set = set(heldout)
    test = [j for j in data.judgments if j.instruction in heldout_set]
    systems = sorted({j.system for j in data.judgments})
    no_ref = len(FEATURE_NAMES)
    weights_by_system = {}
    for system in systems:
        heads = fit_offline_judge.fit_heads(features, pairs, doc["fit"]["l2"], mask=groups_arr != system,
                                    embedding_l2_factor=doc["fit"]["embedding_l2_factor"])
        weights_by_system[system] = heads["no_reference"]
    test_x1 = featurize([(j.instruction, j.output_1, None) for j in test])[:, :no_ref]
    test_x2 = featurize([(j.instruction, j.output_2, None) for j in test])[:, :no_ref]
    sys_of = np.array([j.system for j in test])
    pred = np.zeros(len(test), dtype=int)
    for system in systems:
        m = sys_of == system
        w = weights_by_system[system]
        same = np.array([j.output_1 == j.output_2 for j in test])[m]
        pred[m] = prefs_from_scores(np.round(test_x1[m] @ w, 6), np.round(test_x2[m] @ w, 6), same)
    label = np.array([1 if j.p2 < 0.5 else 2 if j.p2 > 0.5 else 0 for j in test])
    base = np.array([longer(j.output_1, j.output_2) for j in test])
    lens = np.array([(len(j.output_1), len(j.output_2)) for j in test])
    balanced = (lens.min(1) >= 0.75 * lens.max(1)) & (label != 0)
    annot = np.array(["gpt4" if j.baseline == offline_judge_data.DAVINCI else "gpt4_turbo" for j in test])
    print(f"{'system (annotator)':44s} {'n':>5s} {'judge':>7s} {'longer':>7s}   (balanced accuracy)")
    strong_scores = []
    for system in systems:
        for a in ("gpt4", "gpt4_turbo"):
            m = balanced & (sys_of == system) & (annot == a)
            if m.sum() < 10:
                continue
            bj, bb = balanced_accuracy(pred[m], label[m]), balanced_accuracy(base[m], label[m])
            if system in STRONG_SYSTEMS and a == "gpt4":
                strong_scores.append(bj)
            print(f"{f'{system} ({a})':44s} {m.sum():5d} {bj:7.3f} {bb:7.3f}")
    m = balanced & np.isin(sys_of, STRONG_SYSTEMS) & (annot == "gpt4")
    print(f"{'strong systems, pooled (gpt4)':44s} {m.sum():5d} {balanced_accuracy(pred[m], label[m]):7.3f} "
          f"{balanced_accuracy(base[m], label[m]):7.3f}")
    print(f"{'strong systems, mean of per-system':44s} {'':5s} {np.mean(strong_scores):7.3f}")
    m = balanced
    print(f"{'all systems, pooled':44s} {m.sum():5d} {balanced_accuracy(pred[m], label[m]):7.3f} "
          f"{balanced_accuracy(base[m], label[m]):7.3f}")
    m = label != 0
    print(f"{'all pairs (not length-balanced), agreement':44s} {m.sum():5d} {credit(pred[m], label[m]).mean():7.3f} "
          f"{credit(base[m], label[m]).mean():7.3f}")

    print("\n== 5. win-rate vs Davinci003 on held-out instructions and the AlpacaEval GPT-4 leaderboard ==")
    with (args.data_dir / LEADERBOARD).open() as f:
        leaderboard = {r[""]: float(r["win_rate"]) / 100 for r in csv.DictReader(f)}
    shipped = judge._weights["no_reference"]
    ranked = sorted((s for s in data.outputs if s in leaderboard), key=lambda s: -leaderboard[s])
    rows5 = []
    for system in ranked:
        ins_list = [ins for ins in heldout if ins in data.outputs[system]]
        w = weights_by_system.get(system, shipped)
        x_ref = featurize([(ins, davinci[ins], None) for ins in ins_list])[:, :no_ref]
        x_sys = featurize([(ins, data.outputs[system][ins], None) for ins in ins_list])[:, :no_ref]
        same = np.array([davinci[ins] == data.outputs[system][ins] for ins in ins_list])
        p = prefs_from_scores(np.round(x_ref @ w, 6), np.round(x_sys @ w, 6), same)
        b = np.array([longer(davinci[ins], data.outputs[system][ins]) for ins in ins_list])
        two = np.full(len(p), 2)
        rows5.append((system, leaderboard[system], credit(p, two).mean(), credit(b, two).mean(),
                      "loso" if system in weights_by_system else "never fitted"))
    gold = [r[1] for r in rows5]
    print(f"   {'system':30s} {'leaderboard':>11s} {'judge':>7s} {'longer':>7s}  judge used")
    for s, g, j, b, how in rows5:
        print(f"   {s:30s} {g:11.3f} {j:7.3f} {b:7.3f}  {how}")
    print(f"Spearman vs leaderboard ({len(rows5)} systems): "
          f"judge {spearmanr([r[2] for r in rows5], gold).statistic:.3f}  "
          f"longer {spearmanr([r[3] for r in rows5], gold).statistic:.3f}")
    never = [r for r in rows5 if r[4] == "never fitted"]
    print(f"Spearman on the {len(never)} systems never in any fit: judge "
          f"{spearmanr([r[2] for r in never], [r[1] for r in never]).statistic:.3f}")

    # 6. speed ------------------------------------------------------------------------------------------------
    print("\n== 6. speed (CPU) ==")
    fresh = OfflineJudge(weights_file=args.weights)
    speed_pairs = [(ins, davinci[ins], data.outputs["vicuna-7b"].get(ins, ""), None) for ins in heldout[:100]]
    t0 = time.perf_counter()
    fresh.judge(speed_pairs)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    fresh.judge(speed_pairs)
    warm = time.perf_counter() - t0
    print(f"{len(speed_pairs)} pairs: {len(speed_pairs) / cold:.1f} pairs/s embedding every text (incl. model load), "
          f"{len(speed_pairs) / warm:.1f} pairs/s with embeddings cached")


if __name__ == "__main__":
    main()
