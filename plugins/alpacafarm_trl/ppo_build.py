"""PPO's models from the recipe's model block and the SFT and reward-model folders (the layouts of
:mod:`alpacafarm_trl.ppo_models`), with the value model starting as the reward model in every layout.

Precision follows the project rule: what trains (the full policy and value model, or the LoRA adapters and the
value head) holds float32 master weights; the frozen copies (reference, reward model, a LoRA layout's bases) stay
in the model block's ``dtype`` (bfloat16 on a GPU by default), quantized if asked.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from torch import nn

from alpacafarm.errors import UserError
from alpacafarm.modeling import enable_activation_checkpointing
from alpacafarm.training import fp32_master_weights
from alpacafarm_trl.ppo_models import (
    POLICY,
    REWARD,
    VALUE,
    PolicyAndValue,
    RewardModelCritic,
    SeparateModels,
    SharedBaseModels,
    ValueModel,
)


def _note(logger: Any, message: str, *args: Any) -> None:
    if logger is not None:
        logger.info(message, *args)


def build_models(spec: Any, sft_path: str, reward_path: str, *, gradient_checkpointing: bool,
                 logger: Any = None) -> PolicyAndValue:
    """The layout the model block asks for: :class:`SeparateModels`, or :func:`build_shared_models` with LoRA."""
    if spec.lora is not None:
        return build_shared_models(spec, sft_path, reward_path, gradient_checkpointing=gradient_checkpointing,
                                   logger=logger)
    if spec.quantization is not None:
        raise UserError("PPO cannot train quantized weights: add 'lora:' to the model block to use quantization")
    return build_separate_models(spec, sft_path, reward_path, gradient_checkpointing=gradient_checkpointing,
                                 logger=logger)


def build_separate_models(spec: Any, sft_path: str, reward_path: str, *, gradient_checkpointing: bool,
                          logger: Any = None) -> SeparateModels:
    """Full fine-tuning: the policy and the value model (a copy of the reward model) train, in float32."""
    from alpacafarm.modeling import load_classifier, load_merged_causal_lm

    policy = load_merged_causal_lm(spec, sft_path, trainable=True)
    reference = load_merged_causal_lm(spec, sft_path)
    value = ValueModel.from_classifier(load_classifier(spec, reward_path, trainable=True))
    if gradient_checkpointing:
        enable_activation_checkpointing(policy)
        enable_activation_checkpointing(value.backbone)
    fp32_master_weights(policy)
    fp32_master_weights(value)
    _note(logger, "value model: a trainable copy of the reward model (its backbone, and its score head read at "
                  "every token)")
    return SeparateModels(policy, reference, value)


def _same_model(a: str, b: str) -> bool:
    from alpacafarm.models import resolve_model_path

    return Path(resolve_model_path(a)).resolve() == Path(resolve_model_path(b)).resolve()


def _lora_to_float32(peft_model: Any) -> None:
    """Adapters as float32 before weights are loaded into them (peft may create them in the base's dtype)."""
    for name, param in peft_model.named_parameters():
        if "lora_" in name and param.is_floating_point():
            param.data = param.data.float()


def build_shared_models(spec: Any, sft_path: str, reward_path: str, *, gradient_checkpointing: bool,
                        logger: Any = None) -> SharedBaseModels:
    """One frozen base (the SFT model, quantized if asked) with a ``policy`` adapter, and the critic.

    The critic starts as the reward model in every case: reward adapters trained on this very base are copied
    into ``value`` and ``reward`` adapters on it (with the reward head); a full-weights reward model, or reward
    adapters on another base (loaded merged, as :class:`~alpacafarm.rewards.RewardScorer` loads them), becomes
    a :class:`~alpacafarm_trl.ppo_models.RewardModelCritic` (the reward model with a fresh adapter, which also
    scores the rewards with the adapter off).
    """
    from peft import PeftConfig, get_peft_model, prepare_model_for_kbit_training

    from alpacafarm.modeling import is_adapter_folder, load_classifier, load_merged_causal_lm, lora_config
    from alpacafarm.models import resolve_model_path

    # An un-merged LoRA SFT stage is merged into its base, so "adapters off" means the SFT model.
    base = load_merged_causal_lm(spec, sft_path)
    sft_is_adapters = is_adapter_folder(sft_path)
    if sft_is_adapters:
        base_name = PeftConfig.from_pretrained(sft_path).base_model_name_or_path
    else:
        base_name = str(resolve_model_path(sft_path))
    if spec.quantization is not None:
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=bool(gradient_checkpointing),
                                               gradient_checkpointing_kwargs={"use_reentrant": False})
    elif gradient_checkpointing:
        enable_activation_checkpointing(base)
    peft_model = get_peft_model(base, lora_config(spec), adapter_name=POLICY)

    reward_base = PeftConfig.from_pretrained(reward_path).base_model_name_or_path \
        if is_adapter_folder(reward_path) else None
    if reward_base is not None and not sft_is_adapters and _same_model(reward_base, sft_path):
        models = _value_adapters_on_the_shared_base(peft_model, reward_path, base_name)
        _note(logger, "value model: the reward model's LoRA adapters and score head, copied onto the shared SFT "
                      "base next to a frozen copy that scores the rewards")
    else:
        if reward_base is not None:
            _note(logger, "the reward model's adapters were trained on %s, not on the SFT model %s: it is loaded "
                          "with its adapters merged into their base", reward_base, sft_path)
        classifier = load_classifier(spec, reward_path)
        if spec.quantization is not None:
            classifier = prepare_model_for_kbit_training(
                classifier, use_gradient_checkpointing=bool(gradient_checkpointing),
                gradient_checkpointing_kwargs={"use_reentrant": False})
        elif gradient_checkpointing:
            enable_activation_checkpointing(classifier)
        adapter = lora_config(spec)
        adapter.task_type = None  # on the bare backbone, not on a causal LM
        critic = RewardModelCritic(classifier, adapter)
        fp32_master_weights(critic)
        models = SharedBaseModels(peft_model, base_name=base_name, critic=critic)
        _note(logger, "value model: the reward model (frozen) with a fresh zero-initialised LoRA adapter and a "
                      "trainable copy of its score head, so it equals the reward model at step 0; the rewards are "
                      "scored by the same backbone with the adapter off")
    fp32_master_weights(models.peft_model)  # the policy (and value) adapters: the ones that train
    return models


