"""Consumer groups against real processes (SPEC §11): a consumer resumes where
its group stopped, the PM reports the lag, a reader starts from a time, and
groups are listed and deleted."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import trio

from client.consumer import Consumer
from client.producer import Producer
from net.pool import ConnectionPool
from sbp import messages
from sbp.constants import MAX_GROUP_COMMIT_ITEMS, MAX_GROUP_METADATA_BYTES
from sbp.enums import ErrorCode
from sbp.errors import GroupNotFoundError

from ..eventually import eventually, eventually_blocking
from .local_cluster import LocalCluster, lines, new_stream, sbp, sbp_json, start_cluster
from .pm_cluster import PMCluster

pytestmark = [pytest.mark.integration, pytest.mark.deadline(90)]


async def _values(consumer: Consumer, count: int) -> list[bytes]:
    values: list[bytes] = []
    with trio.fail_after(20):
        async for record in consumer.records():
            values.append(record.value)
            if len(values) == count:
                break
    return values


async def test_a_group_resumes_where_it_stopped_and_its_lag_is_known(tmp_path: Path) -> None:
    async with ConnectionPool() as pool:
        cluster = PMCluster(tmp_path, pool)
        try:
            await cluster.start_pm("127.0.0.1:0", "--end-offsets-interval-ms", "200")
            await cluster.start_nodes((1, 2))
            pm = cluster.pm_client()
            created = await pm.create_stream(1)
            assert created.stream is not None
            stream_id = created.stream.stream_id
            async with Producer(pm, stream_id, pool=pool) as producer:
                for n in range(50):
                    await producer.send(b"early-%d" % n)
                await producer.flush()
            await pm.seal_range(stream_id, 0)  # "since" lands at the next range's start
            await trio.sleep(0.05)
            since_ms = int(time.time() * 1000)
            await trio.sleep(0.05)
            async with Producer(pm, stream_id, pool=pool) as producer:
                for n in range(50):
                    await producer.send(b"late-%d" % n)
                await producer.flush()

            async with Consumer(pm, stream_id, group="etl", pool=pool) as consumer:
                read = await _values(consumer, 40)
            assert read[0] == b"early-0" and len(read) == 40  # committed 40 on the way out
            async with Consumer(pm, stream_id, group="etl", pool=pool) as consumer:
                assert consumer.committed == 40
                assert (await _values(consumer, 1)) == [b"early-40"]
                assert await consumer.lag() == 59
                await consumer.commit()
            [position] = await eventually(
                lambda: pm.fetch_offsets("etl"),
                until=lambda found: found[0].end_offset == 100,
            )
            assert (position.stream_id, position.offset, position.lag_records) == (
                stream_id,
                41,
                59,
            )
            # a rewind, and a refusal past the end that changes nothing
            rewound = await pm.commit_offset("etl", stream_id, 0, "replay")
            assert rewound.metadata == "replay"
            [past] = await pm.commit_offsets(
                "etl", [messages.GroupOffset(stream_id=stream_id, offset=101)]
            )
            assert past.error_code == ErrorCode.OFFSET_OUT_OF_RANGE
            assert (await pm.fetch_offsets("etl"))[0].offset == 0

            # from a time: the first record appended at or after it
            async with Consumer(pm, stream_id, pool=pool) as consumer:
                assert await consumer.seek_to_time(since_ms) == 50
                assert (await _values(consumer, 1)) == [b"late-0"]
                assert await consumer.seek_to_time(since_ms + 3_600_000) == 100

            [listing] = await pm.list_groups()
            assert (listing.group, listing.stream_ids) == ("etl", (stream_id,))
            [deleted] = await pm.delete_groups(["etl"])
            assert deleted.error_code == ErrorCode.NONE
            with pytest.raises(GroupNotFoundError):
                await pm.fetch_offsets("etl")
            assert await pm.list_groups() == ()
            # deleting a stream deletes every group's position on it
            await pm.commit_offset("other", stream_id, 10)
            await pm.delete_stream(stream_id)
            with pytest.raises(GroupNotFoundError):
                await pm.fetch_offsets("other")
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()


WORKER = """
import sys, time
from client.sync import SyncClient

pm, stream = sys.argv[1], int(sys.argv[2])
with SyncClient(pm) as client:
    with client.consumer(stream, group="worker", auto_commit_interval=0.05) as consumer:
        for record in consumer:
            time.sleep(0.001)  # the work
            print(record.offset, flush=True)
