"""Keeping freed memory for the next large buffer.

``keep_freed_memory`` tunes glibc's allocator; ``RECEIVE_BUFFERS`` keeps a
few buffers of large frames received, to receive later frames into.

glibc (``keep_freed_memory``):

A reader of history receives an answer of about a megabyte per FETCH, and
decoding it gathers the records' values into another buffer of that size.
With glibc's defaults each such buffer is memory fresh from the kernel: a
block this large is mapped on its own and unmapped when freed, or taken
from the top of the heap, which is handed back to the kernel as soon as
128 KiB there are free. Either way every page of every buffer is faulted in
and zeroed again. Reading 64 KiB batches from one data node, that was about
a third of the reading process's time: 1.0-1.1 GB/s against 1.28-1.37 GB/s
with the settings below (docs/benchmarks.md, "Catch-up reads").

``keep_freed_memory()`` lets blocks up to ``MMAP_THRESHOLD`` come from the
heap and keeps up to ``TRIM_THRESHOLD`` of free heap before returning any,
so the next buffer reuses the pages of the last. Both are needed: setting
either one turns off glibc's adaptive threshold, and the trim threshold
alone (with mapping from 128 KiB) read at half the speed.

It is process-wide, so the reading tools call it (``sbp``, the Spark
source's readers, the benchmarks), not the client library: an application
reading with ``Consumer`` may call it at start-up, or set
``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=134217728``. The
data node calls it too: a FETCH answer the socket does not take at once is
copied out of LMDB into a buffer of its own.

glibc hands free heap back only from the heap's top: one live block above
a burst of freed buffers (the half-sent frames of peers that went away)
keeps every page of them resident. ``give_back_free_heap`` hands back what
is free beyond ``TRIM_THRESHOLD`` wherever it lies; the data node calls it
when the requests it holds at once have dropped by that much.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import platform
import sys
import threading
from typing import Final

#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
#: blocks smaller than this come from the heap (glibc's largest allowed on 64-bit)
MMAP_THRESHOLD: Final = 32 * 1024 * 1024
#: free heap kept before any is handed back to the kernel
TRIM_THRESHOLD: Final = 128 * 1024 * 1024

#: free heap past ``TRIM_THRESHOLD`` worth handing back to the kernel
GIVE_BACK_SLACK: Final = 32 * 1024 * 1024

_done = False


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Apply the settings above once; True if they are in effect (glibc)."""
    global _done
    if _done:
        return True
    libc = _glibc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _done


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h, glibc 2.33 and later)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def give_back_free_heap() -> int:
    """When more than ``TRIM_THRESHOLD`` + ``GIVE_BACK_SLACK`` of the heap is
    free, hand the free pages back to the kernel wherever they lie
    (``malloc_trim``). Returns the free bytes found (0 without glibc)."""
    libc = _glibc()
    mallinfo2 = getattr(libc, "mallinfo2", None)
    malloc_trim = getattr(libc, "malloc_trim", None)
    if mallinfo2 is None or malloc_trim is None:
        return 0
    mallinfo2.restype = _MallInfo2
    free = int(mallinfo2().fordblks)
    if free > TRIM_THRESHOLD + GIVE_BACK_SLACK:
        malloc_trim.argtypes = (ctypes.c_size_t,)
        malloc_trim(TRIM_THRESHOLD)
    return free


class BufferPool:
    """Buffers of large frames that were handed over, kept process-wide to
    receive later large frames into (``sbp.frames.FrameDecoder``): a new
    ``bytearray(n)`` writes n zeros that the read then overwrites, about
    6 % of a reading client's CPU at 2 MiB a FETCH; a kept buffer comes
    back without that, and warm. A buffer is handed out again only once
    nothing else refers to it: every view, frame or array made of a
    bytearray holds a reference to it, so CPython's reference count says
    when the last is gone. Process-wide, not per connection, so an idle
    connection holds nothing; thread-safe."""

    def __init__(self, max_bytes: int, largest: int) -> None:
        #: bytes of buffers kept at most, and the largest buffer kept
        self.max_bytes = max_bytes
        self.largest = largest
        self._kept: collections.deque[bytearray] = collections.deque()
        self._kept_bytes = 0
        self._lock = threading.Lock()

    def keep(self, buffer: bytearray) -> None:
        """Remember ``buffer``, just handed over (the oldest kept are dropped
        when the pool is full)."""
        size = len(buffer)
        if size > self.largest:
            return
        with self._lock:
            kept = self._kept
            while kept and self._kept_bytes + size > self.max_bytes:
                self._kept_bytes -= len(kept.popleft())
            kept.append(buffer)
            self._kept_bytes += size

    def take(self, size: int) -> bytearray | None:
        """A kept buffer nothing else refers to, resized to ``size``; None
        if there is none of a size near it."""
        with self._lock:
            kept = self._kept
            # The oldest first, they are the likeliest to be let go of; a few
            # at most, each one looked at going to the back, so that a take
            # costs little however many are kept (and in use).
            for _ in range(min(len(kept), _LOOKS_PER_TAKE)):
                buffer = kept.popleft()
                # only this name and getrefcount's argument refer to it; and
                # ``size`` fits its allocation without leaving half of it
                # unused (CPython reallocates either way: a copy)
                if sys.getrefcount(buffer) == 2 and size < _allocated(buffer) < 2 * size:
                    self._kept_bytes -= len(buffer)
                    break
                kept.append(buffer)
            else:
                return None
        if len(buffer) > size:
            del buffer[size:]
        elif len(buffer) < size:
            buffer += bytes(size - len(buffer))
        return buffer


#: kept buffers a take looks at, at most
_LOOKS_PER_TAKE: Final = 4

#: what ``sys.getsizeof`` counts of a bytearray besides its allocation
_BYTEARRAY_OVERHEAD: Final = sys.getsizeof(bytearray())


def _allocated(buffer: bytearray) -> int:
    """Bytes ``buffer`` may hold without CPython reallocating it."""
    return sys.getsizeof(buffer) - _BYTEARRAY_OVERHEAD


#: the pool the frame decoders of this process share: enough for a reader
#: with a few 2 MiB FETCH answers in flight, or a data node with a few
#: hundred 64 KiB APPENDs in flight
RECEIVE_BUFFERS: Final = BufferPool(max_bytes=16 * 1024 * 1024, largest=4 * 1024 * 1024)
