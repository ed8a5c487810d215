"""Where alpacafarm keeps shared state (converted models, annotation cache): never inside the package.

Also the one translation of the file system's refusals (permission denied, read-only, disk full, a file where a
folder should be, ...) into a :class:`~alpacafarm.errors.UserError` naming the path: :func:`user_path` wraps the
place where a path the user chose is read or written, so the message names that path and what was being done.
:func:`check_write_place` is the rule for a file written at the end of long work (``bench``'s report and
baseline), checked before the work starts; :func:`write_text_replacing` writes such a file without following a
link.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
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


def symlink_on(path: str | Path) -> Path | None:
    """The symbolic link a write to ``path`` would pass through, or None: ``path`` itself, or, for a relative path,
    a folder it names on the way (those lie in the working tree, where a pull request can commit a link; the
    folders above an absolute path are the machine's, e.g. ``/tmp`` on macOS, and are not checked)."""
    path = Path(path)
    candidates = [path] if path.is_absolute() else [path, *(p for p in path.parents if p != Path("."))]
    return next((p for p in candidates if p.is_symlink()), None)


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same place once links are resolved, or one file under two names
    (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): not the same file
        return False


def check_write_place(path: str | Path, what: str, *, not_same_as: dict[str, str | Path | None] | None = None) -> Path:
    """Refuse, before any work starts, a file that a command would write only at the end of it (``bench``'s
    report and baseline: a refusal after a 7-minute run loses its verdict). The rule: ``path`` is not a symbolic
    link (nor, for a relative path, a folder on the way: :func:`symlink_on`), not a folder, not the same file as
    any of ``not_same_as`` (label → path), and its folder exists (it is made here otherwise) and takes a new file
    (probed by creating and removing one: permissions, a read-only disk). Each refusal is one
    :class:`UserError` naming ``what`` and ``path``; the caller checks what an existing file may be."""
    path = Path(path)
    shown = f"{what} {path}"
    link = symlink_on(path)
    if link is not None:
        through = "is a symbolic link" if link == path else f"goes through a symbolic link ({link})"
        raise UserError(f"{shown} {through}: a link could send the write anywhere (a link committed in a pull "
                        "request, into CI's files); give a path without links")
    if path.is_dir():
        raise UserError(f"{shown} is a directory; give a file name")
    for label, other in (not_same_as or {}).items():
        if other is not None and same_file(path, other):
            raise UserError(f"{shown} is the same file as {label} {other}; writing it would destroy that one: "
                            "give another file name")
    blocker = _file_in_the_way(path.parent)
    if blocker is not None:
        raise UserError(f"cannot write {shown}: {blocker} is a file, not a directory")
    folder = make_dir(path.parent, f"{what} folder")
    with user_path(shown, "write"):  # the real test: root passes os.access, a read-only disk may not say so
        handle, probe = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".write-check")
        os.close(handle)
        os.unlink(probe)
    return path


def write_text_replacing(path: str | Path, text: str, what: str = "file") -> None:
    """Write ``text`` to ``path`` through a new temporary file renamed over it: a link put at ``path`` meanwhile is
    replaced, never followed, and a reader never sees half a file. Refusals are one line naming ``what`` and
    ``path`` (:func:`user_path`)."""
    path = Path(path)
    with user_path(f"{what} {path}", "write"):
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(handle, 0o666 & ~umask)  # as an ordinary new file (mkstemp makes it private)
            with os.fdopen(handle, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(temporary, path)
        except BaseException:
            with suppress(OSError):
                os.unlink(temporary)
            raise
