"""Ranks and collectives: the same code runs as one process or as N (``torchrun``, ``accelerate launch``).

With one process nothing is initialised and every helper is a cheap no-op (``world_size() == 1``). Under a
launcher (``WORLD_SIZE`` > 1 in the environment) :func:`init` joins the process group through accelerate's
``PartialState`` — the same state TRL's trainers use — over NCCL on GPUs and gloo on CPUs.

Every collective here is an ``all_gather_object`` of an *envelope*: ``("ok", value)`` or ``("failed", message)``.
So a rank that fails inside :func:`agree` (or any block wrapped by it) tells the others at their next collective,
and they raise :class:`RankFailed` naming it instead of waiting forever. Collectives run by libraries (a DDP
gradient all-reduce) cannot be matched this way: a rank that dies inside a trainer stops the others at the
process group's timeout.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

from alpacafarm.errors import UserError

T = TypeVar("T")


class RankFailed(UserError):
    """Another rank failed; this rank stops too. ``rank`` failed with ``message`` (its exit status kept)."""

    def __init__(self, rank: int, message: str, exit_code: int = 1, where: str = "") -> None:
        self.rank, self.message, self.exit_code = rank, message, exit_code
        super().__init__(f"rank {rank} failed{f' in {where}' if where else ''}: {message}")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return int(value) if value not in (None, "") else default
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer (set by a launcher?)") from None


def _initialized() -> bool:
    import sys

    if "torch" not in sys.modules:  # nothing imported torch: nothing can have joined a process group
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def launched_processes() -> int:
    """How many processes the launcher started (``WORLD_SIZE``; 1 without one), whether they joined a group yet."""
    return _env_int("WORLD_SIZE", 1)


def local_rank() -> int:
    """This process's index on its machine (``LOCAL_RANK``: which GPU is its own); 0 without a launcher."""
    return _env_int("LOCAL_RANK", 0)


#: Modules whose functions take ``group=dist.group.WORLD`` as a default argument, evaluated when the module is first
#: imported: imported after the process group started, they keep it alive past ``destroy_process_group`` (DDP
#: imports the first; accelerate imports DeepSpeed's where it is installed), so the group's gloo worker threads
#: outlive it and one may free the last collective's tensors while the interpreter is finalizing: "terminate
#: called without an active exception", SIGABRT, and a run that finished its work exits 1. Imported before the
#: group starts, their defaults are ``None``. (A library not installed is skipped.)
GROUP_DEFAULT_MODULES = ("torch.distributed.nn.functional", "torch.distributed.optim.zero_redundancy_optimizer",
                         "torch.distributed.fsdp.sharded_grad_scaler", "deepspeed.comm.torch")


_JOINED = False  # set by init() in one of a launcher's ranks


def joined_by_us() -> bool:
    """Whether :func:`init` ran in one of a launcher's ranks (this process then ends through :func:`end_process`)."""
    return _JOINED


def end_with_launcher(poll_seconds: float = 0.5) -> None:
    """End this rank as soon as its launcher is gone (a daemon thread watching the parent process).

    torchrun starts each rank in a session of its own, so killing the launcher's process group (``kill -9`` of a
    run, a CI timeout) does not reach the ranks: orphaned, they would train on and hold the run directory's lock,
    and the next ``alpacafarm run`` of it is refused. A rank whose parent changed ends at once (``os._exit``), as
    if it had been killed with the launcher; what it had not finished is redone on resume.
    """
    import threading
    import time

    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_seconds)
        os._exit(137)  # the status of a process killed by SIGKILL, as its launcher was

    threading.Thread(target=watch, name="alpacafarm-launcher-watch", daemon=True).start()


def init() -> None:
    """Join the process group when a launcher started several processes; a no-op for one process.

    Call it before anything else can start the group (a TRL config starts one when it is validated): see
    :data:`GROUP_DEFAULT_MODULES` for why the order matters.
    """
    global _JOINED
    if launched_processes() <= 1:
        return
    _JOINED = True
    end_with_launcher()
    if _initialized():
        return
    import importlib
    import importlib.util

    import torch
    from accelerate import PartialState

    for module in GROUP_DEFAULT_MODULES:
        if importlib.util.find_spec(module.split(".")[0]) is not None:
            importlib.import_module(module)

    # Joins torch.distributed from the launcher's environment (NCCL on GPUs). cpu=True where there is no GPU:
    # accelerate then joins over gloo (without it, a CPU-only rank stays alone).
    PartialState(cpu=not torch.cuda.is_available())
    if not _initialized():
        raise UserError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but no process group could be started; launch with "
                        "torchrun or 'accelerate launch' (on CPU: --multi_gpu with use_cpu: true)")


def world_size() -> int:
    if _initialized():
        import torch.distributed as dist

        return dist.get_world_size()
    return 1


def rank() -> int:
    if _initialized():
        import torch.distributed as dist

        return dist.get_rank()
    return 0


def is_main() -> bool:
    return rank() == 0


def _exchange(envelope: tuple[str, Any]) -> list[tuple[str, Any]]:
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, envelope)
    return gathered


def _check(gathered: list[tuple[str, Any]], where: str) -> list[Any]:
    for peer, (status, payload) in enumerate(gathered):
        if status == "failed":
            message, exit_code = payload
            raise RankFailed(peer, message, exit_code, where)
    return [payload for _, payload in gathered]


def all_gather_object(value: T, where: str = "") -> list[T]:
    """Every rank's ``value``, in rank order, on every rank (``[value]`` for one process)."""
    if world_size() == 1:
        return [value]
    return _check(_exchange(("ok", value)), where)


