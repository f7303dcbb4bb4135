"""Record batches (SPEC §4), sans-IO, with numpy for the per-record parts.

Two formats share the first 31 bytes (base_offset, batch_length, magic, crc,
flags or attributes, record_count, base_timestamp) and may be mixed in one
stream: magic 1, below, and magic 2 (``sbp.batch_v2``: keys, headers, record
timestamps and offset deltas). A batch covers the offsets ``base_offset ..
base_offset + span - 1``: its record count for magic 1, ``last_offset_delta
+ 1`` for magic 2, which compaction keeps when it removes records.

Layout of a magic 1 batch (big-endian)::

    0   8    base_offset     int64   -1 from producers; the data node assigns it
    8   4    batch_length    int32   bytes after this field = 19 + 4*n + sum(lengths)
    12  1    magic           int8    = 1
    13  4    crc             uint32  CRC-32C of bytes 17..end
    17  2    flags           int16   0
    19  4    record_count    int32   n >= 1
    23  8    base_timestamp  int64   ms since the Unix epoch
    31  4*n  lengths         uint32[n]
    ..       values          concatenated

The lengths come before the values, so decoding many batches into an Arrow-style
binary column (one values buffer plus n+1 positions) is a handful of numpy
operations per batch and no Python work per record.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple, NoReturn

import numpy as np
import numpy.typing as npt
from fastcrc.crc32 import iscsi as _crc32c

from . import batch_v2
from .batch_v2 import MAGIC_V2, V2_HEADER_SIZE, BinaryColumn, Header, HeadersColumn
from .crc32c import crc32c as crc32c
from .errors import InvalidRecordBatchError
from .frames import Buffer as Buffer

#: base_offset, batch_length, magic, crc, flags, record_count, base_timestamp
BATCH_HEADER: Final = struct.Struct(">qiBIhiq")
BATCH_HEADER_SIZE: Final = BATCH_HEADER.size  # 31
BATCH_MAGIC: Final = 1
#: bytes before the part that batch_length counts (base_offset + batch_length)
BATCH_LOG_OVERHEAD: Final = 12
#: the CRC covers every byte from here to the end of the batch
CRC_START: Final = 17
#: batch_length of a batch with no records: flags .. base_timestamp
BATCH_LENGTH_FIXED: Final = BATCH_HEADER_SIZE - BATCH_LOG_OVERHEAD  # 19
#: largest batch whose batch_length fits the int32 field
MAX_BATCH_SIZE: Final = BATCH_LOG_OVERHEAD + (1 << 31) - 1

#: a batch's first field, outside its CRC: the node stamps it on the way out
BASE_OFFSET: Final = struct.Struct(">q")
_BATCH_LENGTH: Final = struct.Struct(">i")
_CRC: Final = struct.Struct(">I")
#: header fields from CRC_START on: flags, record_count, base_timestamp
_CRC_COVERED_HEADER: Final = struct.Struct(">hiq")
_LENGTHS_DTYPE: Final = np.dtype(">u4")
#: up to this many records, struct sums the lengths faster than numpy
_SMALL_BATCH_RECORDS: Final = 64


#: magic 2's last_offset_delta, right after the shared 31 bytes
_LAST_OFFSET_DELTA: Final = struct.Struct(">i")
MAGICS: Final = (BATCH_MAGIC, MAGIC_V2)


class BatchHeader(NamedTuple):
    """The header of one batch, as read from the buffer (``flags`` holds
    magic 2's attributes)."""

    base_offset: int
    batch_length: int
    magic: int
    crc: int
    flags: int
    record_count: int
    base_timestamp: int
    #: magic 2's; ``record_count - 1`` for magic 1
    last_offset_delta: int

    @property
    def size(self) -> int:
        """Bytes the whole batch occupies."""
        return self.batch_length + BATCH_LOG_OVERHEAD

    @property
    def span(self) -> int:
        """How many offsets the batch covers (its records, and those
        compaction removed)."""
        return self.last_offset_delta + 1

    @property
    def next_offset(self) -> int:
        """The offset right after the batch."""
        return self.base_offset + self.span


def _finish(out: bytearray, n: int, base_timestamp: int) -> bytearray:
    batch_length = len(out) - BATCH_LOG_OVERHEAD
    if batch_length > MAX_BATCH_SIZE - BATCH_LOG_OVERHEAD:
        raise ValueError(f"a batch of {len(out)} bytes overflows the int32 batch_length")
    _CRC_COVERED_HEADER.pack_into(out, CRC_START, 0, n, base_timestamp)
    crc = crc32c(out, CRC_START)
    BATCH_HEADER.pack_into(out, 0, -1, batch_length, BATCH_MAGIC, crc, 0, n, base_timestamp)
    return out


def build_batch(values: Sequence[Buffer], base_timestamp: int) -> bytearray:
    """One batch holding ``values``, with base_offset -1 (the data node assigns it).

    Returns a writable buffer, so that ``stamp_base_offset`` can work in place.
    """
    n = len(values)
    if n < 1:
        raise ValueError("a record batch holds at least one record")
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=n)
    values_start = BATCH_HEADER_SIZE + 4 * n
    out = bytearray(values_start + int(lengths.sum()))
    np.frombuffer(out, dtype=_LENGTHS_DTYPE, count=n, offset=BATCH_HEADER_SIZE)[:] = lengths
    out[values_start:] = b"".join(values)
    return _finish(out, n, base_timestamp)


