"""PPO under FSDP2: the policy and the value model sharded across ranks, the reference and reward models frozen and
whole on every rank.

**When.** Under ``alpacafarm run --num-processes N --accelerate-config fsdp2`` (or any accelerate config with
``distributed_type: FSDP`` and ``fsdp_version: 2``). The launch config is the one switch, read from the environment
``accelerate launch`` gives every rank (``ACCELERATE_USE_FSDP``, ``FSDP_VERSION``), as TRL's trainers read it
through accelerate's state: the same ``--accelerate-config fsdp2`` shards SFT's model and PPO's, and no recipe field
can contradict the launch (sharding changes memory, not results: a stage's fingerprint does not depend on it).
DeepSpeed ZeRO-2/3 configs train the policy and value through a DeepSpeed engine instead
(:mod:`alpacafarm_trl.ppo_zero`, a :class:`Sharding` too); FSDP version 1 and other ZeRO stages are refused for PPO
with one line.

**How.** :func:`torch.distributed.fsdp.fully_shard` on every decoder layer (the model's ``_no_split_modules``
classes, as accelerate's ``TRANSFORMER_BASED_WRAP`` picks them), then on the root, for the policy and for the value
model; their parameters, gradients and AdamW state are DTensors holding 1/N of each tensor. The data-parallel path
sums gradients across ranks (each rank's loss is already divided by the mini-batch's token count on all ranks);
FSDP2 would average them in its reduce-scatter, so every sharded module reduces with a plain sum (divide factor 1).
``clip_grad_norm_`` and AdamW work on DTensors as they are.

**Collectives.** A sharded forward all-gathers each layer, so every rank must run the same forwards: the rollout
(generation, whose length differs per rank, and the evaluation passes) runs with the policy and value gathered
whole once per step (:meth:`Sharding.gathered`; no collective inside), and in the update every rank runs as many
micro-batches as the rank with the most, padding with passes whose tokens are all masked out (zero loss, zero
gradient: :meth:`Sharding.even`). Saving gathers full weights on every rank and the main process writes them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from alpacafarm.errors import MissingPackageError, UserError

FSDP2 = "fsdp2"
#: The DeepSpeed ZeRO stages our PPO trainer drives, by the mode name it gets.
ZERO_STAGES = {"2": "zero2", "3": "zero3"}


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def requested_sharding() -> str | None:
    """``"fsdp2"``, ``"zero2"`` or ``"zero3"`` as the ranks' accelerate launch config asks, None for data parallel;
    a one-line error for launch configs PPO cannot honour (FSDP version 1, ZeRO stages other than 2 and 3, or a
    DeepSpeed config without the deepspeed package)."""
    if _env_true("ACCELERATE_USE_DEEPSPEED"):
        import importlib.util

        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "").strip()
        if stage not in ZERO_STAGES:
            raise UserError(f"ppo: DeepSpeed ZeRO stage {stage or '(unset)'} is not supported by our PPO trainer; "
                            "set zero_stage: 2 or 3 in the accelerate config (the packaged ones: --accelerate-config "
                            "zero2 or zero3)")
        if importlib.util.find_spec("deepspeed") is None:
            raise MissingPackageError(f"ppo: the accelerate config asks for DeepSpeed ZeRO-{stage}, which is not "
                                      "installed: pip install deepspeed --no-build-isolation")
        return ZERO_STAGES[stage]
    if not _env_true("ACCELERATE_USE_FSDP"):
        return None
    version = os.environ.get("FSDP_VERSION", "1").strip()
    if version != "2":
        raise UserError(f"ppo: FSDP version {version} is not supported by our PPO trainer; set fsdp_version: 2 in "
                        "the accelerate config (the packaged one: --accelerate-config fsdp2)")
    return FSDP2


def is_sharded(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _layer_classes(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def _shard_module(module: nn.Module, mesh: Any) -> list[Any]:
    """``fully_shard`` each decoder layer of ``module``, then ``module`` itself; the FSDP modules, root last."""
    from torch.distributed.fsdp import fully_shard

    classes = _layer_classes(module)
    layers = [m for m in module.modules() if m is not module and type(m).__name__ in classes]
    units = [fully_shard(layer, mesh=mesh) for layer in layers]
    units.append(fully_shard(module, mesh=mesh))
    for unit in units:  # sum, not average, across ranks: the loss is already over the global token count
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return units


class Sharding:
    """What the trainer asks of the sharding: a no-op for data parallel (``mode`` None)."""

    def __init__(self, mode: str | None = None, roots: Iterable[Any] = ()) -> None:
        self.mode = mode
        self.roots = list(roots)

    @property
    def active(self) -> bool:
        return self.mode is not None

    def prepare(self, optimizer: torch.optim.Optimizer, args: Any) -> None:
        """Called once with the trainer's optimizer over the trained parameters (DeepSpeed builds its engine)."""

    def backward(self, loss: torch.Tensor, *, last: bool = True) -> None:
        """Backpropagate ``loss``; ``last=False`` marks the micro-batch's first loss (the policy's: DeepSpeed waits
        for the value's to run one backward)."""
        loss.backward()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def step(self, optimizer: torch.optim.Optimizer, params: list[Any], max_grad_norm: float) -> float:
        """Sum the gradients across ranks (data parallel; FSDP2 reduce-scattered them already), clip them together
        to ``max_grad_norm`` and step; the norm before clipping."""
        from alpacafarm_trl.ppo_core import all_reduce_gradients

        all_reduce_gradients(params)
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        return float(norm)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """The sharded modules whole on every rank inside the block (one all-gather per module on entry), so
        forwards inside it run no collective (generation takes as many steps as its own batches need)."""
        if not self.active:
            yield
            return
        for root in self.roots:
            root.set_reshard_after_forward(False)
            for unit in _units(root):
                unit.unshard()
        try:
            yield
        finally:
            for root in self.roots:
                for unit in _units(root):
                    unit.reshard()
                root.set_reshard_after_forward(True)

    def even(self, chunks: Iterable[list[int]], fallback: int) -> Iterator[list[int]]:
        """``chunks``, then :class:`Padding` chunks (row ``fallback``, masked out by the caller) until this rank has
        run as many as the rank with the most: sharded forwards and backwards are collectives."""
        chunks = list(chunks)
        if not self.active:
            yield from chunks
            return
        from alpacafarm import distributed

        # Agreed before the first chunk runs: the count exchange must not interleave with the passes' collectives.
        most = max(distributed.all_gather_object(len(chunks), "ppo micro-batches"))
        yield from chunks
        for _ in range(most - len(chunks)):
            yield Padding([fallback])

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """``module``'s full weights on the CPU, gathered on every rank (a collective); None when not sharded.
        Ranks other than the main one get an empty dict (only the main process writes)."""
        if not self.active:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def full_tensors(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Every DTensor in ``tensors`` gathered whole on the CPU (a collective per tensor), others as they are."""
        return {k: v.full_tensor().cpu() if is_sharded(v) else v for k, v in tensors.items()}

    def full_parameters(self, params: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Every trained parameter whole (a collective per sharded one), as the checkpoint stores it."""
        return self.full_tensors({k: p.detach() for k, p in params.items()})

    def load_parameters(self, params: dict[str, Any], saved: dict[str, torch.Tensor]) -> None:
        """Set every trained parameter from full tensors, sharded again like the parameter."""
        with torch.no_grad():
            for name, param in params.items():
                value = saved[name].to(param.device, param.dtype)
                if is_sharded(param):
                    from torch.distributed.tensor import distribute_tensor

                    value = distribute_tensor(value, param.device_mesh, param.placements)
                param.copy_(value)

    def load_optimizer(self, optimizer: torch.optim.Optimizer, params: list[Any], state: dict[str, Any]) -> None:
        """Load a full (data-parallel format) optimizer state dict, sharded like the parameters."""
        optimizer.load_state_dict(self.shard_like(params, state))

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state dict with every sharded state tensor gathered whole: the data-parallel format."""
        state = optimizer.state_dict()
        if self.active:
            state["state"] = {i: self.full_tensors(s) for i, s in state["state"].items()}
        return state

    def shard_like(self, params: list[Any], state: dict[str, Any]) -> dict[str, Any]:
        """A full (data-parallel format) optimizer state dict with each state tensor sharded like its parameter."""
        if not self.active:
            return state
        from torch.distributed.tensor import distribute_tensor

        for index, entry in state["state"].items():
            param = params[int(index)]
            for key, value in list(entry.items()):
                if is_sharded(param) and torch.is_tensor(value) and value.shape == param.shape:
                    entry[key] = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh,
                                                   param.placements)
        return state


class Padding(list):
    """A micro-batch run only to keep the ranks' collectives in step: its tokens are masked out."""


def _units(root: Any) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in root.modules() if isinstance(m, FSDPModule)]


