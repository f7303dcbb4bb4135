"""The group-commit writer: one thread, one write transaction per group.

Callers on any thread submit operations (appends, seals, trims, ...) to a
queue. The writer takes everything waiting, up to a byte and count budget,
applies it in one LMDB write transaction, commits (an fsync unless the store
runs with sync off), publishes the new stream states, and only then completes
each operation. One sync thus serves every append that arrived while the
previous one was running: the busier the node, the bigger the groups.

A committed group is completed when the next group has been applied, just
before that one's commit, or at once if nothing else is waiting: callers
woken by a completion then run while the writer waits for the disk rather
than while it applies the next group, where every put that lets go of the
GIL would hand it to them.

The thread exists because an LMDB write transaction must stay on the thread
that began it, and so that no event loop ever waits for a sync.

If a group's transaction fails as a whole (the map is full, or something
unexpected), it is rolled back and its operations are run again one
transaction each, so that only the operations that fail on their own fail.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Final, Generic, TypeVar

import lmdb

from sbp.batches import validate_batch
from sbp.errors import ProtocolError, ShuttingDownError, StorageFullError, UnknownServerError
from sbp.stats import Buckets

from . import replica_transitions
from .model import (
    COMMIT_SECONDS_BOUNDS,
    GROUP_SIZE_BOUNDS,
    AppendItem,
    AppendOutcome,
)
from .page_cache import WrittenPageDropper
from .producers import check_stamp
from .transaction import Store, WriteContext

log = logging.getLogger(__name__)

T = TypeVar("T")

#: one transaction holds at most this many batch bytes, which bounds commit
#: latency and the dirty pages LMDB keeps in memory
DEFAULT_MAX_GROUP_BYTES: Final = 32 * 1024 * 1024
DEFAULT_MAX_GROUP_OPS: Final = 4096

AppendCallback = Callable[[list[AppendOutcome]], None]


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class WriteOp(ABC):
    """Something the writer applies inside a transaction and completes after it."""

    #: how many appends this operation carries (for statistics)
    appends: int = 0
    #: bytes it writes, roughly (for the group budget)
    size: int = 0

    @abstractmethod
    def apply(self, ctx: WriteContext) -> None:
        """Write into the transaction. Raising aborts the whole group."""

    def applied(self) -> bool:
        """Called on the writer thread once the group is applied, before its
        commit; True when the operation handed its outcomes on already (they
        are not durable yet: see ``AppendOp``)."""
        return False

    @abstractmethod
    def complete(self) -> None:
        """Deliver the outcome; called on the writer thread after the commit."""

    @abstractmethod
    def fail(self, error: ProtocolError) -> None:
        """Deliver ``error``: the operation's transaction could not be committed."""


class AppendOp(WriteOp):
    """A request's appends: applied in one transaction, answered by one callback.

    The batches are validated here, on the submitting thread, not by the
    writer: the writer's loop is the one serial path every append goes
    through, and the checks (the CRC-32C above all) need nothing it owns.
    """

    def __init__(
        self,
        items: Sequence[AppendItem],
        callback: AppendCallback,
        on_applied: AppendCallback | None = None,
    ) -> None:
        self.items = items
        self.callback = callback
        #: called with the outcomes before the commit makes them durable, so
        #: that a primary can send the batches to its followers while this
        #: node's fsync runs (SPEC §7); a failed commit then fences the
        #: ranges they went to (``GroupCommitWriter._commit``)
        self.on_applied = on_applied
        self.appends = len(items)
        self.size = sum(len(item.batch) for item in items)
        #: per item, its record count, or the error that refuses the batch
        self.checked = [_checked(item) for item in items]
        self.outcomes: list[AppendOutcome] = []

    def apply(self, ctx: WriteContext) -> None:
        outcomes: list[AppendOutcome] = []
        self.outcomes = outcomes
        for item, checked in zip(self.items, self.checked, strict=True):
            if isinstance(checked, ProtocolError):
                outcomes.append(checked)
                continue
            try:
                outcome: AppendOutcome = ctx.append(
                    item.stream_id, item.batch, checked, item.producer
                )
            except ProtocolError as error:
                outcome = error
            outcomes.append(outcome)

    def applied(self) -> bool:
        if self.on_applied is None:
            return False
        self.on_applied(list(self.outcomes))
        return True

    def complete(self) -> None:
        self.callback(self.outcomes)

    def fail(self, error: ProtocolError) -> None:
        # items that were refused on their own keep their own error
        own: list[AppendOutcome] = [
            o if isinstance(o, ProtocolError) else error for o in self.outcomes
        ]
        self.callback(own + [error] * (len(self.items) - len(own)))


