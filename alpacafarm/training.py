"""What trainer-based methods share: machine-aware config defaults, per-stage trainer arguments, checkpoints.

For any method built on a ``transformers.Trainer`` / TRL trainer (the built-in ones and third-party plugins):

* :class:`TrainingDefaults` — inherit it first in a ``TrainingArguments`` subclass
  (``@dataclass class MyConfig(TrainingDefaults, trl.DPOConfig)``): ``bf16`` and gradient checkpointing are then
  chosen for the machine (TRL's configs default to ``bf16=True`` and checkpointing on; both are wrong on a CPU:
  bf16 makes ``TrainingArguments`` refuse to build there, checkpointing only slows a small model down), and on
  several CPU processes the trainer spans them all (:func:`shared_process_state`);
* :func:`stage_training_args` — the config for this stage (``output_dir`` = the stage folder, the stage seed),
  built right before its trainer: building it sets accelerate's process state up afresh;
* :func:`resume_checkpoint` — the newest readable checkpoint an interrupted attempt left (half-written ones are
  skipped with a warning), for ``trainer.train(resume_from_checkpoint=...)``: the one way every trainer finds its
  checkpoint. TRL / ``transformers.Trainer`` stages write theirs with the Trainer; our own loops (PPO, Quark) with
  :func:`save_checkpoint` and read them back with :func:`load_checkpoint` (``accelerator.save_state`` /
  ``load_state``);
* saving what was trained is :func:`alpacafarm.model_loading.save_model`'s job (one function for every trainer);
* :func:`fp32_master_weights` — trainable tensors as float32 master copies (load the trained model with
  ``trainable=True``, see :meth:`alpacafarm.recipe.ModelSpec.for_training`; frozen copies keep ``dtype``);
* :func:`train_summary`, :func:`limit`.

Heavy imports (torch, transformers) happen inside functions.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("alpacafarm")


@dataclass
class TrainingDefaults:
    """Mixin for ``TrainingArguments`` subclasses: ``bf16`` / ``gradient_checkpointing`` ``None`` = automatic."""

    bf16: bool | None = None
    gradient_checkpointing: bool | None = None

    def __post_init__(self) -> None:
        check_training_values(self)
        apply_device_defaults(self)
        for name, value in shared_process_state(self).items():
            setattr(self, name, value)
        super().__post_init__()  # type: ignore[misc]  # TrainingArguments.__post_init__
        check_process_count(self)


#: Fields of TRL's and transformers' configs that neither checks, with the smallest value a run can use: a
#: negative learning rate or a batch of 0 passed ``recipe check`` and crashed the stage after its inputs were built.
#: (name, smallest allowed, whether the bound itself is allowed); a field a config does not have is skipped.
TRAINING_BOUNDS: tuple[tuple[str, float, bool], ...] = (
    ("learning_rate", 0.0, True), ("per_device_train_batch_size", 1, True), ("per_device_eval_batch_size", 1, True),
    ("gradient_accumulation_steps", 1, True), ("num_train_epochs", 0.0, False), ("max_grad_norm", 0.0, True),
    ("weight_decay", 0.0, True), ("warmup_ratio", 0.0, True), ("beta", 0.0, True),
    ("max_length", 8, True), ("max_prompt_length", 1, True), ("max_completion_length", 1, True),
    ("num_generations", 2, True), ("generation_batch_size", 1, True), ("logging_steps", 0.0, False))


def check_training_values(config: object) -> None:
    """Refuse values no run can use (:data:`TRAINING_BOUNDS`; ``max_steps`` is -1 or at least 1), as a
    ``ValueError`` naming the field, when the config is built: ``recipe check`` then refuses what the run would."""
    import math

    for name, low, inclusive in TRAINING_BOUNDS:
        value = getattr(config, name, None)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value) or (value < low if inclusive else value <= low):
            raise ValueError(f"{name} must be a finite number {'>=' if inclusive else '>'} {low:g}, got {value}")
    steps = getattr(config, "max_steps", None)
    if isinstance(steps, int) and not isinstance(steps, bool) and steps != -1 and steps < 1:
        raise ValueError(f"max_steps must be -1 (use num_train_epochs) or at least 1, got {steps}")


def apply_device_defaults(config: object) -> None:
    """Resolve ``bf16`` and gradient checkpointing for this machine; runs before ``TrainingArguments.__post_init__``.

    ``bf16: None`` (the default) means bfloat16 autocast only on a GPU that supports it. An explicit ``bf16: true``
    is honoured where the hardware computes bfloat16: such a GPU, or, with no GPU, a CPU with AVX512-BF16 or AMX
    (:func:`alpacafarm.hardware.native_bfloat16`; autocast with float32 master weights, 1.5-1.8x faster per step
    than float32 on such a CPU, ``benchmarks/training_precision.py``, though a DPO run learned less under it:
    ``docs/reports/2026-12-02-training-precision.md``); elsewhere it is turned off with a note
    (so a GPU recipe still loads and checks on a laptop, and a CPU never trains in emulated bfloat16, tens of times
    slower). A CPU is never chosen automatically: autocast changes a run's numbers, so a recipe opts in.
    Gradient checkpointing left unset is on with CUDA (memory is what matters there) and off elsewhere.
    """
    import torch

    from alpacafarm.hardware import BFLOAT16_CPU_FLAGS, cpu_flags, native_bfloat16

    cuda = torch.cuda.is_available()
    bf16_ok = torch.cuda.is_bf16_supported() if cuda else native_bfloat16("cpu")
    notes: list[str] = []
    if config.bf16 is None:
        config.bf16 = cuda and bf16_ok and not config.fp16
    elif config.bf16 and not bf16_ok:
        notes.append("bf16: true needs bfloat16 arithmetic in hardware (a GPU from Ampere on, or a CPU with "
                     f"{' or '.join(sorted(BFLOAT16_CPU_FLAGS))}); this machine has none, so training runs in float32")
        config.bf16 = False
    elif config.bf16 and not cuda:
        found = ", ".join(sorted(BFLOAT16_CPU_FLAGS & cpu_flags()))
        notes.append(f"bf16: true: training with bfloat16 autocast on this CPU ({found}), float32 master weights")
        config.use_cpu = True  # TrainingArguments refuses bf16 without a GPU unless told it trains on the CPU
    if config.gradient_checkpointing is None and config.activation_checkpointing is None:
        # Set the new name directly: setting the deprecated alias makes transformers warn on every config.
        config.activation_checkpointing = cuda
    object.__setattr__(config, "device_notes", notes)


#: TrainingArguments' own default seed; a config still holding it gets the stage's seed instead.
DEFAULT_TRAINER_SEED = 42


def stage_seed(config: Any, context: Any) -> int:
    """The seed a stage trains with: the config's own, or the stage seed where it holds the trainer default (the
    pipeline derives the stage seed from the recipe seed and the stage name)."""
    return context.seed if config.seed == DEFAULT_TRAINER_SEED else config.seed


def stage_training_args(config: Any, context: Any, **overrides: Any) -> Any:
    """A copy of the method's config for this stage: ``output_dir`` is the stage folder, the seed the stage's
    (:func:`stage_seed`); ``overrides`` set further fields (``output_dir`` too, for a folder inside the stage's).

    ``output_dir`` is the stage directory (checkpoints must live where the pipeline can resume them); a user-given
    one is ignored with a note. The copy is built once, with every field at once: building ``TrainingArguments``
    sets accelerate's process state up afresh for it (transformers resets the state a previous trainer left, its
    DeepSpeed plugin and mixed precision with it), so build it right before the stage's trainer.
    """
    stage_dir = str(context.stage_dir)
    if config.output_dir not in (None, "trainer_output", stage_dir):
        context.logger.warning("stage %s: output_dir %r ignored; checkpoints go to the stage folder %s",
                               context.stage, config.output_dir, stage_dir)
    for note in getattr(config, "device_notes", ()):
        context.logger.warning("stage %s: %s", context.stage, note)
    # TrainingDefaults applies shared_process_state itself; other configs need it here
    values = {"output_dir": stage_dir, "seed": stage_seed(config, context), **shared_process_state(config),
              **overrides}
    # dataclasses.replace re-runs __post_init__ on already-normalised values, which TrainingArguments accepts;
    # the recipe's config object itself stays untouched (it is part of the stage fingerprint).
    args = dataclasses.replace(config, **values)
    check_process_count(args)
    return args


def shared_process_state(config: Any) -> dict[str, Any]:
    """The ``TrainingArguments`` fields that make a trainer span every launched process on a CPU-only machine
    (nothing where one process runs, or GPUs do). Set them before ``TrainingArguments.__post_init__``.

    Building ``TrainingArguments`` resets accelerate's process state and rebuilds it from the arguments and the
    environment. With several processes but no GPU accelerate names no backend unless told the run is on CPU:
    every rank then counts one process, so DDP trains each rank alone on all the data, TRL derives batch sizes for
    one process and DeepSpeed's batch check fails (its engine does see every rank). ``use_cpu`` tells it, with the
    backend of the process group the pipeline joined (:func:`alpacafarm.distributed.init`). DDP or DeepSpeed stays
    the launch config's choice: ``use_cpu`` only shapes the process state, and the trainer's ``Accelerator`` (built
    without ``cpu``) still turns the launch's DeepSpeed plugin on over it. Only public API is used: transformers
    does the reset, so a previous trainer's state (its DeepSpeed plugin with the ``auto`` values it filled, its
    mixed precision) never reaches the next one.
    """
    import torch

    from alpacafarm import distributed

    if distributed.world_size() <= 1 or torch.cuda.is_available():
        return {}
    import torch.distributed as dist

    return {"use_cpu": True, "ddp_backend": config.ddp_backend or dist.get_backend()}


def check_process_count(args: Any) -> None:
    """Fail where a trainer's arguments set accelerate up over fewer processes than were launched (each rank would
    train alone); ``args`` is a built ``TrainingArguments``."""
    from alpacafarm import distributed

    world = distributed.world_size()
    if world > 1 and args.world_size != world:
        raise RuntimeError(f"accelerate counts {args.world_size} of the {world} processes for this trainer")


def check_launch_honoured(distributed_type: Any) -> None:
    """One line when the launch config asked for FSDP but accelerate set up something else: accelerate runs FSDP on
    GPUs only and otherwise falls back to plain data parallelism without a word (``distributed_type`` is the
    ``accelerate.DistributedType`` of the Accelerator that was built)."""
    import os

    wanted = os.environ.get("ACCELERATE_USE_FSDP", "").strip().lower() in ("1", "true", "yes")
    if wanted and getattr(distributed_type, "value", str(distributed_type)) != "FSDP":
        from alpacafarm.errors import UserError

        raise UserError("the accelerate launch config asks for FSDP, which accelerate runs on GPUs only (here: "
                        f"{getattr(distributed_type, 'value', distributed_type)}); on CPU processes use "
                        "--accelerate-config ddp, zero2 or zero3")


def trackers(report_to: Sequence[str] | None) -> list[str]:
    """The ``accelerate`` trackers ``report_to`` names; one line for a name accelerate does not know or a tracker
    whose package is missing (accelerate itself would drop it silently)."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    from alpacafarm.errors import MissingPackageError, UserError

    names = [name for name in (report_to or []) if name not in ("none", "all")]
    if "all" in (report_to or []):
        return [str(t) for t in get_available_trackers()]
    available = {str(t) for t in get_available_trackers()}
    for name in names:
        if name not in LOGGER_TYPE_TO_CLASS:
            raise UserError(f"report_to: {name!r} is not a tracker accelerate can log to "
                            f"({', '.join(sorted(LOGGER_TYPE_TO_CLASS))})")
        if name not in available:
            package = "tensorboardX" if name == "tensorboard" else name
            raise MissingPackageError(f"report_to: {name} needs its package, which is not installed: "
                                      f"pip install {package}")
    return names


