"""Data node benchmarks: durable append throughput over the wire, compared in
the same run with the storage engine's own group-commit rate, and the FETCH
wake-up latency from an append's acknowledgement to a waiting consumer.

    .venv/bin/python -m bench.datanode [--seconds 5] [--sync always|never]
    .venv/bin/python -m bench.datanode --metrics-cost [--rounds 4]

``--metrics-cost`` runs two nodes, one serving /metrics (``--metrics-listen``)
and one without (no per-frame metrics on the hot path), and alternates the
same 1-connection append run between them.

The node runs as a real process (``python -m datanode``), started as a user
starts it; the clients run in this process over loopback. Its CPU use is read
with psutil (user + system time of the node process over the run's wall time:
100 % is one core).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import trio

from bench.storage import make_batch, run_engine
from net.connection import Connection
from net.metrics import ServerMetrics, new_registry
from net.service import LISTENING_PREFIX
from sbp import messages
from sbp.connection import Side
from sbp.enums import ErrorCode, Opcode

BATCH_SIZE = 64 * 1024
SINGLE_IN_FLIGHT = 64
MULTI_CONNECTIONS = 8
MULTI_IN_FLIGHT = 8
PROBE_INTERVAL_S = 0.005


@dataclass
class Throughput:
    label: str
    seconds: float
    batches: int
    bytes: int
    node_cpu: float  # fraction of one core

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6

    @property
    def cpu_per_append(self) -> float:
        """Seconds of node CPU per APPEND."""
        return self.node_cpu * self.seconds / max(1, self.batches)


#: bytes a node may append per second at most, for sizing its map: above
#: what any of these hosts reaches, so that a long run never fills it
APPEND_RATE_CEILING = 2_000_000_000


def map_size_for(seconds: float) -> int:
    """An LMDB map for ``seconds`` of appending, at least the node's default
    (it is address space: the file grows with the data)."""
    return max(8 << 30, int(seconds * APPEND_RATE_CEILING))


class NodeProcess:
    """``python -m datanode`` in a temporary directory, its map sized for
    ``seconds`` of appending."""

    def __init__(self, root: Path, sync: str, seconds: float, extra: tuple[str, ...] = ()) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.stdout_path = root / "node.stdout"
        with self.stdout_path.open("wb") as out, (root / "node.stderr").open("wb") as err:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "datanode",
                    "--node-id",
                    "1",
                    "--data-dir",
                    str(root / "data"),
                    "--sync",
                    sync,
                    "--log-level",
                    "warning",
                    "--map-size",
                    str(map_size_for(seconds)),
                    *extra,
                ],
                stdout=out,
                stderr=err,
            )
        self.address = self._wait_for_address()
        self.ps = psutil.Process(self.process.pid)

    def _wait_for_address(self) -> str:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for line in self.stdout_path.read_text().splitlines():
                if line.startswith(LISTENING_PREFIX):
                    return line[len(LISTENING_PREFIX) :].strip()
            if self.process.poll() is not None:
                raise RuntimeError(f"the data node exited with {self.process.returncode}")
            time.sleep(0.02)
        raise RuntimeError("the data node did not report its address")

    def cpu_seconds(self) -> float:
        times = self.ps.cpu_times()
        return float(times.user + times.system)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


async def open_connection(address: str, nursery: trio.Nursery) -> Connection:
    host, _, port = address.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    connection = Connection(stream, side=Side.CLIENT, peer=address)
    await nursery.start(connection.run)
    return connection


def one_range(stream_id: int, address: str) -> messages.StreamRanges:
    replica = messages.ReplicaNode(
        data_node=messages.DataNode(node_id=1, advertise_addr=address), is_primary=True
    )
    wire = messages.Range(stream_id=stream_id, range_index=0, replica_nodes=(replica,))
    return messages.StreamRanges(stream_id=stream_id, ranges=(wire,))


async def create_streams(connection: Connection, address: str, stream_ids: range) -> None:
    request = messages.SyncRangesRequest(
        stream_ranges=tuple(one_range(stream_id, address) for stream_id in stream_ids)
    )
    await connection.request(Opcode.SYNC_RANGES, request, timeout=30)


def append_header(stream_id: int, batch: bytes) -> bytes:
    return messages.AppendRequest(
        timeout_ms=30_000,
        append_requests=(
            messages.AppendInfo(stream_id=stream_id, request_index=0, batch_length=len(batch)),
        ),
    ).encode()


async def append_loop(
    connection: Connection,
    stream_id: int,
    batch: bytes,
    in_flight: int,
    stop_at: float,
    count: Callable[[int], None],
    pace: float = 0.0,
) -> None:
    """Keep ``in_flight`` appends outstanding until ``stop_at`` (trio time);
    with ``pace``, each lane sends one append per ``pace`` seconds at most."""
    header = append_header(stream_id, batch)

    async def lane() -> None:
        next_send = trio.current_time()
        while trio.current_time() < stop_at:
            if pace:
                await trio.sleep_until(next_send)
                next_send += pace
            response = await connection.request(Opcode.APPEND, header, batch, timeout=30)
            (result,) = response.header.append_responses
            if result.error_code != ErrorCode.NONE:
                raise RuntimeError(f"append failed: {result.error_code!r}")
            count(len(batch))

    async with trio.open_nursery() as nursery:
        for _ in range(in_flight):
            nursery.start_soon(lane)


async def measure_appends(
    node: NodeProcess, label: str, connections: int, in_flight: int, seconds: float, first: int
) -> Throughput:
    batch = make_batch(BATCH_SIZE)
    totals = [0, 0]

    def count(nbytes: int) -> None:
        totals[0] += 1
        totals[1] += nbytes

    async with trio.open_nursery() as nursery:
        links = [await open_connection(node.address, nursery) for _ in range(connections)]
        await create_streams(links[0], node.address, range(first, first + connections))
        cpu_before = node.cpu_seconds()
        started = trio.current_time()
        async with trio.open_nursery() as load:
            for i, link in enumerate(links):
                load.start_soon(
                    append_loop, link, first + i, batch, in_flight, started + seconds, count
                )
        elapsed = trio.current_time() - started
        cpu = (node.cpu_seconds() - cpu_before) / elapsed
        nursery.cancel_scope.cancel()
    return Throughput(label, elapsed, totals[0], totals[1], cpu)


async def measure_wakeup(
    node: NodeProcess, background_mb_s: float, seconds: float, first: int
) -> list[float]:
    """Latency (s) from each probe append's acknowledgement to its arrival at
    a consumer long-polling the stream's tail, under ``background_mb_s`` of
    other appends."""
    batch = make_batch(BATCH_SIZE)
    probe = bytes(make_batch(1024))
    acked: dict[int, float] = {}
    received: dict[int, float] = {}
    probe_stream, load_streams = first, range(first + 1, first + 1 + MULTI_CONNECTIONS)
    per_lane_pace = MULTI_CONNECTIONS * 2 * len(batch) / (background_mb_s * 1e6)

    async with trio.open_nursery() as nursery:
        admin = await open_connection(node.address, nursery)
        await create_streams(admin, node.address, range(first, first + 1 + MULTI_CONNECTIONS))
        consumer = await open_connection(node.address, nursery)
        producer = await open_connection(node.address, nursery)
        load_links = [await open_connection(node.address, nursery) for _ in load_streams]
        stop_at = trio.current_time() + seconds

        async def consume() -> None:
            offset = 0
            while True:
                fetch = messages.FetchRequest(
                    max_wait_ms=10_000,
                    fetch_requests=(
                        messages.FetchInfo(
                            stream_id=probe_stream, fetch_offset=offset, batch_max_bytes=1 << 20
                        ),
                    ),
                )
                response = await consumer.request(Opcode.FETCH, fetch, timeout=30)
                now = trio.current_time()
                (result,) = response.header.fetch_responses
                payload = bytes(response.payload)
                position = 0
                while position < result.batch_length:
                    base = int.from_bytes(payload[position : position + 8], "big", signed=True)
                    count = int.from_bytes(payload[position + 19 : position + 23], "big")
                    received.setdefault(base, now)
                    offset = base + count
                    position += 12 + int.from_bytes(payload[position + 8 : position + 12], "big")

        async def produce() -> None:
            header = append_header(probe_stream, probe)
            while trio.current_time() < stop_at:
                response = await producer.request(Opcode.APPEND, header, probe, timeout=30)
                acked[response.header.append_responses[0].base_offset] = trio.current_time()
                await trio.sleep(PROBE_INTERVAL_S)

        nursery.start_soon(consume)
        async with trio.open_nursery() as load:
            for link, stream_id in zip(load_links, load_streams, strict=True):
                load.start_soon(
                    append_loop, link, stream_id, batch, 2, stop_at, lambda _n: None, per_lane_pace
                )
            load.start_soon(produce)
        await trio.sleep(0.2)
        nursery.cancel_scope.cancel()
    return sorted(received[offset] - acked[offset] for offset in acked if offset in received)


def percentile(sorted_values: list[float], fraction: float) -> float:
    index = min(len(sorted_values) - 1, max(0, math.ceil(fraction * len(sorted_values)) - 1))
    return sorted_values[index]


async def run_node_benchmarks(
    node: NodeProcess, seconds: float
) -> tuple[list[Throughput], list[float], float]:
    single = await measure_appends(node, "1 connection", 1, SINGLE_IN_FLIGHT, seconds, 1)
    multi = await measure_appends(
        node, f"{MULTI_CONNECTIONS} connections", MULTI_CONNECTIONS, MULTI_IN_FLIGHT, seconds, 100
    )
    peak = max(single.mb_per_s, multi.mb_per_s)
    latencies = await measure_wakeup(node, peak / 2, seconds, 200)
    return [single, multi], latencies, peak


async def compare_metrics(
    with_metrics: NodeProcess, without: NodeProcess, seconds: float, rounds: int
) -> tuple[list[Throughput], list[Throughput]]:
    """Alternate the same append run between the two nodes."""
    on: list[Throughput] = []
    off: list[Throughput] = []
    for i in range(rounds):
        # Swap which goes first each round, so drift in the machine's load
        # does not favour one side.
        order = [(with_metrics, on), (without, off)]
        for node, results in order if i % 2 == 0 else reversed(order):
            results.append(await measure_appends(node, "", 1, SINGLE_IN_FLIGHT, seconds, 1000 + i))
    return on, off


def observer_seconds_per_request() -> float:
    """CPU time the metrics observer adds to one APPEND: its four calls
    (frame in, request start and finish, frame out), timed in this process."""
    registry = new_registry()
    observer = ServerMetrics(registry)

    def one_request() -> None:
        observer.frame_received(Opcode.APPEND, BATCH_SIZE)
        observer.request_started(Opcode.APPEND)
        observer.request_finished(Opcode.APPEND, 0.002, ErrorCode.NONE)
        observer.frame_sent(Opcode.APPEND, 100)

    number = 200_000
    return min(timeit.repeat(one_request, number=number, repeat=5)) / number


def metrics_cost(root: Path, sync: str, seconds: float, rounds: int) -> None:
    writing = seconds * rounds
    with_metrics = NodeProcess(root / "on", sync, writing, ("--metrics-listen", "127.0.0.1:0"))
    without = NodeProcess(root / "off", sync, writing)
    try:
        on, off = trio.run(compare_metrics, with_metrics, without, seconds, rounds)
    finally:
        with_metrics.stop()
        without.stop()
    median_on = statistics.median(run.mb_per_s for run in on)
    median_off = statistics.median(run.mb_per_s for run in off)
    node_cpu_per_request = statistics.median(run.cpu_per_append for run in off)
    observer = observer_seconds_per_request()
    print(f"metrics cost: 1 connection x {SINGLE_IN_FLIGHT} in flight, 64 KiB, sync {sync}")
    for label, runs, median in (("with /metrics", on, median_on), ("without", off, median_off)):
        values = ", ".join(f"{run.mb_per_s:.0f}" for run in runs)
        print(f"  {label:<14} {values} MB/s (median {median:.0f})")
    print(f"  A/B difference of the medians: {1 - median_on / median_off:+.1%}")
    print(
        f"  observer: {observer * 1e6:.2f} µs per APPEND against "
        f"{node_cpu_per_request * 1e6:.0f} µs of node CPU per APPEND: "
        f"{observer / node_cpu_per_request:.2%} of the node's work"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each run")
    parser.add_argument("--sync", choices=("always", "never"), default="always")
    parser.add_argument(
        "--metrics-cost", action="store_true", help="append throughput with /metrics on vs off"
    )
    parser.add_argument("--rounds", type=int, default=4, help="--metrics-cost runs of each")
    args = parser.parse_args()
    if args.metrics_cost:
        root = Path(tempfile.mkdtemp(prefix="bench-metrics-"))
        try:
            metrics_cost(root, args.sync, args.seconds, args.rounds)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    root = Path(tempfile.mkdtemp(prefix="bench-datanode-"))
    try:
        node = NodeProcess(root, args.sync, 3 * args.seconds)  # two runs and the probes
        try:
            runs, latencies, peak = trio.run(run_node_benchmarks, node, args.seconds)
        finally:
            node.stop()
        batch = make_batch(BATCH_SIZE)
        total = max(200, int(peak * 1e6 * args.seconds / len(batch)))
        engine = run_engine(root / "engine", batch, total, args.sync)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    engine_mb_s = engine.bytes / engine.seconds / 1e6
    print(f"data node, {len(batch):,}-byte batches, sync {args.sync}, {os.cpu_count()} cores")
    print()
    print(
        "| clients | in flight | MB/s | batches/s | node CPU | node CPU per APPEND "
        "| of engine rate |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for run, in_flight in zip(runs, (SINGLE_IN_FLIGHT, MULTI_IN_FLIGHT), strict=True):
        print(
            f"| {run.label} | {in_flight} per connection | {run.mb_per_s:,.0f} | "
            f"{run.batches / run.seconds:,.0f} | {run.node_cpu:.0%} | "
            f"{run.cpu_per_append * 1e6:,.0f} µs | {run.mb_per_s / engine_mb_s:.0%} |"
        )
    print(
        f"| storage engine alone (bench.storage) | 4 x 16 | {engine_mb_s:,.0f} | "
        f"{engine.batches / engine.seconds:,.0f} | n/a | n/a | 100% |"
    )
    print()
    if latencies:
        print(
            f"FETCH wake-up, append acknowledged -> waiting consumer has the batch, "
            f"{len(latencies)} probes at ~{peak / 2:,.0f} MB/s background: "
            f"p50 {percentile(latencies, 0.5) * 1e3:.2f} ms, "
            f"p99 {percentile(latencies, 0.99) * 1e3:.2f} ms, "
            f"max {latencies[-1] * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
