"""One PPO step's data: the token tensors every forward pass reads and the rollout batch they make.

Conventions: per-token tensors are ``[batch, response_length]`` and right-padded; ``mask`` is 1 on the real
response tokens (a contiguous run from position 0) and 0 on the padding after them.

:class:`Batch` and :func:`collate` pack prompt and response token ids into the tensors that every forward pass of
the trainer and of the models (:mod:`alpacafarm_methods.ppo.models`) reads; :class:`Rollouts` holds one PPO step's
samples and the per-token tensors computed from them (:mod:`alpacafarm_methods.ppo.advantages` fills in the rewards,
advantages and returns); :func:`rollout_means` are the step's logged rollout statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from alpacafarm.sampling import Sample


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
