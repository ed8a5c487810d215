"""Annotation throughput against a local OpenAI-compatible server with a fixed latency.

Prints, for each concurrency C, annotations/s next to the ideal C x batch / latency (goal: >= 90% of it), and
the rate of re-annotating a fully cached set (goal: >= 10,000/s).

    python benchmarks/annotation_throughput.py [--latency 0.25] [--batch-size 5] [--concurrency 1 4 16 32]
                                               [--pairs 400] [--cached-pairs 20000]
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alpacafarm.annotation_cache import AnnotationCache
from alpacafarm.testing.openai_server import FakeOpenAIServer, prefer_first_responder
from alpacafarm.types import Pair
from alpacafarm_annotators.config import PromptedAnnotatorConfig
from alpacafarm_annotators.prompted import PromptedAnnotator


def make_pairs(n: int, tag: str) -> list[Pair]:
    return [Pair(f"{tag} instruction {i}: explain item {i}", f"first answer {i} " * 5, f"second answer {i} " * 7)
            for i in range(n)]


def _serve(latency: float, pipe: object) -> None:
    with FakeOpenAIServer(prefer_first_responder, latency_s=latency) as server:
        pipe.send(server.base_url)
        pipe.recv()  # block until the benchmark is done


@contextmanager
def server_process(latency: float) -> Iterator[str]:
    """The server in its own process, so it does not share the client's interpreter lock."""
    ours, theirs = multiprocessing.Pipe()
    process = multiprocessing.get_context("spawn").Process(target=_serve, args=(latency, theirs), daemon=True)
    process.start()
    try:
        yield ours.recv()
    finally:
        ours.send("stop")
        process.join(timeout=10)


def judge(base_url: str, cache: AnnotationCache, batch_size: int, concurrency: int) -> PromptedAnnotator:
    config = PromptedAnnotatorConfig(model="bench-model", template="ranking_noex", batch_size=batch_size,
                                     base_url=base_url, api_key_env=None, max_concurrency=concurrency, timeout_s=30)
    return PromptedAnnotator(config, "bench", cache=cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency", type=float, default=0.25)
    parser.add_argument("--batch-size", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--pairs", type=int, default=400, help="pairs per concurrency level (scaled up with C)")
    parser.add_argument("--cached-pairs", type=int, default=20000)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp, server_process(args.latency) as base_url:
        cache = AnnotationCache(Path(tmp) / "bench.sqlite")
        print(f"server latency {args.latency:.3f}s (separate process), batch size {args.batch_size}")
        print(f"{'C':>4} {'pairs':>7} {'seconds':>8} {'ann/s':>9} {'ideal/s':>9} {'efficiency':>10}")
        for c in args.concurrency:
            n = max(args.pairs, c * args.batch_size * 10)  # at least 10 waves, so start-up does not dominate
            pairs = make_pairs(n, f"C{c}")
            started = time.perf_counter()
            annotations = judge(base_url, cache, args.batch_size, c).annotate(pairs)
            seconds = time.perf_counter() - started
            assert all(a.preference in (1, 2) for a in annotations)
            rate, ideal = n / seconds, c * args.batch_size / args.latency
            print(f"{c:>4} {n:>7} {seconds:>8.2f} {rate:>9.1f} {ideal:>9.1f} {rate / ideal:>9.1%}")

    with tempfile.TemporaryDirectory() as tmp, server_process(0.0) as base_url:
        cache = AnnotationCache(Path(tmp) / "bench.sqlite")
        pairs = make_pairs(args.cached_pairs, "cached")
        fill = judge(base_url, cache, args.batch_size, 64)
        fill.annotate(pairs)
        paid = cache.ledger().requests
        started = time.perf_counter()
        again = fill.annotate(pairs)
        seconds = time.perf_counter() - started
        assert all(a.cached for a in again) and cache.ledger().requests == paid
        print(f"fully cached re-annotation: {len(pairs)} pairs in {seconds:.3f}s = {len(pairs) / seconds:,.0f}/s "
              f"(0 requests)")


if __name__ == "__main__":
    main()
