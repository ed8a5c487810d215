"""PPO and Quark maths against the released implementation (``alpaca-farm==0.2.0``, imported at run time).

Each test feeds the same synthetic tensors to our functions and to the released ones, called unbound with a
``SimpleNamespace`` standing in for the released trainer's ``self`` (its KL controller, tokenizer and arguments)
and, for the losses, a stand-in policy that returns the given log-probabilities and values: the oracle is fed,
our code is not mocked. The released package is installed without its dependencies (README command 2:
``pip install --no-deps alpaca-farm==0.2.0``); without it these tests are skipped.

Conventions of the released code that the tests reproduce: responses are ``[batch, response_len]``, right-padded
with the pad token; log-probabilities are 0 on padding (``compute_logprobs`` ignores the pad token); the
released whitening asserts at least 8 rows. Where we deliberately differ (padding is masked out of the
advantage whitening and of the losses; Quark keeps only the top quantile and divides by real tokens), each test
states the exact relation and checks it.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from alpacafarm.sampling import Sample
from alpacafarm_methods.ppo.advantages import advantages_and_returns, kl_penalized_rewards, masked_whiten, whiten
from alpacafarm_methods.ppo.losses import approx_policy_kl, clipped_policy_loss, clipped_value_loss

PAD = 0  # the released `_shape_reward` finds each row's last token by counting non-pad tokens
SEEDS = (0, 1, 2, 3)
RELEASED_VERSION = "0.2.0"


@pytest.fixture(scope="module")
def released() -> SimpleNamespace:
    """The released modules, imported with what transformers 5 removed shimmed in for the import only.

    ``alpaca_farm.common`` imports ``is_deepspeed_zero3_enabled`` from ``transformers.trainer`` (moved to
    ``transformers.integrations``); the trainers import ``unwrap_model`` from ``transformers.modeling_utils``.
    A missing name is set before the import and removed right after, so nothing else sees it.
    """
    if importlib.util.find_spec("alpaca_farm") is None:
        pytest.skip("alpaca-farm==0.2.0 is not installed (pip install --no-deps alpaca-farm==0.2.0, "
                    "README command 2)")
    import transformers.modeling_utils
    import transformers.trainer
    from transformers.integrations import is_deepspeed_zero3_enabled

    shims = [(transformers.trainer, "is_deepspeed_zero3_enabled", is_deepspeed_zero3_enabled),
             (transformers.modeling_utils, "unwrap_model", lambda model: getattr(model, "module", model))]
    added = []
    for module, name, value in shims:
        if not hasattr(module, name):
            setattr(module, name, value)
            added.append((module, name))
    try:
        package = importlib.import_module("alpaca_farm")
        modules = {name: importlib.import_module(f"alpaca_farm.{path}") for name, path in (
            ("ppo", "rl.ppo_trainer"), ("quark", "rl.quark_trainer"), ("torch_ops", "torch_ops"),
            ("rl_models", "models.rl_models"), ("data", "data_preprocessor"))}
    finally:
        for module, name in added:
            delattr(module, name)
    assert package.__version__ == RELEASED_VERSION
    return SimpleNamespace(**modules)


# ------------------------------------------------------------------------------------------------ synthetic data


def synthetic(seed: int, batch: int = 10, width: int = 12, *, offset: float = 0.0) -> dict[str, torch.Tensor]:
    """Right-padded responses of random lengths (one full row, one of a single token), float64 tensors.

    ``logprobs``/``ref_logprobs`` and ``values`` are 0 on padding, as the released code holds them.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    lengths[0], lengths[1] = width, 1
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    responses = torch.randint(PAD + 1, 100, (batch, width), generator=g)
    responses[mask == 0] = PAD
    logprobs = -3 * torch.rand(batch, width, generator=g, dtype=torch.float64) * mask
    ref_logprobs = -3 * torch.rand(batch, width, generator=g, dtype=torch.float64) * mask
    values = torch.randn(batch, width, generator=g, dtype=torch.float64) * mask
    scores = offset + 2 * torch.randn(batch, generator=g, dtype=torch.float64)
    return {"mask": mask, "responses": responses, "logprobs": logprobs, "ref_logprobs": ref_logprobs,
            "values": values, "scores": scores, "lengths": lengths}


