"""PPO's models: the trained policy and value model as one module, the frozen reference and the reward model beside
them, built from the recipe's model block and the SFT and reward-model folders.

The policy and the critic train together as one :class:`ActorCritic` module, which the trainer hands to
``accelerate`` once (DDP, FSDP2 or DeepSpeed ZeRO-2/3 from the launch config): one forward gives the policy's
logits and the critic's values, one backward trains both. The critic is the reward model's backbone with a new
value head that starts at zero, as in the released AlpacaFarm implementation (``value_head_init: zero``; the
paper's "initialise the value model from the reward model" is the backbone; ``reward_head`` starts the head as a
copy of the reward model's score head instead, so that values are raw reward scores at step 0).

* Without LoRA (:class:`SeparateModels`): a trainable policy, a frozen reference copy, and a critic that is a
  trainable copy of the reward model's backbone (:class:`ValueModel`); the rewards are scored by the reward model
  loaded on its own.
* With ``lora:`` (and optionally 4-bit) in the model block (:class:`SharedBaseModels`): ONE base, the SFT model,
  carries the policy's adapter, and the reference is that base with its adapter disabled; the critic is the
  reward model itself (frozen, in the model block's dtype, quantized if asked) with a fresh LoRA ``value`` adapter
  on its backbone (:class:`RewardModelCritic`), and the rewards are scored by that backbone with the adapter off.
  No adapter is switched while a gradient is computed, so activation checkpointing recomputes exactly what ran.

Precision follows the project rule: what trains (the full policy and value model, or the LoRA adapters and the
value head) holds float32 master weights; the frozen copies (reference, reward model, a LoRA layout's bases) stay
in the model block's ``dtype`` (bfloat16 on a GPU by default), quantized if asked. The trainer
(:mod:`alpacafarm_methods.ppo.trainer`) only talks to the :class:`PolicyAndValue` interface.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from alpacafarm.errors import UserError
from alpacafarm.model_loading import (
    enable_activation_checkpointing,
    load_classifier,
    load_merged_causal_lm,
    lora_config,
)
from alpacafarm.training import fp32_master_weights
from alpacafarm_methods.ppo.rollouts import Batch

#: The critic's adapter in the LoRA layout (the policy's is peft's default adapter, saved as a plain LoRA folder).
VALUE = "value"
#: How the critic's head starts (``PPOMethodConfig.value_head_init``).
VALUE_HEAD_INITS = ("zero", "reward_head")


def build_models(spec: Any, sft_path: str, reward_path: str, *, gradient_checkpointing: bool,
                 value_head_init: str = "zero", logger: Any = None) -> PolicyAndValue:
    """The layout the model block asks for, from the SFT and reward-model folders: :class:`SharedBaseModels` with
    ``lora:``, else :class:`SeparateModels`.

    An un-merged LoRA SFT stage is merged into its base (so "adapters off" means the SFT model), and reward adapters
    into theirs, as :class:`~alpacafarm.rewards.RewardScorer` loads them. Without LoRA the policy and the reward
    model load as trainable copies (float32 master weights) beside a frozen reference; with it both load frozen, in
    the model block's dtype, quantized if asked."""
    shared = spec.lora is not None
    if not shared and spec.quantization is not None:
        raise UserError("PPO cannot train quantized weights: add 'lora:' to the model block to use quantization")
    policy = load_merged_causal_lm(spec, sft_path, trainable=not shared)
    reference = None if shared else load_merged_causal_lm(spec, sft_path)
    classifier = load_classifier(spec, reward_path, trainable=not shared)
    for model in (policy, classifier):
        if spec.quantization is not None:
            from peft import prepare_model_for_kbit_training

            prepare_model_for_kbit_training(model, use_gradient_checkpointing=bool(gradient_checkpointing),
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
        elif gradient_checkpointing:
            enable_activation_checkpointing(model)
    adapter = lora_config(spec)
    models = (SharedBaseModels(policy, classifier, adapter, value_head_init) if shared
              else SeparateModels(policy, reference, ValueModel.from_classifier(classifier, value_head_init)))
    fp32_master_weights(models.actor_critic)  # what trains: the policy and the critic (or their adapters)
    if logger is not None:
        logger.info("value model: %s a %s value head%s",
                    "the reward model (frozen) with a fresh LoRA adapter and" if shared
                    else "a trainable copy of the reward model's backbone with",
                    "new zero-initialised" if value_head_init == "zero" else "copy of its score head as the",
                    "; the rewards are scored by the same backbone with the adapter off" if shared else "")
    return models


class PolicyAndValue:
    """What the trainer needs of its models: the trained :class:`ActorCritic`, the reference and the reward."""

    #: the policy and the critic, trained together
    actor_critic: ActorCritic
    #: a sequence classifier scoring with the reward model these models already hold (None: load it on its own)
    reward_classifier: nn.Module | None = None

    def reference_logits(self, batch: Batch) -> torch.Tensor:
        """Logits of the frozen reference (the SFT model) predicting each response token."""
        raise NotImplementedError

    def frozen_modules(self) -> list[nn.Module]:
        """Models held beside the actor-critic (moved to the device, never trained)."""
        return []

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Every trained tensor by its name in :attr:`actor_critic` (what a checkpoint stores)."""
        return {n: p for n, p in self.actor_critic.named_parameters() if p.requires_grad}


class SeparateModels(PolicyAndValue):
    """Full fine-tuning: a trainable policy and critic, and a frozen reference copy of the policy."""

    def __init__(self, policy: Any, reference: Any, value: ValueModel) -> None:
        self.reference = reference.requires_grad_(False)
        for module in (policy, reference, value):
            disable_dropout(module)
        self.actor_critic = ActorCritic(policy, value)

    def reference_logits(self, batch: Batch) -> torch.Tensor:
        return response_logits(self.reference, batch)

    def frozen_modules(self) -> list[nn.Module]:
        return [self.reference]


class SharedBaseModels(PolicyAndValue):
    """LoRA/QLoRA: one SFT base with the policy's adapter (the reference is the base with it disabled) and a
    :class:`RewardModelCritic` on the reward model. No second copy of the policy's weights exists.

    ``base`` is the SFT model (frozen, quantized if asked), ``classifier`` the reward model, ``adapter`` the model
    block's LoRA config. The rewards are scored by the critic's backbone with its adapter off
    (:attr:`reward_classifier`)."""

    def __init__(self, base: Any, classifier: Any, adapter: Any, value_head_init: str = "zero") -> None:
        import copy

        from peft import get_peft_model

        value_adapter = copy.deepcopy(adapter)
        value_adapter.task_type = None  # on the bare backbone, not on a causal LM
        peft_model = get_peft_model(base, adapter)
        critic = RewardModelCritic(classifier, value_adapter, value_head_init)
        disable_dropout(peft_model)
        self.actor_critic = ActorCritic(peft_model, critic)
        self._peft_model = [peft_model]  # the reference runs it with the adapter off, outside any wrapper
        self.reward_classifier = critic.reward_model()

    def reference_logits(self, batch: Batch) -> torch.Tensor:
        peft_model = self._peft_model[0]
        with peft_model.disable_adapter():
            return response_logits(peft_model, batch)


class ActorCritic(nn.Module):
    """The policy and the critic as one module: what ``accelerate`` prepares, what one backward trains.

    ``forward`` returns the policy's logits predicting each response token (``[b, R, vocab]``, divided by nothing)
    and the critic's value before each response token (``[b, R]``, float32).
    """

    def __init__(self, policy: nn.Module, critic: ValueModel) -> None:
        super().__init__()
        self.policy = policy
        self.critic = critic
        # What accelerate's FSDP auto-wrap policy reads from the module it wraps: the transformer block classes
        self._no_split_modules = transformer_blocks(policy) + [
            name for name in transformer_blocks(critic) if name not in transformer_blocks(policy)]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                response_ids: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = Batch(input_ids, attention_mask, position_ids, response_ids, response_mask)
        return response_logits(self.policy, batch), self.critic(batch)


def response_logits(model: Any, batch: Batch) -> torch.Tensor:
    """Logits predicting each response token (positions ``P-1 .. P+R-2``), ``[b, R, vocab]``.

    Only those positions are computed (``logits_to_keep``, which the forward of transformers' causal LMs takes); a
    model whose forward does not is one line naming it."""
    n = batch.response_ids.shape[1]
    try:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False, logits_to_keep=n + 1).logits
    except TypeError as exc:
        if "logits_to_keep" not in str(exc):
            raise
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        raise UserError(f"PPO needs a causal LM whose forward takes logits_to_keep (transformers' text models do); "
                        f"{type(base).__name__} does not") from None
    return logits[:, -(n + 1):-1]


def transformer_blocks(model: nn.Module) -> list[str]:
    """The class names of ``model``'s repeated blocks (the modules of a ``ModuleList`` of one class, outermost
    lists only): the units FSDP shards and wraps one by one."""
    names: list[str] = []
    inside: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(prefix + ".") for prefix in inside):
            continue
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            inside.append(path)
            name = type(module[0]).__name__
            if name not in names:
                names.append(name)
    return names


def disable_dropout(module: nn.Module) -> None:
    """Zero every dropout: the PPO ratio must compare the same function before and after an update."""
    for sub in module.modules():
        if isinstance(sub, nn.Dropout):
            sub.p = 0.0
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "attention_dropout"):
        config.attention_dropout = 0.0


class ValueModel(nn.Module):
    """A backbone and a one-output head giving a value for every position (the critic)."""

    def __init__(self, backbone: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    @classmethod
    def from_classifier(cls, classifier: Any, head_init: str = "zero") -> ValueModel:
        """The critic on a reward model's backbone, with :func:`value_head` (zero at step 0 by default)."""
        return cls(getattr(classifier, classifier.base_model_prefix), value_head(classifier, head_init))

    def forward(self, batch: Batch) -> torch.Tensor:
        n = batch.response_ids.shape[1]
        hidden = self.backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                               position_ids=batch.position_ids, use_cache=False).last_hidden_state
        hidden = hidden[:, -(n + 1):-1]
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()


