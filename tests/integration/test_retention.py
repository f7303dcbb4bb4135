"""Retention on real processes: a data node drops batches older than their
stream's period on its schedule, and soon after UPDATE_STREAMS changes the
period; the PM's first offset follows, and /metrics counts what was freed."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from net.pool import ConnectionPool
from sbp import messages

from ..eventually import eventually
from .conftest import scrape
from .pm_cluster import PMCluster, append_values, pm_cluster, read_stream

pytestmark = pytest.mark.integration


async def wait_first_offset(cluster: PMCluster, stream_id: int, offset: int) -> None:
    pm = cluster.pm_client()
    await eventually(
        lambda: pm.list_stream_ranges(stream_id),
        until=lambda ranges: ranges[0].start_offset == offset,
        timeout=10,
    )


async def test_old_records_go_on_schedule_and_the_pm_follows(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, node_ids=()) as cluster:
        node = await cluster.start_node(
            1, "--retention-interval-ms", "200", "--metrics-listen", "127.0.0.1:0"
        )
        await cluster.wait_alive({1})
        created = await cluster.pm_client().create_stream(1, retention_period_ms=2000)
        assert created.stream is not None and created.range is not None
        stream = created.stream.stream_id
        await append_values(cluster, created.range, [b"old"] * 10)
        await trio.sleep(2.1)
        await append_values(cluster, created.range, [b"new"] * 5)
        # The old batch is past its period now; the new one is not.
        await wait_first_offset(cluster, stream, 10)
        assert await read_stream(cluster, stream) == [b"new"] * 5
        samples = await scrape(node)
        assert samples["sbp_datanode_retention_freed_records_total"] == 10
        assert samples["sbp_datanode_retention_freed_bytes_total"] > 10 * len(b"old")
        assert samples["sbp_datanode_retention_runs_total"] >= 1


async def test_a_changed_period_applies_soon_after_the_update(tmp_path: Path) -> None:
    # The node's own schedule (30 s) is far off: the update's SYNC_RANGES does it.
    async with pm_cluster(tmp_path, node_ids=(1,)) as cluster:
        pm = cluster.pm_client()
        created = await pm.create_stream(1)
        assert created.stream is not None and created.range is not None
        stream = created.stream.stream_id
        await append_values(cluster, created.range, [b"kept until the update"] * 7)
        await trio.sleep(0.3)
        current = await pm.get_stream(stream)
        await pm.update_stream(
            type(current)(
                stream_id=stream,
                replica_nums=current.replica_nums,
                retention_period_ms=100,
                epoch=current.epoch,
            )
        )
        await wait_first_offset(cluster, stream, 7)
        assert await read_stream(cluster, stream) == []


async def test_size_retention_keeps_a_stream_under_its_limit(tmp_path: Path) -> None:
    """A producer writes five times a stream's size limit, over several
    ranges on several nodes: the PM trims the stream to about its limit, the
    data nodes drop what lies below, and the newest records stay readable."""
    limit = 1 << 20
    value = bytes(64 << 10)
    async with ConnectionPool() as pool:
        cluster = PMCluster(tmp_path, pool)
        try:
            await _write_five_times_the_limit(cluster, limit, value)
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()


async def _write_five_times_the_limit(cluster: PMCluster, limit: int, value: bytes) -> None:
    await cluster.start_pm("127.0.0.1:0", "--size-retention-interval-ms", "200")
    await cluster.start_nodes((1, 2))
    pm = cluster.pm_client()
    created = await pm.create_stream(1)
    assert created.stream is not None and created.range is not None
    stream = created.stream.stream_id
    updated = await pm.update_stream(
        messages.Stream(stream_id=stream, replica_nums=1, retention_bytes=limit)
    )
    assert updated.retention_bytes == limit
    rng = created.range
    for batch in range(80):  # 5 MiB, a new range every 16 batches
        await append_values(cluster, rng, [value])
        if batch % 16 == 15:
            rng = (await pm.seal_range(stream, rng.range_index)).ranges[-1]
    ranges = await eventually(
        lambda: pm.list_stream_ranges(stream),
        until=lambda ranges: (80 - ranges[0].start_offset) * len(value) <= limit,
        timeout=20,
    )
    kept = 80 - ranges[0].start_offset
    assert kept * len(value) >= limit - 4 * len(value), kept  # about the limit, not less
    assert len(await read_stream(cluster, stream)) == kept
    # an update that does not name the limit keeps it; -1 removes it
    kept_limit = await pm.update_stream(
        messages.Stream(stream_id=stream, replica_nums=1, retention_period_ms=-1)
    )
    assert kept_limit.retention_bytes == limit
    removed = await pm.update_stream(
        messages.Stream(
            stream_id=stream, replica_nums=1, retention_period_ms=-1, retention_bytes=-1
        )
    )
    assert removed.retention_bytes == 0
