"""The load a chaos run puts on the cluster, through the client library:

- producers, one per stream, each sending unique values at a steady pace
  with the library's ``Producer`` and recording each value's outcome (with
  ``compacted_keys``, to compacted streams, each value with a key);
- a tailing ``Consumer`` per stream, recording every record it is handed;
- side operations on a seeded schedule of their own: seals of a stream's
  open range, trims below what is acknowledged, new streams (each with a
  producer and a consumer of its own).

Every error is recorded and the loops go on: faults are expected here.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import trio

from client._base import single
from client.consumer import Consumer
from client.pm_client import PMClient
from client.producer import Producer
from client.retry import is_transient
from sbp import messages
from sbp.errors import ProtocolError, SBPError, raise_for_code

from .history import History, Outcome, key_of

#: errors a workload loop records and outlives
EXPECTED = (SBPError, OSError, trio.TooSlowError)
#: how often sbp-tables commits the streams with ``tables`` (SPEC §16)
TABLE_INTERVAL_MS = 500


@dataclass(frozen=True)
class WorkloadSettings:
    producers: int = 3
    #: seconds between two values of one producer
    interval_s: float = 0.01
    replicas: int = 1
    #: mean seconds between two side operations
    side_every_s: float = 4.0
    max_streams: int = 8
    request_timeout_s: float = 2.0
    delivery_timeout_s: float = 20.0
    #: idempotent producers (SPEC §10): a value stored twice is a violation
    idempotent: bool = True
    #: compacted streams (SPEC §13) whose values have this many keys (0: plain)
    compacted_keys: int = 0
    #: streams kept as Iceberg tables by sbp-tables (SPEC §16)
    tables: bool = False
    #: tiered streams (SPEC §14): sealed ranges go to the object store at once
    tiered: bool = False


class Workload:
    """Run with ``await nursery.start(workload.run)``; ``stop()`` ends the
    producers (their last values settle), then cancel the nursery."""

    def __init__(
        self, pm_address: str, history: History, settings: WorkloadSettings, seed: int
    ) -> None:
        self.pm_address = pm_address
        self.history = history
        self.settings = settings
        self._random = random.Random(seed ^ 0x5EED)
        self._stopping = trio.Event()
        self._started_at = time.monotonic()
        self._producing = 0
        self._idle = trio.Event()
        self._consumers: trio.Nursery | None = None
        self._producers: trio.Nursery | None = None

    def now(self) -> float:
        return time.monotonic() - self._started_at

    async def run(
        self, started_at: float, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        self._started_at = started_at
        async with trio.open_nursery() as consumers, trio.open_nursery() as producers:
            self._consumers, self._producers = consumers, producers
            for _ in range(self.settings.producers):
                await self._add_stream()
            producers.start_soon(self._side_operations)
            task_status.started()
            await self._stopping.wait()
            # Producers end on their own (their last values settle); the
            # side operations stop with them.
            await self.settled()
            producers.cancel_scope.cancel()
            # consumers run until the caller cancels the run

    def stop(self) -> None:
        self._stopping.set()

    async def settled(self) -> None:
        """Until every producer has ended (its last values settled), at most
        a delivery timeout and then some after ``stop``."""
        with trio.move_on_after(self.settings.delivery_timeout_s + 10):
            while self._producing:
                await trio.sleep(0.1)

    # -- streams --------------------------------------------------------------

    async def _add_stream(self) -> int | None:
        try:
            async with PMClient(self.pm_address) as pm:
                stream = messages.Stream(
                    replica_nums=self.settings.replicas,
                    cleanup_policy=1 if self.settings.compacted_keys else 0,
                    table_interval_ms=TABLE_INTERVAL_MS if self.settings.tables else -1,
                    local_retention_ms=0 if self.settings.tiered else -1,
                )
                created = single(await pm.create_streams([stream], timeout=10), "CREATE_STREAMS")
                raise_for_code(created.error_code, created.error_message)
        except EXPECTED as error:
            self.history.operations.append((self.now(), "create", -1, f"failed: {error}"))
            return None
        assert created.stream is not None
        stream_id = created.stream.stream_id
        self.history.streams.append(stream_id)
        self.history.operations.append((self.now(), "create", stream_id, "ok"))
        assert self._producers is not None and self._consumers is not None
        index = len(self.history.streams)
        self._producing += 1
        self._producers.start_soon(self._produce, index, stream_id)
        self._consumers.start_soon(self._consume, stream_id)
        return stream_id

    # -- producing ------------------------------------------------------------

    async def _produce(self, index: int, stream_id: int) -> None:
        settings = self.settings
        try:
            while not self._stopping.is_set():
                try:
                    async with (
                        Producer(
                            self.pm_address,
                            stream_id,
                            linger=0.002,
                            request_timeout=settings.request_timeout_s,
                            delivery_timeout=settings.delivery_timeout_s,
                            idempotent=settings.idempotent,
                        ) as producer,
                        trio.open_nursery() as settling,
                    ):
                        seq = 0
                        while not self._stopping.is_set():
                            value = f"p{index}-{seq}-{self._random.getrandbits(32):08x}".encode()
                            seq += 1
                            await self._send_one(producer, stream_id, value, settling)
                            await trio.sleep(settings.interval_s)
                except EXPECTED:
                    # the producer itself gave up (its flush on the way out)
                    await trio.sleep(0.5)
        finally:
            self._producing -= 1

    async def _send_one(
        self, producer: Producer, stream_id: int, value: bytes, settling: trio.Nursery
    ) -> None:
        sent_at = self.now()
        keys = self.settings.compacted_keys
        try:
            handle = await producer.send(value, key=key_of(value, keys) if keys else None)
        except EXPECTED as error:
            self._record(stream_id, value, "failed", -1, 0, sent_at, str(error))
            return

        async def settle() -> None:
            try:
                offset = await handle.offset()
            except EXPECTED as error:
                status = "failed" if _never_stored(error, handle.attempts) else "unknown"
                self._record(stream_id, value, status, -1, handle.attempts, sent_at, str(error))
            else:
                self._record(stream_id, value, "ack", offset, handle.attempts, sent_at)

        settling.start_soon(settle)

    def _record(
        self,
        stream_id: int,
        value: bytes,
        status: str,
        offset: int,
        attempts: int,
        sent_at: float,
        error: str = "",
    ) -> None:
        self.history.outcomes.append(
            Outcome(stream_id, value, status, offset, attempts, sent_at, self.now(), error[:200])
        )

    # -- consuming ------------------------------------------------------------

    async def _consume(self, stream_id: int) -> None:
        """Tail the stream from its start, for the whole run; a consumer that
        gives up is opened again where the last one stopped."""
        seen = self.history.observed[stream_id]
        position: int | None = 0
        while True:
            try:
                async with Consumer(
                    self.pm_address,
                    stream_id,
                    from_offset=position,
                    tail=True,
                    max_wait_ms=500,
                    retry_timeout=30,
                    request_timeout=self.settings.request_timeout_s,
                ) as consumer:
                    async for record in consumer.records():
                        seen.append((record.offset, record.value))
                        position = record.offset + 1
            except EXPECTED as error:
                self.history.operations.append(
                    (self.now(), "consumer-restart", stream_id, str(error)[:200])
                )
                if (position or 0) < self.history.trimmed_to.get(stream_id, 0):
                    position = None  # trimmed past it: from the first stored offset
                await trio.sleep(0.5)

    # -- side operations ------------------------------------------------------

    async def _side_operations(self) -> None:
        while True:
            await trio.sleep(self._random.expovariate(1 / self.settings.side_every_s))
            kind = self._random.choice(["seal", "seal", "trim", "create"])
            streams = list(self.history.streams)
            if kind == "create" and len(streams) < self.settings.max_streams:
                await self._add_stream()
            elif kind == "trim" and streams:
                await self._trim(self._random.choice(streams))
            elif streams:
                await self._seal(self._random.choice(streams))

    async def _seal(self, stream_id: int) -> None:
        try:
            async with PMClient(self.pm_address) as pm:
                ranges = await pm.list_stream_ranges(stream_id, timeout=5)
                open_ranges = [r for r in ranges if r.is_open]
                if not open_ranges:
                    return
                await pm.seal_range(stream_id, open_ranges[-1].range_index, timeout=10)
            result = "ok"
        except EXPECTED as error:
            result = f"failed: {error}"
        self.history.operations.append((self.now(), "seal", stream_id, result[:200]))

    async def _trim(self, stream_id: int) -> None:
        """Trim to a third of the stream's lowest acknowledged offsets."""
        acked = [
            o.offset for o in self.history.outcomes if o.stream_id == stream_id and o.offset >= 0
        ]
        if len(acked) < 30:
            return
        offset = sorted(acked)[len(acked) // 3]
        # counted before the call: a trim that times out may still apply
        self.history.record_trim(stream_id, offset)
        try:
            async with PMClient(self.pm_address) as pm:
                await pm.trim_stream(stream_id, offset, timeout=10)
            result = f"ok to {offset}"
        except EXPECTED as error:
            result = f"failed: {error}"
        self.history.operations.append((self.now(), "trim", stream_id, result[:200]))


def _never_stored(error: BaseException, attempts: int) -> bool:
    """Whether a value that failed with ``error`` cannot have been stored: it
    never left the client, or its one attempt was refused by the node for
    this item (STORAGE_FULL …). A retried value may have been stored by an
    earlier attempt whose answer was lost."""
    if attempts == 0:
        return True
    return attempts == 1 and isinstance(error, ProtocolError) and not is_transient(error)
