"""The storage engine of a data node: record batches of streams, in ranges, in LMDB.

``StorageEngine`` is the whole public surface. It knows record batches
(SPEC §4) and ranges (SPEC §5), not sockets; the data node adapts it to trio.

Threads: every change goes through the group-commit writer thread (see
``storage.writer``); ``submit`` is non-blocking and completes on that thread.
Reads, listings and ``next_offset`` run on the caller's thread and see only
committed, published state. Every change is a named operation that
returns at once with a ``concurrent.futures.Future`` (the data node waits on
it without blocking its event loop; a test or tool calls ``.result()``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, TypeVar

import lmdb

from sbp.batch_v2 import is_gap_marker
from sbp.batches import BASE_OFFSET, Buffer, batch_span, batch_spans, stamp_base_offset
from sbp.errors import (
    InvalidRequestError,
    OffsetOutOfRangeError,
    ProtocolError,
    RangeNotFoundError,
    StreamDeletedError,
)
from sbp.key_hash import KeyMap

from . import commands, layout
from .compaction import ChunkRewrite, RangeKeys, rewrite_chunk, scan_keys
from .layout import BATCH_KEY, IndexEntry, seek_floor
from .model import (
    AppendItem,
    AppendOutcome,
    AppendResult,
    Expired,
    RangeInfo,
    ReplicaBatch,
    StorageStats,
    StreamState,
    hosts,
)
from .page_cache import WrittenPageDropper
from .producers import DEFAULT_EXPIRY_MS, ProducerStamp, ProducerState, decode_stamp
from .transaction import ProducerTable, Store, WriteContext, is_dropped, producers_whole
from .writer import (
    DEFAULT_MAX_GROUP_BYTES,
    DEFAULT_MAX_GROUP_OPS,
    AppendCallback,
    AppendOp,
    CommandOp,
    GroupCommitWriter,
    wall_clock_ms,
)

T = TypeVar("T")

#: LMDB's own default map is 10 MiB: never what a data node wants. The map is
#: address space, not disk: the file grows with the data it holds.
DEFAULT_MAP_SIZE: Final = 4 * 1024**3
#: part of the map kept free of appends, so that trims, deletes and seals (which
#: need fresh pages before they free any) still work when appends hit the limit
MIN_RESERVE_BYTES: Final = 256 * 1024
MAX_RESERVE_BYTES: Final = 64 * 1024 * 1024
RESERVE_FRACTION: Final = 0.05
#: the newest written bytes kept in the OS page cache (see storage/page_cache.py)
DEFAULT_PAGE_CACHE_WINDOW: Final = 256 * 1024**2

#: how long ``prefetch_chunks`` may read before it leaves the rest to the writer
PREFETCH_BUDGET_S: Final = 5.0

SyncMode = Literal["always", "never"]


class StorageEngine:
    """Streams, ranges and record batches of one data directory (one LMDB environment).

    ``node_id`` is this data node's id: appends go only to ranges it is the
    primary of, reads only to ranges it hosts. None hosts and leads every range
    (tests and tools).

    ``sync="always"`` (the default) fsyncs every commit; ``"never"`` leaves
    flushing to the OS: a process crash loses nothing, a machine crash may lose
    the latest commits. For benchmarks and throwaway nodes.

    ``page_cache_window``: written pages further than this many bytes behind
    the end of the data file are dropped from the OS page cache (0: never);
    see ``storage/page_cache.py``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        sync: SyncMode = "always",
        node_id: int | None = None,
        clock: Callable[[], int] = wall_clock_ms,
        max_group_bytes: int = DEFAULT_MAX_GROUP_BYTES,
        max_group_ops: int = DEFAULT_MAX_GROUP_OPS,
        page_cache_window: int = DEFAULT_PAGE_CACHE_WINDOW,
        producer_expiry_ms: int = DEFAULT_EXPIRY_MS,
    ) -> None:
        if page_cache_window < 0:
            raise ValueError(f"page_cache_window must be >= 0, not {page_cache_window}")
        if sync not in ("always", "never"):
            raise ValueError(f"sync must be 'always' or 'never', not {sync!r}")
        Path(path).mkdir(parents=True, exist_ok=True)
        self.path = Path(path)
        self.sync: SyncMode = sync
        durable = sync == "always"
        env = lmdb.open(
            str(path),
            map_size=map_size,
            max_dbs=len(layout.ALL_DBS),
            sync=durable,
            metasync=durable,
            # writemap made synced commits 2-4x slower here; meminit off saves
            # zeroing pages that are overwritten anyway
            writemap=False,
            meminit=False,
            # the kernel's readahead on: a reader catching up from data no
            # longer in memory would fault the map in one 4 KiB disk read per
            # page without it (docs/storage.md)
            readahead=True,
        )
        try:
            dbs = {name: env.open_db(name) for name in layout.ALL_DBS}
            dbs[b""] = env.open_db(None)
            page_size = env.stat()["psize"]
            reserve = min(
                MAX_RESERVE_BYTES, max(MIN_RESERVE_BYTES, int(map_size * RESERVE_FRACTION))
            )
            self._store = Store(
                env=env,
                dbs=dbs,
                node_id=node_id,
                map_size=map_size,
                page_size=page_size,
                append_limit_pages=max(0, map_size - reserve) // page_size,
                producer_expiry_ms=producer_expiry_ms,
            )
            self._recover()
        except BaseException:
            env.close()
            raise
        self._page_cache = WrittenPageDropper(
            self.path / "data.mdb", page_cache_window, synced=durable
        )
        self._writer = GroupCommitWriter(
            self._store,
            clock=clock,
            max_group_bytes=max_group_bytes,
            max_group_ops=max_group_ops,
            page_cache=self._page_cache,
        )
        self._writer.start()
        self._closed = False
        self._close_lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------

    def _recover(self) -> None:
        """Rebuild the catalog from disk: stream and range records, and each
        stream's next offset from its last index entry (one seek per stream)."""
        store = self._store
        env = store.env
        with env.begin(write=True) as txn:
            meta = store.dbs[layout.META_DB]
            stored = txn.get(layout.FORMAT_KEY, db=meta)
            version = layout.FORMAT_VERSION if stored is None else layout.COUNTER.unpack(stored)[0]
            if version not in layout.READABLE_FORMATS:
                raise RuntimeError(f"{self.path}: unknown storage format {stored.hex()}")
            if version == 1:
                # format 1 stored one batch per value: count them once
                entries = txn.stat(store.dbs[layout.BATCHES_DB])["entries"]
                txn.put(layout.STORED_BATCHES_KEY, layout.COUNTER.pack(entries), db=meta)
            if stored is None or version != layout.FORMAT_VERSION:
                txn.put(layout.FORMAT_KEY, layout.COUNTER.pack(layout.FORMAT_VERSION), db=meta)
        with env.begin() as txn:
            streams: dict[int, StreamState] = {}
            for key, value in txn.cursor(db=store.dbs[layout.STREAMS_DB]):
                stream_id = layout.STREAM_KEY.unpack(key)[0]
                record = layout.decode_stream(value)
                streams[stream_id] = StreamState(
                    stream_id,
                    first_offset=record.first_offset,
                    next_offset=record.first_offset,
                    deleted=record.deleted,
                    retention_period_ms=record.retention_period_ms,
                    cleanup_policy=record.cleanup_policy,
                    keyless_below=record.keyless_below,
                    # a record from before idempotent producers: none wrote here
                    producers_from=(
                        record.first_offset
                        if record.producers_from is None
                        else record.producers_from
                    ),
                )
            for key, value in txn.cursor(db=store.dbs[layout.RANGES_DB]):
                info = layout.decode_range(key, value)
                state = streams.setdefault(info.stream_id, StreamState(info.stream_id))
                state.ranges = (*state.ranges, info)
            index = txn.cursor(db=store.dbs[layout.INDEX_DB])
            for stream_id, state in streams.items():
                floor = state.first_offset
                if state.ranges:
                    last = state.ranges[-1]
                    floor = max(floor, last.end_offset if not last.is_open else last.start_offset)
                last_batch_end = 0
                if seek_floor(index, layout.batch_key(stream_id, layout.MAX_OFFSET_KEY)):
                    key_stream, base_offset = BATCH_KEY.unpack(index.key())
                    if key_stream == stream_id:
                        entry = layout.decode_index(index.value())
                        last_batch_end = base_offset + entry.record_count
                        store.last_append_ms = max(store.last_append_ms, entry.append_time_ms)
                state.next_offset = max(floor, last_batch_end)
                if last_batch_end and _holds_dropped_chunks(index, state):
                    store.unfreed.add(stream_id)
                if state.ranges and state.ranges[-1].is_open:
                    state.producers_ready = producers_whole(
                        state.producers_from,
                        state.ranges[-1].start_offset,
                        functools.partial(layout.held_end, index, stream_id),
                    )
            store.streams = streams
            for key, value in txn.cursor(db=store.dbs[layout.PRODUCERS_DB]):
                stream_id, producer_id = BATCH_KEY.unpack(key)
                store.producers.setdefault(stream_id, {})[producer_id] = ProducerState(value)
            batches = txn.cursor(db=store.dbs[layout.BATCHES_DB])
            store.last_batch_key = batches.key() if batches.last() else b""
            store.stored_bytes = _counter(txn, store, layout.STORED_BYTES_KEY)
            store.stored_batches = _counter(txn, store, layout.STORED_BATCHES_KEY)

    def close(self) -> None:
        """Finish everything submitted, then close the environment. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._writer.close()
        self._page_cache.close()
        self._store.env.close()

    def __enter__(self) -> StorageEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- appends ------------------------------------------------------------

    def submit(
        self,
        items: Sequence[AppendItem],
        callback: AppendCallback,
        on_applied: AppendCallback | None = None,
    ) -> None:
        """Queue one request's appends; never blocks.

        ``items`` are ``AppendItem(stream_id, batch)``, each batch one whole
        record batch (any buffer; a memoryview of the receive buffer is stored
        without an intermediate copy). The buffers must stay unchanged until the
        callback runs. The batches are validated here, on the caller's thread
        (a CRC-32C pass over each). All items go into one transaction.
        ``callback`` is called ON THE WRITER THREAD once that transaction is
        durable (possibly while the writer's next transaction is open, so it
        should hand the outcomes over and return), with one outcome per item,
        in order: an ``AppendResult`` or the ``ProtocolError`` that item failed
        with (InvalidRecordBatchError, RangeNotFoundError, RangeSealedError,
        StreamDeletedError, NotPrimaryError, StorageFullError). Items of one
        stream are applied in submission order. Raises ShuttingDownError after
        ``close``.

        ``on_applied``, if given, is called the same way with the same
        outcomes earlier: once the transaction is written and before it is
        durable (a primary sends the batches to its followers meanwhile). If
        that commit then fails, the ranges of those batches are fenced: they
        take no more appends here (RangeSealedError) until the PM seals them.
        """
        self._writer.submit(AppendOp(items, callback, on_applied))

    def fence(self, stream_id: int, range_index: int) -> None:
        """Refuse appends to this open range from now on (RangeSealedError),
        until it is sealed: its followers may hold batches past this node's
        next offset (see ``submit``). Thread-safe."""
        self._store.fenced.add((stream_id, range_index))

    def fenced(self, stream_id: int, range_index: int) -> bool:
        """Whether appends to this open range are refused (``fence``). Thread-safe."""
        return (stream_id, range_index) in self._store.fenced

    def append(self, stream_id: int, batch: Buffer) -> Future[AppendResult]:
        """Append one batch (``submit`` with one item); the future completes
        once it is durable, with its ``AppendResult`` or the item's error."""
        done: Future[AppendResult] = Future()

        def complete(outcomes: list[AppendOutcome]) -> None:
            outcome = outcomes[0]
            if isinstance(outcome, ProtocolError):
                done.set_exception(outcome)
            else:
                done.set_result(outcome)

        self.submit([AppendItem(stream_id, batch)], complete)
        return done

    # -- other changes ----------------------------------------------------------
    #
    # Each is queued for the writer's transaction, ordered after everything
    # submitted before it, and never blocks: the future completes after the
    # commit, with the result or the ProtocolError that refused it (nothing
    # written then).

    def replicate(self, items: Sequence[ReplicaBatch]) -> Future[list[int | ProtocolError]]:
        """A follower stores a REPLICATE's batches (``commands.replicate``), in
        order, in one transaction; per item, this replica's next offset of the
        range after it, or the error refusing it. The batches must be
        validated by the caller and stay unchanged until the future is done."""
        items = list(items)

        def apply(ctx: WriteContext) -> list[int | ProtocolError]:
            outcomes: list[int | ProtocolError] = []
            for item in items:
                try:
                    outcomes.append(commands.replicate(ctx, item))
                except ProtocolError as error:
                    outcomes.append(error)
            return outcomes

        return self._command(apply)

    def catch_up(
        self,
        items: Sequence[ReplicaBatch],
        covered_to: int = 0,
        where: tuple[int, int] | None = None,
    ) -> Future[int]:
        """Store batches a sealed range lacks here, copied from another
        replica (``commands.catch_up``); how far the range is held after them."""
        items = list(items)
        return self._command(lambda ctx: commands.catch_up(ctx, items, covered_to, where))

    def sync_ranges(
        self, stream_id: int, ranges: Sequence[RangeInfo], cleanup_policy: int | None = None
    ) -> Future[list[RangeInfo]]:
        """Apply the PM's view of a stream's ranges (SYNC_RANGES); see
        ``commands.sync_ranges``. Creates or updates range records; a range
        is sealed when its end offset is not -1; ranges left out are
        forgotten and data below the first range's start offset is freed.
        ``cleanup_policy``, when the PM sent the stream's settings, is kept
        with it (SPEC §13). The ranges with live next offsets."""
        _check_stream_id(stream_id)
        ranges = list(ranges)
        return self._command(
            lambda ctx: commands.sync_ranges(ctx, stream_id, ranges, cleanup_policy)
        )

    def learn_ranges(self, stream_id: int, ranges: Sequence[RangeInfo]) -> Future[list[RangeInfo]]:
        """Apply a view of a stream's ranges this node looked up on the PM,
        unless it may be older than the one held (``commands.learn_ranges``)."""
        _check_stream_id(stream_id)
        ranges = list(ranges)
        return self._command(lambda ctx: commands.learn_ranges(ctx, stream_id, ranges))

    def seal_range(self, stream_id: int, range_index: int) -> Future[RangeInfo]:
        """Stop appends to a range; its end offset becomes the stream's next
        offset. Every append submitted before the seal is inside the range.
        Sealing a sealed range returns it unchanged."""
        return self._command(lambda ctx: commands.seal_range(ctx, stream_id, range_index))

    def trim(self, stream_id: int, trim_offset: int) -> Future[int]:
        """Drop the batches wholly below ``trim_offset``; the new first offset.

        The first offset never passes the next offset. A batch that straddles
        the trim offset is kept whole (readers skip its early records). The
        dropped chunks are freed by later appends (``WriteContext.free_dropped``).
        """
        return self._command(lambda ctx: commands.trim_stream(ctx, stream_id, trim_offset))

    def delete_stream(self, stream_id: int) -> Future[None]:
        """Mark the stream deleted, refuse its appends and reads, free its data."""
        _check_stream_id(stream_id)
        return self._command(lambda ctx: commands.delete_stream(ctx, stream_id))

    def set_retentions(self, periods: dict[int, int]) -> Future[None]:
        """Keep each stream's batches this many ms after they were appended (0: forever)."""
        periods = dict(periods)
        return self._command(lambda ctx: commands.set_retentions(ctx, periods))

    def expire(self, stream_ids: Sequence[int] | None = None) -> Future[list[Expired]]:
        """Drop every batch older than its stream's retention period, by
        append time (of these streams; of all by default); what was freed."""
        ids = None if stream_ids is None else list(stream_ids)
        return self._command(lambda ctx: commands.expire_streams(ctx, ids))

    def forget_idle_producers(self) -> Future[int]:
        """Forget the idempotent producers silent on a stream past the
        producer expiry (SPEC §10); how many (stream, producer) states went."""
        return self._command(lambda ctx: ctx.forget_idle_producers())

    def raise_pm_term(self, term: int) -> Future[int]:
        """Record ``term`` as the highest PM term seen, unless a higher one
        is; the highest, after (SPEC §8)."""
        return self._command(lambda ctx: commands.raise_pm_term(ctx, term))

    def _command(self, fn: Callable[[WriteContext], T]) -> Future[T]:
        op = CommandOp(fn)
        self._writer.submit(op)
        return op.future

    def prefetch_chunks(
        self,
        stream_id: int,
        stop: Callable[[int, IndexEntry], bool] | None = None,
        *,
        budget_s: float = PREFETCH_BUDGET_S,
    ) -> int:
        """Read the first page of each of the stream's chunks, oldest first,
        until ``stop(end_offset, entry)`` is true; returns how many were read.

        Freeing a chunk makes LMDB read its first page, where the length of
        its page run is kept. For chunks written long ago that page has left
        the page cache (see ``storage/page_cache.py``), and the writer, the
        path of every append, would wait for one disk read per chunk:
        deleting a stream of 6,000 chunks held appends up for 1.8 s. Call
        this on a worker thread before the command that frees the chunks.
        It is an optimisation only: it stops after ``budget_s`` seconds.
        """
        deadline = time.monotonic() + budget_s
        touched = 0
        with self._store.env.begin(buffers=True) as txn:
            index = txn.cursor(db=self._store.dbs[layout.INDEX_DB])
            if not index.set_range(layout.batch_key(stream_id, 0)):
                return 0
            batches = self._store.dbs[layout.BATCHES_DB]
            for key, value in index:
                key_stream, base_offset = BATCH_KEY.unpack(key)
                if key_stream != stream_id:
                    break
                entry = layout.decode_index(bytes(value))
                if stop is not None and stop(base_offset + entry.record_count, entry):
                    break
                chunk = txn.get(key, db=batches)
                if chunk is not None and len(chunk):
                    # one byte read faults in the page LMDB reads to free the chunk
                    _ = chunk[0]
                    touched += 1
                if time.monotonic() > deadline:
                    break
        return touched

    def replica_position(self, item: ReplicaBatch) -> int:
        """This replica's durable next offset of the item's range, or the error
        REPLICATE would refuse the item with (``commands.replica_position``),
        without going through the writer: what an item carrying only the
        primary's commit offset is answered. Thread-safe."""
        return commands.replica_position(
            self._store.streams.get(item.stream_id), item, self._store.node_id
        )

    def held_end(self, stream_id: int, start: int, end: int) -> int:
        """How far from ``start`` this node holds the stream without a gap, up
        to ``end``: where a catch-up of a sealed range resumes. Thread-safe."""
        store = self._store
        with store.env.begin(db=store.dbs[layout.INDEX_DB]) as txn:
            return layout.held_end(txn.cursor(), stream_id, start, end)

    # -- compaction (SPEC §13; storage/compaction.py) --------------------------------

    def _sealed_chunks(
        self, txn: Any, stream_id: int, range_index: int
    ) -> Iterator[tuple[int, memoryview]]:
        """``(base offset, value)`` of each chunk of a sealed range held here
        whole (RangeNotFoundError otherwise)."""
        info = self.describe_range(stream_id, range_index)
        if info.is_open or info.sealed_here:
            raise RangeNotFoundError(
                f"range {range_index} of stream {stream_id} is not sealed where the PM sealed "
                "it: only such ranges are compacted"
            )
        start = max(info.start_offset, self.first_offset(stream_id) or 0)
        cursor = txn.cursor(db=self._store.dbs[layout.BATCHES_DB])
        if start >= info.end_offset or not layout.seek_floor(
            cursor, layout.batch_key(stream_id, start)
        ):
            return
        held = start
        for key, value in cursor:
            key_stream, base_offset = BATCH_KEY.unpack(key)
            if key_stream != stream_id or base_offset >= info.end_offset:
                break
            chunk_end = base_offset + sum(batch_span(value, s) for s, _ in batch_spans(value))
            if base_offset > held:
                raise RangeNotFoundError(
                    f"range {range_index} of stream {stream_id} is not held whole here "
                    f"(offsets {held}..{base_offset - 1} are missing)"
                )
            held = max(held, chunk_end)
            yield base_offset, value
        if held < info.end_offset:
            raise RangeNotFoundError(
                f"range {range_index} of stream {stream_id} is held here only up to {held}"
            )

    def range_last_append_ms(self, stream_id: int, range_index: int) -> int:
        """When the last chunk of a range held here was appended (0: none).
        Thread-safe."""
        info = self.describe_range(stream_id, range_index)
        end = info.next_offset if info.is_open else info.end_offset
        store = self._store
        with store.env.begin(db=store.dbs[layout.INDEX_DB]) as txn:
            cursor = txn.cursor()
            if end <= info.start_offset or not layout.seek_floor(
                cursor, layout.batch_key(stream_id, end - 1)
            ):
                return 0
            key_stream, base_offset = BATCH_KEY.unpack(cursor.key())
            if key_stream != stream_id or base_offset < info.start_offset:
                return 0
            return layout.decode_index(cursor.value()).append_time_ms

    def range_keys(self, stream_id: int, range_index: int) -> RangeKeys:
        """What a sealed range held here holds of each key (COMPACTION_KEYS).
        Reads in a read transaction: call it off the event loop."""
        store = self._store
        with store.env.begin(buffers=True) as txn:
            return scan_keys(self._sealed_chunks(txn, stream_id, range_index))

    def compaction_rewrites(
        self, stream_id: int, range_index: int, keys: KeyMap, drop_tombstones: bool
    ) -> list[ChunkRewrite]:
        """The chunks of a sealed range held here as ``keys`` compacts them
        (only those that change), made in a read transaction, off the
        writer: ``apply_compaction`` then swaps them in."""
        store = self._store
        with store.env.begin(buffers=True) as txn:
            return [
                rewrite
                for base_offset, chunk in self._sealed_chunks(txn, stream_id, range_index)
                if (rewrite := rewrite_chunk(base_offset, chunk, keys, drop_tombstones)).value
                is not None
            ]

    def apply_compaction(
        self, stream_id: int, range_index: int, rewrites: Sequence[ChunkRewrite]
    ) -> Future[int]:
        """Swap the compacted chunks in, all in one transaction: a crash
        leaves the range as it was or compacted whole. A chunk that changed
        since it was read (trimmed, say) is left for the next pass. The
        bytes freed."""
        rewrites = list(rewrites)
        return self._command(lambda ctx: commands.apply_compaction(ctx, stream_id, rewrites))

    def keyless_below(self, stream_id: int) -> int:
        """The offset after the last batch stored here with a record without
        a key (0: none). Thread-safe."""
        state = self._store.streams.get(stream_id)
        return 0 if state is None else state.keyless_below

    def range_holding(self, stream_id: int, range_index: int) -> tuple[int, int]:
        """What this node holds of a range from its start (or the stream's
        first offset, if later): how far without a gap, and the bytes of it
        (RANGE_HOLDINGS). Raises RangeNotFoundError. Thread-safe."""
        info = self.describe_range(stream_id, range_index)
        start = max(info.start_offset, self.first_offset(stream_id) or 0)
        end = info.next_offset if info.is_open else info.end_offset
        if start >= end:
            return end, 0
        store = self._store
        with store.env.begin(db=store.dbs[layout.INDEX_DB]) as txn:
            return layout.held_span(txn.cursor(), stream_id, start, end)

    def offset_after_bytes(self, stream_id: int, range_index: int, skip: int) -> int:
        """Where to cut a range to drop about its first ``skip`` bytes (from
        its start, or the stream's first offset if later), at a boundary of
        whole batches (size retention, SPEC §12). Thread-safe."""
        info = self.describe_range(stream_id, range_index)
        start = max(info.start_offset, self.first_offset(stream_id) or 0)
        end = info.next_offset if info.is_open else info.end_offset
        if start >= end or skip <= 0:
            return start
        store = self._store
        with store.env.begin(db=store.dbs[layout.INDEX_DB]) as txn:
            return layout.offset_after_bytes(txn.cursor(), stream_id, start, end, skip)

    def retention_periods(self) -> dict[int, int]:
        """Each live stream's retention period in ms (0: kept forever)."""
        return {
            stream_id: state.retention_period_ms
            for stream_id, state in self._published_streams().items()
            if not state.deleted
        }

    def _published_streams(self) -> dict[int, StreamState]:
        """The streams as the last commit left them, copied: the writer thread
        publishes into the dict meanwhile. ``dict.copy`` makes no object per
        item, so no garbage collection (nor the Python code one can run) lets
        the writer in mid-copy, as it can while ``list(d.items())`` makes its
        tuples: "dictionary changed size during iteration"."""
        return self._store.streams.copy()

    # -- reads ----------------------------------------------------------------

    def read(
        self, stream_id: int, offset: int, max_bytes: int, limit: int | None = None
    ) -> bytearray:
        """Whole batches from the one holding ``offset``, up to ``max_bytes`` (at
        least one batch), with their base offsets stamped. Empty at the open tail,
        and at ``limit`` when given (a replicated range's commit offset: SPEC §7
        serves nothing at or above it). A read never crosses a gap in what this
        node holds: a replica still catching up serves what it has, and an
        offset it does not hold yet is RangeNotFoundError (read elsewhere).

        Raises OffsetOutOfRangeError (below the first offset or above the next),
        RangeNotFoundError (offset in a range not hosted here, or unknown stream),
        RangeSealedError (the end of a sealed range whose successor is not here),
        StreamDeletedError.
        """
        with self.borrow(stream_id, offset, max_bytes, limit) as batches:
            return batches.copy()

    @contextlib.contextmanager
    def borrow(
        self, stream_id: int, offset: int, max_bytes: int, limit: int | None = None
    ) -> Iterator[BorrowedBatches]:
        """``read``'s batches left where they are, in LMDB's map, for a caller
        that writes them out at once (a FETCH answer sent straight to its
        socket): they are valid inside the ``with`` block only, which holds a
        read transaction, so the block must not wait for anything (LMDB cannot
        reuse pages freed after its oldest reader began). Same arguments,
        answers and errors as ``read``."""
        state = self._state(stream_id)
        holder = state.read_range(offset, self._store.node_id)
        if holder is None:
            yield NO_BATCHES
            return
        # a sealed range ends the read, so a gap to a later range hosted here is never crossed
        stop = holder.end_offset if not holder.is_open else state.next_offset
        if limit is not None:
            if offset >= limit:
                if not holder.is_open:
                    # sealed here, the PM's end not known yet: ask elsewhere or later
                    raise RangeNotFoundError(
                        f"offset {offset} of stream {stream_id} is past what range "
                        f"{holder.range_index} has committed, and the PM has not said "
                        "where that range ends yet"
                    )
                yield NO_BATCHES
                return
            stop = min(stop, limit)
        store = self._store
        with store.env.begin(db=store.dbs[layout.BATCHES_DB], buffers=True) as txn:
            batches = _find_batches(txn.cursor(), stream_id, offset, stop, max_bytes)
            if not batches.size and batches.covered >= stop:
                # held to the read's end, every record of it compacted away
                # (SPEC §13): an empty answer, as at the end of what there is
                yield NO_BATCHES
                return
            if not batches.size:
                if offset >= state.first_offset:
                    raise RangeNotFoundError(
                        f"offset {offset} of stream {stream_id} is not held on this node yet "
                        "(its replica is catching up)"
                    )
                raise _trimmed(stream_id, offset)
            try:
                yield batches
            finally:
                batches.release()

    # -- what the node hosts --------------------------------------------------

    def _state(self, stream_id: int) -> StreamState:
        state = self._store.streams.get(stream_id)
        if state is None:
            raise RangeNotFoundError(f"stream {stream_id} is unknown here")
        return state

    def next_offset(self, stream_id: int) -> int | None:
        """The stream's next offset as of the last commit (None if unknown). Thread-safe."""
        state = self._store.streams.get(stream_id)
        return None if state is None else state.next_offset

    def producer_stamps(self, stream_id: int, start: int, end: int) -> dict[int, ProducerStamp]:
        """The producer stamps of the stream's idempotent batches based in
        ``[start, end)``, by base offset (what REPLICATE carries, SPEC §10).
        Thread-safe."""
        stamps: dict[int, ProducerStamp] = {}
        with self._store.env.begin(buffers=False) as txn:
            cursor = txn.cursor(db=self._store.dbs[layout.SEQUENCES_DB])
            if not cursor.set_range(layout.batch_key(stream_id, start)):
                return stamps
            for key, value in cursor:
                key_stream, base_offset = BATCH_KEY.unpack(key)
                if key_stream != stream_id or base_offset >= end:
                    break
                stamps[base_offset] = decode_stamp(value)
        return stamps

    def producer_snapshot(self, stream_id: int, as_of: int) -> ProducerTable:
        """The stream's producer state as of ``as_of`` (for the replica of the
        range that starts there), or ``RangeNotFoundError`` when this node's
        table is not whole up to there. Thread-safe."""
        if not self.producers_whole_at(stream_id, as_of):
            raise RangeNotFoundError(
                f"stream {stream_id}: this node's producer state is not whole up to {as_of}"
            )
        snapshot: ProducerTable = {}
        for producer_id, producer in self._store.producers.get(stream_id, {}).items():
            kept = producer.below(as_of)
            if kept is not None:
                snapshot[producer_id] = kept
        return snapshot

    def producers_whole_at(self, stream_id: int, as_of: int) -> bool:
        """Whether this node's producer table of the stream is whole as of
        ``as_of``: it holds the effect of every batch below it. Thread-safe."""
        state = self._state(stream_id)
        with self._store.env.begin(buffers=False) as txn:
            index = txn.cursor(db=self._store.dbs[layout.INDEX_DB])
            held = functools.partial(layout.held_end, index, stream_id)
            return producers_whole(state.producers_from, as_of, held)

    def take_in_producers(
        self, stream_id: int, as_of: int, inherited: ProducerTable | None
    ) -> Future[bool]:
        """Take in the stream's producer state as of ``as_of`` (its open
        range's start, or the end of a sealed range just copied here) from
        another replica (``producer_snapshot`` there), or go on without it
        (None); the future says whether this node may now decide the
        stream's idempotent appends (``commands.take_in_producers``)."""
        return self._command(
            lambda ctx: commands.take_in_producers(ctx, stream_id, as_of, inherited)
        )

    def producers_ready(self, stream_id: int) -> bool:
        """Whether the producer table is whole as of the open range's start
        (True for a stream unknown here). Thread-safe."""
        state = self._store.streams.get(stream_id)
        return state is None or state.producers_ready

    def producers(self, stream_id: int) -> dict[int, ProducerState]:
        """The stream's idempotent producers as of the last commit. Thread-safe."""
        return dict(self._store.producers.get(stream_id, {}))

    def first_offset(self, stream_id: int) -> int | None:
        """The lowest readable offset of the stream (None if unknown). Thread-safe."""
        state = self._store.streams.get(stream_id)
        return None if state is None else state.first_offset

    def open_range(self, stream_id: int) -> RangeInfo | None:
        """The stream's open (last) range, live next offset filled in; None
        when the stream is unknown here or its last range is sealed. Thread-safe."""
        state = self._store.streams.get(stream_id)
        if state is None or state.deleted or not state.ranges or not state.ranges[-1].is_open:
            return None
        return state.live(state.ranges[-1])

    def unsettled_range(self, stream_id: int) -> RangeInfo | None:
        """The stream's first range with followers whose end is not fixed by
        the PM yet: open, or sealed here (``RangeInfo.sealed_here``); None if
        none. Reads must not pass its commit offset. Thread-safe."""
        state = self._store.streams.get(stream_id)
        if state is None:
            return None
        for info in state.ranges:
            if len(info.replicas) > 1 and not info.end_is_final:
                return info
        return None

    def range_at(self, stream_id: int, offset: int) -> RangeInfo | None:
        """The stream's range holding ``offset`` (the open one holds every
        offset from its start) as recorded, its ``next_offset`` not filled in
        (this runs once per appended batch); None if none or the stream is
        unknown. Thread-safe."""
        state = self._store.streams.get(stream_id)
        if state is None:
            return None
        for info in reversed(state.ranges):
            if info.holds(offset):
                return info
        return None

    def find_offset(self, stream_id: int, range_index: int, timestamp_ms: int) -> tuple[int, int]:
        """FIND_OFFSETS (SPEC §11): the first offset of the range whose batch
        was appended at or after ``timestamp_ms``, with that append time; the
        range's end (its next offset while open) and -1 when none was.
        Append times never go backwards within a range, so this is a binary
        search over the index by offset (every batch of one chunk was
        committed at one time). Thread-safe."""
        state = self._state(stream_id)
        if state.deleted:
            raise StreamDeletedError(f"stream {stream_id} is deleted")
        info = state.live(state.find_range(range_index))
        low = max(info.start_offset, state.first_offset)
        high = info.next_offset
        with self._store.env.begin(buffers=False) as txn:
            index = txn.cursor(db=self._store.dbs[layout.INDEX_DB])
            while low < high:
                middle = (low + high) // 2
                chunk = _chunk_at(index, stream_id, middle, high)
                if chunk is None:  # nothing held from there on: look below
                    high = middle
                elif chunk[1].append_time_ms >= timestamp_ms:
                    high = max(chunk[0], low)
                else:
                    low = chunk[0] + chunk[1].record_count
            found = _chunk_at(index, stream_id, low, info.next_offset)
        if found is None:
            return info.next_offset, -1
        return max(found[0], low), found[1].append_time_ms

    def describe_range(self, stream_id: int, range_index: int) -> RangeInfo:
        """One range with its live next offset."""
        state = self._state(stream_id)
        return state.live(state.find_range(range_index))

    def list_ranges(self, stream_id: int | None = None) -> list[RangeInfo]:
        """Ranges hosted here (of one stream, or of all), with live next offsets."""
        node_id = self._store.node_id
        if stream_id is not None:
            states = [self._state(stream_id)]
        else:
            states = [state for _, state in sorted(self._published_streams().items())]
        return [s.live(r) for s in states for r in s.ranges if hosts(r, node_id) and not r.deleted]

    def pm_term(self) -> int:
        """The highest PM term recorded here (``raise_pm_term``), 0 if none."""
        with self._store.env.begin() as txn:
            return _counter(txn, self._store, layout.PM_TERM_KEY)

    def stream_ids(self) -> list[int]:
        """Every stream this node has a record of, deleted ones included."""
        return sorted(self._published_streams())

    def stats(self) -> StorageStats:
        """A snapshot of sizes and writer counters (cheap: one read transaction)."""
        store = self._store
        writer = self._writer
        with store.env.begin() as txn:
            used_pages = store.pages_in_use(txn)
        info: dict[str, Any] = store.env.info()
        streams = list(self._published_streams().values())
        return StorageStats(
            stored_bytes=store.stored_bytes,
            stored_batches=store.stored_batches,
            map_size=store.map_size,
            used_bytes=used_pages * store.page_size,
            file_bytes=(info["last_pgno"] + 1) * store.page_size,
            append_room_bytes=max(0, store.append_limit_pages - used_pages) * store.page_size,
            commits_total=writer.commits_total,
            commit_seconds_total=writer.commit_seconds_total,
            last_commit_seconds=writer.last_commit_seconds,
            appends_total=writer.appends_total,
            last_group_size=writer.last_group_size,
            max_group_size=writer.max_group_size,
            appends_waiting=writer.appends_waiting,
            appends_in_commit=writer.appends_in_commit,
            streams=len(streams),
            ranges=sum(len(s.ranges) for s in streams),
            streams_freeing=len(store.unfreed),
            producers=sum(len(table) for table in list(store.producers.values())),
            commit_seconds=writer.commit_seconds.snapshot(),
            sync_seconds=writer.sync_seconds.snapshot(),
            group_sizes=writer.group_sizes.snapshot(),
        )


