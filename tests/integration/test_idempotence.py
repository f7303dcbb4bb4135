"""Idempotent appends against real processes (SPEC §10): the PM hands out the
producer's id, the data node stores each batch once however often it is
sent, and the followers' state lets the next primary answer a resend after
the old one was killed."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import trio

from client.consumer import Consumer
from client.producer import Producer
from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import build_batch
from sbp.enums import ErrorCode
from sbp.errors import (
    OutOfOrderSequenceError,
    ProducerFencedError,
    RangeNotFoundError,
    RangeSealedError,
)
from sbp.producer_stamp import ProducerStamp

from ..eventually import eventually
from .pm_cluster import PMCluster, pm_cluster, primary_address, read_stream

pytestmark = [pytest.mark.integration, pytest.mark.deadline(120)]


async def _read(pm_address: str, stream_id: int, count: int) -> list[bytes]:
    """The stream's first ``count`` values, as a consumer reads them (from
    any live replica)."""
    values: list[bytes] = []
    with trio.fail_after(30):
        async with Consumer(pm_address, stream_id, from_offset=0) as consumer:
            async for record in consumer.records():
                values.append(record.value)
                if len(values) == count:
                    return values
    return values


def _batch(*values: bytes) -> bytes:
    return bytes(build_batch(list(values), base_timestamp=1))


async def test_resends_are_stored_once_through_a_primarys_death(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, (1, 2, 3)) as cluster:
        pm = cluster.pm_client()
        producer_id, epoch = await pm.init_producer()
        created = await pm.create_stream(3, ack_nums=2)
        assert created.range is not None and epoch == 0
        stream_id = created.range.stream_id
        primary = cluster.node_client(primary_address(created.range))

        first = await primary.append_batch(
            stream_id, _batch(b"a", b"b"), producer=ProducerStamp(producer_id, 0, 0)
        )
        again = await primary.append_batch(
            stream_id, _batch(b"a", b"b"), producer=ProducerStamp(producer_id, 0, 0)
        )
        assert (first.base_offset, again.base_offset) == (0, 0)
        assert again.error_code == ErrorCode.NONE
        second = await primary.append_batch(
            stream_id, _batch(b"c"), producer=ProducerStamp(producer_id, 0, 2)
        )
        assert second.base_offset == 2
        with pytest.raises(OutOfOrderSequenceError) as gap:
            await primary.append_batch(
                stream_id, _batch(b"x"), producer=ProducerStamp(producer_id, 0, 9)
            )
        assert gap.value.code == ErrorCode.OUT_OF_ORDER_SEQUENCE
        (wire,) = await primary.append(
            [(stream_id, _batch(b"x"))], producers=[ProducerStamp(producer_id, 0, 9)]
        )
        assert wire.next_sequence == 3  # the answer names the sequence expected
        # a new epoch starts at 0 and fences the old one
        bumped = await primary.append_batch(
            stream_id, _batch(b"d"), producer=ProducerStamp(producer_id, 1, 0)
        )
        assert bumped.base_offset == 3
        with pytest.raises(ProducerFencedError):
            await primary.append_batch(
                stream_id, _batch(b"y"), producer=ProducerStamp(producer_id, 0, 3)
            )

        # The primary dies; the PM seals range 0 at 4 and opens range 1 on
        # the two followers, which hold the producer's state from REPLICATE.
        victim = next(node for node in cluster.nodes.values() if node.address == primary.address)
        await victim.kill()
        ranges = await eventually(
            lambda: pm.list_stream_ranges(stream_id),
            until=lambda found: len(found) == 2 and found[1].is_open,
            timeout=30,
        )
        assert ranges[0].end_offset == 4
        successor = cluster.node_client(primary_address(ranges[1]))

        async def resend() -> messages.AppendResult | None:
            # the successor may not have heard of range 1 yet (the PM tells
            # it after its commit): RANGE_SEALED then, as a client would retry
            try:
                return await successor.append_batch(
                    stream_id, _batch(b"d"), producer=ProducerStamp(producer_id, 1, 0)
                )
            except RangeSealedError:
                return None

        resent = await eventually(resend, timeout=10, what="the successor takes appends")
        assert resent.base_offset == 3  # answered where range 0 holds it
        after = await successor.append_batch(
            stream_id, _batch(b"e"), producer=ProducerStamp(producer_id, 1, 1)
        )
        assert after.base_offset == 4
        assert await _read(cluster.pm_address, stream_id, 5) == [b"a", b"b", b"c", b"d", b"e"]


async def test_producer_state_outlives_a_data_node_restart(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, (1,)) as cluster:
        pm = cluster.pm_client()
        producer_id, _ = await pm.init_producer("restarts")
        created = await pm.create_stream(1)
        assert created.range is not None
        stream_id = created.range.stream_id
        node = cluster.nodes[1]
        client = cluster.node_client(node.address)
        stamp = ProducerStamp(producer_id, 0, 0)
        assert (await client.append_batch(stream_id, _batch(b"a"), producer=stamp)).base_offset == 0
        assert await node.terminate() == 0
        restarted = await cluster.start_node(1)
        # "alive" may still be the old process's last heartbeat: wait until
        # the PM names the new address, which read_stream below goes to
        await eventually(
            lambda: pm.list_stream_ranges(stream_id),
            until=lambda ranges: primary_address(ranges[0]) == restarted.address,
            what="the PM naming the restarted node's address",
        )
        client = cluster.node_client(restarted.address)
        again = await client.append_batch(stream_id, _batch(b"a"), producer=stamp)
        assert again.base_offset == 0
        assert await read_stream(cluster, stream_id) == [b"a"]
        # and the PM, restarted, keeps the name's id and moves its epoch on
        assert cluster.pm is not None and await cluster.pm.terminate() == 0
        await cluster.start_pm(cluster.pm_address)
        assert await cluster.pm_client().init_producer("restarts") == (producer_id, 1)


async def test_the_next_range_on_another_node_takes_in_the_producer_state(
    tmp_path: Path,
) -> None:
    """Range 1 is placed on a node that never held range 0 (SPEC §10,
    across ranges): it takes in the state as of range 0's end from range 0's
    replica, and answers resends and continuations as range 0's primary would."""
    async with pm_cluster(tmp_path, (1, 2)) as cluster:
        pm = cluster.pm_client()
        producer_id, _ = await pm.init_producer()
        created = await pm.create_stream(1)
        assert created.range is not None
        stream_id = created.range.stream_id
        first = cluster.node_client(primary_address(created.range))
        for sequence, value in enumerate((b"a", b"b", b"c")):
            stamp = ProducerStamp(producer_id, 0, sequence)
            await first.append_batch(stream_id, _batch(value), producer=stamp)
        await pm.seal_range(stream_id, 0)
        ranges = await pm.list_stream_ranges(stream_id)
        assert ranges[0].end_offset == 3
        assert primary_address(ranges[1]) != primary_address(ranges[0])  # the other node
        second = cluster.node_client(primary_address(ranges[1]))

        # refused (retriable) until it has taken the state in: then the resend
        # of the last batch of range 0 is answered where range 0 holds it
        resent = await eventually(
            lambda: second.append(
                [(stream_id, _batch(b"c"))], producers=[ProducerStamp(producer_id, 0, 2)]
            ),
            until=lambda results: results[0].error_code != ErrorCode.RANGE_NOT_FOUND,
            timeout=20,
        )
        assert (resent[0].error_code, resent[0].base_offset) == (ErrorCode.NONE, 2)
        after = await second.append_batch(
            stream_id, _batch(b"d"), producer=ProducerStamp(producer_id, 0, 3)
        )
        assert after.base_offset == 3
        assert await read_stream(cluster, stream_id) == [b"a", b"b", b"c", b"d"]


