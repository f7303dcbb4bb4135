"""Streams as Iceberg tables (SPEC §16) on real processes: ``sbp-tables``
keeps a tabled stream in ``sbp.stream_<id>`` exactly once through SIGKILLs,
with two workers of which one is killed, and an idle stream stalls
nothing; pyiceberg reads what the stream holds."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Awaitable
from pathlib import Path

import psutil
import pytest
import trio

from client import Producer
from net.address import free_ports
from sbp import messages
from sbp.enums import ErrorCode
from tables.catalog import END_OFFSET, end_offset, load_table, open_catalog, table_name

from ..eventually import eventually, eventually_blocking
from .local_cluster import all_gone, lines, sbp_json, start_cluster
from .pm_cluster import PMCluster, pm_cluster
from .procs import ServerProcess, _child_env, start_server

pytestmark = [pytest.mark.integration, pytest.mark.deadline(240)]

INTERVAL_MS = 200


async def tabled_stream(cluster: PMCluster, interval_ms: int = INTERVAL_MS) -> int:
    [created] = await cluster.pm_client().create_streams(
        [messages.Stream(replica_nums=1, table_interval_ms=interval_ms)]
    )
    assert created.error_code == ErrorCode.NONE, created.error_message
    assert created.stream is not None
    return created.stream.stream_id


async def start_tables(cluster: PMCluster, root: Path, name: str) -> ServerProcess:
    return await start_server(
        "tables",
        [
            "--pm",
            cluster.pm_address,
            "--catalog",
            f"sqlite:///{root}/catalog.db",
            "--warehouse",
            str(root / "warehouse"),
            "--member-id",
            name,
            "--session-timeout-ms",
            "2000",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        root / "logs",
        name=name,
    )


def table_rows(root: Path, stream_id: int) -> tuple[list[int], int | None]:
    """The offsets the table holds (pyiceberg's scan), and its end offset."""
    catalog = open_catalog(f"sqlite:///{root}/catalog.db", str(root / "warehouse"))
    table = load_table(catalog, stream_id)
    if table is None:
        return [], None
    offsets = table.scan(selected_fields=("offset",)).to_arrow().column("offset").to_pylist()
    return sorted(offsets), end_offset(table)


async def test_a_tabled_stream_is_in_its_table_once_through_kills(tmp_path: Path) -> None:
    """Records with keys are appended while sbp-tables is SIGKILLed and
    started again 10 times: the table ends with every record once, and an
    idle tabled stream beside it stalls nothing."""
    async with pm_cluster(tmp_path, (1,)) as cluster:
        stream = await tabled_stream(cluster)
        idle = await tabled_stream(cluster)
        pm = cluster.pm_client()
        total = 50_000
        rng = random.Random(62)

        async def produce() -> None:
            async with Producer(pm, stream, pool=cluster.pool, linger=0.01) as producer:
                for start in range(0, total, 500):
                    await producer.send_many(
                        [b"v%d" % i for i in range(start, start + 500)],
                        keys=[b"k%d" % (i % 97) for i in range(start, start + 500)],
                    )
                    await trio.sleep(0.1)  # appends go on through the kills

        tables = await start_tables(cluster, tmp_path, "tables-1")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            for _ in range(10):
                await trio.sleep(rng.uniform(0.1, 0.6))
                await tables.kill()
                tables = await start_tables(cluster, tmp_path, "tables-1")
        offsets, _end = await eventually(
            lambda: trio.to_thread.run_sync(table_rows, tmp_path, stream),
            until=lambda found: found[1] == total,
            timeout=60,
            what="the table's end at the stream's end",
        )
        assert offsets == list(range(total))
        assert (await trio.to_thread.run_sync(table_rows, tmp_path, idle))[1] is None
        await tables.stop(signal.SIGTERM)


async def test_two_workers_share_the_tables_and_one_is_killed(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, (1,)) as cluster:
        streams = [await tabled_stream(cluster) for _ in range(4)]
        pm = cluster.pm_client()
        workers = [await start_tables(cluster, tmp_path, f"w{i}") for i in range(2)]
        per_stream = 3000

        async def produce(stream_id: int) -> None:
            async with Producer(pm, stream_id, pool=cluster.pool, linger=0.01) as producer:
                for _start in range(0, per_stream, 100):
                    await producer.send_many([b"x"] * 100, keys=[b"k"] * 100)
                    await trio.sleep(0.02)

        async with trio.open_nursery() as nursery:
            for stream_id in streams:
                nursery.start_soon(produce, stream_id)
            await trio.sleep(1.0)
            await workers[0].kill()
        for stream_id in streams:
            offsets, _end = await eventually(
                lambda s=stream_id: trio.to_thread.run_sync(table_rows, tmp_path, s),
                until=lambda found: found[1] == per_stream,
                timeout=60,
                what=f"stream {stream_id}'s table complete",
            )
            assert offsets == list(range(per_stream))
        await workers[1].stop(signal.SIGTERM)
        catalog = open_catalog(f"sqlite:///{tmp_path}/catalog.db", str(tmp_path / "warehouse"))
        snapshot = catalog.load_table(table_name(streams[0])).current_snapshot()
        assert snapshot is not None and snapshot.summary is not None
        assert snapshot.summary.additional_properties[END_OFFSET] == str(per_stream)


async def test_sbp_tables_lists_and_describes_the_tables(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, (1,)) as cluster:

        def sbp(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "client.cli", "--pm", cluster.pm_address, *args],
                capture_output=True,
                text=True,
                timeout=60,
                env=_child_env(),
                check=False,
            )

        refused = await trio.to_thread.run_sync(
            lambda: sbp("streams", "create", "--table-interval", "50")
        )
        assert refused.returncode == 2 and "100ms" in refused.stderr
        created = await trio.to_thread.run_sync(
            lambda: sbp("--json", "streams", "create", "--table-interval", "200ms")
        )
        assert created.returncode == 0, created.stderr
        stream = json.loads(created.stdout)[0]["stream"]["stream_id"]
        async with Producer(cluster.pm_client(), stream, pool=cluster.pool) as producer:
            await producer.send_many([b"r%d" % i for i in range(50)])
        tables = await start_tables(cluster, tmp_path, "tables")
        await eventually(
            lambda: trio.to_thread.run_sync(table_rows, tmp_path, stream),
            until=lambda found: found[1] == 50,
            timeout=30,
        )
        where = (
            "--catalog",
            f"sqlite:///{tmp_path}/catalog.db",
            "--warehouse",
            str(tmp_path / "warehouse"),
        )
        listed = await trio.to_thread.run_sync(lambda: sbp("--json", "tables", "list", *where))
        assert listed.returncode == 0, listed.stderr
        [row] = json.loads(listed.stdout)
        assert (row["stream_id"], row["end_offset"], row["lag_records"], row["rows"]) == (
            stream,
            50,
            0,
            50,
        )
        described = await trio.to_thread.run_sync(
            lambda: sbp("tables", "describe", str(stream), *where)
        )
        assert described.returncode == 0 and f"sbp.stream_{stream}" in described.stdout
        await tables.stop(signal.SIGTERM)


