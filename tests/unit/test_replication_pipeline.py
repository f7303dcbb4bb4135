"""The primary's side of replication (datanode.replication.primary) on fake
nodes: what a pipeline tells a follower of the commit offset is what the
follower ends up serving, and a range sealed here learns where the PM ended
it even when the PM's SYNC_RANGES never came."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from client.ordered import SendOrder
from datanode.replica_state import SETTLE_AFTER_S, ReplicaStates
from datanode.replication.primary import (
    REPLICATE_SECONDS_BOUNDS,
    RangePipeline,
    Replicator,
)
from datanode.waiters import StreamWaiters
from net.calls import Response
from sbp import messages
from sbp.batches import build_batch, peek_header, stamp_base_offset
from sbp.enums import Opcode
from sbp.stats import Buckets
from storage import RangeInfo, ReplicaBatch, ReplicaInfo, StorageEngine
from storage.producers import ProducerStamp

from ..eventually import eventually

STREAM = 5


class FakeEngine:
    """Batches of one stream, durable as soon as appended."""

    def __init__(self) -> None:
        self.batches: list[bytearray] = []
        self.next = 0
        #: producer stamps by base offset (SPEC §10)
        self.stamps: dict[int, ProducerStamp] = {}

    def append(self, records: int, stamp: ProducerStamp | None = None) -> None:
        batch = build_batch([b"v"] * records, 0)
        stamp_base_offset(batch, self.next)
        self.batches.append(batch)
        if stamp is not None:
            self.stamps[self.next] = stamp
        self.next += records

    def producer_stamps(self, stream_id: int, start: int, end: int) -> dict[int, ProducerStamp]:
        return {base: s for base, s in self.stamps.items() if start <= base < end}

    def next_offset(self, stream_id: int) -> int:
        return self.next

    def read(self, stream_id: int, offset: int, max_bytes: int) -> bytearray:
        out = bytearray()
        for batch in self.batches:
            if peek_header(batch).base_offset >= offset and len(out) < max_bytes:
                out += batch
        return out


class FakeFollower:
    """A follower's connection: stores every batch sent, answers at once with
    its next offset, and remembers the highest commit offset it was told."""

    def __init__(self) -> None:
        self.next = 0
        self.told_commit = -1
        self.frames = 0
        self._closed = trio.Event()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        """The follower went away (a restart): the connection ends."""
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    @asynccontextmanager
    async def stream(
        self, opcode: Opcode, header: messages.ReplicateRequest, payload: Any, timeout: float
    ) -> AsyncIterator[AsyncIterator[Response[messages.ReplicateResponse]]]:
        self.frames += 1
        results = []
        for item in header.replicate_requests:
            if item.batch_length:
                self.next = max(self.next, item.base_offset + 1)
            self.told_commit = max(self.told_commit, item.commit_offset)
            results.append(
                messages.ReplicateResult(
                    stream_id=item.stream_id, range_index=item.range_index, next_offset=self.next
                )
            )
        answer = messages.ReplicateResponse(replicate_responses=tuple(results))

        async def responses() -> AsyncIterator[Response[messages.ReplicateResponse]]:
            yield Response(Opcode.REPLICATE, answer, b"")

        yield responses()


def pipeline_of(engine: FakeEngine) -> RangePipeline:
    info = RangeInfo(
        STREAM,
        0,
        0,
        replicas=(
            ReplicaInfo(1, "127.0.0.1:9001", True),
            ReplicaInfo(2, "127.0.0.1:9002", False),
            ReplicaInfo(3, "127.0.0.1:9003", False),
        ),
    )
    replicas = ReplicaStates(1, engine, StreamWaiters())  # type: ignore[arg-type]
    pipeline = RangePipeline(replicas, None, None, info, Buckets(REPLICATE_SECONDS_BOUNDS))  # type: ignore[arg-type]
    pipeline.ack_nums = 2
    return pipeline


async def test_an_idle_follower_is_told_the_commit_that_moved_while_its_frame_waited() -> None:
    """A frame read at commit 0 leaves after another follower's answer moved
    the commit to 1 (REPLICATE frames leave in order, after the one before):
    the follower was told 0, and once nothing else is left to send it is
    told 1 on its own. Counting 1 as told would leave it serving one batch
    short of what was acknowledged for as long as no append comes."""
    engine = FakeEngine()
    engine.append(1)
    pipeline = pipeline_of(engine)
    follower = pipeline.followers[1]
    follower.send_offset = 0
    connection = FakeFollower()
    pipeline.replicas.commits.advance(STREAM, 0, 0)  # the followers said where they are

    items, payload, follower.send_offset = pipeline._read_frame(0)
    assert [item.commit_offset for item in items] == [0]
    # the other follower answered before this frame left:
    pipeline.replicas.commits.advance(STREAM, 0, 1)
    await pipeline._frame(follower, connection, items, payload, SendOrder().turn())  # type: ignore[arg-type]
    assert connection.told_commit == 0
    assert follower.sent_commit == 0
    assert follower.match == 1

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pipeline._stream_to, follower, connection)  # type: ignore[arg-type]
            await eventually(lambda: connection.told_commit >= 1, interval=0.01)
            nursery.cancel_scope.cancel()
    assert connection.frames == 2


def test_the_commit_offset_is_unknown_until_enough_followers_have_answered() -> None:
    """A primary that restarted holds records its followers may hold too:
    until one of them (ack_nums 2) has said how far it is, the commit offset
    is unknown, not the range's start, so nothing reads the start as the end
    and no follower is told it. A follower's own answer then fixes it."""
    engine = FakeEngine()
    engine.append(5)
    pipeline = pipeline_of(engine)
    pipeline._recompute()
    assert pipeline.commit == -1
    assert not pipeline.replicas.commits.known(STREAM, 0)
    assert pipeline._item(0).commit_offset == -1
    ok = messages.ReplicateResult(stream_id=STREAM, range_index=0, next_offset=5)
    pipeline._take_answers(pipeline.followers[0], 0, [ok])
    assert pipeline.commit == 5
    assert pipeline.replicas.commits.known(STREAM, 0)
    assert pipeline._item(5).commit_offset == 5


