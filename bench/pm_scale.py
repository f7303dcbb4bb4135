"""How the placement manager scales with the number of streams.

Starts a PM and three data nodes as processes on loopback (as ``sbp-cluster``
does), creates 100,000 streams in CREATE_STREAMS frames of 1,000 (10,000
with ``--quick``), and reports:

- the creation rate (streams per second, each frame answered only after its
  metadata is synced and the data nodes have the new ranges);
- the PM's resident memory (RSS) at 1,000 streams and at the end;
- the latency of GET_STREAMS (one id), LIST_RANGES (one stream) and
  SEAL_RANGES (seal-and-new of one stream's open range, a data node round
  trip included) at 1,000 streams and at the end, one request in flight,
  on streams picked at random.

    .venv/bin/python -m bench.pm_scale [--quick] [--samples 300] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import trio

from client.launcher import Plan, plan_children, running_plan
from client.pm_client import PMClient
from sbp import messages
from sbp.enums import ErrorCode

FRAME_STREAMS = 1000
FULL_STREAMS = 100_000
QUICK_STREAMS = 10_000
FIRST_POINT = 1000
NODES = 3


@dataclass
class Latency:
    p50_ms: float
    p99_ms: float


@dataclass
class Point:
    """Measurements with ``streams`` streams in the PM."""

    streams: int
    rss_mib: float
    #: RSS less file-backed shared pages: LMDB's mapped pages count in RSS but
    #: belong to the page cache; this is the PM's own heap and stacks
    private_mib: float
    get_streams: Latency
    list_ranges: Latency
    seal_ranges: Latency


async def _latency(samples: int, call: Callable[[], Awaitable[object]]) -> Latency:
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        await call()
        times.append(time.perf_counter() - start)
    times.sort()
    return Latency(
        p50_ms=statistics.median(times) * 1000, p99_ms=times[int(len(times) * 0.99) - 1] * 1000
    )


async def _measure(pm: PMClient, pid: int, ids: list[int], samples: int) -> Point:
    rng = random.Random(len(ids))

    async def get() -> None:
        await pm.get_stream(rng.choice(ids))

    async def list_ranges() -> None:
        await pm.list_stream_ranges(rng.choice(ids))

    # Each stream is sealed at most once, so every seal does the full work
    # (seal on the primary, commit, SYNC_RANGES) rather than an idempotent retry.
    unsealed = rng.sample(ids, samples)

    async def seal() -> None:
        await pm.seal_range(unsealed.pop(), 0)

    get_latency = await _latency(samples, get)
    list_latency = await _latency(samples, list_ranges)
    seal_latency = await _latency(samples, seal)
    memory = psutil.Process(pid).memory_info()
    rss = memory.rss / (1 << 20)
    private = (memory.rss - memory.shared) / (1 << 20)
    return Point(len(ids), rss, private, get_latency, list_latency, seal_latency)


async def _create(pm: PMClient, count: int, replicas: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < count:
        batch = [messages.Stream(replica_nums=replicas)] * min(FRAME_STREAMS, count - len(ids))
        results = await pm.create_streams(batch, timeout=60)
        failed = [r for r in results if r.error_code != ErrorCode.NONE]
        if failed:
            raise RuntimeError(f"CREATE_STREAMS failed: {failed[0].error_message}")
        ids.extend(r.stream.stream_id for r in results if r.stream is not None)
    return ids


async def run(total: int, samples: int, replicas: int, data_dir: Path) -> dict[str, object]:
    pm_child, nodes = plan_children(data_dir, NODES, "127.0.0.1", 0, "always", sys.executable)
    async with running_plan(Plan([], [pm_child], nodes), data_dir):
        assert pm_child.process is not None
        pid = pm_child.process.pid
        async with PMClient(pm_child.address, timeout=60) as pm:
            ids = await _create(pm, FIRST_POINT, replicas)
            first = await _measure(pm, pid, ids, samples)
            print(_describe(first), flush=True)
            start = time.perf_counter()
            ids += await _create(pm, total - len(ids), replicas)
            elapsed = time.perf_counter() - start
            rate = (total - FIRST_POINT) / elapsed
            print(f"created {total - FIRST_POINT:,} more streams at {rate:,.0f}/s", flush=True)
            last = await _measure(pm, pid, ids, samples)
            print(_describe(last), flush=True)
    return {
        "replicas": replicas,
        "frame_streams": FRAME_STREAMS,
        "create_rate_per_s": rate,
        "points": [asdict(first), asdict(last)],
        "growth": {
            name: getattr(last, name).p50_ms / getattr(first, name).p50_ms
            for name in ("get_streams", "list_ranges", "seal_ranges")
        },
    }


def _describe(point: Point) -> str:
    return (
        f"{point.streams:>7,} streams: RSS {point.rss_mib:5.1f} MiB "
        f"(private {point.private_mib:5.1f}) | p50/p99 ms: "
        f"GET_STREAMS {point.get_streams.p50_ms:.2f}/{point.get_streams.p99_ms:.2f}  "
        f"LIST_RANGES {point.list_ranges.p50_ms:.2f}/{point.list_ranges.p99_ms:.2f}  "
        f"SEAL_RANGES {point.seal_ranges.p50_ms:.2f}/{point.seal_ranges.p99_ms:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pm_scale", description=__doc__)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STREAMS:,} streams")
    parser.add_argument("--samples", type=int, default=300, help="requests per latency figure")
    parser.add_argument("--replicas", type=int, default=1, choices=(1, 2, 3))
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    total = QUICK_STREAMS if args.quick else FULL_STREAMS
    with tempfile.TemporaryDirectory(prefix="pm-scale-") as tmp:
        result = trio.run(run, total, args.samples, args.replicas, Path(tmp))
    growth = result["growth"]
    assert isinstance(growth, dict)
    print(
        "p50 growth from 1,000 to "
        f"{total:,} streams: "
        + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in growth.items()),
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
