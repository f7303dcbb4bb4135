"""Record batches to and from Arrow, with numpy and no per-record Python work.

A decoded SBP batch (``sbp.batches.DecodedRecords``) already holds the two
buffers of an Arrow binary column, so reading wraps them without copying the
values. Writing goes the other way: an Arrow binary or string column's value
buffer and offsets become the lengths and values of SBP record batches.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from sbp.batch_v2 import assemble_v2, encode_headers
from sbp.batches import DecodedRecords, build_batch_from_arrays

#: the rows the ``sbp`` source produces (``source.SCHEMA``) as Arrow: PySpark
#: checks a reader's batches against exactly this (Spark's timestamp is
#: microseconds in UTC on the Arrow side)
ARROW_SCHEMA: Final = pa.schema(
    [
        pa.field("stream_id", pa.int64()),
        pa.field("offset", pa.int64()),
        pa.field("timestamp", pa.timestamp("us", tz="UTC")),
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
    ]
)
#: a record's headers (SPEC §13), with ``includeHeaders``
HEADERS_TYPE: Final = pa.map_(pa.string(), pa.binary())
ARROW_SCHEMA_WITH_HEADERS: Final = ARROW_SCHEMA.append(pa.field("headers", HEADERS_TYPE))

_MICROS_PER_MILLI: Final = 1000


_INT64: Final = pa.int64()
_BINARY: Final = pa.binary()
_NO_NAMES: Final = pa.array([], pa.string())
_NO_VALUES: Final = pa.array([], pa.binary())


def _int64_array(values: npt.NDArray[np.int64], type_: pa.DataType = _INT64) -> pa.Array:
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(values)])


def _validity(valid: npt.NDArray[np.bool_] | None) -> pa.Buffer | None:
    """An Arrow validity bitmap (None: every entry valid)."""
    if valid is None:
        return None
    return pa.py_buffer(np.packbits(valid, bitorder="little"))


def _binary(
    n: int,
    data: npt.NDArray[np.uint8],
    offsets: npt.NDArray[np.int32] | npt.NDArray[np.int64],
    valid: npt.NDArray[np.bool_] | None = None,
    type_: pa.DataType = _BINARY,
) -> pa.Array:
    if offsets.dtype != np.int32:
        raise ValueError(f"{len(data)} bytes overflow an Arrow binary column")
    return pa.Array.from_buffers(
        type_,
        n,
        [_validity(valid), pa.py_buffer(offsets), pa.py_buffer(data)],
        null_count=-1 if valid is None else int(n - valid.sum()),
    )


def _headers(records: DecodedRecords) -> pa.Array:
    """The records' headers as map<string, binary>: a map holds a name once,
    so of a name repeated in a record the last value is kept (SPEC §16)."""
    n = len(records)
    headers = records.headers
    if headers is None:
        return pa.MapArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), _NO_NAMES, _NO_VALUES)
    names, values = headers.names, headers.values
    offsets = np.asarray(headers.entry_offsets, dtype=np.int32)
    name_array = _binary(len(names), names.data, names.offsets, type_=pa.string())
    value_array = _binary(len(values), values.data, values.offsets)
    last = _last_of_each_name(offsets, name_array)
    if last is not None:
        kept_before = np.concatenate([[0], np.cumsum(last)]).astype(np.int32)
        offsets = kept_before[offsets]
        name_array = name_array.filter(pa.array(last))
        value_array = value_array.filter(pa.array(last))
    return pa.MapArray.from_arrays(pa.array(offsets), name_array, value_array)


def _last_of_each_name(
    offsets: npt.NDArray[np.int32], names: pa.Array
) -> npt.NDArray[np.bool_] | None:
    """Which header entries to keep so that each record has a name once (the
    last of it); None when no record repeats a name (the usual case: one
    grouping, nothing filtered)."""
    entries = len(names)
    counts = np.diff(offsets)
    if entries < 2 or counts.max() < 2:
        return None  # no record has two headers
    rows = np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), counts)
    table = pa.table({"row": rows, "name": names, "at": np.arange(entries, dtype=np.int64)})
    latest = table.group_by(["row", "name"]).aggregate([("at", "max")])
    if latest.num_rows == entries:
        return None
    keep = np.zeros(entries, dtype=np.bool_)
    keep[latest.column("at_max").to_numpy()] = True
    return keep


def records_to_arrow(
    stream_id: int, records: DecodedRecords, *, include_headers: bool = False
) -> pa.RecordBatch:
    """The records of one stream as a batch of ``ARROW_SCHEMA`` (with
    ``headers``: ``ARROW_SCHEMA_WITH_HEADERS``); values and keys not copied."""
    n = len(records)
    offsets = np.ascontiguousarray(records.offsets, dtype=np.int64)
    stream_ids = np.full(n, stream_id, dtype=np.int64)
    micros = records.timestamps * _MICROS_PER_MILLI
    value = _binary(n, records.values, records.value_offsets, records.value_valid)
    keys = records.keys
    key = pa.nulls(n, _BINARY) if keys is None else _binary(n, keys.data, keys.offsets, keys.valid)
    columns = [
        _int64_array(stream_ids),
        _int64_array(offsets),
        _int64_array(micros, ARROW_SCHEMA.field("timestamp").type),
        key,
        value,
    ]
    if include_headers:
        columns.append(_headers(records))
        return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA_WITH_HEADERS)
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)


class ValueColumnError(ValueError):
    """A column to append is missing, of the wrong type, or holds nulls it
    may not."""


def _is_bytes_type(type_: pa.DataType) -> bool:
    return bool(
        pa.types.is_binary(type_)
        or pa.types.is_string(type_)
        or pa.types.is_large_binary(type_)
        or pa.types.is_large_string(type_)
    )


def _is_bytes(column: pa.Array) -> bool:
    return _is_bytes_type(column.type)


def value_column(batch: pa.RecordBatch, name: str = "value") -> pa.Array:
    """The column ``name`` of ``batch``, checked to be binary or string; a
    null value only where a ``key`` column gives the record a key (a
    tombstone, SPEC §13)."""
    if name not in batch.schema.names:
        raise ValueColumnError(
            f"writing to sbp needs a column {name!r} (binary or string); "
            f"the DataFrame has {batch.schema.names}"
        )
    column = batch.column(name)
    if not _is_bytes(column):
        raise ValueColumnError(f"column {name!r} must be binary or string, not {column.type}")
    if column.null_count:
        key = batch.column("key") if "key" in batch.schema.names else None
        keyless_nulls = (
            column.null_count
            if key is None
            else int(pc.sum(pc.and_(column.is_null(), key.is_null())).as_py() or 0)
        )
        if keyless_nulls:
            raise ValueColumnError(
                f"column {name!r} holds {keyless_nulls} null values without a key; a null "
                "value is a tombstone and needs a key"
            )
    return column


def key_column(batch: pa.RecordBatch) -> pa.Array | None:
    """The optional ``key`` column (binary or string; null: no key)."""
    if "key" not in batch.schema.names:
        return None
    column = batch.column("key")
    if not _is_bytes(column):
        raise ValueColumnError(f"column 'key' must be binary or string, not {column.type}")
    return column


def headers_column(batch: pa.RecordBatch) -> pa.Array | None:
    """The optional ``headers`` column: map<string, binary or string>."""
    if "headers" not in batch.schema.names:
        return None
    column = batch.column("headers")
    if not (
        pa.types.is_map(column.type)
        and pa.types.is_string(column.type.key_type)
        and _is_bytes_type(column.type.item_type)
    ):
        raise ValueColumnError(
            f"column 'headers' must be map<string, binary or string>, not {column.type}"
        )
    return column


def _lengths_with_nulls(column: pa.Array, start: int, stop: int) -> npt.NDArray[np.int64]:
    """Each entry's length in ``[start, stop)``; -1 where it is null."""
    positions, _ = _column_buffers(column)
    lengths = np.diff(positions[start : stop + 1])
    if column.null_count:
        nulls = np.asarray(column.slice(start, stop - start).is_null())
        lengths = np.where(nulls, -1, lengths)
    return lengths


