"""A blocking facade over the async client, for scripts and Spark executors.

``SyncClient`` runs a trio event loop in a background thread of its own and
passes every call to it (``trio.from_thread``); the calling thread blocks
until the answer is there. Nothing about trio leaks out: producers,
consumers and PM calls are plain methods and iterators.

Producers and consumers are async context managers underneath, whose tasks
must start and end in one trio task; each one therefore lives in a host task
of the loop, which opens it, hands it out and closes it when told.

The loop thread is a daemon, so a client that is never closed does not keep
the interpreter alive; ``close()`` (or ``with``) flushes producers and shuts
the loop down cleanly. Create the client in the process that uses it: a
forked child (a Spark Python worker is one) does not inherit the thread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from types import TracebackType
from typing import Any, Generic, Literal, Self, TypeVar

import numpy as np
import numpy.typing as npt
import trio

from net.pool import ConnectionPool
from net.tls import TLSSettings
from sbp import messages
from sbp.batches import Buffer, DecodedRecords

from ._base import DEFAULT_TIMEOUT
from .consumer import Consumer, Record, iter_records
from .group_member import GroupConsumer, StreamBatch
from .loop_thread import LoopThread
from .pm_client import PMClient
from .producer import RESUME_SETTLE_S, Producer, RecordHandle, RecordsHandle

T = TypeVar("T")


class _Hosted(Generic[T]):
    """An async context manager kept open by a task of the loop."""

    def __init__(self, value: T) -> None:
        self.value = value
        self.close = trio.Event()
        self.closed = trio.Event()
        self.error: BaseException | None = None
        #: close as if its block had failed: a producer drops what it has not
        #: sent rather than flush it
        self.abort = False


class _Aborted(Exception):
    """Closes a hosted resource as a failed block would (``_Hosted.abort``)."""


class SyncClient:
    """A blocking client of one SBP cluster, reached through its PM.

    ::

        with SyncClient(pm="127.0.0.1:7400") as client:
            stream = client.create_stream()
            with client.producer(stream.stream_id) as producer:
                producer.send_many([b"a", b"b"])
            for record in client.consumer(stream.stream_id, from_offset=0):
                print(record.offset, record.value)

    Methods are safe to call from several threads at once, but not from
    inside the client's own loop (that is, not from async code).
    """

    def __init__(
        self, pm: str, *, timeout: float = DEFAULT_TIMEOUT, tls: TLSSettings | None = None
    ) -> None:
        self.pm_address = pm
        self.timeout = timeout
        # TLS with ``tls.ca`` checking the servers, ``tls.cert`` presented (mutual TLS)
        self._loop = LoopThread("sbp-client", tls=tls.client_context() if tls else None)
        self._pm = PMClient(pm, pool=self._loop.pool, timeout=timeout)
        self._hosted: set[_Hosted[Any]] = set()
        self._closed = False

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in the client's loop and return its result:
        the way to reach any async API (``PMClient`` methods …) from here."""
        if self._closed:
            raise RuntimeError("the client is closed")
        return self._loop.run(fn, *args)

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> Future[T]:
        """Start ``await fn(*args)`` in the client's loop without waiting for it."""
        if self._closed:
            raise RuntimeError("the client is closed")
        return self._loop.submit(fn, *args)

    @property
    def pool(self) -> ConnectionPool:
        """The connection pool of the client's loop (for async clients run
        through ``run`` or ``submit``)."""
        return self._loop.pool

    # -- PM calls -------------------------------------------------------------

    @property
    def pm(self) -> PMClient:
        """The async PM client (call its methods through ``run``)."""
        return self._pm

    def create_stream(
        self, replica_nums: int = 1, *, retention_period_ms: int = 0
    ) -> messages.Stream:
        """Create a stream; returns it with its id."""

        async def create() -> messages.Stream:
            result = await self.pm.create_stream(
                replica_nums, retention_period_ms=retention_period_ms
            )
            assert result.stream is not None
            return result.stream

        return self.run(create)

    def get_stream(self, stream_id: int) -> messages.Stream:
        return self.run(self.pm.get_stream, stream_id)

    def list_streams(self) -> list[messages.Stream]:
        """Every stream, in id order."""

        async def listing() -> list[messages.Stream]:
            return [stream async for stream in self.pm.list_streams()]

        return self.run(listing)

    def list_ranges(self, stream_id: int) -> tuple[messages.Range, ...]:
        """The stream's ranges, in order (the last one open)."""
        return self.run(self.pm.list_stream_ranges, stream_id)

    def seal(self, stream_id: int) -> tuple[messages.Range, ...]:
        """Seal the stream's open range and open the next one; both, in order."""

        async def seal() -> tuple[messages.Range, ...]:
            ranges = await self.pm.list_stream_ranges(stream_id)
            result = await self.pm.seal_range(stream_id, ranges[-1].range_index)
            return result.ranges

        return self.run(seal)

    def delete_stream(self, stream_id: int) -> None:
        self.run(self.pm.delete_stream, stream_id)

    def update_stream(self, stream_id: int, **settings: int) -> messages.Stream:
        """Change some of a stream's settings (``messages.Stream`` fields, such
        as ``replica_nums=3`` or ``table_interval_ms=1000``), keeping the rest;
        returns the stream as stored."""

        async def update() -> messages.Stream:
            current = await self.pm.get_stream(stream_id)
            return await self.pm.update_stream(replace(current, **settings))

        return self.run(update)

    def trim(self, stream_id: int, trim_offset: int) -> int:
        """Drop the stream's records below ``trim_offset``; returns its first
        offset afterwards (unchanged when it already started there or later)."""

        async def trim() -> int:
            result = await self.pm.trim_stream(stream_id, trim_offset)
            return result.range.start_offset if result.range is not None else trim_offset

        return self.run(trim)

    # -- producers and consumers ----------------------------------------------

    def producer(self, stream_id: int, **options: Any) -> SyncProducer:
        """A producer of ``stream_id``; ``options`` are ``Producer``'s."""
        producer = Producer(self.pm, stream_id, pool=self._loop.pool, **options)
        return SyncProducer(self, self._host(producer))

    def consumer(
        self, stream_id: int, from_offset: int | None = None, **options: Any
    ) -> SyncConsumer:
        """A consumer of ``stream_id`` from ``from_offset`` (None: the first
        stored offset); ``options`` are ``Consumer``'s."""
        consumer = Consumer(self.pm, stream_id, from_offset, pool=self._loop.pool, **options)
        return SyncConsumer(self, self._host(consumer))

    def group_consumer(
        self, group: str, subscribe: Sequence[int] | Literal["all"], **options: Any
    ) -> SyncGroupConsumer:
        """A member of consumer group ``group`` reading the streams the PM
        assigns it of ``subscribe`` (SPEC §15); ``options`` are
        ``GroupConsumer``'s."""
        member = GroupConsumer(self.pm, group, subscribe, pool=self._loop.pool, **options)
        return SyncGroupConsumer(self, self._host(member))

    def _host(self, resource: AbstractAsyncContextManager[T]) -> _Hosted[T]:
        async def open_hosted() -> _Hosted[T]:
            hosted: _Hosted[T] = await self._loop.nursery.start(_keep_open, resource)
            self._hosted.add(hosted)
            return hosted

        return self.run(open_hosted)

    def _release(self, hosted: _Hosted[Any], *, abort: bool = False) -> None:
        """Close a hosted producer or consumer (``abort``: as a failed block
        would); raises what its exit raised."""

        async def release() -> None:
            hosted.abort = abort
            hosted.close.set()
            await hosted.closed.wait()
            self._hosted.discard(hosted)

        if hosted.closed.is_set() or self._closed:
            return
        self.run(release)
        if hosted.error is not None:
            raise hosted.error

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Close every producer (flushing it) and consumer, then the loop."""
        if self._closed:
            return
        errors = []
        for hosted in list(self._hosted):
            try:
                self._release(hosted)
            except Exception as error:
                errors.append(error)
        self._closed = True
        self._loop.close()
        if errors:
            raise errors[0]

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


async def _keep_open(
    resource: AbstractAsyncContextManager[T],
    *,
    task_status: trio.TaskStatus[_Hosted[T]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Open ``resource``, hand it out, and close it when told (in this task)."""
    hosted: _Hosted[T] | None = None
    try:
        async with resource as value:
            hosted = _Hosted(value)
            task_status.started(hosted)
            await hosted.close.wait()
            if hosted.abort:
                raise _Aborted
    except _Aborted:
        pass
    except Exception as error:
        if hosted is None:
            raise  # failed to open: ``start`` raises it to the caller
        hosted.error = error
    finally:
        if hosted is not None:
            hosted.closed.set()


