"""Packaged accelerate configs (``ddp``, ``fsdp2``, ``zero2``, ``zero3``) and how ``alpacafarm run`` re-launches
itself through ``accelerate launch`` when asked for several processes.

``alpacafarm run RECIPE --num-processes N [--accelerate-config NAME|FILE]`` runs::

    python -m accelerate.commands.launch --config_file CONFIG --num_processes N -m alpacafarm run RECIPE ...

and every launched process runs the pipeline as a rank (see :mod:`alpacafarm.distributed`). A command already
started by a launcher (``torchrun``, ``accelerate launch``) is never re-launched: it just runs as its rank.

``zero2`` and ``zero3`` need the deepspeed package, on GPUs or CPUs (DeepSpeed's CPU accelerator joins the ranks over
gloo without oneCCL, and compiles its small shared-memory op with the system C++ compiler on first use). Its
``setup.py`` imports torch: ``pip install deepspeed --no-build-isolation`` builds it against the installed torch (an
isolated build would download another one, a CUDA build of several GB).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from alpacafarm.errors import MissingPackageError, UserError, did_you_mean

#: The packaged configs, by name.
NAMES = ("ddp", "fsdp2", "zero2", "zero3")


def under_launcher() -> bool:
    """Whether this process was started by a launcher as one of several ranks (``WORLD_SIZE`` is set)."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def config_path(name_or_file: str) -> Path:
    """A packaged config by name, or a YAML file; anything else is a one-line error."""
    if name_or_file in NAMES:
        return Path(str(resources.files(__name__) / f"{name_or_file}.yaml"))
    path = Path(name_or_file)
    if path.is_file():
        return path
    raise UserError(f"--accelerate-config {name_or_file!r}: neither a packaged config ({', '.join(NAMES)})"
                    f"{did_you_mean(name_or_file, list(NAMES))} nor a file")


def read_config(path: Path) -> dict[str, Any]:
    import yaml

    from alpacafarm.yamlsource import yaml_value

    try:
        data = yaml_value(path.read_text(encoding="utf-8"), f"accelerate config {path}")  # bounded
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"accelerate config {path}: cannot be read ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise UserError(f"accelerate config {path}: not a YAML mapping")
    return data


def check_config(path: Path, data: dict[str, Any]) -> None:
    """Fail before launching when the config needs a package that is not installed."""
    import importlib.util

    if str(data.get("distributed_type", "")).upper() == "DEEPSPEED" and importlib.util.find_spec("deepspeed") is None:
        raise MissingPackageError(f"accelerate config {path.name} uses DeepSpeed, which is not installed: "
                                  "pip install deepspeed --no-build-isolation")


def launch_command(num_processes: int, config: str | None, argv: Sequence[str]) -> list[str]:
    """The ``accelerate launch`` command that runs ``alpacafarm`` with ``argv`` on ``num_processes`` processes."""
    path = config_path(config or "ddp")
    data = read_config(path)
    check_config(path, data)
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path),
            "--num_processes", str(num_processes), "--num_machines", str(data.get("num_machines", 1)),
            "-m", "alpacafarm", *argv]


def strip_launch_args(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--num-processes`` and ``--accelerate-config`` (the launched ranks must not re-launch)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--num-processes", "--accelerate-config"):
            skip = True
            continue
        if arg.startswith(("--num-processes=", "--accelerate-config=")):
            continue
        out.append(arg)
    return out


def relaunch(num_processes: int, config: str | None, argv: Sequence[str]) -> int:
    """Run ``alpacafarm`` with ``argv`` under ``accelerate launch``; its exit status (the ranks' worst)."""
    import subprocess

    command = launch_command(num_processes, config, strip_launch_args(argv))
    # The ranks' output passes through; the launcher's own report of a failed rank (its log lines, traceback and
    # summary) is held back: the main rank has already printed the one line that says what failed and where.
    launcher_report = re.compile(r"torch/distributed/elastic/|torch\.distributed\.elastic")
    exit_code = re.compile(r"failed \(exitcode: (-?\d+)\)")
    status, held_back = None, False
    try:
        with subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace") as process:
            assert process.stderr is not None
            for line in process.stderr:
                found = exit_code.search(line)
                if found and status is None:
                    status = int(found.group(1))
                held_back = held_back or bool(launcher_report.search(line))
                if not held_back:
                    sys.stderr.write(line)
                    sys.stderr.flush()
        returncode = process.returncode
    except KeyboardInterrupt:
        return 130
    if returncode == 0:
        return 0
    return status if status is not None and status > 0 else returncode


def launch_settings(args: Any, recipe: Any) -> tuple[int | None, str | None]:
    """``(processes, config)`` to re-launch with, or ``(None, None)`` to run here: one process asked for, or this
    process already one of a launcher's ranks. The command line wins over the recipe's ``launch:`` block."""
    launch = getattr(recipe, "launch", None)
    processes = args.num_processes if args.num_processes is not None else (launch.num_processes if launch else None)
    config = args.accelerate_config or (launch.accelerate_config if launch else None)
    if args.num_processes is not None and args.num_processes < 1:
        raise UserError(f"--num-processes {args.num_processes}: must be at least 1")
    if under_launcher():
        world = int(os.environ["WORLD_SIZE"])
        if args.num_processes is not None and args.num_processes != world:
            raise UserError(f"--num-processes {args.num_processes} but the launcher started {world} processes; "
                            "drop --num-processes when running under torchrun or accelerate launch")
        return None, None
    if config is not None:
        path = config_path(config)
        check_config(path, read_config(path))
    if (processes or 1) > 1 or config is not None:
        return processes or 1, config
    return None, None