def classifier_head(classifier: Any) -> nn.Linear:
    """The linear head of a sequence classifier (``score`` in LLMs, ``classifier`` in BERT): one output, or one
    per member of a reward-model ensemble."""
    for name in ("score", "classifier"):
        head = getattr(classifier, name, None)
        if isinstance(head, nn.Linear):
            return head
    raise UserError(f"{type(classifier).__name__} has no linear head ('score' or 'classifier'), "
                    "so the value model cannot be initialised from this reward model")


def value_head(classifier: Any, init: str = "zero") -> nn.Linear:
    """A trainable float32 one-output head for the critic on ``classifier``'s backbone.

    ``zero`` (the released implementation): a new linear layer whose weight and bias are 0, so every value is 0
    at step 0, in the same units as the whitened returns it learns; ``reward_head``: a copy of the reward model's
    score head, so a sequence's value is its raw reward score at step 0 (an ensemble's members averaged: the
    mean member's score).
    """
    if init not in VALUE_HEAD_INITS:
        raise ValueError(f"value_head_init must be one of {', '.join(VALUE_HEAD_INITS)}, not {init!r}")
    source = classifier_head(classifier)
    if init == "reward_head":
        head = nn.Linear(source.in_features, 1, bias=source.bias is not None, dtype=torch.float32,
                         device=source.weight.device)
        with torch.no_grad():
            head.weight.copy_(source.weight.float().mean(0, keepdim=True))
            if source.bias is not None:
                head.bias.copy_(source.bias.float().mean(0, keepdim=True))
    else:
        head = nn.Linear(source.in_features, 1, bias=True, dtype=torch.float32, device=source.weight.device)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
    return head.requires_grad_(True)


