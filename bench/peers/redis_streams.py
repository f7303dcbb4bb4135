"""Redis Streams as a peer: Debian's ``redis-server`` with an append-only
file, each record batch one XADD entry (one field holding the batch bytes).

Durability: ``appendfsync always`` makes Redis write and fsync the AOF
before it answers the commands it read in one event-loop turn (its group
commit); ``everysec`` answers first and fsyncs once a second. Both are set
per run with CONFIG SET on one server. RDB snapshots and AOF rewrites are
off, so no background fork lands inside a measurement.

"N in flight" is a pipeline of N XADDs: sent in one write, answered
together; each one's latency is its pipeline's round trip.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis
import redis.asyncio

from bench.harness import (
    READ_REPEATS,
    CPUMeter,
    Load,
    Measurement,
    Workload,
    entries_per_read,
    median_run,
    pace_asyncio,
    paced_measurement,
    percentiles_ms,
)
from bench.peers.servers import ServerProcess, accepts_connections
from bench.tail_consumer import TailAcks, TailConsumer

SYSTEM = "redis-streams"
FIELD = b"b"
#: connections an open loop may hold at once (one per XADD awaiting its answer)
PACED_CONNECTIONS = 256


def redis_server(parent: Path | None = None) -> ServerProcess:
    def argv(port: int, directory: Path) -> list[str]:
        return [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(directory),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--auto-aof-rewrite-percentage",
            "0",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
        ]

    return ServerProcess("redis-server", argv, accepts_connections, parent)


def stream_key(index: int) -> bytes:
    return b"s%d" % index


def measure_appends(
    server: ServerProcess, workload: Workload, fsync: str, load: Load
) -> Measurement:
    """XADD pipelines of ``load.in_flight`` entries, for the load's window."""
    in_flight = load.in_flight
    client = redis.Redis(port=server.port, socket_timeout=60)
    client.config_set("appendfsync", fsync)
    client.flushall()
    keys = [stream_key(i) for i in range(workload.streams)]
    fields = {FIELD: workload.batch}
    server_cpu, client_cpu = CPUMeter(server.pid), CPUMeter()
    window = load.window()
    turn = 0
    server_cpu.start()
    client_cpu.start()
    while (sent := time.perf_counter()) < window.closes:
        pipe = client.pipeline(transaction=False)
        for _ in range(in_flight):
            pipe.xadd(keys[turn % len(keys)], fields)  # type: ignore[arg-type]
            turn += 1
        pipe.execute()
        done = time.perf_counter()
        for _ in range(in_flight):
            window.record(sent, done, len(workload.batch), workload.records_per_batch)
    measurement = window.measurement(
        SYSTEM, workload, f"aof {fsync}", in_flight, server_cpu.stop(), client_cpu.stop()
    )
    client.flushall()
    client.close()
    return measurement


def measure_paced(
    server: ServerProcess, workload: Workload, fsync: str, rate_per_s: float, load: Load
) -> Measurement:
    """XADDs to one stream offered at ``rate_per_s`` (``pace_asyncio``), each
    on a pooled connection of its own."""
    return asyncio.run(_paced(server, workload, fsync, rate_per_s, load))


async def _paced(
    server: ServerProcess, workload: Workload, fsync: str, rate_per_s: float, load: Load
) -> Measurement:
    admin = redis.Redis(port=server.port)
    admin.config_set("appendfsync", fsync)
    admin.flushall()
    admin.close()
    pool = redis.asyncio.BlockingConnectionPool(
        port=server.port, max_connections=PACED_CONNECTIONS, timeout=None
    )
    producer = redis.asyncio.Redis(connection_pool=pool)
    key, fields = stream_key(0), {FIELD: workload.batch}

    async def send() -> None:
        await producer.xadd(key, fields)  # type: ignore[arg-type]

    server_cpu, client_cpu = CPUMeter(server.pid), CPUMeter()
    server_cpu.start()
    client_cpu.start()
    window = await pace_asyncio(send, workload, rate_per_s, load)
    measurement = paced_measurement(
        window, SYSTEM, workload, f"aof {fsync}", rate_per_s, server_cpu.stop(), client_cpu.stop()
    )
    await producer.aclose()
    await pool.aclose()
    return measurement


