"""The store's catalog and one LMDB write transaction over it.

A ``WriteContext`` wraps the writer's current transaction. Stream states are
copied on first change and published only after the commit, so readers never
see an offset whose batch is not durable, and an aborted transaction leaves
the published catalog as it was.

Each operation checks everything that can refuse it before its first write:
a ``ProtocolError`` raised by an operation means "nothing was written", which
is what lets one bad item fail alone inside a shared transaction.

Appends are gathered per stream and written as one chunk per stream when the
transaction is finished, or before the next command runs (a command may read
or drop batches, so it must find them in LMDB); see ``storage.layout``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sbp.batches import Buffer, all_keyed, batch_spans, peek_header
from sbp.constants import COMPACTED_POLICIES, MAX_RECORD_OFFSET
from sbp.errors import (
    InvalidRecordBatchError,
    OffsetOutOfRangeError,
    RangeNotFoundError,
    RangeSealedError,
    StorageFullError,
)

from . import layout
from .layout import BATCH_KEY, IndexEntry, batch_key, range_key, stream_key
from .model import AppendResult, RangeInfo, StreamState
from .producers import (
    DEFAULT_EXPIRY_MS,
    ProducerStamp,
    ProducerState,
    SequenceEntry,
    decide,
    encode_stamp,
    merge,
)

#: producer id -> state, for one stream
ProducerTable = dict[int, ProducerState]


@dataclass(slots=True)
class Store:
    """The open environment and what the writer and readers share about it."""

    env: Any  # lmdb.Environment (py-lmdb ships no type hints)
    dbs: dict[bytes, Any]
    node_id: int | None
    map_size: int
    page_size: int
    #: appends are refused once the pages in use would pass this; the rest of
    #: the map stays free for trims, deletes, seals and LMDB's own bookkeeping,
    #: which all need fresh pages (copy-on-write) even when they free space
    append_limit_pages: int
    #: the published catalog: replaced per stream after each commit, never mutated
    streams: dict[int, StreamState] = field(default_factory=dict)
    #: >= the largest key in ``batches``: a larger key can use MDB_APPEND
    last_batch_key: bytes = b""
    #: the latest append time stored (at open: of every stream's last chunk),
    #: below which the writer's clock never goes, so that append times never
    #: go backwards within a range even when the wall clock does
    last_append_ms: int = 0
    stored_bytes: int = 0
    stored_batches: int = 0
    #: pages in use as of the last commit, or more: counted (``pages_in_use``,
    #: a few LMDB calls that each hand the GIL away) only when unknown or when
    #: an append would pass the limit, and otherwise grown by the appends'
    #: generous estimates. None: count before the next append.
    used_pages_bound: int | None = None
    #: (stream id, range index) of open ranges that take no more appends here
    #: until the PM seals them: their batches may have reached the followers
    #: ahead of this node's commit (a commit that then failed, or a restart),
    #: so offsets from this node's next offset on may hold other batches there
    fenced: set[tuple[int, int]] = field(default_factory=set)
    #: streams with chunks that no longer count as stored but are not freed
    #: yet: every chunk of a deleted stream, those wholly below a trimmed
    #: stream's first offset. Later write transactions free them a little at
    #: a time (``WriteContext.free_dropped``).
    unfreed: set[int] = field(default_factory=set)
    #: the stream whose chunk was freed last; the next transaction's
    #: free_dropped starts with the stream after it
    free_after: int = -1
    #: idempotent producers per stream (SPEC §10), published like ``streams``
    producers: dict[int, ProducerTable] = field(default_factory=dict)
    #: a producer silent this long on a stream is forgotten there
    producer_expiry_ms: int = DEFAULT_EXPIRY_MS

    def pages_in_use(self, txn: Any) -> int:
        """Pages the databases occupy as ``txn`` sees them (free pages excluded)."""
        total = 2  # the two meta pages
        for db in self.dbs.values():  # the main database (key b"") included
            stat = txn.stat(db)
            total += stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        return total

    def estimate_pages(self, batch_size: int) -> int:
        """A generous bound on the pages one batch and its index entry take.

        Values over about half a page go to overflow pages of their own; smaller
        ones share leaf pages, counted here as if those pages were half full.
        """
        if batch_size > self.page_size // 2:
            return -(-(batch_size + 16) // self.page_size) + 1
        return -(-2 * (batch_size + 96) // self.page_size)


@dataclass(slots=True)
class _Chunk:
    """One stream's appends of this transaction, not yet written."""

    base_offset: int
    batches: list[Buffer]
    record_count: int
    size: int

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.record_count


