"""A crowd against one data node: what many connections cost it, and what
they cost the clients that are not part of the crowd.

A probe process (a child of its own, so that the crowd's work in this one
does not delay it) sends a PING and a small FETCH every 20 ms and reports
the latencies. It runs twice: on a quiet node, then while this process
holds

- 1,000 busy connections, each sending a small FETCH about once a second;
- 10,000 idle connections, opened and left silent;
- 100 slow readers, each asking for 1 MiB answers it never reads.

Verdict: the probe's p99 under the crowd within 2x of the quiet p99 (plus
1 ms, below which loopback timing is noise), and the node's resident memory
within its byte budgets of where it started (``MEMORY_ALLOWANCE``).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import trio

from client.pm_client import PMClient
from client.producer import Producer
from sbp import messages
from sbp.enums import Opcode
from sbp.frames import Frame, FrameDecoder, encode_frame

from .cluster import ChaosCluster
from .report import write_verdict

BUSY = 1_000
IDLE = 10_000
SLOW = 100
PROBE_S = 10.0
#: what one connection costs a data node (trio tasks, engine, its 4 KiB
#: read buffer): about 24 KiB measured with 10,000 idle connections, with
#: room for what busy ones hold
CONNECTION_STATE_BYTES = 28 * 1024
#: what the node may grow by under the crowd: its answer budget (256 MiB)
#: and the reserve for small answers (32 MiB), plus its connections' state
MEMORY_ALLOWANCE = (256 + 32) * 1024 * 1024 + (BUSY + IDLE + SLOW) * CONNECTION_STATE_BYTES
P99_FACTOR = 2.0
P99_NOISE_MS = 1.0


async def main(root: Path, out_dir: Path) -> int:
    _raise_fd_limit(BUSY + IDLE + SLOW + 1_000)
    cluster = ChaosCluster(root, 1, node_args=("--max-connections", str(BUSY + IDLE + SLOW + 100)))
    async with trio.open_nursery() as nursery:
        try:
            await cluster.start(nursery)
            result = await _crowd(cluster)
        finally:
            await cluster.stop_all()
            nursery.cancel_scope.cancel()
    result["server_tracebacks"] = cluster.log_tracebacks()
    return write_verdict(
        "crowd",
        result,
        out_dir,
        f"probe p99 {result['p99_ms']['quiet']:.2f} ms quiet, "
        f"{result['p99_ms']['crowd']:.2f} ms in the crowd; node memory "
        f"{result['rss_mb']['quiet']:.0f} -> {result['rss_mb']['crowd']:.0f} MB",
    )


def _raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


async def _crowd(cluster: ChaosCluster) -> dict[str, Any]:
    node = cluster.nodes["node-1"]
    assert node.child.process is not None
    pid = node.child.process.pid
    address = node.child.address
    # the slow readers ask for 1 MiB batches, everybody else for 1 KiB ones
    big = await _fill(cluster.pm.child.address, 64, 1024)
    stream_id = await _fill(cluster.pm.child.address, 64, 1)
    node_process, this_process = psutil.Process(pid), psutil.Process()
    cpu = _CPU(node_process, this_process)
    quiet = await _probe(address, stream_id)
    quiet_cpu = cpu.percent()
    quiet_rss = psutil.Process(pid).memory_info().rss
    print(f"  quiet: p99 {quiet['p99_ms']:.2f} ms, node {quiet_rss / 1e6:.0f} MB", flush=True)
    peak_rss = quiet_rss
    opened: list[trio.SocketStream] = []
    async with trio.open_nursery() as crowd:
        host, _, port = address.rpartition(":")
        for _ in range(IDLE):
            opened.append(await trio.open_tcp_stream(host, int(port)))
        print(f"  {IDLE:,} idle connections open", flush=True)
        for i in range(SLOW):
            crowd.start_soon(_slow_reader, host, int(port), big, i)
        for i in range(BUSY):
            crowd.start_soon(_busy, host, int(port), stream_id, i)
        await trio.sleep(3)
        print(f"  {BUSY:,} busy connections and {SLOW} slow readers running", flush=True)
        cpu.percent()
        print(f"  PROBE START {time.time():.3f}", flush=True)
        crowded = await _probe(address, stream_id)
        print(f"  PROBE END {time.time():.3f}", flush=True)
        crowd_cpu = cpu.percent()
        print(f"  CPU % (node, crowd): quiet {quiet_cpu}, in the crowd {crowd_cpu}", flush=True)
        peak_rss = max(peak_rss, psutil.Process(pid).memory_info().rss)
        crowd.cancel_scope.cancel()
    for stream in opened:
        await trio.aclose_forcefully(stream)
    failures = []
    bound = quiet["p99_ms"] * P99_FACTOR + P99_NOISE_MS
    if crowded["p99_ms"] > bound:
        failures.append(
            f"probe p99 {crowded['p99_ms']:.2f} ms in the crowd, over {bound:.2f} ms "
            f"(2x the quiet {quiet['p99_ms']:.2f} ms, plus {P99_NOISE_MS} ms)"
        )
    if peak_rss - quiet_rss > MEMORY_ALLOWANCE:
        failures.append(f"node memory grew by {(peak_rss - quiet_rss) / 1e6:.0f} MB")
    if crowded["errors"]:
        failures.append(f"{crowded['errors']} probe calls failed in the crowd")
    return {
        "verdict": "FAIL" if failures else "pass",
        "crowd": {"busy": BUSY, "idle": IDLE, "slow_readers": SLOW},
        "p99_ms": {"quiet": quiet["p99_ms"], "crowd": crowded["p99_ms"]},
        "p50_ms": {"quiet": quiet["p50_ms"], "crowd": crowded["p50_ms"]},
        "probe_calls": {"quiet": quiet["calls"], "crowd": crowded["calls"]},
        "rss_mb": {"quiet": round(quiet_rss / 1e6, 1), "crowd": round(peak_rss / 1e6, 1)},
        "cpu_percent": {"quiet": quiet_cpu, "crowd": crowd_cpu},
        "failures": failures,
    }


async def _fill(pm_address: str, batches: int, records: int) -> int:
    """A stream of ``batches`` batches of ``records`` 1 KiB records."""
    async with PMClient(pm_address) as pm:
        stream_id = (await pm.create_stream(replica_nums=1, timeout=10)).stream.stream_id
    async with Producer(pm_address, stream_id) as producer:
        for _ in range(batches):
            await producer.send_many([b"c" * 1024] * records)
            await producer.flush()  # one batch each
    return stream_id


class _CPU:
    """CPU use of the node and of this process since the last call, in %."""

    def __init__(self, *processes: psutil.Process) -> None:
        self._processes = processes
        self._last = self._times()

    def _times(self) -> tuple[float, list[float]]:
        return time.monotonic(), [sum(p.cpu_times()[:2]) for p in self._processes]

    def percent(self) -> list[float]:
        (then, before), (now, after) = self._last, self._times()
        self._last = (now, after)
        return [round(100 * (b - a) / (now - then), 1) for a, b in zip(before, after, strict=True)]


def _fetch(stream_id: int, request_id: int, max_bytes: int) -> bytes:
    header = messages.FetchRequest(
        max_wait_ms=0,
        min_bytes=1,
        fetch_requests=(
            messages.FetchInfo(
                stream_id=stream_id, request_index=0, fetch_offset=0, batch_max_bytes=max_bytes
            ),
        ),
    ).encode()
    return encode_frame(Opcode.FETCH, 0, request_id, header, b"")


async def _slow_reader(host: str, port: int, stream_id: int, index: int) -> None:
    """Ask for 1 MiB answers, never read them."""
    with trio.move_on_after(600):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            frames = b"".join(_fetch(stream_id, 1 + i, 1 << 20) for i in range(200))
            await stream.send_all(frames)
            await trio.sleep_forever()


async def _busy(host: str, port: int, stream_id: int, index: int) -> None:
    """A small FETCH once a second, its whole answer read. Each connection
    keeps its own phase in the second (index/BUSY): a send that comes late
    waits for its next slot rather than going at once, so that the
    connections stay spread over the second, as independent clients are,
    instead of bunching up behind any pause of this process."""
    stream = await trio.open_tcp_stream(host, port)
    decoder = FrameDecoder()
    async with stream:
        request = 0
        next_send = trio.current_time() + index / BUSY
        while True:
            await trio.sleep_until(next_send)
            request += 1
            await stream.send_all(_fetch(stream_id, request, 1024))
            answered = False
            while not answered:
                data = await stream.receive_some(1 << 16)
                if not data:
                    return
                answered = any(
                    isinstance(event, Frame) and event.is_end for event in decoder.feed(data)
                )
            now = trio.current_time()
            while next_send <= now:
                next_send += 1.0


async def _probe(address: str, stream_id: int) -> dict[str, Any]:
    """Run the probe process and read its latencies."""
    command = [sys.executable, "-m", "bench.chaos.probe", address, str(stream_id), str(PROBE_S)]
    done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    if done.returncode != 0:
        last = done.stderr.decode(errors="replace").strip().splitlines()[-1:]
        print(f"  the probe failed: {last[0] if last else done.returncode}", flush=True)
        return {"p99_ms": float("inf"), "p50_ms": float("inf"), "calls": 0, "errors": 1}
    report: dict[str, Any] = json.loads(done.stdout)
    return report