def trainer_accelerator(args: Any, gradient_accumulation_steps: int, *, project: str) -> Any:
    """The one ``accelerate.Accelerator`` of a trainer of our own (PPO): every launched process (``args`` is a
    :class:`TrainingDefaults` config built right before, which set accelerate's process state up afresh over them
    all, :func:`shared_process_state`), the launch config's distribution (refused where accelerate would silently
    build another, :func:`check_launch_honoured`), bf16 autocast when ``args.bf16``, DeepSpeed's ``auto`` values
    filled as transformers' Trainer fills them, and the ``report_to`` trackers (:func:`trackers`) under
    ``output_dir/tensorboard`` (TensorBoard) or ``output_dir/<project>``."""
    from accelerate import Accelerator
    from accelerate.state import is_initialized

    if is_initialized():
        raise RuntimeError("an accelerate Accelerator was built after this trainer's arguments: build them "
                           "(stage_training_args) right before the trainer, which sets accelerate's process state "
                           "up afresh, so that no earlier trainer's state (DeepSpeed plugin, mixed precision) is "
                           "reused")
    log_with = trackers(args.report_to)
    accelerator = Accelerator(mixed_precision="bf16" if args.bf16 else "no",
                              gradient_accumulation_steps=gradient_accumulation_steps, log_with=log_with or None,
                              project_dir=args.output_dir)
    check_launch_honoured(accelerator.distributed_type)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
        plugin.deepspeed_config["gradient_clipping"] = args.max_grad_norm
    if log_with:
        accelerator.init_trackers("tensorboard" if log_with == ["tensorboard"] else project)
    return accelerator


