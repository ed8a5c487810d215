"""Run a test script on several processes, as a user's launcher would: ``torchrun`` or ``accelerate launch``.

A two-process test writes its script's ranks as the ``__main__`` block of the test file itself (each rank writes
``<out>/<prefix>rank<R>.json``), starts them with :func:`launch_ranks`, and asserts on :func:`rank_results`.
The children get one torch thread each (two ranks on two cores), the repository's packages on ``PYTHONPATH``
(a checkout without an editable install still imports its own code), and none of the launcher variables of
the process that runs the tests (a test run under ``accelerate launch`` must not leak its rank into them).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Variables a launcher sets in its children; dropped from the environment the test's own launcher inherits.
LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous port of one launch)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_environment(*paths: str | Path) -> dict[str, str]:
    """The environment of launched ranks: this one without launcher state, one torch thread, ``paths`` first on
    ``PYTHONPATH``."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("ACCELERATE_", "FSDP_")) and name not in LAUNCHER_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in paths), os.environ.get("PYTHONPATH", "")])
    return env


def launch_ranks(script: str | Path, args: Sequence[str], *, cwd: str | Path, processes: int = 2,
                 launcher: str = "torchrun", config_file: str | Path | None = None,
                 pythonpath: Sequence[str | Path] = (), timeout: float = 400) -> subprocess.CompletedProcess[str]:
    """Start ``script args...`` on ``processes`` ranks with ``torchrun`` (``launcher="torchrun"``) or
    ``accelerate launch --config_file config_file`` (``launcher="accelerate"``) and wait for it; the completed
    process (its return code is the test's to check)."""
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                   "--master_port", str(free_port())]
    elif launcher == "accelerate":
        if config_file is None:
            raise ValueError("launcher='accelerate' needs config_file")
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
                   "--num_processes", str(processes), "--main_process_port", str(free_port())]
    else:
        raise ValueError(f"launcher must be 'torchrun' or 'accelerate', not {launcher!r}")
    return subprocess.run([*command, str(script), *args], capture_output=True, text=True,
                          env=launch_environment(*pythonpath), cwd=cwd, timeout=timeout)


def rank_results(out: str | Path, processes: int = 2, prefix: str = "") -> list[dict[str, Any]]:
    """What each rank wrote: ``<out>/<prefix>rank<R>.json`` for R in 0..processes-1."""
    return [json.loads((Path(out) / f"{prefix}rank{r}.json").read_text(encoding="utf-8")) for r in range(processes)]
