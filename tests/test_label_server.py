"""``alpacafarm label serve`` as a real process on 127.0.0.1: kill and resume, and every refused request (issue 39)."""

from __future__ import annotations

import re
import signal
import sqlite3
from pathlib import Path

import pytest
from conftest import REPO_ROOT, run_cli
from label_session import call, label, next_pair, plain_pairs, serving, write_pairs

DEMO = REPO_ROOT / "plugins" / "alpacafarm_validation" / "data" / "label_demo_pairs.jsonl"


def stored(folder: Path) -> list[tuple[str, str, str]]:
    with sqlite3.connect(folder / "labels.sqlite") as db:
        return db.execute("SELECT labeller, pair_id, choice FROM labels ORDER BY created").fetchall()


def test_killing_the_server_after_15_labels_loses_none_and_repeats_none(tmp_path: Path) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(40))
    folder = tmp_path / "session"
    with serving(str(pairs), "--dir", str(folder), "--pairs", "30") as (url, process):
        first = [label(url, "ann")["pair_id"] for _ in range(15)]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    assert [r[1] for r in stored(folder)] == first
    with serving("--dir", str(folder)) as (url, _):  # resume: the folder alone
        status, served = next_pair(url, "ann")
        progress = served["progress"]
        assert status == 200 and (progress["labelled"], progress["skipped"], progress["left"]) == (15, 0, 15)
        rest = [label(url, "ann")["pair_id"] for _ in range(15)]
        assert next_pair(url, "ann")[1]["done"] is True
    assert len(set(first + rest)) == 30 and len(stored(folder)) == 30


def test_forged_replayed_malformed_and_path_requests_get_4xx_and_change_nothing(tmp_path: Path) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(4))
    folder = tmp_path / "session"
    with serving(str(pairs), "--dir", str(folder)) as (url, _):
        _, served = next_pair(url, "ann")
        good = {"labeller": "ann", "pair_id": served["pair_id"], "ticket": served["ticket"], "choice": "first"}
        refused = [
            ({**good, "pair_id": "0123456789abcdef"}, None, 404),  # unknown pair id
            ({**good, "ticket": "made-up"}, None, 403),  # forged ticket
            ({**good, "labeller": "bob"}, None, 403),  # a ticket issued to someone else
            ({**good, "choice": "both"}, None, 400),
            ({**good, "labeller": "../../etc"}, None, 400),
            ({**good, "extra": 1}, None, 400),
            ({**good, "reason": "x" * 3000}, None, 400),
            ([1, 2], None, 400),
            (None, b"{not json", 400),
            (None, b"\xff\xfe", 400),
            (None, b"x" * 20_000, 413),
        ]
        for body, raw, status in refused:
            got, answer = call(url, "/api/label", body, raw=raw)
            assert got == status and "error" in answer, (body, raw and raw[:20], got, answer)
        assert call(url, "/api/label", raw=b"labeller=ann", headers={"Content-Type": "text/plain"})[0] == 415
        assert next_pair(url, "")[0] == 400
        assert stored(folder) == []
        assert call(url, "/api/label", good)[0] == 200
        assert call(url, "/api/label", good)[0] == 409  # the same request replayed
        assert call(url, "/api/label", {**good, "choice": "second"})[0] == 409
        assert stored(folder) == [("ann", served["pair_id"], "first")]
        # no path reaches the file system: only the page's two assets are served
        for path in ("/static/../../pyproject.toml", "/static/..%2f..%2fpyproject.toml", "/static/label_server.py",
                     "/static/%2e%2e/labels.sqlite", "/labels.sqlite", "/../labels.sqlite"):
            status, text = call(url, path)
            assert status == 404 and "alpacafarm" not in str(text), path
        assert call(url, "/static/label.js")[0] == 200
        # another site's name for this address (DNS rebinding) is refused
        assert call(url, "/", headers={"Host": "attacker.example"})[0] == 400


def test_a_token_guards_the_page_and_the_api(tmp_path: Path) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(3))
    with serving(str(pairs), "--dir", str(tmp_path / "s"), "--random-token") as (url, _):
        token = url.split("token=")[1]
        assert call(url, "/")[0] == 401 and call(url, "/?token=wrong")[0] == 401
        assert call(url, f"/?token={token}")[0] == 200
        assert next_pair(url, "ann")[0] == 401
        assert next_pair(url, "ann", headers={"X-Label-Token": "wrong"})[0] == 401
        label(url, "ann", headers={"X-Label-Token": token})


