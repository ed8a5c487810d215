"""Fit the offline judge's weights (a maintainer tool, not part of the package: it needs the shared data folder).

    python tools/fit_offline_judge.py --data ../shared/data --out FILE [--cache-dir .cache/offline_judge/embeddings]

Writes a weights document (:mod:`alpacafarm_annotators.offline_judge.weights`, replaced atomically); copy it over
``plugins/alpacafarm_annotators/offline_judge/weights.json`` to ship it.

What the fit uses (every file is described in the data folder's SOURCES.md):

* the recorded GPT-4 pairwise judgments of AlpacaEval (``results/*/alpaca_eval_gpt4/annotations.json``: Davinci003
  against 7 systems; ``results/*/weighted_alpaca_eval_gpt4_turbo/annotations.json``: GPT-4 Turbo against 5
  systems, soft labels), on the FIT instructions only (3 in 4, chosen by a hash of the text; the others are held
  out for ``benchmarks/offline_judge_agreement.py``);
* synthetic hard negatives that must always lose, built from recorded answers to fit instructions: word salad,
  random corpus words, invented words, an answer to a different instruction (a well-formatted one, and the answer
  to the instruction sharing the most words), a repetition loop, a truncation mid-sentence, a restatement of the
  instruction, and words drawn from the answer and instruction themselves (:func:`offline_judge_data.degenerate`); and
  the judge's language model's own answers sampled at temperatures 1.2-1.5 (:func:`offline_judge_data.hot_samples`),
  fluent word by word but drifting into nonsense;
* an adversarial round (:func:`training_set`): a first fit scores 16 samples of the LM at temperature 1.2 for every
  sixth fit instruction, and the two it likes best per instruction (what best-of-n on it would pick) join the
  rivals of the final fit;
* the word and word-pair tables of the fluency features and the common word stems of the key-word coverage,
  counted on every system's answers to fit instructions.

The head is linear over the features of :mod:`alpacafarm_annotators.offline_judge.features` (text statistics, MiniLM
relevance, the language model's fluency and PMI, key-word coverage; length and layout count only in on-topic, fluent
text), fitted Bradley-Terry (logistic loss on score differences, L2 penalty, 300 times stronger on the 768
embedding features) by Newton's method from zero, with the gated length and layout weights held >= 0: the same
data and seed give byte-identical weights.
Two heads are fitted: one without a reference answer and one that also reads the output's similarity to a strong
reference answer.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

if str(Path(__file__).resolve().parent) not in sys.path:  # its sibling offline_judge_data, however it was started
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_judge_data import (
    DAVINCI,
    FAMILIES,
    HOT_TEMPERATURES,
    POOL_SIZE,
    POOL_TEMPERATURE,
    STRONG,
    JudgeData,
    hot_samples,
    is_heldout,
    load_data,
    sample_pool,
    synthetic_pairs,
)

from alpacafarm_annotators.offline_judge.embeddings import MiniLMEmbedder
from alpacafarm_annotators.offline_judge.features import (
    FEATURE_NAMES,
    FIRST_EMBEDDING,
    GATED_STATS,
    Featurizer,
    feature_settings,
)
from alpacafarm_annotators.offline_judge.language_model import COND_TOKENS, LM_MODEL, PMI_TOKENS, LMScorer
from alpacafarm_annotators.offline_judge.text_features import NGramTables
from alpacafarm_annotators.offline_judge.weights import FORMAT_VERSION, fingerprint, save_weights

#: each synthetic pair counts as this many GPT-4 judgments: degenerate text must lose by a wide margin
SYNTHETIC_WEIGHT = 60.0
#: the adversarial round (:func:`training_set`): every POOL_EVERY-th fit instruction gets a pool of the LM's
#: samples, and the first fit's MINED_PER_INSTRUCTION favourites in each become rivals
POOL_EVERY = 6
MINED_PER_INSTRUCTION = 2
#: the embedding features' L2 penalty relative to the others. Chosen on the held-out benchmark among 10, 40, 100, 300
#: and 1000: with 10 (format 4) what an answer is about outweighed whether it answered *this* question (the answer
#: to a near-identical question won 2.8% of the time) and Spearman with the leaderboard was 0.78; 300 gave 0% and 0.84
EMBEDDING_L2_FACTOR = 300.0


# ------------------------------------------------------------------------------------------ features and fit
def fit_bradley_terry(diff: np.ndarray, p: np.ndarray, weight: np.ndarray, l2: float,
                      max_iter: int = 50, tol: float = 1e-8) -> np.ndarray:
    """Minimise sum w * logistic loss of (diff @ theta) against soft labels p, plus l2/2 * |theta|^2 (Newton)."""
    theta = np.zeros(diff.shape[1])
    for _ in range(max_iter):
        z = diff @ theta
        q = 1.0 / (1.0 + np.exp(-z))
        grad = diff.T @ (weight * (q - p)) + l2 * theta
        hess = (diff * (weight * q * (1 - q))[:, None]).T @ diff + l2 * np.eye(diff.shape[1])
        step = np.linalg.solve(hess, grad)
        theta -= step
        if float(np.abs(step).max()) < tol:
            break
    return theta


@dataclass
class PairSet:
    """Pairs as row indices into a feature matrix: p2 = probability that the second wins."""

    first: list[int] = field(default_factory=list)
    second: list[int] = field(default_factory=list)
    p2: list[float] = field(default_factory=list)
    weight: list[float] = field(default_factory=list)
    group: list[str] = field(default_factory=list)  # the system this pair would leak if held out
    has_ref: list[bool] = field(default_factory=list)
    synthetic: list[bool] = field(default_factory=list)


def build_training(data: JudgeData, instructions: Sequence[str], featurize: Featurizer, seed: int,
                   synthetic_weight: float = 1.0, lm_rivals: Sequence[tuple[str, str]] = ()
                   ) -> tuple[np.ndarray, PairSet]:
    """The feature matrix of every (instruction, output, reference) in the fit pairs, and the pairs.

    ``lm_rivals`` are (instruction, text) of the judge's LM's own samples (:func:`offline_judge_data.hot_samples`,
    and the favourites mined by :func:`training_set`), each a rival that must lose to a strong answer like the
    degenerate families; an instruction's strong systems take turns answering its rivals.
    """
    keep = set(instructions)
    items: list[tuple[str, str, str | None]] = []
    index: dict[tuple[str, str, str | None], int] = {}

    def row(ins: str, out: str, ref: str | None) -> int:
        key = (ins, out, ref)
        if key not in index:
            index[key] = len(items)
            items.append(key)
        return index[key]

    pairs = PairSet()
    for j in data.judgments:
        if j.instruction not in keep:
            continue
        ref_system = "gpt4_1106_preview" if j.baseline == DAVINCI else "gpt4"
        ref = data.outputs.get(ref_system, {}).get(j.instruction)
        pairs.first.append(row(j.instruction, j.output_1, ref))
        pairs.second.append(row(j.instruction, j.output_2, ref))
        pairs.p2.append(j.p2)
        pairs.weight.append(1.0)
        pairs.group.append(j.system)
        pairs.has_ref.append(ref is not None)
        pairs.synthetic.append(False)
    rivals = [(source, ins, answer, rival)
              for _, source, ins, answer, rival in synthetic_pairs(data, instructions, seed)]
    position = {ins: k for k, ins in enumerate(instructions)}
    turns: dict[str, int] = {}
    for ins, sample in lm_rivals:
        turn = turns[ins] = turns.get(ins, -1) + 1
        source = STRONG[(position[ins] + turn) % len(STRONG)]
        answer = data.outputs.get(source, {}).get(ins, "")
        if len(answer.split()) >= 12:
            rivals.append((source, ins, answer, sample))
    for source, ins, answer, rival in rivals:
        ref_system = next(s for s in STRONG if s != source)
        ref = data.outputs.get(ref_system, {}).get(ins)
        pairs.first.append(row(ins, answer, ref))
        pairs.second.append(row(ins, rival, ref))
        pairs.p2.append(0.0)
        pairs.weight.append(synthetic_weight)
        pairs.group.append(source)
        pairs.has_ref.append(ref is not None)
        pairs.synthetic.append(True)
    return featurize(items), pairs


_NONNEGATIVE = [FEATURE_NAMES.index(f"{name}*gate") for name in GATED_STATS]


def fit_heads(features: np.ndarray, pairs: PairSet, l2: float, mask: np.ndarray | None = None,
              embedding_l2_factor: float = EMBEDDING_L2_FACTOR) -> dict[str, Any]:
    """Fit both heads on the pairs selected by ``mask``; return the weights as plain lists."""
    first, second = np.array(pairs.first), np.array(pairs.second)
    p2, weight = np.array(pairs.p2), np.array(pairs.weight)
    has_ref = np.array(pairs.has_ref)
    if mask is None:
        mask = np.ones(len(first), dtype=bool)
    used_rows = np.unique(np.concatenate([first[mask], second[mask]]))
    scale = features[used_rows].std(axis=0)
    scale = np.where(scale > 1e-9, scale, 1.0)
    # The 768 embedding features get a stronger penalty (embedding_l2_factor x l2): what an answer is about must
    # not outweigh whether it answers the question, is fluent and complete.
    scale[FIRST_EMBEDDING:len(FEATURE_NAMES)] *= embedding_l2_factor ** 0.5
    heads = {}
    for name, columns, rows in (("no_reference", slice(0, len(FEATURE_NAMES)), mask),
                                ("reference", slice(0, len(FEATURE_NAMES) + 1), mask & has_ref)):
        x = features[:, columns] / scale[columns]
        diff = x[second[rows]] - x[first[rows]]
        # Length and layout count only through the gate, so their weights must be >= 0 (closing the gate must
        # never earn credit): a gated weight that comes out negative is fixed at 0 and the rest refitted.
        free = np.ones(x.shape[1], dtype=bool)
        while True:
            theta = np.zeros(x.shape[1])
            theta[free] = fit_bradley_terry(diff[:, free], p2[rows], weight[rows], l2)
            negative = [c for c in _NONNEGATIVE if theta[c] < 0]
            if not negative:
                break
            free[min(negative, key=lambda c: theta[c])] = False
        heads[name] = theta / scale[columns]
    return heads


def mine(instructions: Sequence[str], pools: Sequence[Sequence[str]], featurize: Featurizer, weights: np.ndarray,
         per_instruction: int) -> list[tuple[str, str]]:
    """(instruction, sample) for the ``per_instruction`` samples of each pool that the no-reference head
    ``weights`` scores highest: what best-of-n on that judge would pick."""
    mined = []
    for ins, pool in zip(instructions, pools, strict=True):
        candidates = sorted(set(pool))
        scores = featurize([(ins, text, None) for text in candidates])[:, :len(FEATURE_NAMES)] @ weights
        for k in np.argsort(-np.round(scores, 6), kind="stable")[:per_instruction]:
            mined.append((ins, candidates[int(k)]))
    return mined


def training_set(data: JudgeData, instructions: Sequence[str], featurize: Featurizer, seed: int,
                 synthetic_weight: float, l2: float, embedding_l2_factor: float, cache_dir: Path | None,
                 log: Callable[[str], None] = print) -> tuple[np.ndarray, PairSet]:
    """The fit's features and pairs, with the adversarial round: a first fit (with the LM's hot samples as
    rivals) picks its favourites among :data:`offline_judge_data.POOL_SIZE` samples per instruction of every
    :data:`POOL_EVERY`-th instruction, and they join the rivals of the final fit."""
    log(f"sampling the LM's hot answers to {len(instructions)} fit instructions (cached with --cache-dir)")
    hot = list(zip(instructions, hot_samples(instructions, seed, cache_dir), strict=True))
    pool_instructions = list(instructions[::POOL_EVERY])
    log(f"sampling {POOL_SIZE} answers to each of {len(pool_instructions)} instructions for the adversarial round")
    pools = sample_pool(pool_instructions, seed, cache_dir)
    features, pairs = build_training(data, instructions, featurize, seed, synthetic_weight, hot)
    first = fit_heads(features, pairs, l2, embedding_l2_factor=embedding_l2_factor)["no_reference"]
    mined = mine(pool_instructions, pools, featurize, first, MINED_PER_INSTRUCTION)
    log(f"adversarial round: the first fit's {MINED_PER_INSTRUCTION} favourites of each pool become rivals")
    return build_training(data, instructions, featurize, seed, synthetic_weight, [*hot, *mined])


def round_weights(values: np.ndarray) -> list[float]:
    return [float(f"{v:.7g}") for v in values]


def fit(data_dir: Path, seed: int = 0, l2: float = 30.0, max_instructions: int | None = None,
        cache_dir: Path | None = None, log: Callable[[str], None] = print,
        synthetic_weight: float = SYNTHETIC_WEIGHT) -> dict[str, Any]:
    """Fit the judge on the fit instructions of ``data_dir``; return the weights document (see :func:`save`)."""
    data = load_data(data_dir, max_instructions)
    fit_instructions = [ins for ins in data.instructions if not is_heldout(ins)]
    corpus = [outs[ins] for outs in data.outputs.values() for ins in fit_instructions if ins in outs]
    tables = NGramTables.fit(corpus)
    log(f"{len(fit_instructions)} fit instructions, {len(corpus)} answers counted for the fluency tables")
    featurize = Featurizer(tables, MiniLMEmbedder(cache_dir=cache_dir), LMScorer(cache_dir=cache_dir))
    features, pairs = training_set(data, fit_instructions, featurize, seed, synthetic_weight, l2,
                                   EMBEDDING_L2_FACTOR, cache_dir, log)
    log(f"{len(pairs.first)} pairs ({sum(pairs.synthetic)} synthetic), {features.shape[1]} features; fitting")
    heads = fit_heads(features, pairs, l2, embedding_l2_factor=EMBEDDING_L2_FACTOR)
    document: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "fit": {"seed": seed, "l2": l2, "embedding_l2_factor": EMBEDDING_L2_FACTOR,
                "synthetic_weight": synthetic_weight, "max_instructions": max_instructions,
                "features": feature_settings(),
                "lm": {"model": LM_MODEL, "cond_tokens": COND_TOKENS, "pmi_tokens": PMI_TOKENS,
                       "hot_sample_temperatures": list(HOT_TEMPERATURES)},
                "adversarial_round": {"pool_every": POOL_EVERY, "pool_size": POOL_SIZE,
                                      "pool_temperature": POOL_TEMPERATURE,
                                      "mined_per_instruction": MINED_PER_INSTRUCTION},
                "families": list(FAMILIES),
                "heldout_rule": "crc32(instruction) % 4 == 0", "n_pairs": len(pairs.first),
                "data_sha256": data.fingerprint(), "embedding": "all-MiniLM-L6-v2, mean pooled, 128 tokens"},
        "feature_names": [*FEATURE_NAMES, "cos_ref"],
        "weights": {name: round_weights(theta) for name, theta in heads.items()},
        "ngrams": tables.to_dict(),
    }
    document["fingerprint"] = fingerprint(document)
    return document


def main(argv: list[str] | None = None) -> int:
    """The command line; a user error (a wrong folder) is one ``error: ...`` line on stderr and exit status 2."""
    from alpacafarm.errors import UserError

    parser = argparse.ArgumentParser(prog="python tools/fit_offline_judge.py",
                                     description="Refit the offline judge's weights from the shared data "
                                                 "(deterministic: the same data and seed give the same bytes).")
    parser.add_argument("--data", type=Path, required=True, help="the shared data folder (with SOURCES.md)")
    parser.add_argument("--out", type=Path, required=True,
                        help="weights file to write (JSON; replaced atomically). The shipped one is "
                             "plugins/alpacafarm_annotators/offline_judge/weights.json")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic negatives (default 0)")
    parser.add_argument("--l2", type=float, default=30.0, help="L2 penalty on standardised features")
    parser.add_argument("--synthetic-weight", type=float, default=SYNTHETIC_WEIGHT,
                        help=f"weight of each synthetic pair (default {SYNTHETIC_WEIGHT})")
    parser.add_argument("--max-instructions", type=int, default=None,
                        help="use only the first N instructions (quick checks)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="keep MiniLM embeddings, LM readings and the LM's hot samples here between runs "
                             "(they are recomputed otherwise)")
    args = parser.parse_args(argv)
    try:
        if args.max_instructions is not None and args.max_instructions < 2:
            raise UserError(f"--max-instructions must be >= 2, got {args.max_instructions}")
        if not args.out.parent.is_dir():
            raise UserError(f"--out {args.out}: folder {args.out.parent} does not exist")
        document = fit(args.data, args.seed, args.l2, args.max_instructions, args.cache_dir,
                       synthetic_weight=args.synthetic_weight)
    except UserError as exc:
        print(f"error: {'; '.join(line.strip() for line in str(exc).splitlines() if line.strip())}", file=sys.stderr)
        return 2
    save_weights(document, args.out)
    print(f"wrote {args.out} (fingerprint {document['fingerprint'][:16]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