def released_self(kl_coef: float = 0.0, **args: Any) -> SimpleNamespace:
    """What the released PPOTrainer methods read from ``self``."""
    return SimpleNamespace(kl_ctl=SimpleNamespace(value=kl_coef), tokenizer=SimpleNamespace(pad_token_id=PAD),
                           args=SimpleNamespace(**args), accelerator=SimpleNamespace(device="cpu"))


def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours.double(), theirs.double(), rtol=1e-9, atol=1e-10)


# ------------------------------------------------------------------------------------------------ KL shaping


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_shaping_equals_released_shape_reward(released: SimpleNamespace, seed: int):
    data = synthetic(seed)
    kl_coef = 0.05
    theirs = released.ppo.PPOTrainer._shape_reward(
        released_self(kl_coef), rewards=data["scores"], responses=data["responses"], logprobs=data["logprobs"],
        ref_logprobs=data["ref_logprobs"])
    ours = kl_penalized_rewards(data["scores"], data["logprobs"], data["ref_logprobs"], data["mask"],
                                         kl_coef, penalty="clamped")
    # Released padding has log-probabilities 0, hence KL 0 and shaped reward 0: equal on every position.
    close(ours.rewards, theirs["shaped_rewards"])
    close(ours.penalized_kl, theirs["kl"])
    close(-kl_coef * ours.penalized_kl, theirs["non_score_rewards"])
    assert bool((ours.kl < 0).any())  # the clamp did something: the unclamped estimate differs
    close(ours.kl.clamp(min=0), theirs["kl"])


# ------------------------------------------------------------------------------------------------ whitening + GAE


@pytest.mark.parametrize("seed", SEEDS)
def test_whiten_equals_released_whiten(released: SimpleNamespace, seed: int):
    values = torch.randn(9, 7, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 3
    for shift_mean in (True, False):
        close(whiten(values, shift_mean=shift_mean), released.torch_ops.whiten(values, shift_mean=shift_mean))


def released_gae(released: SimpleNamespace, rewards: torch.Tensor, values: torch.Tensor, *, response_len: int,
                 gamma: float, lam: float, whiten_rewards: bool = True) -> dict[str, torch.Tensor]:
    """The released ``_estimate_advantage`` on ``[batch, response_len]`` tensors (ours padded with zeros)."""
    full = torch.zeros(rewards.shape[0], response_len, dtype=rewards.dtype)
    full_rewards, full_values = full.clone(), full.clone()
    full_rewards[:, :rewards.shape[1]] = rewards
    full_values[:, :values.shape[1]] = values
    args = {"whiten_rewards": whiten_rewards, "response_len": response_len, "gamma": gamma, "lam": lam}
    return released.ppo.PPOTrainer._estimate_advantage(released_self(**args), full_rewards, full_values)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.9, 0.95)])
@pytest.mark.parametrize("whiten_rewards", [True, False])
def test_returns_and_advantages_equal_released_estimate_advantage(released: SimpleNamespace, seed: int,
                                                                  gamma: float, lam: float, whiten_rewards: bool):
    response_len = 16  # the released max_new_tokens; our tensors are only as wide as the longest response (12)
    data = synthetic(seed, batch=10, width=12, offset=1.5)
    mask = data["mask"]
    shaped = kl_penalized_rewards(data["scores"], data["logprobs"], data["ref_logprobs"], mask, 0.05)
    advantages, returns = advantages_and_returns(shaped.rewards, data["values"], mask,
                                                          response_length=response_len, gamma=gamma, lam=lam,
                                                          whiten_rewards=whiten_rewards)
    theirs = released_gae(released, shaped.rewards, data["values"], response_len=response_len, gamma=gamma,
                          lam=lam, whiten_rewards=whiten_rewards)
    width = mask.shape[1]
    their_returns = theirs["returns"][:, :width]
    close(returns, their_returns * mask)
    # Before whitening, the released advantages are returns - values (values 0 on padding here).
    their_raw_advantages = their_returns - data["values"]
    close(advantages, their_raw_advantages * mask)
    # The documented difference: our advantages are whitened over real tokens only; the released ones over the
    # whole [batch, response_len] tensor, padding included. Ours equal the released whitening applied to the
    # real-token entries of the released (unwhitened) advantages.
    real = mask.bool()
    whitened = masked_whiten(advantages, mask)
    close(whitened[real], released.torch_ops.whiten(their_raw_advantages[real], shift_mean=True))
    assert bool((whitened[~real] == 0).all())
    # ... and they are not the released final advantages, which also count the padding's 4 extra columns.
    assert not torch.allclose(whitened[real], theirs["advantages"][:, :width][real])


