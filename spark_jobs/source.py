"""The ``sbp`` PySpark data source: batch and streaming reads, batch writes.

::

    spark.dataSource.register(SBPDataSource)        # spark_session() does this
    df = (spark.read.format("sbp").option("pm", "127.0.0.1:7400")
          .option("streams", "1,2").load())         # stream_id, offset, timestamp, value

    (df.select("value").write.format("sbp").mode("append")
       .option("pm", "127.0.0.1:7400").option("stream", "3").save())

Reads plan one input partition per range (long ranges cut by
``maxRecordsPerPartition``) from the PM's LIST_RANGES, and each partition
fetches from the range's primary, falling back to other replicas. Streaming
offsets are each stream's next offset to read, as JSON ``{"1": 500}``.
See docs/spark.md for every option.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import (
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from .options import (
    EARLIEST_CODE,
    OffsetSpec,
    ReadOptions,
    SBPOptionError,
    TimeSpec,
    WriteOptions,
)

# Spark starts a fresh Python process to create the source and another to
# plan each query; only what a step needs is imported in it (trio, the
# client and pyarrow cost a few hundred ms), hence the imports inside methods.
if TYPE_CHECKING:
    import pyarrow as pa

    from .layout import StreamLayout
    from .writer import AppendedSpan

log = logging.getLogger(__name__)

#: JSON form of streaming offsets: stream id (a string key) -> next offset to read
StreamOffsets = dict[str, int]


def _layouts(options: ReadOptions, stream_ids: Sequence[int] | None) -> dict[int, StreamLayout]:
    from .layout import stream_layouts

    return stream_layouts(options.pm, stream_ids, options.timeout, options.tls)


#: ``stream_id long, offset long, timestamp timestamp, key binary, value
#: binary``, built field by field: parsing DDL needs a JVM, which Python
#: workers do not have. ``timestamp`` is the record's own (SPEC §13); ``key``
#: is null for a record without one, ``value`` for a tombstone.
SCHEMA = StructType(
    [
        StructField("stream_id", LongType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
    ]
)
#: with ``includeHeaders``: ``headers map<string, binary>`` too (a name
#: repeated in a record keeps its last value)
SCHEMA_WITH_HEADERS = StructType(
    [*SCHEMA.fields, StructField("headers", MapType(StringType(), BinaryType()))]
)


def schema_for(options: Mapping[str, str]) -> StructType:
    """The rows the source gives with these options."""
    include = {k.lower(): v for k, v in options.items()}.get("includeheaders", "false")
    return SCHEMA_WITH_HEADERS if include.strip().lower() == "true" else SCHEMA


def _check_schema(schema: StructType, expected: StructType) -> None:
    if [(f.name, f.dataType) for f in schema.fields] != [
        (f.name, f.dataType) for f in expected.fields
    ]:
        raise SBPOptionError(
            f"the sbp source has the fixed schema '{expected.simpleString()}'; "
            f"do not pass another one (got '{schema.simpleString()}')"
        )


def _read(partition: InputPartition, options: ReadOptions) -> Iterator[pa.RecordBatch]:
    from client.sync import SyncClient
    from sbp.allocator import keep_freed_memory

    from .layout import RangeSlice
    from .reader import read_slice

    keep_freed_memory()  # this worker receives a megabyte per FETCH (sbp/allocator.py)

    if not isinstance(partition, RangeSlice):
        return  # Spark's stand-in partition when partitions() planned none
    # made here, in the worker that reads: a client does not survive Spark's fork
    with SyncClient(options.pm, timeout=options.timeout, tls=options.tls) as client:
        yield from read_slice(
            client, partition, options.fetch_max_bytes, include_headers=options.include_headers
        )


def _by_time(
    options: ReadOptions,
    times: TimeSpec,
    layouts: Mapping[int, StreamLayout],
    spec: OffsetSpec,
) -> OffsetSpec:
    """``spec`` with the streams that ``times`` names set by append time."""
    if not times.given:
        return spec
    from .positions import offsets_by_time

    return offsets_by_time(options, times, layouts, spec)


def _plan(
    layouts: Mapping[int, StreamLayout], bounds: list[tuple[int, int, int]], max_records: int
) -> list[InputPartition]:
    from .layout import plan_all

    # Spark wants a list; an empty one reads nothing
    return list(plan_all(layouts, bounds, max_records))


class SBPDataSource(DataSource):
    """Streams of an SBP cluster as a table of ``stream_id, offset, timestamp, value``."""

    @classmethod
    def name(cls) -> str:
        return "sbp"

    def schema(self) -> StructType:
        return schema_for(self.options)

    def reader(self, schema: StructType) -> DataSourceReader:
        _check_schema(schema, schema_for(self.options))
        options = ReadOptions.parse(self.options)
        if options.group is not None:
            raise SBPOptionError(
                "option 'group' is for streaming reads (spark.readStream): a batch read "
                "keeps no position"
            )
        return SBPBatchReader(options)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        _check_schema(schema, schema_for(self.options))
        return SBPStreamReader(ReadOptions.parse(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> SBPWriter:
        _check_writable(schema, overwrite)
        return SBPWriter(WriteOptions.parse(self.options))

    def streamWriter(self, schema: StructType, overwrite: bool) -> SBPStreamWriter:
        _check_writable(schema, overwrite)
        return SBPStreamWriter(WriteOptions.parse(self.options))


def _check_writable(schema: StructType, overwrite: bool) -> None:
    if overwrite:
        raise SBPOptionError("sbp streams are append-only: write with .mode('append')")
    field = next((f for f in schema.fields if f.name == "value"), None)
    if field is None or not isinstance(field.dataType, BinaryType | StringType):
        raise SBPOptionError(
            "writing to sbp needs a column 'value' of type binary or string; "
            f"the DataFrame has '{schema.simpleString()}'"
        )


class SBPBatchReader(DataSourceReader):
    """Reads ``[startingOffsets, endingOffsets)`` of each stream, resolved when planned."""

    def __init__(self, options: ReadOptions) -> None:
        self.options = options

    def partitions(self) -> list[InputPartition]:
        options = self.options
        layouts = _layouts(options, options.streams)
        starting = _by_time(options, options.starting_times, layouts, options.starting)
        ending = _by_time(options, options.ending_times, layouts, options.ending)
        bounds = []
        fail = options.fail_on_data_loss
        for stream_id, layout in layouts.items():
            start = layout.resolve(starting, fail_on_data_loss=fail)
            end = layout.resolve(ending)
            wanted_start = starting.for_stream(stream_id)
            wanted_end = ending.for_stream(stream_id)
            if start > end or (0 <= wanted_end < wanted_start):
                shown_start = start if wanted_start < 0 else wanted_start
                shown_end = end if wanted_end < 0 else wanted_end
                raise SBPOptionError(
                    f"stream {stream_id}: startingOffsets ({shown_start}) is after "
                    f"endingOffsets ({shown_end})"
                )
            bounds.append((stream_id, start, end))
        return _plan(layouts, bounds, options.max_records_per_partition)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from _read(partition, self.options)


def _fair_shares(available: Mapping[str, int], budget: int) -> dict[str, int]:
    """Split ``budget`` records among streams with ``available`` records each,
    evenly, handing what a short stream cannot take to the others."""
    shares = dict.fromkeys(available, 0)
    pending = {key: count for key, count in available.items() if count > 0}
    while budget > 0 and pending:
        share = max(1, budget // len(pending))
        for key in sorted(pending):
            take = min(share, pending[key], budget)
            shares[key] += take
            pending[key] -= take
            budget -= take
            if budget == 0:
                break
        pending = {key: count for key, count in pending.items() if count > 0}
    return shares


class SBPStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches over the streams' new records.

    An offset is ``{"<stream id>": next offset to read}``; streams that appear
    later (with ``streams=all``) start at their earliest record. The default
    read limit is ``maxRecordsPerTrigger`` records per micro-batch, shared
    fairly among streams; ``availableNow`` drains up to the ends seen when the
    query started, in micro-batches of that size.
    """

    def __init__(self, options: ReadOptions) -> None:
        self.options = options
        self._target: StreamOffsets | None = None
        #: what was last committed to the group (option ``group``)
        self._committed: StreamOffsets = {}

    def _layouts(self, stream_ids: Sequence[int] | None = None) -> dict[int, StreamLayout]:
        ids = self.options.streams if stream_ids is None else stream_ids
        return _layouts(self.options, ids)

    def initialOffset(self) -> StreamOffsets:
        """Where a query without a checkpoint starts: the group's positions
        (option ``group``) where it has them, else the starting time or
        offset of each stream."""
        options = self.options
        layouts = self._layouts()
        starting = _by_time(options, options.starting_times, layouts, options.starting)
        if options.group is not None:
            from .positions import group_positions

            held = group_positions(options, options.group)
            starting = OffsetSpec(starting.default, {**starting.per_stream, **held})
        fail = options.fail_on_data_loss
        return {
            str(stream_id): layout.resolve(starting, fail_on_data_loss=fail)
            for stream_id, layout in layouts.items()
        }

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.options.max_records_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        # Later appends belong to the next run, so the query ends.
        self._target = {
            str(stream_id): layout.next_offset for stream_id, layout in self._layouts().items()
        }

    def reportLatestOffset(self) -> StreamOffsets:
        return {str(stream_id): layout.next_offset for stream_id, layout in self._layouts().items()}

    def latestOffset(self, start: StreamOffsets, limit: ReadLimit) -> StreamOffsets:
        # Spark asks for the next batch once the one ending at ``start`` has
        # run and its output is committed (and once more when an
        # availableNow run is done): ``start`` is processed.
        self._commit_to_group(start)
        begins: dict[str, int] = {}
        available: dict[str, int] = {}
        for stream_id, layout in self._layouts().items():
            key = str(stream_id)
            if self._target is not None and key not in self._target:
                continue  # appeared after an availableNow run began
            begin = layout.bound(
                int(start.get(key, EARLIEST_CODE)),
                fail_on_data_loss=self.options.fail_on_data_loss,
            )
            latest = layout.next_offset
            if self._target is not None:
                latest = min(latest, self._target[key])
            begins[key] = begin
            available[key] = max(0, latest - begin)
        total = sum(available.values())
        if isinstance(limit, ReadMaxRows):
            takes = _fair_shares(available, limit.max_rows)
        elif isinstance(limit, ReadMinRows) and total < limit.min_rows:
            return dict(start)
        else:  # ReadAllAvailable, and limits in units this source does not have
            takes = available
        end = dict(start)
        for key, begin in begins.items():
            if key in start or takes[key] > 0:
                end[key] = begin + takes[key]
        return end

    def partitions(self, start: StreamOffsets, end: StreamOffsets) -> list[InputPartition]:
        if not end:
            return []
        layouts = self._layouts([int(key) for key in end])
        bounds = []
        for key, stop in end.items():
            layout = layouts[int(key)]
            begin = layout.bound(int(start.get(key, EARLIEST_CODE)))
            bounds.append((int(key), begin, max(begin, int(stop))))
        return _plan(layouts, bounds, self.options.max_records_per_partition)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from _read(partition, self.options)

    def commit(self, end: StreamOffsets) -> None:
        """With option ``group``, a processed micro-batch's ends become the
        group's positions (SPEC §11): its lag shows on the dashboard and in
        ``sbp groups``. The query itself restarts from its checkpoint."""
        self._commit_to_group(end)

    def _commit_to_group(self, processed: StreamOffsets) -> None:
        if self.options.group is None or not processed or processed == self._committed:
            return
        from .positions import commit_positions

        commit_positions(self.options, self.options.group, processed)
        self._committed = dict(processed)


