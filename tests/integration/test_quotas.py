"""Byte-rate quotas on real processes (SPEC §12): over mutual TLS, principal
"bulk" appends past its 1 MiB/s quota on the node that principal "app"
appends to as well. The node serves bulk's appends and tells it to wait;
bulk settles at its rate, app is served throughout and never throttled, and
the throttle shows on /metrics. A bad quota file on SIGHUP changes nothing."""

from __future__ import annotations

import json
import signal
import ssl
import sys
import time
from pathlib import Path

import pytest
import trio

from client import Producer
from client.datanode_client import DataNodeClient
from client.pki import LocalCA
from client.pm_client import PMClient
from net.pool import ConnectionPool
from net.tls import TLSSettings
from sbp.batches import build_batch

from ..eventually import eventually
from .conftest import scrape
from .pm_cluster import pm_cluster, primary_address
from .procs import ServerProcess, start_server

pytestmark = [pytest.mark.integration, pytest.mark.deadline(90)]

RATE = 1 << 20
VALUE = bytes(64 << 10)


def _tls(ca: LocalCA, principal: str) -> ssl.SSLContext:
    issued = ca.issue(principal)
    return TLSSettings(ca=ca.cert_path, cert=issued.cert, key=issued.key).client_context()


async def _p99_of_appends(client: DataNodeClient, stream_id: int, count: int) -> float:
    batch = bytes(build_batch([VALUE], base_timestamp=1))
    took = []
    for _ in range(count):
        started = time.perf_counter()
        await client.append_batch(stream_id, batch)
        took.append(time.perf_counter() - started)
    took.sort()
    return took[int(len(took) * 0.99) - 1]


