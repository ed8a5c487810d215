"""How fast the offline judge reads new answers: the language model's reads one at a time, as the previous release
batched them, and as they are batched now, on the same pairs in one run.

    python benchmarks/offline_judge_speed.py [--instructions 16] [--outputs 5] [--threads N] [--repeats N]
                                             [--paths one previous new] [--pairs FILE [--limit N]]

The pairs are shaped like the quickstart's evaluation: ``--outputs`` answers per instruction (bundled AlpacaEval
instructions with Davinci003 answers, each instruction's own answer against the next instructions' answers), every
pair new to the judge. ``--pairs`` replays a run's judged pairs instead (a JSON list or JSON lines of records with
``instruction``, ``input``, ``output_1``, ``output_2``: an evaluation's ``annotations.json``, a
``preferences.jsonl``), the first ``--limit`` of them. Each path gets a fresh judge whose models are loaded (and
warmed up on one other pair) before the clock starts, so the figures are the reads themselves: MiniLM embeddings,
the language model's two reads per answer and the text statistics. Paths:

* ``one``: each answer's two reads alone, prompt included (``OfflineJudge(lm_batch_size=1)``), the definition the
  batched reads are tested against;
* ``previous``: the previous release's reads: sequences of prompt and answer batched 8 at a time, every position
  through the LM head (its code is copied below; its values are left unrounded, as now);
* ``new``: the default: each instruction's prompt read once for all its answers (the empty prompt once per call),
  answers batched behind it, only the positions that predict an answer token through the LM head.

Prints pairs/s (wall clock) and CPU seconds per pair (all threads; steadier than the wall clock on a busy machine),
and how far each path's scores are from the one-at-a-time scores (max absolute difference, labels that differ).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "plugins"))
from alpacafarm.data import BUILTIN_DIR, read_records  # noqa: E402
from alpacafarm_annotators.offline_judge.judge import OfflineJudge  # noqa: E402
from alpacafarm_annotators.offline_judge.language_model import LMScorer  # noqa: E402

Pair = tuple[str, str, str, None]


class PreviousLMScorer(LMScorer):
    """The language model's reads as the previous release made them (batches of 8 whole sequences, the model's
    own float32 attention)."""

    def _load(self) -> None:
        super()._load()
        self._model.set_attn_implementation("sdpa")

    def _token_logprobs(self, sequences: list[tuple[list[int], list[int]]]) -> list[np.ndarray]:
        import torch

        order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i][0]) + len(sequences[i][1]), i))
        out: list[np.ndarray] = [np.zeros(0)] * len(sequences)
        pad = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        with torch.inference_mode():
            for start in range(0, len(order), 8):
                chunk = order[start:start + 8]
                full = [sequences[i][0] + sequences[i][1] for i in chunk]
                width = max(len(s) for s in full)
                ids = torch.tensor([s + [pad] * (width - len(s)) for s in full])
                mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in full])
                logits = self._model(input_ids=ids, attention_mask=mask).logits.float()
                logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
                for row, i in enumerate(chunk):
                    prompt_len, n = len(sequences[i][0]), len(sequences[i][1])
                    out[i] = logprobs[row, prompt_len - 1:prompt_len - 1 + n].numpy().astype(np.float64)
        return out


def make_pairs(instructions: int, outputs: int) -> tuple[list[Pair], Pair]:
    """``instructions`` x (``outputs`` - 1) pairs: an instruction's own answer against the next ones' answers."""
    records = [(f"{r['instruction']}\n\n{r['input']}" if r["input"] else r["instruction"], r["reference"])
               for r in read_records(BUILTIN_DIR / "alpaca_eval.jsonl")]
    if len(records) < instructions + outputs + 1:
        raise SystemExit(f"--instructions {instructions}: the bundled set has {len(records)} instructions")
    pairs = [(records[i][0], records[i][1], records[i + j][1], None)
             for i in range(instructions) for j in range(1, outputs)]
    return pairs, (records[-1][0], records[-1][1], records[-2][1], None)


def read_pairs(path: Path, limit: int | None) -> tuple[list[Pair], Pair]:
    """The first ``limit`` judged pairs of a run's file (and one more, for the warm-up)."""
    import json

    text = path.read_text(encoding="utf-8")
    records = json.loads(text) if text.lstrip().startswith("[") else [json.loads(line) for line in
                                                                      text.splitlines() if line.strip()]
    pairs = [(f"{r['instruction']}\n\n{r['input']}" if r.get("input") else r["instruction"], r["output_1"] or "",
              r["output_2"] or "", None) for r in records]
    if len(pairs) < 2:
        raise SystemExit(f"--pairs {path}: fewer than 2 pairs")
    limit = min(limit or len(pairs) - 1, len(pairs) - 1)
    return pairs[:limit], pairs[-1]


