"""The limits of this machine for the same bytes, with nothing of a storage
service around them:

- raw LMDB group commit: ``bench.storage.run_raw`` writes the workload's
  batch under increasing keys, ``in_flight`` puts per transaction (the group
  a node could commit with that many requests outstanding), synced or not;
- a bare trio socket sink: a child process that receives and discards, fed
  the same batches over loopback by one trio stream.

    .venv/bin/python -m bench.peers.limits --sink   (the sink process itself)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from bench.harness import Measurement, Workload, percentiles_ms
from bench.storage import MAP_SIZE, run_raw

RAW_LMDB = "raw-lmdb"
SOCKET_SINK = "trio-socket-sink"
READY_PREFIX = "listening on "
#: raw LMDB writes at least this many batches per measurement
MIN_RAW_BATCHES = 200


def measure_raw_lmdb(
    workload: Workload, sync: str, in_flight: int, seconds: float, parent: Path | None = None
) -> Measurement:
    """Raw group-commit writes for about ``seconds`` (sized from a short first pass)."""
    root = Path(tempfile.mkdtemp(prefix="raw-lmdb-", dir=parent))
    try:
        probe = run_raw(root / "probe", workload.batch, MIN_RAW_BATCHES, sync, in_flight)
        rate = probe.batches / probe.seconds
        # unsynced writes reach GB/s: stay well inside bench.storage's map size
        most = MAP_SIZE // 2 // len(workload.batch)
        total = min(most, max(MIN_RAW_BATCHES, int(rate * seconds)))
        run = run_raw(root / "run", workload.batch, total, sync, in_flight)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return Measurement(
        system=RAW_LMDB,
        workload=workload.key,
        durability=f"sync {sync}",
        in_flight=in_flight,
        seconds=round(run.seconds, 4),
        requests=run.batches,
        bytes=run.bytes,
        records=run.batches * workload.records_per_batch,
        latency_ms=percentiles_ms([]),
    )


async def _discard(stream: trio.SocketStream) -> None:
    try:
        while await stream.receive_some(1 << 20):
            pass
    except trio.BrokenResourceError:
        pass


async def _serve_sink() -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, _discard, 0)
        port = listeners[0].socket.getsockname()[1]
        print(f"{READY_PREFIX}127.0.0.1:{port}", flush=True)


async def _feed(port: int, workload: Workload, seconds: float) -> tuple[float, int]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    sent = 0
    batch = workload.batch
    async with stream:
        started = time.perf_counter()
        stop_at = started + seconds
        while time.perf_counter() < stop_at:
            await stream.send_all(batch)
            sent += 1
        return time.perf_counter() - started, sent


def measure_socket_sink(workload: Workload, seconds: float) -> Measurement:
    """The workload's batches into a discarding trio server in another process."""
    sink = subprocess.Popen(
        [sys.executable, "-m", "bench.peers.limits", "--sink"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sink.stdout is not None
        line = sink.stdout.readline().strip()
        if not line.startswith(READY_PREFIX):
            raise RuntimeError(f"the socket sink did not start: {line!r}")
        port = int(line.rpartition(":")[2])
        elapsed, sent = trio.run(_feed, port, workload, seconds)
    finally:
        sink.terminate()
        sink.wait(timeout=10)
    return Measurement(
        system=SOCKET_SINK,
        workload=workload.key,
        durability="none",
        in_flight=1,
        seconds=round(elapsed, 4),
        requests=sent,
        bytes=sent * len(workload.batch),
        records=sent * workload.records_per_batch,
        latency_ms=percentiles_ms([]),
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["--sink"]:
        trio.run(_serve_sink)
    else:
        sys.exit(__doc__)