def build_batch_from_arrays(
    values: Buffer | npt.NDArray[np.uint8], lengths: npt.ArrayLike, base_timestamp: int
) -> bytearray:
    """One batch from a contiguous values buffer and the length of each value.

    ``lengths`` must sum to the size of ``values``; base_offset is -1.
    """
    lengths_array = np.asarray(lengths)
    n = len(lengths_array)
    if n < 1:
        raise ValueError("a record batch holds at least one record")
    if lengths_array.min() < 0 or lengths_array.max() > 0xFFFFFFFF:
        raise ValueError("value lengths must fit uint32")
    payload = (
        values.reshape(-1).view(np.uint8)
        if isinstance(values, np.ndarray)
        else np.frombuffer(values, dtype=np.uint8)
    )
    total = int(lengths_array.sum(dtype=np.int64))
    if total != payload.nbytes:
        raise ValueError(f"lengths sum to {total} but the values buffer holds {payload.nbytes}")
    values_start = BATCH_HEADER_SIZE + 4 * n
    out = bytearray(values_start + total)
    np.frombuffer(out, dtype=_LENGTHS_DTYPE, count=n, offset=BATCH_HEADER_SIZE)[:] = lengths_array
    out[values_start:] = payload.data
    return _finish(out, n, base_timestamp)


def stamp_base_offset(buf: bytearray | memoryview, base_offset: int, start: int = 0) -> None:
    """Write ``base_offset`` into the batch at ``buf[start:]``, in place.

    base_offset lies outside the CRC, so the checksum stays valid.
    """
    BASE_OFFSET.pack_into(buf, start, base_offset)


def peek_header(buf: Buffer, start: int = 0) -> BatchHeader:
    """The header of the batch at ``buf[start:]``, unchecked (see ``validate_batch``)."""
    if len(buf) - start < BATCH_HEADER_SIZE:
        raise InvalidRecordBatchError(
            f"record batch header truncated: {len(buf) - start} of {BATCH_HEADER_SIZE} bytes"
        )
    fields = BATCH_HEADER.unpack_from(buf, start)
    if fields[2] != MAGIC_V2:
        return BatchHeader._make((*fields, fields[5] - 1))
    if len(buf) - start < V2_HEADER_SIZE:
        raise InvalidRecordBatchError(
            f"record batch header truncated: {len(buf) - start} of {V2_HEADER_SIZE} bytes"
        )
    last = _LAST_OFFSET_DELTA.unpack_from(buf, start + BATCH_HEADER_SIZE)[0]
    return BatchHeader._make((*fields, last))


def all_keyed(buf: Buffer, start: int = 0) -> bool:
    """Whether every record of the (checked) batch at ``buf[start:]`` has a
    key: never for magic 1 (SPEC §13)."""
    if buf[start + 12] != MAGIC_V2:
        return False
    return batch_v2.all_keyed(buf, start)


