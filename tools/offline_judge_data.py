"""What the offline judge is fitted on (a part of ``tools/fit_offline_judge.py``, the maintainers' refit).

* :func:`load_data`: the recorded AlpacaEval outputs and GPT-4 pairwise judgments in the shared data folder (every
  file is described in its SOURCES.md); :func:`is_heldout` keeps one instruction in four out of the fit for
  ``benchmarks/offline_judge_agreement.py``;
* :func:`synthetic_pairs`: rivals built from recorded strong answers that must always lose (:func:`degenerate`:
  word salad, random corpus words, invented words, an answer to a different instruction, a repetition loop, a
  truncation mid-sentence, a restatement of the instruction, words drawn from the answer and instruction);
* the judge's language model's own answers (:func:`hot_samples` at temperatures 1.2-1.5, fluent word by word but
  drifting into nonsense; :func:`sample_pool`, the candidates of the fit's adversarial round), drawn with the
  project's sampler and cached (:func:`cached_json`).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from alpacafarm.data import write_json
from alpacafarm.errors import UserError
from alpacafarm.paths import read_text
from alpacafarm_annotators.offline_judge.language_model import LM_MODEL
from alpacafarm_annotators.offline_judge.text_features import STOPWORDS, words

T = TypeVar("T")

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


# ---------------------------------------------------------------------------------- the language model's own answers
#: temperatures of the language model's own hot samples, a negative family of the fit (cycled over instructions)
HOT_TEMPERATURES = (1.2, 1.35, 1.5)
HOT_TOKENS = 96


def _sample_cache(cache_dir: str | Path | None, prefix: str, determinants: list[Any]) -> Path | None:
    """``<cache_dir>/<prefix>_<hash of determinants>.json`` (None without a folder)."""
    if cache_dir is None:
        return None
    key = hashlib.sha256(json.dumps(determinants).encode()).hexdigest()[:20]
    return Path(cache_dir) / f"{prefix}_{key}.json"


def cached_json(path: Path | None, draw: Callable[[], T]) -> T:
    """The JSON value cached at ``path``, or ``draw()`` written there atomically (a run killed mid-write leaves no
    half file). No ``path``: drawn every time. A cache file that is not valid JSON is a one-line UserError naming it."""
    if path is not None and path.is_file():
        try:
            return json.loads(read_text(path, "sample cache"))
        except json.JSONDecodeError as exc:
            raise UserError(f"sample cache {path} is not valid JSON ({exc}): delete it to draw the samples "
                            "again") from None
    value = draw()
    if path is not None:
        write_json(path, value)
    return value


def hot_samples(instructions: Sequence[str], seed: int, cache_dir: str | Path | None = None,
                temperatures: Sequence[float] = HOT_TEMPERATURES) -> list[str]:
    """One answer per instruction sampled from the judge's LM at a high temperature (``temperatures`` cycled):
    text that reads as fluent word by word but drifts into nonsense, which best-of-n on the judge's score would
    otherwise find. Drawn with the project's transformers sampler (fixed batches and seed: the same on every run
    on a machine) and cached under ``cache_dir`` by a hash of everything that determines them."""
    def draw() -> list[str]:
        samples = [""] * len(instructions)
        generator = lm_generator()
        for k, temperature in enumerate(temperatures):
            chosen = list(range(k, len(instructions), len(temperatures)))
            outs = sample_answers([instructions[i] for i in chosen], temperature, 1, HOT_TOKENS, seed + k,
                                  batch_size=16, generator=generator)
            for i, out in zip(chosen, outs, strict=True):
                samples[i] = out[0]
        return samples

    path = _sample_cache(cache_dir, "hot_samples",
                         [LM_MODEL, list(instructions), list(temperatures), seed, HOT_TOKENS])
    return cached_json(path, draw)


#: the pool mined for the adversarial round of the fit: many samples per instruction at the temperature of
#: ``benchmarks/offline_judge_agreement.py``'s best-of-n, of which the judge's favourites become rivals
POOL_TEMPERATURE = 1.2
POOL_SIZE = 16


def sample_pool(instructions: Sequence[str], seed: int, cache_dir: str | Path | None = None,
                n: int = POOL_SIZE, temperature: float = POOL_TEMPERATURE) -> list[list[str]]:
    """``n`` answers per instruction sampled from the judge's LM at ``temperature`` (cached like
    :func:`hot_samples`): the candidates a best-of-n policy would choose among."""
    path = _sample_cache(cache_dir, "pool", [LM_MODEL, list(instructions), n, temperature, seed, HOT_TOKENS])
    return cached_json(path, lambda: sample_answers(instructions, temperature, n, HOT_TOKENS, seed,
                                                    batch_size=max(1, 64 // n)))


def lm_generator() -> Any:
    """The judge's LM behind the project's transformers sampler (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alpacafarm.generation import TransformersGenerator
    from alpacafarm.model_sources import resolve_model_path

    model_path = resolve_model_path(LM_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    return TransformersGenerator(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), tokenizer)


def sample_answers(instructions: Sequence[str], temperature: float, n: int, max_new_tokens: int, seed: int,
                   batch_size: int, generator: Any = None) -> list[list[str]]:
    """``n`` answers per instruction from the judge's LM (``generator``: one from :func:`lm_generator`, else loaded)."""
    from alpacafarm.generation import SamplingConfig

    generator = generator or lm_generator()
    prompts = generator.prompt_format.records([{"instruction": ins, "input": ""} for ins in instructions])
    return generator.generate(prompts, SamplingConfig(n=n, temperature=temperature, max_new_tokens=max_new_tokens,
                                                      batch_size=batch_size, seed=seed))