class RewardModelCritic(ValueModel):
    """The critic as the reward model's backbone with a fresh LoRA ``value`` adapter and a new value head.

    ``classifier`` is the reward model (frozen, as loaded: in the model block's dtype, quantized if asked). Its
    backbone gets a ``value`` adapter (``adapter_config``; LoRA's B matrices start at zero) and the critic reads
    :func:`value_head` at every token. :meth:`reward_model` scores with the same backbone, adapter off, and the
    original head: the reward model exactly as trained, without a second copy of its weights.
    """

    def __init__(self, classifier: Any, adapter_config: Any, head_init: str = "zero") -> None:
        from peft import get_peft_model

        head = value_head(classifier, head_init)
        classifier.requires_grad_(False)
        backbone = getattr(classifier, classifier.base_model_prefix)
        super().__init__(get_peft_model(backbone, adapter_config, adapter_name=VALUE), head)
        self._classifier = [classifier]  # a list: its backbone is registered once, as self.backbone's base
        disable_dropout(self.backbone)

    def reward_model(self) -> AdapterOffClassifier:
        return AdapterOffClassifier(self._classifier[0], self.backbone)


class AdapterOffClassifier(nn.Module):
    """A sequence classifier run with the adapters of ``adapted`` (a peft model inside it) disabled."""

    def __init__(self, classifier: Any, adapted: Any) -> None:
        super().__init__()
        self.classifier = classifier
        self.config = classifier.config
        self._adapted = [adapted]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._adapted[0].disable_adapter():
            return self.classifier(*args, **kwargs)