def test_sbp_cluster_runs_sbp_tables_with_a_catalog_under_its_directory(tmp_path: Path) -> None:
    data_dir = tmp_path / "var"
    cluster = start_cluster(data_dir, nodes=1, tables=True)
    try:
        created = sbp_json(cluster.pm_address, "streams", "create", "--table-interval", "100ms")
        stream = created[0]["stream"]["stream_id"]
        sbp_json(
            cluster.pm_address, "append", str(stream), stdin=lines([f"r{i}" for i in range(10)])
        )
        eventually_blocking(
            lambda: table_rows(data_dir / "tables", stream)[1],
            until=lambda end: end == 10,
            timeout=30,
            what="sbp-tables, started by sbp-cluster, to commit the stream",
        )
        children = psutil.Process(cluster.process.pid).children()
        assert len(children) == 3  # the PM, the node and sbp-tables
    finally:
        assert cluster.stop() == 0, cluster.output()
    assert all_gone(children)  # stopping the cluster stopped sbp-tables too


async def test_a_catalog_out_of_reach_is_said_at_start_and_waited_for_later(
    tmp_path: Path,
) -> None:
    """A catalog that cannot be reached: at start, one line and exit 1; while
    running (its SQLite file locked by another process), the commits fail,
    are tried again, and the table ends with every record once."""
    [port] = free_ports(1)
    refused = await trio.run_process(
        [sys.executable, "-m", "tables", "--pm", "127.0.0.1:9", "--catalog",
         f"http://127.0.0.1:{port}", "--warehouse", str(tmp_path / "w")],
        capture_stdout=True, capture_stderr=True, check=False, env=_child_env(),
    )  # fmt: skip
    said = refused.stderr.decode()
    assert refused.returncode == 1 and "cannot use the catalog" in said, said
    assert "Traceback" not in said

    async with pm_cluster(tmp_path, (1,)) as cluster:
        stream = await tabled_stream(cluster)
        tables = await start_tables(cluster, tmp_path, "tables")

        async def append(start: int, count: int) -> None:
            async with Producer(cluster.pm_client(), stream, pool=cluster.pool) as producer:
                await producer.send_many([b"r%d" % i for i in range(start, start + count)])

        def table_end() -> Awaitable[tuple[list[int], int | None]]:
            return trio.to_thread.run_sync(table_rows, tmp_path, stream)

        await append(0, 1000)
        await eventually(table_end, until=lambda found: found[1] == 1000, timeout=30)
        lock = sqlite3.connect(tmp_path / "catalog.db", timeout=0, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            await append(1000, 1000)
            await eventually(
                lambda: trio.to_thread.run_sync(tables.log),
                until=lambda log: "a commit to its table failed" in log,
                timeout=30,
                what="a commit to fail on the locked catalog",
            )
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        offsets, _end = await eventually(
            table_end, until=lambda found: found[1] == 2000, timeout=60
        )
        assert offsets == list(range(2000))
        await tables.stop(signal.SIGTERM)
