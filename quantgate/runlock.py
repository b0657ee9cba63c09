"""One writer per run directory: an advisory ``flock`` on ``<dir>/.quantgate.lock``.

The lock is released when its holder exits, even on SIGKILL, so a crashed run never leaves a stale
lock behind. The file holds the holder's pid and command for the error message of the next writer.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from quantgate.errors import InputError, Unavailable

__all__ = ["RunDirectoryBusy", "run_lock", "LOCK_FILE"]

LOCK_FILE = ".quantgate.lock"


class RunDirectoryBusy(Unavailable):
    """Another process is writing to this run directory."""


@contextlib.contextmanager
def run_lock(directory: str | Path) -> Iterator[Path]:
    """Hold the run directory's lock while the body runs; raise :class:`RunDirectoryBusy` naming the
    holder's pid when another process holds it. Re-entrant within one process is not supported: take it
    once, at the outermost writer. The lock file is opened without following a link (a link planted at its
    name is refused, its target untouched). Where the body raises, what the lock made is removed: the lock
    file, and the directory where it made it and nothing else is there, so a refused command leaves nothing."""
    directory = Path(directory)
    made = [d for d in (directory, *directory.parents) if not d.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    existed = path.exists() or path.is_symlink()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise InputError(
            f"{path} is a symlink (to {os.readlink(path)}); quantgate does not write through links: remove it"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = path.read_text().strip() or "an unknown process"
            raise RunDirectoryBusy(
                f"{directory} is in use by {holder}; wait for it to finish (or stop it), or write to another directory"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} ({' '.join(sys.argv[:3]) or 'python'})".encode())
        try:
            yield path
        except BaseException:
            if not existed:
                path.unlink(missing_ok=True)
                for d in made:  # innermost first: only folders this lock made, and only while empty
                    with contextlib.suppress(OSError):
                        d.rmdir()
            raise
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