def _value_adapters_on_the_shared_base(peft_model: Any, reward_path: str, base_name: str) -> SharedBaseModels:
    """``value`` and ``reward`` adapters on the shared base, both loaded with the reward model's LoRA weights."""
    from peft import PeftConfig, set_peft_model_state_dict
    from peft.utils import load_peft_weights

    rm_config = PeftConfig.from_pretrained(reward_path)
    state = load_peft_weights(reward_path, device="cpu")
    head_state = {k.rsplit(".", 1)[-1]: v for k, v in state.items() if k.split(".")[-2] in ("score", "classifier")}
    adapter_state = {k: v for k, v in state.items() if "lora_" in k}
    if "weight" not in head_state:
        raise UserError(f"the reward adapters in {reward_path} carry no score head")
    adapter_config = copy.deepcopy(rm_config)
    adapter_config.modules_to_save = None
    adapter_config.task_type = "CAUSAL_LM"
    adapter_config.inference_mode = False
    for name in (VALUE, REWARD):
        peft_model.add_adapter(name, copy.deepcopy(adapter_config))
    _lora_to_float32(peft_model)
    for name in (VALUE, REWARD):
        result = set_peft_model_state_dict(peft_model, adapter_state, adapter_name=name)
        unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        if unexpected:
            raise UserError(f"the reward model's adapters do not fit the SFT model ({unexpected[0]} ...)")
    causal_lm = peft_model.get_base_model()
    device = causal_lm.get_input_embeddings().weight.device
    source_head = nn.Linear(causal_lm.config.hidden_size, 1, bias="bias" in head_state)
    source_head.load_state_dict(head_state)
    value_head = copy.deepcopy(source_head).float().to(device)
    value_head.requires_grad_(True)
    reward_head = copy.deepcopy(source_head).float().to(device)
    return SharedBaseModels(peft_model, base_name=base_name, value_head=value_head, reward_head=reward_head)
