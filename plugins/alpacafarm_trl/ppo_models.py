"""The model layouts of the PPO trainer: who holds the policy, the value model, the reference and the reward.

In every layout the value model starts as the reward model (the paper's second modification of PPO): its value
of a whole sequence equals the reward model's score of it at step 0.

* Without LoRA (:class:`SeparateModels`): a trainable policy, a frozen reference copy and a value model that is
  a trainable copy of the reward model (:class:`ValueModel`: its backbone and its head read at every token).
* With ``lora:`` (and optionally 4-bit) in the model block (:class:`SharedBaseModels`): ONE base, the SFT
  model, carries the ``policy`` adapter, and the reference is that base with its adapters disabled. The critic
  then depends on the reward model's folder:

  - LoRA reward adapters trained on that same base: the base also carries ``value`` and ``reward`` adapters,
    both copies of the reward model's, with copies of its head;
  - full reward-model weights (a LoRA reward model trained on a LoRA SFT model is saved merged), or reward
    adapters on another base: :class:`RewardModelCritic`, the reward model itself (frozen, in the model
    block's dtype, quantized if asked) with a fresh zero-initialised LoRA ``value`` adapter on its backbone
    and a trainable copy of its head; the reward is scored by the same backbone with the adapter off.

The layouts are built from folders by :mod:`alpacafarm_trl.ppo_build`; the trainer
(:mod:`alpacafarm_trl.ppo_trainer`) only talks to the :class:`PolicyAndValue` interface.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from alpacafarm.errors import UserError
from alpacafarm_trl.ppo_core import Batch

#: Adapters on the shared base in the LoRA layout; the first two train.
POLICY, VALUE, REWARD = "policy", "value", "reward"
TRAINED_ADAPTERS = [POLICY, VALUE]


def disable_dropout(module: nn.Module) -> None:
    """Zero every dropout: the PPO ratio must compare the same function before and after an update."""
    for sub in module.modules():
        if isinstance(sub, nn.Dropout):
            sub.p = 0.0
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "attention_dropout"):
        config.attention_dropout = 0.0


def classifier_head(classifier: Any) -> nn.Linear:
    """The one-output linear head of a sequence classifier (``score`` in LLMs, ``classifier`` in BERT)."""
    for name in ("score", "classifier"):
        head = getattr(classifier, name, None)
        if isinstance(head, nn.Linear) and head.out_features == 1:
            return head
    raise UserError(f"{type(classifier).__name__} has no one-output linear head ('score' or 'classifier'), "
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


class PolicyAndValue:
    """What the trainer needs of its models: policy/reference logits, values, generation, trained weights."""

    device: torch.device
    #: the module that generates (the policy model, or the shared peft model)
    policy_module: Any

    def generate(self, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError

    def policy_logits(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def reference_logits(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def values(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def value_scope(self) -> contextlib.AbstractContextManager:
        """Wraps a value forward *and its backward* (the shared layout switches to the value adapter)."""
        return contextlib.nullcontext()

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Every trained tensor by a stable name (what a checkpoint stores)."""
        raise NotImplementedError

    def modules(self) -> list[nn.Module]:
        """Every distinct top-level module held (for mode switches and memory accounting)."""
        raise NotImplementedError

    def policy_export(self) -> Any:
        """What :func:`alpacafarm.modeling.save_model` saves as the trained policy."""
        raise NotImplementedError

    def reward_model(self) -> nn.Module | None:
        """A sequence classifier scoring with the reward model these models already hold (None: load it)."""
        return None

    def set_training(self, training: bool) -> None:
        for module in self.modules():
            module.train(training)


class ValueModel(nn.Module):
    """A backbone and a one-output head giving a value for every position (the critic)."""

    def __init__(self, backbone: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    @classmethod
    def from_classifier(cls, classifier: Any) -> ValueModel:
        """The critic initialised from a reward model: its backbone, and its score head read at each token."""
        return cls(getattr(classifier, classifier.base_model_prefix), classifier_head(classifier))

    def forward(self, batch: Batch) -> torch.Tensor:
        n = batch.response_ids.shape[1]
        hidden = self.backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                               position_ids=batch.position_ids, use_cache=False).last_hidden_state
        hidden = hidden[:, -(n + 1):-1]
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()


