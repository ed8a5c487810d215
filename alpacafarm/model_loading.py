"""The model block of a recipe → loaded models: full precision, LoRA adapters (peft) or QLoRA (bitsandbytes).

One place decides dtype, device placement, quantization and adapters, so SFT, reward modelling, DPO, PPO and
generation all load models the same way. Heavy imports (torch, transformers, peft) happen inside functions.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from alpacafarm.errors import MissingPackageError, UserError
from alpacafarm.model_sources import resolve_model_path
from alpacafarm.prompts import PromptConditioning

if TYPE_CHECKING:
    from alpacafarm.recipe import ModelSpec


def torch_dtype(spec: ModelSpec) -> Any:
    """``auto``: bfloat16 on a GPU that supports it, else float32 (CPU training in half precision is slow and lossy)."""
    import torch

    if spec.dtype != "auto":
        return getattr(torch, spec.dtype)
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def device_map(spec: ModelSpec) -> Any:
    """Where ``device: auto`` puts a model: nowhere special on CPU; spread over the GPUs by one process; on its own
    GPU (``LOCAL_RANK``) by each of several processes, which hold a copy each ("auto" would spread every rank's
    models over every GPU). While DeepSpeed ZeRO-3 partitions a model as it loads (see :func:`zero3_partitioning`),
    none: its ``zero.Init`` places each rank's part on the rank's device, whatever ``device`` says."""
    import torch

    from alpacafarm import distributed

    if zero3_partitioning():
        return None
    if spec.device != "auto":
        return spec.device
    if not torch.cuda.is_available():
        return None
    return {"": distributed.local_rank()} if distributed.launched_processes() > 1 else "auto"


def zero3_partitioning() -> bool:
    """Whether models load partitioned across the ranks (a ZeRO-3 launch config while a trainer's arguments live;
    transformers then builds them inside DeepSpeed's ``zero.Init``)."""
    import sys

    if "deepspeed" not in sys.modules:  # transformers imports it for a ZeRO-3 config: nothing to ask otherwise
        return False
    from transformers.integrations import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


@contextlib.contextmanager
def loading_whole() -> Iterator[None]:
    """Models loaded inside are whole on every rank, not partitioned by ZeRO-3's ``zero.Init`` (a no-op otherwise).

    For frozen and inference models (a DPO reference, a reward model scoring, a generator): ``zero.Init`` is a
    collective (each weight is broadcast from the main rank), so a model only the main process loads would wait
    for the others forever; a trainer partitions what it trains (and TRL a ZeRO-3 reference) when it prepares it.
    Only the models a trainer trains load partitioned (``trainable=True``), which is what saves memory at load.
    """
    if not zero3_partitioning():
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig, deepspeed_config, unset_hf_deepspeed_config

    config = deepspeed_config()
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        # transformers holds a weak reference to a config object that only its owner (a trainer's arguments,
        # accelerate's DeepSpeed plugin) exposes: an object with the same config takes its place, kept alive here
        # until the next block puts another back. The owner's lasts as long in practice: a trainer's Accelerator
        # holds its plugin until the next trainer's arguments are built, and those announce their own config.
        _ANNOUNCED_ZERO3[:] = [HfDeepSpeedConfig(config)]


#: The DeepSpeed config :func:`loading_whole` announced again (transformers keeps only a weak reference to it).
_ANNOUNCED_ZERO3: list[Any] = []


def quantization_config(spec: ModelSpec) -> Any:
    """A ``BitsAndBytesConfig`` for ``quantization: 4bit|8bit`` (NF4 with double quantization, as QLoRA does)."""
    if spec.quantization is None:
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise MissingPackageError(f"quantization: {spec.quantization} needs bitsandbytes: "
                                  "pip install 'alpacafarm[qlora]'")
    from transformers import BitsAndBytesConfig

    if spec.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch_dtype(spec))


def lora_config(spec: ModelSpec, task_type: str = "CAUSAL_LM") -> Any:
    """The peft ``LoraConfig`` for the model block's ``lora:`` (None without one)."""
    if spec.lora is None:
        return None
    from peft import LoraConfig

    return LoraConfig(r=spec.lora.r, lora_alpha=spec.lora.alpha, lora_dropout=spec.lora.dropout,
                      target_modules=spec.lora.target_modules, task_type=task_type, bias="none")


