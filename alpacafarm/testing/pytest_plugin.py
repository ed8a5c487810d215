"""pytest plugin: an offline environment and fixtures for alpacafarm and its plugins.

Enabled in this repository through ``addopts = "-p alpacafarm.testing.pytest_plugin"``; a third-party plugin
package can do the same. It sets the Hugging Face offline variables and a temporary ``HF_HOME`` before any test
imports transformers (a hub ID then fails at once instead of retrying for ~47 s), points
``ALPACAFARM_CACHE_DIR`` at a session temporary directory unless the caller set one, and provides fixtures.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from alpacafarm.testing import offline_environment

_session_tmp = tempfile.TemporaryDirectory(prefix="alpacafarm-tests-")


def pytest_configure(config: pytest.Config) -> None:
    root = Path(_session_tmp.name)
    os.environ.update(offline_environment(root / "hf_home"))
    os.environ.setdefault("ALPACAFARM_CACHE_DIR", str(root / "cache"))
    os.environ.update(worker_threads(getattr(config, "workerinput", None), os.cpu_count() or 1, os.environ))


def worker_threads(workerinput: dict[str, Any] | None, cpus: int, environ: Mapping[str, str]) -> dict[str, str]:
    """Thread variables for a pytest-xdist worker: the cores shared out between the workers (at least one each).

    Two workers that each run torch with every core's thread oversubscribe the machine, and OpenMP threads that
    spin-wait for a busy core make a tiny model train many times slower. Set before torch loads (this runs in
    ``pytest_configure``, and the test processes a worker starts inherit it). Nothing outside xdist, and nothing
    when the caller set ``OMP_NUM_THREADS`` itself."""
    if workerinput is None or "OMP_NUM_THREADS" in environ:
        return {}
    threads = str(max(1, cpus // max(1, int(workerinput.get("workercount", 1)))))
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def pytest_unconfigure(config: pytest.Config) -> None:
    _session_tmp.cleanup()


@pytest.fixture
def register_test_plugin() -> Iterator[Callable[[Any, str], None]]:
    """Register in-process plugin objects for one test; they are always unregistered afterwards."""
    from alpacafarm.plugins import register_plugin, unregister_plugin

    names: list[str] = []

    def register(plugin: Any, name: str) -> None:
        names.append(name)
        register_plugin(plugin, name)

    try:
        yield register
    finally:
        for name in names:
            unregister_plugin(name)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models train many times slower with two threads when another process competes for the two cores.

    Module-scoped, so module fixtures that train can use it: ``pytestmark = pytest.mark.usefixtures(...)``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def generated_prompts(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The prompt token ids (padding dropped) of every transformers ``generate`` call made during the test."""
    from transformers.generation.utils import GenerationMixin

    prompts: list[list[int]] = []
    real = GenerationMixin.generate

    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        prompts.extend(row[keep.bool()].tolist() for row, keep in zip(ids, mask, strict=True))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", generate)
    return prompts


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A saved tiny random-init causal LM + tokenizer folder, shared by the session (read-only)."""
    from alpacafarm.testing import save_tiny_causal_lm

    return save_tiny_causal_lm(tmp_path_factory.mktemp("tiny-model"))
