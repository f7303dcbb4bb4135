"""sbp.allocator: glibc keeps freed blocks for the next large buffer."""

from __future__ import annotations

import platform

from sbp.allocator import keep_freed_memory


def test_keep_freed_memory_applies_once_on_glibc() -> None:
    on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is on_glibc
    assert keep_freed_memory() is on_glibc  # idempotent
    # large buffers still work as before
    buffers = [bytearray(1 << 20) for _ in range(8)]
    del buffers[::2]
    assert all(len(b) == 1 << 20 for b in buffers)