def _checked(item: AppendItem) -> int | ProtocolError:
    """The offsets the item's batch covers (its records, for a batch as
    producers write it), or the error refusing it alone."""
    try:
        if item.producer is not None:
            check_stamp(item.producer)
        return validate_batch(item.batch).span
    except ProtocolError as error:
        return error


class CommandOp(WriteOp, Generic[T]):
    """Any other change (seal, trim, sync ranges ...), answered through a future."""

    def __init__(self, fn: Callable[[WriteContext], T]) -> None:
        self.fn = fn
        self.future: Future[T] = Future()
        self._result: T | None = None
        self._error: ProtocolError | None = None

    def apply(self, ctx: WriteContext) -> None:
        # the appends before this command must be in LMDB for it to see (or drop) them
        ctx.write_appends()
        try:
            self._result, self._error = self.fn(ctx), None
        except ProtocolError as error:
            self._result, self._error = None, error
        finally:
            # later appends look up their range and the pages in use again
            ctx.after_command()

    def complete(self) -> None:
        if self._error is not None:
            self.future.set_exception(self._error)
        else:
            self.future.set_result(self._result)  # type: ignore[arg-type]

    def fail(self, error: ProtocolError) -> None:
        self.future.set_exception(error)


class _Stop:
    pass


_STOP: Final = _Stop()


