"""Replication's cost: 64 KiB appends to a stream of one replica against a
stream of three replicas acknowledged by two (SPEC §7), on the same cluster
of a PM and three data nodes (``--sync always``) sharing this machine.

Each pair is measured at 1 and at 64 requests in flight, in alternating
order over several rounds (whichever runs second on a shared machine tends
to lose). At 1 in flight an R=3 A=1 stream runs with them: it is
acknowledged once the primary alone holds a batch durably, while both
followers are still sent and store every batch, so its p50 less R=1's is
what running two followers beside the primary costs the primary's own path
on this machine's shared cores and disk, and R=3 A=2's less R=3 A=1's is the
wait for a follower. While the replicated stream takes its load, its followers are
asked their next offset every 50 ms: how far behind the primary they are
is the replication lag. Last, an R=3 stream is read back from the start by
a ``Consumer``, from its primary and from a follower, alternating.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import trio
from matplotlib.figure import Figure

from bench.harness import (
    CPUMeter,
    Load,
    Measurement,
    Workload,
    batch_64k,
    drive_trio,
    one_stream_64k,
    percentiles_ms,
)
from bench.peers.limits import measure_raw_lmdb
from bench.report import ScenarioResult, Target, number, percent, table
from bench.scenarios.options import DEFAULT_IN_FLIGHT, Options
from client.consumer import Consumer
from client.datanode_client import DataNodeClient
from client.launcher import Plan, plan_children, running_plan
from client.pm_client import PMClient
from net.pool import ConnectionPool
from sbp import messages

NAME = "replication"
NODES: Final = 3
#: (replica_nums, ack_nums) of the two streams compared
SETTINGS: Final = ((1, 1), (3, 2))
#: measured at 1 in flight only: replicated, but acknowledged on the primary's durability
PRIMARY_ONLY: Final = (3, 1)
LAG_SAMPLE_S: Final = 0.05
#: catch-up reads from the primary and from a follower, each
READ_ROUNDS: Final = 3


@dataclass
class Cluster:
    pm_address: str
    node_pids: list[int]


@asynccontextmanager
async def three_node_cluster(parent: Path) -> AsyncIterator[Cluster]:
    data_dir = Path(tempfile.mkdtemp(prefix="replication-", dir=parent))
    pm, nodes = plan_children(data_dir, NODES, "127.0.0.1", 0, "always", sys.executable)
    async with running_plan(Plan([], [pm], nodes), data_dir):
        pids = [node.process.pid for node in nodes if node.process is not None]
        yield Cluster(pm.address, pids)


async def _lag_sampler(
    pool: ConnectionPool, rng: messages.Range, lags: list[int], stop: trio.Event
) -> None:
    """Every ``LAG_SAMPLE_S``: the primary's next offset minus each follower's."""
    clients = {
        replica.is_primary: DataNodeClient(replica.data_node.advertise_addr, pool=pool)
        for replica in rng.replica_nodes
    }
    followers = [
        DataNodeClient(r.data_node.advertise_addr, pool=pool)
        for r in rng.replica_nodes
        if not r.is_primary
    ]
    primary = clients[True]
    while not stop.is_set():
        head = (await primary.describe_range(rng.stream_id, rng.range_index)).next_offset
        for follower in followers:
            held = (await follower.describe_range(rng.stream_id, rng.range_index)).next_offset
            lags.append(max(0, head - held))
        await trio.sleep(LAG_SAMPLE_S)


async def _measure(
    cluster: Cluster,
    pool: ConnectionPool,
    replicas: int,
    acks: int,
    in_flight: int,
    options: Options,
    lags: list[int],
) -> Measurement:
    workload = one_stream_64k()
    batch = workload.batch
    pm = PMClient(cluster.pm_address, pool=pool)
    created = await pm.create_stream(replicas, ack_nums=acks)
    assert created.range is not None and created.stream is not None
    rng = created.range
    primary = rng.primary_node()
    assert primary is not None
    node = DataNodeClient(primary.advertise_addr, pool=pool)
    stream_id = created.stream.stream_id

    async def send(_index: int) -> None:
        await node.append_batch(stream_id, batch)

    servers = [CPUMeter(pid) for pid in cluster.node_pids]
    client = CPUMeter()
    for meter in (*servers, client):
        meter.start()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        if replicas > 1:
            nursery.start_soon(_lag_sampler, pool, rng, lags, stop)
        window = await drive_trio(send, workload, Load(in_flight, options.seconds, options.warmup))
        stop.set()
    server_cpu = sum(meter.stop() or 0.0 for meter in servers)
    measurement = window.measurement(
        f"R={replicas} A={acks}", workload, "sync always", in_flight, server_cpu, client.stop()
    )
    measurement.extra["replicas"] = replicas
    measurement.extra["acks"] = acks
    await pm.delete_stream(stream_id)
    return measurement


async def _measure_ceiling(cluster: Cluster, pool: ConnectionPool, options: Options) -> Measurement:
    """The machine's ceiling for writing every byte three times: three R=1
    streams, one led by each node, 64 requests in flight among them. An R=3
    stream writes each record on the three nodes, so a third of this is the
    most it can reach here, where the replicas share two cores and one disk."""
    batch, records = batch_64k()
    workload = Workload("64k-3", "64 KiB batches, 3 streams", batch, records, NODES)
    pm = PMClient(cluster.pm_address, pool=pool)
    led: dict[str, int] = {}
    made: list[int] = []
    while len(led) < NODES:
        created = await pm.create_stream(1)
        assert created.range is not None and created.stream is not None
        made.append(created.stream.stream_id)
        primary = created.range.primary_node()
        assert primary is not None
        led.setdefault(primary.advertise_addr, created.stream.stream_id)
    targets = [
        (DataNodeClient(address, pool=pool), stream_id) for address, stream_id in led.items()
    ]

    async def send(index: int) -> None:
        node, stream_id = targets[index % len(targets)]
        await node.append_batch(stream_id, batch)

    servers = [CPUMeter(pid) for pid in cluster.node_pids]
    client = CPUMeter()
    for meter in (*servers, client):
        meter.start()
    window = await drive_trio(
        send, workload, Load(DEFAULT_IN_FLIGHT, options.seconds, options.warmup)
    )
    server_cpu = sum(meter.stop() or 0.0 for meter in servers)
    measurement = window.measurement(
        "3 x R=1", workload, "sync always", DEFAULT_IN_FLIGHT, server_cpu, client.stop()
    )
    measurement.extra["replicas"] = 0
    measurement.extra["acks"] = 0
    for stream_id in made:
        await pm.delete_stream(stream_id)
    return measurement


async def _measure_reads(
    cluster: Cluster, pool: ConnectionPool, options: Options
) -> list[Measurement]:
    """Catch-up reads of one R=3 A=2 stream from its primary and from a
    follower (``Consumer(prefer_followers=True)``), alternating, each
    ``READ_ROUNDS`` times. A read counts only once it got every record: a
    follower serves what the primary has told it is committed."""
    workload = one_stream_64k()
    batch = workload.batch
    pm = PMClient(cluster.pm_address, pool=pool)
    created = await pm.create_stream(3, ack_nums=2)
    assert created.range is not None and created.stream is not None
    primary = created.range.primary_node()
    assert primary is not None
    node = DataNodeClient(primary.advertise_addr, pool=pool)
    stream_id = created.stream.stream_id
    batches = (16 if options.quick else 256) * 1024 * 1024 // len(batch)
    remaining = batches

    async def writer() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await node.append_batch(stream_id, batch)

    async with trio.open_nursery() as nursery:
        for _ in range(DEFAULT_IN_FLIGHT):
            nursery.start_soon(writer)
    expected = batches * workload.records_per_batch
    out = []
    for round_number in range(1 if options.quick else READ_ROUNDS):
        order = (False, True) if round_number % 2 == 0 else (True, False)
        for from_followers in order:
            with trio.fail_after(30):
                while True:
                    read = await _read_all(cluster, pool, stream_id, from_followers, expected)
                    if read is not None:
                        break
                    await trio.sleep(0.1)  # the follower's commit offset is on its way
            read.extra |= {"replicas": -1, "acks": 0}
            read.system = "read from a follower" if from_followers else "read from the primary"
            read.workload = workload.key
            out.append(read)
    await pm.delete_stream(stream_id)
    return out


async def _read_all(
    cluster: Cluster, pool: ConnectionPool, stream_id: int, from_followers: bool, expected: int
) -> Measurement | None:
    """One read of the stream from offset 0; None if it ended short."""
    got = nbytes = 0
    servers = [CPUMeter(pid) for pid in cluster.node_pids]
    client = CPUMeter()
    for meter in (*servers, client):
        meter.start()
    started = time.perf_counter()
    async with Consumer(
        cluster.pm_address, stream_id, 0, pool=pool, prefer_followers=from_followers
    ) as consumer:
        async for records in consumer:
            got += len(records)
            nbytes += len(records.values)
    seconds = time.perf_counter() - started
    if got != expected:
        return None
    return Measurement(
        system="",
        workload="",
        durability="n/a (read)",
        in_flight=1,
        seconds=round(seconds, 4),
        requests=0,
        bytes=nbytes,
        records=got,
        latency_ms=percentiles_ms([]),
        server_cpu=sum(meter.stop() or 0.0 for meter in servers),
        client_cpu=client.stop(),
    )


def _raw_commit_ms(options: Options) -> float:
    """The mean time of one synced LMDB commit of one 64 KiB batch, alone on
    this machine (no node, no network): the disk's share of every latency
    below, which varies from machine to machine and hour to hour."""
    raw = measure_raw_lmdb(one_stream_64k(), "always", 1, options.seconds, options.scratch)
    return raw.seconds / raw.requests * 1e3


async def _run(options: Options) -> tuple[list[Measurement], list[int]]:
    rounds = 1 if options.quick else 3
    measurements: list[Measurement] = []
    lags: list[int] = []
    async with three_node_cluster(options.scratch) as cluster, ConnectionPool() as pool:
        for round_number in range(rounds):
            for in_flight in (1, DEFAULT_IN_FLIGHT):
                settings: tuple[tuple[int, int], ...] = (
                    (*SETTINGS, PRIMARY_ONLY) if in_flight == 1 else SETTINGS
                )
                if round_number % 2:
                    settings = tuple(reversed(settings))
                for replicas, acks in settings:
                    measurements.append(
                        await _measure(
                            cluster, pool, replicas, acks, in_flight, options,
                            lags if in_flight == DEFAULT_IN_FLIGHT else [],
                        )
                    )  # fmt: skip
            measurements.append(await _measure_ceiling(cluster, pool, options))
        measurements += await _measure_reads(cluster, pool, options)
    return measurements, lags


def _median(
    ms: list[Measurement],
    setting: tuple[int, int],
    in_flight: int,
    value: Callable[..., float],
) -> float:
    """The median of ``value`` over the runs of one (replicas, acks) setting;
    (0, 0) is the three-stream ceiling."""
    chosen = [
        value(m)
        for m in ms
        if (m.extra["replicas"], m.extra["acks"]) == setting and m.in_flight == in_flight
    ]
    return statistics.median(chosen)


def _plot(ms: list[Measurement]) -> Callable[[Figure], None]:
    def draw(figure: Figure) -> None:
        left, right = figure.subplots(1, 2)
        for setting in (*SETTINGS, PRIMARY_ONLY):
            label = "R={} A={}".format(*setting)
            runs = [m for m in ms if (m.extra["replicas"], m.extra["acks"]) == setting]
            rates = [m.mb_per_s for m in runs if m.in_flight > 1]
            p50s = [m.latency_ms["p50"] for m in runs if m.in_flight == 1]
            if rates:
                left.plot(range(1, len(rates) + 1), rates, "o-", label=label)
            right.plot(range(1, len(p50s) + 1), p50s, "o-", label=label)
        left.set_title(f"MB/s at {DEFAULT_IN_FLIGHT} in flight")
        right.set_title("p50 ms at 1 in flight")
        for axes in (left, right):
            axes.set_xlabel("round")
            axes.legend(fontsize=8)
            axes.set_ylim(bottom=0)

    return draw


def run(options: Options) -> ScenarioResult:
    started = time.monotonic()
    raw_commit_ms = _raw_commit_ms(options)
    measurements, lags = trio.run(_run, options)
    single, replicated = SETTINGS
    rate_1 = _median(measurements, single, DEFAULT_IN_FLIGHT, lambda m: m.mb_per_s)
    rate_3 = _median(measurements, replicated, DEFAULT_IN_FLIGHT, lambda m: m.mb_per_s)
    p50_1 = _median(measurements, single, 1, lambda m: m.latency_ms["p50"])
    p50_3 = _median(measurements, replicated, 1, lambda m: m.latency_ms["p50"])
    p50_primary_only = _median(measurements, PRIMARY_ONLY, 1, lambda m: m.latency_ms["p50"])
    ceiling = _median(measurements, (0, 0), DEFAULT_IN_FLIGHT, lambda m: m.mb_per_s)
    reads = {
        name: statistics.median(m.mb_per_s for m in measurements if m.system == name)
        for name in ("read from the primary", "read from a follower")
    }
    rows = [
        (
            m.system,
            m.in_flight,
            number(m.mb_per_s),
            number(m.latency_ms["p50"], 2),
            number(m.latency_ms["p99"], 2),
            percent(m.server_cpu),
            percent(m.client_cpu),
        )
        for m in measurements
    ]
    lag_rows = [
        (
            "followers' lag behind the primary, records of 64 KiB batches",
            len(lags),
            number(statistics.median(lags) if lags else None),
            number(max(lags) if lags else None),
        )
    ]
    latency_rows = [
        (
            "one synced LMDB commit of a 64 KiB batch, alone (no node; the mean)",
            number(raw_commit_ms, 2),
            "",
        ),
        ("R=1 A=1: the primary alone", number(p50_1, 2), ""),
        (
            "R=3 A=1: acknowledged on the primary's durability, two followers storing "
            "every batch beside it",
            number(p50_primary_only, 2),
            f"+{p50_primary_only - p50_1:.2f} ms: the followers' work on the shared cores and disk",
        ),
        (
            "R=3 A=2: acknowledged once a follower holds it too",
            number(p50_3, 2),
            f"+{p50_3 - p50_primary_only:.2f} ms: the wait for the follower",
        ),
    ]
    return ScenarioResult(
        name=NAME,
        title="Replication",
        settings=options.as_settings()
        | {
            "nodes": NODES,
            "streams": [f"R={r} A={a}" for r, a in (*SETTINGS, PRIMARY_ONLY)],
            "sync": "always",
        },
        measurements=measurements,
        targets=[
            Target(
                f"R=3 A=2 against R=1 at {DEFAULT_IN_FLIGHT} in flight (median MB/s)",
                rate_3 / rate_1,
                0.6,
                "x",
            ),
            Target(
                "R=3 A=2 against a third of three R=1 streams on three nodes (the ceiling "
                "of writing every byte three times on this machine)",
                rate_3 / (ceiling / NODES),
                0.8,
                "x",
            ),
            Target(
                "catch-up read of an R=3 stream: from a follower / from the primary "
                "(median MB/s)",
                reads["read from a follower"] / reads["read from the primary"],
                1.0,
                "x",
                note=f"{reads['read from a follower']:,.0f} vs "
                f"{reads['read from the primary']:,.0f} MB/s",
            ),
            Target(
                "R=3 p50 minus R=1 p50 at 1 in flight",
                p50_3 - p50_1,
                0.5,
                "ms",
                higher_is_better=False,
            ),
        ],
        tables=[
            "## Every run, in the order measured\n\n"
            + table(
                ["stream", "in flight", "MB/s", "p50 ms", "p99 ms", "nodes' CPU", "client CPU"],
                rows,
                "lrrrrrr",
            ),
            "## Where R=3's latency at 1 in flight goes (median p50)\n\n"
            + table(["stream", "p50 ms", "over the row before"], latency_rows, "lrl"),
            "## Replication lag under load\n\n"
            + table(["what", "samples", "median", "max"], lag_rows, "lrrr"),
        ],
        plot=_plot(measurements),
        extra={"lag_records": {"median": statistics.median(lags) if lags else None,
                               "max": max(lags) if lags else None},
               "raw_lmdb_commit_ms": raw_commit_ms,
               "seconds": time.monotonic() - started},
    )  # fmt: skip
