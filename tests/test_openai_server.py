"""The fake OpenAI-compatible server, exercised through the real ``openai`` client over real sockets."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from alpacafarm.testing.openai_server import FakeOpenAIServer, Fault, prefer_first_responder, request_text

API_KEY = "sk-test-123"
MESSAGES = [{"role": "system", "content": "You judge."}, {"role": "user", "content": "## Pair 1\nA\n## Pair 2\nB"}]


def echo_responder(body: dict) -> str:
    return f"echo: {request_text(body)}"


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    srv = FakeOpenAIServer(echo_responder, model_prefix="fake-").start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server: FakeOpenAIServer) -> Iterator[OpenAI]:
    with OpenAI(api_key=API_KEY, base_url=server.base_url, max_retries=0, timeout=5.0) as c:
        yield c


def chat(client: OpenAI, **kwargs: object) -> str | None:
    return client.chat.completions.create(model="gpt-x", messages=MESSAGES, **kwargs).choices[0].message.content


def test_chat_completion_answer_usage_and_record(server: FakeOpenAIServer, client: OpenAI) -> None:
    response = client.chat.completions.create(model="gpt-x", messages=MESSAGES)
    assert response.choices[0].message.content == "echo: ## Pair 1\nA\n## Pair 2\nB"
    assert response.choices[0].finish_reason == "stop"
    assert response.object == "chat.completion" and response.model == "fake-gpt-x" and response.id
    assert response.usage is not None
    assert response.usage.completion_tokens == 8  # ceil(29 characters / 4)
    assert response.usage.prompt_tokens == 9  # ceil(len("You judge. ## Pair 1\nA\n## Pair 2\nB") / 4)
    assert response.usage.total_tokens == 17
    (record,) = server.requests
    assert record.path == "/v1/chat/completions" and record.status == 200 and record.completed
    assert record.body["messages"] == MESSAGES and record.body["model"] == "gpt-x"
    assert record.headers["authorization"] == f"Bearer {API_KEY}"
    assert server.seen_api_keys() == {API_KEY}


def test_completions_endpoint_and_default_responder() -> None:
    with FakeOpenAIServer() as server, OpenAI(api_key=API_KEY, base_url=server.base_url, max_retries=0) as client:
        response = client.completions.create(model="m", prompt="# Pair 1\nx\n# Pair 2\ny\n# Pair 3\nz")
        assert response.choices[0].text == "Pair 1: 1\nPair 2: 1\nPair 3: 1"
        assert response.object == "text_completion" and response.usage is not None
        assert response.usage.prompt_tokens == 8 and response.usage.completion_tokens == 8  # 32 and 29 chars
        explicit = client.completions.create(model="m", prompt="pair 1", extra_body={"metadata": {"n_pairs": 2}})
        assert explicit.choices[0].text == "Pair 1: 1\nPair 2: 1"
        assert server.answered() == 2


def test_prefer_first_responder_counts_pairs() -> None:
    assert prefer_first_responder({"prompt": "no pairs here"}) == "Pair 1: 1"
    assert prefer_first_responder({"prompt": "compare pair 1 with pair 2 (see pair 2)"}) == "Pair 1: 1\nPair 2: 1"
    assert prefer_first_responder({"messages": MESSAGES, "metadata": {"n_pairs": "3"}}).count("\n") == 2


def test_chat_logprobs_parse(client: OpenAI) -> None:
    response = client.chat.completions.create(model="m", messages=MESSAGES, logprobs=True, top_logprobs=3)
    content = response.choices[0].message.content
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.content
    assert "".join(t.token for t in logprobs.content) == content
    for token in logprobs.content:
        assert token.logprob < 0 and bytes(token.bytes or []) == token.token.encode()
        assert len(token.top_logprobs) == 3 and token.top_logprobs[0].token == token.token
    digit = next(t for t in logprobs.content if t.token == " 1")
    assert [t.token for t in digit.top_logprobs] == [" 1", " 2", " 0"]


def test_completion_logprobs_parse(client: OpenAI) -> None:
    response = client.completions.create(model="m", prompt="Pair 1", logprobs=2)
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.top_logprobs and logprobs.text_offset
    assert "".join(logprobs.tokens) == response.choices[0].text == "echo: Pair 1"
    assert len(logprobs.token_logprobs or []) == len(logprobs.tokens) == len(logprobs.top_logprobs)
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


def test_rate_limit_carries_retry_after(server: FakeOpenAIServer, client: OpenAI) -> None:
    server.script(Fault("429", retry_after=1.5))
    with pytest.raises(openai.RateLimitError) as caught:
        chat(client)
    assert caught.value.response.headers["retry-after"] == "1.5"
    assert caught.value.status_code == 429 and caught.value.code == "rate_limit_exceeded"
    assert server.requests[0].status == 429 and server.answered() == 0


@pytest.mark.parametrize("kind", ["500", "503"])
def test_server_errors(server: FakeOpenAIServer, client: OpenAI, kind: str) -> None:
    server.script(Fault(kind))  # type: ignore[arg-type]
    with pytest.raises(openai.InternalServerError) as caught:
        chat(client)
    assert caught.value.status_code == int(kind)


def test_hang_times_out_and_stop_does_not_wait(server: FakeOpenAIServer) -> None:
    server.script(Fault("hang", seconds=2))
    with OpenAI(api_key=API_KEY, base_url=server.base_url, max_retries=0, timeout=0.5) as client:
        started = time.monotonic()
        with pytest.raises(openai.APITimeoutError):
            chat(client)
        assert time.monotonic() - started < 1.5
        assert chat(client) == "echo: ## Pair 1\nA\n## Pair 2\nB"  # the hung handler does not block others
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 1.0
    assert [r.status for r in server.requests] == [0, 200]  # the hung request was dropped, never answered
    assert server.answered() == 1


def test_garbage_body_raises_json_decode_error(server: FakeOpenAIServer, client: OpenAI) -> None:
    server.script(Fault("garbage"))
    with pytest.raises(json.JSONDecodeError):  # the openai client lets the decoder's error through
        chat(client)
    assert server.requests[0].status == 200 and server.answered() == 0


def test_close_raises_connection_error(server: FakeOpenAIServer, client: OpenAI) -> None:
    server.script(Fault("close"))
    with pytest.raises(openai.APIConnectionError) as caught:
        chat(client)
    assert not isinstance(caught.value, openai.APITimeoutError)
    assert server.requests[0].status == 0


def test_script_order_then_responder_resumes(server: FakeOpenAIServer, client: OpenAI) -> None:
    server.script(Fault("500"), None, Fault("429"))
    outcomes = []
    for _ in range(4):
        try:
            outcomes.append(chat(client))
        except openai.APIStatusError as error:
            outcomes.append(error.status_code)
    normal = "echo: ## Pair 1\nA\n## Pair 2\nB"
    assert outcomes == [500, normal, 429, normal]
    assert server.answered() == 2 and len(server.requests) == 4


def test_responder_may_return_faults() -> None:
    calls: list[dict] = []

    def flaky(body: dict) -> str | Fault:
        calls.append(body)
        return Fault("429", retry_after=2) if len(calls) == 1 else "ok"

    with FakeOpenAIServer(flaky) as server, OpenAI(api_key=API_KEY, base_url=server.base_url, max_retries=0) as c:
        with pytest.raises(openai.RateLimitError):
            chat(c)
        assert chat(c) == "ok"
        assert server.answered() == 1


def test_concurrent_async_requests_and_runtime_latency(server: FakeOpenAIServer) -> None:
    server.latency_s = 0.2

    async def main() -> list[str | None]:
        async with AsyncOpenAI(api_key=API_KEY, base_url=server.base_url, max_retries=0, timeout=10) as client:
            async def one(i: int) -> str | None:
                messages = [{"role": "user", "content": f"request {i}"}]
                response = await client.chat.completions.create(model="m", messages=messages)
                return response.choices[0].message.content

            return await asyncio.gather(*(one(i) for i in range(64)))

    started = time.monotonic()
    answers = asyncio.run(main())
    elapsed = time.monotonic() - started
    assert answers == [f"echo: request {i}" for i in range(64)]
    assert elapsed < 3.0, f"64 requests of 0.2 s took {elapsed:.2f} s: the server is not concurrent"
    assert elapsed >= 0.2
    assert server.answered() == 64 and server.seen_api_keys() == {API_KEY}


def test_async_client_faults(server: FakeOpenAIServer) -> None:
    server.script(Fault("429", retry_after=3), Fault("close"))

    async def main() -> None:
        async with AsyncOpenAI(api_key=API_KEY, base_url=server.base_url, max_retries=0, timeout=5) as client:
            with pytest.raises(openai.RateLimitError) as caught:
                await client.chat.completions.create(model="m", messages=MESSAGES)
            assert caught.value.response.headers["retry-after"] == "3"
            with pytest.raises(openai.APIConnectionError):
                await client.chat.completions.create(model="m", messages=MESSAGES)

    asyncio.run(main())
    assert server.answered() == 0


def test_models_and_unknown_path(server: FakeOpenAIServer, client: OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["fake-fake-model"]
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"{server.base_url}/nowhere", timeout=5)
    assert caught.value.code == 404
    error = json.loads(caught.value.read())["error"]
    assert set(error) >= {"message", "type", "code"}
    caught.value.close()
    assert server.answered() == 0 and server.seen_api_keys() == {API_KEY}  # urllib sent no key


def test_base_url_needs_start() -> None:
    server = FakeOpenAIServer()
    with pytest.raises(RuntimeError):
        _ = server.base_url
    server.stop()  # stopping a server that never started is harmless


# ------------------------------------------------------------------------ the OpenAI generation backend

GEN_RECORDS = [{"instruction": "Add 2 and 3."}, {"instruction": "Translate", "input": "hola"}]


def _backend(server: FakeOpenAIServer, prompt_format: str, **options: object):
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import ModelSpec

    # "served-model" is no local folder and no hub model: nothing can load its tokenizer here
    spec = ModelSpec(name="served-model", prompt_format=prompt_format)
    return get_registry().create("generation_backend", "openai", {"base_url": server.base_url, **options},
                                 spec=spec, model_path="served-model")


def test_chat_models_are_asked_through_chat_completions_without_a_tokenizer():
    from alpacafarm.generation import SamplingConfig, generate_records

    with FakeOpenAIServer(lambda body: f"re: {request_text(body)}") as server:
        backend = _backend(server, "chat_template")
        rows = generate_records(backend, GEN_RECORDS, SamplingConfig(n=2, max_new_tokens=5, temperature=0.7))
    assert [(r["instruction"], r["sample_index"], r["output"]) for r in rows] == [
        ("Add 2 and 3.", 0, "re: Add 2 and 3."), ("Add 2 and 3.", 1, "re: Add 2 and 3."),
        ("Translate", 0, "re: Translate\n\nhola"), ("Translate", 1, "re: Translate\n\nhola")]
    assert {r.path for r in server.requests} == {"/v1/chat/completions"}
    bodies = sorted((r.body for r in server.requests), key=lambda b: b["messages"][0]["content"])
    assert [b["messages"] for b in bodies] == [[{"role": "user", "content": "Add 2 and 3."}],
                                               [{"role": "user", "content": "Translate\n\nhola"}]]
    assert all(b["n"] == 2 and b["max_tokens"] == 5 and b["model"] == "served-model" for b in bodies)
    assert backend.last_finished == [[True, True], [True, True]]


def test_endpoint_option_overrides_the_model_blocks_format():
    from alpacafarm.generation import SamplingConfig, generate_records

    with FakeOpenAIServer(lambda body: "ok") as server:
        generate_records(_backend(server, "alpaca", endpoint="chat"), GEN_RECORDS[:1], SamplingConfig())
        generate_records(_backend(server, "alpaca"), GEN_RECORDS[:1], SamplingConfig())
    chat, completion = server.requests
    assert chat.path == "/v1/chat/completions" and completion.path == "/v1/completions"
    prompt = completion.body["prompt"]
    assert prompt.startswith("Below is an instruction") and "Add 2 and 3." in prompt


@pytest.mark.parametrize("prompt_format", ["chat_template", "alpaca"])
def test_n_samples_are_guaranteed_when_the_server_ignores_n(prompt_format: str):
    from annotator_server import FewChoicesServer

    from alpacafarm.generation import SamplingConfig, generate_records

    with FewChoicesServer(lambda body: f"sample seed {body['seed']}") as server:
        backend = _backend(server, prompt_format)
        rows = generate_records(backend, GEN_RECORDS, SamplingConfig(n=3, max_new_tokens=4, seed=5))
    by_instruction = {}
    for row in rows:
        by_instruction.setdefault(row["instruction"], []).append(row)
    assert {k: [r["sample_index"] for r in v] for k, v in by_instruction.items()} == {
        "Add 2 and 3.": [0, 1, 2], "Translate": [0, 1, 2]}
    assert len(server.requests) == 6 and sorted(r.body["n"] for r in server.requests) == [1, 1, 2, 2, 3, 3]
    for samples in by_instruction.values():  # each extra request samples with a seed of its own
        assert len({r["output"] for r in samples}) == 3
    assert [len(f) for f in backend.last_finished] == [3, 3]


def test_a_server_that_returns_no_choices_is_one_line(monkeypatch):
    from annotator_server import FewChoicesServer

    from alpacafarm.errors import UserError
    from alpacafarm.generation import SamplingConfig

    class NoChoices(FewChoicesServer):
        def _completion(self, path: str, body: dict, text: str) -> dict:
            return {**super()._completion(path, body, text), "choices": []}

    with NoChoices(lambda body: "x") as server:
        backend = _backend(server, "chat_template")
        with pytest.raises(UserError, match=r"0 of n=2 samples after 4 requests"):
            backend.generate(["hi"], SamplingConfig(n=2))