"""


async def test_a_group_consumer_killed_mid_stream_goes_on_from_its_last_commit(
    tmp_path: Path,
) -> None:
    async with ConnectionPool() as pool:
        cluster = PMCluster(tmp_path, pool)
        try:
            await cluster.start_pm()
            await cluster.start_nodes((1,))
            pm = cluster.pm_client()
            created = await pm.create_stream(1)
            assert created.stream is not None
            stream_id = created.stream.stream_id
            count = 3000
            async with Producer(pm, stream_id, pool=pool) as producer:
                await producer.send_many([b"%d" % n for n in range(count)])
                await producer.flush()
            argv = [sys.executable, "-c", WORKER, cluster.pm_address, str(stream_id)]
            first = await trio.lowlevel.open_process(argv, stdout=subprocess.PIPE)
            assert first.stdout is not None
            seen = b""
            with trio.fail_after(30):
                while seen.count(b"\n") < 1000:
                    seen += await first.stdout.receive_some()
            first.send_signal(signal.SIGKILL)
            await first.wait()
            before = [int(line) for line in seen.split(b"\n")[:-1]]
            second = await trio.run_process(argv, capture_stdout=True)
            after = [int(line) for line in second.stdout.split()]
            assert after[-1] == count - 1
            # on from the last commit: some records again, none skipped
            assert after[0] <= before[-1] + 1
            assert set(before) | set(after) == set(range(count))
            [position] = await pm.fetch_offsets("worker")
            assert position.offset == count  # committed on the way out
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()


def _lag_on_metrics(
    address: str, group: str, series: str = "sbp_group_lag_records"
) -> float | None:
    """``sbp_group_lag_records`` (or ``series``) of ``group`` on the PM's /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    for line in text.splitlines():
        if line.startswith(series + "{") and f'group="{group}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _pm_metrics_address(cluster: LocalCluster) -> str:
    """Where the cluster's PM serves /metrics now (its log's last word on it)."""
    log = (cluster.data_dir / "logs" / "pm.log").read_text()
    return log.rsplit("metrics on ", 1)[1].split()[0]


def test_the_lag_in_seconds_is_one_number_however_long_the_pm_has_been_up(
    tmp_path: Path,
) -> None:
    """``sbp_group_lag_seconds`` and ``sbp groups describe`` give the same
    age of the oldest unread record, its own, before and after a PM
    restart (which leaves the PM nothing of what it saw before)."""
    cluster = start_cluster(tmp_path / "var", nodes=1)
    try:
        pm = cluster.pm_address
        stream = str(new_stream(pm))
        appended_at = time.time()
        assert sbp(pm, "append", stream, stdin=lines([f"v{i}" for i in range(100)])).returncode == 0
        time.sleep(3)
        read = sbp(pm, "read", stream, "--group", "lagging", "--count", "10", "--commit")
        assert read.returncode == 0, read.stderr

        def both_agree() -> tuple[float, float] | None:
            metric = _lag_on_metrics(
                _pm_metrics_address(cluster), "lagging", "sbp_group_lag_seconds"
            )
            [described] = sbp_json(pm, "groups", "describe", "lagging")
            if metric is None or described["lag_seconds"] is None:
                return None
            return metric, described["lag_seconds"]

        for _ in range(2):
            metric, described = eventually_blocking(
                both_agree, until=lambda got: got is not None and abs(got[0] - got[1]) < 1.5
            )
            age = time.time() - appended_at
            assert age - 1.5 < described <= age and age - 3 < metric <= age
            # a PM killed and started again by the launcher knows nothing it saw
            [pm_process] = [
                p for p in psutil.Process(cluster.process.pid).children() if "pm" in p.cmdline()
            ]
            pm_process.kill()
            eventually_blocking(
                lambda: sbp(pm, "ping").returncode == 0 and _pm_metrics_address(cluster)
            )
            time.sleep(1)
    finally:
        assert cluster.stop() == 0, cluster.output()