def rollouts_of(data: dict[str, torch.Tensor]) -> Any:
    """Our trainer's rollout batch from the synthetic tensors (float32 as the trainer holds them)."""
    from alpacafarm_methods.ppo.rollouts import Rollouts

    lengths = [int(n) for n in data["lengths"]]
    samples = [Sample([1, 2], [7] * n, "x" * n, True) for n in lengths]
    width = max(lengths)
    return Rollouts(records=[{} for _ in lengths], samples=samples, scores=data["scores"].float(),
                    mask=data["mask"][:, :width].float(), logprobs=data["logprobs"][:, :width].float(),
                    ref_logprobs=data["ref_logprobs"][:, :width].float(), values=data["values"][:, :width].float(),
                    entropy=torch.zeros(len(lengths), width))


def ppo_args(tmp_path: Path, **overrides: Any) -> Any:
    from alpacafarm_methods.ppo.config import PPOMethodConfig

    values = {"output_dir": str(tmp_path), "rollout_batch_size": 8, "mini_batch_size": 8, "report_to": "none",
              **overrides}
    return PPOMethodConfig(**values)


def our_compute_advantages(args: Any, rollouts: Any) -> Any:
    from alpacafarm_methods.ppo.trainer import PPOTrainer

    return PPOTrainer.compute_advantages(SimpleNamespace(args=args), rollouts)


@pytest.mark.parametrize("seed", SEEDS)
def test_compute_advantages_end_to_end_equals_released(released: SimpleNamespace, tmp_path: Path, seed: int):
    response_len, kl_coef = 16, 0.05
    data = synthetic(seed, batch=10, width=12, offset=-2.0)
    args = ppo_args(tmp_path, max_new_tokens=response_len, kl_coef=kl_coef)
    ours = our_compute_advantages(args, rollouts_of(data))
    shaped = released.ppo.PPOTrainer._shape_reward(
        released_self(kl_coef), rewards=data["scores"], responses=data["responses"], logprobs=data["logprobs"],
        ref_logprobs=data["ref_logprobs"])
    theirs = released_gae(released, shaped["shaped_rewards"], data["values"], response_len=response_len,
                          gamma=args.gamma, lam=args.lam)
    mask, real = data["mask"], data["mask"].bool()
    tol = {"rtol": 1e-4, "atol": 1e-5}  # our trainer holds float32
    torch.testing.assert_close(ours.rewards.double(), shaped["shaped_rewards"], **tol)
    torch.testing.assert_close(ours.returns.double(), theirs["returns"][:, :12] * mask, **tol)
    raw = (theirs["returns"][:, :12] - data["values"])[real]
    torch.testing.assert_close(ours.advantages.double()[real], released.torch_ops.whiten(raw), **tol)


@pytest.mark.parametrize("offset", [1.0, -1.0, 3.0, -3.0])
def test_returns_are_length_invariant_as_released(released: SimpleNamespace, tmp_path: Path, offset: float):
    """8 rows of lengths 2 and 8 (pairs with equal scores), zero KL, values 0: the same first-token return.

    Whitening the shaped rewards over real tokens only and keeping their mean (this trainer before ec44d22)
    gave every real token mean * (1 - 1/std): a length bonus or penalty signed by the score offset.
    """
    response_len = 300
    lengths = torch.tensor([2, 8] * 4)
    width = 8
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    scores = offset + 0.25 * torch.arange(8, dtype=torch.float64).div(2, rounding_mode="floor")  # pairs equal
    zeros = torch.zeros(8, width, dtype=torch.float64)
    data = {"mask": mask, "lengths": lengths, "scores": scores, "logprobs": zeros, "ref_logprobs": zeros,
            "values": zeros}
    ours = our_compute_advantages(ppo_args(tmp_path, max_new_tokens=response_len), rollouts_of(data))
    first = ours.returns[:, 0].double()
    short, long = first[0::2], first[1::2]
    torch.testing.assert_close(short, long, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"first-token returns depend on the length: length 2 "
                                             f"{short.tolist()} vs length 8 {long.tolist()}; {m}")
    shaped = kl_penalized_rewards(scores, zeros, zeros, mask, 0.0).rewards
    theirs = released_gae(released, shaped, zeros, response_len=response_len, gamma=1.0, lam=1.0)
    # ours in float32 (as the trainer holds rollouts), summed over 300 columns; the released formula in float64
    torch.testing.assert_close(first, theirs["returns"][:, 0], rtol=1e-3, atol=1e-4)


