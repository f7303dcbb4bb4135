"""What every scenario of the suite shares: the workloads, the measurement
record, load drivers that keep N requests in flight, latency percentiles,
a process's CPU use, the local SBP cluster, and the machine and versions a
result was measured with.

A measurement counts only what completes inside its window: the drivers run
a warm-up first (connections opened, caches and LMDB pages warm) and stop
counting at the deadline, so that the start-up and the tail of the last
requests are left out alike.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import trio

from bench.storage import make_batch
from client.consumer import DEFAULT_FETCH_BYTES
from client.launcher import Plan, plan_children, running_plan
from client.pm_client import PMClient
from sbp import messages
from sbp.batches import build_batch, peek_header

#: seconds of load before a measurement window opens
WARMUP_S = 0.3
#: the latency percentiles every result reports
PERCENTILES = (("p50", 0.50), ("p95", 0.95), ("p99", 0.99), ("p99.9", 0.999))


# -- workloads -----------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What one request carries: one SBP record batch, sent as it is to every
    system (an APPEND item, an XADD field, a JetStream message), round-robin
    over ``streams`` streams."""

    key: str
    label: str
    batch: bytes
    records_per_batch: int
    streams: int


def batch_64k() -> tuple[bytes, int]:
    """The 64 KiB batch of the storage benchmarks (63 records of ~1 KiB) and
    its record count."""
    batch = make_batch(64 * 1024)
    return batch, peek_header(batch).record_count


def batch_of_small_records(records: int = 1000, size: int = 100) -> bytes:
    """``records`` records of ``size`` bytes in one batch (~104 KB for 1,000 x 100 B)."""
    return bytes(build_batch([b"v" * size] * records, 0))


def one_stream_64k() -> Workload:
    """64 KiB batches to one stream: the workload of the latency, tail and
    replication scenarios, and the first of the append suite."""
    batch, records = batch_64k()
    return Workload("64k-1", "64 KiB batches, 1 stream", batch, records, 1)


def standard_workloads() -> list[Workload]:
    """The append workloads of the suite."""
    big, big_records = batch_64k()
    small = batch_of_small_records()
    return [
        one_stream_64k(),
        Workload("64k-100", "64 KiB batches, 100 streams", big, big_records, 100),
        Workload("64k-2000", "64 KiB batches, 2,000 streams", big, big_records, 2000),
        Workload("100b-1", "100 B records x 1,000 per batch, 1 stream", small, 1000, 1),
    ]


# -- measurements --------------------------------------------------------------


@dataclass
class Measurement:
    """One system under one load: rates over the window, latency of each
    request from send to acknowledgement, and CPU use (1.0 = one core)."""

    system: str
    workload: str
    durability: str
    in_flight: int
    seconds: float
    requests: int
    bytes: int
    records: int
    latency_ms: dict[str, float]
    server_cpu: float | None = None
    client_cpu: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            mb_per_s=round(self.mb_per_s, 3),
            records_per_s=round(self.records_per_s, 1),
            requests_per_s=round(self.requests_per_s, 1),
        )
        return out


def percentiles_ms(latencies_s: list[float]) -> dict[str, float]:
    """p50/p95/p99/p99.9 and max in milliseconds (nearest-rank)."""
    if not latencies_s:
        return {name: 0.0 for name, _ in PERCENTILES} | {"max": 0.0}
    ordered = sorted(latencies_s)
    out = {}
    for name, fraction in PERCENTILES:
        index = min(len(ordered) - 1, max(0, int(fraction * len(ordered) + 0.999999) - 1))
        out[name] = round(ordered[index] * 1e3, 4)
    out["max"] = round(ordered[-1] * 1e3, 4)
    return out


#: how many times a catch-up read is repeated over the same data (the median counts)
READ_REPEATS = 3