def load_tokenizer(spec: ModelSpec, path: str | None = None, *, padding_side: str = "right") -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(path or spec.name), revision=spec.revision,
                                              trust_remote_code=spec.trust_remote_code)
    if tokenizer.pad_token is None:  # Llama-style tokenizers ship without one; padding is masked anyway
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    return tokenizer


def _load(auto_class: Any, spec: ModelSpec, path: str | None, *, partitioned: bool = False, **kwargs: Any) -> Any:
    location = resolve_model_path(path or spec.name)
    try:
        with contextlib.nullcontext() if partitioned else loading_whole():
            return auto_class.from_pretrained(location, revision=spec.revision, dtype=torch_dtype(spec),
                                              device_map=device_map(spec),
                                              quantization_config=quantization_config(spec),
                                              trust_remote_code=spec.trust_remote_code, **kwargs)
    except OSError as exc:
        hint = ("" if Path(location).exists()
                else " (offline? use a local folder or an offline alias such as smollm2-135m-instruct)")
        raise UserError(f"cannot load model {location!r}: {str(exc).splitlines()[0]}{hint}") from None


def load_causal_lm(spec: ModelSpec, path: str | None = None, *, partitioned: bool = False) -> Any:
    """The causal LM of the model block (or of ``path``, e.g. an SFT stage's output), quantized if asked.

    Whole on every rank; ``partitioned``: under ZeRO-3, partitioned as it loads (for a trainer to train).
    """
    from transformers import AutoModelForCausalLM

    model = _load(AutoModelForCausalLM, spec, path, partitioned=partitioned)
    if spec.device not in ("auto", "cpu") and spec.quantization is None and not zero3_partitioning():
        model = model.to(spec.device)
    return model


