"""What consumer groups (SPEC §11) cost: commits per second, the PM's CPU
for keeping lag current, and FIND_OFFSETS on a large range.

    .venv/bin/python -m bench.groups [--quick] [--out FILE]

- **Commits.** A PM on LMDB and one data node, then three PMs on three etcd
  members (``sbp-cluster --ha``), run as real processes; COMMIT_OFFSETS of
  100 positions each, one request in flight, for ``--seconds``: positions
  committed per second.
- **Lag.** ``--streams`` streams (10,000) each read by ``--groups`` groups
  (10), so 100,000 positions; the PM asks the primaries for the streams'
  ends every 5 s (its default) and /metrics is scraped every 15 s, for
  ``--lag-seconds``; the PM's CPU over that window, as a share of one core.
- **FIND_OFFSETS.** A storage engine (no sync) gets ``--range-gb`` of 64 KiB
  batches in one range, 8 batches per commit; then FIND_OFFSETS of random
  times over the range, in process: the median and p99 per call.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import trio

from bench.output import emit
from client.launcher import Plan, plan_children, plan_ha, running_plan
from client.pm_client import PMClient
from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import build_batch
from storage import AppendItem, StorageEngine
from storage.model import RangeInfo, ReplicaInfo

COMMIT_ITEMS = 100
SCRAPE_EVERY_S = 15.0


async def _create_streams(pm: PMClient, count: int) -> list[int]:
    ids: list[int] = []
    for first in range(0, count, 1000):
        wanted = [messages.Stream(replica_nums=1)] * min(1000, count - first)
        created = await pm.create_streams(wanted, timeout=120)
        ids += [c.stream.stream_id for c in created if c.stream is not None]
    return ids


async def _commit_rate(pm: PMClient, streams: list[int], seconds: float) -> float:
    """Positions committed per second, 100 per COMMIT_OFFSETS, one in flight."""
    committed = 0
    started = time.perf_counter()
    round_index = 0
    while time.perf_counter() - started < seconds:
        chunk = streams[(round_index * COMMIT_ITEMS) % len(streams) :][:COMMIT_ITEMS]
        items = [messages.GroupOffset(stream_id=s, offset=0) for s in chunk]
        results = await pm.commit_offsets(f"bench-{round_index % 10}", items)
        assert all(r.error_code == 0 for r in results), results[0]
        committed += len(items)
        round_index += 1
    return committed / (time.perf_counter() - started)


async def commits(root: Path, seconds: float, ha: bool) -> float:
    python = sys.executable
    if ha:
        plan = plan_ha(root, 1, "127.0.0.1", 0, "always", python)
    else:
        pm_child, nodes = plan_children(root, 1, "127.0.0.1", 0, "always", python)
        plan = Plan([], [pm_child], nodes)
    async with running_plan(plan, root), ConnectionPool() as pool:
        pm = PMClient(plan.pm_addresses, pool=pool, timeout=30)
        streams = await _create_streams(pm, 1000)
        return await _commit_rate(pm, streams, seconds)


def _scrape(address: str) -> int:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as answer:
        return len(answer.read())


async def lag_cpu(root: Path, streams: int, groups: int, seconds: float) -> dict[str, float]:
    pm_child, nodes = plan_children(root, 1, "127.0.0.1", 0, "always", sys.executable)
    async with running_plan(Plan([], [pm_child], nodes), root), ConnectionPool() as pool:
        pm = PMClient(pm_child.address, pool=pool, timeout=120)
        ids = await _create_streams(pm, streams)
        for group in range(groups):
            for first in range(0, len(ids), COMMIT_ITEMS):
                items = [
                    messages.GroupOffset(stream_id=s, offset=0)
                    for s in ids[first : first + COMMIT_ITEMS]
                ]
                await pm.commit_offsets(f"group-{group}", items)
        assert pm_child.process is not None and pm_child.metrics_address is not None
        process = psutil.Process(pm_child.process.pid)
        await trio.sleep(6)  # one round of end offsets with every position in place
        before = process.cpu_times()
        started = time.perf_counter()
        scrape_s: list[float] = []
        while time.perf_counter() - started < seconds:
            scraped = time.perf_counter()
            await trio.to_thread.run_sync(_scrape, pm_child.metrics_address)
            scrape_s.append(time.perf_counter() - scraped)
            await trio.sleep(SCRAPE_EVERY_S)
        after = process.cpu_times()
        window = time.perf_counter() - started
        used = (after.user - before.user) + (after.system - before.system)
        return {
            "positions": len(ids) * groups,
            "pm_cpu_share_of_a_core": used / window,
            "scrape_median_s": statistics.median(scrape_s),
        }


def find_offsets(root: Path, range_gb: float, probes: int) -> dict[str, float]:
    """FIND_OFFSETS in process on one range of ``range_gb`` of 64 KiB batches."""
    batch = bytes(build_batch([os.urandom(64 * 1024 - 64)], 0))
    count = int(range_gb * (1 << 30) / len(batch))
    map_size = int((range_gb + 2) * (1 << 30))
    with StorageEngine(root / "node", map_size=map_size, node_id=1, sync="never") as engine:
        replicas = (ReplicaInfo(1, "a:1", True),)
        engine.sync_ranges(1, [RangeInfo(1, 0, 0, replicas=replicas)]).result()
        first_ms = int(time.time() * 1000)
        in_flight = threading.Semaphore(16)
        for n in range(0, count, 8):
            in_flight.acquire()
            items = [AppendItem(1, batch)] * min(8, count - n)
            engine.submit(items, lambda _outcomes: in_flight.release())
        for _ in range(16):
            in_flight.acquire()
        last_ms = int(time.time() * 1000)
        seconds = []
        for _ in range(probes):
            moment = random.randint(first_ms, last_ms)
            started = time.perf_counter()
            engine.find_offset(1, 0, moment)
            seconds.append(time.perf_counter() - started)
        seconds.sort()
        return {
            "range_gb": count * len(batch) / (1 << 30),
            "batches": count,
            "median_ms": statistics.median(seconds) * 1000,
            "p99_ms": seconds[int(len(seconds) * 0.99)] * 1000,
        }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.groups", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    parser.add_argument("--seconds", type=float, default=10.0, help="commit runs (10 s)")
    parser.add_argument("--streams", type=int, default=10_000, help="streams for lag (10,000)")
    parser.add_argument("--groups", type=int, default=10, help="groups for lag (10)")
    parser.add_argument("--lag-seconds", type=float, default=60.0, help="lag window (60 s)")
    parser.add_argument("--range-gb", type=float, default=10.0, help="FIND_OFFSETS range (10)")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.streams, args.groups = 2.0, 1000, 2
        args.lag_seconds, args.range_gb = 16.0, 0.1
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-groups-") as tmp:
        root = Path(tmp)
        result["commits_per_s_lmdb"] = trio.run(commits, root / "lmdb", args.seconds, False)
        print(f"commits on LMDB: {result['commits_per_s_lmdb']:,.0f} positions/s", flush=True)
        result["commits_per_s_etcd"] = trio.run(commits, root / "etcd", args.seconds, True)
        print(f"commits on etcd: {result['commits_per_s_etcd']:,.0f} positions/s", flush=True)
        result["lag"] = trio.run(lag_cpu, root / "lag", args.streams, args.groups, args.lag_seconds)
        print(f"lag: {result['lag']}", flush=True)
        result["find_offsets"] = find_offsets(root / "find", args.range_gb, 2000)
        print(f"find_offsets: {result['find_offsets']}", flush=True)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