def test_listening_beyond_this_machine_without_a_token_is_refused(tmp_path: Path) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(3))
    result = run_cli("label", "serve", str(pairs), "--dir", str(tmp_path / "s"), "--host", "0.0.0.0")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--random-token" in result.stderr
    result = run_cli("label", "serve", str(tmp_path / "missing.jsonl"), "--dir", str(tmp_path / "s"))
    assert result.returncode == 2 and "missing.jsonl" in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.slow
def test_report_prints_the_offline_judges_agreement_with_the_people(tmp_path: Path) -> None:
    """The issue's "done when": label from the demo pairs, then one command reports the offline judge (slow: the
    judge reads every labelled pair with a small LM)."""
    folder = tmp_path / "session"
    with serving(str(DEMO), "--dir", str(folder), "--pairs", "4", "--overlap", "0.5") as (url, _):
        for _ in range(4):
            label(url, "ann", "first")
        for _ in range(2):
            label(url, "bob", "second")
    result = run_cli("label", "report", "--dir", str(folder), "--n-bootstrap", "50")
    shown = result.stdout + result.stderr  # the tables go to the console (stderr), as compare's do
    assert result.returncode == 0, shown
    row = re.search(r"offline\s*│\s*(\d+\.\d)\s*│\s*(-?\d\.\d{3}|-)\s*│\s*(\d+\.\d|-)\s*│\s*6\s*│", shown)
    assert row is not None and 0.0 <= float(row[1]) <= 100.0, shown  # agreement %, kappa, P(longer), 6 labels
    assert "human-human agreement on 2 overlap pairs" in shown and "65.7%" in shown
    assert "Spearman of win-rates" in shown and "text_davinci_003 left out" in shown
    assert (folder / "report.png").stat().st_size > 1000


def test_every_error_is_the_json_error_shape(tmp_path: Path) -> None:
    """Issue 61 (10): unknown routes, wrong methods, a foreign host and a missing token answer {"error": ...}."""
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(3))
    with serving(str(pairs), "--dir", str(tmp_path / "s")) as (url, _):
        for method_path, status in ((("GET", "/nowhere"), 404), (("GET", "/api/label"), 405),
                                    (("GET", "/api/next"), 405), (("GET", "/static/nothing.js"), 404)):
            got, answer = call(url, method_path[1])
            assert got == status and isinstance(answer, dict) and answer.get("error"), (method_path, got, answer)
        got, answer = call(url, "/", headers={"Host": "attacker.example"})
        assert got == 400 and isinstance(answer, dict) and "host" in answer["error"]
    with serving(str(pairs), "--dir", str(tmp_path / "t"), "--random-token") as (url, _):
        got, answer = call(url, "/")
        assert got == 401 and isinstance(answer, dict) and "token" in answer["error"]


def test_a_get_changes_nothing(tmp_path: Path) -> None:
    """Issue 62 (5): fetching a pair is a POST; a GET (a drive-by, a prefetch) reserves nothing."""
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(2))
    folder = tmp_path / "s"
    with serving(str(pairs), "--dir", str(folder), "--overlap", "0") as (url, _):
        for name in ("drive1", "drive2"):
            assert call(url, f"/api/next?labeller={name}")[0] == 405
        with sqlite3.connect(folder / "labels.sqlite") as db:
            assert db.execute("SELECT COUNT(*) FROM assignments").fetchone()[0] == 0
        label(url, "ann")
        label(url, "ann")  # both pairs are still there for a real labeller


def test_random_token_is_the_same_after_a_restart(tmp_path: Path) -> None:
    """Issue 62 (2): a restarted server serves the link it printed before, so open tabs keep working."""
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(3))
    folder = tmp_path / "s"
    with serving(str(pairs), "--dir", str(folder), "--random-token") as (url, _):
        token = url.split("token=")[1]
        label(url, "ann", headers={"X-Label-Token": token})
    with serving("--dir", str(folder), "--random-token") as (url, _):
        assert url.split("token=")[1] == token
        label(url, "ann", headers={"X-Label-Token": token})


def test_a_network_server_prints_an_address_teammates_can_open(tmp_path: Path) -> None:
    """Issue 62 (8): with --host 0.0.0.0 the printed link names this machine's own address, not 0.0.0.0."""
    import ipaddress
    import socket
    from urllib.parse import urlsplit

    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(3))
    with serving(str(pairs), "--dir", str(tmp_path / "s"), "--host", "0.0.0.0", "--random-token") as (url, _):
        host = urlsplit(url).hostname
        assert host != "0.0.0.0"
        try:
            address = ipaddress.ip_address(socket.gethostbyname(host))
        except OSError:
            pytest.skip(f"this machine's name {host} does not resolve here")
        assert not address.is_loopback or address.is_loopback == all(
            ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(socket.gethostname(), None))
        token = url.split("token=")[1]
        assert call(url, f"/?token={token}")[0] == 200  # and the printed address answers
