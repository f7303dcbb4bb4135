"""The system under test, driven exactly as the peers are: a local cluster
(one PM, one data node) and this process as the client over loopback.

Appends go through ``DataNodeClient.append``, one record batch per APPEND,
with N requests in flight on the one pooled connection; the tail consumer and
the catch-up reader are the client library's ``Consumer``.
"""

from __future__ import annotations

import time

import trio

from bench.harness import (
    CPUMeter,
    Load,
    LocalCluster,
    Measurement,
    Workload,
    drive_trio,
    percentiles_ms,
)
from client.consumer import Consumer
from client.datanode_client import DataNodeClient
from net.pool import ConnectionPool
from sbp.errors import raise_for_code

SYSTEM = "sbp"


def durability_label(sync: str) -> str:
    return "sync always" if sync == "always" else "sync never"


async def measure_appends(
    cluster: LocalCluster,
    sync: str,
    workload: Workload,
    load: Load,
) -> Measurement:
    """Appends of the workload's batch to fresh streams under ``load``."""
    stream_ids = await cluster.create_streams(workload.streams)
    server, client = CPUMeter(cluster.node_pid), CPUMeter()
    async with DataNodeClient(cluster.node_address) as node:

        async def send(index: int) -> None:
            await node.append_batch(stream_ids[index], workload.batch)

        async def send_several(index: int) -> None:
            items = [
                (stream_ids[(index + i) % len(stream_ids)], workload.batch)
                for i in range(load.batches_per_request)
            ]
            for result in await node.append(items):
                raise_for_code(result.error_code, result.error_message)

        server.start()
        client.start()
        window = await drive_trio(
            send if load.batches_per_request == 1 else send_several, workload, load
        )
    measurement = window.measurement(
        SYSTEM, workload, durability_label(sync), load.in_flight, server.stop(), client.stop()
    )
    measurement.extra["batches_per_request"] = load.batches_per_request
    await cluster.delete_streams(stream_ids)
    return measurement


async def measure_tail(
    cluster: LocalCluster, workload: Workload, rate_per_s: float, seconds: float
) -> tuple[list[float], int]:
    """Latency of each batch from its APPEND acknowledgement to a long-polling
    ``Consumer`` of the stream holding it, with one append sent every
    1/``rate_per_s`` s (each on its own task, so a slow answer does not delay
    the next send). Returns the latencies and how many appends were sent."""
    (stream_id,) = await cluster.create_streams(1)
    acked: dict[int, float] = {}
    received: dict[int, float] = {}
    step = workload.records_per_batch
    interval = 1.0 / rate_per_s
    async with ConnectionPool() as pool:
        node = DataNodeClient(cluster.node_address, pool=pool)
        consumer_pool = ConnectionPool()  # its own connection, as a separate reader would have
        async with (
            consumer_pool,
            Consumer(cluster.pm_address, stream_id, 0, pool=consumer_pool, tail=True) as consumer,
            trio.open_nursery() as nursery,
        ):

            async def consume() -> None:
                async for records in consumer:
                    now = time.perf_counter()
                    first, last = int(records.offsets[0]), int(records.offsets[-1])
                    for base in range(first - first % step, last + 1, step):
                        received.setdefault(base, now)

            async def append_one() -> None:
                result = await node.append_batch(stream_id, workload.batch)
                acked[result.base_offset] = time.perf_counter()

            nursery.start_soon(consume)
            sent = 0
            next_send = trio.current_time()
            stop_at = next_send + seconds
            async with trio.open_nursery() as senders:
                while next_send < stop_at:
                    await trio.sleep_until(next_send)
                    senders.start_soon(append_one)
                    sent += 1
                    next_send += interval
            with trio.move_on_after(2.0):
                while any(base not in received for base in acked):
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    latencies = [received[base] - acked[base] for base in acked if base in received]
    return latencies, sent


async def measure_catch_up(
    cluster: LocalCluster, workload: Workload, total_bytes: int, in_flight: int
) -> Measurement:
    """Write ``total_bytes`` of the workload's batch into one stream, then
    read it all back from offset 0 with a ``Consumer`` (FETCH 1 MiB chunks,
    prefetching, CRC-32C checked)."""
    (stream_id,) = await cluster.create_streams(1)
    batches = max(1, total_bytes // len(workload.batch))
    async with DataNodeClient(cluster.node_address) as node:
        remaining = batches

        async def writer() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await node.append_batch(stream_id, workload.batch)

        async with trio.open_nursery() as nursery:
            for _ in range(in_flight):
                nursery.start_soon(writer)
    records = 0
    server, client = CPUMeter(cluster.node_pid), CPUMeter()
    async with Consumer(cluster.pm_address, stream_id, 0) as consumer:
        server.start()
        client.start()
        started = time.perf_counter()
        async for batch in consumer:
            records += len(batch)
            if records >= batches * workload.records_per_batch:
                break
        seconds = time.perf_counter() - started
    expected = batches * workload.records_per_batch
    if records != expected:
        raise RuntimeError(f"read back {records} records of {expected}")
    return Measurement(
        system=SYSTEM,
        workload=workload.key,
        durability="n/a (read)",
        in_flight=1,
        seconds=round(seconds, 4),
        requests=0,
        bytes=batches * len(workload.batch),
        records=records,
        latency_ms=percentiles_ms([]),
        server_cpu=server.stop(),
        client_cpu=client.stop(),
    )