def batch_span(buf: Buffer, start: int = 0) -> int:
    """The offsets the batch at ``buf[start:]`` covers (``BatchHeader.span``),
    read from its header alone."""
    if buf[start + 12] == MAGIC_V2:
        return int(_LAST_OFFSET_DELTA.unpack_from(buf, start + BATCH_HEADER_SIZE)[0]) + 1
    return int(_RECORD_COUNT.unpack_from(buf, start + 19)[0])


_RECORD_COUNT: Final = struct.Struct(">i")


def _check(buf: Buffer, start: int, end: int, verify_crc: bool) -> BatchHeader:
    """Validate the batch occupying exactly ``buf[start:end]``."""
    header = peek_header(buf, start)
    size = end - start
    if header.size != size:
        raise InvalidRecordBatchError(
            f"batch_length {header.batch_length} does not match the {size}-byte batch"
        )
    if header.magic == MAGIC_V2:
        batch_v2.check_v2(buf, start, end)
        _check_crc(buf, start, end, header, verify_crc)
        return header
    if header.magic != BATCH_MAGIC:
        raise InvalidRecordBatchError(f"record batch magic {header.magic}, expected 1 or 2")
    n = header.record_count
    if n < 1:
        raise InvalidRecordBatchError(f"record_count {n}, expected at least 1")
    values_size = header.batch_length - BATCH_LENGTH_FIXED - 4 * n
    if values_size < 0:
        raise InvalidRecordBatchError(
            f"{n} records need {4 * n} bytes of lengths but batch_length is {header.batch_length}"
        )
    lengths_start = start + BATCH_HEADER_SIZE
    if n <= _SMALL_BATCH_RECORDS:
        total = sum(struct.unpack_from(f">{n}I", buf, lengths_start))
    else:
        lengths = np.frombuffer(buf, dtype=_LENGTHS_DTYPE, count=n, offset=lengths_start)
        total = int(lengths.sum(dtype=np.uint64))
    if total != values_size:
        raise InvalidRecordBatchError(
            f"record lengths sum to {total} but the batch holds {values_size} bytes of values"
        )
    _check_crc(buf, start, end, header, verify_crc)
    return header


def _check_crc(buf: Buffer, start: int, end: int, header: BatchHeader, verify_crc: bool) -> None:
    if verify_crc:
        actual = crc32c(buf, start + CRC_START, end)
        if actual != header.crc:
            raise InvalidRecordBatchError(
                f"record batch CRC-32C mismatch: header {header.crc:#010x}, computed {actual:#010x}"
            )


def validate_batch(buf: Buffer, *, verify_crc: bool = True) -> BatchHeader:
    """Check that ``buf`` is exactly one well-formed batch and return its header.

    Raises InvalidRecordBatchError naming the first inconsistency found: sizes
    (batch_length against the buffer and against 19 + 4n + sum(lengths)), magic,
    record_count >= 1, and the CRC-32C; for magic 2 every rule of its layout
    (``sbp.batch_v2``).
    """
    return _check(buf, 0, len(buf), verify_crc)


def batch_spans(payload: Buffer) -> list[tuple[int, int]]:
    """``(start, end)`` of each batch in a payload of concatenated batches.

    Only the headers' batch_length fields are read; raises
    InvalidRecordBatchError unless the payload is whole batches end to end.
    """
    spans: list[tuple[int, int]] = []
    size = len(payload)
    start = 0
    while start < size:
        if size - start < BATCH_HEADER_SIZE:
            raise InvalidRecordBatchError(
                f"truncated record batch at byte {start}: {size - start} bytes left"
            )
        batch_length = _BATCH_LENGTH.unpack_from(payload, start + 8)[0]
        if batch_length < BATCH_LENGTH_FIXED:
            raise InvalidRecordBatchError(
                f"record batch at byte {start} has batch_length {batch_length}"
            )
        end = start + BATCH_LOG_OVERHEAD + batch_length
        if end > size:
            raise InvalidRecordBatchError(
                f"record batch at byte {start} needs {end - start} bytes, {size - start} left"
            )
        spans.append((start, end))
        start = end
    return spans