class WriteContext:
    """One write transaction of the group-commit writer."""

    def __init__(self, store: Store, txn: Any, now_ms: int) -> None:
        self.store = store
        self.txn = txn
        self.now_ms = now_ms
        self.pending: dict[int, StreamState | None] = {}
        self.last_batch_key = store.last_batch_key
        self.stored_bytes = store.stored_bytes
        self.stored_batches = store.stored_batches
        self.used_pages = store.used_pages_bound
        #: estimated pages of the appends gathered but not yet written
        self._unwritten_pages = 0
        self._counted = False
        self._batches = store.dbs[layout.BATCHES_DB]
        self._index = store.dbs[layout.INDEX_DB]
        #: stream id -> the range its appends go to; looked up once per stream
        #: and transaction, and again after any command (see after_command)
        self._append_targets: dict[int, RangeInfo] = {}
        self._chunks: dict[int, _Chunk] = {}
        #: (stream id, range index) of every append of this transaction
        self.appended_ranges: set[tuple[int, int]] = set()
        #: the store's set until this transaction changes it, then a copy
        self.unfreed = store.unfreed
        #: the stream freed from last (free_dropped's turns go on after it)
        self.free_after = store.free_after
        #: bytes of batches this transaction stores
        self._stored_here = 0
        #: producer states this transaction changed (None: gone), by stream
        self._producers: dict[int, dict[int, ProducerState | None]] = {}
        self._sequences = store.dbs[layout.SEQUENCES_DB]

    # -- stream states ----------------------------------------------------

    def current(self, stream_id: int) -> StreamState | None:
        """The stream as this transaction sees it (do not mutate; see ``for_update``)."""
        if stream_id in self.pending:
            return self.pending[stream_id]
        return self.store.streams.get(stream_id)

    def for_update(self, stream_id: int) -> StreamState:
        """A private copy of the stream to change; RangeNotFoundError if unknown."""
        state = self.pending.get(stream_id)
        if state is not None:  # pending states are this transaction's own copies
            return state
        state = self.current(stream_id)
        if state is None:
            raise RangeNotFoundError(f"stream {stream_id} is unknown here")
        if self.pending.get(stream_id) is not state:
            state = state.copy()
            self.pending[stream_id] = state
        return state

    def save_stream(self, state: StreamState) -> None:
        self.txn.put(
            stream_key(state.stream_id),
            layout.encode_stream(state.record()),
            db=self.store.dbs[layout.STREAMS_DB],
        )

    def save_range(self, info: RangeInfo) -> None:
        self.txn.put(
            range_key(info.stream_id, info.range_index),
            layout.encode_range(info),
            db=self.store.dbs[layout.RANGES_DB],
        )

    def delete_range(self, info: RangeInfo) -> None:
        self.txn.delete(
            range_key(info.stream_id, info.range_index), db=self.store.dbs[layout.RANGES_DB]
        )

    # -- batches ----------------------------------------------------------

    def append(
        self,
        stream_id: int,
        batch: Buffer,
        record_count: int,
        producer: ProducerStamp | None = None,
    ) -> AppendResult:
        """Append one batch to the stream's open range; the wire error if refused.

        ``batch`` is already validated (``sbp.batches.validate_batch``) and holds
        ``record_count`` records. With a ``producer`` (SPEC §10) the batch is
        decided by ``producers.decide`` first: a resend is answered with the
        offset it was stored at (``duplicate``), and nothing is written.
        """
        target = self._append_targets.get(stream_id)
        if target is None:
            state = self.current(stream_id)
            if state is None:
                raise RangeNotFoundError(f"stream {stream_id} is unknown here")
            target = state.append_range(self.store.node_id)
            # checked before the target is remembered: every later append of
            # the stream in this transaction takes the remembered target
            # unchecked, so a fenced range must never be remembered
            if (stream_id, target.range_index) in self.store.fenced:
                raise RangeSealedError(
                    f"range {target.range_index} of stream {stream_id} takes no more appends "
                    "here: its followers may hold batches this node does not; the PM must seal it"
                )
            self._append_targets[stream_id] = target
        if producer is not None:
            current = self.current(stream_id)
            if current is None or not current.producers_ready:
                raise RangeNotFoundError(
                    f"stream {stream_id}: this node is still taking in the producer state "
                    f"of the ranges before range {target.range_index}; try again"
                )
            stored = decide(
                self.producer(stream_id, producer.producer_id),
                producer,
                record_count,
                self.now_ms,
                self.store.producer_expiry_ms,
            )
            if stored is not None:
                return AppendResult(stored.base_offset, record_count, self.now_ms, duplicate=True)
        if not all_keyed(batch):
            current = self.current(stream_id)
            if current is not None and current.cleanup_policy in COMPACTED_POLICIES:
                raise InvalidRecordBatchError(
                    f"stream {stream_id} is compacted (SPEC §13): every record needs a key"
                )
        self.appended_ranges.add((stream_id, target.range_index))
        state = self.for_update(stream_id)
        base_offset = max(state.next_offset, target.start_offset)
        self.add_batch(state, base_offset, batch, record_count, producer=producer)
        return AppendResult(base_offset, record_count, self.now_ms)

    def add_batch(
        self,
        state: StreamState,
        base_offset: int,
        batch: Buffer,
        record_count: int,
        *,
        advance: bool = True,
        producer: ProducerStamp | None = None,
    ) -> None:
        """Store one validated batch at ``base_offset`` of ``state`` (a copy
        from ``for_update``); ``advance`` moves the stream's next offset past
        it (not for a batch filled in below it, by a catch-up). A
        ``producer``'s stamp is stored beside it and its state moves on."""
        stream_id = state.stream_id
        if base_offset + record_count > MAX_RECORD_OFFSET:  # the next offset must fit too
            raise OffsetOutOfRangeError(
                f"stream {stream_id} has no offsets left: {record_count} records from "
                f"{base_offset} would pass {MAX_RECORD_OFFSET}"
            )
        size = len(batch)
        self._reserve(size)
        chunk = self._chunks.get(stream_id)
        if chunk is not None and chunk.next_offset == base_offset:
            chunk.batches.append(batch)
            chunk.record_count += record_count
            chunk.size += size
        else:
            if chunk is not None:  # offsets jumped (a new range): a chunk of its own
                self._write_chunk(stream_id, chunk)
            chunk = self._chunks[stream_id] = _Chunk(base_offset, [batch], record_count, size)
        if advance:
            state.next_offset = base_offset + record_count
        if not all_keyed(batch):
            state.keyless_below = max(state.keyless_below, base_offset + record_count)
        self.stored_bytes += size
        self.stored_batches += 1
        if producer is not None:
            self._record_producer(stream_id, producer, base_offset, record_count)

    # -- producers (SPEC §10) ------------------------------------------------

    def producer(self, stream_id: int, producer_id: int) -> ProducerState | None:
        """The producer's state on the stream as this transaction sees it."""
        changed = self._producers.get(stream_id)
        if changed is not None and producer_id in changed:
            return changed[producer_id]
        return self.store.producers.get(stream_id, {}).get(producer_id)

    def producer_table(self, stream_id: int) -> ProducerTable:
        """Every producer's state on the stream, this transaction included."""
        table = dict(self.store.producers.get(stream_id, {}))
        for producer_id, state in self._producers.get(stream_id, {}).items():
            if state is None:
                table.pop(producer_id, None)
            else:
                table[producer_id] = state
        return table

    def _set_producer(self, stream_id: int, producer_id: int, state: ProducerState | None) -> None:
        self._producers.setdefault(stream_id, {})[producer_id] = state

    def _record_producer(
        self, stream_id: int, stamp: ProducerStamp, base_offset: int, record_count: int
    ) -> None:
        entry = SequenceEntry(stamp.epoch, stamp.base_sequence, record_count, base_offset)
        state = self.producer(stream_id, stamp.producer_id)
        expired = (
            state is not None and self.now_ms - state.last_append_ms > self.store.producer_expiry_ms
        )
        state = (
            ProducerState.first(entry, self.now_ms)
            if state is None or expired
            else state.with_batch(entry, self.now_ms)
        )
        self._set_producer(stream_id, stamp.producer_id, state)
        self.txn.put(batch_key(stream_id, base_offset), encode_stamp(stamp), db=self._sequences)

    def _drop_producers_from(self, stream_id: int, offset: int) -> None:
        """The stream's producers as of ``offset``: their batches at and
        above it are gone (``drop_from``), and so are their stamps."""
        for producer_id, state in self.producer_table(stream_id).items():
            if state.holds_above(offset):
                self._set_producer(stream_id, producer_id, state.below(offset))
        self._delete_stamps(stream_id, offset, layout.MAX_OFFSET_KEY)

    def refresh_producers_ready(self, state: StreamState) -> None:
        """Whether the producer table is whole as of the open range's start:
        it holds every batch below ``producers_from``, and this node holds,
        with their producer fields, every batch from there to that start."""
        last = state.ranges[-1] if state.ranges else None
        if last is None or not last.is_open:
            state.producers_ready = True
            return
        state.producers_ready = producers_whole(
            state.producers_from,
            last.start_offset,
            lambda start, end: self.held_end(state.stream_id, start, end),
        )
        if state.producers_ready:
            # whole there: the next check walks the index from here, not
            # from further back (what is stored from here on came stamped)
            state.producers_from = last.start_offset

    def take_in_producers(
        self, state: StreamState, as_of: int, inherited: ProducerTable | None
    ) -> None:
        """Merge the producer state as of ``as_of`` from another replica into
        this one's (None: none could be had; go on with what is here).
        A table already whole there, or kept from further on, is left as
        it is: taking in never moves ``producers_from`` back."""
        whole = producers_whole(
            state.producers_from,
            as_of,
            lambda start, end: self.held_end(state.stream_id, start, end),
        )
        if whole or (inherited is not None and state.producers_from > as_of):
            if not state.producers_ready:
                self.refresh_producers_ready(state)
                self.save_stream(state)
            return
        if inherited is not None:
            local = self.producer_table(state.stream_id)
            for producer_id in set(inherited) | set(local):
                merged = merge(inherited.get(producer_id), local.get(producer_id), as_of)
                self._set_producer(state.stream_id, producer_id, merged)
        state.producers_from = as_of
        self.refresh_producers_ready(state)
        self.save_stream(state)

    def forget_idle_producers(self) -> int:
        """Forget every producer silent past the expiry, on every stream
        (its next batch starts again at sequence 0); how many went."""
        cutoff = self.now_ms - self.store.producer_expiry_ms
        forgotten = 0
        for stream_id in list(self.store.producers):
            for producer_id, state in self.producer_table(stream_id).items():
                if state.last_append_ms < cutoff:
                    self._set_producer(stream_id, producer_id, None)
                    forgotten += 1
        return forgotten

    def drop_producers(self, stream_id: int) -> None:
        """Forget every producer of the stream (it is deleted, or gone from here)."""
        for producer_id in self.producer_table(stream_id):
            self._set_producer(stream_id, producer_id, None)

    def _delete_stamps(self, stream_id: int, start: int, end: int) -> None:
        """Delete the producer stamps of batches based in ``[start, end)``."""
        cursor = self.txn.cursor(db=self._sequences)
        if not cursor.set_range(batch_key(stream_id, start)):
            return
        while key := cursor.key():  # empty once the cursor ran off the end
            key_stream, base_offset = BATCH_KEY.unpack(key)
            if key_stream != stream_id or base_offset >= end:
                return
            cursor.delete()  # and moves on to the next key

    def _write_producers(self) -> None:
        db = self.store.dbs[layout.PRODUCERS_DB]
        for stream_id, changed in self._producers.items():
            for producer_id, state in changed.items():
                key = batch_key(stream_id, producer_id)
                if state is None:
                    self.txn.delete(key, db=db)
                else:
                    self.txn.put(key, state.value, db=db)

    def held_end(self, stream_id: int, start: int, end: int) -> int:
        """How far from ``start`` this node holds the stream's records without
        a gap, up to ``end`` (``layout.held_end``), this transaction included."""
        self.write_appends()
        return layout.held_end(self.txn.cursor(db=self._index), stream_id, start, end)

    def drop_from(self, stream_id: int, offset: int) -> int:
        """Delete the stream's records at and above ``offset`` (a replica's
        excess past a sealed end, never acknowledged); a chunk that straddles
        ``offset`` keeps its batches below it. Returns the batches dropped."""
        self.write_appends()
        self._drop_producers_from(stream_id, offset)
        cursor = self.txn.cursor(db=self._index)
        doomed: list[tuple[int, IndexEntry]] = []
        if layout.seek_floor(cursor, batch_key(stream_id, offset)):
            for key, value in cursor:
                key_stream, base_offset = BATCH_KEY.unpack(key)
                if key_stream != stream_id:
                    break
                entry = layout.decode_index(value)
                if base_offset + entry.record_count > offset:
                    doomed.append((base_offset, entry))
        dropped = 0
        for base_offset, entry in doomed:
            key = batch_key(stream_id, base_offset)
            kept = self._batches_below(key, base_offset, offset) if base_offset < offset else None
            self.txn.delete(key, db=self._batches)
            self.txn.delete(key, db=self._index)
            self.stored_bytes -= entry.size
            self.stored_batches -= entry.batches
            dropped += entry.batches
            if kept is not None and kept[2]:
                value, count, batches = kept
                self.txn.put(key, value, db=self._batches)
                self.txn.put(
                    key,
                    layout.encode_index(
                        IndexEntry(entry.append_time_ms, count, len(value), batches)
                    ),
                    db=self._index,
                )
                self.stored_bytes += len(value)
                self.stored_batches += batches
                dropped -= batches
        return dropped

    def _batches_below(self, key: bytes, base_offset: int, offset: int) -> tuple[bytes, int, int]:
        """The leading batches of the chunk at ``key`` that end at or below
        ``offset``: their bytes, record count and number."""
        value = bytes(self.txn.get(key, db=self._batches))
        position = base_offset
        cut = 0
        batches = 0
        for start, end in batch_spans(value):
            count = peek_header(value, start).span
            if position + count > offset:
                break
            position += count
            cut = end
            batches += 1
        return value[:cut], position - base_offset, batches

    def write_appends(self) -> None:
        """Write the appends gathered so far, one chunk per stream."""
        # in key order, so that as many puts as possible can use MDB_APPEND
        for stream_id in sorted(self._chunks):
            self._write_chunk(stream_id, self._chunks[stream_id])
        self._chunks.clear()
        self._unwritten_pages = 0

    def replace_chunk(
        self,
        stream_id: int,
        base_offset: int,
        old_size: int,
        value: bytes | bytearray,
        batches: int,
    ) -> int:
        """Put ``value`` in place of the stream's chunk at ``base_offset``
        (compacted: the same offsets, fewer bytes), keeping its index entry's
        append time and span; skipped (0) when the stored chunk is no longer
        ``old_size`` bytes. The bytes freed."""
        key = batch_key(stream_id, base_offset)
        stored = self.txn.get(key, db=self._index)
        if stored is None:
            return 0
        entry = layout.decode_index(bytes(stored))
        if entry.size != old_size:
            return 0
        self.txn.put(key, bytes(value), db=self._batches)
        self.txn.put(
            key,
            layout.encode_index(entry._replace(size=len(value), batches=batches)),
            db=self._index,
        )
        self.stored_bytes -= old_size - len(value)
        self.stored_batches -= entry.batches - batches
        return old_size - len(value)

    def _write_chunk(self, stream_id: int, chunk: _Chunk) -> None:
        key = BATCH_KEY.pack(stream_id, chunk.base_offset)
        # MDB_APPEND skips the search when the key sorts after every stored key
        at_end = key > self.last_batch_key
        # The batches go in as received (base_offset still -1), a lone batch
        # without a copy: LMDB copies the caller's buffer straight into its
        # pages. Reads stamp the base offsets into the copy they return.
        batches = chunk.batches
        value = batches[0] if len(batches) == 1 else b"".join(batches)
        entry = IndexEntry(self.now_ms, chunk.record_count, chunk.size, len(batches))
        self.txn.put(key, value, db=self._batches, append=at_end)
        self.txn.put(key, layout.encode_index(entry), db=self._index, append=at_end)
        if at_end:
            self.last_batch_key = key

    def after_command(self) -> None:
        """Forget what a command may have changed: the ranges appends go to (a
        seal, sync or delete), and the pages in use (a trim frees some)."""
        self._append_targets.clear()
        self.used_pages = None

    def _reserve(self, batch_size: int) -> None:
        needed = self.store.estimate_pages(batch_size)
        limit = self.store.append_limit_pages
        if self.used_pages is None or (self.used_pages + needed > limit and not self._counted):
            self.used_pages = self.store.pages_in_use(self.txn) + self._unwritten_pages
            self._counted = True
        if self.used_pages + needed > limit and self.unfreed:
            # room is short: free every dropped chunk now, not a little at a time
            self.free_dropped(None)
            self.used_pages = self.store.pages_in_use(self.txn) + self._unwritten_pages
        if self.used_pages + needed > limit:
            raise StorageFullError(
                f"storage full: {self.used_pages * self.store.page_size} bytes in use of "
                f"{self.store.map_size}; a {batch_size}-byte batch does not fit"
            )
        self.used_pages += needed
        self._unwritten_pages += needed
        self._stored_here += batch_size

    def index_entries(self, stream_id: int) -> Iterable[tuple[int, IndexEntry]]:
        """(base_offset, index entry) of the stream's chunks, in order."""
        cursor = self.txn.cursor(db=self._index)
        if not cursor.set_range(batch_key(stream_id, 0)):
            return
        for key, value in cursor:
            key_stream, base_offset = BATCH_KEY.unpack(key)
            if key_stream != stream_id:
                return
            yield base_offset, layout.decode_index(value)

    def _forgotten_below(self, stream_id: int) -> int:
        """The stream's chunks that end at or below this offset no longer
        count as stored: a trim forgot them (``forget_chunks``)."""
        state = self.current(stream_id)
        return 0 if state is None else state.first_offset

    def _uncount(self, entry: IndexEntry) -> None:
        self.stored_bytes -= entry.size
        self.stored_batches -= entry.batches

    def _delete_chunk(self, stream_id: int, base_offset: int, record_count: int) -> None:
        key = batch_key(stream_id, base_offset)
        self.txn.delete(key, db=self._batches)
        self.txn.delete(key, db=self._index)
        self._delete_stamps(stream_id, base_offset, base_offset + record_count)

    def _mark_unfreed(self, stream_id: int, unfreed: bool) -> None:
        """Add the stream to, or take it from, the streams with chunks to free
        (copied first: the store's set changes only when this one commits)."""
        if (stream_id in self.unfreed) == unfreed:
            return
        if self.unfreed is self.store.unfreed:
            self.unfreed = set(self.unfreed)
        if unfreed:
            self.unfreed.add(stream_id)
        else:
            self.unfreed.discard(stream_id)

    def forget_chunks(self, stream_id: int, below: int | None = None) -> None:
        """Stop counting as stored the stream's chunks wholly below ``below``
        (all of them with None), and leave them to ``free_dropped``. Call it
        before the stream's first offset moves: the chunks wholly below that
        offset were forgotten when it moved there."""
        forgotten_below = self._forgotten_below(stream_id)
        queued = False
        for base_offset, entry in self.index_entries(stream_id):
            end = base_offset + entry.record_count
            if below is not None and end > below:
                break
            queued = True
            if end > forgotten_below:
                self._uncount(entry)
        if queued:
            self._mark_unfreed(stream_id, True)

    def drop_span(self, stream_id: int, start: int, end: int) -> int:
        """Delete now the stream's chunks wholly within ``[start, end)``: a
        range this node no longer holds (moved to other nodes, SPEC §12). A
        chunk that straddles either end stays. Returns the bytes freed."""
        cursor = self.txn.cursor(db=self._index)
        doomed: list[tuple[int, IndexEntry]] = []
        if cursor.set_range(batch_key(stream_id, start)):
            for key, value in cursor:
                key_stream, base_offset = BATCH_KEY.unpack(key)
                if key_stream != stream_id or base_offset >= end:
                    break
                entry = layout.decode_index(value)
                if base_offset + entry.record_count <= end:
                    doomed.append((base_offset, entry))
        forgotten_below = self._forgotten_below(stream_id)
        freed = 0
        for base_offset, entry in doomed:  # not while the cursor walks the index
            self._delete_chunk(stream_id, base_offset, entry.record_count)
            if base_offset + entry.record_count > forgotten_below:
                self._uncount(entry)
                freed += entry.size
        return freed

    def drop_chunks(self, stream_id: int) -> None:
        """Delete every chunk of the stream now (the PM forgot it here)."""
        self.drop_producers(stream_id)
        forgotten_below = self._forgotten_below(stream_id)
        doomed = list(self.index_entries(stream_id))
        for base_offset, entry in doomed:  # not while the cursor walks the index
            self._delete_chunk(stream_id, base_offset, entry.record_count)
            if base_offset + entry.record_count > forgotten_below:
                self._uncount(entry)

    def free_dropped(self, budget_bytes: int | None) -> None:
        """Free chunks that no longer count as stored (``forget_chunks``)
        until about ``budget_bytes`` of them are gone (all of them with None).

        A deletion or a trim does not free its chunks at once. LMDB reuses
        freed pages through an in-memory list that it searches for a run of
        contiguous pages on every large allocation; a gigabyte freed in one
        transaction made that search, once appends had used up the big runs,
        take the writer's core for 40-90 ms stalls and then 2-3 ms per commit
        (docs/benchmarks.md, Write latency). Freed no faster than appends
        reuse the pages, about as much as each transaction stores, it did not.

        The streams take turns, one oldest chunk each, from the stream after
        the one the last transaction freed from. Chunks written together
        (the appends of many streams in one group commit) are neighbours in
        the file and so come free together, in runs a large append can use.
        Freed a stream at a time, 100 deleted streams left their pages
        scattered, and LMDB searched and merged its free list on every commit
        for want of a long run (docs/benchmarks.md, Suite).
        """
        turns = sorted(self.unfreed)
        first = bisect.bisect_right(turns, self.free_after)
        turns = turns[first:] + turns[:first]
        while turns:
            waiting: list[int] = []
            for stream_id in turns:
                if budget_bytes is not None and budget_bytes <= 0:
                    return
                freed = self._free_oldest(stream_id)
                if freed is None:
                    self._mark_unfreed(stream_id, False)
                    continue
                self.free_after = stream_id
                if budget_bytes is not None:
                    budget_bytes -= freed
                waiting.append(stream_id)
            turns = waiting

    def _free_oldest(self, stream_id: int) -> int | None:
        """Free the stream's oldest chunk if it no longer counts as stored;
        its size, or None when the stream has no such chunk left."""
        # the cursor is gone once next() returns: deleting is safe
        oldest = next(iter(self.index_entries(stream_id)), None)
        if oldest is None:
            return None
        base_offset, entry = oldest
        if not is_dropped(self.current(stream_id), base_offset + entry.record_count):
            return None
        self._delete_chunk(stream_id, base_offset, entry.record_count)
        return entry.size

    def publish(self) -> None:
        """Make this (committed) transaction's changes visible to readers."""
        store = self.store
        for stream_id, state in self.pending.items():
            if state is None:
                store.streams.pop(stream_id, None)
            else:
                store.streams[stream_id] = state
        store.last_batch_key = max(store.last_batch_key, self.last_batch_key)
        store.stored_bytes = self.stored_bytes
        store.stored_batches = self.stored_batches
        store.used_pages_bound = self.used_pages
        store.unfreed = self.unfreed
        store.free_after = self.free_after
        for stream_id in self._producers:
            table = self.producer_table(stream_id)
            if table:
                store.producers[stream_id] = table
            else:
                store.producers.pop(stream_id, None)

    def finish(self) -> None:
        """Write what the transaction still holds: the appends and the counters."""
        self.write_appends()
        self._write_producers()
        if self.unfreed and self._stored_here:
            self.free_dropped(self._stored_here)
        meta = self.store.dbs[layout.META_DB]
        if self.stored_bytes != self.store.stored_bytes:
            self.txn.put(layout.STORED_BYTES_KEY, layout.COUNTER.pack(self.stored_bytes), db=meta)
        if self.stored_batches != self.store.stored_batches:
            self.txn.put(
                layout.STORED_BATCHES_KEY, layout.COUNTER.pack(self.stored_batches), db=meta
            )


def producers_whole(producers_from: int, start: int, held_end: Callable[[int, int], int]) -> bool:
    """Whether a table kept from ``producers_from`` is whole as of ``start``,
    given how far from an offset this node holds the stream without a gap."""
    if producers_from < 0 or producers_from > start:
        return False
    return producers_from == start or held_end(producers_from, start) == start


def is_dropped(state: StreamState | None, chunk_end: int) -> bool:
    """Whether a chunk of the stream that ends at ``chunk_end`` was dropped:
    every chunk of a deleted (or forgotten) stream, and a live stream's
    chunks wholly below its first offset."""
    return state is None or state.deleted or chunk_end <= state.first_offset
