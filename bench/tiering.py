"""Tiered storage (SPEC §14): reads of ranges in the object store against
the same reads from local disk, uploads keeping pace with appends, and the
PM's work per state change at 100,000 tiered ranges.

    .venv/bin/python -m bench.tiering [--quick] [--part read|upload|pm|all]

**read**: a PM, one data node (``--sync never``) and SeaweedFS's ``weed
mini`` on loopback. Each round fills a tiered stream (ranges rolled at the
default 64 MiB) with ``--mb`` MiB of 1 KiB values and reads the same
ranges from offset 0 to the end with a ``Consumer`` three times: once they
are copied but still on the node (``local_retention_ms`` one hour: local
disk), then, with ``local_retention_ms`` 0, once they are in the store only
(through the node's empty cache: cold), and again (warm). Reported: MB/s
of each and the ratios cold/local and warm/local of each round, and the
ratios' medians over ``--rounds``.

**upload**: the same processes. The append rate one producer reaches in
``--seconds`` (64 KiB batches, 8 in flight) is the peak; then half of it is
sent for ``--seconds`` to a plain stream and to a tiered one, alternating.
Reported: each run's append latency p50/p99, and for the tiered runs how
many ranges were sealed and how long after the last append the last of
them was copied.

**pm**: the PM's tiering alone, in this process, over LMDB metadata and an
object store in memory (``tiering.memory``): ``--ranges`` sealed ranges of
tiered streams, then copies and offloads of 1,000 of them. Reported: the
time per state change at 1,000 ranges and at ``--ranges``, and the
start-up scan that finds them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import trio

from bench.output import emit
from client.consumer import Consumer
from client.launcher import Plan, add_object_store, plan_children, running_plan
from client.pm_client import PMClient
from client.producer import Producer
from net.pool import ConnectionPool
from pm.changes import PutRange, PutStream
from pm.liveness import NodeRegistry
from pm.metadata import MetadataStore
from pm.range_log import RangeLog
from pm.range_sizes import RangeSizes
from pm.records import Holding, NodeRecord, RangeRecord, StreamRecord
from pm.tiering import Tiering
from sbp import messages
from sbp.batches import build_batch, build_batch_from_arrays, stamp_base_offset
from sbp.enums import ObjectState
from tiering import layout
from tiering.memory import MemoryObjectStore

VALUE_BYTES = 1024
BATCH_VALUES = 1024  # 1 MiB batches for the fills
ROLL = "64MiB"  # the default


def _plan(root: Path) -> Plan:
    pm, nodes = plan_children(root, 1, "127.0.0.1", 0, "never", sys.executable)
    plan = Plan([], [pm], nodes)
    add_object_store(plan, root, "127.0.0.1", 0)
    pm.argv += ["--tiering-interval-ms", "200", "--tiered-roll-bytes", ROLL]
    nodes[0].argv += ["--object-cache-bytes", "4GiB", "--max-upload-bytes-per-s", "0"]
    return plan


def _batches(count: int) -> list[bytearray]:
    rng = np.random.default_rng(14)
    lengths = np.full(BATCH_VALUES, VALUE_BYTES, dtype=np.int64)
    return [
        build_batch_from_arrays(
            rng.integers(97, 123, size=BATCH_VALUES * VALUE_BYTES, dtype=np.uint8), lengths, 0
        )
        for _ in range(count)
    ]


async def _create(pm: PMClient, **settings: int) -> int:
    [created] = await pm.create_streams([messages.Stream(replica_nums=1, **settings)])
    assert created.stream is not None, created.error_message
    return int(created.stream.stream_id)


async def _fill(pm: PMClient, pool: ConnectionPool, stream_id: int, mb: int) -> int:
    """``mb`` MiB of values, then the open range sealed; the end offset."""
    batches = _batches(4)
    async with Producer(pm, stream_id, pool=pool, linger=0) as producer:
        for i in range(mb):
            await producer.send_batch(batches[i % len(batches)])
    last = (await pm.list_stream_ranges(stream_id))[-1]
    sealed = await pm.seal_range(stream_id, last.range_index)
    return int(sealed.ranges[0].end_offset)


async def _read_mb_per_s(pm: PMClient, pool: ConnectionPool, stream_id: int, end: int) -> float:
    started = time.perf_counter()
    async with Consumer(pm, stream_id, 0, pool=pool) as consumer:
        async for records in consumer:
            if int(records.offsets[-1]) + 1 >= end:
                break
    elapsed = time.perf_counter() - started
    return end * VALUE_BYTES / elapsed / 1e6


async def _all_at_least(pm: PMClient, stream_id: int, state: int, timeout: float) -> None:
    """Until every sealed range of the stream is in ``state`` or past it."""
    with trio.fail_after(timeout):
        while True:
            ranges = await pm.list_stream_ranges(stream_id)
            if all(r.object_state >= state for r in ranges if not r.is_open):
                return
            await trio.sleep(0.2)


async def read_part(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    plan = _plan(root)
    async with running_plan(plan, root), ConnectionPool() as pool:
        pm = PMClient(plan.pm_addresses, pool=pool, timeout=60)
        rounds = []
        for _ in range(args.rounds):
            # the same ranges: copied but kept on the node, then in the store only
            stream_id = await _create(pm, local_retention_ms=3_600_000)
            end = await _fill(pm, pool, stream_id, args.mb)
            await _all_at_least(pm, stream_id, 1, timeout=300)
            on_disk = await _read_mb_per_s(pm, pool, stream_id, end)
            stream = await pm.get_stream(stream_id)
            await pm.update_stream(replace(stream, local_retention_ms=0))
            await _all_at_least(pm, stream_id, 2, timeout=300)
            cold = await _read_mb_per_s(pm, pool, stream_id, end)
            warm = await _read_mb_per_s(pm, pool, stream_id, end)
            await pm.delete_streams([stream_id])
            rounds.append(
                {
                    "local_mb_per_s": round(on_disk, 1),
                    "store_cold_mb_per_s": round(cold, 1),
                    "store_warm_mb_per_s": round(warm, 1),
                    "cold_over_local": round(cold / on_disk, 2),
                    "warm_over_local": round(warm / on_disk, 2),
                }
            )
    return {
        "mb_per_stream": args.mb,
        "rounds": rounds,
        "median_cold_over_local": statistics.median(r["cold_over_local"] for r in rounds),
        "median_warm_over_local": statistics.median(r["warm_over_local"] for r in rounds),
    }


async def _paced(
    pm: PMClient, pool: ConnectionPool, stream_id: int, mb_per_s: float, seconds: float
) -> tuple[list[float], float]:
    """64 KiB batches at ``mb_per_s`` for ``seconds``, 8 in flight at most;
    each one's latency (s), and the MB/s reached (``mb_per_s`` 0: flat out)."""
    rng = np.random.default_rng(7)
    values = 64
    lengths = np.full(values, VALUE_BYTES, dtype=np.int64)
    batch = build_batch_from_arrays(
        rng.integers(97, 123, size=values * VALUE_BYTES, dtype=np.uint8), lengths, 0
    )
    latencies: list[float] = []
    sent = 0
    interval = len(batch) / (mb_per_s * 1e6) if mb_per_s else 0.0
    in_flight = trio.Semaphore(8)
    async with Producer(pm, stream_id, pool=pool, linger=0) as producer:

        async def one() -> None:
            started = time.perf_counter()
            handle = await producer.send_batch(batch)
            await handle.offsets()
            latencies.append(time.perf_counter() - started)
            in_flight.release()

        begun = trio.current_time()
        tick = begun
        async with trio.open_nursery() as nursery:
            while trio.current_time() - begun < seconds:
                await in_flight.acquire()
                nursery.start_soon(one)
                sent += len(batch)
                if interval:
                    tick += interval
                    await trio.sleep_until(tick)
        elapsed = trio.current_time() - begun
    return latencies, sent / elapsed / 1e6