def measure_catch_up(
    server: ServerProcess, workload: Workload, total_bytes: int, in_flight: int
) -> Measurement:
    """Write ``total_bytes`` into one stream, then XRANGE it all back in order,
    ``READ_REPEATS`` times (the median counts)."""
    client = redis.Redis(port=server.port, socket_timeout=60)
    client.config_set("appendfsync", "everysec")
    client.flushall()
    key = stream_key(0)
    batches = max(1, total_bytes // len(workload.batch))
    for first in range(0, batches, in_flight):
        pipe = client.pipeline(transaction=False)
        for _ in range(min(in_flight, batches - first)):
            pipe.xadd(key, {FIELD: workload.batch})
        pipe.execute()
    runs = [_read_back(server, client, key, workload, batches) for _ in range(READ_REPEATS)]
    client.flushall()
    client.close()
    return median_run(runs)


def _read_back(
    server: ServerProcess, client: redis.Redis, key: bytes, workload: Workload, batches: int
) -> Measurement:
    """XRANGE the whole stream, as many bytes a call as a FETCH asks for."""
    count = entries_per_read(workload)
    server_cpu, client_cpu = CPUMeter(server.pid), CPUMeter()
    server_cpu.start()
    client_cpu.start()
    started = time.perf_counter()
    read = nbytes = 0
    last = b"-"
    while True:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(  # type: ignore[assignment]
            key, min=last, max="+", count=count
        )
        if last != b"-":
            entries = entries[1:]  # XRANGE's start is inclusive
        if not entries:
            break
        for entry_id, values in entries:
            nbytes += len(values[FIELD])
            read += 1
            last = entry_id
    seconds = time.perf_counter() - started
    if read != batches:
        raise RuntimeError(f"read back {read} entries of {batches}")
    return Measurement(
        system=SYSTEM,
        workload=workload.key,
        durability="n/a (read)",
        in_flight=1,
        seconds=round(seconds, 4),
        requests=0,
        bytes=nbytes,
        records=read * workload.records_per_batch,
        latency_ms=percentiles_ms([]),
        server_cpu=server_cpu.stop(),
        client_cpu=client_cpu.stop(),
    )


def measure_tail(
    server: ServerProcess, workload: Workload, fsync: str, rate_per_s: float, load: Load
) -> tuple[list[float], int]:
    """Latency from each XADD's answer to a client blocked in XREAD (in a
    process of its own) receiving the entry, XADDs offered at ``rate_per_s``
    (``pace_asyncio``); those sent in the warm-up are not counted."""
    return asyncio.run(_tail(server.port, workload, fsync, rate_per_s, load))


async def _tail(
    port: int, workload: Workload, fsync: str, rate_per_s: float, load: Load
) -> tuple[list[float], int]:
    admin = redis.Redis(port=port)
    admin.config_set("appendfsync", fsync)
    admin.flushall()
    admin.close()
    key = stream_key(0)
    # a pool: each XADD in flight takes its own connection, as pipelining
    # would not let the answers come back one by one
    pool = redis.asyncio.BlockingConnectionPool(
        port=port, max_connections=PACED_CONNECTIONS, timeout=None
    )
    producer = redis.asyncio.Redis(connection_pool=pool)
    consumer = TailConsumer("redis", str(port), key.decode())
    acks = TailAcks(load.warmup)
    try:

        async def append_one() -> str:
            entry_id: bytes = await producer.xadd(key, {FIELD: workload.batch})
            return entry_id.decode()

        await pace_asyncio(acks.counting(append_one), workload, rate_per_s, load)
        loop = asyncio.get_running_loop()
        received = await loop.run_in_executor(None, consumer.finish, acks.answered)
    finally:
        consumer.kill()
    await producer.aclose()
    await pool.aclose()
    return acks.latencies(received)
