"""Replication and failover (SPEC §7) with a PM and four data nodes as processes."""

from __future__ import annotations

import functools
import random
import signal
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio

from client.consumer import DEFAULT_REQUEST_TIMEOUT, DEFAULT_RETRY_TIMEOUT, Consumer
from client.producer import Producer
from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import build_batch, decode_batches
from sbp.enums import ErrorCode
from sbp.errors import ProtocolError, RangeSealedError
from spark_jobs.layout import RangeSlice, replica_addresses
from spark_jobs.reader import fetch_from_replicas

from ..eventually import eventually
from .pm_cluster import PMCluster, append_values, pm_cluster, primary_address, read_stream

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NODES = (1, 2, 3, 4)


def node_of(cluster: PMCluster, data_node: messages.DataNode | None) -> int:
    assert data_node is not None
    return next(n for n, p in cluster.nodes.items() if p.address == data_node.advertise_addr)


async def replica_values(
    cluster: PMCluster, rng: messages.Range, address: str, offset: int
) -> list[bytes]:
    """What one replica serves of the range from ``offset`` (no long poll)."""
    info = messages.FetchInfo(stream_id=rng.stream_id, fetch_offset=offset, batch_max_bytes=1 << 20)
    async with cluster.node_client(address).fetch([info]) as results:
        data = b"".join([bytes(fetched.data) async for fetched in results])
    return decode_batches(data).to_list() if data else []


async def wait_served(
    cluster: PMCluster, rng: messages.Range, address: str, expected: list[bytes]
) -> None:
    await eventually(
        lambda: replica_values(cluster, rng, address, rng.start_offset),
        until=lambda values: values == expected,
        timeout=10,
    )


async def replicated_range(cluster: PMCluster) -> messages.Range:
    """The first range of a new stream of 3 replicas acknowledged by 2."""
    created = await cluster.pm_client().create_stream(3, ack_nums=2)
    assert created.range is not None
    return created.range


async def consume(
    cluster: PMCluster,
    stream_id: int,
    count: int,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
) -> list[bytes]:
    """The first ``count`` values of the stream, read by a ``Consumer``."""
    read: list[bytes] = []
    with trio.fail_after(30):
        async with Consumer(
            cluster.pm_address,
            stream_id,
            from_offset=0,
            request_timeout=request_timeout,
            retry_timeout=retry_timeout,
        ) as consumer:
            async for record in consumer.records():
                read.append(record.value)
                if len(read) == count:
                    break
    return read


@pytest.mark.deadline(90)
async def test_every_replica_holds_and_serves_what_was_acknowledged(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, NODES) as cluster:
        pm = cluster.pm_client()
        created = await pm.create_stream(3, ack_nums=2)
        assert created.stream is not None and created.range is not None
        assert created.stream.ack_nums == 2
        rng = created.range
        assert await append_values(cluster, rng, [b"a", b"b"]) == 0
        assert await append_values(cluster, rng, [b"c"]) == 2
        for replica in rng.replica_nodes:
            await wait_served(cluster, rng, replica.data_node.advertise_addr, [b"a", b"b", b"c"])
        # the commit offset every replica reports
        for replica in rng.replica_nodes:
            described = await cluster.node_client(replica.data_node.advertise_addr).describe_range(
                rng.stream_id, 0
            )
            assert (described.next_offset, described.commit_offset) == (3, 3)


@pytest.mark.deadline(90)
async def test_ack_nums_is_checked(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, (1,)) as cluster:
        results = await cluster.pm_client().create_streams(
            [messages.Stream(replica_nums=1, ack_nums=2), messages.Stream(replica_nums=1)]
        )
        assert results[0].error_code == ErrorCode.INVALID_REQUEST
        assert "ack_nums" in results[0].error_message
        assert results[1].error_code == ErrorCode.NONE


