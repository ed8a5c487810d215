"""The arithmetic of PPO for language models, as pure functions on tensors (no models, no I/O).

Conventions: per-token tensors are ``[batch, response_length]`` and right-padded; ``mask`` is 1 on the
real response tokens (a contiguous run from position 0) and 0 on the padding after them. Token ``t``'s value
is the critic's estimate before token ``t`` is emitted; token ``t``'s reward is the per-token KL penalty, plus
the sequence's reward-model score on the last real token (the paper's Eq. 3 spread over tokens). The penalty
is charged on the per-token KL clamped at zero by default, as the released AlpacaFarm implementation does
(:func:`kl_penalized_rewards`).

:class:`Batch` and :func:`collate` pack prompt and response token ids into the tensors that every forward
pass of the trainer and of the model layouts (:mod:`alpacafarm_methods.ppo.models`) reads; :class:`Rollouts` holds
one PPO step's samples and the per-token tensors computed from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from alpacafarm.sampling import Sample

#: Keeps whitening finite when every value in a batch is the same.
WHITEN_EPS = 1e-8


@dataclass
class Batch:
    """A micro-batch of prompt + response token sequences: prompts left-padded, responses right-padded."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor


def collate(queries: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
            device: torch.device | str = "cpu") -> Batch:
    """Pack prompts (left-padded to a common start of the response) and responses (right-padded).

    Position ids count real tokens only, as ``generate`` does with left padding, so a forward pass here sees
    the same positions as the sampling pass did.
    """
    n_query = max(len(q) for q in queries)
    n_response = max(max(len(r) for r in responses), 1)
    ids = torch.full((len(queries), n_query + n_response), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (query, response) in enumerate(zip(queries, responses, strict=True)):
        ids[row, n_query - len(query):n_query] = torch.tensor(query, dtype=torch.long)
        mask[row, n_query - len(query):n_query] = 1
        if response:
            ids[row, n_query:n_query + len(response)] = torch.tensor(response, dtype=torch.long)
            mask[row, n_query:n_query + len(response)] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    return Batch(ids, mask, positions, ids[:, n_query:], mask[:, n_query:].float())


@dataclass
class Rollouts:
    """One PPO step's samples and everything computed from them (per-token tensors ``[n, max response]``)."""

    records: list[dict[str, Any]]
    samples: list[Sample]
    scores: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    entropy: torch.Tensor
    rewards: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    penalized_kl: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    #: Where each row sits in the step's whole rollout batch (under several processes a rank holds some rows).
    positions: list[int] | None = None

    @property
    def queries(self) -> list[list[int]]:
        return [s.prompt_ids for s in self.samples]

    @property
    def responses(self) -> list[list[int]]:
        return [s.response_ids for s in self.samples]

    @property
    def texts(self) -> list[str]:
        return [s.text for s in self.samples]

    @property
    def ended(self) -> list[bool]:
        return [s.finished for s in self.samples]


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the positions where ``mask`` is 1 (0 when there are none)."""
    return masked_sum(values, mask) / mask.sum().clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance (ddof 0) over the positions where ``mask`` is 1."""
    mean = masked_mean(values, mask)
    return masked_mean((values - mean) ** 2, mask)


def sum_across_ranks(sums: dict[str, float]) -> dict[str, float]:
    """``sums`` added up over every rank (one all-reduce, float64); unchanged for one process."""
    from alpacafarm import distributed

    if distributed.world_size() == 1:
        return dict(sums)
    totals = torch.tensor(list(sums.values()), dtype=torch.float64)
    distributed.all_reduce_sum(totals)
    return dict(zip(sums, totals.tolist(), strict=True))


def rollout_means(rollouts: Rollouts, kl_coef: float) -> dict[str, float]:
    """A PPO step's logged rollout statistics: means over the whole rollout batch (per rollout, or per response
    token). Every rank holds the whole batch (:meth:`PPOTrainer.rollout` gathers it), so no reduction is needed."""
    mask = rollouts.mask.double()
    kl, penalized = rollouts.kl.sum(-1), rollouts.penalized_kl.sum(-1)
    non_score = -kl_coef * penalized
    per_rollout = {"score": rollouts.scores, "kl": kl, "penalized_kl": penalized, "non_score_reward": non_score,
                   "reward": rollouts.scores + non_score, "response_length": rollouts.mask.sum(-1),
                   "eos_fraction": torch.tensor(rollouts.ended, dtype=torch.float32)}
    per_token = {"entropy": rollouts.entropy, "value_mean": rollouts.values, "return_mean": rollouts.returns}
    n_rollouts, n_tokens = max(len(rollouts.scores), 1), max(float(mask.sum()), 1.0)
    means = {k: float(v.double().sum()) / n_rollouts for k, v in per_rollout.items()}
    means.update({k: float(masked_sum(v.double(), mask)) / n_tokens for k, v in per_token.items()})
    return means


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


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log p(token)`` under ``logits`` (``[..., vocab]``) gathered at ``tokens`` (``[...]``), in float32."""
    return torch.gather(logits.float().log_softmax(-1), -1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_of(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the categorical distribution of ``logits`` over the last dimension, in float32."""
    logits = logits.float()
    probs = logits.softmax(-1)
    return torch.logsumexp(logits, -1) - (probs * logits).sum(-1)


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
