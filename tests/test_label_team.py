"""Labelling for a team (issue 62) through the real server: invite links, undo, leases, counts, the team page."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from conftest import run_cli
from label_session import call, invite, label, next_pair, plain_pairs, serving, write_pairs


def rows(folder: Path, query: str) -> list[tuple]:
    with sqlite3.connect(folder / "labels.sqlite") as db:
        return db.execute(query).fetchall()


def test_invite_links_are_the_identity_and_survive_a_restart(tmp_path: Path) -> None:
    """Issue 62 (1): nobody labels as someone else, "bob" and "Bob" are one person, a revoked link stops."""
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(6))
    folder = tmp_path / "session"
    with serving(str(pairs), "--dir", str(folder), "--overlap", "0.5") as (url, _):
        label(url, "bob")  # before any invite: a typed name
        ann = invite(folder, "ann", url)  # while the server runs: honoured at once
        bob = invite(folder, "Bob", url)  # the same person as "bob": keeps his label
        again = run_cli("label", "invite", "BOB", "--dir", str(folder))
        assert again.returncode == 2 and again.stderr.count("\n") == 1 and "already has an invite" in again.stderr
        assert next_pair(url, "carol")[0] == 401  # a typed name is no identity any more
        assert next_pair(url, "ann")[0] == 401  # not even a real labeller's
        assert next_pair(url, "bob", headers={"X-Label-Token": ann})[0] == 403  # ann's link, claiming bob
        label(url, None, headers={"X-Label-Token": ann})
        status, served = next_pair(url, None, headers={"X-Label-Token": bob})
        assert status == 200 and served["labeller"] == "bob" and served["progress"]["labelled"] == 1
        assert call(url, f"/?token={ann}")[0] == 200 and call(url, "/?token=made-up")[0] == 401
    with serving("--dir", str(folder)) as (url, _):  # a restart: the same links
        label(url, None, headers={"X-Label-Token": ann})
        assert run_cli("label", "revoke", "ann", "--dir", str(folder)).returncode == 0
        status, answer = next_pair(url, None, headers={"X-Label-Token": ann})
        assert status == 401 and "revoked" in answer["error"]
    assert sorted(rows(folder, "SELECT labeller, COUNT(*) FROM labels GROUP BY labeller")) == [("ann", 2), ("bob", 1)]


def test_undo_takes_back_the_last_label_and_keeps_the_history(tmp_path: Path) -> None:
    """Issue 62 (3): a mis-click is undone (the pair comes back, labelled again); the old label stays recorded."""
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(4))
    folder = tmp_path / "session"
    with serving(str(pairs), "--dir", str(folder)) as (url, _):
        assert call(url, "/api/undo", {"labeller": "ann"})[0] == 409  # nothing to undo yet
        first = label(url, "ann", "first")["pair_id"]
        second = label(url, "ann", "first")["pair_id"]
        status, back = call(url, "/api/undo", {"labeller": "ann"})
        assert status == 200 and back["pair_id"] == second and back["undone"]["choice"] == "first"
        assert back["progress"]["labelled"] == 1
        assert call(url, "/api/undo", {"labeller": "bob"})[0] == 409  # only one's own labels
        answer = call(url, "/api/label", {"labeller": "ann", "pair_id": second, "ticket": back["ticket"],
                                          "choice": "second"})
        assert answer[0] == 200 and answer[1]["progress"]["labelled"] == 2
        assert next_pair(url, "ann")[1]["pair_id"] not in (first, second)
    assert rows(folder, "SELECT pair_id, choice FROM labels ORDER BY created") == [(first, "first"), (second, "second")]
    assert rows(folder, "SELECT action, pair_id, choice FROM label_events ORDER BY id") == [
        ("label", first, "first"), ("label", second, "first"), ("undo", second, "first"),
        ("label", second, "second")]


def test_leases_are_short_and_released_by_a_skip_or_a_closed_tab(tmp_path: Path) -> None:
    """Issue 62 (5): abandoned page loads lock nothing for long; a release (tab closed) or a skip frees a pair."""
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(2))
    folder = tmp_path / "session"
    with serving(str(pairs), "--dir", str(folder), "--overlap", "0") as (url, _):
        _, ann = next_pair(url, "ann")
        _, bob = next_pair(url, "bob")
        assert ann["pair_id"] != bob["pair_id"]
        assert next_pair(url, "cyd")[1]["done"] is True  # both pairs held by a live lease
        assert call(url, "/api/lease", {"labeller": "ann", "ticket": ann["ticket"], "action": "release"}) == (
            200, {"released": True})
        assert next_pair(url, "cyd")[1]["pair_id"] == ann["pair_id"]  # ann closed her tab: cyd gets it
        answer = call(url, "/api/label", {"labeller": "bob", "pair_id": bob["pair_id"], "ticket": bob["ticket"],
                                          "choice": "skip"})
        assert answer[0] == 200
        assert next_pair(url, "dee")[1]["pair_id"] == bob["pair_id"]  # bob skipped it: free at once
        assert call(url, "/api/lease", {"labeller": "bob", "ticket": "made-up", "action": "renew"}) == (
            200, {"renewed": False})
        assert call(url, "/api/lease", {"labeller": "bob", "ticket": "x", "action": "keep"})[0] == 400
    settings = dict(rows(folder, "SELECT key, value FROM meta"))
    assert float(settings["lease_s"]) <= 180  # short: the page renews it while it is open


def test_skips_are_counted_apart_and_ones_own_counts_never_shrink(tmp_path: Path) -> None:
    """Issue 62 (7): a skip is not a label; others labelling leaves my counts as they were."""
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(10))
    with serving(str(pairs), "--dir", str(tmp_path / "s"), "--overlap", "0") as (url, _):
        label(url, "ann", "first")
        label(url, "ann", "skip")
        mine = next_pair(url, "ann")[1]["progress"]
        assert (mine["labelled"], mine["skipped"]) == (1, 1)
        for _ in range(4):
            label(url, "bob", "second")
        after = next_pair(url, "ann")[1]["progress"]
        assert (after["labelled"], after["skipped"]) == (1, 1) and after["session_pairs"] == 10
        assert after["session_done"] == 5 and mine["left"] - 4 <= after["left"] < mine["left"]  # "left" may shrink


def test_the_team_page_shows_who_labelled_what_and_the_agreement_so_far(tmp_path: Path) -> None:
    """Issue 62 (8): per labeller counts, overlap done and human-human agreement, live, without any judge."""
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(6))
    with serving(str(pairs), "--dir", str(tmp_path / "s"), "--overlap", "0.5") as (url, _):
        for _ in range(3):
            label(url, "ann", "first")
        label(url, "bob", "skip")
        label(url, "bob", "first")
        status, team = call(url, "/api/team")
        assert status == 200
        assert team["labellers"]["ann"]["labelled"] == 3 and team["labellers"]["bob"]["skipped"] == 1
        assert team["overlap_pairs"] == 3 and team["shared_pairs"] == team["overlap_done"] >= 1
        assert team["human_human"]["pairs"] == team["shared_pairs"] and "minimum 20" in team["warning"]
        status, page = call(url, "/team")
        assert status == 200 and "<td>ann</td><td>3</td>" in page and "http-equiv=\"refresh\"" in page
        assert json.dumps(team)  # plain data


def test_team_page_escapes_names(tmp_path: Path) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(2))
    with serving(str(pairs), "--dir", str(tmp_path / "s")) as (url, _):
        label(url, "a@b.c-d_e", "first")
        _, page = call(url, "/team")
        assert "<td>a@b.c-d_e</td>" in page and "<script" not in page.lower()


def test_a_session_with_invites_may_listen_on_the_network_without_a_shared_token(tmp_path: Path) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl", plain_pairs(2))
    folder = tmp_path / "session"
    refused = run_cli("label", "serve", str(pairs), "--dir", str(folder), "--host", "0.0.0.0", "--port", "0")
    assert refused.returncode == 2 and "invite" in refused.stderr  # nobody needs a link yet: refused
    token = invite(folder, "ann")
    with serving("--dir", str(folder), "--host", "0.0.0.0") as (url, _):
        assert "?token=" not in url  # each person has their own link
        assert next_pair(url, None)[0] == 401
        label(url, None, headers={"X-Label-Token": token})
