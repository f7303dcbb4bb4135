"""How fast a drain moves sealed ranges, and what it costs appends nearby
(SPEC §12):

    .venv/bin/python -m bench.drain [--gb 1] [--out FILE]

A PM and three data nodes (``client.launcher``, sync always; the PM with
``--max-move-bytes-per-s 0``, no pace). Node 1 is given ``--gb`` of sealed
ranges of one replica: 16 streams whose range 0 is on node 1, each filled
with 1 MiB batches and sealed. A producer appends 64 KiB batches to a
stream on node 2:

1. its peak: appends per second with 8 in flight, for 5 s;
2. the baseline: an open loop at half that rate for ``--seconds``, its p99;
3. the drain: node 1 drained while the same open loop runs; the bytes
   moved over the time until node 1 is drained, and the loop's p99 over
   that time.

The drain's rate counts the bytes node 1 held when the drain began.

``--ranges N`` measures the other bound of a drain, its steps per range:
a PM and two data nodes, ``2N`` streams of one replica created empty (about
``N`` of them on node 1), and node 1 drained with nothing else running: the
ranges moved per second, sealing the open ones included.

``--split-cpus`` runs the producer and node 2 on CPU 0 and everything else
(node 1, node 3, the PM) on CPU 1, as on machines of their own: what the
drain costs the producer through the cluster, apart from what it costs
through sharing the CPUs of one machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from bench.output import emit
from client.children import Child
from client.datanode_client import DataNodeClient
from client.launcher import Plan, plan_children, running_plan
from client.pm_client import PMClient
from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import build_batch
from sbp.enums import DataNodeState

from .harness import Load, batch_64k, one_stream_64k, pace_trio, percentiles_ms

STREAMS = 16
FILL_BATCH = 1 << 20
PEAK_S = 5.0
PEAK_IN_FLIGHT = 8


def _primary(rng: messages.Range) -> str:
    node = rng.primary_node()
    return "" if node is None else node.advertise_addr


async def _fill(pm: PMClient, pool: ConnectionPool, address: str, total: int) -> list[int]:
    """Streams whose range 0 is on ``address``, filled with ``total`` bytes
    in all and sealed."""
    streams: list[int] = []
    batch = bytes(build_batch([bytes(FILL_BATCH - 100)], base_timestamp=1))
    per_stream = max(1, total // STREAMS // len(batch))
    while len(streams) < STREAMS:
        created = (await pm.create_stream(1)).range
        assert created is not None
        if _primary(created) != address:
            continue
        node = DataNodeClient(address, pool=pool, timeout=60)

        async def put(stream_id: int, count: int, node: DataNodeClient = node) -> None:
            for _ in range(count):
                await node.append_batch(stream_id, batch)

        async with trio.open_nursery() as nursery:
            for lane in range(4):
                nursery.start_soon(
                    put, created.stream_id, per_stream // 4 + (lane < per_stream % 4)
                )
        await pm.seal_range(created.stream_id, 0)
        streams.append(created.stream_id)
    return streams


async def _peak(node: DataNodeClient, stream_id: int) -> float:
    batch, _ = batch_64k()
    done = 0
    started = time.perf_counter()

    async def lane() -> None:
        nonlocal done
        while time.perf_counter() - started < PEAK_S:
            await node.append_batch(stream_id, batch)
            done += 1

    async with trio.open_nursery() as nursery:
        for _ in range(PEAK_IN_FLIGHT):
            nursery.start_soon(lane)
    return done / (time.perf_counter() - started)


async def _nodes_alive(pm: PMClient, count: int) -> None:
    """Wait until the PM holds ``count`` data nodes alive."""
    with trio.fail_after(30):
        while sum(s.alive for s in await pm.describe_cluster()) < count:
            await trio.sleep(0.2)


async def _drained(pm: PMClient, node_id: int) -> bool:
    statuses = await pm.describe_cluster()
    return any(
        s.data_node.node_id == node_id and s.state == DataNodeState.DRAINED for s in statuses
    )


def _pin(pid: int, cpu: int) -> None:
    """Every thread of process ``pid`` on ``cpu`` alone."""
    for thread in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(thread.name), {cpu})


def _child_pid(child: Child) -> int:
    assert child.process is not None
    return child.process.pid


async def measure(
    root: Path, gb: float, seconds: float, pace: str, split_cpus: bool = False
) -> dict[str, Any]:
    pm_child, nodes = plan_children(root, 3, "127.0.0.1", 0, "always", sys.executable)
    pm_child.argv += ["--max-move-bytes-per-s", pace, "--rebalance-interval-ms", "0"]
    async with running_plan(Plan([], [pm_child], nodes), root), ConnectionPool() as pool:
        if split_cpus:
            for child in (pm_child, nodes[0], nodes[2]):
                _pin(_child_pid(child), 1)
            _pin(_child_pid(nodes[1]), 0)
            _pin(os.getpid(), 0)
        pm = PMClient(pm_child.address, pool=pool, timeout=60)
        await _nodes_alive(pm, 3)
        victim, neighbour = nodes[0].address, nodes[1].address
        print(f"filling node 1 with {gb:g} GB of sealed ranges …", flush=True)
        await _fill(pm, pool, victim, int(gb * 1e9))
        while True:
            created = (await pm.create_stream(1)).range
            assert created is not None
            if _primary(created) == neighbour:
                break
        producer_stream = created.stream_id
        node = DataNodeClient(neighbour, pool=pool, timeout=30)
        batch, _ = batch_64k()

        async def send() -> None:
            await node.append_batch(producer_stream, batch)

        peak = await _peak(node, producer_stream)
        rate = peak / 2
        print(f"producer peak {peak:,.0f} appends/s; paced at {rate:,.0f}", flush=True)
        baseline = await pace_trio(send, one_stream_64k(), rate, Load(1, seconds, warmup=1.0))
        held = sum(
            h.bytes
            for h in await DataNodeClient(victim, pool=pool).range_holdings(
                [
                    messages.RangeId(r.stream_id, r.range_index)
                    for r in await pm.list_node_ranges(messages.DataNode(1, victim))
                ]
            )
        )
        during: list[float] = []
        finished = trio.Event()
        drain_s = 0.0

        async def drain() -> None:
            nonlocal drain_s
            started = time.perf_counter()
            await pm.drain_data_nodes([1])
            while not await _drained(pm, 1):
                await trio.sleep(0.1)
            drain_s = time.perf_counter() - started
            finished.set()

        async def paced() -> None:
            interval = 1 / rate
            next_send = time.perf_counter()
            async with trio.open_nursery() as nursery:
                while not finished.is_set():
                    await trio.sleep(max(0.0, next_send - time.perf_counter()))
                    nursery.start_soon(_timed, send, during)
                    next_send += interval

        async with trio.open_nursery() as nursery:
            nursery.start_soon(paced)
            await drain()
    base_p99 = percentiles_ms(baseline.latencies)["p99"]
    drain_p99 = percentiles_ms(during)["p99"]
    return {
        "gb_moved": round(held / 1e9, 3),
        "drain_seconds": round(drain_s, 2),
        "drain_mb_per_s": round(held / drain_s / 1e6, 1),
        "producer_peak_appends_per_s": round(peak),
        "producer_rate_appends_per_s": round(rate),
        "producer_p99_ms_without_drain": base_p99,
        "producer_p99_ms_during_drain": drain_p99,
        "p99_ratio": round(drain_p99 / base_p99, 2) if base_p99 else None,
        "appends_during_drain": len(during),
        "split_cpus": split_cpus,
    }


async def measure_ranges(root: Path, ranges: int) -> dict[str, Any]:
    pm_child, nodes = plan_children(root, 2, "127.0.0.1", 0, "always", sys.executable)
    pm_child.argv += ["--max-move-bytes-per-s", "0", "--rebalance-interval-ms", "0"]
    async with running_plan(Plan([], [pm_child], nodes), root), ConnectionPool() as pool:
        pm = PMClient(pm_child.address, pool=pool, timeout=120)
        await _nodes_alive(pm, 2)
        streams = 2 * ranges  # placed in turn on the two nodes
        for start in range(0, streams, 100):
            await pm.create_streams([messages.Stream(replica_nums=1)] * min(100, streams - start))
        held = len(await pm.list_node_ranges(messages.DataNode(1, nodes[0].address)))
        print(f"draining node 1, which holds {held:,} ranges …", flush=True)
        started = time.perf_counter()
        await pm.drain_data_nodes([1])
        while not await _drained(pm, 1):
            await trio.sleep(0.1)
        seconds = time.perf_counter() - started
    return {
        "ranges_moved": held,
        "drain_seconds": round(seconds, 2),
        "ranges_per_s": round(held / seconds),
    }


async def _timed(send: Any, into: list[float]) -> None:
    started = time.perf_counter()
    await send()
    into.append(time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.drain", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--gb", type=float, default=1.0, help="sealed data on the node (default 1)")
    parser.add_argument("--seconds", type=float, default=10.0, help="baseline window (default 10)")
    parser.add_argument(
        "--pace", default="0", help="the PM's --max-move-bytes-per-s (default 0: none)"
    )
    parser.add_argument(
        "--split-cpus",
        action="store_true",
        help="the producer and its node on CPU 0, the other nodes and the PM on CPU 1",
    )
    parser.add_argument(
        "--ranges",
        type=int,
        metavar="N",
        help="instead: drain a node holding about N empty ranges, with nothing else running; "
        "ranges moved per second",
    )
    parser.add_argument("--out", type=Path, help="write the result as JSON here too")
    args = parser.parse_args(argv)
    if args.split_cpus and not {0, 1} <= os.sched_getaffinity(0):
        parser.error("--split-cpus needs CPUs 0 and 1")
    if args.ranges is not None and args.ranges < 1:
        parser.error("--ranges must be at least 1")
    with tempfile.TemporaryDirectory(prefix="bench-drain-") as root:
        if args.ranges is not None:
            result = trio.run(measure_ranges, Path(root), args.ranges)
        else:
            result = trio.run(
                measure, Path(root), args.gb, args.seconds, args.pace, args.split_cpus
            )
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
