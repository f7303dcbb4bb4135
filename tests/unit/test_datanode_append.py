"""APPEND in a data node's own process: the immediate path keeps a
connection's order behind a request that must first learn a stream from the
PM, answers TIMEOUT when durability takes longer than timeout_ms (and the
data still lands), and never leaves a request without an answer."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from datanode.items import wait_future
from datanode.node import DataNode
from datanode.server import build_dispatcher
from net.connection import Connection
from net.limits import CLIENT_LIMITS
from sbp import messages
from sbp.allocator import BufferPool
from sbp.batches import build_batch
from sbp.connection import Side
from sbp.constants import MAX_RECORD_OFFSET
from sbp.enums import ErrorCode, Opcode
from sbp.errors import InvalidRequestError, ProtocolError
from storage import RangeInfo, ReplicaInfo, StorageEngine

from ..eventually import eventually

NODE = 1
KNOWN, UNKNOWN = 1, 2
MAP_SIZE = 64 * 1024 * 1024


@contextmanager
def engine_at(path: Path) -> Iterator[StorageEngine]:
    engine = StorageEngine(path, map_size=MAP_SIZE, node_id=NODE)
    try:
        replica = ReplicaInfo(NODE, "127.0.0.1:9001", True)
        engine.sync_ranges(KNOWN, [RangeInfo(KNOWN, 0, 0, replicas=(replica,), epoch=1)]).result()
        yield engine
    finally:
        engine.close()


class SlowPM:
    """Stands in for the PM link: every lookup waits for ``answer``, then
    reports the stream unknown."""

    def __init__(self) -> None:
        self.answer = trio.Event()
        self.asked: list[int] = []

    async def refresh_stream(self, stream_id: int) -> bool:
        self.asked.append(stream_id)
        await self.answer.wait()
        return False


@asynccontextmanager
async def node_connection(engine: StorageEngine, pm: Any = None) -> AsyncIterator[Any]:
    node = DataNode(NODE, engine, pm=pm)
    client_stream, server_stream = trio.testing.memory_stream_pair()
    server = Connection(
        server_stream, side=Side.SERVER, handler=build_dispatcher(node, 1 << 20), peer="client"
    )
    client = Connection(client_stream, side=Side.CLIENT, limits=CLIENT_LIMITS, peer="node")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(node.append_timeouts.run)
        await nursery.start(server.run)
        await nursery.start(client.run)
        yield node, client, server
        nursery.cancel_scope.cancel()


async def append(
    client: Connection, items: list[tuple[int, bytes]], timeout_ms: int = 30_000
) -> tuple[messages.AppendResult, ...]:
    request = messages.AppendRequest(
        timeout_ms=timeout_ms,
        append_requests=tuple(
            messages.AppendInfo(stream_id=stream_id, request_index=index, batch_length=len(batch))
            for index, (stream_id, batch) in enumerate(items)
        ),
    )
    response = await client.request(Opcode.APPEND, request, b"".join(b for _, b in items))
    results: tuple[messages.AppendResult, ...] = response.header.append_responses
    return results


def batch(records: int) -> bytes:
    return bytes(build_batch([b"r%d" % i for i in range(records)], 1000))


async def test_appends_after_one_that_waits_for_the_pm_keep_their_order(tmp_path: Path) -> None:
    pm = SlowPM()
    with engine_at(tmp_path) as engine:
        async with node_connection(engine, pm) as (_, client, server):
            results: dict[str, tuple[messages.AppendResult, ...]] = {}

            async def send(name: str, items: list[tuple[int, bytes]]) -> None:
                results[name] = await append(client, items)

            async with trio.open_nursery() as nursery:
                # The first request names a stream the node must ask the PM
                # about; the second only a known one, so it could be
                # submitted at once, before the first, if order were not kept.
                nursery.start_soon(send, "first", [(KNOWN, batch(3)), (UNKNOWN, batch(1))])
                await trio.testing.wait_all_tasks_blocked()
                assert pm.asked == [UNKNOWN]
                nursery.start_soon(send, "second", [(KNOWN, batch(2))])
                await trio.testing.wait_all_tasks_blocked()
                assert server.serving == 2 and not results
                pm.answer.set()
            # and once the queue is empty, appends go the immediate way again
            third = await append(client, [(KNOWN, batch(1))])
    first_known, first_unknown = results["first"]
    (second,) = results["second"]
    assert (first_known.error_code, first_known.base_offset) == (ErrorCode.NONE, 0)
    assert first_unknown.error_code == ErrorCode.RANGE_NOT_FOUND
    assert (second.error_code, second.base_offset) == (ErrorCode.NONE, 3)
    assert (third[0].error_code, third[0].base_offset) == (ErrorCode.NONE, 5)


async def test_an_append_slower_than_its_timeout_answers_timeout_and_still_lands(
    tmp_path: Path,
) -> None:
    with engine_at(tmp_path) as engine:
        async with node_connection(engine) as (node, client, server):
            # Hold the storage writer: the next commit waits for the release.
            release = threading.Event()
            held = engine._command(lambda ctx: release.wait(10))
            with trio.fail_after(5):
                (result,) = await append(client, [(KNOWN, batch(4))], timeout_ms=100)
            assert result.error_code == ErrorCode.TIMEOUT
            assert result.base_offset == -1
            assert server.serving == 0
            assert node.metrics.counters.append_items_failed == 1
            release.set()
            await trio.to_thread.run_sync(held.result)
            # The late commit delivers: no second answer, and the data is there.
            await eventually(lambda: engine.next_offset(KNOWN) == 4, timeout=5)
            (after,) = await append(client, [(KNOWN, batch(1))], timeout_ms=100)
            assert (after.error_code, after.base_offset) == (ErrorCode.NONE, 4)
            assert client.engine.discarded == {}
            assert len(node.append_timeouts) <= 2


async def test_a_malformed_append_is_refused_and_the_connection_goes_on(tmp_path: Path) -> None:
    with engine_at(tmp_path) as engine:
        async with node_connection(engine) as (_, client, server):
            request = messages.AppendRequest(
                timeout_ms=1000,
                append_requests=(
                    messages.AppendInfo(stream_id=KNOWN, request_index=0, batch_length=999),
                ),
            )
            with pytest.raises(InvalidRequestError, match="batch_lengths"):
                await client.request(Opcode.APPEND, request, batch(1))
            (ok,) = await append(client, [(KNOWN, batch(2))])
            assert (ok.error_code, ok.base_offset) == (ErrorCode.NONE, 0)
            assert server.serving == 0


@pytest.mark.parametrize(
    ("range_index", "start", "end", "message"),
    [
        (-1, 0, -1, "range index -1 of stream 5 is negative"),
        (0, -7, -1, "starts at a negative offset -7"),
        (1, 10, 4, "ends at 4, before its start 10"),
    ],
)
async def test_sync_ranges_refuses_fields_out_of_range(
    tmp_path: Path, range_index: int, start: int, end: int, message: str, caplog: Any
) -> None:
    """A field out of its range is INVALID_REQUEST for its item, never a
    storage failure with a traceback, and the node goes on."""
    replica = messages.ReplicaNode(
        data_node=messages.DataNode(node_id=NODE, advertise_addr="127.0.0.1:9001"),
        is_primary=True,
    )
    bad = messages.Range(
        stream_id=5,
        range_index=range_index,
        start_offset=start,
        end_offset=end,
        replica_nodes=(replica,),
    )
    request = messages.SyncRangesRequest(
        timeout_ms=1000, stream_ranges=(messages.StreamRanges(stream_id=5, ranges=(bad,)),)
    )
    with engine_at(tmp_path) as engine:
        async with node_connection(engine) as (_, client, _server):
            answer = (await client.request(Opcode.SYNC_RANGES, request, timeout=5)).header
            (result,) = answer.sync_responses
            assert result.error_code == ErrorCode.INVALID_REQUEST
            assert message in result.error_message
            (ok,) = await append(client, [(KNOWN, batch(2))])
            assert ok.error_code == ErrorCode.NONE
    assert "Traceback" not in caplog.text and "storage write failed" not in caplog.text


async def test_an_append_past_the_last_offset_is_refused(tmp_path: Path) -> None:
    """A range that starts near the end of int64 (a hostile SYNC_RANGES can
    place one there): records that would pass the last offset are refused
    with OFFSET_OUT_OF_RANGE, those that fit are stored, the node goes on
    (the overflowing answer once took the whole process down)."""
    near_end = MAX_RECORD_OFFSET - 3
    replica = ReplicaInfo(NODE, "127.0.0.1:9001", True)
    with engine_at(tmp_path) as engine:
        engine.sync_ranges(9, [RangeInfo(9, 0, near_end, replicas=(replica,), epoch=1)]).result()
        async with node_connection(engine) as (_, client, _server):
            (refused,) = await append(client, [(9, batch(4))])
            assert refused.error_code == ErrorCode.OFFSET_OUT_OF_RANGE
            assert "no offsets left" in refused.error_message
            (fits,) = await append(client, [(9, batch(3))])
            assert (fits.error_code, fits.base_offset) == (ErrorCode.NONE, near_end)
            assert engine.next_offset(9) == MAX_RECORD_OFFSET
            (full,) = await append(client, [(9, batch(1))])
            assert full.error_code == ErrorCode.OFFSET_OUT_OF_RANGE
            await client.ping(timeout=5)


async def test_an_answer_that_cannot_be_built_is_unknown_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Answers are delivered in a trio system callback, where an exception
    would end the process: a failure there answers UNKNOWN instead."""
    import datanode.handlers.append

    def broken(*_: Any) -> messages.AppendResult:
        raise ValueError("cannot build the answer")

    with engine_at(tmp_path) as engine:
        async with node_connection(engine) as (_, client, _server):
            monkeypatch.setattr(datanode.handlers.append, "_result", broken)
            with pytest.raises(ProtocolError, match="internal server error") as caught:
                await append(client, [(KNOWN, batch(1))])
            assert caught.value.code == ErrorCode.UNKNOWN
            monkeypatch.undo()
            (ok,) = await append(client, [(KNOWN, batch(1))])
            assert (ok.error_code, ok.base_offset) == (ErrorCode.NONE, 1)


