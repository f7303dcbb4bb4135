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

from sbp.batches import DecodedRecords, build_batch_from_arrays

#: the rows the ``sbp`` source produces (``source.SCHEMA``) as Arrow: PySpark
#: checks a reader's batches against exactly this (Spark's timestamp is
#: microseconds in UTC on the Arrow side)
ARROW_SCHEMA: Final = pa.schema(
    [
        pa.field("stream_id", pa.int64()),
        pa.field("offset", pa.int64()),
        pa.field("timestamp", pa.timestamp("us", tz="UTC")),
        pa.field("value", pa.binary()),
    ]
)

_MICROS_PER_MILLI: Final = 1000


_INT64: Final = pa.int64()


def _int64_array(values: npt.NDArray[np.int64], type_: pa.DataType = _INT64) -> pa.Array:
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(values)])


def records_to_arrow(stream_id: int, records: DecodedRecords) -> pa.RecordBatch:
    """The records of one stream as a batch of ``ARROW_SCHEMA`` (values not copied)."""
    n = len(records)
    if records.value_offsets.dtype != np.int32:
        raise ValueError(f"{len(records.values)} bytes of values overflow an Arrow binary column")
    offsets = np.ascontiguousarray(records.offsets, dtype=np.int64)
    stream_ids = np.full(n, stream_id, dtype=np.int64)
    micros = records.timestamps * _MICROS_PER_MILLI
    value = pa.Array.from_buffers(
        pa.binary(),
        n,
        [None, pa.py_buffer(records.value_offsets), pa.py_buffer(records.values)],
    )
    return pa.RecordBatch.from_arrays(
        [
            _int64_array(stream_ids),
            _int64_array(offsets),
            _int64_array(micros, ARROW_SCHEMA.field("timestamp").type),
            value,
        ],
        schema=ARROW_SCHEMA,
    )


class ValueColumnError(ValueError):
    """The column to append is missing, of the wrong type, or holds nulls."""


def value_column(batch: pa.RecordBatch, name: str = "value") -> pa.Array:
    """The column ``name`` of ``batch``, checked to be binary or string without nulls."""
    if name not in batch.schema.names:
        raise ValueColumnError(
            f"writing to sbp needs a column {name!r} (binary or string); "
            f"the DataFrame has {batch.schema.names}"
        )
    column = batch.column(name)
    if not (
        pa.types.is_binary(column.type)
        or pa.types.is_string(column.type)
        or pa.types.is_large_binary(column.type)
        or pa.types.is_large_string(column.type)
    ):
        raise ValueColumnError(f"column {name!r} must be binary or string, not {column.type}")
    if column.null_count:
        raise ValueColumnError(
            f"column {name!r} holds {column.null_count} null values; records cannot be null"
        )
    return column


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
    column: pa.Array, batch_max_bytes: int, base_timestamp: int | None = None
) -> Iterator[tuple[bytearray, int]]:
    """SBP record batches holding the column's values in order, each with at
    most ``batch_max_bytes`` of values (a single larger value gets a batch of
    its own); yields ``(batch, record_count)``."""
    n = len(column)
    if n == 0:
        return
    timestamp = int(time.time() * 1000) if base_timestamp is None else base_timestamp
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
