"""PMs on etcd as real processes (SPEC §8): three etcd members, two PMs,
two data nodes. One PM leads and the other names it; SIGKILL of the leader
hands the cluster to the other without losing a stream, a record or a data
node; data nodes refuse a deposed term."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import psutil
import pytest
import trio

from client.datanode_client import DataNodeClient
from client.pm_client import PMClient
from client.retry import is_transient
from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import build_batch
from sbp.enums import DataNodeState, ErrorCode
from sbp.errors import ConnectionClosed, EpochFencedError, NotLeaderError, ProtocolError

from ..eventually import eventually, eventually_blocking
from .etcd_cluster import etcd_cluster
from .local_cluster import lines, new_stream, sbp, sbp_json, start_cluster
from .pm_cluster import pm_cluster, primary_address
from .procs import ServerProcess, start_server

pytestmark = pytest.mark.deadline(120)


def alive(nodes: Sequence[messages.DataNodeStatus]) -> int:
    """How many of the data nodes the PM holds alive."""
    return sum(node.alive for node in nodes)


NODE_TIMEOUT_MS = "1500"
LEASE_TTL_MS = "3000"


async def start_pm(
    root: Path,
    name: str,
    endpoints: list[str],
    *extra: str,
    node_timeout_ms: str = NODE_TIMEOUT_MS,
) -> ServerProcess:
    return await start_server(
        "pm",
        [
            *("--listen", "127.0.0.1:0", "--etcd", ",".join(endpoints)),
            *("--lease-ttl-ms", LEASE_TTL_MS, "--node-timeout-ms", node_timeout_ms),
            *extra,
        ],
        root / "logs",
        name=name,
    )


async def only(pm: ServerProcess, pool: ConnectionPool) -> PMClient:
    """A client of this PM alone (NOT_LEADER is raised, not followed)."""
    return PMClient(await pool.get(pm.address), timeout=2)


async def leader_of(pms: list[ServerProcess], pool: ConnectionPool) -> ServerProcess:
    """The PM that answers DESCRIBE_CLUSTER itself (the others say NOT_LEADER)."""
    with trio.fail_after(20):
        while True:
            for pm in pms:
                if not pm.running:
                    continue
                try:
                    await (await only(pm, pool)).describe_cluster()
                    return pm
                except (NotLeaderError, OSError, ConnectionClosed):
                    pass
            await trio.sleep(0.1)


async def test_the_leader_pm_fails_over_and_nothing_is_lost(tmp_path: Path) -> None:
    async with etcd_cluster(tmp_path) as etcd, ConnectionPool() as pool:
        pms = [await start_pm(tmp_path, f"pm-{i}", etcd.endpoints) for i in (1, 2)]
        addresses = ",".join(pm.address for pm in pms)
        nodes = []
        try:
            for node_id in (1, 2):
                nodes.append(
                    await start_server(
                        "datanode",
                        [
                            *("--listen", "127.0.0.1:0", "--node-id", str(node_id)),
                            *("--data-dir", str(tmp_path / f"node-{node_id}"), "--pm", addresses),
                            *("--heartbeat-interval-ms", "200"),
                        ],
                        tmp_path / "logs",
                        name=f"node-{node_id}",
                    )
                )
            leader = await leader_of(pms, pool)
            follower = next(pm for pm in pms if pm is not leader)
            # The follower names the leader.
            with pytest.raises(NotLeaderError) as named:
                await (await only(follower, pool)).create_stream(1)
            assert named.value.leader_addr == leader.address

            # A client given both PMs finds the leader itself.
            pm = PMClient(addresses, pool=pool, timeout=5)
            await eventually(
                pm.describe_cluster, until=lambda st: sum(s.alive for s in st) >= 2, timeout=20
            )
            created = await pm.create_stream(2)
            assert created.range is not None and created.stream is not None
            stream_id = created.stream.stream_id
            node = DataNodeClient(primary_address(created.range), pool=pool, timeout=5)
            await node.append_batch(stream_id, bytes(build_batch([b"a", b"b"], 1)))
            # a consumer group's position (SPEC §11), kept in etcd
            await pm.commit_offset("etl", stream_id, 1, "after a")

            leader.process.send_signal(signal.SIGKILL)
            killed_at = trio.current_time()
            await leader.process.wait()
            # The client goes on by itself: its next call waits out the
            # election and lands on the new leader.
            after = await pm.create_stream(1, timeout=10)
            failover_s = trio.current_time() - killed_at
            assert after.stream is not None
            assert failover_s < 2 * int(LEASE_TTL_MS) / 1000, failover_s
            new_leader = await leader_of(pms, pool)
            assert new_leader is follower
            # The stream, its range and both data nodes are there; nothing was
            # sealed because of the failover.
            (rng,) = await pm.list_stream_ranges(stream_id)
            assert rng.is_open
            [position] = await pm.fetch_offsets("etl")
            assert (position.stream_id, position.offset, position.metadata) == (
                stream_id,
                1,
                "after a",
            )
            # the data nodes heartbeat to the new leader: alive past a node timeout
            await trio.sleep(2 * int(NODE_TIMEOUT_MS) / 1000)
            statuses = await pm.describe_cluster()
            assert sorted(s.data_node.node_id for s in statuses if s.alive) == [1, 2]
            assert after.stream.stream_id == stream_id + 1
            # the CLI, given both PMs, finds the leader and says which it is
            status = subprocess.run(
                [sys.executable, "-m", "client.cli", "--pm", addresses, "cluster", "status"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert status.returncode == 0, status.stderr
            assert f"PM leader {follower.address} (of {addresses})" in status.stdout
            # A seal in the new term reaches the data nodes (it carries the term).
            sealed = await pm.seal_range(stream_id, 0)
            assert [r.end_offset for r in sealed.ranges][:1] == [2]
            # The old term is fenced on the data nodes.
            with pytest.raises(EpochFencedError):
                await node.seal_range(stream_id, 1, pm_term=1)

            # The old leader comes back and follows.
            pms[pms.index(leader)] = restarted = await start_pm(
                tmp_path, "pm-restarted", etcd.endpoints
            )
            with trio.fail_after(10):
                while True:
                    try:
                        await (await only(restarted, pool)).describe_cluster()
                    except NotLeaderError as error:
                        if error.leader_addr == new_leader.address:
                            break
                    await trio.sleep(0.1)

            # A drain (SPEC §12) is metadata: the next leader goes on with it.
            [draining] = await pm.drain_data_nodes([2])
            assert draining.state == DataNodeState.DRAINING  # it holds a range
            new_leader.process.send_signal(signal.SIGKILL)
            await new_leader.process.wait()
            pm = PMClient(",".join(p.address for p in pms), pool=pool, timeout=10)
            statuses = await pm.describe_cluster()
            assert {s.data_node.node_id: s.state for s in statuses}[2] == DataNodeState.DRAINING
            assert await leader_of(pms, pool) is restarted
            placed = await pm.create_stream(1)  # nothing new on a draining node
            assert placed.range is not None
            assert {r.data_node.node_id for r in placed.range.replica_nodes} == {1}
            [active] = await pm.drain_data_nodes([2], cancel=True)
            assert active.state == DataNodeState.ACTIVE
        finally:
            with trio.CancelScope(shield=True):
                for server in (*nodes, *pms):
                    await server.kill()


async def test_pms_answer_promptly_without_an_etcd_majority_and_recover(tmp_path: Path) -> None:
    async with etcd_cluster(tmp_path) as etcd, ConnectionPool() as pool:
        pm_process = await start_pm(tmp_path, "pm", etcd.endpoints)
        node = await start_server(
            "datanode",
            [
                *("--listen", "127.0.0.1:0", "--node-id", "1"),
                *("--data-dir", str(tmp_path / "node-1"), "--pm", pm_process.address),
                *("--heartbeat-interval-ms", "200"),
            ],
            tmp_path / "logs",
            name="node-1",
        )
        try:
            pm = PMClient(pm_process.address, pool=pool, timeout=5)
            await leader_of([pm_process], pool)
            await eventually(
                pm.describe_cluster, until=lambda st: any(s.alive for s in st), timeout=20
            )
            assert (await pm.create_stream(1)).stream is not None
            first, second, _third = etcd.members
            await etcd.kill(first)
            assert (await pm.create_stream(1)).stream is not None  # one member lost: nothing seen
            await etcd.kill(second)
            started = trio.current_time()
            # a retriable answer, promptly: the write timed out in etcd, or the
            # PM stepped down (its lease could not be renewed)
            with pytest.raises(ProtocolError) as refused:
                await pm.create_stream(1)
            assert refused.value.code in (ErrorCode.TIMEOUT, ErrorCode.NOT_LEADER), refused.value
            assert is_transient(refused.value)
            assert trio.current_time() - started < 6.0
            assert pm_process.running
            await etcd.start(first, state="existing")
            await etcd.start(second, state="existing")
            await leader_of([pm_process], pool)
            created = await pm.create_stream(1)
            # ids are never handed out twice (a write whose answer was lost may
            # have taken one)
            assert created.stream is not None and created.stream.stream_id >= 3
        finally:
            with trio.CancelScope(shield=True):
                await node.kill()
                await pm_process.kill()


async def test_a_leader_stopped_past_its_lease_writes_nothing_when_it_resumes(
    tmp_path: Path,
) -> None:
    async with etcd_cluster(tmp_path) as etcd, ConnectionPool() as pool:
        # A long node timeout: the stopped PM still holds the data node alive
        # when it resumes, and so goes as far as writing the new stream.
        pms = [
            await start_pm(tmp_path, f"pm-{i}", etcd.endpoints, node_timeout_ms="60000")
            for i in (1, 2)
        ]
        node = await start_server(
            "datanode",
            [
                *("--listen", "127.0.0.1:0", "--node-id", "1"),
                *("--data-dir", str(tmp_path / "node-1")),
                *("--pm", ",".join(pm.address for pm in pms), "--heartbeat-interval-ms", "200"),
            ],
            tmp_path / "logs",
            name="node-1",
        )
        try:
            leader = await leader_of(pms, pool)
            follower = next(pm for pm in pms if pm is not leader)
            stale = await only(leader, pool)  # connected while it leads
            await eventually(
                stale.describe_cluster, until=lambda st: any(s.alive for s in st), timeout=20
            )
            leader.process.send_signal(signal.SIGSTOP)
            outcome: list[BaseException | None] = []
            try:
                assert await leader_of([follower], pool) is follower
                # A request reaches the stopped PM; it resumes still believing
                # it leads, for a moment.
                async with trio.open_nursery() as nursery:

                    async def create_on_stale() -> None:
                        try:
                            await stale.create_stream(1, timeout=10)
                            outcome.append(None)
                        except ProtocolError as error:
                            outcome.append(error)

                    nursery.start_soon(create_on_stale)
                    await trio.sleep(0.3)
                    leader.process.send_signal(signal.SIGCONT)
            finally:
                leader.process.send_signal(signal.SIGCONT)
            assert len(outcome) == 1 and isinstance(outcome[0], NotLeaderError), outcome
            # nothing it tried to write landed
            assert await (await only(follower, pool)).get_streams_page() == ()
            # and it comes to name the leader
            with trio.fail_after(10):
                while True:
                    with pytest.raises(NotLeaderError) as named:
                        await stale.describe_cluster()
                    if named.value.leader_addr == follower.address:
                        break
                    await trio.sleep(0.1)
        finally:
            with trio.CancelScope(shield=True):
                for server in (node, *pms):
                    await server.kill()


def test_sbp_cluster_ha_survives_the_loss_of_its_leader_pm(tmp_path: Path) -> None:
    """``sbp-cluster --ha``: three etcd members, three PMs and the data nodes;
    the README's round trip goes on through SIGKILL of the leading PM."""
    cluster = start_cluster(tmp_path / "var", nodes=2, extra=("--ha",))
    try:
        pms = cluster.pm_address
        assert pms.count(",") == 2
        assert new_stream(pms, "--replicas", "2") == 1
        assert sbp(pms, "append", "1", stdin=lines(["a", "b"])).returncode == 0
        leader = sbp_json(pms, "cluster", "status")["pm_leader"]
        port = int(leader.rpartition(":")[2])
        (process,) = [
            p
            for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"]
            and p.info["cmdline"][1:3] == ["-m", "pm"]
            and any(c.laddr.port == port for c in p.net_connections(kind="tcp"))
        ]
        process.send_signal(signal.SIGKILL)
        assert new_stream(pms) == 2  # waits out the election
        # (the launcher starts the killed PM again on its address: it may lead again)
        assert sbp_json(pms, "cluster", "status")["pm_leader"] in pms.split(",")
        assert sbp(pms, "read", "1").stdout.split() == ["a", "b"]
        eventually_blocking(lambda: "pm-" in cluster.output() and "is back on" in cluster.output())
    finally:
        assert cluster.stop() == 0, cluster.output()


