"""Fit the offline judge's weights: ``alpacafarm offline-judge fit --data ../shared/data --out FILE``.

What the fit uses (every file is described in the data folder's SOURCES.md):

* the recorded GPT-4 pairwise judgments of AlpacaEval (``results/*/alpaca_eval_gpt4/annotations.json``: Davinci003
  against 7 systems; ``results/*/weighted_alpaca_eval_gpt4_turbo/annotations.json``: GPT-4 Turbo against 5
  systems, soft labels), on the FIT instructions only (3 in 4, chosen by a hash of the text; the others are held
  out for ``benchmarks/offline_judge_agreement.py``);
* synthetic hard negatives that must always lose, built from recorded answers to fit instructions: word salad,
  random corpus words, invented words, an answer to a different instruction (a well-formatted one, and the answer
  to the instruction sharing the most words), a repetition loop, a truncation mid-sentence, a restatement of the
  instruction, and words drawn from the answer and instruction themselves (:func:`degenerate`); and the judge's
  language model's own answers sampled at temperatures 1.2-1.5 (:func:`judge_lm.hot_samples`), fluent word by word
  but drifting into nonsense;
* the word and word-pair tables of the fluency features, counted on every system's answers to fit instructions.

The head is linear over the features of :mod:`judge_featurizer` (text statistics, MiniLM relevance, the language
model's fluency and PMI of :mod:`judge_lm`; length and layout count only in on-topic, fluent text), fitted
Bradley-Terry (logistic loss on score differences, L2 penalty) by Newton's method from zero: the same data and
seed give byte-identical weights.
Two heads are fitted: one without a reference answer and one that also reads the output's similarity to a strong
reference answer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from alpacafarm_annotators.judge_features import MiniLMEmbedder, NGramTables, words
from alpacafarm_annotators.judge_featurizer import FEATURE_NAMES, FIRST_EMBEDDING, Featurizer, gate_settings
from alpacafarm_annotators.judge_lm import COND_TOKENS, HOT_TEMPERATURES, LM_MODEL, PMI_TOKENS, LMScorer, hot_samples

#: words too common to say what an instruction is about (the nearest-instruction search ignores them)
STOPWORDS = frozenset(
    ["a", "an", "the", "and", "or", "of", "to", "in", "on", "for", "with", "by", "at", "from", "as", "is", "are",
     "was", "were", "be", "it", "its", "this", "that", "what", "which", "who", "how", "why", "when", "where", "do",
     "does", "did", "can", "could", "should", "would", "will", "i", "you", "me", "my", "your", "we", "our", "they",
     "them", "their", "please", "give", "write", "list", "make", "provide", "describe", "explain", "tell", "some",
     "any", "all"]
)

FORMAT_VERSION = "offline-judge-4"
#: each synthetic pair counts as this many GPT-4 judgments: degenerate text must lose by a wide margin
SYNTHETIC_WEIGHT = 60.0
#: the embedding features' L2 penalty relative to the others
EMBEDDING_L2_FACTOR = 10.0
FAMILIES = ("word_salad", "random_words", "invented_words", "off_topic", "repetition", "truncation", "restate",
            "off_topic_near", "on_topic_words")
#: families added in format 3; they draw from their own random stream so the first seven stay as they were
_NEW_FAMILIES = ("off_topic_near", "on_topic_words")
RESULTS = "tatsu-lab_alpaca_eval/results"
DAVINCI_REFERENCE = "stanford-cs336_spring2024-assignment5-alignment/data/alpaca_eval/alpaca_eval.jsonl"
#: Strong systems: synthetic negatives are built from their answers, and they serve as reference answers.
STRONG = ("gpt4_1106_preview", "gpt4", "gpt4_0314", "gpt-3.5-turbo-0301")
DAVINCI = "text_davinci_003_reference"  # the AlpacaEval 1 reference outputs (not results/text_davinci_003)
def is_heldout(instruction: str) -> bool:
    """One instruction in four (by a hash of its text) is never fitted on."""
    return zlib.crc32(instruction.encode("utf-8")) % 4 == 0


@dataclass
class Judgment:
    system: str  # the compared system (the other side is the annotation file's baseline)
    baseline: str
    instruction: str
    output_1: str
    output_2: str
    p2: float  # probability that output_2 wins (GPT-4's label; soft for the weighted annotator)


@dataclass
class JudgeData:
    instructions: list[str]
    outputs: dict[str, dict[str, str]]  # system -> instruction -> output (DAVINCI included)
    judgments: list[Judgment]
    files: list[Path] = field(default_factory=list)

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for path in self.files:
            digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
        return digest.hexdigest()


def load_data(data_dir: Path, max_instructions: int | None = None) -> JudgeData:
    """Read the AlpacaEval outputs and GPT-4 judgments under ``data_dir`` (the shared data folder)."""
    from alpacafarm.errors import UserError

    reference_file = data_dir / DAVINCI_REFERENCE
    results = data_dir / RESULTS
    if not reference_file.is_file() or not results.is_dir():
        raise UserError(f"--data {data_dir}: expected {DAVINCI_REFERENCE} and {RESULTS}/ under it "
                        "(the shared data folder, see its SOURCES.md)")
    files = [reference_file]
    rows = [json.loads(line) for line in reference_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    instructions = [r["instruction"] for r in rows]
    if max_instructions is not None:
        instructions = instructions[:max_instructions]
    keep = set(instructions)
    outputs: dict[str, dict[str, str]] = {DAVINCI: {r["instruction"]: r["output"] or "" for r in rows
                                                    if r["instruction"] in keep}}
    for path in sorted(results.glob("*/model_outputs.json")):
        files.append(path)
        outputs[path.parent.name] = {r["instruction"]: r["output"] or ""
                                     for r in json.loads(path.read_text(encoding="utf-8"))
                                     if r["instruction"] in keep}
    judgments = []
    for annotator, baseline in (("alpaca_eval_gpt4", DAVINCI), ("weighted_alpaca_eval_gpt4_turbo",
                                                                "gpt4_1106_preview")):
        for path in sorted(results.glob(f"*/{annotator}/annotations.json")):
            files.append(path)
            for r in json.loads(path.read_text(encoding="utf-8")):
                if r["instruction"] not in keep or r["preference"] is None:
                    continue
                p2 = min(1.0, max(0.0, float(r["preference"]) - 1.0))
                judgments.append(Judgment(r["generator_2"], baseline, r["instruction"], r["output_1"] or "",
                                          r["output_2"] or "", p2))
    return JudgeData(instructions, outputs, judgments, files)


# ------------------------------------------------------------------------------------------ degenerate rivals
_SENTENCE_END = re.compile(r"[.!?:;,)\]\"'`*]+$")
RESTATE_TEMPLATES = (
    "{ins}",
    "You asked: {ins}",
    "Sure! Here is my answer to \"{ins}\"",
    "{ins} This is a question about {ins_lower}",
    "The task is to answer the following. {ins} I will now answer: {ins_lower}",
)


def degenerate(family: str, instruction: str, answer: str, rng: random.Random, corpus_words: Sequence[str],
               other_answer: str) -> str:
    """A rival to ``answer`` that no reader would prefer (``family`` in :data:`FAMILIES`).

    ``corpus_words`` are whitespace tokens of real answers (random words); ``other_answer`` is an answer to a
    different instruction (off-topic; for ``off_topic_near``, to the instruction sharing the most words).
    """
    # The rivals keep the answer's layout (line breaks, list markers' positions): only the words change.
    parts = re.split(r"(\s+)", answer.strip())
    tokens = parts[0::2]
    n = max(len(tokens), 8)

    def relayout(new_tokens: list[str]) -> str:
        if len(new_tokens) != len(tokens):
            return " ".join(new_tokens)
        out = list(parts)
        out[0::2] = new_tokens
        return "".join(out)

    if family == "word_salad":
        shuffled = list(tokens)
        rng.shuffle(shuffled)
        return relayout(shuffled)
    if family == "random_words":
        return relayout([rng.choice(corpus_words) for _ in range(n)])
    if family == "invented_words":  # word fragments glued together, as a language model sampled too hot
        out = []
        for _ in range(n):
            a, b = rng.choice(corpus_words), rng.choice(corpus_words)
            out.append(a[: max(1, len(a) // 2)] + b[len(b) // 2:] if rng.random() < 0.6 else a)
        return relayout(out)
    if family in ("off_topic", "off_topic_near"):
        return other_answer
    if family == "on_topic_words":  # drawn (with repeats) from the answer's and the instruction's own words
        vocabulary = [w for w in (answer + " " + instruction).split() if any(c.isalpha() for c in w)] or tokens
        return relayout([rng.choice(vocabulary) for _ in tokens])
    if family == "repetition":
        loop = "".join(parts[: 2 * rng.randint(4, 12) - 1]) or instruction
        text = loop
        while len(text) < max(len(answer), 4 * len(loop)):
            text += (" " if rng.random() < 0.7 else "\n") + loop
        return text
    if family == "truncation":
        cut = max(1, int(len(tokens) * rng.uniform(0.25, 0.75)))
        text = "".join(parts[: 2 * cut - 1])
        return _SENTENCE_END.sub("", text) or tokens[0]
    if family == "restate":
        template = RESTATE_TEMPLATES[rng.randrange(len(RESTATE_TEMPLATES))]
        return template.format(ins=instruction.strip(), ins_lower=instruction.strip().lower().rstrip("?.!"))
    raise ValueError(f"unknown degenerate family {family!r}; choose from {', '.join(FAMILIES)}")


def corpus_words_of(texts: Sequence[str]) -> list[str]:
    """Whitespace tokens of ``texts`` made of letters (the random-words family draws from them)."""
    return [w for t in texts for w in t.split() if w.isalpha()]


def synthetic_pairs(data: JudgeData, instructions: Sequence[str], seed: int,
                    sources: Sequence[str] = STRONG, min_words: int = 12) -> list[tuple[str, str, str, str, str]]:
    """(family, source system, instruction, real answer, degenerate rival) for every family and instruction.

    The real answer comes from the ``sources`` in turn; answers shorter than ``min_words`` words are skipped
    (a shuffled or truncated three-word answer is not clearly worse).
    """
    rng = random.Random(seed)
    extra_rng = random.Random(seed + 7919)
    pool = [ins for ins in instructions]
    vocab = [set(words(ins)) - STOPWORDS for ins in pool]
    corpus = corpus_words_of([data.outputs[s][ins] for s in sources for ins in instructions
                              if ins in data.outputs.get(s, {})])
    out = []
    for k, ins in enumerate(instructions):
        for j, family in enumerate(FAMILIES):
            source = sources[(k + j) % len(sources)]
            answer = data.outputs.get(source, {}).get(ins, "")
            if len(answer.split()) < min_words or len(pool) < 2:
                continue
            if family in _NEW_FAMILIES:
                other = ""
                if family == "off_topic_near":  # the nearest other instruction's answer (Jaccard of content words)
                    near = max((o for o in range(len(pool)) if pool[o] != ins and pool[o] in data.outputs[source]),
                               key=lambda o: len(vocab[k] & vocab[o]) / (len(vocab[k] | vocab[o]) or 1),
                               default=None)
                    other = data.outputs[source][pool[near]] if near is not None else ""
                out.append((family, source, ins, answer,
                            degenerate(family, ins, answer, extra_rng, corpus, other)))
                continue
            # off-topic: of 4 answers to other instructions, the one with the most lines, then the longest (a
            # well-formatted answer to another question is the hardest off-topic rival)
            others = [data.outputs[source].get(o, "") for o in rng.sample(pool, min(5, len(pool))) if o != ins][:4]
            other = max(others, key=lambda t: (t.count("\n"), len(t)))
            out.append((family, source, ins, answer, degenerate(family, ins, answer, rng, corpus, other)))
    return out


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
                   synthetic_weight: float = 1.0, hot: Sequence[str] | None = None) -> tuple[np.ndarray, PairSet]:
    """The feature matrix of every (instruction, output, reference) in the fit pairs, and the pairs.

    ``hot`` (one per instruction, see :func:`judge_lm.hot_samples`) are the LM's own hot samples, each a rival
    that must lose to a strong answer like the degenerate families.
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
    for k, (ins, sample) in enumerate(zip(instructions, hot or [], strict=False)):  # the LM's own hot samples
        source = STRONG[k % len(STRONG)]
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