def rotate_checkpoints(output_dir: str | Path, limit: int | None) -> None:
    """Keep the newest ``limit`` ``checkpoint-N`` folders of ``output_dir`` (all of them when ``limit`` is unset)."""
    import shutil

    if not limit or limit < 1:
        return
    checkpoints = sorted((p for p in Path(output_dir).glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                         key=lambda p: int(p.name.split("-")[-1]))
    for old in checkpoints[:-limit]:
        shutil.rmtree(old, ignore_errors=True)


#: The trainer state in every ``checkpoint-N`` folder, written last (:func:`checkpoint_problem` looks for it).
TRAINER_STATE = "trainer_state.json"


def save_checkpoint(accelerator: Any, state: Any, output_dir: str | Path, *, trained_tensors_of: Any = None,
                    limit: int | None = None, extra: dict[str, Any] | None = None) -> Path:
    """``output_dir/checkpoint-<global_step>/`` for a training loop of our own (PPO, Quark): everything the
    ``accelerator`` prepared (weights, optimizer, RNG states: ``accelerator.save_state``), ``extra`` (file name →
    JSON value) and the ``transformers.TrainerState`` ``state``, written last. Call it on every rank.

    ``trained_tensors_of``: a model the accelerator prepared whose trained tensors (those that require gradients)
    alone are written, not its frozen ones (a LoRA layout's base, loaded again anyway). Written as
    ``checkpoint-N.partial`` and renamed when whole, so a crash never leaves a half checkpoint; the newest ``limit``
    checkpoints are kept (all when unset).
    """
    import json
    import shutil

    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{state.global_step}"
    partial = output_dir / f"{final.name}.partial"
    if accelerator.is_main_process:  # created here: only the main process writes in the run directory
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)

    def trained_only(models: list[Any], weights: list[dict[str, Any]], directory: str) -> None:
        # weights: the state dicts accelerate is about to write, one per prepared model (none where DeepSpeed or
        # FSDP write their own files), named as in the unwrapped model
        for model, weight in zip(models, weights, strict=False):
            if model is trained_tensors_of:
                keep = trained_names(accelerator.unwrap_model(model))
                for name in [k for k in weight if k not in keep]:
                    del weight[name]

    handle = accelerator.register_save_state_pre_hook(trained_only)
    try:
        accelerator.wait_for_everyone()
        accelerator.save_state(str(partial))
        accelerator.wait_for_everyone()
    finally:
        handle.remove()
    if accelerator.is_main_process:
        for name, value in (extra or {}).items():
            (partial / name).write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
        state.save_to_json(str(partial / TRAINER_STATE))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        rotate_checkpoints(output_dir, limit)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Any, path: str | Path, *, trained_tensors_of: Any = None,
                    lr_scheduler: Any = None, max_steps: int | None = None) -> Any:
    """Restore what :func:`save_checkpoint` wrote at ``path`` into the ``accelerator``'s prepared objects (under the
    same launch config) and return the ``transformers.TrainerState`` saved with it. Call it on every rank.

    ``trained_tensors_of`` as for :func:`save_checkpoint`: the rest of that model stays as loaded; a checkpoint that
    lacks one of its trained tensors (written for another model or layout) is one line naming it. ``lr_scheduler``:
    replayed to the checkpoint's step (a schedule is a function of the step alone: replaying it unpickles nothing);
    ``max_steps``: set on the returned state (this run's, not the saved one's).
    """
    state = _load_state(accelerator, Path(path), trained_tensors_of)
    if max_steps is not None:
        state.max_steps = max_steps
    if lr_scheduler is not None:
        import warnings

        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": a replay, on purpose
            warnings.simplefilter("ignore")
            for _ in range(state.global_step):
                lr_scheduler.step()
    return state


