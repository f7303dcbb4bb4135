"""Magic 2 record batches (SPEC §4, "Magic 2"; §13): keys, headers, record
timestamps and, after compaction, offset deltas, each as a column of
fixed-width entries present only when the batch needs it::

    0   8    base_offset        int64
    8   4    batch_length       int32   bytes after this field
    12  1    magic              int8    = 2
    13  4    crc                uint32  CRC-32C of bytes 17..end
    17  2    attributes         int16   bit 0 offset deltas, bit 1 timestamp
                                        deltas, bit 2 keys, bit 3 headers
    19  4    record_count       int32   n >= 1
    23  8    base_timestamp     int64
    31  4    last_offset_delta  int32   the batch covers base_offset .. + this
    35  4n   offset_deltas      int32[n]   (bit 0) strictly increasing
    ..  4n   timestamp_deltas   int32[n]   (bit 1)
    ..  4n   key_lengths        int32[n]   (bit 2) -1: no key
    ..  4n   value_lengths      int32[n]   -1: a null value (a tombstone)
    ..  4n   header_lengths     uint32[n]  (bit 3)
    ..       keys, then values, then headers blocks, each concatenated

A headers block is ``uint16 count`` and ``count`` times ``uint16 name
length, name (UTF-8), uint32 value length, value``.

Everything here works on columns: a batch is encoded from and decoded into
numpy arrays, with no Python step per record (the headers are parsed one
header position at a time across all records: a loop as long as the most
headers one record has).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from .crc32c import crc32c
from .errors import InvalidRecordBatchError
from .frames import Buffer

MAGIC_V2: Final = 2
OFFSET_DELTAS: Final = 0x1
TIMESTAMP_DELTAS: Final = 0x2
KEYS: Final = 0x4
HEADERS: Final = 0x8
KNOWN_ATTRIBUTES: Final = OFFSET_DELTAS | TIMESTAMP_DELTAS | KEYS | HEADERS

#: base_offset, batch_length, magic, crc, attributes, record_count,
#: base_timestamp, last_offset_delta
V2_HEADER: Final = struct.Struct(">qiBIhiqi")
V2_HEADER_SIZE: Final = V2_HEADER.size  # 35
#: bytes the batch_length field counts before the columns (magic .. last_offset_delta)
V2_LENGTH_FIXED: Final = V2_HEADER_SIZE - 12  # 23
_CRC_START: Final = 17
#: attributes, record_count, base_timestamp, last_offset_delta (the CRC-covered header)
_COVERED: Final = struct.Struct(">hiqi")
_I32: Final = np.dtype(">i4")
_U32: Final = np.dtype(">u4")
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
#: a header's name and value lengths, and a block's count
_NAME_LENGTH: Final = struct.Struct(">H")
_VALUE_LENGTH: Final = struct.Struct(">I")

Header = tuple[str, bytes]
#: the widest span of record timestamps one batch holds (int32 deltas from
#: its base, which is its earliest record's when need be): about 24 days
MAX_TIMESTAMP_SPAN_MS: Final = _INT32_MAX


@dataclass(frozen=True, slots=True)
class BinaryColumn:
    """Variable-length values as an Arrow binary column: ``data[offsets[i]:
    offsets[i + 1]]`` is entry i; ``valid`` is None when no entry is null."""

    data: npt.NDArray[np.uint8]
    offsets: npt.NDArray[np.int32] | npt.NDArray[np.int64]
    valid: npt.NDArray[np.bool_] | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get(self, i: int) -> bytes | None:
        """Entry i (a copy), None when null: for tests and tools."""
        if self.valid is not None and not self.valid[i]:
            return None
        return self.data[self.offsets[i] : self.offsets[i + 1]].tobytes()


@dataclass(frozen=True, slots=True)
class HeadersColumn:
    """Every record's headers as an Arrow ``map<string, binary>``: record i's
    entries are ``entry_offsets[i] .. entry_offsets[i + 1]`` of ``names`` and
    ``values`` (in the order the record carries them)."""

    entry_offsets: npt.NDArray[np.int32]
    names: BinaryColumn
    values: BinaryColumn

    def of(self, i: int) -> list[Header]:
        """Record i's headers (copies): for tests and tools."""
        lo, hi = int(self.entry_offsets[i]), int(self.entry_offsets[i + 1])
        return [
            (bytes(self.names.get(j) or b"").decode(), self.values.get(j) or b"")
            for j in range(lo, hi)
        ]