def fit_heads(features: np.ndarray, pairs: PairSet, l2: float, mask: np.ndarray | None = None) -> dict[str, Any]:
    """Fit both heads on the pairs selected by ``mask``; return the weights as plain lists."""
    first, second = np.array(pairs.first), np.array(pairs.second)
    p2, weight = np.array(pairs.p2), np.array(pairs.weight)
    has_ref = np.array(pairs.has_ref)
    if mask is None:
        mask = np.ones(len(first), dtype=bool)
    used_rows = np.unique(np.concatenate([first[mask], second[mask]]))
    scale = features[used_rows].std(axis=0)
    scale = np.where(scale > 1e-9, scale, 1.0)
    # The 768 embedding features get a stronger penalty (EMBEDDING_L2_FACTOR x l2): what an answer is about must
    # not outweigh whether it answers the question, is fluent and complete.
    scale[FIRST_EMBEDDING:len(FEATURE_NAMES)] *= EMBEDDING_L2_FACTOR ** 0.5
    heads = {}
    for name, columns, rows in (("no_reference", slice(0, len(FEATURE_NAMES)), mask),
                                ("reference", slice(0, len(FEATURE_NAMES) + 1), mask & has_ref)):
        x = features[:, columns] / scale[columns]
        theta = fit_bradley_terry(x[second[rows]] - x[first[rows]], p2[rows], weight[rows], l2)
        heads[name] = theta / scale[columns]
    return heads


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
    log(f"sampling the LM's hot answers to {len(fit_instructions)} fit instructions (cached with --cache-dir)")
    hot = hot_samples(fit_instructions, seed, cache_dir)
    features, pairs = build_training(data, fit_instructions, featurize, seed, synthetic_weight, hot)
    log(f"{len(pairs.first)} pairs ({sum(pairs.synthetic)} synthetic), {features.shape[1]} features; fitting")
    heads = fit_heads(features, pairs, l2)
    document: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "fit": {"seed": seed, "l2": l2, "embedding_l2_factor": EMBEDDING_L2_FACTOR,
                "synthetic_weight": synthetic_weight, "max_instructions": max_instructions,
                "gate": gate_settings(),
                "lm": {"model": LM_MODEL, "cond_tokens": COND_TOKENS, "pmi_tokens": PMI_TOKENS,
                       "hot_sample_temperatures": list(HOT_TEMPERATURES)},
                "families": list(FAMILIES),
                "heldout_rule": "crc32(instruction) % 4 == 0", "n_pairs": len(pairs.first),
                "data_sha256": data.fingerprint(), "embedding": "all-MiniLM-L6-v2, mean pooled, 128 tokens"},
        "feature_names": [*FEATURE_NAMES, "cos_ref"],
        "weights": {name: round_weights(theta) for name, theta in heads.items()},
        "ngrams": tables.to_dict(),
    }
    document["fingerprint"] = fingerprint(document)
    return document


