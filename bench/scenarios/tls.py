"""What security costs (SPEC §9): 64 KiB appends to one data node over plain
TCP, over mutual TLS, and over mutual TLS with an ACL file, in the same run.

Three one-node clusters (a PM and a data node each, ``--sync always``) run
side by side; each configuration is measured at 1 and at 64 requests in
flight, in an order that rotates every round (whichever runs last on a
shared machine tends to lose). CPU is counted on both ends, per MB moved,
so that TLS's cost shows where it lands.

The ACL check itself is also timed on its own: ``AccessControl.check_each``
for one APPEND item, against the data node's CPU time per APPEND measured
with the ACL on.
"""

from __future__ import annotations

import json
import ssl
import statistics
import sys
import tempfile
import time
import timeit
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio
from matplotlib.figure import Figure

from bench.harness import CPUMeter, Load, Measurement, Workload, batch_64k, drive_trio
from bench.report import ScenarioResult, Target, number, percent, table
from bench.scenarios.options import DEFAULT_IN_FLIGHT, Options
from client.datanode_client import DataNodeClient
from client.launcher import Plan, plan_children, running_plan, secure_children
from client.pki import CLIENT_NAME
from client.pm_client import PMClient
from net.authz import AccessControl
from net.pool import ConnectionPool
from net.tls import TLSSettings

NAME = "tls"
CONFIGS: Final = ("plain", "mutual TLS", "mutual TLS + ACL")
#: what the benchmark's client may do, among entries for others (a realistic file)
ACL: Final = {
    "acls": [
        *(
            {
                "principal": f"team-{n}",
                "operations": ["APPEND", "FETCH"],
                "resource": f"streams:{n * 1000}-{n * 1000 + 999}",
                "effect": "allow",
            }
            for n in range(1, 20)
        ),
        {
            "principal": CLIENT_NAME,
            "operations": ["CREATE", "APPEND", "FETCH", "DELETE", "DESCRIBE"],
            "resource": "streams:*",
            "effect": "allow",
        },
        {
            "principal": "*",
            "operations": ["DELETE"],
            "resource": "streams:1000000-1999999",
            "effect": "deny",
        },
    ]
}


@dataclass
class OneNode:
    config: str
    pm_address: str
    node_pid: int
    tls: ssl.SSLContext | None


@asynccontextmanager
async def one_node_cluster(parent: Path, config: str) -> AsyncIterator[OneNode]:
    data_dir = Path(tempfile.mkdtemp(prefix="tls-", dir=parent))
    pm, nodes = plan_children(data_dir, 1, "127.0.0.1", 0, "always", sys.executable)
    plan = Plan([], [pm], nodes)
    launcher = tls = None
    if config != "plain":
        acl_file = None
        if config.endswith("ACL"):
            acl_file = data_dir / "acl.json"
            acl_file.write_text(json.dumps(ACL))
        pki = data_dir / "pki"
        launcher = secure_children(plan, pki, acl_file)
        client = TLSSettings(
            ca=pki / "ca.pem", cert=pki / f"{CLIENT_NAME}.pem", key=pki / f"{CLIENT_NAME}.key"
        )
        tls = client.client_context()
    async with running_plan(plan, data_dir, launcher):
        process = nodes[0].process
        assert process is not None
        yield OneNode(config, pm.address, process.pid, tls)


async def _measure(cluster: OneNode, in_flight: int, options: Options) -> Measurement:
    batch, records = batch_64k()
    workload = Workload("64k-1", "64 KiB batches, 1 stream", batch, records, 1)
    async with ConnectionPool(tls=cluster.tls) as pool:
        pm = PMClient(cluster.pm_address, pool=pool)
        created = await pm.create_stream(1)
        assert created.range is not None and created.stream is not None
        primary = created.range.primary_node()
        assert primary is not None
        node = DataNodeClient(primary.advertise_addr, pool=pool)
        stream_id = created.stream.stream_id

        async def send(_index: int) -> None:
            await node.append_batch(stream_id, batch)

        server, client = CPUMeter(cluster.node_pid), CPUMeter()
        server.start()
        client.start()
        window = await drive_trio(send, workload, Load(in_flight, options.seconds, options.warmup))
        measurement = window.measurement(
            cluster.config, workload, "sync always", in_flight, server.stop(), client.stop()
        )
        await pm.delete_stream(stream_id)
    return measurement


async def _run(options: Options) -> list[Measurement]:
    rounds = 1 if options.quick else 3
    measurements: list[Measurement] = []
    async with (
        one_node_cluster(options.scratch, CONFIGS[0]) as plain,
        one_node_cluster(options.scratch, CONFIGS[1]) as mutual,
        one_node_cluster(options.scratch, CONFIGS[2]) as with_acl,
    ):
        clusters = [plain, mutual, with_acl]
        for round_number in range(rounds):
            shift = round_number % len(clusters)
            order = clusters[shift:] + clusters[:shift]
            for in_flight in (1, DEFAULT_IN_FLIGHT):
                for cluster in order:
                    measurements.append(await _measure(cluster, in_flight, options))
    return measurements


