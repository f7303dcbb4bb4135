"""PMClient and DataNodeClient against small in-memory servers built on
net.Dispatcher: every opcode, per-item results, raising one-item calls,
paged listing, APPEND spread over frames and FETCH streaming."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from client import DataNodeClient, FetchedBatches, PMClient
from net.connection import Connection
from net.request import Request, Responder
from net.server import Dispatcher, Server
from sbp import messages as m
from sbp.connection import Side
from sbp.enums import ClientRole, ErrorCode, Opcode
from sbp.errors import (
    ConnectionClosed,
    HeaderDecodeError,
    NoAvailableDataNodeError,
    NotLeaderError,
    RangeSealedError,
    StreamNotFoundError,
)

from ..fake_pm import NODE, FakePM, replica_range


@asynccontextmanager
async def over_memory(dispatcher: Dispatcher) -> AsyncIterator[Connection]:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    server = Connection(server_stream, side=Side.SERVER, handler=dispatcher)
    client = Connection(client_stream, side=Side.CLIENT, peer="server")
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        await nursery.start(client.run)
        yield client
        nursery.cancel_scope.cancel()


async def test_pm_client_streams() -> None:
    fake = FakePM()
    async with over_memory(fake.dispatcher()) as connection:
        pm = PMClient(connection, timeout=5)
        assert await pm.ping() >= 0
        hello = await pm.heartbeat("tester")
        assert (hello.client_id, hello.client_role) == ("tester", ClientRole.PM)

        created = await pm.create_stream(3, retention_period_ms=60_000)
        assert created.stream == m.Stream(stream_id=1, replica_nums=3, retention_period_ms=60_000)
        assert created.range is not None and created.range.is_open
        assert fake.requests[-1] == m.CreateStreamsRequest(
            timeout_ms=5000, streams=(m.Stream(replica_nums=3, retention_period_ms=60_000),)
        )
        batch = await pm.create_streams([m.Stream(replica_nums=1), m.Stream(replica_nums=9)])
        assert [r.error_code for r in batch] == [ErrorCode.NONE, ErrorCode.NO_AVAILABLE_DATA_NODE]
        with pytest.raises(NoAvailableDataNodeError, match="need more"):
            await pm.create_stream(9)

        assert await pm.get_stream(2) == m.Stream(stream_id=2, replica_nums=1)
        with pytest.raises(StreamNotFoundError, match="no stream 42"):
            await pm.get_stream(42)
        results = await pm.get_streams([1, 42])
        assert [r.error_code for r in results] == [ErrorCode.NONE, ErrorCode.STREAM_NOT_FOUND]

        updated = await pm.update_stream(m.Stream(stream_id=2, replica_nums=1, epoch=4))
        assert updated.epoch == 4
        with pytest.raises(StreamNotFoundError):
            await pm.update_stream(m.Stream(stream_id=42))

        trimmed = await pm.trim_stream(1, 100)
        assert trimmed.range is not None and trimmed.range.start_offset == 100

        deleted = await pm.delete_stream(2)
        assert deleted.deleted_stream is not None and deleted.deleted_stream.stream_id == 2
        with pytest.raises(StreamNotFoundError):
            await pm.delete_stream(2)
        assert [r.error_code for r in await pm.delete_streams([1, 2])] == [
            ErrorCode.NONE,
            ErrorCode.STREAM_NOT_FOUND,
        ]


async def test_pm_client_lists_every_stream_page_by_page() -> None:
    fake = FakePM()
    async with over_memory(fake.dispatcher()) as connection:
        pm = PMClient(connection)
        await pm.create_streams([m.Stream(replica_nums=1)] * 7)
        fake.requests.clear()
        listed = [stream.stream_id async for stream in pm.list_streams(page_size=3)]
        assert listed == [1, 2, 3, 4, 5, 6, 7]
        pages = [
            (r.start_after, r.limit) for r in fake.requests if isinstance(r, m.GetStreamsRequest)
        ]
        assert pages == [(0, 3), (3, 3), (6, 3)]
        # A full last page costs one more request, which comes back empty.
        fake.requests.clear()
        assert len([s async for s in pm.list_streams(page_size=7)]) == 7
        assert [r.start_after for r in fake.requests if isinstance(r, m.GetStreamsRequest)] == [
            0,
            7,
        ]


async def test_pm_client_ranges_and_cluster() -> None:
    fake = FakePM()
    async with over_memory(fake.dispatcher()) as connection:
        pm = PMClient(connection)
        await pm.create_streams([m.Stream(replica_nums=1)] * 2)
        ranges = await pm.list_stream_ranges(5)
        assert [(r.range_index, r.start_offset, r.end_offset) for r in ranges] == [
            (0, 0, 10),
            (1, 10, -1),
        ]
        on_node = await pm.list_node_ranges(NODE)
        assert [r.stream_id for r in on_node] == [1, 2]
        assert (
            len(await pm.list_ranges([m.RangeOwner(stream_id=1), m.RangeOwner(data_node=NODE)]))
            == 2
        )

        sealed = await pm.seal_range(1, 0)
        assert [(r.range_index, r.end_offset) for r in sealed.ranges] == [(0, 10), (1, -1)]
        with pytest.raises(RangeSealedError):
            await pm.seal_range(1, 1)
        batch = await pm.seal_ranges([m.RangeId(stream_id=1, range_index=1)])
        assert batch[0].error_code == ErrorCode.RANGE_SEALED

        described = await pm.describe_range(1, 3)
        assert (described.stream_id, described.range_index) == (1, 3)
        assert len(await pm.describe_ranges([m.RangeId(stream_id=1), m.RangeId(stream_id=2)])) == 2

        report = m.ReportMetricsRequest(data_node=NODE, disk_free_space=1 << 30)
        assert (await pm.report_metrics(report)).data_node == NODE
        assert fake.requests[-1] == report
        (status,) = await pm.describe_cluster()
        assert (status.data_node, status.alive, status.range_count) == (NODE, True, 2)


class FakeDataNode:
    """APPEND answered in two frames (two group commits); FETCH streams each
    item as it becomes ready."""

    def __init__(self) -> None:
        self.appended: list[tuple[int, bytes]] = []
        self.fetch_ready = trio.Event()

    def dispatcher(self) -> Dispatcher:
        dispatcher = Dispatcher("data node")
        dispatcher.register(Opcode.APPEND, self.append)
        dispatcher.register(Opcode.FETCH, self.fetch)
        dispatcher.register(Opcode.SYNC_RANGES, self.sync)
        dispatcher.register(Opcode.SEAL_RANGES, self.seal)
        dispatcher.register(Opcode.DELETE_STREAMS, self.delete)
        return dispatcher

    async def append(self, request: Request, responder: Responder) -> None:
        header = request.header_as(m.AppendRequest)
        offset = 0
        results = []
        for info in header.append_requests:
            batch = bytes(request.payload[offset : offset + info.batch_length])
            offset += info.batch_length
            self.appended.append((info.stream_id, batch))
            code = ErrorCode.STREAM_DELETED if info.stream_id == 666 else ErrorCode.NONE
            results.append(
                m.AppendResult(
                    stream_id=info.stream_id,
                    request_index=info.request_index,
                    base_offset=len(self.appended) - 1,
                    error_code=code,
                )
            )
        # The later items commit first, in a frame of their own.
        half = len(results) // 2
        if half:
            await responder.send(
                m.AppendResponse(append_responses=tuple(results[half:])), end=False
            )
        await responder.send(m.AppendResponse(append_responses=tuple(results[:half] or results)))

    async def fetch(self, request: Request, responder: Responder) -> None:
        header = request.header_as(m.FetchRequest)
        first, *rest = header.fetch_requests
        data = b"A" * 10
        await responder.send(
            m.FetchResponse(
                fetch_responses=(
                    m.FetchResult(
                        stream_id=first.stream_id,
                        request_index=first.request_index,
                        batch_length=len(data),
                    ),
                )
            ),
            data,
            end=False,
        )
        await self.fetch_ready.wait()
        results = tuple(
            m.FetchResult(
                stream_id=info.stream_id, request_index=info.request_index, batch_length=3
            )
            for info in rest
        )
        await responder.send(m.FetchResponse(fetch_responses=results), b"xyz" * len(rest))

    async def sync(self, request: Request, responder: Responder) -> None:
        header = request.header_as(m.SyncRangesRequest)
        results = tuple(
            m.SyncRangesResult(stream_id=s.stream_id, ranges=s.ranges) for s in header.stream_ranges
        )
        await responder.send(m.SyncRangesResponse(sync_responses=results))

    async def seal(self, request: Request, responder: Responder) -> None:
        (range_id,) = request.header_as(m.SealRangesRequest).ranges
        sealed = replica_range(range_id.stream_id, range_id.range_index, 0, 5)
        result = m.SealRangesResult(stream_id=range_id.stream_id, ranges=(sealed,))
        await responder.send(m.SealRangesResponse(seal_responses=(result,)))

    async def delete(self, request: Request, responder: Responder) -> None:
        results = tuple(
            m.DeleteStreamResult(deleted_stream=s)
            for s in request.header_as(m.DeleteStreamsRequest).streams
        )
        await responder.send(m.DeleteStreamsResponse(delete_responses=results))


async def test_datanode_client_append_gathers_results_from_every_frame() -> None:
    node = FakeDataNode()
    async with over_memory(node.dispatcher()) as connection:
        client = DataNodeClient(connection)
        results = await client.append([(1, b"one"), (2, b"two!"), (666, b"x"), (1, b"four")])
        assert [(r.request_index, r.stream_id, r.base_offset) for r in results] == [
            (0, 1, 0),
            (1, 2, 1),
            (2, 666, 2),
            (3, 1, 3),
        ]
        assert results[2].error_code == ErrorCode.STREAM_DELETED
        assert node.appended == [(1, b"one"), (2, b"two!"), (666, b"x"), (1, b"four")]
        single = await client.append_batch(5, b"batch")
        assert (single.stream_id, single.base_offset) == (5, 4)


async def test_datanode_client_fetch_yields_results_as_they_stream_in() -> None:
    node = FakeDataNode()
    infos = [
        m.FetchInfo(stream_id=s, request_index=i, fetch_offset=0) for i, s in enumerate([4, 5, 6])
    ]
    async with over_memory(node.dispatcher()) as connection:
        client = DataNodeClient(connection)
        seen: list[tuple[int, bytes]] = []
        async with client.fetch(infos, max_wait_ms=100) as results:
            async for fetched in results:
                assert isinstance(fetched, FetchedBatches)
                assert isinstance(fetched.data, memoryview)
                seen.append((fetched.result.stream_id, bytes(fetched.data)))
                # The first item arrives before the node has the others.
                node.fetch_ready.set()
        assert seen == [(4, b"A" * 10), (5, b"xyz"), (6, b"xyz")]


async def test_datanode_client_rejects_a_fetch_payload_that_does_not_add_up() -> None:
    async def lying(request: Request, responder: Responder) -> None:
        result = m.FetchResult(stream_id=1, batch_length=100)
        await responder.send(m.FetchResponse(fetch_responses=(result,)), b"short")

    dispatcher = Dispatcher("data node")
    dispatcher.register(Opcode.FETCH, lying)
    async with over_memory(dispatcher) as connection:
        client = DataNodeClient(connection)
        with pytest.raises(HeaderDecodeError, match="past the payload"):
            async with client.fetch([m.FetchInfo(stream_id=1)]) as results:
                async for _ in results:
                    pass


async def test_datanode_client_range_calls() -> None:
    node = FakeDataNode()
    async with over_memory(node.dispatcher()) as connection:
        client = DataNodeClient(connection)
        ranges = (replica_range(3, 0, 0),)
        (synced,) = await client.sync_ranges([m.StreamRanges(stream_id=3, ranges=ranges)])
        assert (synced.stream_id, synced.ranges) == (3, ranges)
        sealed = await client.seal_range(3, 0)
        assert sealed.ranges[0].end_offset == 5
        assert (await client.delete_stream(3)).deleted_stream == m.Stream(stream_id=3)


async def test_clients_by_address_share_a_pool_and_reconnect() -> None:
    fake = FakePM()
    server = Server(fake.dispatcher())
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(server.serve, "127.0.0.1", 0)
        async with PMClient(f"{host}:{port}", timeout=5) as pm:
            first = await pm.connection()
            assert (await pm.create_stream(1)).stream is not None
            # The server restarts its side: GOAWAY, then the connection ends.
            (served,) = server.connections
            await served.drain(1.0)
            await first.wait_closed()
            assert (await pm.get_stream(1)).stream_id == 1
            assert await pm.connection() is not first
        nursery.cancel_scope.cancel()


class Follower:
    """A PM that is not the leader: every request is answered NOT_LEADER,
    naming ``leader`` (or nobody)."""

    def __init__(self, leader: str) -> None:
        self.leader = leader
        self.asked = 0

    def start(self, request: Request, responder: Responder) -> None:
        self.asked += 1
        responder.send_error_nowait(ErrorCode.NOT_LEADER, "not me", leader_addr=self.leader)

    def dispatcher(self) -> Dispatcher:
        dispatcher = Dispatcher("PM follower")
        for opcode in (Opcode.GET_STREAMS, Opcode.CREATE_STREAMS):
            dispatcher.register_handler(opcode, self)
        return dispatcher


async def test_a_client_follows_not_leader_to_the_leader_it_names() -> None:
    leader = FakePM()
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(Server(leader.dispatcher()).serve, "127.0.0.1", 0)
        leader_addr = f"{host}:{port}"
        follower = Follower(leader_addr)
        follower_server = Server(follower.dispatcher())
        fhost, fport = await nursery.start(follower_server.serve, "127.0.0.1", 0)
        async with PMClient(f"{fhost}:{fport}", timeout=5) as pm:
            assert (await pm.create_stream(1)).stream is not None
            assert pm.address == leader_addr  # later calls go straight there
            assert (await pm.get_stream(1)).stream_id == 1
            assert follower.asked == 1
        nursery.cancel_scope.cancel()


async def test_a_client_tries_the_next_address_when_one_is_unreachable() -> None:
    pm_side = FakePM()
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(Server(pm_side.dispatcher()).serve, "127.0.0.1", 0)
        with socket.socket() as unused:  # a port nobody listens on
            unused.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{unused.getsockname()[1]}"
        async with PMClient(f"{dead},{host}:{port}", timeout=5) as pm:
            assert pm.addresses == [dead, f"{host}:{port}"]
            assert (await pm.create_stream(1)).stream is not None
            assert pm.address == f"{host}:{port}"
        async with PMClient(dead, timeout=5) as alone:  # one address: as before
            with pytest.raises((ConnectionClosed, OSError)):
                await alone.create_stream(1)
        nursery.cancel_scope.cancel()


async def test_not_leader_without_a_leader_and_one_address_is_raised() -> None:
    follower = Follower("")
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(Server(follower.dispatcher()).serve, "127.0.0.1", 0)
        async with PMClient(f"{host}:{port}", timeout=5) as pm:
            with pytest.raises(NotLeaderError) as raised:
                await pm.create_stream(1)
            assert raised.value.leader_addr == ""
        nursery.cancel_scope.cancel()