def new_judge(path: str, threads: int | None) -> OfflineJudge:
    judge = OfflineJudge(num_threads=threads, lm_batch_size=1 if path == "one" else 16)
    if path == "previous":
        judge.lm.__class__ = PreviousLMScorer  # the same scorer with the previous release's reads
    return judge


def timed(judge: OfflineJudge, pairs: list[Pair]) -> tuple[float, float, list[float]]:
    start, cpu = time.perf_counter(), time.process_time()
    items = [(ins, out, ref) for ins, o1, o2, ref in pairs for out in (o1, o2)]
    scores = judge.score_batch(items)
    return time.perf_counter() - start, time.process_time() - cpu, scores


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instructions", type=int, default=16)
    parser.add_argument("--outputs", type=int, default=5, help="answers per instruction (pairs: outputs - 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--paths", nargs="+", default=["one", "previous", "new"], choices=["one", "previous", "new"])
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of all paths (each a fresh judge); the fastest round of each is printed")
    parser.add_argument("--pairs", type=Path, default=None, help="replay a run's judged pairs (see above)")
    parser.add_argument("--limit", type=int, default=None, help="with --pairs: the first N pairs")
    args = parser.parse_args(argv)
    pairs, warmup = read_pairs(args.pairs, args.limit) if args.pairs else make_pairs(args.instructions, args.outputs)
    answers = len({(ins, out) for ins, o1, o2, _ in pairs for out in (o1, o2)})
    print(f"{len(pairs)} pairs ({answers} distinct answers to {len({p[0] for p in pairs})} instructions"
          f"{f', from {args.pairs}' if args.pairs else ''}), torch threads: {args.threads or 'default'}")
    results: dict[str, Any] = {}
    times: dict[str, list[tuple[float, float]]] = {path: [] for path in args.paths}
    for round_ in range(args.repeats):  # rounds interleave the paths: a busy spell slows all of them
        for path in args.paths:
            judge = new_judge(path, args.threads)
            judge.judge([warmup])  # loads both models outside the clock
            wall, cpu, scores = timed(judge, pairs)
            results[path] = scores
            times[path].append((wall, cpu))
            if args.repeats > 1:
                print(f"  round {round_ + 1} {path}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
    fastest = f", the fastest of {args.repeats} rounds" if args.repeats > 1 else ""
    for path in args.paths:
        wall, cpu = min(w for w, _ in times[path]), min(c for _, c in times[path])
        print(f"{path:>9}: {len(pairs) / wall:6.2f} pairs/s  {cpu / len(pairs):6.2f} CPU s/pair  "
              f"({wall:.1f} s wall, {cpu:.1f} s CPU{fastest})", flush=True)
    if "one" in results:
        reference = np.array(results["one"])
        for path in (p for p in args.paths if p != "one"):
            scores = np.array(results[path])
            labels = [np.sign(a - b) for a, b in zip(scores[0::2], scores[1::2], strict=True)]
            expected = [np.sign(a - b) for a, b in zip(reference[0::2], reference[1::2], strict=True)]
            print(f"{path:>9} vs one at a time: max |score difference| {np.abs(scores - reference).max():.2e}, "
                  f"labels differing {sum(a != b for a, b in zip(labels, expected, strict=True))} of {len(pairs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