# ------------------------------------------------------------------------------------------------ losses


def released_losses(released: SimpleNamespace, *, new_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                    advantages: torch.Tensor, vpred: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                    cliprange: float, cliprange_value: float) -> dict[str, float]:
    """The released ``compute_loss`` with a stand-in policy returning the given log-probabilities and values."""

    def policy(queries: Any, query_attn_masks: Any, responses: Any, temperature: Any = None) -> dict[str, Any]:
        return {"logprobs": new_logprobs, "values": vpred, "entropies": torch.zeros_like(new_logprobs)}

    rows = new_logprobs.shape[0]
    rollouts = {"values": old_values, "logprobs": old_logprobs, "returns": returns, "advantages": advantages,
                "queries": torch.ones(rows, 3, dtype=torch.long), "query_attn_masks": torch.ones(rows, 3),
                "responses": torch.ones_like(new_logprobs, dtype=torch.long)}
    owner = released_self(cliprange=cliprange, cliprange_value=cliprange_value, vf_coef=0.1, temperature=1.0)
    owner.policy = policy
    _, stats = released.ppo.PPOTrainer.compute_loss(owner, rollouts)
    return {key: float(stats[key]) for key in ("loss/policy", "loss/value", "policy/clipfrac", "val/clipfrac",
                                                "policy/approxkl")}


def loss_inputs(seed: int, batch: int = 8, width: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(batch, width, generator=g, dtype=torch.float64)
    new = old + 0.3 * torch.randn(batch, width, generator=g, dtype=torch.float64)  # some ratios clip
    old_values = torch.randn(batch, width, generator=g, dtype=torch.float64)
    return {"new_logprobs": new, "old_logprobs": old,
            "advantages": torch.randn(batch, width, generator=g, dtype=torch.float64),
            "vpred": old_values + 0.4 * torch.randn(batch, width, generator=g, dtype=torch.float64),
            "old_values": old_values, "returns": torch.randn(batch, width, generator=g, dtype=torch.float64)}


def our_losses(inputs: dict[str, torch.Tensor], mask: torch.Tensor, cliprange: float,
               cliprange_value: float) -> dict[str, float]:
    policy = clipped_policy_loss(inputs["new_logprobs"], inputs["old_logprobs"], inputs["advantages"],
                                          mask, cliprange)
    value = clipped_value_loss(inputs["vpred"], inputs["old_values"], inputs["returns"], mask,
                                        cliprange_value)
    return {"loss/policy": float(policy.loss), "loss/value": float(value.loss),
            "policy/clipfrac": float(policy.clip_fraction), "val/clipfrac": float(value.clip_fraction),
            "policy/approxkl": float(approx_policy_kl(inputs["new_logprobs"], inputs["old_logprobs"],
                                                               mask))}


@pytest.mark.parametrize("seed", SEEDS)
def test_clipped_losses_equal_released_compute_loss_without_padding(released: SimpleNamespace, seed: int):
    inputs = loss_inputs(seed)
    mask = torch.ones_like(inputs["new_logprobs"])
    ours = our_losses(inputs, mask, 0.2, 0.2)
    theirs = released_losses(released, **inputs, cliprange=0.2, cliprange_value=0.2)
    assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-7)
    assert 0 < theirs["policy/clipfrac"] < 1 and 0 < theirs["val/clipfrac"] < 1  # both clips are exercised