async def test_an_idempotent_producer_writes_through_a_primary_kill_exactly_once(
    tmp_path: Path,
) -> None:
    """SIGKILL the primary of an R = 3 stream while a producer with 16
    requests in flight writes: it goes on by itself, and the stream holds
    every value once, in the order sent."""
    async with pm_cluster(tmp_path, (1, 2, 3)) as cluster:
        pm = cluster.pm_client()
        created = await pm.create_stream(3, ack_nums=2)
        assert created.range is not None
        stream_id = created.range.stream_id
        victim = next(
            node
            for node in cluster.nodes.values()
            if node.address == primary_address(created.range)
        )
        sent: list[bytes] = []
        async with Producer(
            cluster.pm_address,
            stream_id,
            max_in_flight=16,
            batch_records=20,
            linger=0.001,
            request_timeout=2.0,
        ) as producer:
            handles = []
            for i in range(6000):
                value = b"value-%05d" % i
                sent.append(value)
                handles.append(await producer.send(value))
                if i == 2000:
                    await victim.kill()
                if i % 50 == 0:
                    await trio.sleep(0.005)
            await producer.flush()
            offsets = [await handle.offset() for handle in handles]
        assert offsets == list(range(6000))  # in the order sent, none twice
        assert await _read(cluster.pm_address, stream_id, 6000) == sent
        ranges = await pm.list_stream_ranges(stream_id)
        assert len(ranges) >= 2  # it did go on in a range after the kill


