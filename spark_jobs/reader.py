"""Reading one input partition: FETCH loops over a range on one of its
replicas, each answer decoded with numpy and handed on as an Arrow batch.

A fetch returns whole batches starting with the one holding the offset asked
for, so the first and last batches of a slice may hold records outside it;
they are cut off with a zero-copy Arrow slice, never a per-record loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from typing import Final

import pyarrow as pa
import trio

from client.compacted_tail import compacted_end
from client.datanode_client import DataNodeClient
from client.retry import retry_delay
from client.sync import SyncClient
from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import batch_spans, decode_batches, peek_header
from sbp.enums import ErrorCode
from sbp.errors import ConnectionClosed, ObjectStoreUnavailableError, ProtocolError, error_for

from .arrow import records_to_arrow
from .layout import RangeSlice

#: rounds over a range's replicas before a fetch fails its task
REPLICA_ROUNDS: Final = 6


class MissingRecordsError(RuntimeError):
    """A replica had no records where the plan said there are some."""


async def fetch_once(
    pool: ConnectionPool,
    address: str,
    stream_id: int,
    offset: int,
    max_bytes: int,
    timeout: float,
) -> bytes | memoryview:
    """The whole batches one FETCH returns from ``offset`` (empty at the tail)."""
    node = DataNodeClient(address, pool=pool, timeout=timeout)
    info = messages.FetchInfo(stream_id=stream_id, fetch_offset=offset, batch_max_bytes=max_bytes)
    parts: list[memoryview] = []
    async with node.fetch([info]) as results:
        async for fetched in results:
            if fetched.result.error_code != ErrorCode.NONE:
                raise error_for(fetched.result.error_code, fetched.result.error_message)
            parts.append(fetched.data)
    if len(parts) == 1:
        return parts[0]
    return b"".join(parts)


async def fetch_from_replicas(
    pool: ConnectionPool, piece: RangeSlice, offset: int, max_bytes: int, timeout: float
) -> bytes | memoryview:
    """One fetch, from the first replica that answers (primary first). A
    range whose nodes read it from an object store that did not answer in
    time (SPEC §14) is asked again after a pause, up to ``REPLICA_ROUNDS``
    times."""
    failure: Exception | None = None
    # what each replica answered: Spark shows the message, not the cause
    refusals: list[str] = []
    store_slow = False
    for round_index in range(REPLICA_ROUNDS):
        if round_index:
            if not store_slow:
                break
            await trio.sleep(retry_delay(round_index, initial=1.0, cap=5.0))
        refusals, store_slow = [], False
        for address in piece.replicas:
            try:
                return await fetch_once(pool, address, piece.stream_id, offset, max_bytes, timeout)
            except ProtocolError as error:
                if not error.retriable:
                    raise
                failure = error
                store_slow = store_slow or isinstance(error, ObjectStoreUnavailableError)
            except (ConnectionClosed, OSError) as error:
                failure = error
            refusals.append(f"{address}: {type(failure).__name__}: {failure}")
    raise RuntimeError(
        f"no replica of range {piece.range_index} of stream {piece.stream_id} "
        f"served offset {offset} ({'; '.join(refusals) or 'no replica listed'})"
    ) from failure


async def compacted_piece_end(
    pool: ConnectionPool, piece: RangeSlice, offset: int, timeout: float
) -> int | None:
    """After an empty answer at ``offset``: the range's end when a replica
    holds nothing of it from there (compacted away, SPEC §13) and the piece
    ends by then; None otherwise."""
    for address in piece.replicas:
        node = DataNodeClient(address, pool=pool, timeout=timeout)
        try:
            end = await compacted_end(node, piece.stream_id, piece.range_index, offset)
        except (ProtocolError, ConnectionClosed, OSError):
            continue
        if end is not None and end >= piece.end:
            return end
    return None


def _next_offset(data: bytes | memoryview) -> int:
    """The offset after the last record of fetched batches (headers only)."""
    last_start, _ = batch_spans(data)[-1]
    return peek_header(data, last_start).next_offset


def read_slice(
    client: SyncClient, piece: RangeSlice, fetch_max_bytes: int, *, include_headers: bool = False
) -> Iterator[pa.RecordBatch]:
    """Every record of ``piece``, in offset order, as Arrow batches, fetched
    through ``client``'s loop and pool (with its timeout).

    The next fetch is sent as soon as an answer arrives, so the data node
    reads and sends it while this thread decodes and Spark takes the batch.
    """
    if piece.start >= piece.end:
        return

    def fetch(at: int) -> Future[bytes | memoryview]:
        return client.submit(
            fetch_from_replicas, client.pool, piece, at, fetch_max_bytes, client.timeout
        )

    offset = piece.start
    pending = fetch(offset)
    while offset < piece.end:
        data = pending.result()
        if not data:
            end = client.run(compacted_piece_end, client.pool, piece, offset, client.timeout)
            if end is not None:
                return  # compaction left nothing from here to the piece's end
            raise MissingRecordsError(
                f"stream {piece.stream_id} has no records at offset {offset} on "
                f"{piece.replicas[0]}, though range {piece.range_index} was planned "
                f"to hold [{piece.start}, {piece.end})"
            )
        fetched_end = _next_offset(data)
        if fetched_end < piece.end:
            pending = fetch(fetched_end)
        records = decode_batches(data)
        # a node answers from the next record compaction left (SPEC §13), never
        # across records it lacks: the cut is by the offsets themselves
        skip = int(records.offsets.searchsorted(offset))
        stop = int(records.offsets.searchsorted(piece.end))
        if stop > skip:
            batch = records_to_arrow(piece.stream_id, records, include_headers=include_headers)
            yield batch if skip == 0 and stop == len(records) else batch.slice(skip, stop - skip)
        offset = min(fetched_end, piece.end)