def fingerprint(document: dict[str, Any]) -> str:
    """SHA-256 of the document without its ``fingerprint`` field (canonical JSON)."""
    body = {k: v for k, v in document.items() if k != "fingerprint"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def save(document: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(document, sort_keys=True, separators=(",", ":")) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    from alpacafarm.errors import UserError

    parser = argparse.ArgumentParser(prog="alpacafarm offline-judge",
                                     description="Refit the offline judge's weights from the shared data.")
    sub = parser.add_subparsers(dest="command", required=True)
    fit_parser = sub.add_parser("fit", help="fit the weights (deterministic: same data and seed, same bytes)")
    fit_parser.add_argument("--data", type=Path, required=True, help="the shared data folder (with SOURCES.md)")
    fit_parser.add_argument("--out", type=Path, required=True, help="weights file to write (JSON)")
    fit_parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic negatives (default 0)")
    fit_parser.add_argument("--l2", type=float, default=30.0, help="L2 penalty on standardised features")
    fit_parser.add_argument("--synthetic-weight", type=float, default=SYNTHETIC_WEIGHT,
                            help=f"weight of each synthetic pair (default {SYNTHETIC_WEIGHT})")
    fit_parser.add_argument("--max-instructions", type=int, default=None,
                            help="use only the first N instructions (quick checks)")
    fit_parser.add_argument("--cache-dir", type=Path, default=None,
                            help="keep MiniLM embeddings, LM readings and the LM's hot samples here between runs "
                                 "(they are recomputed otherwise)")
    args = parser.parse_args(argv)
    if args.max_instructions is not None and args.max_instructions < 2:
        raise UserError(f"--max-instructions must be >= 2, got {args.max_instructions}")
    if not args.out.parent.is_dir():
        raise UserError(f"--out {args.out}: folder {args.out.parent} does not exist")
    document = fit(args.data, args.seed, args.l2, args.max_instructions, args.cache_dir,
                   synthetic_weight=args.synthetic_weight)
    save(document, args.out)
    print(f"wrote {args.out} (fingerprint {document['fingerprint'][:16]})")
    return 0
