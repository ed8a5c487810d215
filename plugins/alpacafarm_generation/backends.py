"""Generation backends, built by ``Registry.create("generation_backend", name, config, spec=..., model_path=...)``.

Each sets the :class:`~alpacafarm.prompts.PromptFormat` of the model it samples from, so prompt conditioning
saved in a model folder (reward conditioning's control token) reaches the transformers, OpenAI-compatible and
vLLM backends alike.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from alpacafarm.errors import MissingPackageError, UserError
from alpacafarm.generation import GenerationProgress, Generator, SamplingConfig, TransformersGenerator
from alpacafarm.model_sources import resolve_model_path
from alpacafarm.prompts import PromptFormat, user_message
from alpacafarm.seeding import stable_seed


def transformers_backend(config: None, spec: Any, model_path: str) -> Generator:
    """The default backend: batched sampling in this process (takes no options)."""
    return TransformersGenerator.from_spec(spec, model_path)


def prompt_format_for(spec: Any, model_path: str | None) -> PromptFormat:
    """The model's prompt format for a backend that does not load the model here: a chat template needs the
    tokenizer, loaded from the model folder (or hub ID)."""
    tokenizer = None
    if spec.prompt_format == "chat_template":
        from alpacafarm.model_loading import load_tokenizer

        tokenizer = load_tokenizer(spec, model_path)
    location = resolve_model_path(model_path) if model_path else None
    return PromptFormat.for_model(spec.prompt_format, location, tokenizer)


class OpenAIBackendConfig(BaseModel):
    """Where the OpenAI-compatible server is and how hard to drive it."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(description="the server's /v1 URL, e.g. http://127.0.0.1:8000/v1")
    model: str | None = Field(None, description="model name the server serves; default: the model path")
    api_key_env: str = Field("OPENAI_API_KEY", description="environment variable holding the key (local: any)")
    endpoint: Literal["auto", "chat", "completions"] = Field(
        "auto", description="chat: /chat/completions with the instruction as the user message (the server applies "
        "the model's chat template); completions: /completions with the prompt formatted here; auto: chat when the "
        "model block says prompt_format: chat_template")
    max_concurrency: int = Field(16, ge=1)
    timeout_s: float = Field(300.0, gt=0)


class ChatMessageFormat(PromptFormat):
    """The user message of a chat request: the instruction and input merged (the server applies the chat template);
    a folder's ``prompt_prefix`` conditioning goes before it."""

    def __call__(self, instruction: str, input: str | None = None) -> str:
        return self.conditioning.prompt_prefix + user_message(instruction, input or None)


