"""Sampling completions: ``generate(prompts, sampling) -> completions`` behind one interface.

Backends are registered by plugins (``register_generation_backends``): ``transformers`` (this module, the
default), ``openai`` (any OpenAI-compatible server: vLLM, llama.cpp, TGI) and ``vllm`` (in-process, with the
``vllm`` extra). Prompts are already formatted (see :mod:`alpacafarm.prompts`).

A model folder may carry ``alpacafarm_generation.json`` (:class:`PromptConditioning`): fixed text that the model
was trained to see around every prompt, such as the "good" control token of binary reward conditioning. The
transformers backend reads it in :meth:`TransformersGenerator.from_spec` and applies it to every prompt, so any
stage that generates from that folder is conditioned the same way without configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from alpacafarm.errors import UserError
from alpacafarm.method import stable_seed

if TYPE_CHECKING:
    from alpacafarm.recipe import ModelSpec

#: ``progress(n_prompts_done)``
GenerationProgress = Callable[[int], None]


class SamplingConfig(BaseModel):
    """How to sample. ``temperature: 0`` means greedy decoding."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(1, ge=1, description="completions per prompt")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(256, ge=1)
    batch_size: int = Field(8, ge=1, description="prompts per forward pass (each with n samples)")
    seed: int = 0


#: The file in a model folder that holds its :class:`PromptConditioning`.
CONDITIONING_FILE = "alpacafarm_generation.json"


class PromptConditioning(BaseModel):
    """Text a model expects around every formatted prompt, saved next to its weights by the stage that trained it.

    ``prompt_prefix`` goes before the prompt (reward conditioning's control token: the paper prepends it to the
    whole example), ``response_prefix`` after it (the response is generated as its continuation). Both are part
    of the prompt, so they never appear in a completion.
    """

    model_config = ConfigDict(extra="forbid")

    prompt_prefix: str = ""
    response_prefix: str = ""

    def apply(self, prompt: str) -> str:
        """``prompt_prefix + prompt + response_prefix``: the text the model is conditioned on."""
        return f"{self.prompt_prefix}{prompt}{self.response_prefix}"

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / CONDITIONING_FILE
        path.write_text(self.model_dump_json(indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> PromptConditioning:
        """The conditioning saved in a local model folder; none (empty prefixes) when there is no file."""
        path = Path(directory) / CONDITIONING_FILE
        if not path.is_file():
            return cls()
        try:
            return cls.model_validate_json(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise UserError(f"{path}: not a valid generation conditioning file: {str(exc).splitlines()[0]}") from None


class Generator:
    """Base class: subclasses implement :meth:`generate`."""

    def generate(self, prompts: Sequence[str], sampling: SamplingConfig,
                 progress: GenerationProgress | None = None) -> list[list[str]]:
        """``sampling.n`` completions for each prompt, in the prompts' order."""
        raise NotImplementedError


class TransformersGenerator(Generator):
    """Batched sampling with a transformers causal LM: left padding, ``num_return_sequences``, EOS stop.

    Prompts are sorted by length (longest first) so each batch pads little and memory peaks at the start; each
    batch is seeded from ``sampling.seed`` and its position, so a run is reproducible. ``conditioning`` is
    applied to every prompt (see :class:`PromptConditioning`).
    """

    def __init__(self, model: Any, tokenizer: Any, conditioning: PromptConditioning | None = None) -> None:
        self.model = model.eval()
        self.conditioning = conditioning or PromptConditioning()
        #: non-padding tokens generated per completion by the last call (for throughput figures)
        self.last_token_counts: list[list[int]] = []
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "left"  # generation appends on the right: prompts must end aligned
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    @classmethod
    def from_spec(cls, spec: ModelSpec, path: str | None = None) -> TransformersGenerator:
        """Load the model block's model (or ``path``), with the conditioning its folder carries, if any."""
        from alpacafarm.modeling import load_causal_lm, load_tokenizer
        from alpacafarm.models import resolve_model_path

        spec = spec.for_inference()
        location = Path(resolve_model_path(path or spec.name))
        conditioning = PromptConditioning.load(location) if location.is_dir() else None
        return cls(load_causal_lm(spec, path), load_tokenizer(spec, path, padding_side="left"), conditioning)

    def generate(self, prompts: Sequence[str], sampling: SamplingConfig,
                 progress: GenerationProgress | None = None) -> list[list[str]]:
        import torch

        prompts = [self.conditioning.apply(p) for p in prompts]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
        results: list[list[str]] = [[] for _ in prompts]
        counts: list[list[int]] = [[] for _ in prompts]
        greedy = sampling.temperature == 0
        bos = self.tokenizer.bos_token
        for start in range(0, len(order), sampling.batch_size):
            indices = order[start:start + sampling.batch_size]
            texts = [prompts[i] for i in indices]
            # Chat templates already carry special tokens; adding a second BOS would shift the distribution.
            add_special = not (bos and all(t.startswith(bos) for t in texts))
            batch = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=add_special)
            batch = batch.to(self.model.device)
            torch.manual_seed(stable_seed(sampling.seed, start))
            kwargs: dict[str, Any] = {"max_new_tokens": sampling.max_new_tokens, "num_return_sequences": sampling.n,
                                      "pad_token_id": self.tokenizer.pad_token_id, "do_sample": not greedy}
            if not greedy:
                kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
            with torch.no_grad():
                output = self.model.generate(**batch, **kwargs)
            new_tokens = output[:, batch["input_ids"].shape[1]:]
            decoded = self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
            lengths = (new_tokens != self.tokenizer.pad_token_id).sum(dim=1).tolist()
            for row, index in enumerate(indices):
                results[index] = [text.strip() for text in decoded[row * sampling.n:(row + 1) * sampling.n]]
                counts[index] = lengths[row * sampling.n:(row + 1) * sampling.n]
            if progress:
                progress(len(indices))
        self.last_token_counts = counts
        return results


def generate_records(generator: Generator, records: Sequence[dict[str, Any]], sampling: SamplingConfig, *,
                     prompt_format: str = "alpaca", tokenizer: Any = None,
                     progress: GenerationProgress | None = None) -> list[dict[str, Any]]:
    """Completions for instruction records, as records: one per (instruction, sample), with ``sample_index``."""
    from alpacafarm.prompts import format_prompt

    prompts = [format_prompt(r["instruction"], r.get("input"), style=prompt_format, tokenizer=tokenizer) for r in records]
    outputs = generator.generate(prompts, sampling, progress)
    return [{**{k: v for k, v in record.items() if k != "output"}, "output": text, "sample_index": j}
            for record, samples in zip(records, outputs, strict=True) for j, text in enumerate(samples)]


def write_completions(path: str | Path, rows: Sequence[dict[str, Any]]) -> int:
    from alpacafarm.data import write_jsonl

    return write_jsonl(Path(path), rows)