class SeparateModels(PolicyAndValue):
    """Full fine-tuning: a trainable policy, a frozen reference copy and a value model (4 with the RM)."""

    def __init__(self, policy: Any, reference: Any, value: ValueModel) -> None:
        self.policy, self.reference, self.value = policy, reference, value
        self.policy_module = policy
        self.reference.requires_grad_(False)
        for module in (policy, reference, value):
            disable_dropout(module)
        self.device = policy.get_input_embeddings().weight.device
        self._keep = _accepts_logits_to_keep(policy)
        #: ``through(part)`` runs ``"policy"`` or ``"value"``: the module itself, or under DeepSpeed the engine
        #: holding both (its backward bookkeeping hangs on the forward: :mod:`alpacafarm_trl.ppo_zero`)
        self.through: Any = lambda part: getattr(self, part)

    def generate(self, **kwargs: Any) -> torch.Tensor:
        return self.policy.generate(**kwargs)

    def policy_logits(self, batch: Batch) -> torch.Tensor:
        return _response_logits(self.through("policy"), batch, self._keep)

    def reference_logits(self, batch: Batch) -> torch.Tensor:
        return _response_logits(self.reference, batch, self._keep)

    def values(self, batch: Batch) -> torch.Tensor:
        return self.through("value")(batch)

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        params = {f"policy.{n}": p for n, p in self.policy.named_parameters() if p.requires_grad}
        params.update({f"value.{n}": p for n, p in self.value.named_parameters() if p.requires_grad})
        return params

    def modules(self) -> list[nn.Module]:
        return [self.policy, self.reference, self.value]

    def policy_export(self) -> Any:
        return self.policy


class SharedBaseModels(PolicyAndValue):
    """LoRA/QLoRA: one base model with a ``policy`` adapter; the reference is the base with adapters disabled.

    The critic is either on the same base (``value`` adapter + ``value_head``, with a frozen ``reward`` adapter
    + ``reward_head`` scoring the rewards), or a :class:`RewardModelCritic` on the reward model's own backbone
    (``critic``). No second copy of the policy's weights exists.
    """

    def __init__(self, peft_model: Any, *, base_name: str, value_head: nn.Linear | None = None,
                 reward_head: nn.Linear | None = None, critic: RewardModelCritic | None = None) -> None:
        if (value_head is None) == (critic is None):
            raise ValueError("give the value head of a value adapter on the shared base, or a critic")
        self.peft_model = self.policy_module = peft_model
        self.value_head = value_head
        self.reward_head = reward_head
        self.critic = critic
        self.base_name = base_name
        causal_lm = peft_model.get_base_model()
        self.backbone = getattr(causal_lm, causal_lm.base_model_prefix)
        self.config = causal_lm.config
        disable_dropout(peft_model)
        if reward_head is not None:
            reward_head.requires_grad_(False)
        self.device = causal_lm.get_input_embeddings().weight.device
        self._keep = _accepts_logits_to_keep(peft_model)
        lora = [(n, p) for n, p in peft_model.named_parameters() if "lora_" in n]
        self._trained = [p for n, p in lora if any(f".{a}." in n for a in TRAINED_ADAPTERS)]
        self._frozen = [p for n, p in lora if not any(f".{a}." in n for a in TRAINED_ADAPTERS)]
        self._active: str | None = None
        self._activate(POLICY)

    def _activate(self, name: str) -> None:
        if name == self._active:
            return
        self.peft_model.set_adapter(name)
        # set_adapter makes the active adapter trainable and freezes the others: restore what trains.
        for param in self._trained:
            param.requires_grad_(True)
        for param in self._frozen:
            param.requires_grad_(False)
        self._active = name

    @contextlib.contextmanager
    def adapter(self, name: str) -> Iterator[None]:
        """Run the shared model with adapter ``name`` active; the previously active one is restored after.

        Keep a backward pass inside the block: activation checkpointing recomputes the forward during
        backward, with whichever adapter is active then.
        """
        previous = self._active
        self._activate(name)
        try:
            yield
        finally:
            self._activate(previous or POLICY)

    def value_scope(self) -> contextlib.AbstractContextManager:
        return self.adapter(VALUE) if self.critic is None else contextlib.nullcontext()

    def generate(self, **kwargs: Any) -> torch.Tensor:
        with self.adapter(POLICY):
            return self.peft_model.generate(**kwargs)

    def policy_logits(self, batch: Batch) -> torch.Tensor:
        return _response_logits(self.peft_model, batch, self._keep)

    def reference_logits(self, batch: Batch) -> torch.Tensor:
        with self.peft_model.disable_adapter():
            return _response_logits(self.peft_model, batch, self._keep)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False).last_hidden_state

    def values(self, batch: Batch) -> torch.Tensor:
        if self.critic is not None:
            return self.critic(batch)
        n = batch.response_ids.shape[1]
        with self.adapter(VALUE):
            hidden = self.hidden_states(batch.input_ids, batch.attention_mask, batch.position_ids)
        hidden = hidden[:, -(n + 1):-1]
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        params = {f"model.{n}": p for n, p in self.peft_model.named_parameters()
                  if "lora_" in n and any(f".{a}." in n for a in TRAINED_ADAPTERS)}
        if self.critic is not None:
            params.update({f"critic.{n}": p for n, p in self.critic.named_parameters() if p.requires_grad})
        else:
            params.update({f"value_head.{n}": p for n, p in self.value_head.named_parameters()})
        return params

    def modules(self) -> list[nn.Module]:
        held = (self.peft_model, self.value_head, self.reward_head, self.critic)
        return [m for m in held if m is not None]

    def policy_export(self) -> PolicyAdapterExport:
        return PolicyAdapterExport(self)

    def reward_model(self) -> nn.Module:
        if self.critic is not None:
            return self.critic.reward_model()
        if self.reward_head is None:
            raise ValueError("this shared model has no reward adapter")
        return SharedRewardClassifier(self, self.reward_head)


