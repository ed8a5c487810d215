"""What a PPO update minimises: token log-probabilities and entropy, the clipped policy and value losses, and
how far an update moved the policy (pure functions on tensors, :mod:`alpacafarm_methods.ppo.rollouts`' conventions).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from alpacafarm_methods.ppo.rollouts import masked_mean, masked_sum


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log p(token)`` under ``logits`` (``[..., vocab]``) gathered at ``tokens`` (``[...]``), in float32."""
    return torch.gather(logits.float().log_softmax(-1), -1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_of(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the categorical distribution of ``logits`` over the last dimension, in float32."""
    logits = logits.float()
    probs = logits.softmax(-1)
    return torch.logsumexp(logits, -1) - (probs * logits).sum(-1)


class LossTerms(NamedTuple):
    """A clipped loss: the reduced ``loss`` and the share of tokens on which clipping was binding."""

    loss: torch.Tensor
    clip_fraction: torch.Tensor


def _reduce(per_token: torch.Tensor, mask: torch.Tensor,
            denominator: float | torch.Tensor | None) -> torch.Tensor:
    if denominator is None:
        return masked_mean(per_token, mask)
    return masked_sum(per_token, mask) / denominator


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, cliprange: float, *,
                        denominator: float | torch.Tensor | None = None) -> LossTerms:
    """PPO's clipped surrogate: ``max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))`` averaged over tokens.

    ``ratio = exp(logprobs - old_logprobs)``. The mean is over the masked tokens, or ``sum / denominator``
    when a denominator is given (the token count of a whole mini-batch that is split into micro-batches).
    ``clip_fraction`` counts the tokens where the clipped term was the larger one.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)
    per_token = torch.maximum(unclipped, clipped)
    clip_fraction = masked_mean((clipped > unclipped).float(), mask).detach()
    return LossTerms(_reduce(per_token, mask, denominator), clip_fraction)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, cliprange_value: float, *,
                       denominator: float | torch.Tensor | None = None) -> LossTerms:
    """``0.5 * max((V - R)^2, (V_clipped - R)^2)`` with ``V_clipped = V_old + clip(V - V_old, -eps, eps)``."""
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_error, clipped_error)
    return LossTerms(_reduce(per_token, mask, denominator),
                     masked_mean((clipped_error > unclipped_error).float(), mask).detach())


def approx_policy_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``0.5 * mean((log p_new - log p_old)^2)``: how far an update moved the policy from the rollout one."""
    return 0.5 * masked_mean((logprobs - old_logprobs) ** 2, mask)