def entries_per_read(workload: Workload) -> int:
    """How many of the workload's batches a peer's reader asks for at once
    in a catch-up read: as many bytes as the ``Consumer`` asks per FETCH,
    so every system reads in requests of the same size."""
    return max(1, DEFAULT_FETCH_BYTES // len(workload.batch))


def median_run(runs: list[Measurement]) -> Measurement:
    """The run with the median time, with every run's MB/s in its ``extra``."""
    ordered = sorted(runs, key=lambda m: m.seconds)
    chosen = ordered[len(ordered) // 2]
    chosen.extra["runs_mb_per_s"] = [round(m.mb_per_s, 1) for m in runs]
    return chosen


class CPUMeter:
    """User + system CPU seconds of processes over a window, as a fraction
    of one core (``None`` when the process is gone)."""

    def __init__(self, pid: int | None = None) -> None:
        self._process = psutil.Process(pid)
        self._started_cpu = 0.0
        self._started_at = 0.0

    def _cpu(self) -> float:
        times = self._process.cpu_times()
        return float(times.user + times.system)

    def start(self) -> None:
        self._started_cpu = self._cpu()
        self._started_at = time.perf_counter()

    def stop(self) -> float | None:
        try:
            used = self._cpu() - self._started_cpu
        except psutil.Error:
            return None
        return round(used / (time.perf_counter() - self._started_at), 3)


@dataclass
class Window:
    """Counts what completes between ``opens`` and ``closes`` (perf_counter)."""

    opens: float
    closes: float
    requests: int = 0
    bytes: int = 0
    records: int = 0
    latencies: list[float] = field(default_factory=list)
    #: requests sent inside the window by an open loop (``pace_trio``), and
    #: how many of them the server refused
    offered: int = 0
    refused: int = 0

    def record(self, sent: float, done: float, nbytes: int, records: int) -> None:
        if self.opens <= done <= self.closes:
            self.requests += 1
            self.bytes += nbytes
            self.records += records
            self.latencies.append(done - sent)

    def measurement(
        self,
        system: str,
        workload: Workload,
        durability: str,
        in_flight: int,
        server_cpu: float | None,
        client_cpu: float | None,
    ) -> Measurement:
        return Measurement(
            system=system,
            workload=workload.key,
            durability=durability,
            in_flight=in_flight,
            seconds=round(self.closes - self.opens, 4),
            requests=self.requests,
            bytes=self.bytes,
            records=self.records,
            latency_ms=percentiles_ms(self.latencies),
            server_cpu=server_cpu,
            client_cpu=client_cpu,
        )


@dataclass(frozen=True)
class Load:
    """How hard and how long: requests in flight, record batches per request
    (streams ``index`` to ``index + batches_per_request - 1``), the measured
    window and the warm-up before it (seconds)."""

    in_flight: int
    seconds: float
    warmup: float = WARMUP_S
    batches_per_request: int = 1

    def window(self) -> Window:
        started = time.perf_counter()
        return Window(started + self.warmup, started + self.warmup + self.seconds)


#: one request of a load: sends the next batch of stream ``index`` (and of the
#: streams after it, with several batches per request); returns when acknowledged
Send = Callable[[int], Awaitable[None]]


async def drive_trio(send: Send, workload: Workload, load: Load) -> Window:
    """Keep ``load.in_flight`` requests outstanding (one task each), round-robin
    over the workload's streams, for the warm-up and then the window."""
    window = load.window()
    per_request = load.batches_per_request
    nbytes, records = len(workload.batch) * per_request, workload.records_per_batch * per_request
    turn = 0

    async def lane() -> None:
        nonlocal turn
        while (sent := time.perf_counter()) < window.closes:
            index = turn % workload.streams
            turn += per_request
            await send(index)
            window.record(sent, time.perf_counter(), nbytes, records)

    async with trio.open_nursery() as nursery:
        for _ in range(load.in_flight):
            nursery.start_soon(lane)
    return window


async def drive_asyncio(send: Send, workload: Workload, load: Load) -> Window:
    """``drive_trio`` for the peers' asyncio clients."""
    window = load.window()
    per_request = load.batches_per_request
    nbytes, records = len(workload.batch) * per_request, workload.records_per_batch * per_request
    turn = 0

    async def lane() -> None:
        nonlocal turn
        while (sent := time.perf_counter()) < window.closes:
            index = turn % workload.streams
            turn += per_request
            await send(index)
            window.record(sent, time.perf_counter(), nbytes, records)

    await asyncio.gather(*(lane() for _ in range(load.in_flight)))
    return window


#: one request of an open loop: sends the workload's batch; returns when acknowledged
SendOne = Callable[[], Awaitable[None]]
#: how long an open loop waits for the answers of what it sent in its window
PACED_DRAIN_S = 10.0


def _paced(window: Window, workload: Workload, offered: int) -> Window:
    """The window of an open loop: what was answered of the ``offered``."""
    answered = len(window.latencies)
    window.offered, window.requests = offered, answered
    window.bytes = answered * len(workload.batch)
    window.records = answered * workload.records_per_batch
    return window


def paced_measurement(
    window: Window,
    system: str,
    workload: Workload,
    durability: str,
    rate_per_s: float,
    server_cpu: float | None,
    client_cpu: float | None,
) -> Measurement:
    """An open loop's result: in flight 0, the offered rate in ``extra``."""
    measurement = window.measurement(system, workload, durability, 0, server_cpu, client_cpu)
    measurement.extra |= {
        "offered_per_s": round(rate_per_s, 1),
        "offered_mb_per_s": round(rate_per_s * len(workload.batch) / 1e6, 3),
        "offered": window.offered,
        "refused": window.refused,
    }
    return measurement


async def _answered(send: SendOne, window: Window, counted: bool) -> None:
    """One request of an open loop, its latency noted if ``counted``. Plain
    awaits only, so it runs under trio and asyncio alike."""
    sent = time.perf_counter()
    try:
        await send()
    except Exception:  # refused (a server shedding load): not answered
        window.refused += counted
        return
    if counted:
        window.latencies.append(time.perf_counter() - sent)


async def pace_trio(send: SendOne, workload: Workload, rate_per_s: float, load: Load) -> Window:
    """An open loop: one request every 1/``rate_per_s`` s, each on its own
    task, whether or not the earlier ones were answered (the way independent
    clients offer load). The latencies are those of the requests sent inside
    the window, each awaited (up to ``PACED_DRAIN_S`` after the window)."""
    window = load.window()
    interval = 1.0 / rate_per_s

    sent = 0
    with trio.move_on_after(load.warmup + load.seconds + PACED_DRAIN_S):
        async with trio.open_nursery() as nursery:
            next_send = time.perf_counter()
            while next_send < window.closes:
                await trio.sleep(max(0.0, next_send - time.perf_counter()))
                counted = next_send >= window.opens
                sent += counted
                nursery.start_soon(_answered, send, window, counted)
                next_send += interval
    return _paced(window, workload, sent)


async def pace_asyncio(send: SendOne, workload: Workload, rate_per_s: float, load: Load) -> Window:
    """``pace_trio`` for the peers' asyncio clients."""
    window = load.window()
    interval = 1.0 / rate_per_s

    tasks = []
    sent = 0
    next_send = time.perf_counter()
    while next_send < window.closes:
        await asyncio.sleep(max(0.0, next_send - time.perf_counter()))
        counted = next_send >= window.opens
        sent += counted
        tasks.append(asyncio.create_task(_answered(send, window, counted)))
        next_send += interval
    _done, pending = await asyncio.wait(tasks, timeout=PACED_DRAIN_S) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    return _paced(window, workload, sent)


# -- the local SBP cluster -------------------------------------------------------


@dataclass
class LocalCluster:
    """A PM and one data node as processes (``client.launcher``), on free
    loopback ports, with their data in a temporary directory."""

    pm_address: str
    node_address: str
    node_pid: int
    data_dir: Path

    async def create_streams(self, count: int) -> list[int]:
        """``count`` streams of one replica; their ids, all on the one data node."""
        ids: list[int] = []
        async with PMClient(self.pm_address) as pm:
            for first in range(0, count, 1000):
                wanted = [messages.Stream(replica_nums=1)] * min(1000, count - first)
                for result in await pm.create_streams(wanted, timeout=60):
                    if result.error_code != 0 or result.stream is None:
                        raise RuntimeError(f"CREATE_STREAMS failed: {result.error_message}")
                    if result.range is not None:
                        primary = result.range.primary_node()
                        address = primary.advertise_addr if primary else ""
                        if address != self.node_address:
                            raise RuntimeError(f"stream placed on {address}, not the data node")
                    ids.append(result.stream.stream_id)
        return ids

    async def delete_streams(self, stream_ids: list[int]) -> None:
        """Delete streams a measurement is done with, so their data is freed
        and a long run does not fill the node's storage."""
        async with PMClient(self.pm_address) as pm:
            for first in range(0, len(stream_ids), 1000):
                for result in await pm.delete_streams(stream_ids[first : first + 1000], timeout=60):
                    if result.error_code != 0:
                        raise RuntimeError(f"DELETE_STREAMS failed: {result.error_message}")


@asynccontextmanager
async def local_cluster(sync: str, parent: Path) -> AsyncIterator[LocalCluster]:
    """Start a one-node cluster with data node ``--sync`` ``sync``; stop it after."""
    data_dir = Path(tempfile.mkdtemp(prefix=f"cluster-{sync}-", dir=parent))
    pm, nodes = plan_children(data_dir, 1, "127.0.0.1", 0, sync, sys.executable)
    async with running_plan(Plan([], [pm], nodes), data_dir):
        assert nodes[0].process is not None
        yield LocalCluster(pm.address, nodes[0].address, nodes[0].process.pid, data_dir)
    shutil.rmtree(data_dir, ignore_errors=True)


# -- where and with what a result was measured -------------------------------------