@pytest.mark.deadline(120)
async def test_a_stopped_follower_does_not_stop_appends_two_do(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, (1, 2, 3)) as cluster:
        pm = cluster.pm_client()
        created = await pm.create_stream(3, ack_nums=2)
        assert created.range is not None
        rng = created.range
        followers = [node_of(cluster, r.data_node) for r in rng.replica_nodes if not r.is_primary]
        primary = cluster.node_client(primary_address(rng))
        batch = bytes(build_batch([b"x"], base_timestamp=1))

        cluster.nodes[followers[0]].process.send_signal(signal.SIGSTOP)
        try:
            [result] = await primary.append([(rng.stream_id, batch)], timeout=5)
            assert (result.error_code, result.base_offset) == (ErrorCode.NONE, 0)

            cluster.nodes[followers[1]].process.send_signal(signal.SIGSTOP)
            started = trio.current_time()
            [result] = await primary.append([(rng.stream_id, batch)], timeout=1)
            assert result.error_code == ErrorCode.NOT_ENOUGH_REPLICAS
            assert trio.current_time() - started < 2.5
        finally:
            for follower in followers:
                cluster.nodes[follower].process.send_signal(signal.SIGCONT)


async def produce(
    cluster: PMCluster, stream_id: int, acked: dict[bytes, int], stop: trio.Event
) -> None:
    """Send unique values until ``stop``; record the offset of each acknowledged one."""
    async with Producer(
        cluster.pm_address, stream_id, linger=0.002, delivery_timeout=60, request_timeout=2
    ) as producer:
        number = 0
        while not stop.is_set():
            values = [f"v{number + i}".encode() for i in range(20)]
            number += len(values)
            handle = await producer.send_many(values)
            offsets = await handle.offsets()
            for value, offset in zip(values, offsets.tolist(), strict=True):
                acked[value] = offset


@pytest.mark.deadline(240)
async def test_killing_the_primary_loses_no_acknowledged_record(tmp_path: Path) -> None:
    rounds = 2
    rng_seed = random.Random(20261124)
    async with pm_cluster(tmp_path, NODES) as cluster:
        pm = cluster.pm_client()
        created = await pm.create_stream(3, ack_nums=2)
        assert created.stream is not None
        stream_id = created.stream.stream_id
        acked: dict[bytes, int] = {}
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce, cluster, stream_id, acked, stop)
            for _ in range(rounds):
                await trio.sleep(rng_seed.uniform(0.5, 1.5))
                ranges = await pm.list_stream_ranges(stream_id)
                victim = node_of(cluster, ranges[-1].primary_node())
                before = len(acked)
                await cluster.nodes[victim].kill()
                await cluster.wait_alive(set(NODES) - {victim}, dead={victim})
                # The producer goes on by itself in a range on live nodes.
                await eventually(lambda: len(acked) >= before + 200, timeout=30)  # noqa: B023
                await cluster.start_node(victim)
                await cluster.wait_alive(set(NODES))
            stop.set()
        ranges = await pm.list_stream_ranges(stream_id)
        assert len(ranges) >= rounds + 1
        end = ranges[-1]
        # Every acknowledged record is read back at its offset, from any replica.
        stored: dict[int, bytes] = {}
        async with Consumer(cluster.pm_address, stream_id, from_offset=0) as consumer:
            with trio.fail_after(60):
                async for record in consumer.records():
                    stored[record.offset] = record.value
                    if len(stored) >= max(acked.values()) + 1:
                        break
        assert sorted(stored) == list(range(len(stored)))  # dense
        lost = {value: offset for value, offset in acked.items() if stored.get(offset) != value}
        assert not lost
        assert end.is_open