def acl_check_seconds(path: Path) -> float:
    """Seconds one APPEND item's authorization takes (the benchmark's ACL,
    the client's principal, allowed: every entry is looked at)."""
    path.write_text(json.dumps(ACL))
    access = AccessControl(path)
    calls = 20_000
    best = min(
        timeit.repeat(
            lambda: access.check_each(CLIENT_NAME, "APPEND", [12345]), number=calls, repeat=5
        )
    )
    return best / calls


def _median(
    ms: list[Measurement], config: str, in_flight: int, value: Callable[..., float]
) -> float:
    return statistics.median(
        value(m) for m in ms if m.system == config and m.in_flight == in_flight
    )


def _cpu_per_mb(cpu: float | None, m: Measurement) -> float | None:
    """CPU milliseconds per MB moved (cpu is in cores)."""
    return None if cpu is None or not m.mb_per_s else cpu * 1000 / m.mb_per_s


def _plot(ms: list[Measurement]) -> Callable[[Figure], None]:
    def draw(figure: Figure) -> None:
        left, right = figure.subplots(1, 2)
        for config in CONFIGS:
            rates = [m.mb_per_s for m in ms if m.system == config and m.in_flight > 1]
            p50s = [m.latency_ms["p50"] for m in ms if m.system == config and m.in_flight == 1]
            left.plot(range(1, len(rates) + 1), rates, "o-", label=config)
            right.plot(range(1, len(p50s) + 1), p50s, "o-", label=config)
        left.set_title(f"MB/s at {DEFAULT_IN_FLIGHT} in flight")
        right.set_title("p50 ms at 1 in flight")
        for axes in (left, right):
            axes.set_xlabel("round")
            axes.legend(fontsize=8)
            axes.set_ylim(bottom=0)

    return draw


def run(options: Options) -> ScenarioResult:
    started = time.monotonic()
    measurements = trio.run(_run, options)
    check_s = acl_check_seconds(options.scratch / "bench-acl.json")
    rates = {c: _median(measurements, c, DEFAULT_IN_FLIGHT, lambda m: m.mb_per_s) for c in CONFIGS}
    p50s = {c: _median(measurements, c, 1, lambda m: m.latency_ms["p50"]) for c in CONFIGS}
    # the data node's CPU seconds per APPEND with the ACL on, at 64 in flight
    per_append = _median(
        measurements,
        CONFIGS[2],
        DEFAULT_IN_FLIGHT,
        lambda m: (m.server_cpu or 0.0) / max(m.requests_per_s, 1e-9),
    )
    rows = [
        (
            m.system,
            m.in_flight,
            number(m.mb_per_s),
            number(m.latency_ms["p50"], 2),
            number(m.latency_ms["p99"], 2),
            percent(m.server_cpu),
            percent(m.client_cpu),
            number(_cpu_per_mb(m.server_cpu, m), 2),
            number(_cpu_per_mb(m.client_cpu, m), 2),
        )
        for m in measurements
    ]
    return ScenarioResult(
        name=NAME,
        title="TLS and ACLs",
        settings=options.as_settings()
        | {"configs": list(CONFIGS), "acl_entries": len(ACL["acls"]), "sync": "always"},
        measurements=measurements,
        targets=[
            Target(
                f"mutual TLS against plain TCP at {DEFAULT_IN_FLIGHT} in flight (median MB/s)",
                rates[CONFIGS[1]] / rates[CONFIGS[0]],
                0.6,
                "x",
            ),
            Target(
                f"mutual TLS + ACL against plain TCP at {DEFAULT_IN_FLIGHT} in flight",
                rates[CONFIGS[2]] / rates[CONFIGS[0]],
                0.6,
                "x",
            ),
            Target(
                "the ACL check of one APPEND item, as a share of the data node's CPU per APPEND",
                100 * check_s / per_append,
                1.0,
                "%",
                higher_is_better=False,
            ),
        ],
        tables=[
            "## Every run, in the order measured\n\n"
            + table(
                [
                    "config",
                    "in flight",
                    "MB/s",
                    "p50 ms",
                    "p99 ms",
                    "node CPU",
                    "client CPU",
                    "node CPU ms/MB",
                    "client CPU ms/MB",
                ],
                rows,
                "lrrrrrrrr",
            ),
            "## The ACL check\n\n"
            + table(
                ["what", "µs"],
                [
                    (
                        f"one APPEND item checked against {len(ACL['acls'])} entries",
                        number(check_s * 1e6, 2),
                    ),
                    (
                        "the data node's CPU per 64 KiB APPEND (ACL on, 64 in flight)",
                        number(per_append * 1e6, 1),
                    ),
                ],
                "lr",
            ),
            "## p50 at 1 in flight (median ms)\n\n"
            + table(["config", "p50 ms"], [(c, number(p50s[c], 2)) for c in CONFIGS], "lr"),
        ],
        plot=_plot(measurements),
        extra={"acl_check_us": check_s * 1e6, "seconds": time.monotonic() - started},
    )
