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
    READ_REPEATS,
    CPUMeter,
    Load,
    LocalCluster,
    Measurement,
    Workload,
    drive_trio,
    median_run,
    pace_trio,
    paced_measurement,
    percentiles_ms,
)
from bench.tail_consumer import TailAcks, TailConsumer
from client.consumer import Consumer
from client.datanode_client import DataNodeClient
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


async def ping_ms(cluster: LocalCluster, seconds: float) -> dict[str, float]:
    """PING round trips to the data node, one at a time, for ``seconds``:
    what any request costs between this client and the node in Python, with
    no payload and no storage."""
    latencies: list[float] = []
    async with DataNodeClient(cluster.node_address) as node:
        await node.ping()  # the connection, opened outside the measurement
        ends = time.perf_counter() + seconds
        while time.perf_counter() < ends:
            started = time.perf_counter()
            await node.ping()
            latencies.append(time.perf_counter() - started)
    return percentiles_ms(latencies)


async def measure_paced(
    cluster: LocalCluster, workload: Workload, rate_per_s: float, load: Load
) -> Measurement:
    """Appends to one stream offered at ``rate_per_s`` (``pace_trio``)."""
    (stream_id,) = await cluster.create_streams(1)
    server, client = CPUMeter(cluster.node_pid), CPUMeter()
    async with DataNodeClient(cluster.node_address) as node:

        async def send() -> None:
            await node.append_batch(stream_id, workload.batch)

        server.start()
        client.start()
        window = await pace_trio(send, workload, rate_per_s, load)
    durability = durability_label("always")
    measurement = paced_measurement(
        window, SYSTEM, workload, durability, rate_per_s, server.stop(), client.stop()
    )
    await cluster.delete_streams([stream_id])
    return measurement


async def measure_tail(
    cluster: LocalCluster, workload: Workload, rate_per_s: float, load: Load
) -> tuple[list[float], int]:
    """Latency of each batch from its APPEND acknowledgement to a long-polling
    ``Consumer`` of the stream, in a process of its own, holding it. Appends
    are offered at ``rate_per_s`` (``pace_trio``); those sent in the warm-up
    are not counted. Returns the latencies and how many appends were counted."""
    (stream_id,) = await cluster.create_streams(1)
    consumer = await trio.to_thread.run_sync(
        TailConsumer, "sbp", cluster.pm_address, str(stream_id), str(workload.records_per_batch)
    )
    acks = TailAcks(load.warmup)
    try:
        async with DataNodeClient(cluster.node_address) as node:

            async def append_one() -> str:
                return str((await node.append_batch(stream_id, workload.batch)).base_offset)

            await pace_trio(acks.counting(append_one), workload, rate_per_s, load)
        received = await trio.to_thread.run_sync(consumer.finish, acks.answered)
    finally:
        consumer.kill()
    return acks.latencies(received)


async def measure_catch_up(
    cluster: LocalCluster, workload: Workload, total_bytes: int, in_flight: int
) -> Measurement:
    """Write ``total_bytes`` of the workload's batch into one stream, then
    read it all back from offset 0 with a ``Consumer`` (FETCHes of its default size,
    reading ahead, CRC-32C checked), ``READ_REPEATS`` times (the median
    counts)."""
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
    runs = [await _read_back(cluster, stream_id, workload, batches) for _ in range(READ_REPEATS)]
    return median_run(runs)


async def _read_back(
    cluster: LocalCluster, stream_id: int, workload: Workload, batches: int
) -> Measurement:
    """Read the stream from offset 0 to its end with a new ``Consumer``."""
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