def _load_state(accelerator: Any, path: Path, trained_tensors_of: Any) -> Any:
    from transformers.trainer_callback import TrainerState

    from alpacafarm.errors import UserError

    weights = path / "model.safetensors"
    kwargs: dict[str, Any] = {}
    if trained_tensors_of is not None and weights.is_file():  # trained tensors only: the rest is as loaded
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as handle:
            missing = sorted(trained_names(accelerator.unwrap_model(trained_tensors_of)) - set(handle.keys()))
        if missing:
            raise UserError(f"checkpoint {path} does not match this model ({len(missing)} tensors missing, "
                            f"e.g. {missing[0]})")
        kwargs["strict"] = False
    accelerator.load_state(str(path), **kwargs)
    return TrainerState.load_from_json(str(path / TRAINER_STATE))


def trained_names(model: Any) -> set[str]:
    """The names of ``model``'s parameters that train (require gradients)."""
    return {name for name, parameter in model.named_parameters() if parameter.requires_grad}


#: Files a checkpoint's weights may be in (transformers, peft, and ``accelerate.save_state``, which our PPO trainer
#: uses: ``model.safetensors``, or ``pytorch_model.bin`` without safetensors); FSDP and DeepSpeed use subfolders.
CHECKPOINT_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")


def resume_checkpoint(context: Any) -> str | None:
    """The newest readable ``checkpoint-N`` folder an interrupted attempt of this stage left, if any.

    A checkpoint the attempt died while writing — no ``trainer_state.json`` (trainers write it last), no weights,
    or an empty, truncated or unparsable JSON / safetensors / torch file — is skipped with a one-line warning, and
    the previous readable one is used, or none (the stage starts afresh). Nothing is deleted or renamed (every
    rank of a distributed run asks, and a trainer saving that step again overwrites the folder).
    """
    import re

    stage_dir = Path(context.stage_dir)
    if not context.resuming or not stage_dir.is_dir():
        return None
    pattern = re.compile(r"^checkpoint-(\d+)$")
    candidates = sorted((p for p in stage_dir.iterdir() if pattern.match(p.name) and p.is_dir()),
                        key=lambda p: int(pattern.match(p.name).group(1)), reverse=True)
    chosen, skipped = None, []
    for path in candidates:
        problem = checkpoint_problem(path)
        if problem is None:
            chosen = path
            break
        skipped.append((path, problem))
    fallback = f"resuming from {chosen.name}" if chosen else "starting from scratch"
    for path, problem in skipped:
        context.logger.warning("stage %s: skipping unreadable checkpoint %s (%s); %s", context.stage, path.name,
                               problem, fallback)
    if chosen is not None:
        context.logger.info("stage %s: resuming from %s", context.stage, chosen)
    return str(chosen) if chosen is not None else None