@pytest.mark.deadline(120)
async def test_a_primary_restarted_before_the_pm_noticed_has_its_range_sealed(
    tmp_path: Path,
) -> None:
    """SIGKILL of the primary under appends, and a restart at once: its
    followers may hold batches its last commit never made durable, so it
    takes no more appends in that range. The producer has the PM seal it and
    goes on; every replica of the sealed range serves the same records, the
    acknowledged ones at their offsets."""
    async with pm_cluster(tmp_path, NODES, node_timeout_ms=60_000) as cluster:
        pm = cluster.pm_client()
        created = await pm.create_stream(3, ack_nums=2)
        assert created.stream is not None and created.range is not None
        stream_id = created.stream.stream_id
        victim = node_of(cluster, created.range.primary_node())
        acked: dict[bytes, int] = {}
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce, cluster, stream_id, acked, stop)
            await eventually(lambda: len(acked) >= 200, timeout=10)
            await cluster.nodes[victim].kill()
            await cluster.start_node(victim)
            before = len(acked)
            await eventually(lambda: len(acked) >= before + 200, timeout=30)
            stop.set()
        first = (await pm.list_stream_ranges(stream_id))[0]
        assert not first.is_open
        length = first.end_offset - first.start_offset
        served = []
        for replica in first.replica_nodes:
            address = replica.data_node.advertise_addr
            values = await eventually(
                functools.partial(replica_values, cluster, first, address, 0),
                until=lambda held: len(held) >= length,
                timeout=20,
            )
            served.append(values[:length])
        assert served[0] == served[1] == served[2]
        for value, offset in acked.items():
            if offset < first.end_offset:
                assert served[0][offset] == value


async def wait_sealed(cluster: PMCluster, stream_id: int, range_index: int) -> messages.Range:
    pm = cluster.pm_client()
    ranges = await eventually(
        lambda: pm.list_stream_ranges(stream_id),
        until=lambda ranges: len(ranges) > range_index + 1 and not ranges[range_index].is_open,
        timeout=20,
        what=f"stream {stream_id} range {range_index} sealed",
    )
    return ranges[range_index]


@pytest.mark.deadline(120)
async def test_the_old_primary_returns_to_a_sealed_range(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, NODES) as cluster:
        pm = cluster.pm_client()
        created = await pm.create_stream(3, ack_nums=2)
        assert created.range is not None
        rng = created.range
        await append_values(cluster, rng, [b"a", b"b"])
        old_address = primary_address(rng)
        victim = cluster.nodes[node_of(cluster, rng.primary_node())]
        victim.process.send_signal(signal.SIGSTOP)
        try:
            sealed = await wait_sealed(cluster, rng.stream_id, 0)
        finally:
            victim.process.send_signal(signal.SIGCONT)
        assert sealed.end_offset == 2
        following = (await pm.list_stream_ranges(rng.stream_id))[1]
        assert await append_values(cluster, following, [b"c"]) == 2

        old = cluster.node_client(old_address)
        batch = bytes(build_batch([b"late"], base_timestamp=1))
        [late] = await old.append([(rng.stream_id, batch)], timeout=2)
        assert late.error_code != ErrorCode.NONE
        # Once the PM told it, it holds the range sealed where the PM sealed
        # it, and serves nothing of it past that end.
        await eventually(
            lambda: old.describe_range(rng.stream_id, 0),
            until=lambda described: described.end_offset == 2,
            timeout=20,
        )
        assert await replica_values(cluster, rng, old_address, 0) == [b"a", b"b"]