async def test_an_lmdb_pms_metadata_moves_to_etcd(tmp_path: Path) -> None:
    """``sbp-pm migrate``: the streams, ranges, nodes and next id of an LMDB
    PM, copied into etcd; a PM there goes on where the old one stopped."""
    async with pm_cluster(tmp_path / "lmdb", (1,)) as old:
        pm = old.pm_client()
        for _ in range(3):
            await pm.create_stream(1)
        await pm.seal_range(2, 0)
        before = {s: await pm.list_stream_ranges(s) for s in (1, 2, 3)}
        assert await pm.init_producer() == (1, 0)
        assert await pm.init_producer("billing", 4) == (2, 4)
        assert old.pm is not None and await old.pm.terminate() == 0
    lmdb_dir = tmp_path / "lmdb" / "pm"
    async with etcd_cluster(tmp_path) as etcd, ConnectionPool() as pool:
        endpoints = ",".join(etcd.endpoints)

        def migrate() -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "pm", "migrate", "--from-data-dir", str(lmdb_dir),
                 "--etcd", endpoints],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip

        moved = await trio.to_thread.run_sync(migrate)
        assert moved.returncode == 0, moved.stderr
        assert "copied 3 streams, 4 ranges and 1 data nodes" in moved.stdout
        again = await trio.to_thread.run_sync(migrate)
        assert again.returncode == 2 and "already holds" in again.stderr
        assert len(again.stderr.strip().splitlines()) == 1

        new = await start_pm(tmp_path, "pm-etcd", etcd.endpoints)
        try:
            await leader_of([new], pool)
            pm = PMClient(new.address, pool=pool, timeout=5)
            for stream_id, ranges in before.items():
                assert await pm.list_stream_ranges(stream_id) == ranges
            assert [s.stream_id for s in await pm.get_streams_page()] == [1, 2, 3]
            statuses = await pm.describe_cluster()
            assert [s.data_node.node_id for s in statuses] == [1]
            # producers keep their ids and epochs; new ids go on above the old
            assert await pm.init_producer("billing", -1) == (2, 5)
            assert await pm.init_producer() == (3, 0)
        finally:
            with trio.CancelScope(shield=True):
                await new.kill()