@dataclass
class AppendCommitMessage(WriterCommitMessage):
    """What one write task appended."""

    stream_id: int
    span: AppendedSpan


class SBPWriter(DataSourceArrowWriter):
    """Appends the ``value`` column to ``stream``, in record batches of up to
    ``batchMaxBytes`` of values, each task in its partition's row order.

    Each row is stored once (``spark_jobs.writer``): a task that fails and is
    retried, or runs speculatively, leaves each of its rows in the stream
    once, given the same input rows in the same order. Every batch is
    durable once its APPEND is answered, before Spark commits the job, and
    nothing can take it back: an aborted job may leave some of its records.
    """

    def __init__(self, options: WriteOptions) -> None:
        self.options = options
        #: this write job, made on the driver: every attempt of a task shares it
        self.job = uuid.uuid4().hex

    def write(self, iterator: Iterator[pa.RecordBatch]) -> AppendCommitMessage:
        from pyspark import TaskContext

        from .writer import append_values, producer_name, settle_for

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        attempt = context.attemptNumber() if context is not None else 0
        span = append_values(
            self.options,
            iterator,
            name=producer_name(self.job, partition),
            epoch=0,
            settle_s=settle_for(attempt),
        )
        return AppendCommitMessage(self.options.stream, span)

    def commit(self, messages: list[Any]) -> None:
        """The records are already durable; only note what the job appended."""
        spans = [m.span for m in messages if isinstance(m, AppendCommitMessage)]
        log.info(
            "appended %d records to stream %d in %d tasks",
            sum(span.records for span in spans),
            self.options.stream,
            len(spans),
        )

    def abort(self, messages: list[Any]) -> None:
        """Appends cannot be undone: records of tasks that finished stay in the stream."""
        spans = [m.span for m in messages if isinstance(m, AppendCommitMessage)]
        log.warning(
            "write to stream %d aborted; %d records appended by finished tasks remain",
            self.options.stream,
            sum(span.records for span in spans),
        )


