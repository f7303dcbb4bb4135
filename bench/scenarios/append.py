"""Append throughput and latency: SBP (sync always / never), Redis Streams
(AOF always / everysec) and NATS JetStream (2.15 syncing every message, 2.15
and 2.9 syncing on a timer) on the same batches at the same concurrency,
against the raw limits of the machine.

Workloads: 64 KiB batches to 1, 100 and 2,000 streams, and 100-byte records
in batches of 1,000 to one stream, each at ``DEFAULT_IN_FLIGHT`` requests in
flight; the 64 KiB one-stream workload also at every ``SWEEP_IN_FLIGHT``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import trio
from matplotlib.figure import Figure

from bench.harness import (
    CPUMeter,
    Measurement,
    Workload,
    local_cluster,
    percentiles_ms,
    standard_workloads,
)
from bench.peers import limits, nats_jetstream, redis_streams, sbp
from bench.producer import make_values, produce
from bench.report import ScenarioResult, Target, number, percent, table
from bench.scenarios.options import DEFAULT_IN_FLIGHT, SWEEP_IN_FLIGHT, Options
from client.pm_client import PMClient
from net.pool import ConnectionPool

NAME = "append"
SWEPT = "64k-1"
PRODUCER_VALUE_BYTES = 100
PRODUCER_IN_FLIGHT = 4
#: SBP with several record batches per APPEND (as the Producer packs them):
#: the same 64 batches in flight, in 8 requests of 8
PACKED = "sbp-packed"
PACKED_WORKLOADS = ("64k-1", "64k-100", "100b-1")
PACKED_IN_FLIGHT = 8
PACKED_BATCHES = 8
LIMITS = ("raw-lmdb", "trio-socket-sink")


def _sweep(workload: Workload) -> list[int]:
    """The in-flight values to measure a workload at."""
    return list(SWEEP_IN_FLIGHT) if workload.key == SWEPT else [DEFAULT_IN_FLIGHT]


async def _sbp_runs(options: Options, sync: str, workloads: list[Workload]) -> list[Measurement]:
    out = []
    async with local_cluster(sync, options.scratch) as cluster:
        for workload in workloads:
            for in_flight in _sweep(workload):
                out.append(
                    await sbp.measure_appends(cluster, sync, workload, options.load(in_flight))
                )
        for workload in workloads:
            if workload.key in PACKED_WORKLOADS:
                load = replace(options.load(PACKED_IN_FLIGHT), batches_per_request=PACKED_BATCHES)
                packed = await sbp.measure_appends(cluster, sync, workload, load)
                packed.system = PACKED
                out.append(packed)
        if sync == "always":
            out.append(await _producer_run(options, cluster.pm_address, cluster.node_pid))
    return out


async def _producer_run(options: Options, pm_address: str, node_pid: int) -> Measurement:
    """100-byte records through the client library's ``Producer`` (send_many,
    batching, encoding, routing) rather than prebuilt batches."""
    count = 200_000 if options.quick else 2_000_000
    values = make_values(count, PRODUCER_VALUE_BYTES)
    async with ConnectionPool() as pool:
        pm = PMClient(pm_address, pool=pool)
        created = await pm.create_stream(1)
        assert created.stream is not None
        stream_id = created.stream.stream_id
        server, client = CPUMeter(node_pid), CPUMeter()
        server.start()
        client.start()
        seconds = await produce(
            pm, pool, stream_id, values, per_record=False, max_in_flight=PRODUCER_IN_FLIGHT
        )
        return Measurement(
            system="sbp-producer",
            workload="100b-1",
            durability="sync always",
            in_flight=PRODUCER_IN_FLIGHT,
            seconds=round(seconds, 4),
            requests=0,
            bytes=count * PRODUCER_VALUE_BYTES,
            records=count,
            latency_ms=percentiles_ms([]),
            server_cpu=server.stop(),
            client_cpu=client.stop(),
        )


def _peer_runs(options: Options, workloads: list[Workload]) -> list[Measurement]:
    out = []
    with redis_streams.redis_server(options.scratch) as server:
        for fsync in ("always", "everysec"):
            for workload in workloads:
                for in_flight in _sweep(workload) if fsync == "always" else [DEFAULT_IN_FLIGHT]:
                    out.append(
                        redis_streams.measure_appends(
                            server, workload, fsync, options.load(in_flight)
                        )
                    )
    for flavour in nats_jetstream.FLAVOURS:
        with nats_jetstream.nats_server(options.scratch, flavour) as server:
            for workload in workloads:
                # the durable server at every concurrency, the others at 1 and the default
                sweep = _sweep(workload)
                if not flavour.sync_always and len(sweep) > 1:
                    sweep = [1, DEFAULT_IN_FLIGHT]
                for in_flight in sweep:
                    out.append(
                        nats_jetstream.measure_appends(server, workload, options.load(in_flight))
                    )
    return out


def _limit_runs(options: Options, workloads: list[Workload]) -> list[Measurement]:
    out = []
    for workload in workloads:
        if workload.streams != 1:
            continue
        for sync in ("always", "never"):
            out.append(
                limits.measure_raw_lmdb(
                    workload, sync, DEFAULT_IN_FLIGHT, options.seconds, options.scratch
                )
            )
        out.append(limits.measure_socket_sink(workload, options.seconds))
    return out


def find(
    measurements: list[Measurement],
    system: str,
    durability: str,
    workload: str,
    in_flight: int = DEFAULT_IN_FLIGHT,
) -> Measurement:
    for m in measurements:
        if (m.system, m.durability, m.workload, m.in_flight) == (
            system,
            durability,
            workload,
            in_flight,
        ):
            return m
    raise KeyError(f"no measurement of {system} {durability} {workload} at {in_flight}")


def _targets(ms: list[Measurement]) -> list[Target]:
    ours = find(ms, "sbp", "sync always", SWEPT)
    nats = find(ms, "nats-jetstream", nats_jetstream.SYNC_ALWAYS.durability, SWEPT)
    redis = find(ms, "redis-streams", "aof always", SWEPT)
    raw = find(ms, "raw-lmdb", "sync always", SWEPT)
    records = find(ms, "sbp", "sync always", "100b-1")
    return [
        Target(
            "64 KiB, durable: SBP / NATS JetStream 2.15 (sync always)",
            ours.mb_per_s / nats.mb_per_s,
            1.5,
            "x",
            note=f"{ours.mb_per_s:,.0f} vs {nats.mb_per_s:,.0f} MB/s",
        ),
        Target(
            "64 KiB, durable: SBP / Redis Streams (appendfsync always)",
            ours.mb_per_s / redis.mb_per_s,
            4.0,
            "x",
            note=f"{ours.mb_per_s:,.0f} vs {redis.mb_per_s:,.0f} MB/s",
        ),
        Target(
            "64 KiB, durable: SBP / raw LMDB group commit",
            ours.mb_per_s / raw.mb_per_s,
            0.5,
            "x",
            note=f"{ours.mb_per_s:,.0f} vs {raw.mb_per_s:,.0f} MB/s",
        ),
        Target(
            "100 B records, durable: SBP records/s",
            records.records_per_s,
            1_000_000,
            "records/s",
        ),
    ]


def _series(m: Measurement) -> str:
    return f"{m.system} ({m.durability})"


def _tables(ms: list[Measurement], workloads: list[Workload]) -> list[str]:
    labels = {w.key: w.label for w in workloads}
    labels["100b-1"] = labels.get("100b-1", "100 B records")
    main = [m for m in ms if m.in_flight == DEFAULT_IN_FLIGHT and m.system not in LIMITS]
    rows = [
        (
            labels.get(m.workload, m.workload),
            m.system,
            m.durability,
            number(m.mb_per_s),
            number(m.records_per_s),
            percent(m.server_cpu),
            percent(m.client_cpu),
            number(m.latency_ms["p50"], 2),
            number(m.latency_ms["p95"], 2),
            number(m.latency_ms["p99"], 2),
            number(m.latency_ms["p99.9"], 2),
        )
        for m in sorted(main, key=lambda m: (list(labels).index(m.workload), _series(m)))
    ]
    headers = [
        "workload",
        "system",
        "durability",
        "MB/s",
        "records/s",
        "server CPU",
        "client CPU",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "p99.9 ms",
    ]
    sweep_rows = [
        (
            m.system,
            m.durability,
            m.in_flight,
            number(m.mb_per_s),
            percent(m.server_cpu),
            number(m.latency_ms["p50"], 2),
            number(m.latency_ms["p99"], 2),
        )
        for m in sorted(
            (m for m in ms if m.workload == SWEPT and m.system not in (*LIMITS, PACKED)),
            key=lambda m: (_series(m), m.in_flight),
        )
    ]
    limit_rows = [
        (labels[m.workload], m.system, m.durability, number(m.mb_per_s), number(m.records_per_s))
        for m in ms
        if m.system in LIMITS
    ]
    packed_rows = [
        (
            labels[m.workload],
            m.durability,
            f"{m.in_flight} x {PACKED_BATCHES}",
            number(m.mb_per_s),
            number(m.records_per_s),
            percent(m.server_cpu),
            number(m.latency_ms["p50"], 2),
            number(m.latency_ms["p99"], 2),
        )
        for m in ms
        if m.system == PACKED
    ]
    producer_rows = [
        (m.system, m.durability, m.in_flight, number(m.records_per_s), number(m.mb_per_s))
        for m in ms
        if m.system == "sbp-producer"
    ]
    return [
        f"## Throughput and latency at {DEFAULT_IN_FLIGHT} requests in flight\n\n"
        "One record batch per request; latency from sending a request to its "
        "acknowledgement. CPU: user + system time over wall time, 100 % = one core "
        "(the client is this benchmark process).\n\n" + table(headers, rows, "lll" + "r" * 8),
        "## Concurrency sweep: 64 KiB batches, 1 stream\n\n"
        + table(
            ["system", "durability", "in flight", "MB/s", "server CPU", "p50 ms", "p99 ms"],
            sweep_rows,
            "llrrrrr",
        ),
        "## Limits of the machine for the same bytes\n\n"
        f"Raw LMDB: {DEFAULT_IN_FLIGHT} puts per transaction (bench.storage's raw loop); "
        "socket sink: one trio stream into a discarding trio server process.\n\n"
        + table(["workload", "limit", "durability", "MB/s", "records/s"], limit_rows, "lllrr"),
        f"## SBP with {PACKED_BATCHES} record batches per APPEND\n\n"
        f"The same {PACKED_IN_FLIGHT * PACKED_BATCHES} batches in flight as above, in "
        f"{PACKED_IN_FLIGHT} requests of {PACKED_BATCHES} (one stream, or {PACKED_BATCHES} "
        "consecutive streams), as the Producer packs ready batches into one request; "
        "latency is per request.\n\n"
        + table(
            [
                "workload",
                "durability",
                "requests x batches",
                "MB/s",
                "records/s",
                "server CPU",
                "p50 ms",
                "p99 ms",
            ],
            packed_rows,
            "lll" + "r" * 5,
        ),
        "## 100-byte records through the Producer\n\n"
        f"`client.producer.Producer.send_many` of {PRODUCER_VALUE_BYTES}-byte values "
        "(batching and encoding in the client included), MB/s of values.\n\n"
        + table(["system", "durability", "in flight", "records/s", "MB/s"], producer_rows, "llrrr"),
    ]


def _plot(ms: list[Measurement], workloads: list[Workload]) -> Callable[[Figure], None]:
    def draw(figure: Figure) -> None:
        left, right = figure.subplots(1, 2)
        main = [
            m
            for m in ms
            if m.in_flight == DEFAULT_IN_FLIGHT
            and m.system in ("sbp", "redis-streams", "nats-jetstream")
        ]
        series = sorted({_series(m) for m in main})
        keys = [w.key for w in workloads]
        width = 0.8 / max(1, len(series))
        for i, name in enumerate(series):
            values = []
            for key in keys:
                found = [m.mb_per_s for m in main if _series(m) == name and m.workload == key]
                values.append(found[0] if found else 0.0)
            left.bar([x + i * width for x in range(len(keys))], values, width, label=name)
        left.set_xticks([x + 0.4 - width / 2 for x in range(len(keys))], keys)
        left.set_ylabel("MB/s")
        left.set_title(f"Appends at {DEFAULT_IN_FLIGHT} in flight")
        left.legend(fontsize=7)
        for name in series:
            points = sorted(
                (m.in_flight, m.mb_per_s) for m in ms if m.workload == SWEPT and _series(m) == name
            )
            if len(points) > 1:
                right.plot(*zip(*points, strict=True), marker="o", label=name)
        for m in ms:
            if m.system == "raw-lmdb" and m.workload == SWEPT:
                right.axhline(m.mb_per_s, linestyle="--", color="gray", linewidth=0.8)
                right.annotate(f"raw LMDB, {m.durability}", (1, m.mb_per_s), fontsize=7)
        right.set_xscale("log", base=2)
        right.set_xticks(SWEEP_IN_FLIGHT, [str(n) for n in SWEEP_IN_FLIGHT])
        right.set_xlabel("requests in flight")
        right.set_ylabel("MB/s")
        right.set_title("64 KiB batches, 1 stream")
        right.legend(fontsize=7)

    return draw


def run(options: Options) -> ScenarioResult:
    workloads = standard_workloads()
    measurements: list[Measurement] = []
    for sync in ("always", "never"):
        measurements += trio.run(_sbp_runs, options, sync, workloads)
    measurements += _peer_runs(options, workloads)
    measurements += _limit_runs(options, workloads)
    return ScenarioResult(
        name=NAME,
        title="Append throughput and latency",
        settings=options.as_settings()
        | {
            "workloads": {w.key: f"{w.label} ({len(w.batch):,} B per batch)" for w in workloads},
            "cluster": "1 PM + 1 data node as processes, client in the benchmark process",
            "cpu_count": os.cpu_count(),
        },
        measurements=measurements,
        targets=_targets(measurements),
        tables=_tables(measurements, workloads),
        plot=_plot(measurements, workloads),
    )
