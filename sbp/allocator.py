"""Keeping freed memory for the next large buffer (glibc only).

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
"""

from __future__ import annotations

import ctypes
import platform
from typing import Final

#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
#: blocks smaller than this come from the heap (glibc's largest allowed on 64-bit)
MMAP_THRESHOLD: Final = 32 * 1024 * 1024
#: free heap kept before any is handed back to the kernel
TRIM_THRESHOLD: Final = 128 * 1024 * 1024

_done = False


def keep_freed_memory() -> bool:
    """Apply the settings above once; True if they are in effect (glibc)."""
    global _done
    if _done:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _done