class OpenAIGenerator(Generator):
    """Samples from an OpenAI-compatible server that serves the model (``vllm serve``, llama.cpp's server, TGI).

    Chat models (``prompt_format: chat_template``, or ``endpoint: chat``) are asked through ``/chat/completions``:
    the server applies its chat template, so no tokenizer is needed here. Other models get the prompt formatted
    here through ``/completions``. ``n`` samples are guaranteed per prompt: a server that returns fewer choices than
    asked (llama.cpp's ignores ``n``) is asked again, with a fresh seed each time, for the missing ones.
    """

    config_class = OpenAIBackendConfig
    #: requests per prompt at most (n per request, the rest one by one) before a short answer is an error
    MAX_REQUESTS_PER_SAMPLE = 2

    def __init__(self, config: OpenAIBackendConfig, spec: Any = None, model_path: str | None = None) -> None:
        self.config = config
        self.model = config.model or model_path
        self.api_key = os.environ.get(config.api_key_env) or "not-needed"
        style = getattr(spec, "prompt_format", "alpaca") if spec is not None else "alpaca"
        self.chat = config.endpoint == "chat" or (config.endpoint == "auto" and style == "chat_template")
        if self.chat:
            conditioning = PromptFormat.for_model("alpaca", model_path).conditioning  # a trained folder's, if any
            if conditioning.response_prefix:
                raise UserError(f"backend 'openai': {model_path} was trained behind a response prefix "
                                f"({conditioning.response_prefix!r}), which a chat endpoint cannot continue; use "
                                "endpoint: completions with prompt_format: alpaca")
            self.prompt_format = ChatMessageFormat("chat", None, conditioning)
        elif spec is not None:
            self.prompt_format = prompt_format_for(spec, model_path)

    def generate(self, prompts: Sequence[str], sampling: SamplingConfig,
                 progress: GenerationProgress | None = None) -> list[list[str]]:
        return asyncio.run(self._generate(list(prompts), sampling, progress))

    async def _request(self, client: Any, prompt: str, n: int, sampling: SamplingConfig, seed: int) -> list[Any]:
        """One request's choices as (text, finished) pairs, in the server's order."""
        common = {"model": self.model, "n": n, "max_tokens": sampling.max_new_tokens,
                  "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": seed}
        if self.chat:
            response = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
            choices = sorted(response.choices, key=lambda c: c.index)
            return [((c.message.content or "").strip(), c.finish_reason != "length") for c in choices]
        response = await client.completions.create(prompt=prompt, **common)
        return [(c.text.strip(), c.finish_reason != "length") for c in sorted(response.choices, key=lambda c: c.index)]

    async def _generate(self, prompts: list[str], sampling: SamplingConfig,
                        progress: GenerationProgress | None) -> list[list[str]]:
        import openai

        self.last_finished = []

        client = openai.AsyncOpenAI(base_url=self.config.base_url, api_key=self.api_key, max_retries=6,
                                    timeout=self.config.timeout_s)
        semaphore = asyncio.Semaphore(self.config.max_concurrency)

        async def one(index: int, prompt: str) -> list[Any]:
            samples: list[Any] = []
            attempt = 0
            while len(samples) < sampling.n:
                if attempt >= self.MAX_REQUESTS_PER_SAMPLE * sampling.n:
                    raise UserError(f"backend 'openai' at {self.config.base_url}: {len(samples)} of n={sampling.n} "
                                    f"samples after {attempt} requests for prompt {index} (the server returns no "
                                    "choices)")
                # the first request keeps the old seed; a server that returned fewer choices is asked again
                seed = sampling.seed + index if attempt == 0 else stable_seed(sampling.seed, "sample", index, attempt)
                async with semaphore:
                    samples += await self._request(client, prompt, sampling.n - len(samples), sampling, seed)
                attempt += 1
            if progress:
                progress(1)
            return samples[: sampling.n]

        try:
            groups = list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        finally:
            await client.close()
        self.last_finished = [[finished for _, finished in group] for group in groups]
        return [[text for text, _ in group] for group in groups]


class VLLMBackendConfig(BaseModel):
    """Options passed to ``vllm.LLM`` (any of its keyword arguments; these are the common ones)."""

    model_config = ConfigDict(extra="allow")

    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=1)


class VLLMGenerator(Generator):
    """vLLM in the same process (GPU). Sampling is seeded per request."""

    def __init__(self, llm: Any, prompt_format: PromptFormat | None = None) -> None:
        self.llm = llm
        self.prompt_format = prompt_format or PromptFormat()

    def generate(self, prompts: Sequence[str], sampling: SamplingConfig,
                 progress: GenerationProgress | None = None) -> list[list[str]]:
        from vllm import SamplingParams

        params = SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                max_tokens=sampling.max_new_tokens, seed=sampling.seed)
        outputs = self.llm.generate(list(prompts), params)
        if progress:
            progress(len(prompts))
        self.last_finished = [[o.finish_reason != "length" for o in out.outputs] for out in outputs]
        return [[o.text.strip() for o in out.outputs] for out in outputs]


def vllm_backend(config: VLLMBackendConfig, spec: Any, model_path: str) -> Generator:
    if importlib.util.find_spec("vllm") is None:
        raise MissingPackageError("the vllm backend needs vLLM: pip install 'alpacafarm[vllm]'")
    from vllm import LLM

    llm = LLM(model=resolve_model_path(model_path), seed=0, **config.model_dump(exclude_none=True))
    return VLLMGenerator(llm, prompt_format_for(spec, model_path))


vllm_backend.config_class = VLLMBackendConfig  # type: ignore[attr-defined]
