"""The one batched, seeded sampler over a transformers causal LM.

Generation (the transformers backend), best-of-n, expert iteration, PPO rollouts and Quark pools all sample
through :func:`sample`: prompts left-padded (generation appends on the right), longest first so each batch pads
little and memory peaks at the start, every batch seeded from ``seed`` and its position (a run is
reproducible), each response cut after its first stop token (which is kept: a trained policy must learn to
stop). Decoding settings are given explicitly: nothing is inherited from a checkpoint's ``generation_config``
but its stop tokens. (transformers fills every setting a ``GenerationConfig`` leaves unset from the model's own
``generation_config.json``, e.g. a ``repetition_penalty``; :func:`exact_generation_config` stops that.)

Across ranks: with ``sharded=True``, :func:`sample` forms the same batches as one process would (the global
length order), hands batch ``b`` to rank ``b mod world_size`` and gathers every rank's samples back in the
prompts' order. A batch's composition and seed do not depend on the number of processes, so the outputs are the
same as one process's for the same seed (bit for bit on the same hardware). Without it every rank samples all of
its own prompts. The choice is an argument of each call (a generator carries it as
:attr:`~alpacafarm.generation.TransformersGenerator.sharded`), never a setting that code further up left behind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from alpacafarm.seeding import stable_seed

#: The longest answer any sampler here is asked for, in new tokens. Why this number: the paper's answers stay
#: under 300 tokens (its PPO, Quark and expert iteration sample 300), the models a recipe samples from read
#: 2k-8k tokens of context (SmolLM2 8,192, Llama-2 4,096) and long-answer models' answers reach ~32k; a bound
#: past every real answer, so that a typo (``1e23``, an extra zero run) is refused before the run instead of a
#: stage that samples until it is killed. A model whose context is shorter stops on its own limit.
MAX_NEW_TOKENS = 32_768
#: The most samples per prompt: 4x the paper's largest best-of-n (best-of-1024); more is a typo, not a sweep.
MAX_SAMPLES_PER_PROMPT = 4_096


def generation_size_problem(n: int, max_new_tokens: int) -> str | None:
    """What is out of bounds in a request for ``n`` samples of ``max_new_tokens`` tokens per prompt, or None:
    each at least 1, at most :data:`MAX_SAMPLES_PER_PROMPT` and :data:`MAX_NEW_TOKENS`."""
    for name, value, cap in (("n", n, MAX_SAMPLES_PER_PROMPT), ("max_new_tokens", max_new_tokens, MAX_NEW_TOKENS)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= cap:
            why = (" (alpacafarm.sampling: the bound is past every real answer; a larger value samples until the "
                   "stage is killed)" if isinstance(value, int | float) and value > cap else "")
            return f"{name} must be a whole number in [1, {cap:,}], got {value!r}{why}"
    return None


@dataclass
class Sample:
    """One sampled response: the exact token ids the model produced (a training example) and its text."""

    prompt_ids: list[int]
    response_ids: list[int]
    text: str
    finished: bool  # ended with a stop token (not cut at max_new_tokens)


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Token ids that end a response: the tokenizer's EOS and those of the model's generation config."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def tokenize_prompts(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of formatted prompts; chat templates already carry their special tokens (no second BOS)."""
    if not prompts:
        return []
    bos = tokenizer.bos_token
    add_special = not (bos and all(p.startswith(bos) for p in prompts))
    return [list(ids) for ids in tokenizer(list(prompts), add_special_tokens=add_special)["input_ids"]]