class GroupCommitWriter:
    """The single writer of a store. Thread-safe ``submit``; ``close`` drains the queue."""

    def __init__(
        self,
        store: Store,
        *,
        clock: Callable[[], int] = wall_clock_ms,
        max_group_bytes: int = DEFAULT_MAX_GROUP_BYTES,
        max_group_ops: int = DEFAULT_MAX_GROUP_OPS,
        page_cache: WrittenPageDropper | None = None,
    ) -> None:
        self.store = store
        self.page_cache = page_cache
        self.clock = clock
        self.max_group_bytes = max_group_bytes
        self.max_group_ops = max_group_ops
        self._queue: queue.SimpleQueue[WriteOp | _Stop] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._last_time_ms = store.last_append_ms
        self._thread = threading.Thread(target=self._run, name="storage-writer", daemon=True)
        #: committed operations whose completion waits for the next commit to
        #: start syncing, or for the queue to run empty (see ``_commit``)
        self._committed: list[WriteOp] = []
        # statistics: written by the writer thread, read by anyone
        self.appends_waiting = 0
        self.appends_in_commit = 0
        self.commits_total = 0
        self.commit_seconds_total = 0.0
        self.last_commit_seconds = 0.0
        self.appends_total = 0
        self.last_group_size = 0
        self.max_group_size = 0
        self.commit_seconds = Buckets(COMMIT_SECONDS_BOUNDS)
        self.sync_seconds = Buckets(COMMIT_SECONDS_BOUNDS)
        self.group_sizes = Buckets(GROUP_SIZE_BOUNDS)

    def start(self) -> None:
        self._thread.start()

    def submit(self, op: WriteOp) -> None:
        with self._lock:
            if self._closed:
                raise ShuttingDownError("the storage engine is closed")
            self.appends_waiting += op.appends
            self._queue.put(op)

    def close(self) -> None:
        """Apply everything already submitted, then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._complete_committed()

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            first = self._next_op()
            if isinstance(first, _Stop):
                return
            group = [first]
            size = first.size
            while size < self.max_group_bytes and len(group) < self.max_group_ops:
                try:
                    op = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(op, _Stop):
                    stopping = True
                    break
                group.append(op)
                size += op.size
            appends = sum(op.appends for op in group)
            with self._lock:
                self.appends_waiting -= appends
            self.appends_in_commit = appends
            try:
                self._run_group(group)
            except Exception:  # never let the writer die; _run_group already isolates
                log.exception("storage writer: unexpected failure")
            self.appends_in_commit = 0

    def _next_op(self) -> WriteOp | _Stop:
        """The next submitted operation; with none waiting, complete the last
        group first, then wait."""
        if self._committed:
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                self._complete_committed()
        return self._queue.get()

    def _complete_committed(self) -> None:
        committed, self._committed = self._committed, []
        for op in committed:
            self._deliver(op.complete)

    def _run_group(self, group: list[WriteOp]) -> None:
        try:
            self._commit(group)
        except Exception as exc:
            self._complete_committed()
            if len(group) > 1:
                for op in group:
                    self._run_group([op])
                return
            if isinstance(exc, lmdb.MapFullError):
                error: ProtocolError = StorageFullError(
                    f"storage full: the {self.store.map_size}-byte map has no room left"
                )
            else:
                log.exception("storage writer: transaction failed")
                error = UnknownServerError(f"storage write failed: {exc}")
            self._deliver(group[0].fail, error)
            return
        self._committed.extend(group)

    def _commit(self, group: list[WriteOp]) -> None:
        started = time.perf_counter()
        now_ms = self._last_time_ms = max(self.clock(), self._last_time_ms)
        txn = self.store.env.begin(write=True)
        try:
            ctx = WriteContext(self.store, txn, now_ms)
            for op in group:
                op.apply(ctx)
            ctx.finish()
        except BaseException:
            txn.abort()
            raise
        # The previous group is completed only now, after this group's apply:
        # its callers wake up and take the GIL while this commit syncs (LMDB
        # releases the GIL), instead of contending with the apply's puts.
        self._complete_committed()
        handed_on = [op for op in group if op.applied()]
        # the durability point: after this returns, the group survives a crash
        syncing = time.perf_counter()
        try:
            txn.commit()
        except BaseException:
            if handed_on:
                self._fence(ctx, handed_on)
            raise
        committed = time.perf_counter()
        ctx.publish()
        if self.page_cache is not None:
            self.page_cache.committed(sum(op.size for op in group))
        elapsed = committed - started
        appends = sum(op.appends for op in group)
        self.commits_total += 1
        self.commit_seconds_total += elapsed
        self.last_commit_seconds = elapsed
        self.appends_total += appends
        self.last_group_size = appends
        self.max_group_size = max(self.max_group_size, appends)
        self.commit_seconds.observe(elapsed)
        self.sync_seconds.observe(committed - syncing)
        self.group_sizes.observe(appends)

    def _fence(self, ctx: WriteContext, handed_on: list[WriteOp]) -> None:
        """The commit failed after ``handed_on`` gave out their offsets: those
        may be on followers already, and this node would give them again to
        other batches. Their ranges take no more appends here until sealed."""
        streams = {
            item.stream_id for op in handed_on if isinstance(op, AppendOp) for item in op.items
        }
        fenced = replica_transitions.fenced_by_failed_commit(ctx.appended_ranges, streams)
        log.error(
            "storage writer: a commit failed after its batches went to followers; "
            "ranges %s take no more appends here until the PM seals them",
            sorted(fenced),
        )
        self.store.fenced.update(fenced)

    @staticmethod
    def _deliver(action: Callable[..., None], *args: ProtocolError) -> None:
        try:
            action(*args)
        except Exception:  # a caller's callback must not take the writer down
            log.exception("storage writer: completion callback failed")