@dataclass(frozen=True, slots=True)
class V2Columns:
    """One magic 2 batch decoded: per record its offset delta and timestamp,
    and the key, value and headers columns."""

    offset_deltas: npt.NDArray[np.int64]
    timestamps: npt.NDArray[np.int64]
    keys: BinaryColumn | None
    values: BinaryColumn
    headers: HeadersColumn | None


# ------------------------------------------------------------------ building


def entry_lengths(items: Sequence[Buffer | None]) -> npt.NDArray[np.int64]:
    """Each item's length, -1 for None."""
    try:  # no None: lengths in C
        return np.fromiter(map(len, items), dtype=np.int64, count=len(items))  # type: ignore[arg-type]
    except TypeError:
        pass
    return np.fromiter(
        (-1 if item is None else len(item) for item in items), dtype=np.int64, count=len(items)
    )


def _joined(items: Sequence[Buffer | None]) -> bytes:
    """The items end to end (None: nothing)."""
    try:  # no None: joined in C
        return b"".join(items)  # type: ignore[arg-type]
    except TypeError:
        return b"".join(item for item in items if item is not None)


def encode_headers(headers: Sequence[Header]) -> bytes:
    """One record's headers block (b"" for no headers)."""
    if not headers:
        return b""
    parts = [_NAME_LENGTH.pack(len(headers))]
    for name, value in headers:
        raw = name.encode()
        if len(raw) > 0xFFFF:
            raise ValueError(f"a header name is at most 65,535 bytes; {len(raw)} given")
        parts += [_NAME_LENGTH.pack(len(raw)), raw, _VALUE_LENGTH.pack(len(value)), bytes(value)]
    return b"".join(parts)


def build_batch_v2(
    values: Sequence[Buffer | None],
    base_timestamp: int,
    *,
    keys: Sequence[Buffer | None] | None = None,
    headers: Sequence[Sequence[Header] | None] | None = None,
    timestamps: Sequence[int | None] | None = None,
    offset_deltas: Sequence[int] | None = None,
    last_offset_delta: int | None = None,
    header_blocks: Sequence[bytes] | None = None,
) -> bytearray:
    """One magic 2 batch (base_offset -1). ``None`` values are tombstones;
    ``keys``, ``headers`` and ``timestamps`` are per record (None: none, or
    the base timestamp); ``header_blocks`` are the records' headers already
    encoded (``encode_headers``; b"": none) instead of ``headers``. A column
    no record needs is left out. Producers give no ``offset_deltas``
    (dense); compaction gives them, with the batch's original
    ``last_offset_delta``."""
    n = len(values)
    if n < 1:
        raise ValueError("a record batch holds at least one record")
    stamps = None
    if timestamps is not None and any(t is not None and t != base_timestamp for t in timestamps):
        stamps = np.fromiter(
            (base_timestamp if t is None else t for t in timestamps), dtype=np.int64, count=n
        )
    key_column = None
    if keys is not None and any(k is not None for k in keys):
        key_column = (_joined(keys), entry_lengths(keys))
    if header_blocks is None and headers is not None:
        header_blocks = [encode_headers(h) if h else b"" for h in headers]
    header_column = None
    if header_blocks is not None and any(header_blocks):
        header_column = (
            b"".join(header_blocks),
            np.fromiter(map(len, header_blocks), dtype=np.int64, count=n),
        )
    return assemble_v2(
        (_joined(values), entry_lengths(values)),
        base_timestamp,
        keys=key_column,
        headers=header_column,
        timestamps=stamps,
        offset_deltas=None if offset_deltas is None else np.asarray(offset_deltas, np.int64),
        last_offset_delta=last_offset_delta,
    )


#: a column of variable-length entries as ``assemble_v2`` takes it: the
#: entries end to end, and each one's length (-1: null)
Entries = tuple[Buffer, npt.NDArray[np.int64]]