def _holds_dropped_chunks(index: Any, state: StreamState) -> bool:
    """Whether the index still holds chunks the stream dropped: any, for a
    deleted stream; one wholly below the first offset, for a live one."""
    if state.deleted:
        return True
    if not index.set_range(layout.batch_key(state.stream_id, 0)):
        return False
    key_stream, base_offset = BATCH_KEY.unpack(index.key())
    if key_stream != state.stream_id:
        return False
    entry = layout.decode_index(index.value())
    return is_dropped(state, base_offset + entry.record_count)


class BorrowedBatches:
    """Whole batches found by ``StorageEngine.borrow``, as views into LMDB's
    map (no copy), with the base offset each must carry, which the stored
    batch does not (it is stamped on the way out)."""

    __slots__ = ("_batches", "_owned", "covered", "record_count", "size")

    def __init__(
        self,
        batches: list[tuple[Any, int, int, int]],
        size: int,
        record_count: int,
        covered: int = 0,
    ) -> None:
        #: (chunk, start, end, base offset) of each batch, in order
        self._batches = batches
        #: the batches copied out of the map (``detach``)
        self._owned: Buffer | None = None
        #: bytes of the whole batches
        self.size = size
        #: offsets they cover
        self.record_count = record_count
        #: how far the read found the stream held without a gap (past
        #: offsets compaction emptied, SPEC §13); 0 when it found nothing
        self.covered = covered

    @classmethod
    def owned(cls, data: Buffer, record_count: int) -> BorrowedBatches:
        """Batches read from elsewhere (the object store), already in one
        buffer with their base offsets."""
        found = cls([], len(data), record_count)
        found._owned = data
        return found

    def copy(self) -> bytearray:
        """The batches in one buffer of their own, base offsets stamped."""
        if self._owned is not None:
            return bytearray(self._owned)
        slices: list[list[Any]] = []  # consecutive batches of one chunk: one slice
        for chunk, start, end, _ in self._batches:
            if slices and slices[-1][0] is chunk and slices[-1][2] == start:
                slices[-1][2] = end
            else:
                slices.append([chunk, start, end])
        out = bytearray().join(chunk[start:end] for chunk, start, end in slices)
        position = 0
        for _, start, end, base_offset in self._batches:
            stamp_base_offset(out, base_offset, position)
            position += end - start
        return out

    def buffers(self) -> list[Buffer]:
        """The batches as buffers to be written in order, none of them
        copied: each batch's base offset (8 bytes of its own), then the rest
        of the batch, a view into the map (once detached, the one copy)."""
        if self._owned is not None:
            return [self._owned]
        out: list[Buffer] = []
        for chunk, start, end, base_offset in self._batches:
            out.append(BASE_OFFSET.pack(base_offset))
            out.append(chunk[start + BASE_OFFSET.size : end])
        return out

    def detach(self) -> BorrowedBatches:
        """Copy the batches out of the map, so that they outlive the
        transaction; returns self (``NO_BATCHES``, shared, stays as it is)."""
        if self._owned is None and self._batches:
            self._owned = self.copy()
            self._batches = []
        return self

    def release(self) -> None:
        """Forget the views: their transaction is ending."""
        self._batches = []


