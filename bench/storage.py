"""Storage benchmarks: record batch codec speed, group-commit append throughput
against a raw LMDB loop, and warm read throughput.

    .venv/bin/python -m bench.storage [--quick]

The raw loop is the limit the engine is measured against: the same batches,
written with the same keys into one LMDB database, in transactions of the
same size as the engine's mean group, with the same sync setting, and none
of the engine's work (validation, CRC-32C, index entries, queueing, threads).
"""

from __future__ import annotations

import argparse
import queue
import shutil
import tempfile
import threading
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

from sbp.batches import build_batch, build_batch_from_arrays, decode_batches
from storage import AppendItem, AppendOutcome, RangeInfo, ReplicaInfo, StorageEngine
from storage.layout import batch_key

MAP_SIZE = 8 * 1024**3
SUBMITTERS = 4
IN_FLIGHT_PER_SUBMITTER = 16
#: measured engine/raw pairs per case, after one warm-up pair
PAIRS = 3


def micros(fn: Callable[[], object], repeat: int = 5, number: int = 200) -> float:
    return min(timeit.repeat(fn, repeat=repeat, number=number)) / number * 1e6


def bench_batches() -> list[str]:
    values = [bytes([i % 256]) * 100 for i in range(1000)]
    flat = np.frombuffer(b"".join(values), dtype=np.uint8)
    lengths = np.full(1000, 100, dtype=np.int64)
    batch = bytes(build_batch(values, 0))
    ten = batch * 10
    return [
        "| case | µs per call | records/s |",
        "|---|---:|---:|",
        *(
            f"| {name} | {us:.1f} | {records / us * 1e6:,.0f} |"
            for name, us, records in (
                ("build 1,000 x 100 B from a list", micros(lambda: build_batch(values, 0)), 1000),
                (
                    "build 1,000 x 100 B from numpy arrays",
                    micros(lambda: build_batch_from_arrays(flat, lengths, 0)),
                    1000,
                ),
                ("decode 1 batch to numpy (CRC on)", micros(lambda: decode_batches(batch)), 1000),
                (
                    "decode 1 batch to numpy (CRC off)",
                    micros(lambda: decode_batches(batch, verify_crc=False)),
                    1000,
                ),
                ("decode 10 batches to numpy (CRC on)", micros(lambda: decode_batches(ten)), 10000),
            )
        ),
    ]


