"""A provider's impossible numbers (issue 61, cases 1 and 3): one check of ``usage`` for the live and the batch path
(:mod:`alpacafarm_annotators.provider_numbers`), against a real local server whose usage is wrong: a clear line
naming the field and the pair, the answer kept and priced by the judge's own upper bound, never bought twice, and
the budget holds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from annotator_server import TagResponder, tagged_pairs
from batch_fault_server import FaultyBatchServer
from conftest import run_cli
from test_annotation_reliability import cache_of, write_pairs
from test_batch_annotation import judge as batch_judge

from alpacafarm.annotation_cache import AnnotationCache
from alpacafarm_annotators.provider_numbers import MAX_REPORTED_TOKENS, read_usage

KEY = "local-numbers-token-3Vb7Qe1Lp9Xs"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"OPENAI_API_KEY": KEY, "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "400"}


@pytest.mark.parametrize(("value", "problem"), [
    ("lots", "is not a number"), (True, "is not a number"), ("12", "is not a number"), (None, "is missing"),
    (-1, "is negative"), (-1e6, "is negative"), (1.5, "is not a whole number"), (math.nan, "is not a whole number"),
    (math.inf, "is not a whole number"), (1e9, "is more than any request can use"),
    (MAX_REPORTED_TOKENS + 1, "is more than any request can use")])
def test_a_usage_field_that_is_not_a_believable_count_is_named(value, problem):
    reading = read_usage({"prompt_tokens": value, "completion_tokens": 7})
    assert not reading.believable and (reading.tokens_in, reading.tokens_out) == (0, 0)
    (found,) = reading.problems
    assert found.startswith("usage.prompt_tokens") and problem in found


def test_believable_counts_are_read_as_they_are():
    assert (read_usage({"prompt_tokens": 12, "completion_tokens": 3.0}).tokens_in, read_usage(
        {"prompt_tokens": 12, "completion_tokens": 3.0}).tokens_out) == (12, 3)
    assert read_usage(None).reported is False and read_usage(None).problems == []
    assert read_usage("lots").problems == ["usage='lots' is not an object"]


def _annotate(source: Path, out: Path, url: str, env: dict[str, str], *extra: str):
    return run_cli("annotate", str(source), "--annotator", "gpt4_b1_noex", "--base-url", url, "-o", str(out),
                   "--set", "retry_backoff_s=0.01", *extra, env=env)


# ------------------------------------------------------------------------------------------ case 1: not a number
def test_non_numeric_usage_in_live_mode_keeps_the_paid_answers_and_a_rerun_pays_nothing(tmp_path: Path, env):
    pairs, labels = tagged_pairs(4)
    source = write_pairs(tmp_path / "p.jsonl", pairs)
    with FaultyBatchServer(TagResponder(), usage={"prompt_tokens": "lots"}) as server:
        first = _annotate(source, tmp_path / "a.json", server.base_url, env)
        assert first.returncode == 0 and "Traceback" not in first.stderr, first.stderr
        sent = len(server.requests)
        again = _annotate(source, tmp_path / "b.json", server.base_url, env)
        assert again.returncode == 0, again.stderr
        assert len(server.requests) == sent == 4  # every answer was kept: the re-run is served from the cache
    named = [line for line in first.stderr.splitlines() if "usage.prompt_tokens='lots' is not a number" in line]
    assert len(named) == 4 and all("for pair " in line and "Question" in line for line in named), first.stderr
    assert [r["preference"] for r in json.loads((tmp_path / "b.json").read_text())] == labels
    ledger = cache_of(env).ledger()  # priced by the judge's upper bound: more than 0, and honest
    assert ledger.requests == 4 and ledger.tokens_in > 0 and ledger.price_usd > 0
    assert KEY not in first.stderr + first.stdout


def test_non_numeric_usage_in_batch_mode_keeps_the_answered_lines(tmp_path: Path, monkeypatch, caplog):
    pairs, labels = tagged_pairs(4)
    cache = AnnotationCache(tmp_path / "c.sqlite")
    with FaultyBatchServer(TagResponder(), usage={"prompt_tokens": "lots", "completion_tokens": True}) as server:
        annotations = batch_judge(server, cache, monkeypatch, batch_size=1).annotate(pairs)
        assert [a.preference for a in annotations] == labels
        assert server.created == 1 and set(server.executions.values()) == {1}  # nothing thrown away, re-sent
    assert "usage.prompt_tokens='lots' is not a number; usage.completion_tokens=True is not a number" in caplog.text
    ledger = cache.ledger()
    assert ledger.requests == 4 and ledger.tokens_in > 0 and ledger.price_usd > 0  # the prompt's bound, kept


# ------------------------------------------------------------------------------------------ case 3: impossible
@pytest.mark.parametrize("tokens", [-1e6, -1], ids=["minus-a-million", "minus-one"])
def test_negative_usage_cannot_buy_past_the_budget(tmp_path: Path, env, tokens: float):
    pairs, _ = tagged_pairs(8)
    source = write_pairs(tmp_path / "p.jsonl", pairs)
    with FaultyBatchServer(TagResponder(), usage={"prompt_tokens": tokens, "completion_tokens": tokens}) as server:
        result = _annotate(source, tmp_path / "a.json", server.base_url, env, "--max-cost-usd", "0.03",
                           "--set", "max_concurrency=1")
        answered = server.answered()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "max_cost_usd=0.0300" in errors[0]
    ledger = cache_of(env).ledger()
    assert 0 < ledger.price_usd <= 0.03 and ledger.requests == answered < 8
    assert "is negative" in result.stderr


def test_a_billion_tokens_is_not_booked(tmp_path: Path, env):
    pairs, labels = tagged_pairs(3)
    source = write_pairs(tmp_path / "p.jsonl", pairs)
    with FaultyBatchServer(TagResponder(), usage={"completion_tokens": 1e9}) as server:
        result = _annotate(source, tmp_path / "a.json", server.base_url, env)
    assert result.returncode == 0, result.stderr
    assert "usage.completion_tokens=1000000000 is more than any request can use" in result.stderr
    ledger = cache_of(env).ledger()
    assert ledger.requests == 3 and ledger.price_usd < 1.0  # the upper bound of three short requests, not $90,000
    assert [r["preference"] for r in json.loads((tmp_path / "a.json").read_text())] == labels


def test_a_usage_field_that_echoes_the_key_is_named_without_it(tmp_path: Path, env):
    pairs, labels = tagged_pairs(2)
    source = write_pairs(tmp_path / "p.jsonl", pairs)
    with FaultyBatchServer(TagResponder(), usage={"prompt_tokens": KEY}) as server:
        result = _annotate(source, tmp_path / "a.json", server.base_url, env)
    assert result.returncode == 0, result.stderr
    assert "usage.prompt_tokens=" in result.stderr and "is not a number" in result.stderr
    assert KEY not in result.stdout + result.stderr
    assert not any(KEY.encode() in f.read_bytes() for f in Path(env["ALPACAFARM_CACHE_DIR"]).iterdir())
    assert [r["preference"] for r in json.loads((tmp_path / "a.json").read_text())] == labels
