"""One write task's rows appended to a stream.

The ``value`` column of each Arrow batch Spark hands over is cut into record
batches with numpy (``arrow.column_to_batches``) and given, as built, to one
``Producer`` of the client library: it sends them in order to the primary of
the stream's open range and, on RANGE_SEALED, RANGE_NOT_FOUND, NOT_PRIMARY or
a lost connection, lists the ranges again and resends. A batch whose answer
was lost may be stored twice: appends are at-least-once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa

from client.sync import SyncClient, SyncRecordsHandle

from .arrow import column_to_batches, value_column
from .options import WriteOptions


@dataclass
class AppendedSpan:
    """Offsets a task appended: ``[first_offset, last_offset]`` and how many records."""

    records: int = 0
    batches: int = 0
    first_offset: int = -1
    last_offset: int = -1


def append_values(options: WriteOptions, arrow_batches: Iterable[pa.RecordBatch]) -> AppendedSpan:
    """Append the ``value`` column of ``arrow_batches`` to ``options.stream``,
    in order; returns once every record is durable."""
    span = AppendedSpan()
    first: SyncRecordsHandle | None = None
    last: SyncRecordsHandle | None = None
    with (
        SyncClient(options.pm, timeout=options.timeout, tls=options.tls) as client,
        # one request at a time keeps the task's records in row order across retries
        client.producer(options.stream, request_timeout=options.timeout) as producer,
    ):
        for arrow_batch in arrow_batches:
            column = value_column(arrow_batch)
            for batch, count in column_to_batches(column, options.batch_max_bytes):
                last = producer.send_batch(batch)
                first = first or last
                span.records += count
                span.batches += 1
        producer.flush()
        if first is not None and last is not None:
            span.first_offset = int(first.offsets()[0])
            span.last_offset = int(last.offsets()[-1])
    return span