def make_batch(size: int) -> bytes:
    """A batch of about ``size`` bytes: records of ~1 KiB (64 KiB) or ~100 B (1 KiB)."""
    record = 1024 if size >= 16 * 1024 else 100
    n = max(1, size // (record + 4))
    value = b"r" * (max(1, size - 31 - 4 * n) // n)
    return bytes(build_batch([value] * n, 0))


@dataclass
class AppendRun:
    seconds: float
    batches: int
    bytes: int
    mean_group: float


def run_engine(path: Path, batch: bytes, total: int, sync: str) -> AppendRun:
    engine = StorageEngine(path, map_size=MAP_SIZE, node_id=1, sync=sync)  # type: ignore[arg-type]
    streams = list(range(1, SUBMITTERS + 1))
    for stream_id in streams:
        engine.sync_ranges(
            stream_id, [RangeInfo(stream_id, 0, 0, replicas=(ReplicaInfo(1, "n", True),))]
        ).result()
    before = engine.stats()
    per_submitter = total // SUBMITTERS
    barrier = threading.Barrier(SUBMITTERS + 1)

    def submitter(stream_id: int) -> None:
        # The callback runs on the writer thread, so it only hands the outcome
        # over (as the data node does); the submitter keeps a window of
        # requests in flight and sends one more per completion.
        completions: queue.SimpleQueue[list[AppendOutcome]] = queue.SimpleQueue()
        items = [AppendItem(stream_id, batch)]
        barrier.wait()
        for sent in range(per_submitter):
            if sent >= IN_FLIGHT_PER_SUBMITTER:
                completions.get()
            engine.submit(items, completions.put)
        for _ in range(min(per_submitter, IN_FLIGHT_PER_SUBMITTER)):
            completions.get()

    threads = [threading.Thread(target=submitter, args=(s,)) for s in streams]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    after = engine.stats()
    engine.close()
    commits = after.commits_total - before.commits_total
    batches = per_submitter * SUBMITTERS
    return AppendRun(seconds, batches, batches * len(batch), batches / commits)


def run_raw(path: Path, batch: bytes, total: int, sync: str, group: int) -> AppendRun:
    durable = sync == "always"
    env = lmdb.open(
        str(path), map_size=MAP_SIZE, max_dbs=2, sync=durable, metasync=durable, meminit=False
    )
    db = env.open_db(b"batches")
    per_stream = total // SUBMITTERS
    keys = [
        batch_key(stream_id, i) for i in range(per_stream) for stream_id in range(1, SUBMITTERS + 1)
    ]
    started = time.perf_counter()
    for first in range(0, len(keys), group):
        with env.begin(write=True, db=db) as txn:
            for key in keys[first : first + group]:
                txn.put(key, batch)
    seconds = time.perf_counter() - started
    env.close()
    return AppendRun(seconds, len(keys), len(keys) * len(batch), group)


def bench_appends(quick: bool) -> tuple[list[str], dict[int, Path]]:
    rows = [
        "| batch | sync | engine MB/s | engine batches/s | mean group | raw LMDB MB/s | ratio "
        "| ratio of each pair |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    kept: dict[int, Path] = {}
    for size, total in ((64 * 1024, 1600), (1024, 24000)):
        batch = make_batch(size)
        for sync in ("always", "never"):
            count = total // 4 if quick else total
            # Engine and raw runs back to back, in pairs: the machine is shared
            # and noisy, so each engine run is compared with the raw run next to
            # it, and the median pair is reported. The first pair only warms
            # up: a process's first writes into fresh page-cache memory cost up
            # to twice as much.
            pairs: list[tuple[AppendRun, AppendRun]] = []
            for attempt in range(PAIRS + 1):
                root = Path(tempfile.mkdtemp(prefix="bench-storage-"))
                engine_run = run_engine(root / "engine", batch, count, sync)
                group = max(1, round(engine_run.mean_group))
                raw_run = run_raw(root / "raw", batch, count, sync, group)
                if attempt > 0:
                    pairs.append((engine_run, raw_run))
                shutil.rmtree(root / "raw")
                if sync == "never" and attempt == PAIRS:
                    kept[size] = root / "engine"
                else:
                    shutil.rmtree(root)
            pairs.sort(key=lambda pair: pair[1].seconds / pair[0].seconds)
            engine_run, raw_run = pairs[len(pairs) // 2]
            engine_mbs = engine_run.bytes / engine_run.seconds / 1e6
            raw_mbs = raw_run.bytes / raw_run.seconds / 1e6
            ratios = ", ".join(f"{raw.seconds / engine.seconds:.2f}" for engine, raw in pairs)
            rows.append(
                f"| {len(batch):,} B | {sync} | {engine_mbs:,.0f} | "
                f"{engine_run.batches / engine_run.seconds:,.0f} | {engine_run.mean_group:.1f} | "
                f"{raw_mbs:,.0f} | {engine_mbs / raw_mbs:.2f} | {ratios} |"
            )
    return rows, kept


def bench_reads(kept: dict[int, Path]) -> list[str]:
    rows = ["| batch | read size | MB/s | batches/s |", "|---|---:|---:|---:|"]
    for size, path in kept.items():
        with StorageEngine(path, map_size=MAP_SIZE, node_id=1, sync="never") as engine:
            next_offset = engine.next_offset(1) or 0
            batch_records = decode_batches(engine.read(1, 0, 1)).offsets.size
            for max_bytes in (1024 * 1024,):
                engine.read(1, 0, max_bytes)  # warm
                total = 0
                batches = 0
                started = time.perf_counter()
                for _ in range(3):
                    offset = 0
                    while offset < next_offset:
                        payload = engine.read(1, offset, max_bytes)
                        total += len(payload)
                        batches += len(payload) // len(make_batch(size))
                        offset += (len(payload) // len(make_batch(size))) * batch_records
                seconds = time.perf_counter() - started
                rows.append(
                    f"| {len(make_batch(size)):,} B | {max_bytes // 1024} KiB | "
                    f"{total / seconds / 1e6:,.0f} | {batches / seconds:,.0f} |"
                )
        shutil.rmtree(path.parent)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the appends")
    args = parser.parse_args()
    print("## Record batches\n")
    print("\n".join(bench_batches()))
    print(
        f"\n## Storage engine: appends ({SUBMITTERS} submitters, "
        f"{IN_FLIGHT_PER_SUBMITTER} requests in flight each)\n"
    )
    rows, kept = bench_appends(args.quick)
    print("\n".join(rows))
    print("\n## Storage engine: warm sequential reads\n")
    print("\n".join(bench_reads(kept)))


if __name__ == "__main__":
    main()