@pytest.mark.deadline(90)
async def test_readers_fall_over_to_a_follower_when_the_primary_is_dead(tmp_path: Path) -> None:
    """With the primary SIGKILLed, a Consumer and the Spark source's fetch
    (primary first in both) read every acknowledged record from a follower."""
    async with pm_cluster(tmp_path, NODES) as cluster:
        rng = await replicated_range(cluster)
        values = [f"v{i}".encode() for i in range(30)]
        for first in range(0, len(values), 10):
            assert await append_values(cluster, rng, values[first : first + 10]) == first
        # the followers serve up to the commit offset they were told
        for replica in rng.replica_nodes:
            if not replica.is_primary:
                await wait_served(cluster, rng, replica.data_node.advertise_addr, values)
        await cluster.nodes[node_of(cluster, rng.primary_node())].kill()

        assert await consume(cluster, rng.stream_id, len(values)) == values

        addresses = replica_addresses(rng)
        assert addresses[0] == primary_address(rng)  # the dead one is tried first
        piece = RangeSlice(rng.stream_id, rng.range_index, 0, len(values), addresses)
        with trio.fail_after(30):
            data = await fetch_from_replicas(cluster.pool, piece, 0, 1 << 20, timeout=5)
        assert decode_batches(data).to_list() == values

        # with every replica gone, the error says what each one answered
        # (Spark shows a task's message, not its cause)
        for replica in rng.replica_nodes:
            if not replica.is_primary:
                await cluster.nodes[node_of(cluster, replica.data_node)].kill()
        with trio.fail_after(30), pytest.raises(RuntimeError) as refused:
            await fetch_from_replicas(cluster.pool, piece, 0, 1 << 20, timeout=5)
        assert all(f"{address}: " in str(refused.value) for address in addresses), refused.value


@pytest.mark.deadline(90)
async def test_a_consumer_tries_every_replica_before_giving_up(tmp_path: Path) -> None:
    """Paused nodes take connections and never answer, so each costs a whole
    request timeout: with the primary and one follower paused, a Consumer
    whose retry window is one request timeout still reaches the third
    replica, which holds every committed record."""
    async with pm_cluster(tmp_path, NODES) as cluster:
        rng = await replicated_range(cluster)
        values = [f"v{i}".encode() for i in range(20)]
        assert await append_values(cluster, rng, values) == 0
        follower, last = [r.data_node for r in rng.replica_nodes if not r.is_primary]
        await wait_served(cluster, rng, last.advertise_addr, values)
        paused = [cluster.nodes[node_of(cluster, n)] for n in (rng.primary_node(), follower)]
        for node in paused:
            node.process.send_signal(signal.SIGSTOP)
        try:
            read = await consume(
                cluster, rng.stream_id, len(values), request_timeout=1.0, retry_timeout=1.0
            )
            assert read == values
        finally:
            for node in paused:
                node.process.send_signal(signal.SIGCONT)


@pytest.mark.deadline(150)
async def test_a_dead_replica_is_repaired_on_a_live_node(tmp_path: Path) -> None:
    async with ConnectionPool() as pool:
        cluster = PMCluster(tmp_path, pool)
        try:
            await cluster.start_pm("127.0.0.1:0", "--repair-after-ms", "2000")
            await cluster.start_nodes(NODES)
            pm = cluster.pm_client()
            created = await pm.create_stream(3, ack_nums=2)
            assert created.range is not None
            rng = created.range
            await append_values(cluster, rng, [b"a", b"b", b"c"])
            await pm.seal_range(rng.stream_id, 0)
            [dead] = [node_of(cluster, r.data_node) for r in rng.replica_nodes if not r.is_primary][
                :1
            ]
            await cluster.nodes[dead].kill()
            with trio.fail_after(30):
                while True:
                    repaired = (await pm.list_stream_ranges(rng.stream_id))[0]
                    ids = {r.data_node.node_id for r in repaired.replica_nodes}
                    if dead not in ids:
                        break
                    await trio.sleep(0.2)
            assert len(ids) == 3
            [newcomer] = ids - {r.data_node.node_id for r in rng.replica_nodes}
            address = next(
                r.data_node.advertise_addr
                for r in repaired.replica_nodes
                if r.data_node.node_id == newcomer
            )
            await wait_served(cluster, repaired, address, [b"a", b"b", b"c"])
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()