async def test_a_data_node_remembers_the_pm_term_through_sigkill(tmp_path: Path) -> None:
    args = [
        *("--listen", "127.0.0.1:0", "--node-id", "1", "--data-dir", str(tmp_path / "node")),
    ]
    node = await start_server("datanode", args, tmp_path / "logs", name="node")
    try:
        async with DataNodeClient(node.address, timeout=5) as client:
            (synced,) = await client.sync_ranges([messages.StreamRanges(stream_id=1)], pm_term=7)
            assert synced.error_code == ErrorCode.NONE
        await node.kill()  # SIGKILL: the term was recorded before the answer
        node = await start_server("datanode", args, tmp_path / "logs", name="node-again")
        async with DataNodeClient(node.address, timeout=5) as client:
            (stale,) = await client.seal_ranges(
                [messages.RangeId(stream_id=1, range_index=0)], pm_term=3
            )
            assert stale.error_code == ErrorCode.EPOCH_FENCED
            assert "older than term 7" in stale.error_message
            (current,) = await client.sync_ranges([messages.StreamRanges(stream_id=1)], pm_term=7)
            assert current.error_code == ErrorCode.NONE
    finally:
        with trio.CancelScope(shield=True):
            await node.kill()


async def test_a_failover_during_a_rebalance_keeps_every_members_epoch(tmp_path: Path) -> None:
    """Members (SPEC §15) on PMs on etcd: a second member joins, the first
    still holds the streams that move to it, the leader is killed; the new
    leader answers both with the epochs they had, and the streams move on
    once let go of, never held by two."""
    async with etcd_cluster(tmp_path) as etcd, ConnectionPool() as pool:
        pms = [await start_pm(tmp_path, f"pm-{i}", etcd.endpoints) for i in (1, 2)]
        addresses = ",".join(p.address for p in pms)
        pm = PMClient(addresses, pool=pool, timeout=10)
        node = await start_server(
            "datanode",
            [
                *("--listen", "127.0.0.1:0", "--node-id", "1", "--pm", addresses),
                *("--data-dir", str(tmp_path / "node-1"), "--heartbeat-interval-ms", "200"),
            ],
            tmp_path / "logs",
            name="node-1",
        )
        await eventually(pm.describe_cluster, until=lambda st: alive(st) == 1, timeout=20)
        created = await pm.create_streams([messages.Stream(replica_nums=1)] * 4)
        assert all(c.error_code == ErrorCode.NONE for c in created), created
        streams = [c.stream.stream_id for c in created if c.stream is not None]
        a = await pm.group_heartbeat("g", "a", 0, streams=streams, session_timeout_ms=20_000)
        assert sorted(a.assigned) == streams
        b = await pm.group_heartbeat("g", "b", 0, streams=streams, session_timeout_ms=20_000)
        assert b.assigned == ()  # a still holds all four
        a = await pm.group_heartbeat("g", "a", a.member_epoch, owned=streams)
        assert len(a.assigned) == 2  # two are being revoked from a: mid-rebalance
        epochs = {"a": a.member_epoch, "b": b.member_epoch}

        leader = await leader_of(pms, pool)
        leader.process.send_signal(signal.SIGKILL)
        await leader.process.wait()

        # the new leader knows both members at their epochs; a still holds
        # what it has not let go of, so b gets nothing yet
        b_again = await pm.group_heartbeat("g", "b", epochs["b"])
        assert b_again.member_epoch == epochs["b"] and b_again.assigned == ()
        kept = a.assigned
        a_again = await pm.group_heartbeat("g", "a", epochs["a"], owned=kept)
        assert a_again.member_epoch == epochs["a"] and a_again.assigned == kept
        b_last = await pm.group_heartbeat("g", "b", epochs["b"])
        assert sorted(b_last.assigned) == sorted(set(streams) - set(kept))
        held = {d.member_id: set(d.streams) for d in await pm.describe_members("g")}
        assert not held["a"] & held["b"] and held["a"] | held["b"] == set(streams)
        await node.kill()
        for other in pms:
            await other.kill()