def broadcast_object(value: T, where: str = "") -> T:
    """The main process's ``value`` on every rank: main decides, everyone agrees (others' values are ignored)."""
    if world_size() == 1:
        return value
    return all_gather_object(value if is_main() else None, where)[0]


def barrier(where: str = "") -> None:
    """Wait until every rank arrives; raises :class:`RankFailed` if another rank reports a failure instead."""
    if world_size() > 1:
        all_gather_object(None, where)


def _describe(exc: BaseException) -> tuple[str, int]:
    if isinstance(exc, RankFailed):
        return exc.message, exc.exit_code
    text = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    message = text if isinstance(exc, UserError) else f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return message, getattr(exc, "exit_code", 1)


@contextmanager
def agree(where: str) -> Iterator[None]:
    """Run a block on every rank, then check that every rank finished it.

    A rank whose block raised re-raises its own error; the others raise :class:`RankFailed` naming that rank and
    its one-line message (the lowest failing rank when several fail). One process: just the block.
    """
    if world_size() == 1:
        yield
        return
    try:
        yield
    except BaseException as exc:
        # A RankFailed came from a collective every rank passed; an error already sent by an inner block is not
        # sent twice (the others raised on the first one and wait for nothing more).
        if not isinstance(exc, RankFailed) and not getattr(exc, "_alpacafarm_reported", False):
            _exchange(("failed", _describe(exc)))
            with contextlib.suppress(AttributeError):  # an exception type with __slots__ (not nested in practice)
                exc._alpacafarm_reported = True  # type: ignore[attr-defined]
        raise
    _check(_exchange(("ok", None)), where)


def run_on_main(fn: Callable[[], T], where: str = "") -> T:
    """``fn()`` on the main process only; its result (or its failure) reaches every rank."""
    if world_size() == 1:
        return fn()
    result = None
    with agree(where):
        if is_main():
            result = fn()
    return broadcast_object(result, where)


# ----------------------------------------------------------------------------------------------- sharding


def shard_indices(n: int, *, rank_: int | None = None, world: int | None = None, strided: bool = False) -> list[int]:
    """The indices of ``range(n)`` this rank handles: a contiguous block (sizes differ by at most one, earlier
    ranks take the extra) or every ``world``-th index starting at the rank (``strided``)."""
    r = rank() if rank_ is None else rank_
    w = world_size() if world is None else world
    if strided:
        return list(range(r, n, w))
    base, extra = divmod(n, w)
    start = r * base + min(r, extra)
    return list(range(start, start + base + (1 if r < extra else 0)))


def shard(items: Sequence[T], *, strided: bool = False) -> list[T]:
    """This rank's part of ``items`` (see :func:`shard_indices`); all of them for one process."""
    return [items[i] for i in shard_indices(len(items), strided=strided)]


def gather_shards(part: Sequence[T], n: int, *, strided: bool = False, where: str = "") -> list[T]:
    """Every rank's ``part`` (made by :func:`shard` with the same ``strided``) put back in the original order."""
    parts = all_gather_object(list(part), where)
    out: list[Any] = [None] * n
    for r, items in enumerate(parts):
        indices = shard_indices(n, rank_=r, world=len(parts), strided=strided)
        if len(indices) != len(items):
            raise RuntimeError(f"rank {r} returned {len(items)} items for {len(indices)} indices")
        for i, item in zip(indices, items, strict=True):
            out[i] = item
    return out


def map_sharded(fn: Callable[[list[T]], list[Any]], items: Sequence[T], *, strided: bool = False,
                where: str = "") -> list[Any]:
    """``fn`` over this rank's shard, every rank's results gathered in the order of ``items`` (on every rank)."""
    if world_size() == 1:
        return list(fn(list(items)))
    result: list[Any] = []
    with agree(where):
        result = list(fn(shard(items, strided=strided)))
    return gather_shards(result, len(items), strided=strided, where=where)


def all_reduce_sum(tensor: Any) -> Any:
    """The element-wise sum of ``tensor`` over ranks (in place; returned); unchanged for one process."""
    if world_size() > 1:
        import torch.distributed as dist

        if dist.get_backend() == "nccl" and not tensor.is_cuda:  # NCCL reduces GPU tensors only
            import torch

            on_gpu = tensor.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(on_gpu, op=dist.ReduceOp.SUM)
            tensor.copy_(on_gpu)
        else:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def describe() -> str:
    """``rank R of W`` (for logs)."""
    return f"rank {rank()} of {world_size()}"


def shutdown() -> None:
    """Leave the process group (every rank, at the end of a command); a no-op for one process."""
    if _initialized():
        import torch.distributed as dist

        dist.destroy_process_group()


def end_process(code: int) -> NoReturn:
    """End one of a launcher's ranks with ``code`` once its command has returned: exit handlers run and output is
    flushed, then the process exits without finalizing the interpreter.

    A process group something still references (FSDP2's DTensor caches hold its device mesh; see also
    :data:`GROUP_DEFAULT_MODULES`) outlives ``destroy_process_group``, and its gloo/NCCL worker threads keep running.
    If the interpreter is finalized under them, one may need the GIL to free a collective's tensors and is killed
    inside a ``noexcept`` destructor: "terminate called without an active exception", SIGABRT, and a rank that
    finished its work exits 1. Nothing is left to do at that point, so the process ends before finalization.
    """
    import atexit
    import logging
    import sys

    atexit._run_exitfuncs()  # what a normal exit runs first (logging's flush, handlers registered by libraries)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream cannot be flushed; the exit code stands
            stream.flush()
    os._exit(code)