class SyncRecordHandle:
    """One record sent by a ``SyncProducer``."""

    def __init__(self, client: SyncClient, handle: RecordHandle) -> None:
        self._client = client
        self._handle = handle

    @property
    def done(self) -> bool:
        return self._handle.done

    def offset(self) -> int:
        """Block until the record is durable; its offset (or the delivery error)."""
        return self._client.run(self._handle.offset)


class SyncRecordsHandle:
    """The records of one ``SyncProducer.send_many`` or ``send_batch``."""

    def __init__(self, client: SyncClient, handle: RecordsHandle) -> None:
        self._client = client
        self._handle = handle

    def __len__(self) -> int:
        return len(self._handle)

    @property
    def done(self) -> bool:
        return self._handle.done

    def wait(self) -> None:
        """Block until every record is durable; raises the first failure."""
        self._client.run(self._handle.wait)

    def offsets(self) -> npt.NDArray[np.int64]:
        """Block until durable; each record's offset, in the order sent."""
        return self._client.run(self._handle.offsets)


class SyncProducer:
    """The blocking face of a ``Producer``. Each call is a hop to the loop
    thread (tens of µs): send records in lists with ``send_many``."""

    def __init__(self, client: SyncClient, hosted: _Hosted[Producer]) -> None:
        self._client = client
        self._hosted = hosted
        self.producer = hosted.value

    def send(self, value: bytes) -> SyncRecordHandle:
        return SyncRecordHandle(self._client, self._client.run(self.producer.send, value))

    def resume(self, settle_s: float = RESUME_SETTLE_S) -> int:
        """``Producer.resume``: the records of this producer and epoch the
        stream holds, which the next record sent follows."""
        held: int = self._client.run(self.producer.resume, settle_s)
        return held

    def send_many(self, values: Sequence[bytes]) -> SyncRecordsHandle:
        return SyncRecordsHandle(self._client, self._client.run(self.producer.send_many, values))

    def send_batch(self, batch: Buffer) -> SyncRecordsHandle:
        """Send a record batch built by the caller, as it is (see
        ``Producer.send_batch``; leave the buffer alone until it is durable)."""
        return SyncRecordsHandle(self._client, self._client.run(self.producer.send_batch, batch))

    def flush(self) -> None:
        """Block until everything sent so far is durable; raises the first failure."""
        self._client.run(self.producer.flush)

    def close(self) -> None:
        """Flush, then stop the producer."""
        self._client._release(self._hosted)

    def abort(self) -> None:
        """Stop the producer without sending what it has not sent yet (as a
        ``Producer`` block left by an exception does): a failed job's
        buffered records must not reach the stream after it gave up, while
        its retry may be running."""
        self._client._release(self._hosted, abort=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            self.abort()


class SyncConsumer:
    """The blocking face of a ``Consumer``: iterate over it for ``Record``s,
    or over ``batches()`` for decoded batches (numpy columns)."""

    def __init__(self, client: SyncClient, hosted: _Hosted[Consumer]) -> None:
        self._client = client
        self._hosted = hosted
        self.consumer = hosted.value

    def next_batch(self) -> DecodedRecords | None:
        """The next decoded records; None at the end of the stream."""
        return self._client.run(self.consumer.next_batch)

    def batches(self) -> Iterator[DecodedRecords]:
        while (records := self.next_batch()) is not None:
            if len(records):
                yield records

    def __iter__(self) -> Iterator[Record]:
        consumer = self.consumer
        while (records := self._client.run(consumer.receive_batch)) is not None:
            consumer.in_hand = records  # a loop left part way goes on from there
            for record in iter_records(records, consumer.stream_id):
                # handed out one at a time: commit() covers what was yielded,
                # an automatic commit what the caller is done with
                consumer.position = record.offset + 1
                yield record
                consumer.processed = consumer.position

    @property
    def position(self) -> int:
        """The offset after the last record handed out."""
        return self.consumer.position

    def commit(self, offset: int | None = None) -> None:
        """Store the group's position on this stream (``Consumer.commit``)."""
        self._client.run(self.consumer.commit, offset)

    def seek(self, offset: int) -> None:
        """Read from ``offset`` next."""
        self._client.run(self.consumer.seek, offset)

    def seek_to_time(self, timestamp_ms: int) -> int:
        """Read from the first record appended at or after ``timestamp_ms``."""
        return self._client.run(self.consumer.seek_to_time, timestamp_ms)

    def lag(self) -> int:
        """Records between ``position`` and the stream's end now."""
        return self._client.run(self.consumer.lag)

    def close(self) -> None:
        self._client._release(self._hosted)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class SyncGroupConsumer:
    """The blocking face of a ``GroupConsumer``: iterate over it for
    ``Record``s (each with its ``stream_id``), or call ``next_batch``."""

    def __init__(self, client: SyncClient, hosted: _Hosted[GroupConsumer]) -> None:
        self._client = client
        self._hosted = hosted
        self.member = hosted.value

    def next_batch(self) -> StreamBatch:
        """The next records of one of the streams this member reads."""
        return self._client.run(self.member.next_batch)

    def __iter__(self) -> Iterator[Record]:
        while True:
            batch = self.next_batch()
            yield from iter_records(batch.records, batch.stream_id)

    @property
    def assignment(self) -> frozenset[int]:
        """The streams this member reads now."""
        return self.member.assignment

    def commit(self) -> None:
        """Store what was handed out as the group's positions (``GroupConsumer.commit``)."""
        self._client.run(self.member.commit)

    def close(self) -> None:
        """Commit, stop reading and leave the group at once."""
        self._client._release(self._hosted)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
