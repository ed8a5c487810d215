"""Helpers for the labelling page's tests: a real ``alpacafarm label serve`` process and plain HTTP calls to it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from conftest import REPO_ROOT


def write_pairs(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def plain_pairs(n: int) -> list[dict[str, str]]:
    return [{"instruction": f"Question {i}?", "output_1": f"Answer A{i}.", "output_2": f"A longer answer B{i}.",
             "generator_1": "ref", "generator_2": "sys"} for i in range(n)]


@contextmanager
def serving(*args: str, env: dict[str, str] | None = None, log: Path | None = None,
            preexec: Callable[[], None] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``alpacafarm label serve ARGS --port 0`` in its own process; yields the URL it printed and the process
    (terminated on exit unless the test already ended it). ``log``: a file for its stderr (else it goes with
    stdout); ``preexec``: run in the child before it starts (e.g. a resource limit)."""
    stderr = open(log, "w") if log is not None else subprocess.STDOUT  # noqa: SIM115 - closed below
    process = subprocess.Popen([sys.executable, "-m", "alpacafarm", "label", "serve", *args, "--port", "0"],
                               cwd=REPO_ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                               stderr=stderr, text=True, preexec_fn=preexec)
    try:
        lines = []
        for line in process.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("open http"):
                yield line.split()[1], process
                break
        else:
            raise AssertionError("the server stopped before printing its address:\n" + "".join(lines))
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=30)
        process.stdout.close()  # type: ignore[union-attr]
        if log is not None:
            stderr.close()  # type: ignore[union-attr]


def call(url: str, path: str, body: Any = None, *, headers: dict[str, str] | None = None,
         raw: bytes | None = None) -> tuple[int, Any]:
    """(status, JSON or text) of a GET, or of a POST when ``body``/``raw`` is given (JSON unless headers say)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    base = {"Content-Type": "application/json"} if data is not None else {}
    request = urllib.request.Request(url.split("?")[0].rstrip("/") + path, data=data,
                                     headers={**base, **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def next_pair(url: str, labeller: str | None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """(status, answer) of ``POST /api/next`` for ``labeller`` (None: as the invite token in ``headers`` says).
    A server from before issue 62 (fetching was a GET) is asked with a GET, so the tests can be run against it to
    show what they catch."""
    status, answer = call(url, "/api/next", {} if labeller is None else {"labeller": labeller}, headers=headers)
    if status == 405 and call(url, "/api/label")[0] == 405 and not isinstance(answer, dict):  # only the old server
        status, answer = call(url, f"/api/next?labeller={labeller}", headers=headers)
    return status, answer


def label(url: str, labeller: str | None, choice: str = "first",
          headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Fetch ``labeller``'s next pair and label it; returns the served pair."""
    status, served = next_pair(url, labeller, headers)
    assert status == 200 and not served["done"], served
    body = {"pair_id": served["pair_id"], "ticket": served["ticket"], "choice": choice}
    status, answer = call(url, "/api/label", body if labeller is None else {**body, "labeller": labeller},
                          headers=headers)
    assert status == 200 and answer["stored"], answer
    return served


def invite(folder: Path, name: str, url: str = "http://127.0.0.1:8765/") -> str:
    """``alpacafarm label invite NAME --dir FOLDER``; returns the token of the printed link."""
    result = subprocess.run([sys.executable, "-m", "alpacafarm", "label", "invite", name, "--dir", str(folder),
                             "--url", url], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["link"].split("token=")[1]