def _entries(column: pa.Array, start: int, stop: int) -> tuple[memoryview, npt.NDArray[np.int64]]:
    """Entries ``[start, stop)`` of a binary/string column as ``assemble_v2``
    takes them (a null's bytes are none: Arrow gives it an empty span)."""
    positions, data = _column_buffers(column)
    first, last = int(positions[start]), int(positions[stop])
    return data[first:last].data, _lengths_with_nulls(column, start, stop)


def _header_blocks(column: pa.Array, start: int, stop: int) -> tuple[bytes, npt.NDArray[np.int64]]:
    """The headers blocks of entries ``[start, stop)`` of a map column (a
    Python step per record: headers are written, not read, that way)."""
    blocks = [
        encode_headers(
            [
                (name, value.encode() if isinstance(value, str) else value)
                for name, value in (pairs or [])
            ]
        )
        if pairs
        else b""
        for pairs in column.slice(start, stop - start).to_pylist()
    ]
    return b"".join(blocks), np.fromiter(map(len, blocks), dtype=np.int64, count=len(blocks))


def _column_buffers(column: pa.Array) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
    """Absolute value positions (n + 1) and the value buffer of a binary/string column."""
    offset_type = (
        np.int64
        if pa.types.is_large_binary(column.type) or pa.types.is_large_string(column.type)
        else np.int32
    )
    _validity, offsets_buffer, data_buffer = column.buffers()
    n = len(column)
    positions = np.frombuffer(
        offsets_buffer,
        dtype=offset_type,
        count=n + 1,
        offset=column.offset * np.dtype(offset_type).itemsize,
    ).astype(np.int64)
    data = (
        np.frombuffer(data_buffer, dtype=np.uint8)
        if data_buffer is not None
        else np.empty(0, dtype=np.uint8)
    )
    return positions, data