def assemble_v2(
    values: Entries,
    base_timestamp: int,
    *,
    keys: Entries | None = None,
    headers: Entries | None = None,
    timestamps: npt.NDArray[np.int64] | None = None,
    offset_deltas: npt.NDArray[np.int64] | None = None,
    last_offset_delta: int | None = None,
) -> bytearray:
    """A magic 2 batch from columns (numpy arrays, or Arrow buffers as
    memoryviews): ``values``,
    ``keys`` and ``headers`` (blocks already encoded) as their bytes end to
    end and each entry's length, ``timestamps`` per record. The work is per
    column, never per record."""
    n = len(values[1])
    attributes = 0
    columns: list[npt.NDArray[np.int64]] = []
    if offset_deltas is not None:
        attributes |= OFFSET_DELTAS
        columns.append(offset_deltas)
    if timestamps is not None:
        attributes |= TIMESTAMP_DELTAS
        if (
            timestamps.max() - base_timestamp > _INT32_MAX
            or timestamps.min() - base_timestamp < _INT32_MIN
        ):
            # the batch's base moves to its earliest record, so that deltas fit
            base_timestamp = int(timestamps.min())
        deltas = timestamps - base_timestamp
        if deltas.max() > _INT32_MAX:
            raise ValueError(
                f"the records' timestamps span more than {MAX_TIMESTAMP_SPAN_MS:,} ms: they "
                "go in batches of their own"
            )
        columns.append(deltas)
    parts: list[Buffer] = []
    if keys is not None:
        attributes |= KEYS
        columns.append(keys[1])
        parts.append(keys[0])
    columns.append(values[1])
    parts.append(values[0])
    if headers is not None:
        attributes |= HEADERS
        columns.append(headers[1])
        parts.append(headers[0])
    sizes = [memoryview(part).nbytes for part in parts]
    position = V2_HEADER_SIZE + 4 * n * len(columns)
    out = bytearray(position + sum(sizes))
    at = V2_HEADER_SIZE
    for column in columns:
        np.frombuffer(out, dtype=_I32, count=n, offset=at)[:] = column
        at += 4 * n
    for part, size in zip(parts, sizes, strict=True):
        out[position : position + size] = memoryview(part).cast("B")
        position += size
    span = n - 1 if last_offset_delta is None else last_offset_delta
    return finish_v2(out, attributes, n, base_timestamp, span)


def finish_v2(
    out: bytearray, attributes: int, n: int, base_timestamp: int, last_offset_delta: int
) -> bytearray:
    """Fill in a magic 2 batch's header and CRC (base_offset -1)."""
    batch_length = len(out) - 12
    if batch_length > _INT32_MAX:
        raise ValueError(f"a batch of {len(out)} bytes overflows the int32 batch_length")
    _COVERED.pack_into(out, _CRC_START, attributes, n, base_timestamp, last_offset_delta)
    crc = crc32c(out, _CRC_START)
    V2_HEADER.pack_into(
        out, 0, -1, batch_length, MAGIC_V2, crc, attributes, n, base_timestamp, last_offset_delta
    )
    return out


