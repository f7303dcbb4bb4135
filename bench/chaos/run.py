"""One fault-injection run: start the cluster behind its proxies, run the
workload while the schedule plays, heal everything, read every stream back
and check it (``checker``), then write the report (``report``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from client.consumer import Consumer
from client.datanode_client import DataNodeClient
from client.pm_client import PMClient
from sbp import messages
from sbp.batches import decode_batches
from sbp.enums import ErrorCode, ObjectState, Opcode

from . import checker, tables_check
from .cluster import ChaosCluster
from .faults import KINDS, Fault, Injector, draw_schedule
from .history import History
from .workload import EXPECTED, Workload, WorkloadSettings

#: after healing, how long the cluster gets to find its nodes again
SETTLE_S = 8.0
#: how long reading one stream back may take at the end
FINAL_READ_TIMEOUT_S = 120.0
#: how long a replica holding fewer records than its stream is given to catch up
REPLICA_SETTLE_S = 15.0
#: how long the moves of ranges under way at the end (a rebalance) may take
#: to finish before the streams are read back
MOVES_SETTLE_S = 300.0


#: a PM that compacts often and rolls small ranges: passes run under the faults
COMPACTING_PM_ARGS = ("--compaction-interval-ms", "1000", "--compaction-roll-bytes", "64KiB")
#: tiered streams' ranges roll, go to the object store and leave the nodes within seconds
TIERING_PM_ARGS = ("--tiering-interval-ms", "500", "--tiered-roll-bytes", "64KiB")


@dataclass(frozen=True)
class RunSettings:
    seed: int
    duration_s: float
    nodes: int = 3
    kinds: tuple[str, ...] = KINDS
    small_map_node: str | None = None
    workload: WorkloadSettings = field(default_factory=WorkloadSettings)
    #: the PM's --repair-after-ms (None: its default, longer than most runs)
    repair_after_ms: int | None = None


@dataclass
class RunResult:
    settings: RunSettings
    schedule: list[Fault]
    history: History
    verdict: checker.Verdict
    stored: list[checker.StoredStream]
    tracebacks: dict[str, int]
    elapsed_s: float
    root: Path
    #: rows in the streams' Iceberg tables at the end (``--tables`` runs)
    table_rows: int | None = None


def replay_command(settings: RunSettings) -> str:
    """The command line that runs the same schedule on the same cluster shape."""
    parts = [
        "python -m bench chaos",
        f"--seed {settings.seed}",
        f"--duration {settings.duration_s:g}",
    ]
    if settings.nodes != RunSettings.nodes:
        parts.append(f"--nodes {settings.nodes}")
    if settings.kinds != KINDS:
        parts.append(f"--faults {','.join(settings.kinds)}")
    if settings.repair_after_ms is not None:
        parts.append(f"--repair-after-ms {settings.repair_after_ms}")
    if settings.small_map_node != "node-3":
        parts.append(f"--small-map-node '{settings.small_map_node or ''}'")
    defaults = WorkloadSettings()
    if settings.workload.producers != defaults.producers:
        parts.append(f"--producers {settings.workload.producers}")
    if settings.workload.replicas != defaults.replicas:
        parts.append(f"--replicas {settings.workload.replicas}")
    if settings.workload.compacted_keys:
        parts.append(f"--compacted-keys {settings.workload.compacted_keys}")
    if settings.workload.tables:
        parts.append("--tables")
    if settings.workload.tiered:
        parts.append("--tiered")
    return " ".join(parts)


def plan(settings: RunSettings) -> list[Fault]:
    nodes = [f"node-{i}" for i in range(1, settings.nodes + 1)]
    links = ["clients->pm", *(f"{n}->pm" for n in nodes), *(f"->{n}" for n in nodes)]
    others = ["tables"] if settings.workload.tables else []
    if settings.workload.tiered:
        links.append("->object-store")
        others.append("object-store")
    return draw_schedule(
        settings.seed, settings.duration_s, nodes, links, settings.kinds, others=others
    )


async def run(settings: RunSettings, root: Path) -> RunResult:
    schedule = plan(settings)
    history = History(
        idempotent=settings.workload.idempotent, compacted_keys=settings.workload.compacted_keys
    )
    cluster = ChaosCluster(
        root,
        settings.nodes,
        small_map_node=settings.small_map_node,
        pm_args=(
            *(COMPACTING_PM_ARGS if settings.workload.compacted_keys else ()),
            *(TIERING_PM_ARGS if settings.workload.tiered else ()),
            *(
                ("--repair-after-ms", str(settings.repair_after_ms))
                if settings.repair_after_ms is not None
                else ()
            ),
        ),
        tables=settings.workload.tables,
        object_store=settings.workload.tiered,
    )
    wall_start = time.monotonic()
    async with trio.open_nursery() as nursery:
        try:
            await cluster.start(nursery)
            also = " and sbp-tables" if settings.workload.tables else ""
            also += " and an object store" if settings.workload.tiered else ""
            print(f"cluster up: PM, {settings.nodes} data nodes{also}, logs in {root / 'logs'}")
            started = trio.current_time()
            workload = Workload(cluster.pm_address, history, settings.workload, settings.seed)
            async with trio.open_nursery() as running:
                await running.start(workload.run, time.monotonic())
                injector = Injector(cluster, history, started)
                running.start_soon(_progress, history, started, settings.duration_s)
                await injector.play(schedule)
                await trio.sleep_until(started + settings.duration_s)
                print("healing: every link back, every server up", flush=True)
                await cluster.heal_all()
                workload.stop()
                # let the producers' last values settle, consumers catch up
                await trio.sleep(SETTLE_S)
                await workload.settled()
                running.cancel_scope.cancel()
            await _moves_done(cluster.pm_address)
            stored = await _read_back(cluster.pm_address, history.streams)
            if settings.workload.tables:
                tables = await tables_check.read_tables(root, stored)
        finally:
            await cluster.stop_all()
            nursery.cancel_scope.cancel()
    verdict = checker.check(history, stored)
    if settings.workload.tables:
        tables_check.check_tables(verdict, history, stored, tables)
    return RunResult(
        settings,
        schedule,
        history,
        verdict,
        stored,
        cluster.log_tracebacks(),
        time.monotonic() - wall_start,
        root,
        sum(len(rows) for _, rows in tables.values()) if settings.workload.tables else None,
    )


async def _progress(history: History, started: float, duration: float) -> None:
    """A line every 10 s: where the run is and what it has seen."""
    while True:
        await trio.sleep(10)
        elapsed = trio.current_time() - started
        counts = history.counts()
        print(
            f"  {min(elapsed, duration):5.0f}/{duration:.0f} s  acked {counts['ack']:,}  "
            f"unknown {counts['unknown']:,}  failed {counts['failed']:,}  "
            f"faults {len(history.faults)}",
            flush=True,
        )


async def _moves_done(pm_address: str) -> None:
    """Wait (up to ``MOVES_SETTLE_S``) until no rebalance moves ranges: the
    copies of a move started near the end would otherwise be read while
    they catch up, each replica waited for in turn."""
    with trio.move_on_after(MOVES_SETTLE_S) as waited:
        async with PMClient(pm_address) as pm:
            while True:
                try:
                    if (await pm.rebalance(dry_run=True, timeout=10)).pending == 0:
                        return
                except EXPECTED:
                    pass
                await trio.sleep(0.5)
    if waited.cancelled_caught:
        print(f"moves of ranges still under way after {MOVES_SETTLE_S:.0f} s", flush=True)


async def _read_back(pm_address: str, streams: list[int]) -> list[checker.StoredStream]:
    """Every stream from its first stored offset to its end, its ranges, and
    what each replica of each range holds (read from that node itself)."""
    stored: list[checker.StoredStream] = []
    for stream_id in streams:
        records: list[tuple[int, bytes]] = []
        ranges: list[tuple[int, int]] = []
        replicas: dict[str, tuple[int, int, list[tuple[int, bytes]]]] = {}
        error = ""
        offloaded = 0
        try:
            with trio.fail_after(FINAL_READ_TIMEOUT_S):
                async with PMClient(pm_address) as pm:
                    wire = await pm.list_stream_ranges(stream_id, timeout=10)
                    ranges = [(r.start_offset, -1 if r.is_open else r.end_offset) for r in wire]
                    offloaded = sum(1 for r in wire if r.object_state == ObjectState.IN_STORE_ONLY)
                async with Consumer(pm_address, stream_id, retry_timeout=60) as consumer:
                    async for record in consumer.records():
                        records.append((record.offset, record.value))
                end = records[-1][0] + 1 if records else 0
                for rng in wire:
                    if len(rng.replica_nodes) > 1:
                        stop = end if rng.is_open else rng.end_offset
                        expected = sum(1 for at, _ in records if rng.start_offset <= at < stop)
                        for replica in rng.replica_nodes:
                            key = f"range {rng.range_index} on node {replica.data_node.node_id}"
                            held = await _settled_replica(
                                replica.data_node.advertise_addr,
                                stream_id,
                                rng.start_offset,
                                stop,
                                expected,
                            )
                            replicas[key] = (rng.start_offset, stop, held)
        except (*EXPECTED, trio.TooSlowError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        stored.append(checker.StoredStream(stream_id, records, ranges, error, replicas, offloaded))
    return stored


async def _settled_replica(
    address: str, stream_id: int, start: int, stop: int, expected: int
) -> list[tuple[int, bytes]]:
    """What a replica holds of [start, stop), read again for up to
    ``REPLICA_SETTLE_S`` while it holds fewer records than the stream: a
    follower of an open range may trail the records already acknowledged by
    the others (A of R), and a short replica of a sealed range catches up;
    what is checked is where replicas end up, not a moment of that."""
    deadline = trio.current_time() + REPLICA_SETTLE_S
    while True:
        held = await _read_replica(address, stream_id, start, stop)
        if len(held) >= expected or trio.current_time() >= deadline:
            return held
        await trio.sleep(0.2)


async def _read_replica(
    address: str, stream_id: int, start: int, stop: int
) -> list[tuple[int, bytes]]:
    """Records [start, stop) of a stream as one data node holds them (FETCH
    straight from it, not through the PM's choice of primary)."""
    records: list[tuple[int, bytes]] = []
    offset = start
    async with DataNodeClient(address) as node:
        while offset < stop:
            fetch = messages.FetchRequest(
                max_wait_ms=0,
                min_bytes=1,
                fetch_requests=(
                    messages.FetchInfo(
                        stream_id=stream_id,
                        request_index=0,
                        fetch_offset=offset,
                        batch_max_bytes=1 << 20,
                    ),
                ),
            )
            response = await node.call(Opcode.FETCH, fetch, timeout=10)
            (result,) = response.header.fetch_responses
            if result.error_code != ErrorCode.NONE or not response.payload:
                break
            decoded = decode_batches(response.payload)
            for i, at in enumerate(decoded.offsets.tolist()):
                if start <= at < stop:
                    records.append((at, decoded.value(i)))
            offset = int(decoded.offsets[-1]) + 1
    return records
