"""KL divergence of a trained policy from its reference model, estimated on the policy's own samples.

Gao et al. (2023) and Coste et al. (2024) draw gold and proxy reward against ``KL(π ‖ π_ref)``: how far a method
moved from the SFT model to buy its gain. For a sample ``y`` of the policy at temperature ``T``, ``log π_T(y|x) -
log π_ref,T(y|x)`` (each model's next-token distribution at ``T``, summed over the completion's tokens) is an
unbiased single-sample estimate of ``KL(π_T ‖ π_ref,T)``: its mean over the samples is the estimate, its spread
the standard error. Each model reads the prompt in its own format (a reward-conditioned policy with its control
token). A sample that ended on its own is scored with its stop token; one cut at ``max_new_tokens`` without.

For best-of-n the KL is known in closed form (Stiennon et al. 2020; Gao et al. 2023): ``log n - (n - 1) / n``
(:func:`best_of_n_kl`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from alpacafarm.recipe import ModelSpec


def best_of_n_kl(n: int) -> float:
    """KL(best-of-n ‖ the sampler) in nats: ``log n - (n - 1) / n`` (0 for n = 1)."""
    if n < 1:
        raise ValueError(f"best-of-n needs n >= 1, got {n}")
    return math.log(n) - (n - 1) / n


def sequence_logprobs(spec: ModelSpec, model_path: str, records: Sequence[dict[str, Any]], *, temperature: float,
                      max_new_tokens: int, batch_size: int = 8) -> list[float]:
    """``log π_T(output | prompt)`` of each record (``instruction``, ``input``, ``output``, optional
    ``finished``) under the model at ``model_path`` (any folder layout), the prompt in that model's format. A record
    without ``finished`` counts as finished when its output is shorter than ``max_new_tokens`` tokens."""
    import torch

    from alpacafarm.model_loading import load_merged_causal_lm, load_tokenizer
    from alpacafarm.model_sources import resolve_model_path
    from alpacafarm.prompts import PromptFormat
    from alpacafarm.sampling import tokenize_prompts

    if temperature <= 0:
        raise ValueError("a KL estimate needs a sampling temperature > 0 (greedy decoding has no distribution)")
    tokenizer = load_tokenizer(spec, model_path, padding_side="right")
    model = load_merged_causal_lm(spec.for_inference(), model_path)
    model.eval()
    prompts = PromptFormat.for_model(spec.prompt_format, resolve_model_path(model_path), tokenizer).records(records)
    prompt_ids = tokenize_prompts(tokenizer, prompts)
    eos = tokenizer.eos_token_id
    rows = []
    for ids, record in zip(prompt_ids, records, strict=True):
        completion = tokenizer(record["output"], add_special_tokens=False)["input_ids"]
        finished = record.get("finished", len(completion) < max_new_tokens)
        if finished and eos is not None:
            completion = [*completion, eos]
        rows.append((ids, completion))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    device = next(model.parameters()).device
    values: list[float] = []
    with torch.inference_mode():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            width = max(len(p) + len(c) for p, c in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, (p, c) in enumerate(chunk):
                input_ids[i, :len(p) + len(c)] = torch.tensor(p + c)
                mask[i, :len(p) + len(c)] = 1
            logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits.float()
            logprobs = (logits[:, :-1] / temperature).log_softmax(-1)
            targets = input_ids[:, 1:].to(device)
            picked = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).cpu()
            for i, (p, c) in enumerate(chunk):
                values.append(float(picked[i, len(p) - 1:len(p) - 1 + len(c)].sum()))
    return values


def kl_estimate(policy_logprobs: Sequence[float], reference_logprobs: Sequence[float]) -> tuple[float, float | None]:
    """``(KL, its standard error)`` from per-sample log-probabilities of the policy's own samples."""
    diffs = [p - r for p, r in zip(policy_logprobs, reference_logprobs, strict=True)]
    if not diffs:
        raise ValueError("a KL estimate needs at least one sample")
    mean = sum(diffs) / len(diffs)
    if len(diffs) < 2:
        return mean, None
    variance = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, math.sqrt(variance / len(diffs))