async def test_the_lag_metric_follows_a_producer_ahead_of_a_slow_consumer(
    tmp_path: Path,
) -> None:
    async with ConnectionPool() as pool:
        cluster = PMCluster(tmp_path, pool)
        try:
            pm_process = await cluster.start_pm(
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--end-offsets-interval-ms",
                "100",
            )
            metrics = pm_process.metrics_address
            assert metrics is not None
            await cluster.start_nodes((1,))
            pm = cluster.pm_client()
            created = await pm.create_stream(1)
            assert created.stream is not None
            stream_id = created.stream.stream_id
            async with Consumer(
                pm, stream_id, group="slow", auto_commit_interval=None, pool=pool, tail=True
            ) as consumer:
                async with Producer(pm, stream_id, pool=pool) as producer:
                    await producer.send_many([b"x"] * 500)
                    await producer.flush()
                    assert len(await _values(consumer, 100)) == 100
                    await consumer.commit()
                    await eventually(
                        lambda: trio.to_thread.run_sync(_lag_on_metrics, metrics, "slow"),
                        until=lambda lag: lag == 400,
                    )
                    await producer.send_many([b"y"] * 500)
                    await producer.flush()
                await eventually(
                    lambda: trio.to_thread.run_sync(_lag_on_metrics, metrics, "slow"),
                    until=lambda lag: lag == 900,
                )
                assert len(await _values(consumer, 900)) == 900  # the consumer catches up
                await consumer.commit()
            await eventually(
                lambda: trio.to_thread.run_sync(_lag_on_metrics, metrics, "slow"),
                until=lambda lag: lag == 0,
            )
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()


async def test_a_loop_left_part_way_through_a_batch_goes_on_from_the_next_record(
    tmp_path: Path,
) -> None:
    """What a group commits is what was handed out, so the rest of a batch a
    loop left must come next, whichever way the consumer is read then."""
    async with ConnectionPool() as pool:
        cluster = PMCluster(tmp_path, pool)
        try:
            await cluster.start_pm()
            await cluster.start_nodes((1,))
            pm = cluster.pm_client()
            created = await pm.create_stream(1)
            assert created.stream is not None
            stream_id = created.stream.stream_id
            async with Producer(pm, stream_id, pool=pool) as producer:
                await producer.send_many([b"%d" % n for n in range(100)])  # one batch
                await producer.flush()
            async with Consumer(pm, stream_id, group="parts", pool=pool) as consumer:
                assert len(await _values(consumer, 10)) == 10
                rest = await consumer.next_batch()
                assert rest is not None and rest.offsets.tolist() == list(range(10, 100))
                assert consumer.position == 100
                await consumer.seek(50)
                assert (await _values(consumer, 3)) == [b"50", b"51", b"52"]
                assert (await _values(consumer, 2)) == [b"53", b"54"]
            [position] = await pm.fetch_offsets("parts")
            assert position.offset == 55
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()


async def test_a_group_with_more_positions_than_a_frame_holds_is_fetched_whole(
    tmp_path: Path,
) -> None:
    """5,000 positions with 4 KiB of metadata each take 21 MB, over the
    16 MiB a frame's header holds: FETCH_OFFSETS of the whole group comes
    in several frames, which the client library joins."""
    metadata = "m" * MAX_GROUP_METADATA_BYTES
    async with ConnectionPool() as pool:
        cluster = PMCluster(tmp_path, pool)
        try:
            await cluster.start_pm("127.0.0.1:0")
            await cluster.start_nodes((1,))
            pm = cluster.pm_client()
            stream_ids: list[int] = []
            for _ in range(50):
                created = await pm.create_streams([messages.Stream(replica_nums=1)] * 100)
                stream_ids += [result.stream.stream_id for result in created if result.stream]
            for start in range(0, len(stream_ids), MAX_GROUP_COMMIT_ITEMS):
                chunk = stream_ids[start : start + MAX_GROUP_COMMIT_ITEMS]
                results = await pm.commit_offsets(
                    "wide",
                    [messages.GroupOffset(stream_id=s, offset=0, metadata=metadata) for s in chunk],
                )
                assert {r.error_code for r in results} == {ErrorCode.NONE}
            positions = await pm.fetch_offsets("wide")
            assert sorted(p.stream_id for p in positions) == stream_ids
            assert {(p.offset, p.metadata, p.error_code) for p in positions} == {
                (0, metadata, ErrorCode.NONE)
            }
            [listing] = await pm.list_groups()
            assert sorted(listing.stream_ids) == stream_ids
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()