@pytest.mark.deadline(120)
async def test_a_seal_that_ran_out_of_answers_is_finished_by_the_primary(
    tmp_path: Path,
) -> None:
    """The primary sealed the range on the PM's request, but too few replicas
    answered for the PM to end it: once the followers are back, the primary
    asks the PM to seal it again, and the stream goes on."""
    async with pm_cluster(tmp_path, (1, 2, 3)) as cluster:
        pm = cluster.pm_client()
        created = await pm.create_stream(3, ack_nums=2)
        assert created.range is not None
        rng = created.range
        await append_values(cluster, rng, [b"a"])
        followers = [node_of(cluster, r.data_node) for r in rng.replica_nodes if not r.is_primary]
        for follower in followers:
            cluster.nodes[follower].process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises((ProtocolError, trio.TooSlowError)):
                await pm.seal_range(rng.stream_id, 0, timeout=1)
        finally:
            for follower in followers:
                cluster.nodes[follower].process.send_signal(signal.SIGCONT)
        primary = cluster.node_client(primary_address(rng))
        assert (await primary.describe_range(rng.stream_id, 0)).end_offset == 1
        sealed = await wait_sealed(cluster, rng.stream_id, 0)
        assert sealed.end_offset == 1
        following = (await pm.list_stream_ranges(rng.stream_id))[1]

        async def append_b() -> int | None:
            try:
                return await append_values(cluster, following, [b"b"])
            except RangeSealedError:
                return None  # the next range's primary has not heard of it yet (SYNC_RANGES)

        assert await eventually(append_b, until=lambda base: base is not None, timeout=10) == 1


@pytest.mark.deadline(150)
async def test_a_follower_whose_map_fills_leaves_its_range_for_a_node_with_room(
    tmp_path: Path,
) -> None:
    """A follower with a 3 MiB map fills while the stream goes on: the PM
    seals the range (its next one goes on nodes with room), the full
    follower, short of the sealed range, leaves it, and the node that joins
    later copies the range: every replica the PM lists holds the whole range.
    The follower that left is not given the range again, though dropping it
    gave it room: the range is larger than that room."""
    value = b"x" * 8_000
    async with ConnectionPool() as pool:
        cluster = PMCluster(tmp_path, pool)
        try:
            await cluster.start_pm()
            await cluster.start_nodes((1, 2))
            await cluster.start_node(4, "--map-size", "3MiB")
            await cluster.wait_alive({1, 2, 4})
            pm = cluster.pm_client()
            created = await pm.create_stream(3, ack_nums=2)
            assert created.stream is not None and created.range is not None
            stream_id = created.stream.stream_id
            assert {r.data_node.node_id for r in created.range.replica_nodes} == {1, 2, 4}
            async with Producer(
                cluster.pm_address, stream_id, delivery_timeout=60, request_timeout=5
            ) as producer:
                for _ in range(12):  # 6 MB, twice the small map
                    handle = await producer.send_many([value] * 60)
                    await handle.offsets()
            await cluster.start_node(3)

            def sealed_on_nodes_with_room(ranges: Sequence[messages.Range]) -> bool:
                first = ranges[0]
                holders = {r.data_node.node_id for r in first.replica_nodes}
                return not first.is_open and holders == {1, 2, 3}

            async def listed() -> Sequence[messages.Range]:
                return await pm.list_stream_ranges(stream_id)

            ranges = await eventually(
                listed,
                until=sealed_on_nodes_with_room,
                timeout=60,
                interval=0.2,
                what="the first range sealed on nodes 1, 2 and 3",
            )
            first = ranges[0]
            count = first.end_offset - first.start_offset
            assert count > 0
            for replica in first.replica_nodes:
                address = replica.data_node.advertise_addr
                held: list[bytes] = []

                async def read_on() -> bool:
                    held.extend(await replica_values(cluster, first, address, len(held)))  # noqa: B023
                    return len(held) >= count  # noqa: B023

                await eventually(read_on, timeout=30, interval=0.05, what=f"{address}'s copy")
                assert held == [value] * count
            # the stream itself reads back whole, and stays writable (node 4,
            # having dropped what it held of the first range, may have room
            # for a later one again)
            assert len(await read_stream(cluster, stream_id)) == 12 * 60
            async with Producer(cluster.pm_address, stream_id, request_timeout=5) as producer:
                handle = await producer.send_many([b"after"])
                assert (await handle.offsets()).tolist() == [12 * 60]
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()
