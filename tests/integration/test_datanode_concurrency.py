"""Many connections at once, pipelined appends, and FETCH long polls."""

from __future__ import annotations

import struct

import pytest
import trio

from net.connection import Connection
from sbp import messages
from sbp.batches import build_batch, decode_batches
from sbp.enums import ErrorCode, Opcode
from sbp.frames import encode_frame

from ..eventually import eventually
from .conftest import (
    DataNodes,
    append_request,
    connect,
    fetch_request,
    hosted_range,
    scrape,
    sync_ranges,
)
from .procs import RawConnection

pytestmark = pytest.mark.integration

CONNECTIONS = 100
STREAMS = 10
APPENDS_PER_CONNECTION = 6
RECORDS_PER_BATCH = 5
RECORD = struct.Struct(">HHH")  # connection, append, record


def record_batch(connection: int, append: int) -> bytearray:
    return build_batch(
        [RECORD.pack(connection, append, i) for i in range(RECORDS_PER_BATCH)],
        base_timestamp=1_700_000_000_000,
    )


async def read_stream(connection: Connection, stream_id: int, total: int) -> list[bytes]:
    """Every record of ``stream_id`` from offset 0, checking offsets are dense."""
    values: list[bytes] = []
    while len(values) < total:
        response = await connection.request(
            Opcode.FETCH, fetch_request((stream_id, len(values)), max_wait_ms=5000), timeout=10
        )
        (result,) = response.header.fetch_responses
        assert result.error_code == ErrorCode.NONE
        records = decode_batches(response.payload)
        first = int(records.offsets[0])
        assert records.offsets.tolist() == list(range(first, first + len(records)))
        # whole batches: the first one may begin before the offset asked for
        assert first <= len(values) < first + len(records)
        values += records.to_list()[len(values) - first :]
    return values


@pytest.mark.deadline(90)
async def test_hundred_connections_append_and_fetch(datanodes: DataNodes) -> None:
    node = await datanodes.start(1)
    async with connect(node.address) as admin:
        await sync_ranges(admin, *(hosted_range(s, node) for s in range(1, STREAMS + 1)))

    acknowledged: dict[int, list[tuple[int, int, int]]] = {s: [] for s in range(1, STREAMS + 1)}
    tailed: dict[int, list[bytes]] = {}
    total_per_stream = CONNECTIONS // STREAMS * APPENDS_PER_CONNECTION * RECORDS_PER_BATCH

    async def producer(index: int) -> None:
        stream_id = index % STREAMS + 1
        raw = await RawConnection.open(node.address)
        # Every append of a connection goes out in one write, all in flight at
        # once: their order on the wire must be their order in the stream.
        frames = b""
        for number in range(APPENDS_PER_CONNECTION):
            header, payload = append_request([(stream_id, record_batch(index, number))])
            frames += encode_frame(Opcode.APPEND, 0, number, header.encode(), payload)
        await raw.send(frames)
        offsets: dict[int, int] = {}
        while len(offsets) < APPENDS_PER_CONNECTION:
            frame = await raw.next_frame(timeout=30)
            (result,) = messages.AppendResponse.decode(frame.header).append_responses
            assert result.error_code == ErrorCode.NONE
            offsets[frame.stream_id] = result.base_offset
        await raw.aclose()
        in_order = [offsets[number] for number in range(APPENDS_PER_CONNECTION)]
        assert in_order == sorted(in_order), f"connection {index}: {in_order}"
        for number, offset in offsets.items():
            acknowledged[stream_id].append((offset, index, number))

    async def consumer(stream_id: int) -> None:
        async with connect(node.address) as connection:
            tailed[stream_id] = await read_stream(connection, stream_id, total_per_stream)

    async with trio.open_nursery() as nursery:
        for stream_id in range(1, STREAMS + 1):
            nursery.start_soon(consumer, stream_id)
        for index in range(CONNECTIONS):
            nursery.start_soon(producer, index)

    async with connect(node.address) as reader:
        for stream_id in range(1, STREAMS + 1):
            values = await read_stream(reader, stream_id, total_per_stream)
            expected = [
                RECORD.pack(connection, number, i)
                for _offset, connection, number in sorted(acknowledged[stream_id])
                for i in range(RECORDS_PER_BATCH)
            ]
            # every acknowledged record exactly once, at the offset it was given
            assert values == expected
            # the consumer that tailed the stream while it grew saw the same
            assert tailed[stream_id] == values