def _cast_to_weight_dtype(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    dtype = module.weight.dtype
    return tuple(a.to(dtype) if getattr(a, "is_floating_point", lambda: False)() else a for a in args)


def load_sequence_classifier(spec: ModelSpec, path: str | None = None, num_labels: int | None = None, *,
                             partitioned: bool = False) -> Any:
    """A sequence-classification head on the model (a reward model when ``num_labels == 1``); ``partitioned`` as
    for :func:`load_causal_lm`. ``num_labels`` None: a saved classifier keeps its own outputs (a reward-model
    ensemble has one per member), any other model gets one new output."""
    from transformers import AutoModelForSequenceClassification

    if num_labels is None:
        num_labels = saved_classifier_outputs(spec, path) or 1
    model = _load(AutoModelForSequenceClassification, spec, path, partitioned=partitioned, num_labels=num_labels)
    if spec.quantization is not None and hasattr(getattr(model, "score", None), "weight"):
        # bitsandbytes' CPU kernels return bfloat16 activations whatever the compute dtype, while the freshly
        # initialised (unquantized, trainable) score head stays in float32: feed it its own dtype. The hook
        # survives peft's copy of the head into modules_to_save.
        model.score.register_forward_pre_hook(_cast_to_weight_dtype)
    if model.config.pad_token_id is None:  # the head reads the last non-pad token, so it must know the pad id
        tokenizer = load_tokenizer(spec, path)
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def saved_classifier_outputs(spec: ModelSpec, path: str | None) -> int | None:
    """How many outputs the sequence classifier saved at ``path`` has; None when the folder holds another kind of
    model (a causal LM, whose config's ``num_labels`` is only transformers' default)."""
    from transformers import AutoConfig

    location = resolve_model_path(path or spec.name)
    if not (Path(location) / "config.json").is_file():
        return None
    config = AutoConfig.from_pretrained(location, trust_remote_code=spec.trust_remote_code)
    if not any(a.endswith("ForSequenceClassification") for a in config.architectures or ()):
        return None
    return int(config.num_labels)


def is_adapter_folder(path: str | Path) -> bool:
    """A folder holding peft adapters (``adapter_config.json``) rather than full weights."""
    return (Path(path) / "adapter_config.json").is_file()


def _merged(load: Any, spec: ModelSpec, path: str, *, classifier: bool = False, partitioned: bool = False) -> Any:
    """``load(spec, path)`` for full weights; for an adapter folder, its base (itself merged the same way, so an
    adapter trained on an adapter-trained base resolves the whole chain) with the adapters merged in (whole:
    merging needs every weight; a trainer partitions the result)."""
    if not is_adapter_folder(path):
        return load(spec, path, partitioned=partitioned)
    from peft import PeftConfig, PeftModel

    config = PeftConfig.from_pretrained(path)
    if classifier and config.task_type != "SEQ_CLS":
        # Causal-LM adapters (an SFT stage) would wrap the classifier in a generation wrapper it cannot serve;
        # the plain wrapper applies the same layer adapters (module names agree below the task head).
        config.task_type = None
    base = _merged(load, spec, resolve_model_path(config.base_model_name_or_path), classifier=classifier)
    return PeftModel.from_pretrained(base, path, config=config).merge_and_unload()


def load_merged_causal_lm(spec: ModelSpec, path: str, *, trainable: bool = False) -> Any:
    """The causal LM in ``path`` as plain weights: full weights as they are, peft adapters merged into their base.

    The one rule for starting from a trained policy: a trainer given a ``peft_config`` on a model whose adapters
    were attached would replace them with fresh ones and silently start from the base model instead.
    ``trainable``: the copy that trains, loaded with float32 master weights (:meth:`ModelSpec.for_training`) and,
    under ZeRO-3, partitioned as it loads; other copies load whole (:func:`loading_whole`).
    """
    return _merged(load_causal_lm, spec.for_training() if trainable else spec, path, partitioned=trainable)


def load_classifier(spec: ModelSpec, path: str, *, trainable: bool = False) -> Any:
    """A sequence classifier from ``path`` (one output, or one per member of a saved reward-model ensemble): full
    weights, or peft adapters merged into their base.

    An adapter folder (an un-merged LoRA SFT or reward model) names its base model; the classifier is built on
    that base and the adapters (and a saved ``score`` head, if any) are merged in, so callers get plain weights.
    ``trainable`` as for :func:`load_merged_causal_lm`.
    """
    return _merged(load_sequence_classifier, spec.for_training() if trainable else spec, path, classifier=True,
                   partitioned=trainable)


def enable_activation_checkpointing(model: Any) -> None:
    """Activation checkpointing, non-reentrant (works with frozen embeddings and LoRA)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    kwargs = {"use_reentrant": False}
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers before the rename
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def save_dtype(spec: ModelSpec) -> Any:
    """The torch dtype full weights are written in: ``save_dtype``, else ``dtype`` resolved as for loading."""
    import torch

    return getattr(torch, spec.save_dtype) if spec.save_dtype is not None else torch_dtype(spec)


def save_model(model: Any, tokenizer: Any, directory: str | Path, spec: ModelSpec | None = None, *,
               start_from: str | Path | None = None, state_dict: dict[str, Any] | None = None,
               conditioning: PromptConditioning | None = None, logger: Any = None) -> bool:
    """Write a trained model folder at ``directory``: the one function that does, for every trainer (full weights,
    LoRA or QLoRA adapters, adapters merged, adapters trained on an adapter folder). Returns whether adapters were
    merged into full weights.

    The folder holds the weights (or adapters), the tokenizer and, when ``conditioning`` is not empty, the prompt
    conditioning the model was trained behind (:class:`~alpacafarm.prompts.PromptConditioning`: it is sampled
    behind it). ``spec``, the recipe's model block, decides how the weights are written: full weights in its save
    dtype (:func:`save_dtype`; the model in memory is not touched, its float32 master weights may still train),
    adapters as they are, or merged into full weights when the block says ``merge_adapters`` or when ``start_from``
    (the folder training started from) is itself an adapter folder: new adapters on it describe a model that no
    folder holds (their base is the pre-SFT model). Without ``spec`` the model is written as it is. Quantized
    weights are written as they are.

    ``state_dict``: the full weights a caller gathered from a sharded model (``accelerator.get_state_dict``; an empty
    dict off the main process), written instead of the model's own (merging needs the model whole in memory, so it
    is not used then). Without one, DeepSpeed ZeRO-3's partitioned weights are gathered here
    (:func:`gathered_state_dict`, a collective): call it on every rank. Only the main process writes, into
    ``<directory>.partial``, renamed to ``directory`` when whole, so a folder at ``directory`` is always complete;
    a refused write (full disk, NaN weights) is one line and leaves nothing behind.
    """
    import shutil

    from alpacafarm import distributed

    merge = bool(spec is not None and spec.lora is not None
                 and (spec.merge_adapters or (start_from is not None and is_adapter_folder(start_from))))
    if state_dict is None:
        state_dict = gathered_state_dict(model)  # every rank: a collective under ZeRO-3
    if not distributed.is_main():
        return merge
    if merge and spec is not None and not spec.merge_adapters and logger is not None:
        logger.info("the starting model is an adapter folder: the new adapters are merged and saved as full weights")
    directory = Path(directory)
    check_finite_weights(model if state_dict is None or merge else state_dict, str(directory))
    full_weights = spec is not None and (spec.lora is None or merge)
    partial = directory.with_name(directory.name + ".partial")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        _save(merged_copy(model) if merge else model, tokenizer, partial,
              save_dtype(spec) if full_weights else None, None if merge else state_dict)
        if conditioning is not None and conditioning != PromptConditioning():
            conditioning.save(partial)
        shutil.rmtree(directory, ignore_errors=True)
        partial.rename(directory)
    except Exception as exc:  # a full disk surfaces as safetensors' own error type, not an OSError
        shutil.rmtree(partial, ignore_errors=True)
        error = _save_error(exc, directory)
        if error is None:
            raise
        raise error from exc
    return merge


def merged_copy(model: Any) -> Any:
    """The adapters of a peft ``model`` merged into a copy of its base: peft's ``merge_and_unload`` merges in place
    and drops the adapters, and a model saved mid-training (a PPO snapshot) must go on training as it was."""
    import copy

    return copy.deepcopy(model).merge_and_unload()


def gathered_state_dict(model: Any) -> dict[str, Any] | None:
    """The full weights of ``model`` when DeepSpeed ZeRO-3 partitioned them (on the main process; an empty dict
    elsewhere), else ``None`` (the model holds them whole: save its own state dict).

    A collective under ZeRO-3: every rank must call it. Weights are gathered one tensor at a time (never the whole
    model on a GPU at once) and copied to the CPU in their training dtype (float32 master weights).
    """
    import torch

    from alpacafarm import distributed

    parameters = dict(model.named_parameters())
    if not any(hasattr(p, "ds_id") for p in parameters.values()):
        return None
    if hasattr(model, "peft_config"):
        raise UserError("LoRA adapters under DeepSpeed ZeRO-3 are not supported yet; use zero2, ddp or fsdp2")
    import deepspeed

    whole: dict[int, torch.Tensor] = {}
    for parameter in parameters.values():
        with deepspeed.zero.GatheredParameters([parameter], modifier_rank=None):
            if distributed.is_main():
                whole[id(parameter)] = parameter.detach().to("cpu", copy=True)
    if not distributed.is_main():
        return {}
    # keep_vars: a state dict entry is the parameter itself, so tied weights map to the one gathered copy
    return {name: whole[id(t)] if id(t) in whole else t.detach().to("cpu", copy=True)
            for name, t in model.state_dict(keep_vars=True).items()}


def _save_error(exc: BaseException, directory: Path) -> Exception | None:
    """A one-line UserError for a save the file system refused (full disk, quota, permissions), else None."""
    import errno

    from alpacafarm.paths import path_error

    if isinstance(exc, OSError):
        return path_error(exc, directory, "save the model to")
    if type(exc).__name__ != "SafetensorError":
        return None
    text = str(exc)
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EROFS):
        if f"code: {code}," in text or os.strerror(code) in text:
            return path_error(OSError(code, os.strerror(code)), directory, "save the model to")
    first = (text.splitlines() or [""])[0][:200]
    return UserError(f"cannot save the model to {directory}: {first}")


def check_finite_weights(weights: Any, where: str) -> None:
    """Refuse to save weights holding NaN or infinity (a diverged training: the learning rate is too high): one
    line naming the first bad tensor. ``weights``: a model or a state dict."""
    import torch

    items = weights.items() if isinstance(weights, dict) else weights.named_parameters()
    for name, tensor in items:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise UserError(f"the trained weights for {where} are not finite (NaN or inf in {name}): training "
                            "diverged; lower learning_rate (or max_grad_norm) and run the stage again")


def _save(model: Any, tokenizer: Any, directory: Path, dtype: Any, state_dict: dict[str, Any] | None) -> None:
    is_adapters = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    quantized = getattr(model, "is_quantized", False) or getattr(model, "quantization_method", None) is not None
    if dtype is None or is_adapters or quantized:
        model.save_pretrained(directory, **({"state_dict": state_dict} if state_dict is not None else {}))
    else:
        import json

        state = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
                 for name, tensor in (model.state_dict() if state_dict is None else state_dict).items()}
        model.save_pretrained(directory, state_dict=state)
        # save_pretrained records the in-memory dtype; config.json must say how the weights were written
        config_file = directory / "config.json"
        config = json.loads(config_file.read_text(encoding="utf-8"))
        config["dtype"] = str(dtype).removeprefix("torch.")
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tokenizer.save_pretrained(directory)
