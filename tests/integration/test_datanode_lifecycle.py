"""Start, stop, crash and restart a data node process; its link to a PM."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator

import pytest
import trio

from client.children import ClusterError
from net.connection import Connection
from net.server import Server
from sbp import messages
from sbp.batches import build_batch, decode_batches
from sbp.enums import ClientRole, ErrorCode, Opcode
from sbp.errors import ConnectionClosed, ShuttingDownError

from ..eventually import eventually
from ..fake_pm import FakePM
from .conftest import (
    DataNodes,
    append_request,
    connect,
    fetch_request,
    hosted_range,
    scrape,
    sync_ranges,
)
from .procs import ServerProcess

pytestmark = pytest.mark.integration


def numbered_batch(number: int) -> bytearray:
    return build_batch(
        [f"{number}:{i}".encode() * 20 for i in range(4)], base_timestamp=1_700_000_000_000
    )


async def test_sigterm_drains_and_exits_zero(datanodes: DataNodes) -> None:
    node = await datanodes.start(1)
    async with connect(node.address) as connection:
        await sync_ranges(connection, hosted_range(1, node))
        answered: list[messages.FetchResponse] = []

        async def long_poll() -> None:
            response = await connection.request(
                Opcode.FETCH, fetch_request((1, 0), max_wait_ms=60_000), timeout=30
            )
            answered.append(response.header)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_poll)
            await trio.sleep(0.2)
            node.process.send_signal(signal.SIGTERM)
            with trio.fail_after(15):
                code = await node.process.wait()
        # The waiting FETCH was answered (empty, NONE) rather than cut off.
        (result,) = answered[0].fetch_responses
        assert (result.error_code, result.batch_length) == (ErrorCode.NONE, 0)
        assert connection.goaway_received
        with pytest.raises((ShuttingDownError, ConnectionClosed)):
            await connection.ping(timeout=5)
    assert code == 0
    assert "draining" in node.log()
    assert "Traceback" not in node.log()


async def test_sigint_is_a_graceful_stop_too(datanodes: DataNodes) -> None:
    node = await datanodes.start(1)
    assert await node.stop(signal.SIGINT) == 0


@pytest.mark.deadline(60)
async def test_sigkill_during_appends_loses_nothing_acknowledged(datanodes: DataNodes) -> None:
    node = await datanodes.start(1)
    acknowledged: dict[int, tuple[int, bytes]] = {}  # base offset -> (number, batch)
    async with connect(node.address) as admin:
        await sync_ranges(admin, hosted_range(1, node))

    async def appender(first: int, connection: Connection) -> None:
        number = first
        while True:
            batch = numbered_batch(number)
            header, payload = append_request([(1, batch)])
            try:
                response = await connection.request(Opcode.APPEND, header, payload, timeout=10)
            except ConnectionClosed:
                return
            (result,) = response.header.append_responses
            assert result.error_code == ErrorCode.NONE
            acknowledged[result.base_offset] = (number, bytes(batch))
            number += 1000

    async with trio.open_nursery() as nursery:
        for first in range(8):
            connection = await nursery.start(_open, node.address)
            nursery.start_soon(appender, first, connection)
        await eventually(lambda: len(acknowledged) >= 200, timeout=20)
        await node.kill()
        nursery.cancel_scope.cancel()
    assert node.process.returncode == -signal.SIGKILL

    restarted = await datanodes.start(1)
    async with connect(restarted.address) as connection:
        end = max(acknowledged) + 4
        stored: dict[int, bytes] = {}
        offset = 0
        while offset < end:
            response = await connection.request(
                Opcode.FETCH, fetch_request((1, offset)), timeout=10
            )
            (result,) = response.header.fetch_responses
            assert result.error_code == ErrorCode.NONE
            payload = bytes(response.payload)
            records = decode_batches(payload)
            assert len(records) > 0
            position = 0
            while position < len(payload):
                size = 12 + int.from_bytes(payload[position + 8 : position + 12], "big")
                base = int.from_bytes(payload[position : position + 8], "big", signed=True)
                stored[base] = payload[position : position + size]
                position += size
            offset = int(records.offsets[-1]) + 1
        for base_offset, (_number, batch) in acknowledged.items():
            # the same bytes at the same offset (base_offset stamped by the node)
            assert stored[base_offset][8:] == batch[8:]
        # Appends go on densely after the last durable batch.
        header, payload = append_request([(1, numbered_batch(-1))])
        response = await connection.request(Opcode.APPEND, header, payload, timeout=10)
        (result,) = response.header.append_responses
        assert result.base_offset == max(stored) + 4


async def _open(address: str, task_status: trio.TaskStatus[Connection]) -> None:
    async with connect(address) as connection:
        task_status.started(connection)
        await trio.sleep_forever()


async def test_restart_recovers_ranges_and_offsets(datanodes: DataNodes) -> None:
    node = await datanodes.start(1)
    async with connect(node.address) as connection:
        await sync_ranges(connection, hosted_range(1, node), hosted_range(2, node, start=50))
        header, payload = append_request([(1, numbered_batch(0)), (2, numbered_batch(1))])
        await connection.request(Opcode.APPEND, header, payload, timeout=10)
        await connection.request(
            Opcode.SEAL_RANGES,
            messages.SealRangesRequest(ranges=(messages.RangeId(stream_id=1, range_index=0),)),
            timeout=10,
        )
    assert await node.terminate() == 0

    restarted = await datanodes.start(1)
    async with connect(restarted.address) as connection:
        response = await connection.request(
            Opcode.DESCRIBE_RANGES,
            messages.DescribeRangesRequest(
                ranges=(
                    messages.RangeId(stream_id=1, range_index=0),
                    messages.RangeId(stream_id=2, range_index=0),
                )
            ),
            timeout=10,
        )
        first, second = (r.range for r in response.header.describe_responses)
        assert first is not None and second is not None
        assert (first.end_offset, first.next_offset) == (4, 4)
        assert (second.start_offset, second.end_offset, second.next_offset) == (50, -1, 54)


async def test_data_directory_in_use_is_refused(datanodes: DataNodes) -> None:
    await datanodes.start(1)
    with pytest.raises(ClusterError, match="in use by another data node"):
        await datanodes.start(1)


async def test_metrics_endpoint(datanodes: DataNodes) -> None:
    node = await datanodes.start(1, "--metrics-listen", "127.0.0.1:0")
    async with connect(node.address) as connection:
        await sync_ranges(connection, hosted_range(1, node))
        batch = numbered_batch(0)
        header, payload = append_request([(1, batch)])
        await connection.request(Opcode.APPEND, header, payload, timeout=10)
        await connection.request(Opcode.FETCH, fetch_request((1, 0)), timeout=10)
    samples = await scrape(node)
    assert samples["sbp_datanode_appended_records_total"] == 4
    assert samples["sbp_datanode_appended_bytes_total"] == len(batch)
    assert samples["sbp_datanode_fetched_records_total"] == 4
    assert samples["sbp_datanode_fetched_bytes_total"] == len(batch)
    assert samples['sbp_request_duration_seconds_count{opcode="APPEND"}'] == 1
    assert samples['sbp_request_duration_seconds_count{opcode="FETCH"}'] == 1
    assert samples['sbp_requests_total{code="NONE",opcode="APPEND"}'] == 1
    assert samples["sbp_datanode_group_commit_appends_count"] >= 2
    assert samples['sbp_datanode_ranges{state="open"}'] == 1
    assert samples["process_resident_memory_bytes"] > 0
    assert samples["sbp_datanode_group_commit_duration_seconds_count"] >= 2  # sync and append
    assert samples["sbp_datanode_storage_map_size_bytes"] == 8 << 30
    assert samples["sbp_datanode_storage_used_bytes"] > 0
    assert samples["sbp_datanode_storage_streams_freeing"] == 0
    assert samples["sbp_datanode_waiting_fetches"] == 0


# -- the PM link, against a stand-in PM served by this test ------------------------


@pytest.fixture
async def fake_pm() -> AsyncIterator[tuple[FakePM, str, trio.Nursery]]:
    pm = FakePM(known_ranges_only=True)
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(Server(pm.dispatcher()).serve, "127.0.0.1", 0)
        yield pm, f"{host}:{port}", nursery
        nursery.cancel_scope.cancel()


async def start_with_pm(datanodes: DataNodes, pm_address: str) -> ServerProcess:
    return await datanodes.start(
        7,
        "--pm",
        pm_address,
        "--heartbeat-interval-ms",
        "100",
        "--metrics-interval-ms",
        "200",
        "--advertise",
        "node-seven.example:9000",
    )


async def test_registers_heartbeats_and_reports(
    datanodes: DataNodes, fake_pm: tuple[FakePM, str, trio.Nursery]
) -> None:
    pm, address, _ = fake_pm
    await start_with_pm(datanodes, address)
    await eventually(lambda: len(pm.heartbeats) >= 3 and len(pm.reports) >= 2)
    identity = messages.DataNode(node_id=7, advertise_addr="node-seven.example:9000")
    heartbeat = pm.heartbeats[0]
    assert (heartbeat.client_role, heartbeat.data_node) == (ClientRole.DATA_NODE, identity)
    assert heartbeat.client_id == "datanode-7"
    report = pm.reports[-1]
    assert report.data_node == identity
    assert report.disk_free_space > 0
    assert report.memory_used > 10 << 20  # a Python process with numpy and LMDB loaded
    assert report.range_active_cnt == 0


async def test_unknown_stream_is_looked_up_on_the_pm(
    datanodes: DataNodes, fake_pm: tuple[FakePM, str, trio.Nursery]
) -> None:
    pm, address, _ = fake_pm
    node = await start_with_pm(datanodes, address)
    pm.ranges[42] = [hosted_range(42, node, node_id=7)]
    async with connect(node.address) as connection:
        header, payload = append_request([(42, numbered_batch(0)), (43, numbered_batch(1))])
        response = await connection.request(Opcode.APPEND, header, payload, timeout=10)
        codes = [(r.stream_id, r.error_code) for r in response.header.append_responses]
        assert codes == [(42, ErrorCode.NONE), (43, ErrorCode.RANGE_NOT_FOUND)]
        assert sorted(set(pm.lookups)) == [42, 43]
    await eventually(lambda: bool(pm.reports) and pm.reports[-1].range_active_cnt == 1)
    assert pm.reports[-1].disk_in_rate >= 0


async def test_survives_pm_absence_and_restart(datanodes: DataNodes) -> None:
    pm = FakePM(known_ranges_only=True)
    async with trio.open_nursery() as outer:
        # Reserve a port for the PM, then start the node while nothing listens there.
        host, port = await outer.start(Server(FakePM().dispatcher()).serve, "127.0.0.1", 0)
        outer.cancel_scope.cancel()
    node = await start_with_pm(datanodes, f"{host}:{port}")
    async with connect(node.address) as connection:
        assert await connection.ping(timeout=5) >= 0  # serving without a PM
    for _ in range(2):  # the PM comes up, goes away, and comes back
        async with trio.open_nursery() as nursery:
            await nursery.start(Server(pm.dispatcher()).serve, host, port)
            seen = len(pm.heartbeats)

            def two_more(seen: int = seen) -> bool:
                return len(pm.heartbeats) >= seen + 2

            await eventually(two_more, timeout=20)
            nursery.cancel_scope.cancel()
        await trio.sleep(0.3)
    assert node.running
