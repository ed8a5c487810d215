"""PPO under DeepSpeed ZeRO-2 and ZeRO-3: the policy and the value model trained through one DeepSpeed engine, the
reference and reward models frozen and whole on every rank.

**When.** Under ``alpacafarm run --num-processes N --accelerate-config zero2|zero3`` (any accelerate config with
``distributed_type: DEEPSPEED`` and ZeRO stage 2 or 3), read from the environment ``accelerate launch`` gives every
rank, as for FSDP2 (:mod:`alpacafarm_trl.ppo_sharding`). DeepSpeed runs on GPUs and on CPUs (its CPU accelerator
joins the ranks over gloo when oneCCL is missing).

**How.** The policy and the value model become the two children of one module (:class:`TrainedPair`), prepared with
the trainer's AdamW by ``accelerate.prepare``: one engine, one optimizer, one gradient clip over both (the data-
parallel path clips them together too). ZeRO-2 shards the AdamW state and the gradients, ZeRO-3 the weights as well.
Training forwards run through the engine (``engine("policy", ...)``: its backward bookkeeping hangs on them); the
caller owns the accumulation boundary (``managed_gradient_accumulation: false``): each micro-batch runs one backward
of the policy and value losses together, which reduces its gradients into the shards (a collective: every rank runs
as many as the rank with the most, :meth:`~Sharding.even`), and :meth:`ZeroSharding.step` clips and steps.
DeepSpeed averages gradients over the ranks; our per-rank loss is already divided by the mini-batch's token count on
all ranks, so the loss is multiplied by the world size before the backward: the gradients are the data-parallel
path's sums. The models' dtype is the launch config's (``mixed_precision: 'no'`` in the packaged ones: fp32 weights
and AdamW state; bf16 compute comes from the trainer's autocast on GPUs, as in the data-parallel path).

**The frozen models** (reference, reward) are whole copies, not ZeRO-3 inference engines: a partitioned model's
forward is a collective, and the rollout scores and evaluates a different number of batches on each rank (the reward
function is the core's and batches as it likes). They load without ``zero.Init``
(:func:`alpacafarm.modeling.loading_whole`), as do the policy and value model, which the engine then partitions.

**Rollouts** under ZeRO-3 run with the policy and value gathered whole once per step (:meth:`ZeroSharding.gathered`,
ZeRO-3's per-module fetch and release hooks lifted meanwhile, so generation of any length runs no collective).
Checkpoints hold full fp32 weights and AdamW state in the data-parallel format (gathered through DeepSpeed's
``safe_get_full_*``), so a run resumes under any launch config. Lifting the hooks, creating AdamW's state for a
resume and lifting ``zero.Init`` touch DeepSpeed's and transformers' internals: tested with deepspeed 0.19.8.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from alpacafarm.errors import UserError
from alpacafarm_trl.ppo_sharding import ZERO_STAGES, Sharding, requested_sharding, require_full_fine_tuning

ZERO2, ZERO3 = ZERO_STAGES["2"], ZERO_STAGES["3"]
#: AdamW's per-parameter state tensors (``step`` is one count per group under ZeRO, per parameter in the file).
ADAM_STATES = ("exp_avg", "exp_avg_sq")


def zero_sharding(models: Any) -> ZeroSharding | None:
    """The :class:`ZeroSharding` of ``models`` when several ranks were launched with a ZeRO-2/3 config, else None;
    its engine is built with the trainer's optimizer (:meth:`ZeroSharding.prepare`)."""
    from alpacafarm import distributed

    mode = requested_sharding()
    if mode not in (ZERO2, ZERO3) or distributed.world_size() == 1:
        return None
    require_full_fine_tuning(models, mode)
    return ZeroSharding(mode, models)


class TrainedPair(nn.Module):
    """The policy and the value model as one module (one DeepSpeed engine); ``forward(part, ...)`` runs one."""

    def __init__(self, policy: nn.Module, value: nn.Module) -> None:
        super().__init__()
        self.policy = policy
        self.value = value
        self.config = getattr(policy, "config", None)  # accelerate sizes DeepSpeed's "auto" buckets from it

    def forward(self, part: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, part)(*args, **kwargs)