def left_pad(queries: Sequence[Sequence[int]], pad_id: int, device: Any = "cpu") -> tuple[Any, Any]:
    """Prompts left-padded to one width: ``(input_ids, attention_mask)``."""
    import torch

    width = max(len(q) for q in queries)
    ids = torch.full((len(queries), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, query in enumerate(queries):
        ids[row, width - len(query):] = torch.tensor(query, dtype=torch.long)
        mask[row, width - len(query):] = 1
    return ids.to(device), mask.to(device)


@contextlib.contextmanager
def exact_generation_config(model: Any) -> Iterator[None]:
    """While open, every ``generation_config`` inside ``model`` (a peft wrapper holds the transformers model) is
    a blank one, so ``generate`` uses exactly the settings it is given and the library's neutral defaults."""
    from transformers import GenerationConfig

    holders = [m for m in model.modules() if isinstance(getattr(m, "generation_config", None), GenerationConfig)]
    saved = [m.generation_config for m in holders]
    for holder in holders:
        holder.generation_config = GenerationConfig()
    try:
        yield
    finally:
        for holder, config in zip(holders, saved, strict=True):
            holder.generation_config = config


def sample(model: Any, tokenizer: Any, queries: Sequence[Sequence[int]], *, n: int = 1, temperature: float = 1.0,
           top_p: float = 1.0, max_new_tokens: int = 256, batch_size: int = 8, seed: int = 0,
           stop_ids: Sequence[int] | None = None, generate: Callable[..., Any] | None = None,
           progress: Callable[[int], None] | None = None, sharded: bool = False,
           synced: bool = False) -> list[list[Sample]]:
    """``n`` responses per tokenized prompt, in the prompts' order; ``temperature: 0`` is greedy decoding.

    ``generate`` replaces ``model.generate``; ``model`` then only supplies the device and the stop tokens.
    ``progress(k)`` is called after each batch of ``k`` prompts. ``sharded``: every rank calls this with the same
    queries; the batches are split across ranks and every rank gets every sample (see the module). ``synced`` (with
    ``sharded``, for a model whose forward is a collective, e.g. sharded by FSDP or ZeRO-3): every rank makes the
    same number of ``generate`` calls (a rank with fewer batches repeats its last one and drops the result) and
    each call runs with ``synced_gpus`` (a rank whose sequences ended keeps stepping until every rank's have), so
    no rank waits forever for another; the samples are the same as without it.
    """
    import torch
    from transformers import GenerationConfig

    problem = generation_size_problem(n, max_new_tokens)
    if problem is not None:  # a caller's own config (PPO's, Quark's) that skipped the bound: refused, never run
        from alpacafarm.errors import UserError

        raise UserError(f"sampling: {problem}")
    if not queries:
        return []
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = list(stop_ids) if stop_ids is not None else stop_token_ids(model, tokenizer)
    greedy = temperature == 0
    config = GenerationConfig(do_sample=not greedy, max_new_tokens=max_new_tokens, num_return_sequences=n,
                              pad_token_id=pad_id, eos_token_id=stops or None,
                              bos_token_id=tokenizer.bos_token_id)
    if not greedy:
        config.temperature, config.top_p, config.top_k = temperature, top_p, 0
    device = next(model.parameters()).device
    generate = generate or model.generate
    order = sorted(range(len(queries)), key=lambda i: len(queries[i]), reverse=True)
    results: list[list[Sample]] = [[] for _ in queries]
    starts = list(range(0, len(order), batch_size))
    world = 1
    if sharded:
        from alpacafarm import distributed

        world = distributed.world_size()
        n_batches = len(starts)
        starts = distributed.shard(starts, strided=True)  # batch b → rank b mod world: balanced, longest first
    synced = synced and world > 1
    calls = list(starts)
    if synced:  # as many calls as the rank with the most batches: repeats of this rank's last (or first) batch
        calls += [starts[-1] if starts else 0] * (-(-n_batches // world) - len(starts))
    for call, start in enumerate(calls):
        indices = order[start:start + batch_size]
        input_ids, attention_mask = left_pad([queries[i] for i in indices], pad_id, device)
        torch.manual_seed(stable_seed(seed, start))
        with torch.no_grad(), exact_generation_config(model):
            output = generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                              **({"synced_gpus": True} if synced else {}))
        if call >= len(starts):
            continue  # a repeat that only kept this rank in step
        new = output[:, input_ids.shape[1]:].tolist()
        for row, index in enumerate(indices):
            for tokens in new[row * n:(row + 1) * n]:
                end = next((k for k, token in enumerate(tokens) if token in stops), None)
                response = tokens if end is None else tokens[:end + 1]
                text = tokenizer.decode(response, skip_special_tokens=True).strip()
                results[index].append(Sample(list(queries[index]), response, text, end is not None))
        if progress is not None:
            progress(len(indices))
    if world > 1:
        from alpacafarm import distributed

        mine = {i: results[i] for start in starts for i in order[start:start + batch_size]}
        for part in distributed.all_gather_object(mine, "sampling"):
            for i, samples in part.items():
                results[i] = samples
    return results
