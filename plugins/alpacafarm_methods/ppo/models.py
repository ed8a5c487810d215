"""The model layouts of the PPO trainer: the trained policy and value model as one module, the frozen reference
and the reward model beside them.

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
  carries the ``policy`` adapter, and the reference is that base with its adapter disabled; the critic is the
  reward model itself (frozen, in the model block's dtype, quantized if asked) with a fresh LoRA ``value`` adapter
  on its backbone (:class:`RewardModelCritic`), and the rewards are scored by that backbone with the adapter off.
  No adapter is switched while a gradient is computed, so activation checkpointing recomputes exactly what ran.

The layouts are built from folders by :mod:`alpacafarm_methods.ppo.build`; the trainer
(:mod:`alpacafarm_methods.ppo.trainer`) only talks to the :class:`PolicyAndValue` interface.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

from alpacafarm.errors import UserError
from alpacafarm_methods.ppo.core import Batch

#: The adapters of the LoRA layout: the policy's on the shared SFT base, the critic's on the reward model.
POLICY, VALUE = "policy", "value"
#: How the critic's head starts (``PPOMethodConfig.value_head_init``).
VALUE_HEAD_INITS = ("zero", "reward_head")


def disable_dropout(module: nn.Module) -> None:
    """Zero every dropout: the PPO ratio must compare the same function before and after an update."""
    for sub in module.modules():
        if isinstance(sub, nn.Dropout):
            sub.p = 0.0
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "attention_dropout"):
        config.attention_dropout = 0.0


def classifier_head(classifier: Any) -> nn.Linear:
    """The linear head of a sequence classifier (``score`` in LLMs, ``classifier`` in BERT): one output, or one
    per member of a reward-model ensemble."""
    for name in ("score", "classifier"):
        head = getattr(classifier, name, None)
        if isinstance(head, nn.Linear):
            return head
    raise UserError(f"{type(classifier).__name__} has no linear head ('score' or 'classifier'), "
                    "so the value model cannot be initialised from this reward model")


def _accepts_logits_to_keep(model: Any) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def _response_logits(model: Any, batch: Batch, keep: bool) -> torch.Tensor:
    """Logits predicting each response token (positions ``P-1 .. P+R-2``), ``[b, R, vocab]``."""
    n = batch.response_ids.shape[1]
    kwargs = {"logits_to_keep": n + 1} if keep else {}
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids, use_cache=False, **kwargs).logits
    return logits[:, -(n + 1):-1]




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


class ActorCritic(nn.Module):
    """The policy and the critic as one module: what ``accelerate`` prepares, what one backward trains.

    ``forward`` returns the policy's logits predicting each response token (``[b, R, vocab]``, divided by nothing)
    and the critic's value before each response token (``[b, R]``, float32).
    """

    def __init__(self, policy: nn.Module, critic: ValueModel) -> None:
        super().__init__()
        self.policy = policy
        self.critic = critic
        self._keep = _accepts_logits_to_keep(policy)
        # FSDP's transformer auto-wrap reads the layer classes from the wrapped module
        self._no_split_modules = list(getattr(_base_model(policy), "_no_split_modules", None) or [])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                response_ids: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = Batch(input_ids, attention_mask, position_ids, response_ids, response_mask)
        return _response_logits(self.policy, batch, self._keep), self.critic(batch)


def _base_model(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class PolicyAndValue:
    """What the trainer needs of its models: the trained :class:`ActorCritic`, the reference and the reward."""

    #: the policy and the critic, trained together
    actor_critic: ActorCritic

    def reference_logits(self, batch: Batch) -> torch.Tensor:
        """Logits of the frozen reference (the SFT model) predicting each response token."""
        raise NotImplementedError

    def reward_model(self) -> nn.Module | None:
        """A sequence classifier scoring with the reward model these models already hold (None: load it)."""
        return None

    def policy_export(self, policy: Any) -> Any:
        """What :func:`alpacafarm.model_loading.save_model` saves as the trained policy (``policy``: the unwrapped
        one)."""
        return policy

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
        self._keep = _accepts_logits_to_keep(reference)

    def reference_logits(self, batch: Batch) -> torch.Tensor:
        return _response_logits(self.reference, batch, self._keep)

    def frozen_modules(self) -> list[nn.Module]:
        return [self.reference]


class SharedBaseModels(PolicyAndValue):
    """LoRA/QLoRA: one SFT base with a ``policy`` adapter (the reference is the base with it disabled) and a
    :class:`RewardModelCritic` on the reward model. No second copy of the policy's weights exists."""

    def __init__(self, peft_model: Any, *, base_name: str, critic: RewardModelCritic) -> None:
        self.base_name = base_name
        disable_dropout(peft_model)
        self.actor_critic = ActorCritic(peft_model, critic)
        self._keep = _accepts_logits_to_keep(peft_model)
        self._peft_model = [peft_model]  # the reference runs it with the adapter off, outside any wrapper

    def reference_logits(self, batch: Batch) -> torch.Tensor:
        peft_model = self._peft_model[0]
        with peft_model.disable_adapter():
            return _response_logits(peft_model, batch, self._keep)

    def reward_model(self) -> nn.Module:
        return self.actor_critic.critic.reward_model()

    def policy_export(self, policy: Any) -> PolicyAdapterExport:
        return PolicyAdapterExport(policy, self.base_name)


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


class PolicyAdapterExport:
    """The ``policy`` adapter of the shared model, saved as a plain top-level LoRA folder (as LoRA SFT saves).

    peft would save a non-default adapter in a sub-folder; this writes ``adapter_model.safetensors`` and
    ``adapter_config.json`` (naming the shared base) at the top, so ``load_causal_lm(spec, folder)`` and
    ``generate_outputs`` load it directly. ``merge_and_unload()`` returns the base with the policy merged in
    (call it only when training is over).
    """

    def __init__(self, peft_model: Any, base_name: str) -> None:
        self.peft_model = peft_model
        self.base_name = base_name

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, Any] | None = None) -> None:
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(self.peft_model, state_dict=state_dict, adapter_name=POLICY)
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()},
                  str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = copy.deepcopy(self.peft_model.peft_config[POLICY])
        config.base_model_name_or_path = self.base_name
        config.inference_mode = True
        config.save_pretrained(str(directory))

    def merge_and_unload(self) -> Any:
        return self.peft_model.merge_and_unload()