class SharedRewardClassifier(nn.Module):
    """The reward model as a sequence classifier over the shared base (``reward`` adapter + reward head).

    Pools like transformers' classifiers (the rightmost token that is not padding), so scores equal those of
    the reward model folder loaded on its own; :class:`~alpacafarm.rewards.RewardScorer` can drive it.
    """

    def __init__(self, models: SharedBaseModels, head: nn.Linear) -> None:
        super().__init__()
        self._models = [models]  # a list: not a registered submodule (the base is not this module's to move)
        self.head = head
        self.config = models.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **_: Any) -> SimpleNamespace:
        models = self._models[0]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        with models.adapter(REWARD):
            hidden = models.hidden_states(input_ids, attention_mask)
        logits = self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)
        if self.config.pad_token_id is None:
            last = torch.full((input_ids.shape[0],), input_ids.shape[1] - 1, device=input_ids.device)
        else:
            not_pad = (input_ids != self.config.pad_token_id).to(torch.int64)
            last = (torch.arange(input_ids.shape[1], device=input_ids.device) * not_pad).argmax(-1)
        pooled = logits[torch.arange(input_ids.shape[0], device=logits.device), last.to(logits.device)]
        return SimpleNamespace(logits=pooled.unsqueeze(-1))


class RewardModelCritic(ValueModel):
    """The critic as the reward model plus a fresh LoRA ``value`` adapter: equal to the reward model at step 0.

    ``classifier`` is the reward model (frozen, as loaded: in the model block's dtype, quantized if asked).
    Its backbone gets a ``value`` adapter (``adapter_config``; LoRA's B matrices start at zero, so the adapter
    changes nothing yet) and the critic reads a trainable float32 copy of the score head at every token.
    :meth:`reward_model` scores with the same backbone, adapter off, and the original head: the reward model
    exactly as trained, without a second copy of its weights.
    """

    def __init__(self, classifier: Any, adapter_config: Any) -> None:
        from peft import get_peft_model

        head = classifier_head(classifier)
        classifier.requires_grad_(False)
        backbone = getattr(classifier, classifier.base_model_prefix)
        super().__init__(get_peft_model(backbone, adapter_config, adapter_name=VALUE), copy.deepcopy(head).float())
        self.head.requires_grad_(True)
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
    """The ``policy`` adapter of a shared model, saved as a plain top-level LoRA folder (as LoRA SFT saves).

    peft would save a non-default adapter in a sub-folder; this writes ``adapter_model.safetensors`` and
    ``adapter_config.json`` (naming the shared base) at the top, so ``load_causal_lm(spec, folder)`` and
    ``generate_outputs`` load it directly. ``merge_and_unload()`` returns the base with the policy merged in
    (it drops the other adapters: call it only when training is over).
    """

    def __init__(self, models: SharedBaseModels) -> None:
        self.models = models

    def save_pretrained(self, directory: str | Path) -> None:
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(self.models.peft_model, adapter_name=POLICY)
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()},
                  str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = copy.deepcopy(self.models.peft_model.peft_config[POLICY])
        config.base_model_name_or_path = self.models.base_name
        config.inference_mode = True
        config.save_pretrained(str(directory))

    def merge_and_unload(self) -> Any:
        peft_model = self.models.peft_model
        for name in (VALUE, REWARD):
            if name in peft_model.peft_config:
                peft_model.delete_adapter(name)
        return peft_model.merge_and_unload()
