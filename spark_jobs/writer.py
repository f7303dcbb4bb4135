"""One write task's rows appended to a stream, exactly once.

The ``value`` column of each Arrow batch Spark hands over (with its optional
``key`` and ``headers`` columns, SPEC §13) is cut into record batches with
numpy (``arrow.column_to_batches``) and given, as built, to one
idempotent ``Producer`` of the client library (SPEC §10): it sends them in
order to the primary of the stream's open range, resends on a sealed or
moved range or a lost answer, and the data node stores each batch once.

Each task appends as a producer of its own name, the same for every attempt
of the task (``producer_name``): the write job's id (or the streaming
query's) and the partition, at an epoch every attempt shares (0 for a batch
job, the micro-batch id for a streaming query). An attempt first asks the
stream how many records that producer stored (``Producer.resume``) and skips
that many rows of its input: a retried or speculative attempt, or a
micro-batch replayed after a driver restart, stores the rest once. This
holds if the attempt's input is the same rows in the same order, which
Spark's own exactly-once sinks assume too, and if the attempt before a
retry stops sending within ``RETRY_SETTLE_S`` of the retry's start: a
failed attempt's input ends early but normally, so it flushes what it had,
and the retry waits until the stream's count stands still that long.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Final

import pyarrow as pa

from client.producer import RESUME_SETTLE_S
from client.sync import SyncClient, SyncRecordsHandle

from .arrow import column_to_batches, headers_column, key_column, value_column
from .options import WriteOptions


@dataclass
class AppendedSpan:
    """Offsets a task appended: ``[first_offset, last_offset]``, how many
    records, and how many rows it skipped because the stream held them from
    an earlier attempt."""

    records: int = 0
    batches: int = 0
    first_offset: int = -1
    last_offset: int = -1
    skipped: int = 0


def producer_name(job: str, partition: int) -> str:
    """The producer of one task: the same for every attempt of it."""
    return f"spark/{job}/{partition}"


#: how long a retried task attempt watches the stream's count of its
#: producer's records stand still before it trusts it: the attempt before
#: it may still be sending (a failed attempt's input ends early but
#: normally, so it flushes what it has), and its records land first
RETRY_SETTLE_S: Final = 3.0


def settle_for(attempt: int) -> float:
    """How long an attempt's resume waits for the count to stand still: a
    first attempt has no earlier one to wait for."""
    return RETRY_SETTLE_S if attempt > 0 else RESUME_SETTLE_S


def append_values(
    options: WriteOptions,
    arrow_batches: Iterable[pa.RecordBatch],
    *,
    name: str,
    epoch: int = 0,
    settle_s: float = RESUME_SETTLE_S,
) -> AppendedSpan:
    """Append the ``value`` column of ``arrow_batches`` to ``options.stream``,
    in order, as producer ``name`` at ``epoch``, after the rows the stream
    holds from that producer already (``settle_s``: see ``settle_for``);
    returns once every record is durable."""
    span = AppendedSpan()
    first: SyncRecordsHandle | None = None
    last: SyncRecordsHandle | None = None
    with (
        SyncClient(options.pm, timeout=options.timeout, tls=options.tls) as client,
        client.producer(
            options.stream, request_timeout=options.timeout, name=name, epoch=epoch
        ) as producer,
    ):
        span.skipped = producer.resume(settle_s)
        for arrow_batch in _after(arrow_batches, span.skipped):
            column = value_column(arrow_batch)
            keyed = column_to_batches(
                column,
                options.batch_max_bytes,
                keys=key_column(arrow_batch),
                headers=headers_column(arrow_batch),
            )
            for batch, count in keyed:
                last = producer.send_batch(batch)
                first = first or last
                span.records += count
                span.batches += 1
        producer.flush()
        if first is not None and last is not None:
            span.first_offset = int(first.offsets()[0])
            span.last_offset = int(last.offsets()[-1])
    return span


def _after(arrow_batches: Iterable[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    """The batches without their first ``rows`` rows."""
    for batch in arrow_batches:
        if rows >= batch.num_rows:
            rows -= batch.num_rows
            continue
        yield batch.slice(rows) if rows else batch
        rows = 0
