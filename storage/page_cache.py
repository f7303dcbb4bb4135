"""Keeping the OS page cache of the data file to the newest writes.

LMDB writes a commit's pages with ``pwrite`` into the kernel's page cache,
and with an append-only load the file grows forever: every commit takes
pages the cache never had. Allocating them is most of the writer's kernel
time once the cache grows (where the benchmarks ran, a synced 64 KiB append cost
~190 µs of system time against ~50 µs while pages are recycled, and raw
``pwrite`` + ``fdatasync`` fell from ~1.3 GB/s to ~300 MB/s). So, once the
commits that wrote them are durable, pages more than ``window`` bytes behind
the end of the file are dropped from the cache (``POSIX_FADV_DONTNEED``) and
the next commits reuse them.

What stays cached: the newest ``window`` bytes, and every page a reader has
touched since (the kernel does not drop pages mapped by LMDB's read map), so
consumers at the tail read from memory; older data is read from disk, as it
would be once the cache filled. A ``window`` of 0 leaves the cache to the
OS. Dropping is an optimisation only: failures are ignored.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

#: how much the file must grow between two drops (one fstat and one fadvise)
DROP_STEP_BYTES: Final = 16 * 1024 * 1024


class WrittenPageDropper:
    """Called by the single writer after each commit; not thread-safe."""

    def __init__(self, data_file: Path, window: int, *, synced: bool) -> None:
        self.window = window
        self._synced = synced
        self._fd: int | None = None
        if window > 0 and hasattr(os, "posix_fadvise"):
            try:
                self._fd = os.open(data_file, os.O_RDONLY)
            except OSError:
                self._fd = None
        #: the file below this offset has been dropped (or never written here)
        self._dropped_until = 0
        #: with sync never, the start of the range advised last time: its pages
        #: were still dirty then (the advice starts their writeback), so they
        #: are advised once more, and dropped, on the next step
        self._advised_from = 0
        self._written_since = 0

    def committed(self, nbytes: int) -> None:
        """A commit of about ``nbytes`` of appends is durable (or, with sync
        never, handed to the OS)."""
        if self._fd is None:
            return
        self._written_since += nbytes
        if self._written_since < DROP_STEP_BYTES:
            return
        self._written_since = 0
        try:
            end = os.fstat(self._fd).st_size - self.window
            start = self._dropped_until if self._synced else self._advised_from
            if end <= start:
                return
            os.posix_fadvise(self._fd, start, end - start, os.POSIX_FADV_DONTNEED)
        except OSError:
            return
        self._advised_from = self._dropped_until
        self._dropped_until = end

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