@pytest.mark.parametrize("seed", SEEDS)
def test_clipped_losses_with_padding_equal_released_on_the_real_tokens_only(released: SimpleNamespace, seed: int):
    """Our losses are masked means; the released ``compute_loss`` averages over padding too. Ours equal the
    released ones computed on the real tokens alone (gathered into one row)."""
    inputs = loss_inputs(seed)
    lengths = torch.randint(1, 11, (8,), generator=torch.Generator().manual_seed(100 + seed))
    lengths[0] = 10
    mask = (torch.arange(10)[None, :] < lengths[:, None]).double()
    ours = our_losses(inputs, mask, 0.2, 0.2)
    real = {key: value[mask.bool()].unsqueeze(0) for key, value in inputs.items()}
    theirs = released_losses(released, **real, cliprange=0.2, cliprange_value=0.2)
    assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-7)
    padded = released_losses(released, **inputs, cliprange=0.2, cliprange_value=0.2)
    assert ours["loss/policy"] != pytest.approx(padded["loss/policy"], rel=1e-6)  # the difference is real


# ------------------------------------------------------------------------------------------------ value head


def test_value_head_starts_at_zero_on_the_reward_models_backbone_as_released(released: SimpleNamespace):
    """Released PPO (``init_value_with_reward``) puts a new zero-initialised head on the reward model's backbone,
    so every value is exactly 0 at step 0; ours must too (not the reward model's score head)."""
    from alpacafarm.testing import tiny_causal_lm, tiny_sequence_classifier, tiny_tokenizer
    from alpacafarm_methods.ppo.models import ValueModel
    from alpacafarm_methods.ppo.rollouts import collate

    tokenizer = tiny_tokenizer()
    queries, responses = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]]

    theirs = released.rl_models.make_value_with_base_model(SimpleNamespace(), tiny_causal_lm(tokenizer), tokenizer)
    assert bool((theirs.value_head.weight == 0).all()) and bool((theirs.value_head.bias == 0).all())
    query_ids = torch.tensor([[tokenizer.pad_token_id, 5, 6, 7], [tokenizer.pad_token_id] * 2 + [8, 9]])
    response_ids = torch.tensor([[10, 11, tokenizer.pad_token_id], [12, 13, 14]])
    their_values = theirs(query_ids, (query_ids != tokenizer.pad_token_id).long(), response_ids)["values"]
    assert bool((their_values == 0).all())

    classifier = tiny_sequence_classifier(tokenizer)
    assert float(classifier.score.weight.detach().abs().sum()) > 0  # reusing this head: values != 0
    ours = ValueModel.from_classifier(classifier)
    with torch.no_grad():
        values = ours(collate(queries, responses, tokenizer.pad_token_id))
    assert values.shape == (2, 3)
    assert bool((values == 0).all()), f"values at step 0 are not 0: {values}"
    backbone = getattr(classifier, classifier.base_model_prefix)
    assert all(p is q for p, q in zip(ours.backbone.parameters(), backbone.parameters(), strict=True))


# ------------------------------------------------------------------------------------------------ Quark


