"""A key the server quotes back in any form never reaches a message or a file (issue 41, case 1).

A real local server answers with an error body that echoes the request's key reversed, spaced out, base64- or
URL-encoded, in hex or masked; the key must not appear in any of those forms on the console, in the ``-o`` file,
in ``run.log``, ``error.log`` or a manifest.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from annotator_server import tagged_pairs
from conftest import run_cli
from test_annotation_reliability import write_pairs

from alpacafarm.errors import REDACTED, redact
from alpacafarm.testing.openai_server import FakeOpenAIServer, Fault, echo_forms

#: In no known key format: only redaction of the very key the client holds (and its transforms) can hide it.
KEY = "local-gateway-token-7Qx2Lm9Pz4Kw8Rt1"
FORMS = sorted(echo_forms(KEY))
ALL = "+".join(FORMS)


def leaks(text: str) -> list[str]:
    """The forms of :data:`KEY` found in ``text`` (case-insensitive: hex and spaced forms change case freely)."""
    lowered = text.lower()
    found = [name for name, form in echo_forms(KEY).items() if form.lower() in lowered]
    # pieces long enough to identify the key: a third of it, as is or reversed
    return found + [f"piece {p}" for p in (KEY[5:17], KEY[-12:], KEY[::-1][:12]) if p.lower() in lowered]


@pytest.mark.parametrize("form", FORMS)
def test_each_transform_is_redacted(form: str):
    text = f"Incorrect API key provided: {echo_forms(KEY)[form]}. See the docs."
    cleaned = redact(text, [KEY])
    assert REDACTED in cleaned and not leaks(cleaned), cleaned


@pytest.mark.parametrize("status", [401, 500])
def test_an_echoing_endpoint_leaks_into_no_console_line_or_output_file(tmp_path: Path, status: int):
    env = {"OPENAI_API_KEY": KEY, "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache")}
    pairs, _ = tagged_pairs(2)
    out = tmp_path / "out.json"
    with FakeOpenAIServer(lambda body: Fault("echo_key", status=status, echo=ALL)) as server:
        result = run_cli("annotate", str(write_pairs(tmp_path / "p.jsonl", pairs)), "--annotator", "gpt4_b1_noex",
                         "--base-url", server.base_url, "--set", "max_retries=1", "--set", "retry_backoff_s=0.01",
                         "-o", str(out), env=env)
        assert KEY in server.seen_api_keys()
    assert result.returncode in (1, 2) and "Traceback" not in result.stderr, result.stderr
    assert f"HTTP {status}" in result.stderr + result.stdout  # the summary: status and the provider's code
    files = out.read_text() if out.exists() else ""
    for where, text in (("stdout", result.stdout), ("stderr", result.stderr), ("-o", files)):
        assert not leaks(text), (where, leaks(text), text)


@pytest.mark.slow  # a real online_dpo stage samples before it asks the judge (~20 s)
@pytest.mark.usefixtures("one_torch_thread")
def test_an_online_dpo_run_writes_the_key_into_no_log_or_manifest(tiny_model_dir: str, tmp_path: Path):
    from test_online_dpo import server_recipe

    env = {"OPENAI_API_KEY": KEY, "ALPACAFARM_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    with FakeOpenAIServer(lambda body: Fault("echo_key", status=401, echo=ALL)) as server:
        recipe = server_recipe(tmp_path, tiny_model_dir, server.base_url)
        result = run_cli("run", str(recipe), "--output-dir", str(tmp_path / "run"), env=env)
        assert KEY in server.seen_api_keys()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "HTTP 401 invalid_api_key" in result.stderr
    written = {p: p.read_text(errors="replace") for p in (tmp_path / "run").rglob("*")
               if p.is_file() and p.suffix in (".log", ".json", ".jsonl", ".yaml", "")}
    assert {p.name for p in written} >= {"run.log", "error.log", "manifest.json"}
    for where, text in (("stdout", result.stdout), ("stderr", result.stderr), *written.items()):
        assert not leaks(text), (str(where), leaks(text))
    assert json.loads((tmp_path / "run/stages/odpo/manifest.json").read_text())["status"] != "complete"
