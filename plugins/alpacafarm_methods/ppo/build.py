"""PPO's models from the recipe's model block and the SFT and reward-model folders (the layouts of
:mod:`alpacafarm_methods.ppo.models`), the critic on the reward model's backbone in every layout.

Precision follows the project rule: what trains (the full policy and value model, or the LoRA adapters and the
value head) holds float32 master weights; the frozen copies (reference, reward model, a LoRA layout's bases) stay
in the model block's ``dtype`` (bfloat16 on a GPU by default), quantized if asked.
"""

from __future__ import annotations

from typing import Any

from alpacafarm.errors import UserError
from alpacafarm.model_loading import enable_activation_checkpointing
from alpacafarm.training import fp32_master_weights
from alpacafarm_methods.ppo.models import (
    POLICY,
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
                 value_head_init: str = "zero", logger: Any = None) -> PolicyAndValue:
    """The layout the model block asks for: :class:`SeparateModels`, or :func:`build_shared_models` with LoRA."""
    if spec.lora is not None:
        return build_shared_models(spec, sft_path, reward_path, gradient_checkpointing=gradient_checkpointing,
                                   value_head_init=value_head_init, logger=logger)
    if spec.quantization is not None:
        raise UserError("PPO cannot train quantized weights: add 'lora:' to the model block to use quantization")
    return build_separate_models(spec, sft_path, reward_path, gradient_checkpointing=gradient_checkpointing,
                                 value_head_init=value_head_init, logger=logger)


def build_separate_models(spec: Any, sft_path: str, reward_path: str, *, gradient_checkpointing: bool,
                          value_head_init: str = "zero", logger: Any = None) -> SeparateModels:
    """Full fine-tuning: the policy and the critic (a copy of the reward model's backbone) train, in float32."""
    from alpacafarm.model_loading import load_classifier, load_merged_causal_lm

    policy = load_merged_causal_lm(spec, sft_path, trainable=True)
    reference = load_merged_causal_lm(spec, sft_path)
    value = ValueModel.from_classifier(load_classifier(spec, reward_path, trainable=True), value_head_init)
    if gradient_checkpointing:
        enable_activation_checkpointing(policy)
        enable_activation_checkpointing(value.backbone)
    fp32_master_weights(policy)
    fp32_master_weights(value)
    _note(logger, "value model: a trainable copy of the reward model's backbone with a %s value head",
          "new zero-initialised" if value_head_init == "zero" else "copy of its score head as the")
    return SeparateModels(policy, reference, value)


def build_shared_models(spec: Any, sft_path: str, reward_path: str, *, gradient_checkpointing: bool,
                        value_head_init: str = "zero", logger: Any = None) -> SharedBaseModels:
    """One frozen base (the SFT model, quantized if asked) with a ``policy`` adapter, and the critic: the reward
    model (frozen; reward adapters are loaded merged into their base, as :class:`~alpacafarm.rewards.RewardScorer`
    loads them) with a fresh ``value`` adapter and value head
    (:class:`~alpacafarm_methods.ppo.models.RewardModelCritic`),
    which also scores the rewards with the adapter off.
    """
    from peft import PeftConfig, get_peft_model, prepare_model_for_kbit_training

    from alpacafarm.model_loading import is_adapter_folder, load_classifier, load_merged_causal_lm, lora_config
    from alpacafarm.model_sources import resolve_model_path

    # An un-merged LoRA SFT stage is merged into its base, so "adapters off" means the SFT model.
    base = load_merged_causal_lm(spec, sft_path)
    if is_adapter_folder(sft_path):
        base_name = PeftConfig.from_pretrained(sft_path).base_model_name_or_path
    else:
        base_name = str(resolve_model_path(sft_path))
    classifier = load_classifier(spec, reward_path)
    if spec.quantization is not None:
        base, classifier = (prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=bool(gradient_checkpointing),
            gradient_checkpointing_kwargs={"use_reentrant": False}) for model in (base, classifier))
    elif gradient_checkpointing:
        enable_activation_checkpointing(base)
        enable_activation_checkpointing(classifier)
    peft_model = get_peft_model(base, lora_config(spec), adapter_name=POLICY)
    adapter = lora_config(spec)
    adapter.task_type = None  # on the bare backbone, not on a causal LM
    critic = RewardModelCritic(classifier, adapter, value_head_init)
    fp32_master_weights(critic)
    fp32_master_weights(peft_model)  # the policy adapter: what trains
    _note(logger, "value model: the reward model (frozen) with a fresh LoRA adapter and a %s value head; the rewards "
                  "are scored by the same backbone with the adapter off",
          "new zero-initialised" if value_head_init == "zero" else "copy of its score head as the")
    return SharedBaseModels(peft_model, base_name=base_name, critic=critic)