async def test_waiting_fetch_wakes_on_append(datanodes: DataNodes) -> None:
    node = await datanodes.start(1)
    async with connect(node.address) as consumer, connect(node.address) as producer:
        await sync_ranges(producer, hosted_range(1, node))
        fetched: list[messages.FetchResponse] = []

        async def wait_at_tail(task_status: trio.TaskStatus[None]) -> None:
            async with consumer.stream(
                Opcode.FETCH, fetch_request((1, 0), max_wait_ms=60_000)
            ) as responses:
                task_status.started()
                async for response in responses:
                    fetched.append(response.header)

        async with trio.open_nursery() as nursery:
            await nursery.start(wait_at_tail)
            await trio.sleep(0.2)  # let the FETCH reach the node and start waiting
            assert fetched == []
            header, payload = append_request([(1, record_batch(0, 0))])
            await producer.request(Opcode.APPEND, header, payload, timeout=10)
            # woken by the append, far before its 60 s max_wait_ms
            await eventually(lambda: fetched, timeout=10)
        (result,) = fetched[0].fetch_responses
        assert result.batch_length == len(record_batch(0, 0))


async def test_fetch_answers_each_item_as_it_gets_data(datanodes: DataNodes) -> None:
    node = await datanodes.start(1)
    async with connect(node.address) as connection, connect(node.address) as producer:
        await sync_ranges(producer, hosted_range(1, node), hosted_range(2, node))
        header, payload = append_request([(1, record_batch(0, 0))])
        await producer.request(Opcode.APPEND, header, payload, timeout=10)
        frames: list[tuple[list[tuple[int, int]], int]] = []
        async with connection.stream(
            Opcode.FETCH, fetch_request((1, 0), (2, 0), max_wait_ms=60_000)
        ) as responses:
            async for response in responses:
                results = [(r.stream_id, r.batch_length) for r in response.header.fetch_responses]
                frames.append((results, len(response.payload)))
                if len(frames) == 1:
                    # stream 1 answered at once; stream 2 still waits for data
                    header, payload = append_request([(2, record_batch(0, 1))])
                    await producer.request(Opcode.APPEND, header, payload, timeout=10)
        size = len(record_batch(0, 0))
        assert frames == [([(1, size)], size), ([(2, size)], size)]


async def test_min_bytes_waits_for_enough_data(datanodes: DataNodes) -> None:
    node = await datanodes.start(1)
    size = len(record_batch(0, 0))
    async with connect(node.address) as connection, connect(node.address) as producer:
        await sync_ranges(producer, hosted_range(1, node))

        async def append_twice() -> None:
            for number in range(2):
                await trio.sleep(0.1)
                header, payload = append_request([(1, record_batch(0, number))])
                await producer.request(Opcode.APPEND, header, payload, timeout=10)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(append_twice)
            response = await connection.request(
                Opcode.FETCH,
                fetch_request((1, 0), max_wait_ms=60_000, min_bytes=size + 1),
                timeout=20,
            )
        (result,) = response.header.fetch_responses
        assert result.batch_length == 2 * size
        assert decode_batches(response.payload).offsets.tolist() == list(range(10))


async def test_waiting_fetch_ends_when_its_client_goes_away(datanodes: DataNodes) -> None:
    node = await datanodes.start(1, "--metrics-listen", "127.0.0.1:0")
    async with connect(node.address) as admin:
        await sync_ranges(admin, hosted_range(1, node))
    for _ in range(3):
        async with connect(node.address) as connection:
            with trio.move_on_after(0.2):
                await connection.request(
                    Opcode.FETCH, fetch_request((1, 0), max_wait_ms=60_000), timeout=60
                )
    # The node forgets the waits of closed connections (no leak, no error).
    await eventually(
        lambda: scrape(node),
        until=lambda metrics: metrics.get("sbp_datanode_waiting_fetches") == 0.0,
        timeout=10,
    )
    async with connect(node.address) as connection:
        assert await connection.ping(timeout=5) >= 0