@pytest.mark.parametrize("bins", [2, 3, 4, 5])
@pytest.mark.parametrize("size", [8, 9, 30, 512])
def test_quark_top_quantile_is_the_released_top_bin(released: SimpleNamespace, bins: int, size: int):
    """The released ``DataPool`` sorts the pool by reward and cuts it into ``bins`` chunks of ``size // bins``
    (the last takes the remainder); the best-quantile variant trains on the first chunk. Ours keeps
    ``top_quantile(rewards, 1 / bins)``: the same samples, ties going to the earlier sample in both."""
    from alpacafarm_methods.quark.selection import top_quantile

    g = torch.Generator().manual_seed(size * 10 + bins)
    rewards = torch.randint(0, size // 2, (size,), generator=g).tolist()  # many ties
    tokens = [f"<reward_{i}>" for i in range(bins)]
    pool = released.quark.DataPool(SimpleNamespace(additional_special_tokens=tokens))
    pool.add(queries=[f"q{i}" for i in range(size)], responses=[f"r{i}" for i in range(size)], rewards=rewards)
    queries, _, _ = pool.sort_and_get(train_on_best_quantile=True)
    theirs = sorted(int(q[1:]) for q in queries)
    assert top_quantile(rewards, 1 / bins) == theirs
    assert len(theirs) == size // bins

    # Our deliberate difference: only the best-quantile variant. In the released all-quantiles variant, the
    # samples conditioned on the best reward token (<reward_0>) are exactly the ones we keep.
    queries, _, _ = pool.sort_and_get(train_on_best_quantile=False)
    best_token = [int(q[len(tokens[0]) + 1:]) for q in queries if q.startswith(tokens[0])]
    assert sorted(best_token) == theirs


def test_quark_keeps_one_sample_where_the_released_top_bin_is_empty(released: SimpleNamespace):
    """A pool smaller than the number of bins: the released top bin is empty (``size // bins`` = 0); ours keeps
    the single best sample so that a tiny pool still trains (``kept_count``'s documented floor of one)."""
    from alpacafarm_methods.quark.selection import top_quantile

    pool = released.quark.DataPool(SimpleNamespace(additional_special_tokens=[f"<reward_{i}>" for i in range(4)]))
    pool.add(queries=["a", "b", "c"], responses=["x", "y", "z"], rewards=[0.1, 0.9, 0.5])
    assert pool.sort_and_get(train_on_best_quantile=True)[0] == []
    assert top_quantile([0.1, 0.9, 0.5], 0.25) == [1]


class ReleasedTokenizer:
    """What the released Quark ``compute_loss`` reads from its tokenizer (no reward tokens: best quantile)."""

    def __init__(self, pad_token_id: int, vocab_size: int) -> None:
        self.pad_token_id, self.vocab_size = pad_token_id, vocab_size
        self.additional_special_tokens_ids: list[int] = []

    def __len__(self) -> int:
        return self.vocab_size


class GivenOutputs:
    """A stand-in released policy: returns the given response logits and their log-probabilities."""

    def __init__(self, outputs: dict[str, torch.Tensor]) -> None:
        self.outputs = outputs

    def train(self) -> None:
        """The released ``compute_loss`` puts its policy in training mode first."""

    def __call__(self, queries: Any, query_attn_masks: Any, responses: Any, temperature: Any = None) -> dict:
        return self.outputs


@pytest.mark.parametrize(("seed", "temperature"), [(0, 1.0), (1, 1.0), (0, 0.7), (1, 1.5)])
def test_quark_loss_equals_released_up_to_its_padding_denominator(released: SimpleNamespace, tmp_path: Path,
                                                                  seed: int, temperature: float):
    """The same samples through our ``QuarkTrainer.compute_loss`` (real tiny models) and the released
    ``compute_loss`` fed the same models' response logits: NLL on the kept samples' tokens plus
    ``kl_coef * KL(policy || reference)`` per token, no entropy term (the paper's setting).

    Documented difference: the released loss is a mean over ``[batch, response_len]`` with padding counted (as
    0); ours is a mean over real tokens. So ``released * batch * response_len == ours * real tokens``, and the
    two are equal when no response is padded. At a rollout temperature other than 1 the released policy's forward
    divides its logits (and the reference's) by it before the log-probabilities, the KL and the loss; so must ours."""
    from alpacafarm.testing import tiny_causal_lm, tiny_tokenizer
    from alpacafarm_methods.quark.config import QuarkMethodConfig
    from alpacafarm_methods.quark.trainer import build_quark_trainer, training_example

    tokenizer = tiny_tokenizer()
    pad, kl_coef = tokenizer.pad_token_id, 0.05
    args = QuarkMethodConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, step_batch_size=4,
                             kl_coef=kl_coef, temperature=temperature, report_to="none", disable_tqdm=True)
    trainer = build_quark_trainer(args, tiny_causal_lm(tokenizer, seed=seed), tokenizer,
                                  [{"instruction": "not sampled here"}], lambda records, texts: [0.0] * len(texts),
                                  ref_model=tiny_causal_lm(tokenizer, seed=seed + 10))
    g = torch.Generator().manual_seed(seed)
    for response_lengths in ([5, 2, 7, 3], [6, 6, 6, 6]):
        samples = [Sample(torch.randint(4, 2048, (p,), generator=g).tolist(),
                          torch.randint(4, 2048, (r,), generator=g).tolist(), "", False)
                   for p, r in zip([3, 6, 4, 5], response_lengths, strict=True)]
        batch = trainer.data_collator([training_example(s, train_eos=True) for s in samples])
        with torch.no_grad():
            ours = float(trainer.compute_loss(trainer.model, batch))
            logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            ref_logits = trainer.ref_model(input_ids=batch["input_ids"],
                                           attention_mask=batch["attention_mask"]).logits
        width = max(response_lengths)
        responses = torch.full((4, width), pad)
        policy_logits = torch.zeros(4, width, logits.shape[-1])
        reference_logits = torch.zeros_like(policy_logits)
        for row, s in enumerate(samples):
            n, start = len(s.response_ids), len(s.prompt_ids) - 1  # logits at t predict token t + 1
            responses[row, :n] = torch.tensor(s.response_ids)
            policy_logits[row, :n] = logits[row, start:start + n] / temperature  # as the released forward
            reference_logits[row, :n] = ref_logits[row, start:start + n] / temperature
        logprobs = released.torch_ops.compute_logprobs(policy_logits, responses, ignore_index=pad)
        owner = SimpleNamespace(
            policy=GivenOutputs({"logits": policy_logits, "logprobs": logprobs}),
            ref_policy=GivenOutputs({"logits": reference_logits}),
            tokenizer=ReleasedTokenizer(pad, logits.shape[-1]),
            args=SimpleNamespace(temperature=temperature, num_reward_tokens=0),
            kl_ctl=SimpleNamespace(value=kl_coef), entropy_ctl=SimpleNamespace(value=0.0),
            accelerator=SimpleNamespace(device="cpu"))
        batch_for_released = {"queries": torch.ones(4, 2, dtype=torch.long),
                              "query_attn_masks": torch.ones(4, 2, dtype=torch.long), "responses": responses}
        theirs, stats = released.quark.QuarkTrainer.compute_loss(owner, batch_for_released)
        real_tokens = sum(response_lengths)
        assert float(theirs) * 4 * width == pytest.approx(ours * real_tokens, rel=1e-5)
        if len(set(response_lengths)) == 1:
            assert float(theirs) == pytest.approx(ours, rel=1e-5)
        # its per-token KL average is ours: the KL term is the same divergence
        with torch.no_grad():
            _, kl, mask, _ = trainer.token_terms(trainer.model, batch)
        assert float(stats["train/kl_avg_seq"]) == pytest.approx(float(kl[mask].mean()), rel=1e-5)
        assert float(stats["train/kl_avg_seq"]) > 1e-3  # two different models: the KL term is exercised