class ZeroSharding(Sharding):
    """The trainer's sharding under DeepSpeed ZeRO-2/3 (``mode`` ``zero2`` or ``zero3``)."""

    def __init__(self, mode: str, models: Any) -> None:
        super().__init__(mode, [models.policy, models.value])
        self.models = models
        self.engine: Any = None
        self.pending: torch.Tensor | None = None
        self.groups: list[dict[str, Any]] = []

    # ---------------------------------------------------------------- the engine

    def prepare(self, optimizer: torch.optim.Optimizer, args: Any) -> None:
        """Build the engine over the policy and value model with ``optimizer`` (``accelerate.prepare``)."""
        from accelerate import Accelerator

        from alpacafarm import distributed

        world = distributed.world_size()
        # On a CPU-only machine accelerate's own process count may read 1 (TrainingArguments rebuilt its state with
        # no backend to name); the batch sizes are set here, and the engine is checked to span every rank.
        accelerator = Accelerator()
        plugin = accelerator.state.deepspeed_plugin
        plugin.deepspeed_config.update({
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
            "gradient_clipping": float(args.max_grad_norm), "managed_gradient_accumulation": False,
            "steps_per_print": 2 ** 31})
        # The parameter indices of the data-parallel optimizer state (ZeRO regroups the tensors into flat shards).
        self.groups = copy.deepcopy(optimizer.state_dict()["param_groups"])
        pair = TrainedPair(self.models.policy, self.models.value)
        self.engine, _ = accelerator.prepare(pair, optimizer)
        if self.engine.dp_world_size != world:
            raise UserError(f"ppo: the DeepSpeed engine spans {self.engine.dp_world_size} of the {world} ranks")
        managed = getattr(self.engine, "managed_gradient_accumulation", None)
        if managed is None or managed():  # older DeepSpeed ignores the key and would reduce at every backward
            import deepspeed

            raise UserError(f"ppo: DeepSpeed {deepspeed.__version__} cannot leave the gradient accumulation boundary "
                            "to our trainer (managed_gradient_accumulation); pip install 'deepspeed>=0.19.8'")
        self.models.through = self._through
        generate = self.models.generate

        def unsynced_generate(**kwargs: Any) -> Any:
            # transformers steps every rank's generate() together under ZeRO-3 (synced_gpus); here the policy is
            # gathered whole and the ranks sample different numbers of batches on their own.
            return generate(**{**kwargs, "synced_gpus": False})

        self.models.generate = unsynced_generate

    def _through(self, part: str) -> Any:
        engine = self.engine

        def run(*args: Any, **kwargs: Any) -> Any:
            return engine(part, *args, **kwargs)

        return run

    @property
    def zero3(self) -> bool:
        return self.mode == ZERO3

    def backward(self, loss: torch.Tensor, *, last: bool = True) -> None:
        """One engine backward per micro-batch: the policy's loss waits for the value's (``last``). ZeRO-3
        accumulates a step's gradients by copying the first backward's over the last step's, for the parameters
        that backward reaches: a value model first reached by a second backward would add to stale gradients."""
        from alpacafarm import distributed

        if self.pending is not None:
            loss, self.pending = self.pending + loss, None
        if not last:
            self.pending = loss
            return
        self.engine.backward(loss * distributed.world_size())  # DeepSpeed averages over ranks; we sum

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to do: the engine clears its gradient shards after each step."""

    def step(self, optimizer: torch.optim.Optimizer, params: list[Any], max_grad_norm: float) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """ZeRO-3: the policy and value model whole on every rank inside the block, ZeRO-3's per-module hooks
        lifted (they would release and fetch again around each forward: a collective per module). ZeRO-2 holds
        them whole anyway."""
        if not self.zero3:
            yield
            return
        import deepspeed

        offload = self.engine.optimizer.parameter_offload
        params = list(self.engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            for param in params:
                param.ds_active_sub_modules.clear()
            offload._remove_module_hooks()
            try:
                yield
            finally:
                from deepspeed.runtime.zero import parameter_offload

                stack = len(parameter_offload.FWD_MODULE_STACK)
                offload.forward_hooks.clear()
                offload.backward_hooks.clear()
                offload.setup_zero_stage3_hooks()
                del parameter_offload.FWD_MODULE_STACK[stack:]  # it pushes the root again: keep one entry

    # ---------------------------------------------------------------- full weights and optimizer state

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """``module``'s full weights on the CPU, gathered on every rank (ZeRO-3: a collective)."""
        if not self.zero3:
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    def full_parameters(self, params: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The fp32 master copy of every parameter, whole on the CPU (a collective per tensor)."""
        from deepspeed.utils import safe_get_full_fp32_param

        return {name: safe_get_full_fp32_param(param).detach().cpu().clone() for name, param in params.items()}

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """AdamW's state in the data-parallel format (per-parameter tensors, gathered whole: a collective each)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        groups, state = [], {}
        for group, saved in zip(optimizer.param_groups, self.groups, strict=True):
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": saved["params"]})
        params = self._params_by_index()
        step = self._step_count(optimizer)
        for index, param in params.items():
            entry = {key: safe_get_full_optimizer_state(param, key) for key in ADAM_STATES}
            if any(v is None for v in entry.values()):
                continue  # no update yet
            state[index] = {"step": step.clone(), **{k: v.detach().cpu().clone() for k, v in entry.items()}}
        return {"state": state, "param_groups": groups}

    def _params_by_index(self) -> dict[int, Any]:
        # The trainer built AdamW over the trained parameters in this order: the data-parallel state's indices.
        indices = [i for group in self.groups for i in group["params"]]
        trained = list(self.models.trainable_parameters().values())
        return dict(zip(indices, trained, strict=True))

    def _step_count(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        for state in optimizer.state.values():
            if "step" in state:
                return torch.as_tensor(state["step"], dtype=torch.float32).detach().cpu()
        return torch.tensor(0.0)

    def load_parameters(self, params: dict[str, Any], saved: dict[str, torch.Tensor]) -> None:
        """Every parameter (its fp32 master and the weight the forward uses) set from full tensors."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        for name, param in params.items():
            value = saved[name].to(torch.float32)
            safe_set_full_fp32_param(param, value)
            if self.zero3:
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
                    param.data.copy_(value.to(param.device, param.dtype))
            else:
                with torch.no_grad():
                    param.data.copy_(value.to(param.device, param.dtype))

    def load_optimizer(self, optimizer: torch.optim.Optimizer, params: list[Any], state: dict[str, Any]) -> None:
        """AdamW's state from the data-parallel format: each tensor cut into this rank's shard."""
        from deepspeed.utils import safe_set_full_optimizer_state

        by_index = self._params_by_index()
        self._create_adam_state()
        step = None
        for index, entry in state["state"].items():
            param = by_index[int(index)]
            for key in ADAM_STATES:
                safe_set_full_optimizer_state(param, entry[key].to(torch.float32), key)
            step = entry.get("step", step)
        for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if step is not None:
            for flat_state in optimizer.state.values():
                if "step" in flat_state:
                    flat_state["step"] = torch.as_tensor(step, dtype=torch.float32).clone()

    def _create_adam_state(self) -> None:
        """AdamW creates its state at its first step; a resumed run writes into it before: create it (zeros) for
        ZeRO's flat fp32 shards, as AdamW would, and link ZeRO-2's per-parameter views of it."""
        zero = self.engine.optimizer
        base = zero.optimizer
        flats = getattr(zero, "fp32_partitioned_groups_flat", None) if self.zero3 else \
            zero.single_partition_of_fp32_groups
        for flat in flats:
            if not base.state[flat]:
                base.state[flat].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(flat),
                                        exp_avg_sq=torch.zeros_like(flat))
        if not self.zero3:
            zero._lazy_init_hp_params_optimizer_state()

    def holdings(self, module: nn.Module) -> tuple[int, int]:
        """``(fp32 master elements this rank holds, elements of the whole module)`` over ``module``'s trained
        parameters: about 1/N under both stages."""
        from deepspeed.utils import safe_get_local_fp32_param

        local = full = 0
        for param in module.parameters():
            if not param.requires_grad:
                continue
            if hasattr(param, "ds_id"):  # ZeRO-3
                part = safe_get_local_fp32_param(param)
            else:  # ZeRO-2: the fragment of this rank's flat fp32 shard that belongs to the parameter, if any
                mapping = getattr(param, "_hp_mapping", None)
                part = mapping.get_hp_fragment() if mapping is not None else None
            local += part.numel() if part is not None else 0
            full += param.ds_numel if hasattr(param, "ds_numel") else param.numel()
        return local, full
