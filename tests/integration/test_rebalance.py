"""Rebalancing on real processes (SPEC §12): a fourth data node joins a
loaded three-node cluster; `sbp cluster rebalance --dry-run` shows the plan
that moves ranges to it, and a PM that checks the balance on its own moves
them until the nodes' bytes are within its threshold. The moved ranges'
chunks leave their old nodes, and every record stays readable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import build_batch

from ..eventually import eventually
from .local_cluster import sbp
from .pm_cluster import PMCluster, primary_address, read_stream

pytestmark = [pytest.mark.integration, pytest.mark.deadline(90)]

THRESHOLD = 0.2
VALUE = bytes(50_000)


async def _placement(cluster: PMCluster) -> dict[tuple[int, int], int]:
    """Where the PM places each range of one replica: (stream, range) -> node."""
    pm = cluster.pm_client()
    return {
        (r.stream_id, r.range_index): status.data_node.node_id
        for status in await pm.describe_cluster()
        for r in await pm.list_node_ranges(status.data_node)
    }


async def _bytes_by_node(cluster: PMCluster) -> dict[int, int]:
    """Each live node's bytes, as the ranges the PM places on it are held there."""
    pm = cluster.pm_client()
    held: dict[int, int] = {}
    for status in await pm.describe_cluster():
        ranges = await pm.list_node_ranges(status.data_node)
        keys = [messages.RangeId(r.stream_id, r.range_index) for r in ranges]
        node = cluster.node_client(status.data_node.advertise_addr)
        holdings = await node.range_holdings(keys) if keys else ()
        held[status.data_node.node_id] = sum(h.bytes for h in holdings)
    return held


def _balanced(held: dict[int, int]) -> bool:
    mean = sum(held.values()) / len(held)
    return max(held.values()) - min(held.values()) <= THRESHOLD * mean


async def test_a_new_node_fills_up_until_the_nodes_are_balanced(tmp_path: Path) -> None:
    async with ConnectionPool() as pool:
        cluster = PMCluster(tmp_path, pool)
        try:
            flags = ("--rebalance-threshold", str(THRESHOLD), "--max-move-bytes-per-s", "0")
            await cluster.start_pm("127.0.0.1:0", *flags, "--rebalance-interval-ms", "0")
            await cluster.start_nodes((1, 2, 3))
            pm = cluster.pm_client()
            streams = []
            for _ in range(6):  # two sealed ranges of 400 KB each, spread over the nodes
                created = (await pm.create_stream(1)).range
                assert created is not None
                rng = created
                for _ in range(2):
                    node = cluster.node_client(primary_address(rng))
                    for _ in range(8):
                        batch = bytes(build_batch([VALUE], base_timestamp=1))
                        await node.append_batch(rng.stream_id, batch)
                    rng = (await pm.seal_range(rng.stream_id, rng.range_index)).ranges[-1]
                streams.append(created.stream_id)
            await cluster.start_node(4)
            await cluster.wait_alive({1, 2, 3, 4})
            before = await _bytes_by_node(cluster)
            assert before[4] == 0 and not _balanced(before)
            placed_before = await _placement(cluster)

            planned = await trio.to_thread.run_sync(
                lambda: sbp(cluster.pm_address, "cluster", "rebalance", "--dry-run")
            )
            assert planned.returncode == 0, planned.stderr
            lines = planned.stdout.splitlines()
            assert lines[0].split() == ["stream", "range", "from", "to", "size"]
            assert "4" in {line.split()[3] for line in lines[1:-1]}  # the new node fills
            assert lines[-1].startswith("would move ")
            assert await _bytes_by_node(cluster) == before  # a dry run moves nothing

            # a PM that checks the balance on its own (restarted: nothing was pending)
            address = cluster.pm_address
            await cluster.pm.kill()  # type: ignore[union-attr]
            await cluster.start_pm(address, *flags, "--rebalance-interval-ms", "300")
            after = await eventually(
                lambda: _bytes_by_node(cluster),
                until=_balanced,
                timeout=45,
                what="the nodes balanced",
            )
            assert after[4] > 0
            assert sum(after.values()) == sum(before.values())
            for stream_id in streams:
                assert len(await read_stream(cluster, stream_id)) == 16
            # each moved range's chunks left its old node
            moved = {
                key: old
                for key, old in placed_before.items()
                if (await _placement(cluster)).get(key, old) != old
            }
            assert moved
            for (stream_id, range_index), old in moved.items():
                address = cluster.nodes[old].address
                [holding] = await cluster.node_client(address).range_holdings(
                    [messages.RangeId(stream_id, range_index)]
                )
                assert holding.bytes == 0, (stream_id, range_index, old)

            def settled(run: subprocess.CompletedProcess[str]) -> bool:
                return "balanced: nothing to move" in run.stdout

            await eventually(
                lambda: trio.to_thread.run_sync(
                    lambda: sbp(cluster.pm_address, "cluster", "rebalance", "--dry-run")
                ),
                until=settled,
                timeout=20,
            )
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()


def test_sbp_cluster_rebalance_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "client.cli", "cluster", "rebalance", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0 and "--dry-run" in done.stdout