@dataclass(frozen=True, slots=True)
class DecodedRecords:
    """The records of one or more batches as columns.

    ``values[value_offsets[i]:value_offsets[i + 1]]`` is record i's value:
    exactly the two buffers of an Arrow binary column (int32 positions while
    they fit, else int64 as for large_binary). ``timestamps`` are the
    records' own (a magic 1 record's is its batch's). Magic 2 batches add
    ``value_valid`` (False: a null value, a tombstone), ``keys`` and
    ``headers``; each is None when no record decoded has one.
    """

    offsets: npt.NDArray[np.int64]
    timestamps: npt.NDArray[np.int64]
    values: npt.NDArray[np.uint8]
    value_offsets: npt.NDArray[np.int32] | npt.NDArray[np.int64]
    value_valid: npt.NDArray[np.bool_] | None = None
    keys: BinaryColumn | None = None
    headers: HeadersColumn | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    def value(self, i: int) -> bytes | None:
        """Record i's value (a copy; None for a tombstone); for tests and
        tools, not bulk paths."""
        if self.value_valid is not None and not self.value_valid[i]:
            return None
        return self.values[self.value_offsets[i] : self.value_offsets[i + 1]].tobytes()

    def key(self, i: int) -> bytes | None:
        """Record i's key (a copy), None when it has none."""
        return None if self.keys is None else self.keys.get(i)

    def headers_of(self, i: int) -> list[Header]:
        """Record i's headers (copies), in order."""
        return [] if self.headers is None else self.headers.of(i)

    def to_list(self) -> list[bytes | None]:
        """Every value as bytes (a per-record loop; for tests and tools)."""
        return [self.value(i) for i in range(len(self))]

    def drop_first(self, skip: int) -> DecodedRecords:
        """These records without the first ``skip`` (views, no copies of the data)."""
        if skip <= 0:
            return self
        value_offsets = self.value_offsets[skip:]
        start = int(value_offsets[0])
        return DecodedRecords(
            self.offsets[skip:],
            self.timestamps[skip:],
            self.values[start:],
            value_offsets - value_offsets.dtype.type(start),
            None if self.value_valid is None else self.value_valid[skip:],
            None if self.keys is None else _drop_entries(self.keys, skip),
            None if self.headers is None else _drop_headers(self.headers, skip),
        )


def _drop_entries(column: BinaryColumn, skip: int) -> BinaryColumn:
    offsets = column.offsets[skip:]
    start = int(offsets[0])
    return BinaryColumn(
        column.data[start:],
        offsets - offsets.dtype.type(start),
        None if column.valid is None else column.valid[skip:],
    )


def _drop_headers(headers: HeadersColumn, skip: int) -> HeadersColumn:
    entries = headers.entry_offsets[skip:]
    first = int(entries[0])
    return HeadersColumn(
        entries - entries.dtype.type(first),
        _drop_entries(headers.names, first),
        _drop_entries(headers.values, first),
    )


def _raise_first_bad(payload: Buffer, spans: list[tuple[int, int]], verify_crc: bool) -> NoReturn:
    """Raise the error of the first batch that fails its checks, naming
    what is wrong with it (``decode_batches`` found that one does)."""
    for start, end in spans:
        _check(payload, start, end, verify_crc)
    raise InvalidRecordBatchError("record batch failed its checks")


def decode_batches(payload: Buffer, *, verify_crc: bool = True) -> DecodedRecords:
    """Decode a payload of concatenated batches into columns.

    Every batch is validated (CRC-32C included unless ``verify_crc`` is false);
    a bad one raises InvalidRecordBatchError. The work is per batch, never per
    record. A single batch's values are a zero-copy view of ``payload``; values
    of several batches are gathered into one new buffer.
    """
    spans = batch_spans(payload)
    unpack = BATCH_HEADER.unpack_from
    # (base_offset, batch_length, magic, crc, flags, record_count, base_timestamp);
    # batch_spans made each batch_length match its span
    headers = [unpack(payload, start) for start, _ in spans]
    if any(header[2] == MAGIC_V2 for header in headers):
        return _decode_mixed(payload, spans, headers, verify_crc)
    return _decode_v1(payload, spans, headers, verify_crc)


