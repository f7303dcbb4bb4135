"""Streams as tables (SPEC §16): whether ``sbp-tables`` keeps up, and how
fast Spark reads a tabled stream.

    .venv/bin/python -m bench.tables [--quick] [--part keep-up|spark|both]

**keep-up**: a PM, one data node (``--sync never``: the subject is
``sbp-tables``, not the disk) and ``sbp-tables`` run as real processes.
``--streams`` tabled streams (``--interval-ms``) take ``--rate-mb`` MB/s
in all for ``--seconds``, in batches of 1 KiB values (random letters) sent
every 100 ms. After each batch is acknowledged its time and end offset are
noted; afterwards each table's snapshot history says when that offset was
committed. Reported: the append rate reached, the commit delay (from the
acknowledgement to the snapshot that holds the records) at p50/p99/max
against 2x the interval, and ``sbp-tables``' CPU seconds per MB appended.

**spark**: one stream of ``--records`` records of 100 bytes, kept as a
table by ``sbp-tables``; Spark reads it (``count(*)`` and
``sum(length(value))``) through ``spark_jobs.read_stream`` (the table's
Parquet files), through the ``sbp`` source, and from a copy of the same
rows Spark wrote as plain Parquet, alternating, medians of ``--repeat``
after warm-up rounds, in the same session.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import trio

from bench.output import emit
from client.launcher import Plan, plan_children, plan_tables, running_plan
from client.pm_client import PMClient
from client.producer import Producer
from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import build_batch_from_arrays
from tables.catalog import END_OFFSET, load_table, open_catalog
from tables.defaults import local_tables

VALUE_BYTES = 1024
TICK_S = 0.1


def _values(rng: np.random.Generator, count: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``count`` values of VALUE_BYTES random letters, back to back."""
    return rng.integers(ord("a"), ord("z") + 1, size=count * VALUE_BYTES, dtype=np.uint8)


def _catalog(root: Path) -> Any:
    return open_catalog(*local_tables(root))


def _commit_times(root: Path, stream_id: int) -> list[tuple[int, float]]:
    """(end offset, commit time in s) of each snapshot of the stream's table."""
    table = load_table(_catalog(root), stream_id)
    assert table is not None
    found = []
    for snapshot in table.snapshots():
        summary = snapshot.summary.additional_properties if snapshot.summary else {}
        if END_OFFSET in summary:
            found.append((int(summary[END_OFFSET]), snapshot.timestamp_ms / 1000))
    return sorted(found)


def _table_end(root: Path, stream_id: int) -> int:
    commits = _commit_times(root, stream_id) if _has_table(root, stream_id) else []
    return commits[-1][0] if commits else 0


def _has_table(root: Path, stream_id: int) -> bool:
    return load_table(_catalog(root), stream_id) is not None


async def _wait_for_tables(root: Path, ends: dict[int, int], timeout: float) -> float:
    """Seconds until every table reaches its stream's end."""
    started = time.monotonic()
    while True:
        behind = [
            s for s, end in ends.items() if await trio.to_thread.run_sync(_table_end, root, s) < end
        ]
        if not behind:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise SystemExit(f"the tables of streams {behind} did not catch up in {timeout:.0f} s")
        await trio.sleep(0.5)


def _plan(root: Path) -> Plan:
    pm, nodes = plan_children(root, 1, "127.0.0.1", 0, "never", sys.executable)
    return Plan([], [pm], nodes, [plan_tables(root, "127.0.0.1", 0, sys.executable)])


async def keep_up(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    plan = _plan(root)
    async with running_plan(plan, root), ConnectionPool() as pool:
        pm = PMClient(plan.pm_addresses, pool=pool, timeout=30)
        created = await pm.create_streams(
            [messages.Stream(replica_nums=1, table_interval_ms=args.interval_ms)] * args.streams
        )
        streams = [int(result.stream.stream_id) for result in created if result.stream]
        tables_process = psutil.Process(plan.tables[0].process.pid)  # type: ignore[union-attr]
        per_tick = max(1, int(args.rate_mb * 1e6 * TICK_S / args.streams / VALUE_BYTES))
        rng = np.random.default_rng(62)
        values = [_values(rng, per_tick) for _ in range(4)]
        lengths = np.full(per_tick, VALUE_BYTES, dtype=np.int64)
        acked: dict[int, list[tuple[float, int]]] = {s: [] for s in streams}
        sent_bytes = 0
        cpu_before = tables_process.cpu_times()

        async def produce(stream_id: int, index: int) -> None:
            nonlocal sent_bytes
            async with Producer(pm, stream_id, pool=pool, linger=0) as producer:
                deadline = trio.current_time() + args.seconds
                tick = trio.current_time()
                count = 0
                while tick < deadline:
                    batch = build_batch_from_arrays(
                        values[(index + count) % len(values)], lengths, int(time.time() * 1000)
                    )
                    handle = await producer.send_batch(batch)
                    offsets = await handle.offsets()
                    acked[stream_id].append((time.time(), int(offsets[-1]) + 1))
                    sent_bytes += per_tick * VALUE_BYTES
                    count += 1
                    tick += TICK_S
                    await trio.sleep_until(tick)

        # sbp-tables holds every stream and has made its table before the clock starts
        for stream_id in streams:
            async with Producer(pm, stream_id, pool=pool) as producer:
                await producer.send_many([b"first"])
        await _wait_for_tables(root, dict.fromkeys(streams, 1), timeout=120)
        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            for index, stream_id in enumerate(streams):
                nursery.start_soon(produce, stream_id, index)
        elapsed = time.monotonic() - started
        ends = {s: acked[s][-1][1] for s in streams}
        drain_s = await _wait_for_tables(root, ends, timeout=120)
        cpu_after = tables_process.cpu_times()
        delays = []
        for stream_id in streams:
            commits = await trio.to_thread.run_sync(_commit_times, root, stream_id)
            for acked_at, end in acked[stream_id]:
                committed_at = next(t for offset, t in commits if offset >= end)
                delays.append(max(committed_at - acked_at, 0.0))
    cpu_s = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
    mb = sent_bytes / 1e6
    delays.sort()
    return {
        "streams": args.streams,
        "interval_ms": args.interval_ms,
        "target_mb_per_s": args.rate_mb,
        "appended_mb_per_s": round(mb / elapsed, 1),
        "seconds": round(elapsed, 1),
        "commit_delay_p50_s": round(delays[len(delays) // 2], 2),
        "commit_delay_p99_s": round(delays[int(len(delays) * 0.99)], 2),
        "commit_delay_max_s": round(delays[-1], 2),
        "two_intervals_s": 2 * args.interval_ms / 1000,
        "caught_up_after_last_append_s": round(drain_s, 1),
        "sbp_tables_cpu_s": round(cpu_s, 1),
        "sbp_tables_cpu_ms_per_mb": round(cpu_s * 1000 / mb, 2),
    }


async def _fill_tabled_stream(pm_address: str, pool: ConnectionPool, records: int) -> int:

    pm = PMClient(pm_address, pool=pool, timeout=30)
    [created] = await pm.create_streams([messages.Stream(replica_nums=1, table_interval_ms=1000)])
    assert created.stream is not None
    stream_id = int(created.stream.stream_id)
    rng = np.random.default_rng(7)
    per_batch = 10_000
    lengths = np.full(per_batch, 100, dtype=np.int64)
    async with Producer(pm, stream_id, pool=pool) as producer:
        for start in range(0, records, per_batch):
            count = min(per_batch, records - start)
            # every value its own random bytes, as bench.spark_read's
            values = rng.integers(0, 256, size=count * 100, dtype=np.uint8)
            batch = build_batch_from_arrays(values, lengths[:count], int(time.time() * 1000))
            await producer.send_batch(batch)
    return stream_id


def _timed(query: Callable[[], tuple[int, int]], expected: tuple[int, int]) -> float:
    started = time.perf_counter()
    result = query()
    elapsed = time.perf_counter() - started
    if result != expected:
        raise SystemExit(f"a query returned {result}, expected {expected}")
    return elapsed


def spark_read(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import spark_jobs
    from spark_jobs.session import spark_session

    plan = _plan(root)
    records = args.records

    async def start_and_fill() -> tuple[int, float]:
        async with ConnectionPool() as pool:
            stream_id = await _fill_tabled_stream(plan.pm_addresses, pool, records)
            tabled_s = await _wait_for_tables(root, {stream_id: records}, timeout=600)
        return stream_id, tabled_s

    async def run() -> dict[str, Any]:
        async with running_plan(plan, root):
            print(f"filling a tabled stream with {records:,} records of 100 B …", flush=True)
            stream_id, tabled_s = await start_and_fill()
            return await trio.to_thread.run_sync(measure, stream_id, tabled_s)

    def measure(stream_id: int, tabled_s: float) -> dict[str, Any]:
        spark = spark_session("sbp-bench-tables", conf={"spark.driver.memory": "3g"})
        catalog, warehouse = local_tables(root)
        table = load_table(open_catalog(catalog, warehouse), stream_id)
        assert table is not None
        files = [task.file.file_path for task in table.scan().plan_files()]
        copy = str(root / "copy")
        spark.read.parquet(*files).write.mode("overwrite").parquet(copy)
        aggregate = ["count(*) AS n", "sum(length(value)) AS bytes"]
        expected = (records, records * 100)

        def answer(frame: Any) -> tuple[int, int]:
            row = frame.selectExpr(*aggregate).first()
            return int(row.n), int(row.bytes)

        queries = {
            "read_stream (table)": lambda: answer(
                spark_jobs.read_stream(
                    spark,
                    pm=plan.pm_addresses,
                    streams=[stream_id],
                    catalog=catalog,
                    warehouse=warehouse,
                )
            ),
            "Spark Parquet (same rows)": lambda: answer(spark.read.parquet(copy)),
            "sbp source": lambda: answer(
                spark.read.format("sbp")
                .option("pm", plan.pm_addresses)
                .option("streams", str(stream_id))
                .load()
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in queries}
        for round_ in range(args.warmups + args.repeat):
            for name, query in queries.items():
                seconds = _timed(query, expected)
                if round_ >= args.warmups:
                    times[name].append(seconds)
        spark.stop()
        medians = {name: statistics.median(values) for name, values in times.items()}
        parquet = medians["Spark Parquet (same rows)"]
        return {
            "records": records,
            "data_files": len(files),
            "tabled_after_append_s": round(tabled_s, 1),
            "median_s": {name: round(s, 3) for name, s in medians.items()},
            "rows_per_s": {name: round(records / s) for name, s in medians.items()},
            "read_stream_vs_parquet": round(parquet / medians["read_stream (table)"], 2),
            "sbp_source_vs_parquet": round(parquet / medians["sbp source"], 2),
        }

    return trio.run(run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.tables", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds of each part")
    parser.add_argument("--part", choices=["keep-up", "spark", "both"], default="both")
    parser.add_argument("--streams", type=int, default=10)
    parser.add_argument("--rate-mb", type=float, default=100.0, help="MB/s over all streams")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--interval-ms", type=int, default=5000)
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.rate_mb, args.records, args.repeat, args.warmups = 5, 10, 200_000, 1, 1
    result: dict[str, Any] = {"cores": psutil.cpu_count()}
    if args.part in ("keep-up", "both"):
        with tempfile.TemporaryDirectory(prefix="sbp-bench-tables-") as tmp:
            result["keep_up"] = trio.run(keep_up, args, Path(tmp))
    if args.part in ("spark", "both"):
        with tempfile.TemporaryDirectory(prefix="sbp-bench-tables-") as tmp:
            result["spark"] = spark_read(args, Path(tmp))
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
