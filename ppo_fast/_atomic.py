"""Files written whole or not at all: ``atomic_write`` (a Python file) and ``atomic_path`` (a
path, for writers that open it themselves), and ``output_problem`` to check a path before any
work starts.

Every file the command line writes goes through ``atomic_path``: the content goes to a
temporary file in the target's folder, which is renamed onto the target (``os.replace``, atomic
on POSIX) once it is complete; on any exception, KeyboardInterrupt included, the temporary file
is removed and the target is left as it was.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from typing import IO, Any


def _temporary(path: str) -> tuple[int, str]:
    folder, name = os.path.split(os.path.abspath(path))
    return tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")


def _mode_for(path: str) -> int:
    """The permissions the file gets: those of the file it replaces, else 0o666 less the umask
    (what open(path, "w") gives; mkstemp makes 0o600)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """The path of a new, empty temporary file next to ``path``, for a writer that opens files
    itself (pyarrow's native ones: no Python file object, so no GIL, between it and the disk).
    When the block ends normally the file is flushed to the disk (fsync) and renamed onto
    ``path``; on any exception it is removed."""
    path = os.fspath(path)
    descriptor, temporary = _temporary(path)
    os.close(descriptor)
    try:
        yield temporary
        descriptor = os.open(temporary, os.O_WRONLY)  # writable: fsync needs it on Windows
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.chmod(temporary, _mode_for(path))
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", **open_args: Any) -> Iterator[IO]:
    """Open a temporary file next to ``path`` for writing (``mode`` "w" or "wb"), and rename it
    onto ``path`` when the block ends normally; on any exception it is removed."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes a whole file: mode 'w' or 'wb', got {mode!r}")
    with atomic_path(path) as temporary, open(temporary, mode, **open_args) as file:
        yield file


def output_problem(path: str | os.PathLike) -> str | None:
    """Why ``atomic_write(path)`` would fail (the folder is missing, is not a folder, or cannot
    be written; the path is a folder), or None. The folder is tried by creating (and removing)
    a temporary file in it."""
    path = os.fspath(path)
    if not path:
        return "an empty path; give a file name"
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a folder; give a file name in it"
    if not os.path.exists(folder):
        return f"the folder {folder} does not exist; create it or choose another path"
    if not os.path.isdir(folder):
        return f"{folder} is not a folder; choose another path"
    try:
        descriptor, temporary = _temporary(path)
    except OSError as error:
        return f"cannot write in {folder} ({error.strerror or error}); choose another path"
    os.close(descriptor)
    os.unlink(temporary)
    return None
