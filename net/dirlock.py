"""An exclusive lock on a server's data directory, naming its holder.

LMDB lets two processes open one environment, but two servers on one
directory would each keep their own idea of offsets and ids (two PMs would
hand out the same stream id). So each server holds ``flock`` on a lock file
in its directory for as long as it runs; the file holds the holder's pid,
which a refused second server names in its one-line error. The kernel drops
the lock when the holder dies, however it dies, so a stale file never
blocks a restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from .service import ServiceError


def _holder(fd: int) -> str:
    """The pid written by the lock's holder, as text for a message."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


@contextlib.contextmanager
def locked_dir(path: Path, lock_name: str, what: str) -> Iterator[None]:
    """Create ``path`` if needed and hold an exclusive lock on ``path/lock_name``.

    Raises ``ServiceError`` ("data directory … is in use by another PM (pid
    N)") when another process holds it; ``what`` names that process's kind.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / lock_name, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise ServiceError(f"cannot use data directory {path}: {error.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ServiceError(
                f"data directory {path} is in use by another {what} (pid {_holder(fd)})"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