def _decode_v1(
    payload: Buffer,
    spans: list[tuple[int, int]],
    headers: list[tuple[int, ...]],
    verify_crc: bool,
) -> DecodedRecords:
    """``decode_batches`` of magic 1 batches only: one pass of numpy per batch."""
    data = np.frombuffer(payload, dtype=np.uint8)
    for header in headers:
        if header[2] != BATCH_MAGIC or not 1 <= header[5] <= (header[1] - BATCH_LENGTH_FIXED) // 4:
            _raise_first_bad(payload, spans, verify_crc)
    base_offsets = np.array([header[0] for header in headers], dtype=np.int64)
    base_timestamps = np.array([header[6] for header in headers], dtype=np.int64)
    counts = np.array([header[5] for header in headers], dtype=np.int64)
    first_index = np.cumsum(counts) - counts  # each batch's first record
    # the bytes of values each batch holds, at its end (batch_length matches its span)
    held = [header[1] - BATCH_LENGTH_FIXED - 4 * header[5] for header in headers]
    # A single batch's values stay a view of the payload. Several batches'
    # values are gathered into one buffer, each batch right after its CRC-32C
    # has read it, while it is still in the CPU's cache (cheaper than one pass
    # over them all at the end).
    gathered = len(spans) > 1
    if gathered:
        values = np.empty(sum(held), dtype=np.uint8)
    elif spans:
        values = data[spans[0][1] - held[0] : spans[0][1]]
    else:
        values = np.empty(0, dtype=np.uint8)
    lengths_parts: list[npt.NDArray[np.uint32]] = []
    octets = data.data  # the payload as bytes, as fastcrc takes it
    position = 0
    for (start, end), header, size in zip(spans, headers, held, strict=True):
        values_start = end - size
        lengths_parts.append(data[start + BATCH_HEADER_SIZE : values_start].view(_LENGTHS_DTYPE))
        if verify_crc and _crc32c(octets[start + CRC_START : end]) != header[3]:
            _raise_first_bad(payload, spans, verify_crc)
        if gathered:
            values[position : position + size] = data[values_start:end]
            position += size
    if lengths_parts:
        lengths = lengths_parts[0] if len(lengths_parts) == 1 else np.concatenate(lengths_parts)
        # each batch's lengths must add up to the values it holds
        if not np.array_equal(np.add.reduceat(lengths, first_index, dtype=np.uint64), held):
            _raise_first_bad(payload, spans, verify_crc)

    total = int(counts.sum())
    # record j of batch b has offset base_offsets[b] + (j - first index of batch b)
    offsets = np.arange(total, dtype=np.int64) + np.repeat(base_offsets - first_index, counts)
    timestamps = np.repeat(base_timestamps, counts)

    value_offsets: npt.NDArray[np.int32] | npt.NDArray[np.int64]
    if len(values) <= np.iinfo(np.int32).max:
        value_offsets = np.zeros(total + 1, dtype=np.int32)
    else:
        value_offsets = np.zeros(total + 1, dtype=np.int64)
    if lengths_parts:
        np.cumsum(lengths, out=value_offsets[1:], dtype=value_offsets.dtype)
    return DecodedRecords(offsets, timestamps, values, value_offsets)


def _decode_mixed(
    payload: Buffer,
    spans: list[tuple[int, int]],
    headers: list[tuple[int, ...]],
    verify_crc: bool,
) -> DecodedRecords:
    """``decode_batches`` of a payload holding magic 2 batches: each batch
    decoded into columns on its own, then the columns joined."""
    parts: list[DecodedRecords] = []
    for (start, end), header in zip(spans, headers, strict=True):
        if header[2] != MAGIC_V2:
            parts.append(_decode_v1(payload, [(start, end)], [header], verify_crc))
            continue
        # decode_v2 checks the layout as it decodes: the CRC is all that is left
        checked = peek_header(payload, start)
        columns = batch_v2.decode_v2(payload, start, end)
        _check_crc(payload, start, end, checked, verify_crc)
        values = columns.values
        parts.append(
            DecodedRecords(
                checked.base_offset + columns.offset_deltas,
                columns.timestamps,
                values.data,
                values.offsets,
                values.valid,
                columns.keys,
                columns.headers,
            )
        )
    return join_records(parts)