def test_quark_trains_the_tokens_the_released_trainer_trains_no_eos(released: SimpleNamespace):
    """The released rollout decodes responses without special tokens and its ``QueryResponseDataset``
    re-tokenizes query + response: a finished sample's EOS is gone. Our default (``train_eos: false``) trains
    exactly those tokens; ``train_eos: true`` adds the stop token."""
    from alpacafarm.testing import tiny_tokenizer
    from alpacafarm_methods.quark.config import QuarkMethodConfig
    from alpacafarm_methods.quark.trainer import IGNORE_INDEX, training_example

    tokenizer = tiny_tokenizer()
    query, text = "Tell me about rivers.\n", "Rivers flow to the sea and carry water."
    prompt_ids = tokenizer(query)["input_ids"]
    sample = Sample(prompt_ids, tokenizer(text)["input_ids"] + [tokenizer.eos_token_id], text, True)
    decoded = tokenizer.decode(sample.response_ids, skip_special_tokens=True)  # as the released rollout does
    dataset = released.data.QueryResponseDataset(tokenizer=tokenizer, queries=[query], responses=[decoded],
                                                 query_len=32, response_len=32)
    their_targets = [t for t in dataset.responses[0].tolist() if t != tokenizer.pad_token_id]

    def targets(example: dict[str, list[int]]) -> list[int]:
        return [t for t in example["labels"] if t != IGNORE_INDEX]

    default = QuarkMethodConfig.__dataclass_fields__["train_eos"].default
    assert default is False
    assert targets(training_example(sample, train_eos=default)) == their_targets
    assert tokenizer.eos_token_id not in their_targets
    assert targets(training_example(sample, train_eos=True)) == [*their_targets, tokenizer.eos_token_id]
    cut = Sample(prompt_ids, sample.response_ids[:-1], text, False)  # cut at max_new_tokens: nothing to drop
    assert targets(training_example(cut, train_eos=False)) == their_targets