def column_to_batches(
    column: pa.Array,
    batch_max_bytes: int,
    base_timestamp: int | None = None,
    *,
    keys: pa.Array | None = None,
    headers: pa.Array | None = None,
) -> Iterator[tuple[bytearray, int]]:
    """SBP record batches holding the column's values in order, each with at
    most ``batch_max_bytes`` of values (a single larger value gets a batch of
    its own); with ``keys`` or ``headers`` columns, magic 2 batches (SPEC
    §13). Yields ``(batch, record_count)``."""
    n = len(column)
    if n == 0:
        return
    timestamp = int(time.time() * 1000) if base_timestamp is None else base_timestamp
    if keys is not None or headers is not None:
        yield from _keyed_batches(column, keys, headers, batch_max_bytes, timestamp)
        return
    positions, data = _column_buffers(column)
    # Cut where the bytes since the last cut would pass batch_max_bytes: the
    # end position of each record, relative to the first, divided into buckets.
    ends = positions[1:] - positions[0]
    start = 0
    while start < n:
        base = ends[start - 1] if start else 0
        stop = int(np.searchsorted(ends, base + batch_max_bytes, side="right"))
        stop = max(stop, start + 1)
        first, last = int(positions[start]), int(positions[stop])
        lengths = np.diff(positions[start : stop + 1])
        yield build_batch_from_arrays(data[first:last], lengths, timestamp), stop - start
        start = stop


def _keyed_batches(
    values: pa.Array,
    keys: pa.Array | None,
    headers: pa.Array | None,
    batch_max_bytes: int,
    timestamp: int,
) -> Iterator[tuple[bytearray, int]]:
    """``column_to_batches`` of records with keys or headers: magic 2."""
    n = len(values)
    positions, _ = _column_buffers(values)
    ends = positions[1:] - positions[0]
    start = 0
    while start < n:
        base = ends[start - 1] if start else 0
        stop = max(int(np.searchsorted(ends, base + batch_max_bytes, side="right")), start + 1)
        batch = assemble_v2(
            _entries(values, start, stop),
            timestamp,
            keys=None
            if keys is None or keys.null_count == len(keys)
            else _entries(keys, start, stop),
            headers=None if headers is None else _header_blocks(headers, start, stop),
        )
        yield batch, stop - start
        start = stop
