"""Sampling completions: ``generate(prompts, sampling) -> completions`` behind one interface.

Backends are registered by plugins (``register_generation_backends``) and built by the registry
(``registry.create("generation_backend", name, config, spec=..., model_path=...)``; a stage asks its context:
``context.generator(...)``): ``transformers`` (this module, the default), ``openai`` (any OpenAI-compatible
server: vLLM, llama.cpp, TGI) and ``vllm`` (in-process, with the ``vllm`` extra).

Every backend carries a :class:`~alpacafarm.prompts.PromptFormat` for the model it samples from (style,
tokenizer, and the conditioning the model folder carries); :func:`generate_records` formats prompts with it, so
a reward-conditioned model is conditioned whatever the backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from alpacafarm.prompts import PromptFormat
from alpacafarm.sampling import MAX_NEW_TOKENS, MAX_SAMPLES_PER_PROMPT, generation_size_problem

if TYPE_CHECKING:
    from alpacafarm.recipe import ModelSpec

#: ``progress(n_prompts_done)``
GenerationProgress = Callable[[int], None]


class SamplingConfig(BaseModel):
    """How to sample. ``temperature: 0`` means greedy decoding. ``n`` and ``max_new_tokens`` are bounded
    (:data:`~alpacafarm.sampling.MAX_SAMPLES_PER_PROMPT`, :data:`~alpacafarm.sampling.MAX_NEW_TOKENS`: past every
    real answer), so a typo is refused by ``recipe check`` and ``--plan`` in one line naming its YAML path."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(1, ge=1, le=MAX_SAMPLES_PER_PROMPT, description="completions per prompt")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(256, ge=1, le=MAX_NEW_TOKENS, description="answer length cap, in tokens")
    batch_size: int = Field(8, ge=1, description="prompts per forward pass (each with n samples)")
    seed: int = 0

    @field_validator("n", "max_new_tokens", mode="before")
    @classmethod
    def _bounded(cls, value: Any, info: ValidationInfo) -> Any:
        """The bound in words (pydantic's 'less than or equal to 32768' does not say why)."""
        if isinstance(value, int) and not isinstance(value, bool) and value > (
                MAX_SAMPLES_PER_PROMPT if info.field_name == "n" else MAX_NEW_TOKENS):
            sizes = {"n": 1, "max_new_tokens": 1, info.field_name: value}
            raise ValueError(generation_size_problem(sizes["n"], sizes["max_new_tokens"]))
        return value


class Generator:
    """Base class of generation backends: subclasses implement :meth:`generate` on formatted prompts.

    ``prompt_format`` says how instruction records become prompts for this backend's model (see
    :func:`generate_records`); a backend sets it from the model block and the model folder it samples from.
    """

    prompt_format: PromptFormat = PromptFormat()
    #: tokens generated per completion by the last call (for throughput figures); empty when the backend cannot tell
    last_token_counts: Sequence[Sequence[int]] = ()
    #: per completion of the last call, whether it ended on its own (a stop token) rather than being cut at
    #: ``max_new_tokens``; empty when the backend cannot tell (a method that needs it then fails, naming it)
    last_finished: Sequence[Sequence[bool]] = ()

    def generate(self, prompts: Sequence[str], sampling: SamplingConfig,
                 progress: GenerationProgress | None = None) -> list[list[str]]:
        """``sampling.n`` completions for each formatted prompt, in the prompts' order."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the model or client (the default holds nothing that needs it)."""


class TransformersGenerator(Generator):
    """Batched sampling with a transformers causal LM through :func:`alpacafarm.sampling.sample`."""

    def __init__(self, model: Any, tokenizer: Any, prompt_format: PromptFormat | None = None, *,
                 sharded: bool = False) -> None:
        self.model = model.eval()
        #: Split each :meth:`generate` call's batches across ranks and gather every rank's samples (every rank
        #: calls it with the same prompts and gets all the completions, the same as one process's); ``False``:
        #: every rank samples all of its own prompts. :func:`alpacafarm.sampling.sample`'s ``sharded``.
        self.sharded = sharded
        self.tokenizer = tokenizer
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.prompt_format = prompt_format or PromptFormat(tokenizer=tokenizer)
        self.last_token_counts = []
        self.last_finished = []

    @classmethod
    def from_spec(cls, spec: ModelSpec, path: str | None = None) -> TransformersGenerator:
        """Load the model block's model (or ``path``) in its inference dtype, with its folder's conditioning."""
        from alpacafarm.model_loading import load_causal_lm, load_tokenizer
        from alpacafarm.model_sources import resolve_model_path

        spec = spec.for_inference()
        tokenizer = load_tokenizer(spec, path, padding_side="left")
        prompt_format = PromptFormat.for_model(spec.prompt_format, resolve_model_path(path or spec.name), tokenizer)
        return cls(load_causal_lm(spec, path), tokenizer, prompt_format)

    def generate(self, prompts: Sequence[str], sampling: SamplingConfig,
                 progress: GenerationProgress | None = None) -> list[list[str]]:
        from alpacafarm.sampling import sample, tokenize_prompts

        samples = sample(self.model, self.tokenizer, tokenize_prompts(self.tokenizer, prompts), n=sampling.n,
                         temperature=sampling.temperature, top_p=sampling.top_p,
                         max_new_tokens=sampling.max_new_tokens, batch_size=sampling.batch_size,
                         seed=sampling.seed, progress=progress, sharded=self.sharded)
        self.last_token_counts = [[len(s.response_ids) for s in group] for group in samples]
        self.last_finished = [[s.finished for s in group] for group in samples]
        return [[s.text for s in group] for group in samples]


def generate_records(generator: Generator, records: Sequence[dict[str, Any]], sampling: SamplingConfig, *,
                     progress: GenerationProgress | None = None) -> list[dict[str, Any]]:
    """Completions for instruction records, as records: one per (instruction, sample), with ``sample_index``.

    Prompts are written by the generator's :class:`~alpacafarm.prompts.PromptFormat` (conditioning included).
    """
    problem = generation_size_problem(sampling.n, sampling.max_new_tokens)
    if problem is not None:  # a config copied with model_copy(update=...) is not validated again: bound it here
        from alpacafarm.errors import UserError

        raise UserError(f"sampling: {problem}")
    outputs = generator.generate(generator.prompt_format.records(records), sampling, progress)
    return [{**{k: v for k, v in record.items() if k != "output"}, "output": text, "sample_index": j}
            for record, samples in zip(records, outputs, strict=True) for j, text in enumerate(samples)]


def write_completions(path: str | Path, rows: Sequence[dict[str, Any]]) -> int:
    from alpacafarm.data import write_jsonl

    return write_jsonl(Path(path), rows)
