"""What records with keys and headers cost (SPEC §4 magic 2), and how fast
a data node compacts (SPEC §13).

    .venv/bin/python -m bench.keys [--quick] [--rounds 5] [--out FILE]

Appends go to a PM and one data node (``--sync always``) running as real
processes, started the way ``sbp-cluster`` starts them, through the client
library's ``Producer``, one new stream per run. Each round runs every
workload plain (magic 1) and keyed (magic 2), the order alternating by
round; a figure is the median over rounds of the keyed/plain ratio of the
same round, which shares the machine's noise:

- 64 KiB batches, one per APPEND, 64 in flight: 63 values of 1 KiB, and
  the same values each with a 16-byte key (MB/s);
- 100-byte values through ``send_many`` (5 in flight), and the same values
  each with a 16-byte key and one header (records/s).

Decoding a 1,000-record magic 2 batch (16-byte keys, one header and a
100-byte value each) into an Arrow batch with keys and headers is timed in
process, best of several repeats.

Compaction is measured on a storage engine in process, doing what a data
node does for COMPACTION_KEYS and COMPACT_RANGES (``datanode.compaction``
without its pacing): ``--compact-mb`` of sealed 64 KiB keyed batches, 64
MiB per range, with 10 % of its keys live, are scanned and rewritten while
another thread appends 64 KiB batches to a second stream at half of the
engine's measured peak. Reported: MB of sealed ranges compacted per second,
and the appends' p99 with and without compaction going on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import timeit
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import trio

from bench.output import emit
from client.launcher import Plan, plan_children, running_plan
from client.pm_client import PMClient
from client.producer import Producer
from net.pool import ConnectionPool
from sbp.batch_v2 import build_batch_v2
from sbp.batches import build_batch, decode_batches
from sbp.key_hash import KeyMap
from storage import AppendItem, RangeInfo, ReplicaInfo, StorageEngine

from .producer import make_values

IN_FLIGHT = 64
RECORDS_IN_FLIGHT = 5
KEY_BYTES = 16
#: the 64 KiB batch: 63 values of this size
BIG_VALUE_BYTES = 1024 - 24
SMALL_VALUE_BYTES = 100
DECODE_RECORDS = 1000
RANGE_BYTES = 64 << 20
COMPACT_KEYS_LIVE = 0.1
APPEND_BATCH = 64 * 1024


def _key(i: int) -> bytes:
    return b"key-%012d" % i


def big_batches(keyed: bool) -> bytes:
    values = [bytes([65 + i % 26]) * BIG_VALUE_BYTES for i in range(63)]
    if not keyed:
        return bytes(build_batch(values, 0))
    return bytes(build_batch_v2(values, 0, keys=[_key(i) for i in range(63)]))


async def _batches(
    pm: PMClient, pool: ConnectionPool, stream_id: int, batch: bytes, count: int
) -> float:
    async with Producer(
        pm,
        stream_id,
        pool=pool,
        max_in_flight=IN_FLIGHT,
        max_request_bytes=len(batch) + 1024,  # one batch per request
    ) as producer:
        started = time.perf_counter()
        for _ in range(count):
            await producer.send_batch(batch)
        await producer.flush()
        return time.perf_counter() - started


async def _records(
    pm: PMClient, pool: ConnectionPool, stream_id: int, values: Sequence[bytes], keyed: bool
) -> float:
    chunk = 10_000
    keys = [_key(i) for i in range(chunk)] if keyed else None
    headers = [[("source", b"bench")]] * chunk if keyed else None
    async with Producer(pm, stream_id, pool=pool, max_in_flight=RECORDS_IN_FLIGHT) as producer:
        started = time.perf_counter()
        for start in range(0, len(values), chunk):
            part = values[start : start + chunk]
            if keyed:
                assert keys is not None and headers is not None
                await producer.send_many(part, keys=keys[: len(part)], headers=headers[: len(part)])
            else:
                await producer.send_many(part)
        await producer.flush()
        return time.perf_counter() - started


async def appends(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The keyed/plain ratios of the module docstring, median over rounds."""
    pm_child, nodes = plan_children(root, 1, "127.0.0.1", 0, "always", sys.executable)
    plain, keyed = big_batches(False), big_batches(True)
    values = make_values(args.records, SMALL_VALUE_BYTES)
    rows: list[dict[str, float]] = []
    async with running_plan(Plan([], [pm_child], nodes), root), ConnectionPool() as pool:
        pm = PMClient(pm_child.address, pool=pool, timeout=30)
        for round_index in range(args.rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            seconds: dict[tuple[str, bool], float] = {}
            for with_keys in order:
                stream = (await pm.create_stream(1)).stream
                assert stream is not None
                batch = keyed if with_keys else plain
                seconds["64k", with_keys] = await _batches(
                    pm, pool, stream.stream_id, batch, args.batches
                )
                await pm.delete_stream(stream.stream_id)
                stream = (await pm.create_stream(1)).stream
                assert stream is not None
                seconds["100b", with_keys] = await _records(
                    pm, pool, stream.stream_id, values, with_keys
                )
                await pm.delete_stream(stream.stream_id)
            row = {
                "plain_64k_mb_per_s": args.batches * len(plain) / seconds["64k", False] / 1e6,
                "keyed_64k_mb_per_s": args.batches * len(keyed) / seconds["64k", True] / 1e6,
                "plain_100b_records_per_s": len(values) / seconds["100b", False],
                "keyed_100b_records_per_s": len(values) / seconds["100b", True],
            }
            row["ratio_64k"] = row["keyed_64k_mb_per_s"] / row["plain_64k_mb_per_s"]
            row["ratio_100b"] = row["keyed_100b_records_per_s"] / row["plain_100b_records_per_s"]
            rows.append(row)
            print(
                f"round {round_index + 1}: 64 KiB keyed/plain {row['ratio_64k']:.3f}, "
                f"100 B keyed/plain {row['ratio_100b']:.3f} "
                f"({row['keyed_100b_records_per_s'] / 1e6:.2f} M records/s keyed)",
                flush=True,
            )
    result = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    result["ratio_64k_range"] = [
        min(r["ratio_64k"] for r in rows),
        max(r["ratio_64k"] for r in rows),
    ]
    result["ratio_100b_range"] = [
        min(r["ratio_100b"] for r in rows),
        max(r["ratio_100b"] for r in rows),
    ]
    return result


def decode_micros() -> dict[str, float]:
    """µs to decode one 1,000-record magic 2 batch into Arrow, with keys and headers."""
    from spark_jobs.arrow import records_to_arrow

    values = make_values(DECODE_RECORDS, SMALL_VALUE_BYTES)
    batch = bytes(
        build_batch_v2(
            values,
            1_700_000_000_000,
            keys=[_key(i) for i in range(DECODE_RECORDS)],
            headers=[[("source", b"bench")]] * DECODE_RECORDS,
        )
    )

    def decode() -> object:
        return records_to_arrow(1, decode_batches(batch), include_headers=True)

    number = 2000
    best = min(timeit.repeat(decode, number=number, repeat=7)) / number
    decoded_only = min(timeit.repeat(lambda: decode_batches(batch), number=number, repeat=7))
    return {"to_arrow_us": best * 1e6, "decode_us": decoded_only / number * 1e6}


class _Appender(threading.Thread):
    """Appends 64 KiB batches to stream 2 at ``rate`` per second (0: as
    fast as it can, 16 in flight), keeping each one's latency."""

    def __init__(self, engine: StorageEngine, rate: float, seconds: float) -> None:
        super().__init__(daemon=True)
        self.engine, self.rate, self.seconds = engine, rate, seconds
        self.latencies: list[float] = []
        self.appended = 0
        self.elapsed = 0.0
        self.stop = threading.Event()
        self._batch = bytes(build_batch([b"a" * (APPEND_BATCH - 64)], 0))

    def run(self) -> None:
        in_flight = threading.Semaphore(16)
        started = next_at = time.perf_counter()

        def finished(sent: float) -> Any:
            def callback(outcomes: list[Any]) -> None:
                self.latencies.append(time.perf_counter() - sent)
                in_flight.release()

            return callback

        while not self.stop.is_set() and time.perf_counter() - started < self.seconds:
            if self.rate:
                next_at += 1 / self.rate
                delay = next_at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            in_flight.acquire()
            self.engine.submit([AppendItem(2, self._batch)], finished(time.perf_counter()))
            self.appended += 1
        for _ in range(16):  # every append answered
            in_flight.acquire()
        self.elapsed = time.perf_counter() - started

    def p99_ms(self) -> float:
        return float(np.percentile(self.latencies, 99) * 1000) if self.latencies else 0.0


def compaction(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """MB/s of sealed ranges compacted with appends going on at half of peak."""
    here = ReplicaInfo(1, "127.0.0.1:1", True)
    total = args.compact_mb << 20
    keys = max(int(total / (APPEND_BATCH / 63) * COMPACT_KEYS_LIVE), 1)
    with StorageEngine(root / "engine", map_size=max(4 * total, 1 << 30), node_id=1) as engine:
        engine.sync_ranges(1, [RangeInfo(1, 0, 0, replicas=(here,))], cleanup_policy=1).result()
        engine.sync_ranges(2, [RangeInfo(2, 0, 0, replicas=(here,))]).result()
        value = b"v" * BIG_VALUE_BYTES
        written = sealed_at = record = 0
        view: list[RangeInfo] = []
        while written < total:
            batch = build_batch_v2(
                [value] * 63, 0, keys=[_key((record + i) % keys) for i in range(63)]
            )
            engine.append(1, batch).result()
            record += 63
            written += len(batch)
            if written - sealed_at >= RANGE_BYTES or written >= total:
                # seal as the PM does: this range ends here, the next opens
                start = view[-1].end_offset if view else 0
                view.append(RangeInfo(1, len(view), start, record, replicas=(here,)))
                opened = RangeInfo(1, len(view), record, replicas=(here,))
                engine.sync_ranges(1, [*view, opened], cleanup_policy=1).result()
                sealed_at = written
        ranges = len(view)

        peak = _Appender(engine, 0, args.seconds)
        peak.start()
        peak.join()
        peak_rate = peak.appended / peak.elapsed
        quiet = _Appender(engine, peak_rate / 2, args.seconds)
        quiet.start()
        quiet.join()

        loaded = _Appender(engine, peak_rate / 2, 3600)
        loaded.start()
        started = time.perf_counter()
        found = [engine.range_keys(1, i) for i in range(ranges)]
        key_map = KeyMap.latest(
            np.concatenate([f.keys.hashes for f in found]),
            np.concatenate([f.keys.offsets for f in found]),
        )
        scanned = time.perf_counter() - started
        removed = 0
        for i in range(ranges):
            rewrites = engine.compaction_rewrites(1, i, key_map, False)
            removed += engine.apply_compaction(1, i, rewrites).result()
        seconds = time.perf_counter() - started
        loaded.stop.set()
        loaded.join()
        sealed_bytes = sum(f.bytes for f in found)
    return {
        "sealed_mb": sealed_bytes / 1e6,
        "keys": keys,
        "seconds": seconds,
        "scan_seconds": scanned,
        "mb_per_s": sealed_bytes / seconds / 1e6,
        "removed_mb": removed / 1e6,
        "append_peak_batches_per_s": peak_rate,
        "append_p99_ms_without": quiet.p99_ms(),
        "append_p99_ms_during": loaded.p99_ms(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.keys", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    parser.add_argument("--rounds", type=int, default=5, help="plain/keyed rounds (default: 5)")
    parser.add_argument("--batches", type=int, default=3000, help="64 KiB batches per run")
    parser.add_argument("--records", type=int, default=2_000_000, help="100-byte records per run")
    parser.add_argument(
        "--compact-mb", type=int, default=512, help="MiB of sealed ranges to compact"
    )
    parser.add_argument(
        "--seconds", type=float, default=5.0, help="appends measured without compaction"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.batches, args.records, args.compact_mb, args.seconds = (
            2,
            200,
            100_000,
            32,
            1.0,
        )
    with tempfile.TemporaryDirectory(prefix="bench-keys-") as tmp:
        result: dict[str, Any] = {"appends": trio.run(appends, args, Path(tmp) / "cluster")}
        result["decode"] = decode_micros()
        result["compaction"] = compaction(args, Path(tmp))
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