def checkpoint_problem(path: Path) -> str | None:
    """Why a ``checkpoint-N`` folder cannot be resumed from, or ``None`` when it looks whole.

    Cheap: no tensor is loaded. JSON files must parse; a safetensors file's header must parse and its size match
    the tensors it lists; a torch file (``.pt``, ``.pth``, ``.bin``) must be a zip archive with its directory (a
    truncated one has none) or a legacy pickle.
    """
    import json
    import zipfile

    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        return "no trainer_state.json"
    if not any((path / name).is_file() for name in CHECKPOINT_WEIGHTS) and not any(p.is_dir() for p in path.iterdir()):
        return "no weights"
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        if file.suffix not in (".json", ".safetensors", ".pt", ".pth", ".bin"):
            continue
        name = file.relative_to(path).as_posix()
        try:
            size = file.stat().st_size
            if size == 0:
                return f"{name} is empty"
            with file.open("rb") as fh:
                if file.suffix == ".json":
                    json.loads(fh.read())
                elif file.suffix == ".safetensors":
                    length = int.from_bytes(fh.read(8), "little")
                    if 8 + length > size:
                        return f"{name} is truncated"
                    header = json.loads(fh.read(length))
                    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
                    if 8 + length + end != size:
                        return f"{name} is truncated"
                elif zipfile.is_zipfile(fh):
                    zipfile.ZipFile(fh).close()
                elif not (fh.seek(0) == 0 and fh.read(1) == b"\x80"):
                    return f"{name} is truncated or not a torch file"
        except (OSError, ValueError, KeyError, TypeError, IndexError, zipfile.BadZipFile) as exc:
            return f"{name} is unreadable: {exc}"
    return None


