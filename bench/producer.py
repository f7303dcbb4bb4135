"""Client library benchmark: producer throughput and consumer catch-up reads
through the whole client path (batching, encoding, routing, APPEND and FETCH,
decoding with CRC-32C checks).

    .venv/bin/python -m bench.producer [--quick] [--records N] [--value-bytes 100]

A PM and one data node (``--sync always``) run as real processes under a
temporary directory, started the way ``sbp-cluster`` starts them; the
producer and the consumer run in this process over loopback. Each figure is
the best of ``--runs`` runs, each on a new stream.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import trio

from client.consumer import Consumer
from client.launcher import Plan, plan_children, running_plan
from client.pm_client import PMClient
from client.producer import Producer
from net.pool import ConnectionPool

#: records handed to send_many at a time, as an application loop would
SEND_CHUNK = 10_000


@dataclass
class Result:
    label: str
    records: int
    value_bytes: int
    seconds: float
    node_cpu: float  # fraction of one core used by the data node

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.value_bytes / self.seconds / 1e6

    def line(self) -> str:
        return (
            f"{self.label:<40} {self.records_per_s:>12,.0f} records/s "
            f"{self.mb_per_s:>8.1f} MB/s  node CPU {self.node_cpu:.0%}"
        )


def make_values(count: int, size: int) -> list[bytes]:
    """``count`` distinct values of ``size`` bytes (made before any timing)."""
    blob = os.urandom(count * size)
    return [blob[i : i + size] for i in range(0, count * size, size)]


class NodeCpu:
    """CPU seconds of the data node process between ``start`` and ``stop``."""

    def __init__(self, pid: int) -> None:
        self._process = psutil.Process(pid)
        self._start = 0.0

    def _seconds(self) -> float:
        times = self._process.cpu_times()
        return float(times.user + times.system)

    def start(self) -> None:
        self._start = self._seconds()

    def share(self, wall: float) -> float:
        return (self._seconds() - self._start) / wall


async def produce(
    pm: PMClient,
    pool: ConnectionPool,
    stream_id: int,
    values: Sequence[bytes],
    *,
    per_record: bool,
    max_in_flight: int,
) -> float:
    """Seconds to send every value and see it durable."""
    async with Producer(pm, stream_id, pool=pool, max_in_flight=max_in_flight) as producer:
        started = time.perf_counter()
        if per_record:
            for value in values:
                await producer.send(value)
        else:
            for start in range(0, len(values), SEND_CHUNK):
                await producer.send_many(values[start : start + SEND_CHUNK])
        await producer.flush()
        return time.perf_counter() - started


async def consume(pm: PMClient, pool: ConnectionPool, stream_id: int) -> tuple[int, int, float]:
    """Records, value bytes and seconds to read a stream from offset 0 to its end."""
    records = value_bytes = 0
    async with Consumer(pm, stream_id, 0, pool=pool) as consumer:
        started = time.perf_counter()
        async for batch in consumer:
            records += len(batch)
            value_bytes += len(batch.values)
        return records, value_bytes, time.perf_counter() - started


async def run(args: argparse.Namespace) -> list[Result]:
    values = make_values(args.records, args.value_bytes)
    per_record_values = values[: max(args.records // 10, 1)]
    data_bytes = args.records * args.value_bytes
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-producer-") as tmp:
        pm_child, node_children = plan_children(
            Path(tmp), 1, "127.0.0.1", 0, "always", sys.executable
        )
        async with running_plan(Plan([], [pm_child], node_children), Path(tmp)):
            assert node_children[0].process is not None
            cpu = NodeCpu(node_children[0].process.pid)
            async with ConnectionPool() as pool:
                pm = PMClient(pm_child.address, pool=pool)

                async def best(label: str, in_flight: int, per_record: bool) -> int:
                    runs = []
                    stream_id = 0
                    sent = per_record_values if per_record else values
                    for _ in range(args.runs):
                        stream = (await pm.create_stream(1)).stream
                        assert stream is not None
                        stream_id = stream.stream_id
                        cpu.start()
                        seconds = await produce(
                            pm,
                            pool,
                            stream_id,
                            sent,
                            per_record=per_record,
                            max_in_flight=in_flight,
                        )
                        runs.append(
                            Result(
                                label,
                                len(sent),
                                len(sent) * args.value_bytes,
                                seconds,
                                cpu.share(seconds),
                            )
                        )
                    results.append(min(runs, key=lambda r: r.seconds))
                    print(results[-1].line(), flush=True)
                    return stream_id

                await best("produce send_many, 1 request in flight", 1, False)
                stream_id = await best("produce send_many, 4 requests in flight", 4, False)
                await best("produce send() per record, 1 in flight", 1, True)

                reads = []
                for _ in range(args.runs):
                    cpu.start()
                    records, nbytes, seconds = await consume(pm, pool, stream_id)
                    if records != args.records or nbytes != data_bytes:
                        raise AssertionError(f"read {records} records, {nbytes} bytes")
                    reads.append(
                        Result(
                            "consume catch-up from offset 0",
                            records,
                            nbytes,
                            seconds,
                            cpu.share(seconds),
                        )
                    )
                results.append(min(reads, key=lambda r: r.seconds))
                print(results[-1].line(), flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.producer", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="300,000 records, one run")
    parser.add_argument("--records", type=int, default=2_000_000)
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.records, args.runs = 300_000, 1
    print(
        f"{args.records:,} records of {args.value_bytes} bytes, best of {args.runs} run(s); "
        "PM + 1 data node with --sync always",
        flush=True,
    )
    trio.run(run, args)


if __name__ == "__main__":
    main()
