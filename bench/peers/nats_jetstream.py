"""NATS JetStream as a peer: Debian's ``nats-server -js`` with file storage,
each record batch one message published with an acknowledgement.

One JetStream stream carries the subjects ``bench.<i>``: N "streams" of the
workload are N subjects, the way a NATS user maps many logs onto one stream.
N requests in flight are N publishes awaiting their PubAck on one
connection. Durability: nats-server 2.9 acknowledges a message once it is
written to its block file and fsyncs on a timer (``sync_interval`` came in
2.10), so its acks are not those of a synced commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import nats
from nats.aio.msg import Msg
from nats.js import api

from bench.harness import CPUMeter, Load, Measurement, Workload, drive_asyncio, percentiles_ms
from bench.peers.servers import ServerProcess, accepts_connections

SYSTEM = "nats-jetstream"
STREAM = "BENCH"
#: messages per pull when reading back: ~1 MiB of 64 KiB messages, as FETCH asks
READ_BATCH = 16
MAX_PAYLOAD = 8 * 1024 * 1024


def nats_server(parent: Path | None = None) -> ServerProcess:
    def argv(port: int, directory: Path) -> list[str]:
        config = directory / "nats.conf"
        config.write_text(
            f"listen: 127.0.0.1:{port}\n"
            f"max_payload: {MAX_PAYLOAD}\n"
            f'jetstream {{\n  store_dir: "{directory / "js"}"\n}}\n'
        )
        return ["nats-server", "-c", str(config)]

    return ServerProcess("nats-server", argv, accepts_connections, parent)


def url(server: ServerProcess) -> str:
    return f"nats://127.0.0.1:{server.port}"


async def _fresh_stream(js: nats.js.JetStreamContext) -> None:
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await js.delete_stream(STREAM)
    await js.add_stream(
        api.StreamConfig(
            name=STREAM,
            subjects=["bench.>"],
            storage=api.StorageType.FILE,
            max_msg_size=MAX_PAYLOAD,
        )
    )


def measure_appends(server: ServerProcess, workload: Workload, load: Load) -> Measurement:
    """Publishes with acks, ``load.in_flight`` outstanding, for the load's window."""
    return asyncio.run(_appends(server, workload, load))


async def _appends(server: ServerProcess, workload: Workload, load: Load) -> Measurement:
    nc = await nats.connect(url(server), max_reconnect_attempts=0)
    js = nc.jetstream(timeout=30)
    await _fresh_stream(js)
    subjects = [f"bench.{i}" for i in range(workload.streams)]
    batch = workload.batch

    async def send(index: int) -> None:
        await js.publish(subjects[index], batch, stream=STREAM)

    server_cpu, client_cpu = CPUMeter(server.pid), CPUMeter()
    server_cpu.start()
    client_cpu.start()
    window = await drive_asyncio(send, workload, load)
    measurement = window.measurement(
        SYSTEM, workload, "file store", load.in_flight, server_cpu.stop(), client_cpu.stop()
    )
    await js.delete_stream(STREAM)
    await nc.close()
    return measurement


def measure_catch_up(
    server: ServerProcess, workload: Workload, total_bytes: int, in_flight: int
) -> Measurement:
    """Publish ``total_bytes`` to one subject, then pull it all back in order."""
    return asyncio.run(_catch_up(server, workload, total_bytes, in_flight))


async def _catch_up(
    server: ServerProcess, workload: Workload, total_bytes: int, in_flight: int
) -> Measurement:
    nc = await nats.connect(url(server), max_reconnect_attempts=0)
    js = nc.jetstream(timeout=30)
    await _fresh_stream(js)
    batches = max(1, total_bytes // len(workload.batch))
    remaining = batches

    async def writer() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await js.publish("bench.0", workload.batch, stream=STREAM)

    await asyncio.gather(*(writer() for _ in range(in_flight)))
    server_cpu, client_cpu = CPUMeter(server.pid), CPUMeter()
    server_cpu.start()
    client_cpu.start()
    started = time.perf_counter()
    subscription = await js.pull_subscribe(
        "bench.0",
        stream=STREAM,
        config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE),
    )
    read = nbytes = 0
    while read < batches:
        for message in await subscription.fetch(min(READ_BATCH, batches - read), timeout=10):
            nbytes += len(message.data)
            read += 1
    seconds = time.perf_counter() - started
    result = Measurement(
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
    await subscription.unsubscribe()
    await js.delete_stream(STREAM)
    await nc.close()
    return result


def measure_tail(
    server: ServerProcess, workload: Workload, rate_per_s: float, seconds: float
) -> tuple[list[float], int]:
    """Latency from each publish's PubAck to a push subscriber (its own
    connection) receiving the message, one publish every 1/``rate_per_s`` s."""
    return asyncio.run(_tail(server, workload, rate_per_s, seconds))


async def _tail(
    server: ServerProcess, workload: Workload, rate_per_s: float, seconds: float
) -> tuple[list[float], int]:
    nc = await nats.connect(url(server), max_reconnect_attempts=0)
    reader_nc = await nats.connect(url(server), max_reconnect_attempts=0)
    js = nc.jetstream(timeout=30)
    await _fresh_stream(js)
    acked: dict[int, float] = {}
    received: dict[int, float] = {}

    async def on_message(message: Msg) -> None:
        received.setdefault(message.metadata.sequence.stream, time.perf_counter())

    subscription = await reader_nc.jetstream().subscribe(
        "bench.0", stream=STREAM, cb=on_message, ordered_consumer=True
    )

    async def publish_one() -> None:
        ack = await js.publish("bench.0", workload.batch, stream=STREAM)
        acked[ack.seq] = time.perf_counter()

    loop = asyncio.get_running_loop()
    interval = 1.0 / rate_per_s
    next_send = loop.time()
    stop_at = next_send + seconds
    tasks = []
    while next_send < stop_at:
        await asyncio.sleep(max(0.0, next_send - loop.time()))
        tasks.append(asyncio.create_task(publish_one()))
        next_send += interval
    await asyncio.gather(*tasks)
    deadline = time.perf_counter() + 2.0
    while any(seq not in received for seq in acked) and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)
    await subscription.unsubscribe()
    await js.delete_stream(STREAM)
    await reader_nc.close()
    await nc.close()
    return [received[s] - acked[s] for s in acked if s in received], len(tasks)