def _ms(latencies: list[float], q: float) -> float:
    return round(float(np.quantile(latencies, q)) * 1000, 2)


async def upload_part(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    plan = _plan(root)
    async with running_plan(plan, root), ConnectionPool() as pool:
        pm = PMClient(plan.pm_addresses, pool=pool, timeout=60)
        flat_out = await _create(pm)
        _, peak = await _paced(pm, pool, flat_out, 0, args.seconds)
        await pm.delete_streams([flat_out])  # the node's map holds a few runs, not all
        half = peak / 2
        runs: dict[str, Any] = {}
        for kind in ("plain", "tiered", "plain", "tiered"):
            settings = {"local_retention_ms": 0} if kind == "tiered" else {}
            stream_id = await _create(pm, **settings)
            latencies, reached = await _paced(pm, pool, stream_id, half, args.seconds)
            run: dict[str, Any] = {
                "mb_per_s": round(reached, 1),
                "p50_ms": _ms(latencies, 0.5),
                "p99_ms": _ms(latencies, 0.99),
            }
            if kind == "tiered":
                last_append = time.monotonic()
                ranges = await pm.list_stream_ranges(stream_id)
                sealed = [r for r in ranges if not r.is_open]
                with trio.fail_after(300):
                    while True:
                        ranges = await pm.list_stream_ranges(stream_id)
                        copied = ObjectState.IN_STORE_TOO
                        if all(r.object_state >= copied for r in ranges if not r.is_open):
                            break
                        await trio.sleep(0.1)
                run["sealed_ranges"] = len(sealed)
                run["copied_within_s_of_last_append"] = round(time.monotonic() - last_append, 1)
            runs.setdefault(kind, []).append(run)
            await pm.delete_streams([stream_id])
    return {
        "peak_mb_per_s": round(peak, 1),
        "half_peak_mb_per_s": round(half, 1),
        "seconds": args.seconds,
        "runs": runs,
        "p99_ms_plain": statistics.median(r["p99_ms"] for r in runs["plain"]),
        "p99_ms_tiered": statistics.median(r["p99_ms"] for r in runs["tiered"]),
    }


class _InstantNodes:
    """Data nodes that copy a range at once (into the memory store)."""

    def __init__(self, objects: MemoryObjectStore) -> None:
        self.objects = objects
        batch = build_batch([b"x"], 0)
        stamp_base_offset(batch, 0)
        self.batch = batch

    async def upload_range(self, node_id: int, rng: RangeRecord) -> None:
        batch = bytearray(self.batch)
        stamp_base_offset(batch, rng.end_offset - 1)
        key = layout.object_key(rng.stream_id, rng.range_index, rng.epoch)
        self.objects.put(
            key,
            layout.whole_object(
                rng.stream_id, rng.range_index, rng.epoch, rng.end_offset, batch, 0
            ),
        )

    async def range_holdings(
        self, node_id: int, keys: Sequence[tuple[int, int]], skips: Sequence[int] = ()
    ) -> dict[tuple[int, int], Holding]:
        return {key: Holding(0, 0) for key in keys}


async def _pm_at(root: Path, ranges: int, changes: int) -> dict[str, float]:
    """Per state change, at ``ranges`` tiered ranges (100 streams)."""
    store = MetadataStore(root / f"pm-{ranges}", map_size=8 << 30)
    try:
        streams = 100
        per_stream = ranges // streams
        for stream_id in range(1, streams + 1):
            changes_batch: list[Any] = [PutStream(StreamRecord(stream_id, 1, local_retention_ms=0))]
            for index in range(per_stream):
                start = index * 10
                changes_batch.append(
                    PutRange(RangeRecord(stream_id, index, start, (1,), start + 10))
                )
            await store.commit(changes_batch)
        registry = NodeRegistry(3600.0)
        registry.heartbeat(NodeRecord(1, "127.0.0.1:1"))
        objects = MemoryObjectStore()
        nodes = _InstantNodes(objects)
        log = RangeLog(store)

        class NoLock:
            async def __aenter__(self) -> None:
                return None

            async def __aexit__(self, *exc: object) -> None:
                return None

        async def nothing(*args: Any, **kwargs: Any) -> Any:
            return []

        tiering = Tiering(
            store,
            registry,
            nodes,
            objects,
            log.commit,
            lambda stream_id: NoLock(),
            nothing,
            nothing,
            nothing,
            RangeSizes(registry, nodes),
        )
        log.observe(tiering)
        started = time.perf_counter()
        tiering.load()
        load_s = time.perf_counter() - started
        keys = [(s, i) for i in range(per_stream) for s in range(1, streams + 1)][:changes]
        started = time.perf_counter()
        for key in keys:
            assert await tiering.copy(*key)
        copy_s = (time.perf_counter() - started) / len(keys)
        started = time.perf_counter()
        for key in keys:
            assert await tiering.offload(*key)
        offload_s = (time.perf_counter() - started) / len(keys)
        return {
            "ranges": ranges,
            "startup_scan_s": round(load_s, 2),
            "copy_us": round(copy_s * 1e6, 1),
            "offload_us": round(offload_s * 1e6, 1),
        }
    finally:
        store.close()


async def pm_part(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    small = await _pm_at(root, 1_000, min(1_000, args.changes))
    large = await _pm_at(root, args.ranges, args.changes)
    return {
        "small": small,
        "large": large,
        "copy_large_over_small": round(large["copy_us"] / small["copy_us"], 2),
        "offload_large_over_small": round(large["offload_us"] / small["offload_us"], 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.tiering", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds of each part")
    parser.add_argument("--part", choices=["read", "upload", "pm", "all"], default="all")
    parser.add_argument("--mb", type=int, default=256, help="MiB per stream (read)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="per run (upload)")
    parser.add_argument("--ranges", type=int, default=100_000, help="tiered ranges (pm)")
    parser.add_argument("--changes", type=int, default=1_000, help="state changes timed (pm)")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    args = parser.parse_args(argv)
    if args.quick:
        args.mb, args.rounds, args.seconds, args.ranges, args.changes = 32, 1, 3, 2_000, 200
    result: dict[str, Any] = {"cores": psutil.cpu_count()}
    parts = ["read", "upload", "pm"] if args.part == "all" else [args.part]
    runs = {"read": read_part, "upload": upload_part, "pm": pm_part}
    for part in parts:
        with tempfile.TemporaryDirectory(prefix="sbp-bench-tiering-") as tmp:
            result[part] = trio.run(runs[part], args, Path(tmp))
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