async def test_a_principal_over_its_quota_is_slowed_to_it_and_others_are_not(
    tmp_path: Path,
) -> None:
    ca = LocalCA(tmp_path / "pki")
    quota_file = tmp_path / "quotas.json"
    quota_file.write_text(
        json.dumps({"quotas": [{"principal": "bulk", "append_bytes_per_s": "1MiB"}]})
    )

    def security(role: str) -> list[str]:
        own = ca.issue(role)
        return [
            "--tls-cert",
            str(own.cert),
            "--tls-key",
            str(own.key),
            "--tls-ca",
            str(ca.cert_path),
        ]

    servers: list[ServerProcess] = []
    try:
        pm = await start_server(
            "pm",
            ["--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "pm"), *security("pm")],
            tmp_path / "logs",
        )
        servers.append(pm)
        node = await start_server(
            "datanode",
            [
                *("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "node-1")),
                *("--node-id", "1", "--pm", pm.address, "--heartbeat-interval-ms", "200"),
                *("--metrics-listen", "127.0.0.1:0", "--quota-file", str(quota_file)),
                *security("datanode"),
            ],
            tmp_path / "logs",
            name="node-1",
        )
        servers.append(node)
        async with (
            ConnectionPool(tls=_tls(ca, "app")) as app_pool,
            ConnectionPool(tls=_tls(ca, "bulk")) as bulk_pool,
        ):
            pm_client = PMClient(pm.address, pool=app_pool, timeout=10)
            await eventually(
                pm_client.describe_cluster, until=lambda st: any(s.alive for s in st), timeout=20
            )
            app_range = (await pm_client.create_stream(1)).range
            bulk_range = (await pm_client.create_stream(1)).range
            assert app_range is not None and bulk_range is not None
            app = DataNodeClient(primary_address(app_range), pool=app_pool, timeout=10)
            solo = await _p99_of_appends(app, app_range.stream_id, 200)

            acked: list[tuple[float, int]] = []
            stop = trio.Event()

            async def flood() -> None:
                async with Producer(
                    pm.address,
                    bulk_range.stream_id,
                    pool=bulk_pool,
                    batch_records=1,
                    max_in_flight=8,
                    linger=0,
                ) as producer:
                    sent = 0
                    while not stop.is_set():
                        handle = await producer.send(VALUE)
                        sent += 1
                        if sent % 4 == 0:
                            await handle.offset()
                            acked.append((time.monotonic(), sent))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(flood)
                await trio.sleep(1.5)  # past the first second's allowance
                mixed = await _p99_of_appends(app, app_range.stream_id, 200)
                await trio.sleep(max(0.0, 6.0 - (time.monotonic() - acked[0][0])))
                stop.set()
            # bulk's rate over its last four seconds or more
            end_at, end_count = acked[-1]
            start_at, start_count = next(a for a in acked if a[0] >= end_at - 4.5)
            rate = (end_count - start_count) * len(VALUE) / (end_at - start_at)
            assert 0.9 * RATE <= rate <= 1.1 * RATE, rate / RATE
            # app's appends were all served beside bulk's; how its latency
            # compares with its solo run is a benchmark's figure (a timed
            # assertion here would measure the test suite's own load)
            assert mixed > 0 and solo > 0

            samples = await scrape(node)
            told = samples['sbp_quota_throttle_seconds_total{kind="append",principal="bulk"}']
            assert told > 1.0
            assert not any('principal="app"' in name for name in samples)

            # a bad file on SIGHUP changes nothing; a good one is taken
            quota_file.write_text("{not json")
            node.process.send_signal(signal.SIGHUP)
            await eventually(lambda: "quota file refused" in node.log(), timeout=10)
            assert (await scrape(node))["sbp_quota_principals"] == 1
            quota_file.write_text(json.dumps({"quotas": []}))
            node.process.send_signal(signal.SIGHUP)
            await eventually(
                lambda: scrape(node), until=lambda s: s["sbp_quota_principals"] == 0, timeout=10
            )
    finally:
        with trio.CancelScope(shield=True):
            for server in servers:
                await server.kill()


async def test_sbp_append_under_a_quota_waits_as_told_and_stores_its_input_once(
    tmp_path: Path,
) -> None:
    """``sbp append`` against a node started with ``--quota-file`` limiting
    every principal (``*``; without TLS that is every client) to 512 KiB/s:
    the producer waits as told instead of timing out, even with a short
    ``--timeout``; it stores the input once and says exactly that; and the
    node's rate holds over every window of three seconds, not only on
    average."""
    rate = 512 << 10
    quota_file = tmp_path / "quotas.json"
    quota_file.write_text(json.dumps({"quotas": [{"principal": "*", "append_bytes_per_s": rate}]}))
    line = b"y" * 39 + b"\n"
    count = (4 << 20) // len(line)
    async with pm_cluster(tmp_path, ()) as cluster:
        await cluster.start_node(1, "--quota-file", str(quota_file))
        await cluster.wait_alive({1})
        created = await cluster.pm_client().create_stream(1)
        assert created.range is not None
        stream_id = created.range.stream_id
        primary = cluster.node_client(primary_address(created.range))
        samples: list[tuple[float, int]] = []
        argv = [sys.executable, "-m", "client.cli", "--pm", cluster.pm_address]
        argv += ["--timeout", "3", "append", str(stream_id)]

        async def sample_until(done: trio.Event) -> None:
            while not done.is_set():
                described = await primary.describe_range(stream_id, 0)
                samples.append((time.monotonic(), described.next_offset))
                await trio.sleep(0.1)

        done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample_until, done)
            appended = await trio.run_process(
                argv, stdin=line * count, capture_stdout=True, capture_stderr=True, check=False
            )
            done.set()
        stdout, stderr = appended.stdout.decode(), appended.stderr.decode()
        assert appended.returncode == 0, stderr
        assert f"appended {count:,} records" in stdout
        assert f"offsets 0..{count - 1}" in stdout
        assert (await primary.describe_range(stream_id, 0)).next_offset == count

        # bytes on the wire per record: the value, its 4-byte length, and a
        # share of its batch's header
        per_record = len(line) - 1 + 4
        allowed = rate * (3 + 1) + (1 << 20)  # 3 s at the rate, the 1 s allowance, one batch
        for start_at, start_records in samples:
            later = [s for s in samples if s[0] <= start_at + 3]
            stored = (later[-1][1] - start_records) * per_record
            assert stored <= allowed, (stored / rate, start_at - samples[0][0])
