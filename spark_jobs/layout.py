"""Where the records of streams are: ranges from the PM, the live end from
the data node holding the open range, and input partitions planned over them.

The PM's ``next_offset`` of an open range is a snapshot that lags the data
node, so the end of a stream is asked of the open range's replicas with
DESCRIBE_RANGES (SPEC §5): its commit offset, below which records are
acknowledged (SPEC §7). Sealed ranges end where the PM says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import trio
from pyspark.sql.datasource import InputPartition

from client import DEFAULT_TIMEOUT
from client.datanode_client import DataNodeClient
from client.pm_client import PMClient
from client.sync import SyncClient
from net.pool import ConnectionPool
from net.tls import TLSSettings
from sbp import messages
from sbp.errors import ConnectionClosed, ProtocolError, SBPError, StreamNotFoundError

from .options import EARLIEST_CODE, LATEST_CODE, OffsetSpec

#: streams described at once when planning over many
_DESCRIBE_CONCURRENCY = 16


def replica_addresses(rng: messages.Range) -> tuple[str, ...]:
    """The range's data nodes' addresses, primary first."""
    return tuple(node.advertise_addr for node in rng.nodes_primary_first())


@dataclass(frozen=True)
class StreamLayout:
    """A stream's ranges and its records' offsets ``[first_offset, next_offset)``."""

    stream_id: int
    ranges: tuple[messages.Range, ...]
    next_offset: int

    @property
    def first_offset(self) -> int:
        return self.ranges[0].start_offset if self.ranges else self.next_offset

    def bound(self, offset: int, *, fail_on_data_loss: bool = False) -> int:
        """An offset of a spec (earliest, latest, or a number) clamped to the
        records there are. With ``fail_on_data_loss``, a number below the
        first offset (trimmed away) raises ``DataLossError`` instead."""
        if offset == EARLIEST_CODE:
            return self.first_offset
        if offset == LATEST_CODE:
            return self.next_offset
        if fail_on_data_loss and offset < self.first_offset:
            raise DataLossError(
                f"offset {offset} of stream {self.stream_id} was trimmed away: the stream "
                f"starts at {self.first_offset} now (failOnDataLoss=false reads from there)"
            )
        return min(max(offset, self.first_offset), self.next_offset)

    def resolve(self, spec: OffsetSpec, *, fail_on_data_loss: bool = False) -> int:
        return self.bound(spec.for_stream(self.stream_id), fail_on_data_loss=fail_on_data_loss)


class DataLossError(RuntimeError):
    """Records a query asked for are gone (trimmed, or expired by retention)."""


class SourceError(RuntimeError):
    """The cluster could not say where the streams are: one line naming the
    stream or the address."""


def _one_line(error: BaseException, pm_address: str) -> SourceError:
    """The first real error inside (nested) exception groups, as one line."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    if isinstance(error, StreamNotFoundError):
        return SourceError(f"no such stream on the PM at {pm_address}: {error.message}")
    if isinstance(error, ConnectionClosed | OSError | trio.TooSlowError):
        return SourceError(f"cannot reach the PM at {pm_address}: {error or 'no answer'}")
    return SourceError(f"cannot describe the streams (PM {pm_address}): {error}")


async def _live_next_offset(pool: ConnectionPool, rng: messages.Range, timeout: float) -> int:
    """Where the open range's readable records end: its commit offset, asked
    of its replicas, primary first."""
    failure: Exception | None = None
    for address in replica_addresses(rng):
        node = DataNodeClient(address, pool=pool, timeout=timeout)
        try:
            described = await node.describe_range(rng.stream_id, rng.range_index)
        except (ProtocolError, ConnectionClosed, OSError) as error:
            failure = error
            continue
        # Records past the commit offset could still be taken back (SPEC §7).
        return int(described.commit_offset)
    raise RuntimeError(
        f"no replica of range {rng.range_index} of stream {rng.stream_id} could say its end"
    ) from failure


async def describe_stream(pm: PMClient, pool: ConnectionPool, stream_id: int) -> StreamLayout:
    """A stream's ranges from the PM and its live end (data nodes reached
    through ``pool``, with the PM client's timeout)."""
    ranges = tuple(sorted(await pm.list_stream_ranges(stream_id), key=lambda r: r.range_index))
    if not ranges:
        return StreamLayout(stream_id, ranges, 0)
    last = ranges[-1]
    if last.is_open:
        next_offset = await _live_next_offset(pool, last, pm.timeout)
    else:
        next_offset = last.end_offset
    return StreamLayout(stream_id, ranges, next_offset)


async def describe_streams(
    pm: PMClient, pool: ConnectionPool, stream_ids: Sequence[int] | None
) -> dict[int, StreamLayout]:
    """Layouts of ``stream_ids`` (every stream the PM knows for None), described concurrently."""
    ids = (
        list(stream_ids)
        if stream_ids is not None
        else [stream.stream_id async for stream in pm.list_streams()]
    )
    layouts: dict[int, StreamLayout] = {}
    limiter = trio.CapacityLimiter(_DESCRIBE_CONCURRENCY)

    async def describe(stream_id: int) -> None:
        async with limiter:
            layouts[stream_id] = await describe_stream(pm, pool, stream_id)

    async with trio.open_nursery() as nursery:
        for stream_id in ids:
            nursery.start_soon(describe, stream_id)
    return {stream_id: layouts[stream_id] for stream_id in ids}


def stream_layouts(
    pm_address: str,
    stream_ids: Sequence[int] | None,
    timeout: float = DEFAULT_TIMEOUT,
    tls: TLSSettings | None = None,
) -> dict[int, StreamLayout]:
    """``describe_streams`` from synchronous code (a Spark driver, a job);
    raises ``SourceError``, one line, when the cluster cannot answer."""
    try:
        with SyncClient(pm_address, timeout=timeout, tls=tls) as client:
            return client.run(describe_streams, client.pm, client.pool, stream_ids)
    except (SBPError, OSError, trio.TooSlowError, BaseExceptionGroup, RuntimeError) as error:
        if isinstance(error, SourceError):
            raise
        raise _one_line(error, pm_address) from None


@dataclass
class RangeSlice(InputPartition):
    """One input partition: offsets ``[start, end)`` of one range of a stream,
    and the data nodes that hold it (primary first)."""

    stream_id: int
    range_index: int
    start: int
    end: int
    replicas: tuple[str, ...]

    @property
    def records(self) -> int:
        return self.end - self.start


def plan_slices(layout: StreamLayout, start: int, end: int, max_records: int) -> list[RangeSlice]:
    """Partitions reading ``[start, end)`` of a stream: one per range it
    touches, long ones cut into pieces of at most ``max_records``."""
    slices: list[RangeSlice] = []
    for rng in layout.ranges:
        range_end = layout.next_offset if rng.is_open else rng.end_offset
        low, high = max(start, rng.start_offset), min(end, range_end)
        replicas = replica_addresses(rng)
        for piece_start in range(low, high, max_records):
            piece_end = min(piece_start + max_records, high)
            slices.append(
                RangeSlice(layout.stream_id, rng.range_index, piece_start, piece_end, replicas)
            )
    return slices


def plan_all(
    layouts: Mapping[int, StreamLayout],
    bounds: Iterable[tuple[int, int, int]],
    max_records: int,
) -> list[RangeSlice]:
    """Partitions for ``(stream_id, start, end)`` bounds, stream by stream."""
    slices: list[RangeSlice] = []
    for stream_id, start, end in bounds:
        slices.extend(plan_slices(layouts[stream_id], start, end, max_records))
    return slices