def require_full_fine_tuning(models: Any, mode: str) -> None:
    """A one-line error unless ``models`` is the full fine-tuning layout (the only one sharded)."""
    from alpacafarm_trl.ppo_models import SeparateModels

    if not isinstance(models, SeparateModels):
        raise UserError(f"ppo: {'FSDP2' if mode == FSDP2 else 'DeepSpeed ZeRO'} shards full fine-tuning only; with "
                        "'lora:' in the model block run PPO data parallel (--accelerate-config ddp): the trained "
                        "adapters are small")


def shard_models(models: Any) -> Sharding:
    """Shard ``models`` (a :class:`~alpacafarm_trl.ppo_models.SeparateModels`) with FSDP2 when the launch config
    asks for it; the :class:`Sharding` the trainer then works through (DeepSpeed ZeRO launches get theirs from
    :func:`alpacafarm_trl.ppo_zero.zero_sharding`, which the trainer asks first)."""
    from alpacafarm import distributed

    mode = requested_sharding()
    if mode != FSDP2 or distributed.world_size() == 1:
        return Sharding()
    require_full_fine_tuning(models, mode)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(models.device.type, (distributed.world_size(),))
    roots = []
    for module in (models.policy, models.value):
        _shard_module(module, mesh)
        roots.append(module)
    generate = models.generate

    def unsynced_generate(**kwargs: Any) -> Any:
        # transformers steps every rank's generate() together on an FSDP model (synced_gpus); here the policy is
        # gathered whole and the ranks sample different numbers of batches (of different lengths) on their own.
        return generate(**{**kwargs, "synced_gpus": False})

    models.generate = unsynced_generate
    return Sharding(mode, roots)


def local_and_full_numel(module: nn.Module) -> tuple[int, int]:
    """``(elements this rank holds, elements of the whole model)`` over ``module``'s parameters."""
    local = full = 0
    for param in module.parameters():
        local += param.to_local().numel() if is_sharded(param) else param.numel()
        full += param.numel()
    return local, full
