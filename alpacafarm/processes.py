"""Which processes are alive or hold a file, and how long to wait for a lock one holds: the annotation cache's
claims and its lock errors name them.

Linux's /proc where it can be read; elsewhere ``kill(pid, 0)`` alone, and no lock holders.
"""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path

from alpacafarm.errors import UserError

#: This machine's name, as claims record it (a claim from another host is judged by its heartbeat alone).
HOST = socket.gethostname()

def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie (a killed, unreaped child)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust kill(0)
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def claim_alive(pid: int, host: str, heartbeat: float, now: float, stale_after_s: float) -> bool:
    """A claim is live while its heartbeat is fresh and, on this host, its process exists."""
    if now - heartbeat > stale_after_s:
        return False
    return pid_alive(pid) if host == HOST else True


def lock_holders(path: Path) -> list[str]:
    """``["pid 123 (sqlite3)"]``: the other processes of this user that have the cache file open (Linux /proc;
    empty where that cannot be read)."""
    names = {str(Path(path).resolve()) + suffix for suffix in ("", "-wal", "-shm", "-journal")}
    found = []
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if any(os.readlink(fd) in names for fd in (entry / "fd").iterdir()):
                command = (entry / "comm").read_text(encoding="utf-8").strip()
                found.append(f"pid {entry.name} ({command})")
        except OSError:  # gone, or another user's
            continue
    return found[:3]


#: How long an operation waits for a lock another process holds on the cache before failing (seconds). Writers
#: hold it for milliseconds; only a stuck program (a sqlite3 shell left in a transaction) holds it for long.
LOCK_TIMEOUT_ENV = "ALPACAFARM_CACHE_LOCK_TIMEOUT_S"
DEFAULT_LOCK_TIMEOUT_S = 5.0


def lock_timeout_s() -> float:
    """``$ALPACAFARM_CACHE_LOCK_TIMEOUT_S``, else :data:`DEFAULT_LOCK_TIMEOUT_S`; a bad value is a UserError."""
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 3600):
        raise UserError(f"${LOCK_TIMEOUT_ENV}={raw!r}: expected seconds in (0, 3600]")
    return value
