"""Draining data nodes (SPEC §12), with real processes: ranges of one and of
three replicas leave a draining node under appends and reads, and a drain
goes on where it was after the PM is killed and started again."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import trio

from client.consumer import Consumer
from client.producer import Producer
from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import build_batch
from sbp.enums import DataNodeState, ErrorCode

from ..eventually import eventually
from .conftest import scrape
from .local_cluster import sbp
from .pm_cluster import PMCluster, append_values, pm_cluster, primary_address, read_stream

pytestmark = pytest.mark.integration


def _nodes(rng: messages.Range) -> set[int]:
    return {r.data_node.node_id for r in rng.replica_nodes}


async def _status(cluster: PMCluster, node_id: int) -> messages.DataNodeStatus:
    statuses = await cluster.pm_client().describe_cluster()
    [status] = [s for s in statuses if s.data_node.node_id == node_id]
    return status


async def _drained(cluster: PMCluster, node_id: int, timeout: float) -> None:
    status = await eventually(
        lambda: _status(cluster, node_id),
        until=lambda s: s.state == DataNodeState.DRAINED,
        timeout=timeout,
        what=f"node {node_id} drained",
    )
    assert status.bytes_to_move == 0


class Load:
    """One producer per stream appending without pause, and one consumer per
    stream reading behind it; what was acknowledged and read, and the
    longest a reader went without a record while values were waiting."""

    def __init__(self, pm_address: str, stream_ids: list[int]) -> None:
        self.pm_address = pm_address
        self.stream_ids = stream_ids
        self.acked: dict[int, list[bytes]] = {sid: [] for sid in stream_ids}
        self.read: dict[int, list[bytes]] = {sid: [] for sid in stream_ids}
        self.longest_stall = 0.0
        self.stop = trio.Event()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for stream_id in self.stream_ids:
                nursery.start_soon(self._produce, stream_id)
                nursery.start_soon(self._consume, stream_id)

    async def _produce(self, stream_id: int) -> None:
        async with Producer(
            self.pm_address, stream_id, batch_records=50, linger=0.002, request_timeout=5.0
        ) as producer:
            i = 0
            while not self.stop.is_set():
                value = b"%d-%07d-" % (stream_id, i) + bytes(200)
                handle = await producer.send(value)
                i += 1
                if i % 200 == 0:
                    await producer.flush()
                    await handle.offset()
                    self.acked[stream_id] = self.acked[stream_id] + [
                        b"%d-%07d-" % (stream_id, n) + bytes(200)
                        for n in range(len(self.acked[stream_id]), i)
                    ]
                    await trio.sleep(0.01)
            await producer.flush()
            self.acked[stream_id] += [
                b"%d-%07d-" % (stream_id, n) + bytes(200)
                for n in range(len(self.acked[stream_id]), i)
            ]

    async def _consume(self, stream_id: int) -> None:
        got = self.read[stream_id]
        async with Consumer(self.pm_address, stream_id, from_offset=0, tail=True) as consumer:
            last = time.monotonic()
            while not self.stop.is_set():
                with trio.move_on_after(0.5):
                    async for record in consumer.records():
                        got.append(record.value)
                        now = time.monotonic()
                        self.longest_stall = max(self.longest_stall, now - last)
                        last = now
                        if self.stop.is_set():
                            return
                if len(got) >= len(self.acked[stream_id]):
                    last = time.monotonic()  # caught up: waiting is not a stall


async def test_a_drained_node_holds_nothing_and_loses_nothing_under_load(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, (1, 2, 3, 4)) as cluster:
        pm = cluster.pm_client()
        singles = [(await pm.create_stream(1)).range for _ in range(3)]
        triples = [(await pm.create_stream(3, ack_nums=2)).range for _ in range(2)]
        ranges = [r for r in (*singles, *triples) if r is not None]
        stream_ids = [r.stream_id for r in ranges]
        # the node that leads the first single-replica stream also holds a
        # replica of every three-replica range (3 of 4 nodes) or most of them
        victim = next(iter(_nodes(ranges[0])))
        load = Load(cluster.pm_address, stream_ids)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load.run)
            await eventually(lambda: all(len(load.acked[s]) >= 400 for s in stream_ids), timeout=30)
            for stream_id in stream_ids:  # sealed ranges as well as open ones
                await pm.seal_range(stream_id, 0)
            await eventually(
                lambda: all(len(load.acked[s]) >= 1000 for s in stream_ids), timeout=30
            )
            held_before = [r for s in stream_ids for r in await pm.list_stream_ranges(s)]
            kinds = {len(_nodes(r)) for r in held_before if victim in _nodes(r)}
            assert kinds == {1, 3}, "the victim holds ranges of one and of three replicas"

            [result] = await pm.drain_data_nodes([victim])
            assert (result.error_code, result.state) == (ErrorCode.NONE, DataNodeState.DRAINING)
            await _drained(cluster, victim, timeout=60)
            count = {s: len(load.acked[s]) for s in stream_ids}
            await eventually(
                lambda: all(len(load.acked[s]) >= count[s] + 200 for s in stream_ids),
                timeout=30,
                what="appends go on after the drain",
            )
            load.stop.set()
        assert load.longest_stall < 10.0, load.longest_stall

        await cluster.nodes[victim].kill()
        for stream_id in stream_ids:
            wanted = 1 if stream_id in [r.stream_id for r in singles if r] else 3
            for rng in await pm.list_stream_ranges(stream_id):
                assert victim not in _nodes(rng)
                assert len(_nodes(rng)) >= wanted, (stream_id, rng)
            # every acknowledged value, once and in order, with the node gone
            acked = load.acked[stream_id]
            async with Consumer(cluster.pm_address, stream_id, from_offset=0) as consumer:
                values = []
                with trio.fail_after(30):
                    async for record in consumer.records():
                        values.append(record.value)
                        if len(values) == len(acked):
                            break
            assert values == acked
            assert load.read[stream_id] == acked[: len(load.read[stream_id])]


async def test_a_range_a_trim_cut_mid_batch_moves_whole(tmp_path: Path) -> None:
    """A trim inside a batch leaves the range starting in the middle of it;
    draining its node copies that batch whole and the rest after it, so the
    drain ends and the stream reads the same from the new replica."""
    async with pm_cluster(tmp_path, (1, 2)) as cluster:
        pm = cluster.pm_client()
        created = (await pm.create_stream(1)).range
        assert created is not None
        stream_id = created.stream_id
        values = [b"v%02d" % i for i in range(12)]
        for start in range(0, 12, 3):  # batches [0, 3), [3, 6) ...
            await append_values(cluster, created, values[start : start + 3])
        await pm.seal_range(stream_id, 0)
        await pm.trim_stream(stream_id, 4)
        [victim] = _nodes(created)
        await pm.drain_data_nodes([victim])
        await _drained(cluster, victim, timeout=30)
        [moved, _] = await pm.list_stream_ranges(stream_id)
        assert (moved.start_offset, moved.end_offset, _nodes(moved)) == (4, 12, {3 - victim})
        assert await read_stream(cluster, stream_id) == values[4:]


async def test_a_drain_goes_on_after_the_pm_is_killed(tmp_path: Path) -> None:
    async with ConnectionPool() as pool:
        cluster = PMCluster(tmp_path, pool)
        try:
            # Slow moves, so that the kill lands in the middle of the drain:
            # at 20 KiB/s a 200 KB range's copy starts ~10 s after the one
            # before, far more than a loaded run takes between seeing a range
            # moved and the kill.
            await cluster.start_pm("127.0.0.1:0", "--max-move-bytes-per-s", "20KiB")
            await cluster.start_nodes((1, 2, 3))
            pm = cluster.pm_client()
            created = (await pm.create_stream(1)).range
            assert created is not None
            stream_id = created.stream_id
            rng = created
            for _ in range(6):  # six sealed ranges of 200 KB, spread over the nodes
                node = cluster.node_client(primary_address(rng))
                for _ in range(4):
                    await node.append_batch(
                        stream_id, bytes(build_batch([bytes(50_000)], base_timestamp=1))
                    )
                rng = (await pm.seal_range(stream_id, rng.range_index)).ranges[-1]
            sealed = [r for r in await pm.list_stream_ranges(stream_id) if r.end_offset >= 0]
            victim = max((1, 2, 3), key=lambda n: sum(n in _nodes(r) for r in sealed))
            on_victim = [r for r in sealed if victim in _nodes(r)]
            assert len(on_victim) >= 2

            await pm.drain_data_nodes([victim])
            await eventually(
                lambda: pm.list_stream_ranges(stream_id),
                until=lambda rs: 0 < sum(victim in _nodes(r) for r in rs) < len(on_victim),
                timeout=30,
                what="a first range moved",
            )
            address = cluster.pm_address
            await cluster.pm.kill()  # type: ignore[union-attr]
            # unthrottled: what is left moves at once
            restarted = await cluster.start_pm(address, "--metrics-listen", "127.0.0.1:0")
            await _drained(cluster, victim, timeout=60)
            samples = await scrape(restarted)
            assert samples['sbp_pm_data_nodes_by_drain_state{state="drained"}'] == 1
            assert samples['sbp_pm_data_nodes_by_drain_state{state="active"}'] == 2
            # the ranges this PM moved: those left on the victim when it started
            assert 1 <= samples["sbp_pm_drain_moved_ranges_total"] < len(on_victim)
            for rng in await pm.list_stream_ranges(stream_id):
                assert victim not in _nodes(rng)
            await cluster.nodes[victim].kill()
            async with Consumer(cluster.pm_address, stream_id, from_offset=0) as consumer:
                with trio.fail_after(30):
                    got = 0
                    async for record in consumer.records():
                        assert record.value == bytes(50_000)
                        got += 1
                        if got == 4 * len(sealed):
                            break
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()


async def test_draining_an_unknown_node_is_refused_and_cancel_makes_it_active(
    tmp_path: Path,
) -> None:
    async with pm_cluster(tmp_path, (1, 2)) as cluster:
        pm = cluster.pm_client()
        unknown, known = await pm.drain_data_nodes([9, 2])
        assert unknown.error_code == ErrorCode.DATA_NODE_NOT_FOUND
        assert (known.error_code, known.state) == (ErrorCode.NONE, DataNodeState.DRAINED)
        # nothing new goes on a draining node
        for _ in range(4):
            created = (await pm.create_stream(1)).range
            assert created is not None and _nodes(created) == {1}
        [again] = await pm.drain_data_nodes([2])  # idempotent
        assert again.state == DataNodeState.DRAINED
        [cancelled] = await pm.drain_data_nodes([2], cancel=True)
        assert cancelled.state == DataNodeState.ACTIVE
        assert (await _status(cluster, 2)).state == DataNodeState.ACTIVE


async def test_sbp_nodes_drain_waits_with_progress_and_cluster_status_shows_it(
    tmp_path: Path,
) -> None:
    async with pm_cluster(tmp_path, (1, 2, 3)) as cluster:
        pm = cluster.pm_client()
        created = (await pm.create_stream(1)).range
        assert created is not None
        victim = created.replica_nodes[0].data_node.node_id
        node = cluster.node_client(primary_address(created))
        await node.append_batch(created.stream_id, bytes(build_batch([b"x"], base_timestamp=1)))

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return sbp(cluster.pm_address, *args)

        drained = await trio.to_thread.run_sync(
            cli, "nodes", "drain", str(victim), "--wait", "--progress"
        )
        assert drained.returncode == 0, drained.stderr
        assert f"node {victim}: draining" in drained.stdout
        assert "1 node drained: they can be stopped" in drained.stdout
        assert "range" in drained.stderr and "left" in drained.stderr

        status = await trio.to_thread.run_sync(cli, "--json", "cluster", "status")
        rows = {row["node_id"]: row for row in json.loads(status.stdout)["data_nodes"]}
        assert rows[victim]["state"] == "drained" and rows[victim]["ranges"] == 0
        assert {rows[n]["state"] for n in rows if n != victim} == {"active"}
        assert "drained" in (await trio.to_thread.run_sync(cli, "cluster", "status")).stdout

        unknown = await trio.to_thread.run_sync(cli, "nodes", "drain", "99")
        assert unknown.returncode == 1 and "DATA_NODE_NOT_FOUND" in unknown.stderr
        bad = await trio.to_thread.run_sync(cli, "nodes", "drain", "-1")
        assert bad.returncode == 2
        cancelled = await trio.to_thread.run_sync(cli, "nodes", "drain", "--cancel", str(victim))
        assert cancelled.returncode == 0 and f"node {victim}: active" in cancelled.stdout

        # remove: a node that holds ranges, or is alive, is refused
        holder = next(n for n in rows if rows[n]["ranges"] > 0)
        refused = await trio.to_thread.run_sync(cli, "nodes", "remove", str(holder))
        assert refused.returncode == 1 and "drain it first" in refused.stderr
        alive = await trio.to_thread.run_sync(cli, "nodes", "remove", str(victim))
        assert alive.returncode == 1 and "stop it first" in alive.stderr
        await cluster.nodes[victim].terminate()
        await cluster.wait_alive(set(), {victim})
        removed = await trio.to_thread.run_sync(cli, "nodes", "remove", str(victim))
        assert removed.returncode == 0 and f"node {victim}: removed" in removed.stdout
        statuses = await pm.describe_cluster()
        assert victim not in {s.data_node.node_id for s in statuses}