class SBPStreamWriter(DataSourceStreamArrowWriter):
    """A streaming query's sink: each micro-batch's ``value`` column
    appended to ``stream``, each row once.

    Each task appends as a producer named by the query (its id, kept in the
    checkpoint across restarts) and the partition, at the micro-batch id as
    its epoch (``spark_jobs.writer``). A micro-batch run again after a driver
    restart, or a retried task, skips the rows the stream holds from that
    producer and epoch: nothing is written twice, given the same input,
    which Spark's replay from its offset log provides.
    """

    def __init__(self, options: WriteOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[pa.RecordBatch]) -> AppendCommitMessage:
        from pyspark import TaskContext

        from .writer import append_values, producer_name, settle_for

        context = TaskContext.get()
        assert context is not None, "a stream writer runs in a Spark task"
        batch_id = int(context.getLocalProperty("streaming.sql.batchId") or 0)
        query = context.getLocalProperty("sql.streaming.queryId") or "query"
        name = producer_name(f"stream-{query}", context.partitionId())
        settle_s = settle_for(context.attemptNumber())
        span = append_values(self.options, iterator, name=name, epoch=batch_id, settle_s=settle_s)
        return AppendCommitMessage(self.options.stream, span)

    def commit(self, messages: list[Any], batchId: int) -> None:
        spans = [m.span for m in messages if isinstance(m, AppendCommitMessage)]
        log.info(
            "micro-batch %d: appended %d records to stream %d (%d rows were there already)",
            batchId,
            sum(span.records for span in spans),
            self.options.stream,
            sum(span.skipped for span in spans),
        )

    def abort(self, messages: list[Any], batchId: int) -> None:
        log.warning(
            "micro-batch %d to stream %d aborted; what its finished tasks appended stays, "
            "and its replay does not append it again",
            batchId,
            self.options.stream,
        )