class FakePool:
    """Hands out a new ``FakeFollower`` per connection, as a follower that
    restarted holding ``held`` records would answer."""

    def __init__(self, held: int) -> None:
        self.held = held
        self.connections: list[FakeFollower] = []

    async def get(self, address: str) -> FakeFollower:
        connection = FakeFollower()
        connection.next = self.held
        self.connections.append(connection)
        return connection


async def test_an_idle_follower_that_restarts_is_told_the_commit_offset_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Nothing is appended while the follower restarts: its connection
    closing wakes the idle sender, which reconnects and tells the restarted
    follower (who forgot it) the commit offset without waiting for an append."""
    engine = FakeEngine()
    engine.append(3)
    pipeline = pipeline_of(engine)
    pool = FakePool(held=3)
    pipeline.pool = pool  # type: ignore[assignment]
    follower = pipeline.followers[0]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pipeline._follow, follower)
            await eventually(
                lambda: pool.connections and pool.connections[0].told_commit >= 3, interval=0.01
            )
            await trio.sleep(5)  # idle
            pool.connections[0].close()
            await eventually(
                lambda: len(pool.connections) >= 2 and pool.connections[1].told_commit >= 3,
                interval=0.01,
            )
            nursery.cancel_scope.cancel()
    assert engine.next == 3  # nothing was appended meanwhile


async def test_followers_end_up_told_the_last_commit_offset() -> None:
    """Appends, both followers streaming: once appends stop, each follower
    has every batch and has been told the commit offset of the last one."""
    engine = FakeEngine()
    pipeline = pipeline_of(engine)
    connections = [FakeFollower(), FakeFollower()]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for follower, connection in zip(pipeline.followers, connections, strict=True):
                follower.send_offset = 0
                nursery.start_soon(pipeline._stream_to, follower, connection)  # type: ignore[arg-type]
            for _ in range(200):
                engine.append(1)
                pipeline.new_data()
                await trio.sleep(0)
            await eventually(
                lambda: (
                    pipeline.commit >= engine.next
                    and all(c.told_commit >= engine.next for c in connections)
                ),
                what="the commit offset told to both followers",
            )
            nursery.cancel_scope.cancel()
    assert [c.next for c in connections] == [200, 200]
    assert [c.told_commit for c in connections] == [200, 200]


async def test_a_range_sealed_here_learns_the_pm_end_it_was_never_synced(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """This follower answered the PM's SEAL_RANGES (sealed here at 3, the
    end unknown) but the SYNC_RANGES with the end, 2, never reached it. The
    PM, asked again, answers that the range is sealed and sends nothing: the
    node asks it for the stream's ranges, and serves up to the PM's end."""
    replicas = (ReplicaInfo(1, "127.0.0.1:9001", True), ReplicaInfo(2, "127.0.0.1:9002", False))
    with StorageEngine(tmp_path / "node", node_id=2, map_size=64 << 20) as engine:
        engine.sync_ranges(STREAM, [RangeInfo(STREAM, 0, 0, replicas=replicas)]).result()
        for offset in range(3):
            batch = build_batch([b"v"], 0)
            stamp_base_offset(batch, offset)
            engine.replicate([ReplicaBatch(STREAM, 0, 0, offset, batch, 1)]).result()
        assert engine.seal_range(STREAM, 0).result().sealed_here

        asked: list[str] = []

        class PM:
            async def seal_range(self, info: RangeInfo) -> bool:
                asked.append("seal")
                return True  # sealed there long ago

            async def refresh_stream(self, stream_id: int) -> bool:
                asked.append("ranges")
                pm_view = [
                    RangeInfo(STREAM, 0, 0, 2, replicas=replicas),
                    RangeInfo(STREAM, 1, 2, replicas=replicas),
                ]
                engine.sync_ranges(stream_id, pm_view).result()
                return True

        states = ReplicaStates(2, engine, StreamWaiters())
        replicator = Replicator(states, PM(), None)  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            await nursery.start(replicator.run)
            replicator.ranges_changed(STREAM)
            await trio.sleep(SETTLE_AFTER_S * 3)
            nursery.cancel_scope.cancel()
        settled = engine.list_ranges(STREAM)[0]
        assert (settled.end_offset, settled.end_is_final) == (2, True)
        assert asked[:2] == ["seal", "ranges"]


def test_only_ranges_sealed_here_past_the_settle_wait_are_due(tmp_path: Path) -> None:
    """``ReplicaStates.due_to_settle``: a stream noted less than
    ``SETTLE_AFTER_S`` ago waits; one past it with a range sealed here is
    due; one past it with nothing sealed here any more is forgotten."""
    replicas = (ReplicaInfo(1, "127.0.0.1:9001", True), ReplicaInfo(2, "127.0.0.1:9002", False))
    with StorageEngine(tmp_path / "node", node_id=2, map_size=64 << 20) as engine:
        for stream_id in (1, 2, 3):
            engine.sync_ranges(stream_id, [RangeInfo(stream_id, 0, 0, replicas=replicas)]).result()
        for stream_id in (1, 2):
            assert engine.seal_range(stream_id, 0).result().sealed_here
        states = ReplicaStates(2, engine, StreamWaiters())
        now = 100.0
        waiting = {1: now - SETTLE_AFTER_S / 2, 2: now - SETTLE_AFTER_S, 3: now - SETTLE_AFTER_S}
        due, settled = states.due_to_settle(waiting, now)
        assert [(info.stream_id, info.range_index) for info in due] == [(2, 0)]
        assert settled == [3]
