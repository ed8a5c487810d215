"""Generation backends. Each is a callable ``(config: dict, spec: ModelSpec, model_path: str) -> Generator``."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Sequence
from typing import Any

from alpacafarm.errors import MissingPackageError, UserError
from alpacafarm.generation import GenerationProgress, Generator, SamplingConfig, TransformersGenerator


def transformers_backend(config: dict[str, Any], spec: Any, model_path: str) -> Generator:
    if config:
        raise UserError(f"the transformers backend takes no options (got {', '.join(config)})")
    return TransformersGenerator.from_spec(spec, model_path)


class OpenAIGenerator(Generator):
    """Completions from an OpenAI-compatible server that serves the model (``vllm serve``, ``llama-server``, TGI).

    Config: ``base_url`` (required), ``model`` (default: the model path), ``api_key_env``, ``max_concurrency``.
    """

    def __init__(self, config: dict[str, Any], spec: Any = None, model_path: str | None = None) -> None:
        unknown = set(config) - {"base_url", "model", "api_key_env", "max_concurrency", "timeout_s"}
        if unknown or "base_url" not in config:
            raise UserError(f"openai backend: needs base_url; unknown options: {', '.join(sorted(unknown)) or 'none'}")
        self.base_url = config["base_url"]
        self.model = config.get("model") or model_path
        self.api_key = os.environ.get(config.get("api_key_env") or "OPENAI_API_KEY") or "not-needed"
        self.max_concurrency = int(config.get("max_concurrency", 16))
        self.timeout_s = float(config.get("timeout_s", 300))

    def generate(self, prompts: Sequence[str], sampling: SamplingConfig,
                 progress: GenerationProgress | None = None) -> list[list[str]]:
        return asyncio.run(self._generate(list(prompts), sampling, progress))

    async def _generate(self, prompts: list[str], sampling: SamplingConfig,
                        progress: GenerationProgress | None) -> list[list[str]]:
        import openai

        client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=6, timeout=self.timeout_s)
        semaphore = asyncio.Semaphore(self.max_concurrency)

        async def one(index: int, prompt: str) -> list[str]:
            async with semaphore:
                response = await client.completions.create(
                    model=self.model, prompt=prompt, n=sampling.n, max_tokens=sampling.max_new_tokens,
                    temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed + index)
            if progress:
                progress(1)
            return [choice.text.strip() for choice in sorted(response.choices, key=lambda c: c.index)]

        try:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        finally:
            await client.close()


class VLLMGenerator(Generator):
    """vLLM in the same process (GPU). Sampling is seeded per request."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def generate(self, prompts: Sequence[str], sampling: SamplingConfig,
                 progress: GenerationProgress | None = None) -> list[list[str]]:
        from vllm import SamplingParams

        params = SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                max_tokens=sampling.max_new_tokens, seed=sampling.seed)
        outputs = self.llm.generate(list(prompts), params)
        if progress:
            progress(len(prompts))
        return [[o.text.strip() for o in out.outputs] for out in outputs]


def vllm_backend(config: dict[str, Any], spec: Any, model_path: str) -> Generator:
    if importlib.util.find_spec("vllm") is None:
        raise MissingPackageError("the vllm backend needs vLLM: pip install 'alpacafarm[vllm]'")
    from vllm import LLM

    from alpacafarm.models import resolve_model_path

    return VLLMGenerator(LLM(model=resolve_model_path(model_path), seed=0, **config))