# ------------------------------------------------------------------ reading


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a checked batch's parts are, relative to the batch's start."""

    attributes: int
    count: int
    base_timestamp: int
    last_offset_delta: int
    offset_deltas: npt.NDArray[np.int64] | None
    timestamp_deltas: npt.NDArray[np.int64] | None
    key_lengths: npt.NDArray[np.int64] | None
    value_lengths: npt.NDArray[np.int64]
    header_lengths: npt.NDArray[np.int64] | None
    keys_start: int
    values_start: int
    headers_start: int


def _bad(message: str) -> InvalidRecordBatchError:
    return InvalidRecordBatchError(f"magic 2 record batch: {message}")


def _entries_size(lengths: npt.NDArray[np.int64], name: str) -> int:
    """The bytes of entries of these lengths (-1: null, no bytes)."""
    least = int(lengths.min())
    if least < -1:
        raise _bad(f"a {name} length of {least}")
    total = int(lengths.sum(dtype=np.int64))
    return total if least >= 0 else total + int((lengths < 0).sum())


def _layout(data: npt.NDArray[np.uint8], start: int, end: int) -> _Layout:
    """Check every rule of the layout but the CRC and the headers blocks'
    insides (``_parse_headers``); where the parts are."""
    size = end - start
    if size < V2_HEADER_SIZE:
        raise _bad(f"{size} bytes, shorter than its {V2_HEADER_SIZE}-byte header")
    _, batch_length, magic, _, attributes, n, base_timestamp, last = V2_HEADER.unpack_from(
        data.data, start
    )
    if magic != MAGIC_V2:
        raise _bad(f"magic {magic}")
    if batch_length + 12 != size:
        raise _bad(f"batch_length {batch_length} does not match the {size}-byte batch")
    if attributes & ~KNOWN_ATTRIBUTES:
        raise _bad(f"attributes {attributes:#06x} set bits other than 0-3")
    if n < 1:
        raise _bad(f"record_count {n}, expected at least 1")
    present = [bool(attributes & bit) for bit in (OFFSET_DELTAS, TIMESTAMP_DELTAS, KEYS)]
    has_headers = bool(attributes & HEADERS)
    columns = sum(present) + 1 + has_headers
    position = start + V2_HEADER_SIZE
    if V2_HEADER_SIZE + 4 * n * columns > size:
        raise _bad(f"{n} records need {4 * n * columns} bytes of lengths; the batch is {size}")
    if last < n - 1:
        raise _bad(f"last_offset_delta {last} covers fewer than its {n} records")

    def column(dtype: np.dtype[np.generic], widen: bool = True) -> npt.NDArray[np.int64]:
        """The next column; as int64 when ``widen`` (what offsets and
        timestamps are added to), else the int32 view itself."""
        nonlocal position
        values = data[position : position + 4 * n].view(dtype)
        position += 4 * n
        return values.astype(np.int64) if widen else values

    offset_deltas = column(_I32) if present[0] else None
    timestamp_deltas = column(_I32) if present[1] else None
    key_lengths = column(_I32, widen=False) if present[2] else None
    value_lengths = column(_I32, widen=False)
    header_lengths = column(_U32) if has_headers else None
    if offset_deltas is not None:
        if offset_deltas[0] < 0 or offset_deltas[-1] > last:
            raise _bad(f"offset deltas run {offset_deltas[0]}..{offset_deltas[-1]}, not 0..{last}")
        if n > 1 and not (np.diff(offset_deltas) > 0).all():
            raise _bad("offset deltas are not strictly increasing")
    keys_size = 0 if key_lengths is None else _entries_size(key_lengths, "key")
    values_size = _entries_size(value_lengths, "value")
    headers_size = 0 if header_lengths is None else int(header_lengths.sum())
    if position - start + keys_size + values_size + headers_size != size:
        raise _bad(
            f"lengths add up to {position - start + keys_size + values_size + headers_size} "
            f"bytes; the batch is {size}"
        )
    return _Layout(
        attributes,
        n,
        base_timestamp,
        last,
        offset_deltas,
        timestamp_deltas,
        key_lengths,
        value_lengths,
        header_lengths,
        position,
        position + keys_size,
        position + keys_size + values_size,
    )


def _gather(
    data: npt.NDArray[np.uint8], starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """The slices ``data[starts[i]:starts[i] + lengths[i]]`` end to end, and
    their offsets (n + 1): one fancy index, no loop."""
    n = len(lengths)
    width = int(lengths[0]) if n else 0
    if n and 0 < width <= len(data) and lengths.min() == lengths.max():
        # all alike (the same header name on every record): each slice one
        # element of an overlapping view of ``width``-byte items
        items = np.ndarray(
            (len(data) - width + 1,), dtype=np.dtype((np.void, width)), buffer=data, strides=(1,)
        )
        return items[starts].view(np.uint8), np.arange(0, (n + 1) * width, width, dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    if not total:
        return np.empty(0, dtype=np.uint8), offsets
    index = np.arange(total, dtype=np.int64) + np.repeat(starts - offsets[:-1], lengths)
    return data[index], offsets


def _column(
    data: npt.NDArray[np.uint8], start: int, lengths: npt.NDArray[np.int64]
) -> BinaryColumn:
    """A binary column of consecutive entries from ``start`` (length -1: null)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    if lengths.min() >= 0:  # no nulls
        np.cumsum(lengths, out=offsets[1:])
        return BinaryColumn(data[start : start + int(offsets[-1])], _narrow(offsets))
    np.cumsum(np.maximum(lengths, 0), out=offsets[1:])
    return BinaryColumn(data[start : start + int(offsets[-1])], _narrow(offsets), lengths >= 0)


def _narrow(offsets: npt.NDArray[np.int64]) -> npt.NDArray[np.int32] | npt.NDArray[np.int64]:
    """Offsets as int32 while they fit (an Arrow binary column's), else int64."""
    return offsets.astype(np.int32) if offsets[-1] <= _INT32_MAX else offsets