async def test_a_repaired_replica_can_give_the_producer_state_after_its_range(
    tmp_path: Path,
) -> None:
    """A replica placed to repair a sealed range copies it with FETCH, which
    carries no producer fields; it then takes in the state as of the range's
    end from the range's other replica, so that it can give it to the range
    after once the replicas it copied from are gone."""
    async with ConnectionPool() as pool:
        cluster = PMCluster(tmp_path, pool)
        try:
            await cluster.start_pm("127.0.0.1:0", "--repair-after-ms", "1000")
            await cluster.start_nodes((1, 2, 3, 4, 5))
            pm = cluster.pm_client()
            producer_id, _ = await pm.init_producer()
            created = await pm.create_stream(2, ack_nums=2)
            assert created.range is not None
            rng = created.range
            stream_id = rng.stream_id
            primary = cluster.node_client(primary_address(rng))
            for sequence, value in enumerate((b"a", b"b", b"c")):
                stamp = ProducerStamp(producer_id, 0, sequence)
                await primary.append_batch(stream_id, _batch(value), producer=stamp)
            await pm.seal_range(stream_id, 0)
            ranges = await pm.list_stream_ranges(stream_id)
            holders = [{r.data_node.node_id for r in each.replica_nodes} for each in ranges]
            # placement spreads ranges: range 1 lies on two other nodes, so
            # the follower of range 0 can die without touching the open range
            assert not holders[0] & holders[1]
            [follower] = [r.data_node.node_id for r in rng.replica_nodes if not r.is_primary]
            await cluster.nodes[follower].kill()

            def repaired(ranges: tuple[messages.Range, ...]) -> bool:
                ids = {r.data_node.node_id for r in ranges[0].replica_nodes}
                return follower not in ids and len(ids) == 2

            ranges = await eventually(
                lambda: pm.list_stream_ranges(stream_id), until=repaired, timeout=30
            )
            [newcomer] = [
                r.data_node.advertise_addr
                for r in ranges[0].replica_nodes
                if r.data_node.node_id not in holders[0]
            ]
            # the newcomer holds no part of the open range, and still gives
            # the state as of range 0's end, as its other replica does
            assert newcomer not in {r.data_node.advertise_addr for r in ranges[1].replica_nodes}
            expected = await primary.producer_state(stream_id, 3)

            async def state_given() -> tuple[messages.ProducerSnapshot, ...] | None:
                try:
                    return await cluster.node_client(newcomer).producer_state(stream_id, 3)
                except RangeNotFoundError:  # still copying range 0, or taking in its end
                    return None

            given = await eventually(state_given, until=bool, timeout=20)
            assert given is not None
            assert given == expected
            [snapshot] = given
            assert snapshot.producer_id == producer_id
            assert [(b.base_sequence, b.base_offset) for b in snapshot.batches] == [
                (0, 0),
                (1, 1),
                (2, 2),
            ]
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()


async def test_a_producer_that_lost_answers_learns_exactly_what_the_stream_holds(
    tmp_path: Path,
) -> None:
    """The node paused (SIGSTOP) under an append: the producer's batches
    time out unanswered and it stops (``stop_after_loss``); once the node
    runs again it stores what had reached it. ``Producer.stored`` then says
    how many of the records sent the stream holds, which are the first ones
    sent, answers lost or not: what ``sbp append`` reports after a failure."""
    async with pm_cluster(tmp_path, (1,)) as cluster:
        created = await cluster.pm_client().create_stream(1)
        assert created.range is not None
        stream_id = created.range.stream_id
        node = cluster.nodes[1]
        async with Producer(
            cluster.pm_address,
            stream_id,
            pool=cluster.pool,
            request_timeout=1.0,
            delivery_timeout=2.0,
            stop_after_loss=True,
        ) as producer:
            first = await producer.send_many([b"acked-%d" % i for i in range(100)])
            await first.wait()
            node.process.send_signal(signal.SIGSTOP)
            try:
                lost = await producer.send_many([b"lost-%d" % i for i in range(100)])
                stored, failure = await lost.settle()
                assert stored == [] and failure is not None
            finally:
                node.process.send_signal(signal.SIGCONT)
            held = await producer.stored()
        values = await _read(cluster.pm_address, stream_id, 200)
        assert held is not None and held == len(values) >= 100
        assert values == [b"acked-%d" % i for i in range(100)] + [
            b"lost-%d" % i for i in range(held - 100)
        ]
