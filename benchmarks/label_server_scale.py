"""The labelling server at scale (issue 61, case 8): ms per request on a session of 100,000 pairs, and how many
requests fail (500 or any 5xx, "database is locked") with 50 clients labelling at once.

A session of ``--pairs`` generated pairs is written straight into a fresh store; the real ``alpacafarm label serve
--dir`` process serves it on 127.0.0.1. One labeller then fetches and labels ``--sequential`` pairs in a row (ms per
request: the mean and the median over those requests); then ``--clients`` threads, each a different labeller,
fetch and label ``--rounds`` pairs each at the same time. Printed: ms per request, requests made under load, the
count of 5xx answers (goal: 0), error lines and tracebacks in the server's log (goal: 0).

``--before REF`` (default ``HEAD``; ``none`` skips it) also measures the label modules as committed at git REF,
in the same run (the files are laid over a temporary copy of the plugin package), so before and after print side
by side. Old servers took ``GET /api/next?labeller=``; the client uses whichever the server accepts.

    python benchmarks/label_server_scale.py [--pairs 100000] [--clients 50] [--rounds 2] [--sequential 20]
                                            [--before HEAD|none]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "plugins" / "alpacafarm_validation"
LABEL_FILES = ("label_store.py", "label_server.py", "label_cli.py", "label_pairs.py", "label_report.py")


def build_store(folder: Path, n: int) -> None:
    """A session of ``n`` pairs (10% overlap, 1 label per other pair), written with the store's own API."""
    code = (
        "import sys; from pathlib import Path\n"
        "from alpacafarm_validation.label_pairs import LabelPair\n"
        "from alpacafarm_validation.label_store import LabelStore, Settings\n"
        "n = int(sys.argv[2])\n"
        "pairs = [LabelPair(f'Question {i}?', '', f'Answer A{i}.', f'A longer answer B{i}.', 'ref', f's{i % 4}')"
        " for i in range(n)]\n"
        "LabelStore.create_or_resume(Path(sys.argv[1]), pairs, Settings(overlap=0.1))\n")
    subprocess.run([sys.executable, "-c", code, str(folder), str(n)], check=True, cwd=REPO,
                   env={**os.environ, **ENV})


ENV: dict[str, str] = {}


def http(url: str, method: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode(errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class Client:
    """One labeller against the server at ``base``; records each request's status and duration."""

    def __init__(self, base: str, name: str, post_next: bool) -> None:
        self.base, self.name, self.post_next = base, name, post_next
        self.timings: list[float] = []
        self.statuses: list[int] = []

    def _timed(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        start = time.perf_counter()
        status, answer = http(self.base + path, method, body)
        self.timings.append(time.perf_counter() - start)
        self.statuses.append(status)
        return status, answer

    def label_one(self) -> None:
        if self.post_next:
            status, served = self._timed("POST", "/api/next", {"labeller": self.name})
        else:
            status, served = self._timed("GET", f"/api/next?labeller={self.name}")
        if status != 200 or served.get("done"):
            return
        self._timed("POST", "/api/label", {"labeller": self.name, "pair_id": served["pair_id"],
                                           "ticket": served["ticket"], "choice": "first", "reason": ""})


def measure(label: str, n: int, clients: int, rounds: int, sequential: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "session"
        start = time.perf_counter()
        build_store(folder, n)
        built = time.perf_counter() - start
        log = open(Path(tmp) / "server.log", "w+")  # noqa: SIM115 - read back after the run
        server = subprocess.Popen([sys.executable, "-m", "alpacafarm", "label", "serve", "--dir", str(folder),
                                   "--port", "0"], cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True,
                                  env={**os.environ, **ENV})
        try:
            url = next(line.split()[1] for line in server.stdout if line.startswith("open http"))  # type: ignore[union-attr]
            base = url.split("?")[0].rstrip("/")
            post_next = http(base + "/api/next", "POST", {"labeller": "probe"})[0] != 405
            one = Client(base, "solo", post_next)
            for _ in range(sequential):
                one.label_one()
            many = [Client(base, f"client{i}", post_next) for i in range(clients)]
            threads = [threading.Thread(target=lambda c=c: [c.label_one() for _ in range(rounds)]) for c in many]
            load_start = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            load_s = time.perf_counter() - load_start
        finally:
            server.terminate()
            server.wait(timeout=60)
            server.stdout.close()  # type: ignore[union-attr]
        log.seek(0)
        text = log.read()
        log.close()
    statuses = [s for c in many for s in c.statuses]
    return {"code": label, "pairs": n, "build_s": round(built, 1),
            "ms_per_request": round(1000 * statistics.mean(one.timings), 1),
            "ms_per_request_median": round(1000 * statistics.median(one.timings), 1),
            "requests_under_load": len(statuses), "clients": clients, "load_s": round(load_s, 1),
            "ms_per_request_under_load": round(1000 * statistics.mean(t for c in many for t in c.timings), 1),
            "status_5xx": sum(s >= 500 for s in statuses), "status_500": sum(s == 500 for s in statuses),
            "locked_in_log": text.count("database is locked"), "tracebacks_in_log": text.count("Traceback")}


def old_package(ref: str, into: Path) -> None:
    """A copy of the plugin package with the label modules as committed at ``ref``."""
    target = into / "alpacafarm_validation"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__", "data"))
    (target / "data").symlink_to(PACKAGE / "data")
    for name in LABEL_FILES:
        shown = subprocess.run(["git", "show", f"{ref}:plugins/alpacafarm_validation/{name}"], cwd=REPO,
                               capture_output=True, text=True)
        if shown.returncode == 0:
            (target / name).write_text(shown.stdout, encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2, help="pairs each concurrent client fetches and labels")
    parser.add_argument("--sequential", type=int, default=20, help="pairs one labeller labels in a row")
    parser.add_argument("--before", default="HEAD", help="also measure the label modules at this git ref; none: skip")
    args = parser.parse_args()
    results = []
    if args.before != "none":
        with tempfile.TemporaryDirectory() as tmp:
            old_package(args.before, Path(tmp))
            ENV["PYTHONPATH"] = tmp + os.pathsep + os.environ.get("PYTHONPATH", "")
            results.append(measure(f"before ({args.before})", args.pairs, args.clients, args.rounds,
                                   args.sequential))
            ENV.clear()
            print(json.dumps(results[-1]), flush=True)
    results.append(measure("now (working tree)", args.pairs, args.clients, args.rounds, args.sequential))
    print(json.dumps(results[-1]), flush=True)
    for r in results:
        print(f"{r['code']}: {r['pairs']} pairs: {r['ms_per_request']:.1f} ms per request (median "
              f"{r['ms_per_request_median']:.1f}); {r['clients']} concurrent clients: {r['requests_under_load']} "
              f"requests in {r['load_s']} s, {r['status_500']} answered 500 ({r['status_5xx']} 5xx), "
              f"{r['locked_in_log']} 'database is locked' and {r['tracebacks_in_log']} tracebacks in the log")
    return 0 if results[-1]["status_5xx"] == 0 and results[-1]["tracebacks_in_log"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