def _be(
    data: npt.NDArray[np.uint8], at: npt.NDArray[np.int64], width: int
) -> npt.NDArray[np.int64]:
    """The big-endian unsigned ints of ``width`` bytes at each of ``at``,
    through an overlapping view whose element i is the bytes from i on: one
    gather (IndexError past the data)."""
    words = np.ndarray(
        (max(len(data) - width + 1, 0),),
        dtype=">u2" if width == 2 else ">u4",
        buffer=data,
        strides=(1,),
    )
    return words[at]


def _parse_headers(
    data: npt.NDArray[np.uint8], start: int, lengths: npt.NDArray[np.int64], *, values: bool = True
) -> HeadersColumn | None:
    """Every record's headers block, checked and parsed (the header values
    gathered only with ``values``; None without)."""
    try:
        return _headers_blocks(data, start, lengths, values)
    except IndexError:  # a length that points past the batch
        raise _bad("a header runs past its block") from None


def _uniform_headers(
    data: npt.NDArray[np.uint8], start: int, lengths: npt.NDArray[np.int64], values: bool
) -> HeadersColumn | bool | None:
    """``_parse_headers`` when every record's block has the layout of the
    first (the same header count, name and value lengths: the same headers
    on every record, their values of one size), as rows of a 2-D view; False
    when they do not."""
    n, size = len(lengths), int(lengths[0])
    if size < 2 or lengths.min() != lengths.max() or start + n * size > len(data):
        return False
    first = bytes(data[start : start + size])
    count = _NAME_LENGTH.unpack_from(first, 0)[0]
    # the spans of bytes that hold the lengths, alike in every block
    fields: list[tuple[int, int]] = []
    layout: list[tuple[int, int, int, int]] = []  # name start, length, value start, length
    at = 0
    for _ in range(count):
        if at + 6 > size:
            return False
        name = _NAME_LENGTH.unpack_from(first, at + 2)[0]
        if at + 8 + name > size:
            return False
        value = _VALUE_LENGTH.unpack_from(first, at + 4 + name)[0]
        fields += [(at + 2, at + 4), (at + 4 + name, at + 8 + name)]
        layout.append((at + 4, name, at + 8 + name, value))
        at += 6 + name + value
    if at + 2 != size:
        return False
    blocks = data[start : start + n * size].reshape(n, size)
    spans = [(0, 2)]
    for a, b in fields:  # adjacent spans as one
        if spans[-1][1] == a:
            spans[-1] = (spans[-1][0], b)
        else:
            spans.append((a, b))
    for a, b in spans:
        if not (blocks[:, a:b] == blocks[0, a:b]).all():
            return False
    name_data = _columns_of(blocks, [(a, length) for a, length, _, _ in layout])
    if len(name_data) and int(name_data.max()) >= 0x80:
        return False  # names to check as UTF-8: the general path
    if not values:
        return None
    value_data = _columns_of(blocks, [(a, length) for _, _, a, length in layout])
    return HeadersColumn(
        np.arange(0, (n + 1) * count, count, dtype=np.int32)
        if count
        else np.zeros(n + 1, np.int32),
        BinaryColumn(name_data, _repeated_offsets([length for _, length, _, _ in layout], n)),
        BinaryColumn(value_data, _repeated_offsets([length for _, _, _, length in layout], n)),
    )


def _columns_of(
    blocks: npt.NDArray[np.uint8], spans: list[tuple[int, int]]
) -> npt.NDArray[np.uint8]:
    """The bytes of each row's ``spans``, row after row."""
    if len(spans) == 1:
        a, length = spans[0]
        # a copy: a one-byte column would otherwise stay a strided view
        return np.ascontiguousarray(blocks[:, a : a + length]).reshape(-1)
    return np.concatenate([blocks[:, a : a + length] for a, length in spans], axis=1).reshape(-1)


def _repeated_offsets(lengths: list[int], n: int) -> npt.NDArray[np.int32] | npt.NDArray[np.int64]:
    """The offsets of ``n`` runs of entries of ``lengths``."""
    offsets = np.zeros(len(lengths) * n + 1, dtype=np.int64)
    if len(lengths) == 1:
        offsets[1:] = np.arange(1, n + 1, dtype=np.int64) * lengths[0]
    else:
        np.cumsum(np.tile(np.array(lengths, dtype=np.int64), n), out=offsets[1:])
    return _narrow(offsets)


