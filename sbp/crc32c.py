"""CRC-32C (Castagnoli), the checksum of record batches (SPEC §4), folded
with carry-less multiplies by ``fastcrc``."""

from __future__ import annotations

from fastcrc.crc32 import iscsi as _crc32c

from .frames import Buffer


def crc32c(buf: Buffer, start: int = 0, end: int | None = None) -> int:
    """CRC-32C of ``buf[start:end]`` without copying it."""
    stop = len(buf) if end is None else end
    with memoryview(buf) as view:
        return _crc32c(view[start:stop])
