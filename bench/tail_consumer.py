"""A tailing consumer in a process of its own, for the tail-latency scenario.

Run by ``TailConsumer`` (below), never by hand::

    python -m bench.tail_consumer sbp PM_ADDRESS STREAM_ID RECORDS_PER_BATCH
    python -m bench.tail_consumer redis PORT KEY
    python -m bench.tail_consumer nats URL SUBJECT STREAM

It subscribes, prints ``ready``, and notes when each message arrives:
``time.monotonic()``, which is CLOCK_MONOTONIC, one clock for every process
of the machine, so the producer's acknowledgement times compare with it.
When the producer writes ``expect N`` to its standard input, it waits until
it holds N messages (or ``GRACE_S`` has passed) and prints one JSON object,
message key to arrival time, then exits.

Why a process: a consumer sharing the producer's event loop waits behind the
producer's own work, and its latency is partly the benchmark's.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

#: how long the consumer waits for the last messages once told how many
GRACE_S = 2.0
READY_TIMEOUT_S = 30.0
ROOT = Path(__file__).resolve().parent.parent


class TailAcks:
    """The producer's side of a tail run: when each counted append was
    acknowledged, by message key. Appends started in the first ``warmup_s``
    are sent but not counted; the consumer still receives them, so it is
    told to wait for ``answered``, every acknowledged append."""

    def __init__(self, warmup_s: float) -> None:
        self.counted_from = time.perf_counter() + warmup_s
        self.sent = 0
        self.answered = 0
        self.acked: dict[str, float] = {}

    def counting(self, append: Callable[[], Awaitable[str]]) -> Callable[[], Awaitable[None]]:
        """``append`` (which returns the message's key) as an open loop's request."""

        async def send() -> None:
            counted = time.perf_counter() >= self.counted_from
            self.sent += counted
            key = await append()
            self.answered += 1
            if counted:
                self.acked[key] = time.monotonic()

        return send

    def latencies(self, received: dict[str, float]) -> tuple[list[float], int]:
        """Acknowledgement to arrival of each counted message the consumer
        got, and how many were counted."""
        return [received[key] - at for key, at in self.acked.items() if key in received], self.sent


class TailConsumer:
    """The consumer process, seen from the producer's side (blocking calls)."""

    def __init__(self, *argv: str) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.tail_consumer", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            text=True,
        )
        assert self._process.stdout is not None
        line = self._process.stdout.readline().strip()
        if line != "ready":
            self._process.kill()
            raise RuntimeError(f"the tail consumer did not start (it said {line!r})")

    def finish(self, expected: int) -> dict[str, float]:
        """Arrival time of every message it got, once it holds ``expected``."""
        out, _ = self._process.communicate(f"expect {expected}\n", timeout=GRACE_S + 30)
        if self._process.returncode != 0:
            raise RuntimeError(f"the tail consumer failed (exit {self._process.returncode})")
        arrivals: dict[str, float] = json.loads(out)
        return arrivals

    def kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def _report(arrivals: dict[str, float]) -> None:
    json.dump(arrivals, sys.stdout)
    sys.stdout.flush()


def _expected(line: str) -> int:
    return int(line.split()[1]) if line.startswith("expect ") else 0


async def _asyncio_until_expected(arrivals: dict[str, float]) -> None:
    """Wait for the producer's ``expect N``, then for N arrivals or the grace."""
    loop = asyncio.get_running_loop()
    expected = _expected(await loop.run_in_executor(None, sys.stdin.readline))
    deadline = time.monotonic() + GRACE_S
    while len(arrivals) < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def _sbp(pm_address: str, stream_id: str, records_per_batch: str) -> None:
    import trio

    from client.consumer import Consumer

    arrivals: dict[str, float] = {}
    step = int(records_per_batch)

    async def main() -> None:
        async with (
            Consumer(pm_address, int(stream_id), 0, tail=True) as consumer,
            trio.open_nursery() as nursery,
        ):

            async def consume() -> None:
                async for records in consumer:
                    now = time.monotonic()
                    first, last = int(records.offsets[0]), int(records.offsets[-1])
                    for base in range(first - first % step, last + 1, step):
                        arrivals.setdefault(str(base), now)

            nursery.start_soon(consume)
            print("ready", flush=True)
            expected = _expected(await trio.to_thread.run_sync(sys.stdin.readline))
            with trio.move_on_after(GRACE_S):
                while len(arrivals) < expected:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    _report(arrivals)


def _redis(port: str, key: str) -> None:
    import redis.asyncio

    arrivals: dict[str, float] = {}

    async def main() -> None:
        reader = redis.asyncio.Redis(port=int(port))

        async def consume() -> None:
            last = "$"
            while True:
                answer = await reader.xread({key: last}, block=1000, count=1000)
                now = time.monotonic()
                for _stream, entries in answer:
                    for entry_id, _values in entries:
                        arrivals.setdefault(entry_id.decode(), now)
                        last = entry_id

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)  # XREAD blocking before anything is sent
        print("ready", flush=True)
        await _asyncio_until_expected(arrivals)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await reader.aclose()

    asyncio.run(main())
    _report(arrivals)


def _nats(url: str, subject: str, stream: str) -> None:
    import nats
    from nats.aio.msg import Msg

    arrivals: dict[str, float] = {}

    async def main() -> None:
        connection = await nats.connect(url, max_reconnect_attempts=0)

        async def on_message(message: Msg) -> None:
            arrivals.setdefault(str(message.metadata.sequence.stream), time.monotonic())

        subscription = await connection.jetstream().subscribe(
            subject, stream=stream, cb=on_message, ordered_consumer=True
        )
        print("ready", flush=True)
        await _asyncio_until_expected(arrivals)
        await subscription.unsubscribe()
        await connection.close()

    asyncio.run(main())
    _report(arrivals)


SYSTEMS: dict[str, Callable[..., None]] = {"sbp": _sbp, "redis": _redis, "nats": _nats}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in SYSTEMS:
        print(f"usage: python -m bench.tail_consumer {{{','.join(SYSTEMS)}}} ARGS...")
        return 2
    SYSTEMS[argv[0]](*argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
