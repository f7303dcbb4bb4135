"""Appends while the store reuses the pages a deletion freed.

    .venv/bin/python -m bench.reuse [--quick] [--rate N] [--seconds S] [--cycles C]

The storage engine alone, no network: 64 KiB batches offered at a fixed
rate (one stream per phase), submitted in bursts of 1 to 8 so that group
commits of varying size form, as they do in a busy data node. The first
phase runs on a fresh store; each later one starts right after the stream
of the phase before it was deleted (its chunks' first pages read first, as
the data node does), so its appends reuse the freed pages.
Reported per phase: latency from submission to durable (p50, p99, p99.9,
max) and the bytes this process wrote to disk per append.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness import percentiles_ms
from bench.storage import MAP_SIZE, make_batch
from storage import AppendItem, AppendOutcome, RangeInfo, ReplicaInfo, StorageEngine

BATCH_BYTES = 64 * 1024
BURST_MAX = 8


@dataclass(frozen=True)
class Phase:
    label: str
    latencies_s: list[float]
    written_bytes: int


def written_bytes() -> int:
    """What this process has caused to be written to disk so far (Linux)."""
    with open("/proc/self/io") as io:
        for line in io:
            name, _, value = line.partition(":")
            if name == "write_bytes":
                return int(value)
    return 0


def offer(
    engine: StorageEngine, stream_id: int, batch: bytes, rate: float, seconds: float
) -> list[float]:
    """Appends offered at ``rate`` a second for ``seconds``, each burst
    submitted at once; returns their latencies once all are durable."""
    latencies: list[float] = []
    answered = threading.Condition()
    items = [AppendItem(stream_id, batch)]
    sent = 0
    started = next_burst = time.perf_counter()
    while time.perf_counter() < started + seconds:
        burst = random.randint(1, BURST_MAX)
        submitted = time.perf_counter()

        def done(_outcomes: list[AppendOutcome], submitted: float = submitted) -> None:
            # on the writer thread: note the latency and hand over, nothing more
            with answered:
                latencies.append(time.perf_counter() - submitted)
                answered.notify()

        for _ in range(burst):
            engine.submit(items, done)
        sent += burst
        next_burst += burst / rate
        time.sleep(max(0.0, next_burst - time.perf_counter()))
    with answered:
        answered.wait_for(lambda: len(latencies) == sent)
    return latencies


def run(rate: float, seconds: float, cycles: int) -> list[Phase]:
    root = Path(tempfile.mkdtemp(prefix="bench-reuse-"))
    batch = make_batch(BATCH_BYTES)
    phases: list[Phase] = []
    try:
        with StorageEngine(root / "store", map_size=MAP_SIZE, node_id=1) as engine:
            replica = ReplicaInfo(1, "n", True)
            for stream_id in range(1, cycles + 2):
                engine.sync_ranges(
                    stream_id, [RangeInfo(stream_id, 0, 0, replicas=(replica,))]
                ).result()
            for stream_id in range(1, cycles + 2):
                label = "fresh store" if stream_id == 1 else f"after deletion {stream_id - 1}"
                before = written_bytes()
                latencies = offer(engine, stream_id, batch, rate, seconds)
                phases.append(Phase(label, latencies, written_bytes() - before))
                print(f"  {label}: {len(latencies):,} appends", flush=True)
                # as the data node deletes: the chunks' first pages read first
                engine.prefetch_chunks(stream_id)
                engine.delete_stream(stream_id).result()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return phases


def table(phases: list[Phase], rate: float) -> list[str]:
    rows = [
        f"| phase ({rate:,.0f} appends/s of {BATCH_BYTES // 1024} KiB) | appends | p50 ms "
        "| p99 ms | p99.9 ms | max ms | KB written per append |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for phase in phases:
        count = len(phase.latencies_s)
        ms = percentiles_ms(phase.latencies_s)
        rows.append(
            f"| {phase.label} | {count:,} | {ms['p50']:.2f} | {ms['p99']:.1f} "
            f"| {ms['p99.9']:.1f} | {ms['max']:.1f} | {phase.written_bytes / count / 1024:.0f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one second per phase, 2 cycles")
    parser.add_argument("--rate", type=float, default=2200.0, help="appends offered a second")
    parser.add_argument("--seconds", type=float, default=7.0, help="length of each phase")
    parser.add_argument("--cycles", type=int, default=3, help="deletions to measure after")
    args = parser.parse_args()
    seconds, cycles = (1.0, 2) if args.quick else (args.seconds, args.cycles)
    if args.rate <= 0 or seconds <= 0 or cycles < 1:
        parser.error("--rate and --seconds must be positive, --cycles at least 1")
    random.seed(1)
    phases = run(args.rate, seconds, cycles)
    print()
    print("\n".join(table(phases, args.rate)))


if __name__ == "__main__":
    main()