async def test_describe_of_a_range_not_synced_here_yet_asks_the_pm(tmp_path: Path) -> None:
    """A reader describes the range the PM just placed here before its
    SYNC_RANGES arrived: the node asks the PM, as FETCH does, and answers
    with the range instead of RANGE_NOT_FOUND. A range the PM does not
    place here either stays RANGE_NOT_FOUND."""
    replica = ReplicaInfo(NODE, "127.0.0.1:9001", True)

    class PM:
        def __init__(self) -> None:
            self.asked: list[int] = []

        async def refresh_stream(self, stream_id: int) -> bool:
            self.asked.append(stream_id)
            sealed = RangeInfo(KNOWN, 0, 0, 3, replicas=(replica,), epoch=1)
            opened = RangeInfo(KNOWN, 1, 3, replicas=(replica,), epoch=1)
            await wait_future(node.engine.sync_ranges(KNOWN, [sealed, opened]))
            return True

    pm = PM()

    async def describe(range_index: int) -> messages.DescribeRangeResult:
        request = messages.DescribeRangesRequest(
            ranges=(messages.RangeId(stream_id=KNOWN, range_index=range_index),)
        )
        answer = (await client.request(Opcode.DESCRIBE_RANGES, request, timeout=5)).header
        result: messages.DescribeRangeResult = answer.describe_responses[0]
        return result

    with engine_at(tmp_path) as engine:
        async with node_connection(engine, pm) as (node, client, _server):
            (ok,) = await append(client, [(KNOWN, batch(3))])
            assert ok.error_code == ErrorCode.NONE
            result = await describe(1)
            assert result.error_code == ErrorCode.NONE
            assert result.range is not None and result.range.start_offset == 3
            assert pm.asked == [KNOWN]
            assert (await describe(7)).error_code == ErrorCode.RANGE_NOT_FOUND


async def test_an_answered_append_leaves_its_receive_buffer_free(
    tmp_path: Path, own_buffer_pool: BufferPool
) -> None:
    """An answered APPEND stays in the timeout queue until the queue is next
    compacted, but holds nothing of its payload: the buffer its frame
    arrived in goes back to the receive pool for a later frame (before, up
    to a thousand answered requests' buffers stayed alive)."""
    large = bytes(build_batch([b"v" * 200_000], 0))
    with engine_at(tmp_path) as engine:
        async with node_connection(engine) as (node, client, _):
            for _ in range(3):
                (result,) = await append(client, [(KNOWN, large)])
                assert result.error_code == ErrorCode.NONE
            assert len(node.append_timeouts) == 3  # answered, not yet compacted away
            # the frames' buffers: free once nothing refers to them (a few
            # tries: a take looks at a few kept buffers, oldest first)
            free = [own_buffer_pool.take(len(large)) for _ in range(64)]
            assert any(buffer is not None for buffer in free)
