"""Head-only reward model (``trainable_layers: 0``): the Bradley-Terry loss on a frozen SFT backbone's features.

With the backbone frozen, the reward of a text is ``w · h(text)``, where ``h`` is the backbone's final hidden
state at the last real token — exactly what the sequence classifier's ``score`` head reads — or, with ``pooling:
mean``, averaged over the answer's tokens (the saved config then says so, and
:class:`~alpacafarm.rewards.RewardScorer` applies the ``score`` head to that average). ``h`` does not
change during training, so it is computed once per *distinct* text (in the model block's ``inference_dtype``)
instead of once per pair side per epoch as ``RewardTrainer`` would; with several pairs per sampled answer
(``preference_data`` with ``k`` > 2 and ``pairing: all``) that is most of the cost of a CPU reward model.
The head is then fitted full-batch with Adam on standardised features (L2 penalty ``weight_decay``) and
written back as the classifier's ``score`` weight (the standardisation folded in), so the saved folder is an
ordinary sequence classifier that :class:`~alpacafarm.rewards.RewardScorer` and PPO load unchanged.

An ensemble (``ensemble_size`` k > 1) is k heads on the one set of features, saved as a classifier with k outputs:
member ``i`` is fitted on a bootstrap resample of the training pairs (drawn with replacement, seed + i). Coste et
al. (2024) vary the seed of each member's training instead; a full-batch fit of this convex loss from a zero
start reaches the same head whatever the seed, so members are made to differ by their data, as in bagging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from alpacafarm.readings import default_store
from alpacafarm.rewards import POOLING_ATTRIBUTE, answer_mean_features, last_token_features, with_eos

#: Full-batch optimiser steps per epoch (the head has one weight per hidden unit; 100 steps converge).
STEPS_PER_EPOCH = 100


def fit_head(features: Any, chosen: Sequence[int], rejected: Sequence[int], *, learning_rate: float, steps: int,
             weight_decay: float, seed: int, log_every: int = 10) -> tuple[Any, list[dict[str, float]]]:
    """Bradley-Terry head on ``features``: maximise log sigmoid(w . (f[c] - f[r])) over the pairs; returns ``w``
    (for raw features) and the loss/accuracy log."""
    import torch

    torch.manual_seed(seed)
    mean, std = features.mean(0), features.std(0).clamp_min(1e-6)
    x = (features - mean) / std
    diff = x[list(chosen)] - x[list(rejected)]
    w = torch.zeros(features.shape[1], requires_grad=True)
    optimizer = torch.optim.Adam([w], lr=learning_rate)
    history = []
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        margin = diff @ w
        loss = -torch.nn.functional.logsigmoid(margin).mean() + weight_decay * (w @ w)
        loss.backward()
        optimizer.step()
        if step % log_every == 0 or step == steps:
            history.append({"step": step, "loss": round(float(loss.detach()), 6),
                            "accuracy": round(float((margin > 0).float().mean()), 6)})
    # score(f) = w · (f - mean) / std = (w / std) · f + const; a constant never changes a comparison.
    return (w.detach() / std), history


def train_head_only(config: Any, spec: Any, model_path: str, rows: list[dict[str, str]], *, seed: int,
                    progress: Any = None) -> tuple[Any, Any, dict[str, Any]]:
    """Fit the score head of a classifier on ``model_path`` from prompt/chosen/rejected ``rows``.

    Returns the classifier (training dtype, ``score`` set), its tokenizer, and metrics with ``log_history``.
    """
    import torch

    from alpacafarm.model_loading import load_classifier, load_tokenizer

    tokenizer = load_tokenizer(spec, model_path)
    eos = tokenizer.eos_token
    texts: dict[tuple[str, str], int] = {}  # distinct (prompt, answer) -> feature row
    pairs = []
    for row in rows:
        ids = []
        for side in ("chosen", "rejected"):
            ids.append(texts.setdefault((row["prompt"], row[side]), len(texts)))
        pairs.append(ids)
    inference = load_classifier(spec.for_inference(), model_path)
    if config.pooling == "mean":
        features = answer_mean_features(inference, tokenizer, [p for p, _ in texts], [a for _, a in texts],
                                        batch_size=config.score_batch_size, max_length=config.max_length,
                                        progress=progress, store=default_store())
    else:
        features = last_token_features(inference, tokenizer, [with_eos(p + a, eos) for p, a in texts],
                                       batch_size=config.score_batch_size, max_length=config.max_length,
                                       progress=progress)
    del inference
    steps = config.max_steps if config.max_steps and config.max_steps > 0 else \
        max(1, round(config.num_train_epochs * STEPS_PER_EPOCH))
    weights, history = [], []
    for member, member_pairs in enumerate(member_samples(pairs, config.ensemble_size, seed)):
        weight, log = fit_head(features, [c for c, _ in member_pairs], [r for _, r in member_pairs],
                               learning_rate=config.learning_rate, steps=steps, weight_decay=config.weight_decay,
                               seed=seed + member)
        weights.append(weight)
        history.extend({**entry, "member": member} if config.ensemble_size > 1 else entry for entry in log)
    model = load_classifier(spec, model_path)
    model.config.pad_token_id = tokenizer.pad_token_id
    if config.pooling != "last":  # RewardScorer reads it back from the saved config
        setattr(model.config, POOLING_ATTRIBUTE, config.pooling)
    if len(weights) > 1:  # one output per member
        model.score = torch.nn.Linear(model.score.in_features, len(weights), bias=False,
                                      dtype=model.score.weight.dtype, device=model.score.weight.device)
        model.config.num_labels = len(weights)
    with torch.no_grad():
        model.score.weight.copy_(torch.stack(weights).to(model.score.weight.dtype))
    last = [entry for entry in history if entry["step"] == steps]
    metrics = {"train_loss": round(sum(e["loss"] for e in last) / len(last), 6),
               "train_accuracy": round(sum(e["accuracy"] for e in last) / len(last), 6), "steps": steps,
               "ensemble_size": len(weights), "n_distinct_texts": len(texts), "log_history": history}
    return model, tokenizer, metrics


def member_samples(pairs: list[Any], members: int, seed: int) -> list[list[Any]]:
    """The training pairs of each ensemble member: all of them for a single reward model; for k > 1, k bootstrap
    resamples (as many pairs, drawn with replacement; member ``i`` from seed + i)."""
    import random

    if members == 1:
        return [pairs]
    return [random.Random(seed + i).choices(pairs, k=len(pairs)) for i in range(members)]
