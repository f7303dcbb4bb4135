"""sbp.allocator: glibc keeps freed blocks for the next large buffer, and a
pool keeps buffers of large frames to receive into again."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import numpy as np

from sbp.allocator import BufferPool, keep_freed_memory


def test_keep_freed_memory_applies_once_on_glibc() -> None:
    on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is on_glibc
    assert keep_freed_memory() is on_glibc  # idempotent
    # large buffers still work as before
    buffers = [bytearray(1 << 20) for _ in range(8)]
    del buffers[::2]
    assert all(len(b) == 1 << 20 for b in buffers)


def test_a_kept_buffer_comes_back_only_once_nothing_refers_to_it() -> None:
    pool = BufferPool(max_bytes=1 << 20, largest=1 << 20)
    buffer = bytearray(b"x" * 100_000)
    view = memoryview(buffer)[10:20]
    pool.keep(buffer)
    buffer_id = id(buffer)
    del buffer
    assert pool.take(100_000) is None  # a view is alive
    view.release()
    del view
    taken = pool.take(100_000)
    assert taken is not None and id(taken) == buffer_id  # and gone from the pool
    assert pool.take(100_000) is None
    array = np.frombuffer(taken, np.uint8)
    pool.keep(taken)
    del taken
    assert pool.take(100_000) is None  # the array refers to it
    del array
    again = pool.take(99_000)  # a little smaller fits its allocation
    assert again is not None and id(again) == buffer_id and len(again) == 99_000
    pool.keep(again)
    del again
    grown = pool.take(100_000)  # back within its allocation
    assert grown is not None and id(grown) == buffer_id and len(grown) == 100_000


def test_a_pool_keeps_few_bytes_and_no_buffer_too_large_or_too_small_for_a_frame() -> None:
    pool = BufferPool(max_bytes=600_000, largest=1 << 20)
    pool.keep(bytearray(2 << 20))  # larger than it keeps
    assert pool.take(2 << 20) is None
    for _ in range(3):  # the oldest is dropped
        pool.keep(bytearray(300_000))
    assert pool.take(300_000) is not None
    assert pool.take(300_000) is not None
    assert pool.take(300_000) is None
    pool.keep(bytearray(300_000))
    assert pool.take(100_000) is None  # would leave most of it unused
    assert pool.take(400_000) is None  # does not fit its allocation


#: in a fresh process: 256 MiB of buffers freed below a live block, as the
#: half-sent frames of peers that went away; the resident MiB after the
#: free, then after give_back_free_heap
_FREED_BELOW_A_LIVE_BLOCK = textwrap.dedent(
    """
    from sbp.allocator import give_back_free_heap, keep_freed_memory

    def resident_mib():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096 >> 20

    keep_freed_memory()
    before = resident_mib()
    buffers = [bytearray(int(6.4 * 2**20)) for _ in range(40)]
    above = bytearray(100_000)
    del buffers
    freed = resident_mib() - before
    give_back_free_heap()
    print(freed, resident_mib() - before)
    """
)


def test_heap_freed_below_a_live_block_goes_back_to_the_kernel() -> None:
    """glibc hands back only the top of the heap: one live block above them
    keeps 256 MiB of freed buffers resident until give_back_free_heap."""
    out = subprocess.run(
        [sys.executable, "-c", _FREED_BELOW_A_LIVE_BLOCK],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    freed, given_back = map(int, out.split())
    assert freed >= 250
    assert given_back < 32