#: what a read at the open tail finds
NO_BATCHES: Final = BorrowedBatches([], 0, 0)


def _find_batches(
    cursor: Any, stream_id: int, offset: int, stop: int, max_bytes: int
) -> BorrowedBatches:
    """The consecutive whole batches of the stream from the one holding
    ``offset`` (or, when compaction emptied that part, the next one left),
    below ``stop``, up to ``max_bytes`` (at least one); none when that part
    is not held here (trimmed, or a gap). Gap markers count as held and are
    never returned."""
    if not seek_floor(cursor, layout.batch_key(stream_id, offset)):
        return NO_BATCHES
    found: list[tuple[Any, int, int, int]] = []
    total = records = 0
    position = offset  # where the next batch must start: no gap is crossed
    for base_offset, span, chunk, start, end in _stream_batches(cursor, stream_id):
        if base_offset + span <= position:
            continue  # below the read, in the same chunk
        if base_offset > position or base_offset >= stop:
            break  # a gap in what is held here, or the read's end
        if found and total + (end - start) > max_bytes:
            break
        position = base_offset + span
        if is_gap_marker(chunk, start):
            continue
        found.append((chunk, start, end, base_offset))
        total += end - start
        records += span
    return BorrowedBatches(found, total, records, position if position > offset else 0)


