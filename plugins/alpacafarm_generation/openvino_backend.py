"""The ``openvino`` generation backend: OpenVINO GenAI's continuous-batching pipeline (a C++ generation loop over
a paged key/value cache) on the checkpoint's own export (extra ``fast-cpu``; see
``benchmarks/generation_throughput.py`` for how it compares with transformers on your CPU).

The checkpoint is exported once into GenAI's folder layout (:mod:`alpacafarm_generation.openvino_export`).
Prompts are tokenized and responses decoded by the checkpoint's own transformers tokenizer, exactly as the
transformers backend does; GenAI only ever sees token ids, so no chat template or tokenizer of its own applies.

Every prompt is one request for its ``n`` samples (the prompt is prefilled once and its cache shared), seeded
by ``(seed, prompt index)``, so a prompt's samples do not depend on which other prompts share the call, and a
call is reproducible; GenAI returns them best score first, so they are put back in a seeded random order (the
order of independent draws). Requests are scheduled continuously (a finished sequence's slot goes to the next
request at once, no padding), at most ``batch_size`` prompts at a time. Temperature and top-p are GenAI's
(the same definitions as transformers' warpers: logits divided by the temperature, then the smallest set of
tokens whose probability reaches ``top_p``); ``temperature: 0`` is greedy. A response ends after its first stop
token (the tokenizer's EOS and the checkpoint's ``generation_config`` stop tokens), which is kept, as the
sampler keeps it, or after ``max_new_tokens``. Weights, activations and the cache stay float32 unless the model
block's ``inference_dtype`` (or ``precision`` here) asks for bfloat16; greedy outputs then equal the transformers
backend's up to float rounding (the benchmark measures the agreement).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alpacafarm.errors import MissingPackageError, UserError
from alpacafarm.generation import GenerationProgress, Generator, SamplingConfig
from alpacafarm.model_sources import resolve_model_path
from alpacafarm.prompts import PromptFormat

EXTRA = "pip install 'alpacafarm[fast-cpu]'"


class OpenVINOBackendConfig(BaseModel):
    """Options of the ``openvino`` backend."""

    model_config = ConfigDict(extra="forbid")

    threads: int | None = Field(None, ge=1, description="CPU threads for inference (default: all cores)")
    precision: str | None = Field(
        None, pattern="^(float32|bfloat16)$",
        description="compute and cache precision (default: the model block's inference dtype; float32 unless "
                    "bfloat16)")
    kv_cache_gb: int | None = Field(
        None, ge=1, description="memory reserved for the key/value cache, GB (default: grown as needed)")
    max_batched_tokens: int = Field(
        1024, ge=16, description="tokens one forward pass may hold (long prompts are prefilled in chunks)")


def require_openvino() -> None:
    missing = [name for name in ("openvino", "openvino_genai", "openvino_tokenizers")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingPackageError(f"the openvino generation backend needs {', '.join(missing)}: {EXTRA}")


class OpenVINOGenerator(Generator):
    """Sampling with GenAI's continuous-batching pipeline (see the module docstring)."""

    def __init__(self, pipeline: Any, tokenizer: Any, stop_ids: Sequence[int],
                 prompt_format: PromptFormat | None = None) -> None:
        self.pipeline = pipeline
        self.tokenizer = tokenizer
        self.stop_ids = sorted(set(stop_ids))
        self.prompt_format = prompt_format or PromptFormat(tokenizer=tokenizer)
        self._next_request = 0
        #: per completion of the last call, the token ids generated (the stop token kept, as the sampler does)
        self.last_token_ids: list[list[list[int]]] = []
        self.last_token_counts = []
        self.last_finished = []

    def _config(self, sampling: SamplingConfig, seed: int) -> Any:
        import openvino_genai

        config = openvino_genai.GenerationConfig()
        config.max_new_tokens = sampling.max_new_tokens
        config.min_new_tokens = 0
        config.eos_token_id = self.stop_ids[0] if self.stop_ids else -1
        config.stop_token_ids = set(self.stop_ids)
        config.ignore_eos = False
        config.apply_chat_template = False
        config.repetition_penalty = 1.0
        config.do_sample = sampling.temperature > 0
        config.num_return_sequences = sampling.n if config.do_sample else 1  # greedy: n copies of one answer
        if config.do_sample:
            config.temperature, config.top_p, config.rng_seed = sampling.temperature, sampling.top_p, seed
        return config

    def sample_ids(self, queries: Sequence[Sequence[int]], sampling: SamplingConfig,
                   progress: GenerationProgress | None = None) -> list[list[list[int]]]:
        """``n`` token lists per tokenized prompt, in the prompts' order (each ends at its first stop token)."""
        import random

        import numpy as np
        import openvino as ov
        from openvino_genai import GenerationStatus

        from alpacafarm.seeding import stable_seed

        greedy = sampling.temperature == 0
        width = 1 if greedy else sampling.n  # sequences one request runs
        waiting = list(range(len(queries)))[::-1]  # popped from the end: prompts in order
        capacity = max(1, sampling.batch_size * sampling.n // width) if not greedy else sampling.batch_size
        running: dict[int, tuple[int, Any]] = {}
        responses: list[list[list[int]]] = [[] for _ in queries]
        while waiting or running:
            while waiting and len(running) < capacity:
                i = waiting.pop()
                ids = ov.Tensor(np.asarray([queries[i]], dtype=np.int64))
                request, self._next_request = self._next_request, self._next_request + 1
                running[request] = (i, self.pipeline.add_request(request, ids,
                                                                 self._config(sampling, stable_seed(sampling.seed, i))))
            self.pipeline.step()
            done = 0
            for request, (i, handle) in list(running.items()):
                status = handle.get_status()
                if status == GenerationStatus.RUNNING:
                    continue
                del running[request]
                if status != GenerationStatus.FINISHED:
                    raise UserError(f"OpenVINO GenAI did not finish prompt {i} ({status.name}): a prompt of "
                                    f"{len(queries[i])} tokens may not fit the openvino backend's kv_cache_gb")
                group = []
                for output in handle.read_all():
                    tokens = list(output.generated_ids)
                    end = next((k for k, token in enumerate(tokens) if token in self.stop_ids), None)
                    group.append(tokens if end is None else tokens[:end + 1])
                # GenAI returns a request's sequences best score first; a seeded shuffle makes their order that of
                # independent draws again (sample 0 is not the likeliest), as the transformers sampler's is.
                random.Random(stable_seed(sampling.seed, i, "order")).shuffle(group)
                responses[i] = group * sampling.n if greedy else group
                done += 1
            if progress is not None and done:
                progress(done)
        return responses

    def generate(self, prompts: Sequence[str], sampling: SamplingConfig,
                 progress: GenerationProgress | None = None) -> list[list[str]]:
        from alpacafarm.sampling import tokenize_prompts

        responses = self.sample_ids(tokenize_prompts(self.tokenizer, prompts), sampling, progress)
        self.last_token_ids = responses
        self.last_token_counts = [[len(r) for r in group] for group in responses]
        self.last_finished = [[bool(r) and r[-1] in self.stop_ids for r in group] for group in responses]
        return [[self.tokenizer.decode(r, skip_special_tokens=True).strip() for r in group] for group in responses]

    def close(self) -> None:
        self.pipeline = None


def cpu_capabilities() -> list[str]:
    """What OpenVINO's CPU plugin can compute natively on this machine (``BF16`` among them or not)."""
    import openvino

    return list(openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def pipeline_properties(config: OpenVINOBackendConfig, spec: Any,
                        capabilities: list[str] | None = None) -> dict[str, str]:
    """Compile properties: the precision asked for (the CPU plugin would otherwise pick bfloat16 on CPUs that
    have it, and an 8-bit cache), and the thread count.

    The KV cache is bfloat16 only on a CPU that computes bfloat16 natively (``capabilities``, default: this
    machine's): on an AVX2-only CPU, OpenVINO 2026.4.1's paged attention refuses a bfloat16 cache ("expect kvcache
    type f32") and computes the bfloat16 hint in float32 anyway, so the cache follows what is computed."""
    import os

    precision = config.precision or spec.for_inference().dtype
    hint = "bf16" if precision == "bfloat16" else "f32"
    if hint == "bf16" and (config.threads or len(os.sched_getaffinity(0))) == 1:
        # OpenVINO 2026.4.1's CPU plugin dies of SIGFPE compiling a bfloat16 graph for one thread.
        raise UserError("the openvino backend cannot run bfloat16 on one CPU thread (OpenVINO 2026.4.1 crashes): "
                        "set backend_config threads >= 2 or precision: float32")
    if hint == "bf16" and "BF16" not in (cpu_capabilities() if capabilities is None else capabilities):
        cache = "f32"
    else:
        cache = hint
    properties = {"INFERENCE_PRECISION_HINT": hint, "KV_CACHE_PRECISION": cache}
    if config.threads:
        properties["INFERENCE_NUM_THREADS"] = str(config.threads)
    return properties


def openvino_backend(config: OpenVINOBackendConfig, spec: Any, model_path: str) -> Generator:
    """The ``openvino`` backend for the model block ``spec`` and the checkpoint ``model_path``."""
    require_openvino()
    import openvino_genai

    from alpacafarm.model_loading import load_tokenizer
    from alpacafarm_generation.openvino_export import INFO_FILE, exported_model

    config = config or OpenVINOBackendConfig()
    properties = pipeline_properties(config, spec)
    folder: Path = exported_model(spec, model_path)
    scheduler = openvino_genai.SchedulerConfig()
    scheduler.cache_size = config.kv_cache_gb or 0  # 0: grown as needed
    scheduler.max_num_batched_tokens = config.max_batched_tokens
    scheduler.dynamic_split_fuse = True
    scheduler.enable_prefix_caching = False  # a sample must not depend on what an earlier call left cached
    pipeline = openvino_genai.ContinuousBatchingPipeline(str(folder), scheduler, "CPU", properties)
    tokenizer = load_tokenizer(spec, model_path, padding_side="left")
    info = json.loads((folder / INFO_FILE).read_text(encoding="utf-8"))
    stops = {tokenizer.eos_token_id, *info["eos_token_id"]} - {None}
    prompt_format = PromptFormat.for_model(spec.prompt_format, resolve_model_path(model_path), tokenizer)
    return OpenVINOGenerator(pipeline, tokenizer, sorted(stops), prompt_format)


openvino_backend.config_class = OpenVINOBackendConfig  # type: ignore[attr-defined]