def _headers_blocks(
    data: npt.NDArray[np.uint8], start: int, lengths: npt.NDArray[np.int64], values: bool
) -> HeadersColumn | None:
    """``_parse_headers``: one pass per header position. A length that runs
    past its block leaves that block's walk past its end, which the check
    at the end finds."""
    n = len(lengths)
    uniform = _uniform_headers(data, start, lengths, values)
    if not isinstance(uniform, bool):
        return uniform
    block_ends = start + np.cumsum(lengths)
    block_starts = block_ends - lengths
    every = bool(lengths.min() > 0)
    if every:
        counts = _be(data, block_starts, 2)
    else:  # a record without headers has no block, its start maybe the batch's end
        counts = np.zeros(n, dtype=np.int64)
        has = lengths > 0
        counts[has] = _be(data, block_starts[has], 2)
    most = int(counts.max())
    position = block_starts + 2
    # per header position k: where each record's k-th name and value start, and their lengths
    parts: list[tuple[npt.NDArray[np.int64], ...]] = []
    rows_of: list[npt.NDArray[np.int64] | None] = []
    for k in range(most):
        rows = None if bool(counts.min() > k) else np.nonzero(counts > k)[0]
        at = position if rows is None else position[rows]
        names = _be(data, at, 2)
        after_name = at + 2 + names
        sizes = _be(data, after_name, 4)
        parts.append((at + 2, names, after_name + 4, sizes))
        rows_of.append(rows)
        if rows is None:
            position = parts[-1][2] + sizes
        else:
            position[rows] = parts[-1][2] + sizes
    done = position if every else np.where(lengths > 0, position, block_starts)
    if not np.array_equal(done, block_ends):
        if (done > block_ends).any():
            raise _bad("a header runs past its block")
        raise _bad("a headers block holds more than its headers")
    if most == 1 and rows_of[0] is None:  # one header on every record
        entry_offsets = np.arange(n + 1, dtype=np.int32)
        name_starts, name_lengths, value_starts, value_lengths = parts[0]
    else:  # entries in record order: each position's into its slots
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        entry_offsets = offsets.astype(np.int32)
        columns = [np.empty(int(offsets[-1]), dtype=np.int64) for _ in range(4)]
        for k, (part, rows) in enumerate(zip(parts, rows_of, strict=True)):
            slots = (offsets[:-1] if rows is None else offsets[rows]) + k
            for column, entries in zip(columns, part, strict=True):
                column[slots] = entries
        name_starts, name_lengths, value_starts, value_lengths = columns
    name_data, name_offsets = _gather(data, name_starts, name_lengths)
    if len(name_data) and int(name_data.max()) >= 0x80:
        # UTF-8 as a whole, and no name starting inside another's character:
        # then each name is UTF-8 on its own
        starts_of = name_data[name_offsets[:-1][name_lengths > 0]]
        if ((starts_of & 0xC0) == 0x80).any():
            raise _bad("a header name is not UTF-8")
        try:
            name_data.tobytes().decode("utf-8")
        except UnicodeDecodeError:
            raise _bad("a header name is not UTF-8") from None
    if not values:
        return None
    value_data, value_offsets = _gather(data, value_starts, value_lengths)
    return HeadersColumn(
        entry_offsets,
        BinaryColumn(name_data, _narrow(name_offsets)),
        BinaryColumn(value_data, _narrow(value_offsets)),
    )


def all_keyed(buf: Buffer, start: int) -> bool:
    """Whether every record of the (checked) magic 2 batch at ``buf[start:]``
    has a key."""
    attributes, n = _COVERED.unpack_from(buf, start + _CRC_START)[:2]
    if not attributes & KEYS:
        return False
    columns = bool(attributes & OFFSET_DELTAS) + bool(attributes & TIMESTAMP_DELTAS)
    lengths = np.frombuffer(
        buf, dtype=_I32, count=n, offset=start + V2_HEADER_SIZE + 4 * n * columns
    )
    return bool(lengths.min() >= 0)


def check_v2(buf: Buffer, start: int, end: int) -> tuple[int, int]:
    """Check every rule of the magic 2 batch at ``buf[start:end]`` but its
    CRC; its (record_count, last_offset_delta)."""
    data = np.frombuffer(buf, dtype=np.uint8)
    layout = _layout(data, start, end)
    if layout.header_lengths is not None:
        _parse_headers(data, layout.headers_start, layout.header_lengths, values=False)
    return layout.count, layout.last_offset_delta


