"""From scores to advantages: the KL-shaped per-token rewards, whitening, and GAE (pure functions on tensors).

Token ``t``'s value is the critic's estimate before token ``t`` is emitted; token ``t``'s reward is the per-token KL
penalty, plus the sequence's reward-model score on the last real token (the paper's Eq. 3 spread over tokens). The
penalty is charged on the per-token KL clamped at zero by default, as the released AlpacaFarm implementation does
(:func:`kl_penalized_rewards`). Tensors follow :mod:`alpacafarm_methods.ppo.rollouts`' conventions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from alpacafarm_methods.ppo.rollouts import masked_mean, masked_var

#: Keeps whitening finite when every value in a batch is the same.
WHITEN_EPS = 1e-8

def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last real token (0 for an empty row)."""
    return (mask.sum(-1).long() - 1).clamp(min=0)


#: The per-token KL estimates the penalty can be charged on (``PPOMethodConfig.kl_penalty``).
KL_PENALTIES = ("clamped", "k1")


class ShapedRewards(NamedTuple):
    """Per-token rewards and the KL terms behind them, all ``[batch, length]`` and zero on padding."""

    #: ``-kl_coef * penalized_kl``, plus the sequence's score on its last real token
    rewards: torch.Tensor
    #: ``log p_policy - log p_ref``: its row sums are the sampled (``k1``) estimates of each response's KL
    kl: torch.Tensor
    #: the per-token KL the penalty is charged on: ``kl`` clamped at zero (``clamped``) or ``kl`` itself (``k1``)
    penalized_kl: torch.Tensor


def kl_penalized_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                         mask: torch.Tensor, kl_coef: float, *, penalty: str = "clamped") -> ShapedRewards:
    """Per-token rewards ``-kl_coef * KL_t``, plus ``scores`` on each row's last real token.

    ``KL_t`` is ``max(log p_policy - log p_ref, 0)`` with ``penalty="clamped"`` (what AlpacaFarm's released PPO
    charges, and what its KL coefficients were tuned with: a token the policy finds *less* likely than the
    reference earns no bonus) or the plain sampled estimate ``log p_policy - log p_ref`` with ``"k1"``.
    """
    if penalty not in KL_PENALTIES:
        raise ValueError(f"unknown KL penalty {penalty!r}: one of {', '.join(KL_PENALTIES)}")
    kl = (logprobs - ref_logprobs) * mask
    penalized = kl.clamp(min=0.0) if penalty == "clamped" else kl
    rewards = -kl_coef * penalized
    has_tokens = (mask.sum(-1) > 0).to(rewards.dtype)
    final = (scores.to(rewards.dtype) * has_tokens).unsqueeze(-1)
    rewards = rewards.scatter_add(-1, last_token_index(mask).unsqueeze(-1), final)
    return ShapedRewards(rewards, kl, penalized)


def advantages_and_returns(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
                           response_length: int, gamma: float = 1.0, lam: float = 1.0,
                           whiten_rewards: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages (not yet whitened) and returns of a whole rollout batch, as the released code computes them.

    The released trainer holds every response padded to ``response_length`` columns (its ``max_new_tokens``),
    whitens the KL-shaped rewards over that whole ``[batch, response_length]`` tensor, padding included, keeping
    their mean, and runs GAE over every column. Whitening with the mean kept adds the same constant to every
    column, so a response's first-token return sums it over all ``response_length`` columns whatever the
    response's length: returns stay length-invariant. (Whitening over real tokens only, as this trainer once did,
    gave longer responses more of that constant: a length bonus or penalty whose sign was the reward model's
    arbitrary offset.)

    ``rewards``, ``values`` and ``mask`` are ``[batch, width]`` with ``width <= response_length``, zero after each
    row's last real token; the values of padding positions count as 0 (the released critic predicts them too, but
    our losses never read them). Returns ``(advantages, returns)`` on real tokens only (zero on padding).
    """
    batch, width = rewards.shape
    if width > response_length:
        raise ValueError(f"responses of {width} tokens are longer than response_length {response_length}")
    full_rewards = rewards.new_zeros(batch, response_length)
    full_values = values.new_zeros(batch, response_length)
    full_rewards[:, :width] = rewards * mask
    full_values[:, :width] = values * mask
    if whiten_rewards:
        full_rewards = whiten(full_rewards, shift_mean=False)
    full_mask = torch.ones_like(full_rewards)
    advantages, returns = compute_gae(full_rewards, full_values, full_mask, gamma=gamma, lam=lam)
    return advantages[:, :width] * mask, returns[:, :width] * mask


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0,
                lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016) over right-padded responses.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V`` = 0 after the last real token, and
    ``A_t = delta_t + gamma * lam * A_{t+1}``. Returns ``(advantages, returns)`` with ``returns = A + V``,
    both zero on padding. With ``gamma = lam = 1`` (the paper's setting) ``returns_t`` is the sum of the
    rewards from ``t`` to the end and ``A_t = returns_t - V_t``.
    """
    rewards = rewards * mask
    values = values * mask
    length = rewards.shape[-1]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[..., 0])
    for t in reversed(range(length)):
        next_value = values[..., t + 1] if t + 1 < length else torch.zeros_like(running)
        delta = rewards[..., t] + gamma * next_value - values[..., t]
        running = delta + gamma * lam * running
        advantages[..., t] = running
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def whiten(values: torch.Tensor, *, shift_mean: bool = True) -> torch.Tensor:
    """Standardise every entry of ``values`` to variance 1 (and mean 0 unless ``shift_mean=False``).

    Statistics over the whole tensor, padding included: ``(x - mean) / (std + eps)`` with the population
    standard deviation, as the released AlpacaFarm implementation whitens (``torch_ops.whiten``).
    """
    mean, std = values.mean(), values.std(unbiased=False)
    whitened = (values - mean) / (std + WHITEN_EPS)
    return whitened + mean if not shift_mean else whitened


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True) -> torch.Tensor:
    """:func:`whiten` over the entries where ``mask`` is 1 only; padding is 0.

    Called on a full rollout batch this is the paper's "normalize the advantage across the entire batch of
    rollouts" (Appendix B.1). The released code whitens the advantages of padding positions too; ours are
    masked out of every loss, so they are kept out of the statistics as well (see :func:`advantages_and_returns`).
    """
    mean = masked_mean(values, mask)
    std = masked_var(values, mask).sqrt()
    whitened = (values - mean) / (std + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask
