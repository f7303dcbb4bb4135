"""What idempotent producers (SPEC §10) cost: append throughput and data
node CPU with idempotence on and off, alternating in one run, and the
memory and disk that many producers' state takes.

    .venv/bin/python -m bench.idempotence [--quick] [--rounds 5] [--producers 10000]

A PM and one data node (``--sync always``) run as real processes, started
the way ``sbp-cluster`` starts them. Two workloads go through the client
library's ``Producer``, one new stream per run:

- 64 KiB batches, one batch per APPEND, 64 requests in flight;
- 100-byte records, batched by the producer (``send_many``), 5 requests
  in flight (the idempotent producer's default) on and off alike.

Each round runs both workloads with idempotence off, then on (the order
alternates by round), and the figure is the median of the rounds: the
ratio on/off of the same round shares the machine's noise. Then
``--producers`` idempotent producers each append one batch to their own
stream, and the data node's RSS and the ``producers`` and ``sequences``
databases' size are reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lmdb
import psutil
import trio

from bench.output import emit
from client.launcher import Plan, plan_children, running_plan
from client.pm_client import PMClient
from client.producer import Producer
from net.pool import ConnectionPool
from sbp import messages
from sbp.batches import build_batch

from .producer import NodeCpu, make_values

#: bytes of one batch of the first workload
BATCH_BYTES = 64 * 1024
IN_FLIGHT = 64
#: the idempotent producer's default, used on and off alike
RECORDS_IN_FLIGHT = 5


async def _batches(
    pm: PMClient, pool: ConnectionPool, stream_id: int, batch: bytes, count: int, on: bool
) -> float:
    """Seconds to append ``count`` copies of ``batch``, one per APPEND."""
    async with Producer(
        pm,
        stream_id,
        pool=pool,
        idempotent=on,
        max_in_flight=IN_FLIGHT,
        max_request_bytes=len(batch) + 1024,  # one batch per request
    ) as producer:
        started = time.perf_counter()
        for _ in range(count):
            await producer.send_batch(batch)
        await producer.flush()
        return time.perf_counter() - started


async def _records(
    pm: PMClient, pool: ConnectionPool, stream_id: int, values: Sequence[bytes], on: bool
) -> float:
    async with Producer(
        pm, stream_id, pool=pool, idempotent=on, max_in_flight=RECORDS_IN_FLIGHT
    ) as producer:
        started = time.perf_counter()
        for start in range(0, len(values), 10_000):
            await producer.send_many(values[start : start + 10_000])
        await producer.flush()
        return time.perf_counter() - started


def _db_bytes(data_dir: Path, names: Sequence[bytes]) -> int:
    """Bytes of the named databases' pages in a data node's LMDB (read only)."""
    env = lmdb.open(str(data_dir), readonly=True, lock=False, max_dbs=16)
    try:
        total = 0
        with env.begin() as txn:
            for name in names:
                stat = txn.stat(env.open_db(name, txn=txn, create=False))
                pages = stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
                total += pages * stat["psize"]
        return total
    finally:
        env.close()


async def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    pm_child, nodes = plan_children(root, 1, "127.0.0.1", 0, "always", sys.executable)
    batch = bytes(build_batch([b"x" * (BATCH_BYTES - 64)], 0))
    values = make_values(args.records, 100)
    rows: dict[str, list[dict[str, float]]] = {"batches_64k": [], "records_100b": []}
    async with running_plan(Plan([], [pm_child], nodes), root), ConnectionPool() as pool:
        assert nodes[0].process is not None
        node_pid = nodes[0].process.pid
        cpu = NodeCpu(node_pid)
        pm = PMClient(pm_child.address, pool=pool, timeout=30)
        for round_index in range(args.rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            measured: dict[str, dict[bool, tuple[float, float]]] = {k: {} for k in rows}
            for on in order:
                stream = (await pm.create_stream(1)).stream
                assert stream is not None
                cpu.start()
                seconds = await _batches(pm, pool, stream.stream_id, batch, args.batches, on)
                measured["batches_64k"][on] = (seconds, cpu.share(seconds))
                await pm.delete_stream(stream.stream_id)  # long runs stay within the map
                stream = (await pm.create_stream(1)).stream
                assert stream is not None
                cpu.start()
                seconds = await _records(pm, pool, stream.stream_id, values, on)
                measured["records_100b"][on] = (seconds, cpu.share(seconds))
                await pm.delete_stream(stream.stream_id)
            for name, count, nbytes in (
                ("batches_64k", args.batches, args.batches * len(batch)),
                ("records_100b", len(values), len(values) * 100),
            ):
                (off_s, off_cpu), (on_s, on_cpu) = measured[name][False], measured[name][True]
                rows[name].append(
                    {
                        "off_mb_per_s": nbytes / off_s / 1e6,
                        "on_mb_per_s": nbytes / on_s / 1e6,
                        "ratio": off_s / on_s,
                        "off_cpu_us_per_item": off_cpu * off_s / count * 1e6,
                        "on_cpu_us_per_item": on_cpu * on_s / count * 1e6,
                    }
                )
            print(
                f"round {round_index + 1}: "
                + ", ".join(f"{k} on/off {rows[k][-1]['ratio']:.3f}" for k in rows),
                flush=True,
            )
        rss_before = psutil.Process(node_pid).memory_info().rss
        one = bytes(build_batch([b"p" * 100], 0))
        streams = []
        for first in range(0, args.producers, 1000):
            wanted = [messages.Stream(replica_nums=1)] * min(1000, args.producers - first)
            created = await pm.create_streams(wanted, timeout=60)
            streams += [c.stream.stream_id for c in created if c.stream is not None]
        async with trio.open_nursery() as nursery:
            limiter = trio.CapacityLimiter(64)

            async def one_producer(stream_id: int) -> None:
                async with limiter, Producer(pm, stream_id, pool=pool, linger=0) as producer:
                    await producer.send_batch(one)
                    await producer.flush()

            for stream_id in streams:
                nursery.start_soon(one_producer, stream_id)
        rss_after = psutil.Process(node_pid).memory_info().rss
    node_dir = root / "node-1"
    result: dict[str, Any] = {
        "rounds": args.rounds,
        "batches": args.batches,
        "records": args.records,
    }
    for name, measured_rows in rows.items():
        result[name] = {
            key: statistics.median(row[key] for row in measured_rows) for key in measured_rows[0]
        }
    result["producers"] = {
        "count": len(streams),
        "node_rss_growth_mb": (rss_after - rss_before) / 1e6,
        "state_on_disk_mb": _db_bytes(node_dir, [b"producers", b"sequences"]) / 1e6,
    }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.idempotence", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    parser.add_argument("--rounds", type=int, default=5, help="on/off rounds (default: 5)")
    parser.add_argument("--batches", type=int, default=3000, help="64 KiB batches per run")
    parser.add_argument("--records", type=int, default=500_000, help="100-byte records per run")
    parser.add_argument("--producers", type=int, default=10_000, help="producers for the state")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.batches, args.records, args.producers = 2, 200, 50_000, 200
    with tempfile.TemporaryDirectory(prefix="bench-idempotence-") as tmp:
        result = trio.run(run, args, Path(tmp))
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