def _joined(columns: list[BinaryColumn]) -> BinaryColumn:
    data = np.concatenate([c.data for c in columns]) if columns else np.empty(0, np.uint8)
    ends = np.cumsum([0, *(int(c.offsets[-1] - c.offsets[0]) for c in columns)])
    offsets = np.concatenate(
        [np.zeros(1, np.int64)]
        + [
            c.offsets[1:].astype(np.int64) - int(c.offsets[0]) + int(ends[i])
            for i, c in enumerate(columns)
        ]
    )
    if any(c.valid is not None for c in columns):
        valid: npt.NDArray[np.bool_] | None = np.concatenate(
            [np.ones(len(c), np.bool_) if c.valid is None else c.valid for c in columns]
        )
    else:
        valid = None
    if len(data) <= np.iinfo(np.int32).max:
        return BinaryColumn(data, offsets.astype(np.int32), valid)
    return BinaryColumn(data, offsets, valid)


def _no_entries(count: int) -> BinaryColumn:
    """``count`` null entries."""
    return BinaryColumn(
        np.empty(0, np.uint8), np.zeros(count + 1, np.int32), np.zeros(count, np.bool_)
    )


def _no_headers(count: int) -> HeadersColumn:
    empty = BinaryColumn(np.empty(0, np.uint8), np.zeros(1, np.int32))
    return HeadersColumn(np.zeros(count + 1, np.int32), empty, empty)


def join_records(parts: Sequence[DecodedRecords]) -> DecodedRecords:
    """Several runs of decoded records as one, in order (a copy of the
    columns, per part, never per record)."""
    if len(parts) == 1:
        return parts[0]
    values = _joined([BinaryColumn(p.values, p.value_offsets, p.value_valid) for p in parts])
    keys = None
    if any(p.keys is not None for p in parts):
        keys = _joined([_no_entries(len(p)) if p.keys is None else p.keys for p in parts])
    headers = None
    if any(p.headers is not None for p in parts):
        each = [_no_headers(len(p)) if p.headers is None else p.headers for p in parts]
        entry_ends = np.cumsum([0, *(int(h.entry_offsets[-1]) for h in each)])
        entry_offsets = np.concatenate(
            [np.zeros(1, np.int64)]
            + [
                h.entry_offsets[1:].astype(np.int64) + int(entry_ends[i])
                for i, h in enumerate(each)
            ]
        ).astype(np.int32)
        headers = HeadersColumn(
            entry_offsets, _joined([h.names for h in each]), _joined([h.values for h in each])
        )
    return DecodedRecords(
        np.concatenate([p.offsets for p in parts]) if parts else np.empty(0, np.int64),
        np.concatenate([p.timestamps for p in parts]) if parts else np.empty(0, np.int64),
        values.data,
        values.offsets,
        values.valid,
        keys,
        headers,
    )


def build_records(
    values: Sequence[Buffer | None],
    base_timestamp: int,
    *,
    keys: Sequence[Buffer | None] | None = None,
    headers: Sequence[Sequence[Header] | None] | None = None,
    timestamps: Sequence[int | None] | None = None,
    header_blocks: Sequence[bytes] | None = None,
) -> bytearray:
    """One batch of these records: magic 1 when they have no key, no header,
    no null value and no timestamp of their own (so they cost no byte more
    than before), else magic 2. ``header_blocks``: the headers already
    encoded (``batch_v2.encode_headers``), instead of ``headers``."""
    plain = (
        (keys is None or all(k is None for k in keys))
        and (headers is None or not any(headers))
        and (header_blocks is None or not any(header_blocks))
        and (timestamps is None or all(t is None or t == base_timestamp for t in timestamps))
        and None not in values
    )
    if plain:
        return build_batch(values, base_timestamp)  # type: ignore[arg-type]
    return batch_v2.build_batch_v2(
        values,
        base_timestamp,
        keys=keys,
        headers=headers,
        timestamps=timestamps,
        header_blocks=header_blocks,
    )
