"""Where alpacafarm keeps shared state (converted models, annotation cache): never inside the package.

Also the one translation of the file system's refusals (permission denied, read-only, disk full, a file where a
folder should be, ...) into a :class:`~alpacafarm.errors.UserError` naming the path: :func:`user_path` wraps the
place where a path the user chose is read or written, so the message names that path and what was being done.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alpacafarm.errors import UserError

CACHE_DIR_ENV = "ALPACAFARM_CACHE_DIR"

#: errno values that describe the user's environment (permissions, disk, path shape), never a bug in a caller.
USER_ERRNOS: dict[int, str] = {
    errno.ENOSPC: "no space left on device (ENOSPC): free some space or choose another location",
    errno.EDQUOT: "disk quota exceeded (EDQUOT): free some space or choose another location",
    errno.EFBIG: "file too large for this file system or limit (EFBIG)",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.EISDIR: "is a directory, not a file",
    errno.ENOTDIR: "not a directory",
    errno.EEXIST: "exists and is not a directory",
    errno.ENAMETOOLONG: "file name too long",
    errno.ELOOP: "too many levels of symbolic links",
}


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest existing ancestor of ``path`` (itself included) that is a file, not a folder."""
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            return None if candidate.is_dir() else candidate
    return None


def path_error(exc: OSError, path: str | Path, action: str | None) -> UserError | None:
    """A one-line :class:`UserError` for an OSError the environment caused, else ``None`` (a bug: re-raise it).

    ``action`` says what was being done (``"write"``, ``"read"``, ``"create directory"``; ``None``: unknown);
    the message names ``path`` (the path the user gave), and the file in the way when a folder was expected.
    """
    reason = USER_ERRNOS.get(exc.errno) if exc.errno is not None else None
    if reason is None:
        return None
    path = Path(path)
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = _file_in_the_way(Path(exc.filename) if exc.filename else path) or _file_in_the_way(path)
        if blocker is not None:
            reason = "is a file, not a directory" if blocker == path else f"{blocker} is a file, not a directory"
    elif exc.errno == errno.EISDIR and action == "write":
        reason = "is a directory; give a file name"
    return UserError(f"cannot {action} {path}: {reason}" if action else f"{path}: {reason}")


@contextmanager
def user_path(path: str | Path, action: str) -> Iterator[None]:
    """Turn the environment's OSErrors inside the block into one line naming ``path``; others propagate."""
    try:
        yield
    except OSError as exc:
        error = path_error(exc, path, action)
        if error is None:
            raise
        raise error from exc


def not_utf8(path: str | Path, display: str | None = None) -> UserError:
    """``PATH: not UTF-8 text (byte 0xe9 at line 3)``, for a text file with bytes UTF-8 cannot decode."""
    where = ""
    try:
        data = Path(path).read_bytes()
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        where = f" (byte 0x{data[exc.start]:02x} at line {line})"
    except OSError:
        pass
    return UserError(f"{display or path}: not UTF-8 text{where}; save it as UTF-8")


def read_text(path: str | Path, what: str = "file", display: str | None = None) -> str:
    """The UTF-8 text of ``path``; unreadable or not UTF-8 is a one-line UserError naming it (as ``display``)."""
    with user_path(display or path, f"read {what}"):
        try:
            return Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise not_utf8(path, display) from None


def make_dir(path: str | Path, what: str = "directory") -> Path:
    """``mkdir -p path``; a file in the way, no permission or a full disk is a one-line UserError naming it."""
    path = Path(path)
    with user_path(path, f"create {what}"):
        path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir() -> Path:
    """``$ALPACAFARM_CACHE_DIR``, else ``$XDG_CACHE_HOME/alpacafarm``, else ``~/.cache/alpacafarm``."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        path = Path(explicit).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        path = Path(base) / "alpacafarm"
    what = f"cache directory (${CACHE_DIR_ENV})" if explicit else "cache directory"
    return make_dir(path, what)


def check_output_file(path: str | Path, what: str = "output file") -> Path:
    """Fail before any work (or money) is spent when ``path`` cannot be written: a folder, a file in the way of
    its folder, no permission. Call it where a command takes an output path; the write itself still reports the
    rest (disk full) through :func:`user_path`."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path} is a directory; give a file name")
    blocker = _file_in_the_way(path.parent)
    if blocker is not None:
        raise UserError(f"cannot write {what} {path}: {blocker} is a file, not a directory")
    folder = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path("."))
    target = path if path.exists() else folder
    if not os.access(target, os.W_OK) or not os.access(folder, os.X_OK):
        raise UserError(f"cannot write {what} {path}: permission denied ({target} is not writable)")
    return path