def train_summary(trainer: Any, result: Any) -> dict[str, Any]:
    """Loss and step count of a finished ``trainer.train()`` (plus the last logged loss, which is per-step), and
    how the trainer ran: over how many processes (its accelerator's count, which sets the global batch) and with
    which distribution (``NO``, ``MULTI_CPU``, ``MULTI_GPU``, ``FSDP``, ``DEEPSPEED`` with its ZeRO stage)."""
    import math

    from alpacafarm.errors import UserError

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if not math.isfinite(float(result.training_loss)) or any(not math.isfinite(float(v)) for v in losses):
        raise UserError(f"training diverged: the loss is not finite (train loss {float(result.training_loss)}); "
                        "lower learning_rate (or max_grad_norm) and run the stage again")
    state = trainer.accelerator.state
    plugin = getattr(state, "deepspeed_plugin", None)
    return {
        "train_loss": round(float(result.training_loss), 6),
        "final_logged_loss": losses[-1] if losses else None,
        "steps": int(trainer.state.global_step),
        "epochs": round(float(trainer.state.epoch or 0.0), 4),
        "train_runtime_s": round(float(result.metrics.get("train_runtime", 0.0)), 3),
        "trainer_processes": int(trainer.accelerator.num_processes),
        "distributed_type": str(getattr(state.distributed_type, "value", state.distributed_type)),
        "zero_stage": int(plugin.zero_stage) if plugin is not None else None,
    }


def limit(records: list[dict[str, Any]], max_examples: int | None) -> list[dict[str, Any]]:
    """The first ``max_examples`` records (all of them when ``None``)."""
    return records if max_examples is None else records[:max_examples]


def fp32_master_weights(model: Any) -> int:
    """Make every trainable floating-point parameter float32 in place; returns how many tensors were cast.

    Call it on the model a trainer will optimise (after peft wrapped it, before the optimizer exists). Frozen
    tensors keep their dtype (a bf16 or 4-bit base under LoRA). A cast leaf module (a LoRA reward model's score
    head copied by peft in the base's dtype) gets its inputs cast to float32, so it also runs where no autocast
    mixes the dtypes (a CPU). The compute dtype is the trainer's business: ``bf16`` autocast on a GPU.
    """
    import torch

    cast = 0
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False)
               if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32]
        for parameter in own:
            parameter.data = parameter.data.float()
            cast += 1
        if own and not any(True for _ in module.children()):
            module.register_forward_pre_hook(_inputs_to_float32)
    return cast


def _inputs_to_float32(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    import torch

    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