def _stream_batches(cursor: Any, stream_id: int) -> Iterator[tuple[int, int, Any, int, int]]:
    """(base_offset, record_count, chunk, start, end) of each batch of the
    stream's chunks, from the cursor's chunk on."""
    while True:
        key_stream, base_offset = BATCH_KEY.unpack(cursor.key())
        if key_stream != stream_id:
            return
        chunk = cursor.value()
        for start, end in batch_spans(chunk):
            count = batch_span(chunk, start)
            yield base_offset, count, chunk, start, end
            base_offset += count
        if not cursor.next():
            return


def _counter(txn: Any, store: Store, name: bytes) -> int:
    value = txn.get(name, db=store.dbs[layout.META_DB])
    return layout.COUNTER.unpack(value)[0] if value else 0


def _check_stream_id(stream_id: int) -> None:
    if not 0 <= stream_id <= layout.MAX_STREAM_ID:
        raise InvalidRequestError(f"stream id {stream_id} out of range")


def _trimmed(stream_id: int, offset: int) -> ProtocolError:
    # the catalog said the offset exists but its batch is gone: trimmed meanwhile
    return OffsetOutOfRangeError(f"offset {offset} of stream {stream_id} is no longer stored")


def _chunk_at(index: Any, stream_id: int, offset: int, end: int) -> tuple[int, IndexEntry] | None:
    """The chunk holding ``offset``, or else the first one after it below
    ``end``: its base offset and index entry (None when there is none)."""
    if seek_floor(index, layout.batch_key(stream_id, offset)):
        key_stream, base = BATCH_KEY.unpack(index.key())
        if key_stream == stream_id:
            entry = layout.decode_index(index.value())
            if base + entry.record_count > offset:
                return base, entry
    if not index.set_range(layout.batch_key(stream_id, offset)):
        return None
    key_stream, base = BATCH_KEY.unpack(index.key())
    if key_stream != stream_id or base >= end:
        return None
    return base, layout.decode_index(index.value())
