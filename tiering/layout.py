"""One sealed range as one object (SPEC §14).

Key: ``streams/<stream id>/<range index, 10 digits>-<epoch>.range`` under
the store's prefix. The epoch in the key makes a copy made twice land on
the same key, and a range of another epoch on another one.

Content::

    the range's record batches, byte for byte as FETCH returns them
    the index: per batch, its base offset and its position (big-endian int64
      pairs), then one more pair: the range's end offset and the batches' size
    the trailer (``TRAILER``, the last ``TRAILER.size`` bytes)

The trailer names the range, so the PM can check an object against its
metadata by reading the trailer alone, and carries the CRC-32C of the index,
so a reader never trusts a torn one. An object is written in one PUT (or one
multipart upload), so it is whole or absent; it is recorded only after it
was checked.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

import numpy as np

from sbp.batches import BASE_OFFSET, Buffer, batch_spans
from sbp.crc32c import crc32c

STREAMS_PREFIX: Final = "streams/"
MAGIC: Final = b"SBPRANGE"
VERSION: Final = 1
#: magic, version, range index, stream id, epoch, start and end offsets,
#: bytes of batches, when the last batch was appended, batch count, index CRC
TRAILER: Final = struct.Struct(">8sHxxiqqqqqqII")
_INDEX_DTYPE: Final = np.dtype(">i8")


def object_key(stream_id: int, range_index: int, epoch: int) -> str:
    return f"{stream_prefix(stream_id)}{range_index:010d}-{epoch}.range"


def stream_prefix(stream_id: int) -> str:
    return f"{STREAMS_PREFIX}{stream_id}/"


def parse_key(key: str) -> tuple[int, int, int] | None:
    """``(stream id, range index, epoch)`` of an object key; None for a key
    that is not a range's."""
    if not key.startswith(STREAMS_PREFIX) or not key.endswith(".range"):
        return None
    try:
        stream, name = key[len(STREAMS_PREFIX) : -len(".range")].split("/")
        index, epoch = name.split("-")
        return int(stream), int(index), int(epoch)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class RangeTrailer:
    stream_id: int
    range_index: int
    epoch: int
    start_offset: int
    end_offset: int
    data_bytes: int
    last_append_ms: int
    batch_count: int
    index_crc: int

    @property
    def index_bytes(self) -> int:
        return (self.batch_count + 1) * 16

    @property
    def object_bytes(self) -> int:
        return self.data_bytes + self.index_bytes + TRAILER.size

    def encode(self) -> bytes:
        return TRAILER.pack(
            MAGIC,
            VERSION,
            self.range_index,
            self.stream_id,
            self.epoch,
            self.start_offset,
            self.end_offset,
            self.data_bytes,
            self.last_append_ms,
            self.batch_count,
            self.index_crc,
        )

    @classmethod
    def decode(cls, data: Buffer) -> RangeTrailer:
        """ValueError unless ``data`` ends with a trailer of this version."""
        if len(data) < TRAILER.size:
            raise ValueError(f"an object of {len(data)} bytes has no trailer")
        magic, version, index, stream, epoch, start, end, size, last_ms, count, crc = (
            TRAILER.unpack_from(data, len(data) - TRAILER.size)
        )
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"not a range object (magic {magic!r}, version {version})")
        return cls(stream, index, epoch, start, end, size, last_ms, count, crc)


class IndexBuilder:
    """The index of batches as they are written out, in order."""

    def __init__(self) -> None:
        self._offsets: list[int] = []
        self._positions: list[int] = []
        self.size = 0

    def add(self, batches: Buffer) -> int:
        """Whole batches about to be written after those added before;
        where the last of them starts in ``batches``."""
        start = 0
        for start, _ in batch_spans(batches):
            self._offsets.append(BASE_OFFSET.unpack_from(batches, start)[0])
            self._positions.append(self.size + start)
        self.size += len(batches)
        return start

    @property
    def batch_count(self) -> int:
        return len(self._offsets)

    def encode(self, end_offset: int) -> bytes:
        pairs = np.empty((len(self._offsets) + 1, 2), dtype=_INDEX_DTYPE)
        pairs[:-1, 0] = self._offsets
        pairs[:-1, 1] = self._positions
        pairs[-1] = (end_offset, self.size)
        return pairs.tobytes()

    def finish(
        self, stream_id: int, range_index: int, epoch: int, end_offset: int, last_append_ms: int
    ) -> tuple[bytes, RangeTrailer]:
        """What follows the batches added: the index and the trailer (in
        one buffer), and the trailer."""
        encoded = self.encode(end_offset)
        trailer = RangeTrailer(
            stream_id,
            range_index,
            epoch,
            self._offsets[0] if self._offsets else end_offset,
            end_offset,
            self.size,
            last_append_ms,
            self.batch_count,
            crc32c(encoded),
        )
        return encoded + trailer.encode(), trailer


class RangeIndex:
    """Where each batch of a range object starts."""

    def __init__(self, trailer: RangeTrailer, index: Buffer) -> None:
        if len(index) != trailer.index_bytes:
            raise ValueError(
                f"an index of {len(index)} bytes, the trailer says {trailer.index_bytes}"
            )
        if crc32c(index) != trailer.index_crc:
            raise ValueError("the index does not match its checksum")
        pairs = np.frombuffer(index, dtype=_INDEX_DTYPE).reshape(-1, 2).astype(np.int64)
        self.trailer = trailer
        #: base offsets, then the end offset
        self.offsets = pairs[:, 0]
        #: positions of the batches, then the batches' size
        self.positions = pairs[:, 1]

    def span(self, offset: int, max_bytes: int) -> tuple[int, int, int]:
        """``(position, end position, records)`` of the whole batches to read
        from the one holding ``offset``: at most ``max_bytes`` of them, but
        at least one. ``offset`` must lie in the range."""
        first = int(np.searchsorted(self.offsets[:-1], offset, side="right")) - 1
        first = max(first, 0)
        position = int(self.positions[first])
        last = int(np.searchsorted(self.positions, position + max_bytes, side="right")) - 1
        last = max(last, first + 1)
        return position, int(self.positions[last]), int(self.offsets[last] - self.offsets[first])


def whole_object(
    stream_id: int,
    range_index: int,
    epoch: int,
    end_offset: int,
    batches: Buffer,
    last_append_ms: int,
) -> bytes:
    """A range's object in one buffer: its whole batches (base offsets
    stamped), index and trailer (as ``tiering.upload`` writes it a piece at
    a time)."""
    index = IndexBuilder()
    index.add(batches)
    tail, _ = index.finish(stream_id, range_index, epoch, end_offset, last_append_ms)
    return bytes(batches) + tail