def decode_v2(buf: Buffer, start: int, end: int) -> V2Columns:
    """The columns of the magic 2 batch at ``buf[start:end]``, every rule but
    its CRC checked on the way (InvalidRecordBatchError)."""
    data = np.frombuffer(buf, dtype=np.uint8)
    layout = _layout(data, start, end)
    n = layout.count
    deltas = np.arange(n, dtype=np.int64) if layout.offset_deltas is None else layout.offset_deltas
    timestamps = np.full(n, layout.base_timestamp, dtype=np.int64)
    if layout.timestamp_deltas is not None:
        timestamps += layout.timestamp_deltas
    keys = (
        None if layout.key_lengths is None else _column(data, layout.keys_start, layout.key_lengths)
    )
    values = _column(data, layout.values_start, layout.value_lengths)
    headers = (
        None
        if layout.header_lengths is None
        else _parse_headers(data, layout.headers_start, layout.header_lengths)
    )
    return V2Columns(deltas, timestamps, keys, values, headers)


# ------------------------------------------------------------------ compaction


def gap_marker(span: int) -> bytearray:
    """A placeholder for ``span`` offsets whose records compaction removed
    (SPEC §13): a magic 2 header with no record. Storage keeps it where
    batches were dropped, so that what a replica holds stays contiguous; it
    is never sent on the wire (``record_count`` 0 is refused there)."""
    out = bytearray(V2_HEADER_SIZE)
    return finish_v2(out, 0, 0, 0, span - 1)


def is_gap_marker(buf: Buffer, start: int = 0) -> bool:
    """Whether the stored batch at ``buf[start:]`` is a ``gap_marker``."""
    return buf[start + 12] == MAGIC_V2 and _COVERED.unpack_from(buf, start + _CRC_START)[1] == 0


def record_keys(
    buf: Buffer, start: int, end: int
) -> tuple[BinaryColumn | None, npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """The keys of the (checked) magic 2 batch at ``buf[start:end]``, its
    records' offset deltas, and which records are tombstones (a null value
    with a key)."""
    data = np.frombuffer(buf, dtype=np.uint8)
    layout = _layout(data, start, end)
    keys = (
        None if layout.key_lengths is None else _column(data, layout.keys_start, layout.key_lengths)
    )
    deltas = (
        np.arange(layout.count, dtype=np.int64)
        if layout.offset_deltas is None
        else layout.offset_deltas
    )
    tombstones = layout.value_lengths < 0
    if keys is None:
        tombstones[:] = False
    elif keys.valid is not None:
        tombstones &= keys.valid
    return keys, deltas, tombstones


def compact_batch(buf: Buffer, start: int, end: int, keep: npt.NDArray[np.bool_]) -> bytearray:
    """The magic 2 batch at ``buf[start:end]`` with only the records ``keep``
    marks (at least one): the same base offset, base timestamp and span, the
    kept records' offsets as deltas, their timestamps, keys, values and
    headers as they were, the CRC taken anew. A function of its input
    alone, so every replica makes the same bytes."""
    data = np.frombuffer(buf, dtype=np.uint8)
    layout = _layout(data, start, end)
    n = layout.count
    rows = np.nonzero(keep)[0]
    deltas = np.arange(n, dtype=np.int64) if layout.offset_deltas is None else layout.offset_deltas

    def entries(region: int, lengths: npt.NDArray[np.int64]) -> Entries:
        sizes = np.maximum(lengths, 0)
        starts = region + np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        taken, _ = _gather(data, starts[rows], sizes[rows])
        return taken.data, lengths[rows]

    stamps = None
    if layout.timestamp_deltas is not None:
        stamps = layout.base_timestamp + layout.timestamp_deltas[rows]
    out = assemble_v2(
        entries(layout.values_start, layout.value_lengths),
        layout.base_timestamp,
        keys=None if layout.key_lengths is None else entries(layout.keys_start, layout.key_lengths),
        headers=(
            None
            if layout.header_lengths is None
            else entries(layout.headers_start, layout.header_lengths)
        ),
        timestamps=stamps,
        offset_deltas=deltas[rows],
        last_offset_delta=layout.last_offset_delta,
    )
    # the stored base offset stays (it lies outside the CRC)
    out[:8] = bytes(data[start : start + 8])
    return out
