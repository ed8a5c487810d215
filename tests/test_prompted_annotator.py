"""The prompted API annotator against a real HTTP server on 127.0.0.1: batching, parsing, caching, faults, budget."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from annotator_server import TAG, TagResponder, tagged_pairs

from alpacafarm.annotation_cache import AnnotationCache
from alpacafarm.testing.openai_server import FakeOpenAIServer, Fault, request_text
from alpacafarm.types import Pair
from alpacafarm_annotators.config import Price, PromptedAnnotatorConfig
from alpacafarm_annotators.endpoint_requests import BudgetExceeded
from alpacafarm_annotators.prompted import PromptedAnnotator

KEY = "sk-test-0123456789abcdefghijklmnop"


@pytest.fixture
def server():
    responder = TagResponder()
    with FakeOpenAIServer(responder) as running:
        running.responder_state = responder
        yield running


@pytest.fixture
def cache(tmp_path: Path) -> AnnotationCache:
    return AnnotationCache(tmp_path / "annotations.sqlite")


def annotator(server: FakeOpenAIServer, cache: AnnotationCache, monkeypatch, **overrides) -> PromptedAnnotator:
    monkeypatch.setenv("TEST_JUDGE_KEY", KEY)
    config = {"model": "gpt-4-0314", "template": "ranking", "batch_size": 5, "base_url": server.base_url,
              "api_key_env": "TEST_JUDGE_KEY", "model_map": {"gpt-4-0314": "judge-model"}, "max_retries": 8,
              "retry_backoff_s": 0.05, "timeout_s": 5.0, "price": {"input": 10.0, "output": 30.0}, **overrides}
    return PromptedAnnotator(PromptedAnnotatorConfig(**config), "test_judge", cache=cache)


def completions(server: FakeOpenAIServer) -> int:
    return sum(1 for r in server.requests if r.completed)


def test_batches_are_labelled_correctly_and_costed(server, cache, monkeypatch):
    pairs, labels = tagged_pairs(23)
    annotations = annotator(server, cache, monkeypatch).annotate(pairs)
    assert [a.preference for a in annotations] == labels
    assert completions(server) == 5 == len(server.requests)  # ceil(23 / 5) requests, no more
    assert {r.body["model"] for r in server.requests} == {"judge-model"}  # the model map was applied
    assert server.seen_api_keys() == {KEY}
    assert all(a.tokens_in > 0 and a.price_usd > 0 and not a.cached for a in annotations)
    ledger = cache.ledger()
    assert ledger.requests == 5 and ledger.price_usd == pytest.approx(sum(a.price_usd for a in annotations))


def test_cached_pairs_are_never_paid_twice(server, cache, monkeypatch):
    pairs, labels = tagged_pairs(12)
    annotator(server, cache, monkeypatch).annotate(pairs[:7])
    assert completions(server) == 2
    again = annotator(server, cache, monkeypatch).annotate(pairs)
    assert [a.preference for a in again] == labels
    assert [a.cached for a in again] == [True] * 7 + [False] * 5
    assert completions(server) == 3 and cache.ledger().requests == 3


def test_identical_outputs_are_ties_without_a_request(server, cache, monkeypatch):
    annotations = annotator(server, cache, monkeypatch).annotate([Pair("q", "same answer", "same answer")])
    assert annotations[0].preference == 0 and server.requests == []


def test_a_wrong_answer_count_is_asked_again_once(server, cache, monkeypatch):
    pairs, labels = tagged_pairs(5)
    server.responder_state.wrong_count_left = 1
    annotations = annotator(server, cache, monkeypatch).annotate(pairs)
    assert [a.preference for a in annotations] == labels
    assert len(server.requests) == 2 and cache.ledger().requests == 2  # one ledger row per paid completion
    prompt_tokens = [r.body for r in server.requests]
    assert prompt_tokens[0] == prompt_tokens[1]  # the same prompt, asked again
    # both attempts billed
    assert cache.ledger().tokens_in == pytest.approx(sum(a.tokens_in for a in annotations), abs=5)


def test_an_unreadable_batch_is_asked_pair_by_pair_and_only_an_unreadable_pair_is_given_up(server, cache,
                                                                                           monkeypatch):
    pairs, _ = tagged_pairs(5)
    server.responder_state.always_wrong_count = True  # every answer has one line too many or too few
    annotations = annotator(server, cache, monkeypatch).annotate(pairs)
    assert [a.preference for a in annotations] == [None] * 5 and {a.outcome for a in annotations} == {"unparsed"}
    assert len(server.requests) == 2 + 5 * 2  # the batch, asked once more, then each pair alone, twice
    assert cache.ledger().requests == 12  # every paid completion is in the ledger
    again = annotator(server, cache, monkeypatch).annotate(pairs)  # reask_unparsed=1: asked once more, as before
    assert len(server.requests) == 12 + 12 and all(a.outcome == "unparsed" for a in again)
    final = annotator(server, cache, monkeypatch).annotate(pairs)
    assert len(server.requests) == 24  # then each pair's own unreadable answers are cached for good
    assert all(a.cached and a.outcome == "unparsed" for a in final)


def test_faults_are_retried_and_no_pair_is_lost_or_paid_twice(server, cache, monkeypatch):
    pairs, labels = tagged_pairs(20)
    server.script(Fault("429", retry_after=0.3), Fault("500"), Fault("garbage"), Fault("close"),
                  Fault("hang", seconds=30), Fault("503"))
    started = time.monotonic()
    annotations = annotator(server, cache, monkeypatch, batch_size=4, max_concurrency=1, timeout_s=0.5).annotate(pairs)
    assert [a.preference for a in annotations] == labels
    assert completions(server) == 5  # five batches, each answered once (the garbage 200 is not a completion)
    assert cache.ledger().requests == 5
    assert time.monotonic() - started >= 0.3


def test_retry_after_is_honoured(server, cache, monkeypatch):
    pairs, labels = tagged_pairs(1)
    server.script(Fault("429", retry_after=1.2))
    annotations = annotator(server, cache, monkeypatch).annotate(pairs)
    assert [a.preference for a in annotations] == labels
    first, second = server.requests
    assert second.time - first.time >= 1.2


def test_requests_that_keep_failing_leave_pairs_unlabelled_and_uncached(server, cache, monkeypatch):
    pairs, labels = tagged_pairs(2)
    server.script(*[Fault("500")] * 3)
    annotations = annotator(server, cache, monkeypatch, batch_size=2, max_retries=2).annotate(pairs)
    assert ([a.preference for a in annotations] == [None, None]
            and "InternalServerError" in annotations[0].metadata["error"])
    assert cache.ledger().requests == 0
    assert [a.preference for a in annotator(server, cache, monkeypatch, batch_size=2).annotate(pairs)] == labels


def test_budget_cap_stops_before_it_is_exceeded(server, cache, monkeypatch):
    pairs, _ = tagged_pairs(30)
    judge = annotator(server, cache, monkeypatch, batch_size=1, max_concurrency=1, max_cost_usd=0.5,
                      price=Price(input=100.0, output=100.0))
    with pytest.raises(BudgetExceeded, match=r"max_cost_usd=0\.5000.*pairs annotated"):
        judge.annotate(pairs)
    spent = cache.ledger().price_usd
    assert 0 < spent <= 0.5
    assert 0 < completions(server) < 30


def test_rate_limit_spaces_requests(server, cache, monkeypatch):
    pairs, _ = tagged_pairs(4)
    annotator(server, cache, monkeypatch, batch_size=1, requests_per_minute=300).annotate(pairs)  # one per 0.2 s
    times = sorted(r.time for r in server.requests)
    assert times[-1] - times[0] >= 3 * 0.2 * 0.9


def test_a_refused_key_is_a_clear_error(server, cache, monkeypatch):
    judge = annotator(server, cache, monkeypatch, base_url=None)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("TEST_JUDGE_KEY")
    from alpacafarm.errors import UserError

    with pytest.raises(UserError, match=r"set \$TEST_JUDGE_KEY"):
        judge.annotate(tagged_pairs(1)[0])


# --- replicates: independent repeats of the same annotation -------------------------------------------------------


class SeededResponder:
    """A stochastic judge, as an endpoint sampling at temperature 1 with a seed: a request without a ``seed`` gets
    the right answers; a request with one gets answers drawn from that seed (the same seed, the same answers)."""

    def __call__(self, body: dict) -> str:
        shown: list[tuple[str, str]] = []  # pair tags in the order shown, the first shown output's side for each
        for pair_id, side in TAG.findall(request_text(body)):
            if pair_id not in {p for p, _ in shown}:
                shown.append((pair_id, side))
        rng = random.Random(body["seed"]) if "seed" in body else None
        answers = [rng.choice((1, 2)) if rng else (1 if side == "good" else 2) for _, side in shown]
        return "\n".join(f"Pair {k}: {c}" for k, c in enumerate(answers, start=1))


def test_replicates_differ_for_a_stochastic_judge_and_each_is_paid_once(cache, monkeypatch):
    pairs, labels = tagged_pairs(20)
    with FakeOpenAIServer(SeededResponder()) as server:
        judge = annotator(server, cache, monkeypatch)
        zero = [a.preference for a in judge.annotate(pairs)]
        assert zero == labels and all("seed" not in r.body for r in server.requests)  # replicate 0: as before
        one = [a.preference for a in judge.annotate(pairs, replicate=1)]
        two = [a.preference for a in judge.annotate(pairs, replicate=2)]
        assert completions(server) == 12 and cache.ledger().requests == 12  # 4 batches per replicate
        seeds = [r.body["seed"] for r in server.requests[4:]]
        assert len(set(seeds)) == 8  # one seed per batch and replicate
        assert one != zero and two != zero and one != two  # independent draws of a stochastic judge
        # a second call (a fresh annotator on the same cache) is served from the cache: no new request
        fresh = annotator(server, cache, monkeypatch)
        again = {k: fresh.annotate(pairs, replicate=k) for k in (0, 1, 2)}
        assert [[a.preference for a in again[k]] for k in (0, 1, 2)] == [zero, one, two]
        assert all(a.cached for k in again for a in again[k]) and completions(server) == 12
    # the replicate's seed is reproducible: another cache, the same answers from a seed-honouring endpoint
    with FakeOpenAIServer(SeededResponder()) as server:
        other = AnnotationCache(cache.path.with_name("other.sqlite"))
        assert [a.preference for a in annotator(server, other, monkeypatch).annotate(pairs, replicate=1)] == one


def test_a_configured_seed_is_sent_unchanged_for_replicate_zero_and_derived_for_k(server, cache, monkeypatch):
    judge = annotator(server, cache, monkeypatch, decoding={"temperature": 1.0, "max_tokens": 100, "seed": 7})
    assert judge.decoding() == judge.decoding(0) == {"temperature": 1.0, "max_tokens": 100, "seed": 7}
    derived = {judge.decoding(k, attempt, ["key"])["seed"] for k in (1, 2) for attempt in (0, 1)}
    assert len(derived) == 4 and 7 not in derived  # per replicate and per attempt (a re-ask samples afresh)


def test_a_pair_given_twice_is_requested_once_and_copied(server, cache, monkeypatch):
    pairs, labels = tagged_pairs(5)
    annotations = annotator(server, cache, monkeypatch).annotate([*pairs, pairs[0], pairs[3]])
    assert [a.preference for a in annotations] == [*labels, labels[0], labels[3]]
    assert completions(server) == 1  # one batch of the 5 distinct pairs
    assert annotations[5] is not annotations[0] and annotations[5].cached and not annotations[0].cached
