"""The storage commands other than appends: each runs inside the writer's
transaction (``transaction.WriteContext``), in submission order, through a
named operation of ``StorageEngine``; nothing outside ``storage`` calls them.

Each checks everything that can refuse it before its first write: a
``ProtocolError`` raised here means "nothing was written".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from sbp.batch_v2 import gap_marker
from sbp.constants import OPEN_END_OFFSET
from sbp.errors import (
    EpochFencedError,
    InvalidRequestError,
    OutOfOrderError,
    RangeNotFoundError,
    RangeSealedError,
    StreamDeletedError,
)

from . import layout, replica_transitions
from .compaction import ChunkRewrite
from .layout import stream_key
from .model import Expired, RangeInfo, ReplicaBatch, StreamState, hosts
from .producers import check_stamp
from .transaction import ProducerTable, WriteContext


def _live_stream(ctx: WriteContext, stream_id: int) -> StreamState:
    state = ctx.for_update(stream_id)
    if state.deleted:
        raise StreamDeletedError(f"stream {stream_id} is deleted")
    return state


def raise_pm_term(ctx: WriteContext, term: int) -> int:
    """Record ``term`` as the highest PM term seen, unless a higher one is
    recorded; the highest, after."""
    meta = ctx.store.dbs[layout.META_DB]
    stored = ctx.txn.get(layout.PM_TERM_KEY, db=meta)
    highest = max(term, layout.COUNTER.unpack(stored)[0] if stored else 0)
    ctx.txn.put(layout.PM_TERM_KEY, layout.COUNTER.pack(highest), db=meta)
    return highest


def seal_range(ctx: WriteContext, stream_id: int, range_index: int) -> RangeInfo:
    """Seal a range at the stream's next offset; a sealed range is returned as is."""
    state = _live_stream(ctx, stream_id)
    info = state.find_range(range_index)
    sealed = replica_transitions.seal_here(info, state.next_offset)
    if sealed is info:
        return state.live(info)
    state.ranges = tuple(sealed if r is info else r for r in state.ranges)
    ctx.save_range(sealed)
    return state.live(sealed)


def replicate(ctx: WriteContext, item: ReplicaBatch) -> int:
    """A follower's side of REPLICATE: store the batch if it is the range's
    next one; returns this replica's next offset of the range afterwards.

    The range must be open here with the same epoch (``replica_position``).
    A batch already held is accepted again without a change (a resend); one
    past the next offset is OutOfOrderError carrying the next offset to
    resend from.
    """
    if item.producer is not None:
        check_stamp(item.producer)
    current = ctx.current(item.stream_id)
    next_offset = replica_position(current, item, ctx.store.node_id)
    if item.record_count == 0 or item.base_offset + item.record_count <= next_offset:
        return next_offset
    if item.base_offset != next_offset:
        raise OutOfOrderError(
            f"range {item.range_index} of stream {item.stream_id} continues at {next_offset} "
            f"here, not {item.base_offset}",
            next_offset=next_offset,
        )
    state = ctx.for_update(item.stream_id)
    ctx.add_batch(state, item.base_offset, item.batch, item.record_count, producer=item.producer)
    return item.base_offset + item.record_count


def replica_position(state: StreamState | None, item: ReplicaBatch, node_id: int | None) -> int:
    """This replica's next offset of the item's range, or the error refusing
    REPLICATE there: the range must be hosted here and open
    (RangeSealedError), with the item's epoch (EpochFencedError for an older
    one, RangeNotFoundError for a newer one: this node's view is behind)."""
    info = _replica_range(state, item.stream_id, item.range_index, node_id)
    if not info.is_open:
        raise RangeSealedError(
            f"range {info.range_index} of stream {item.stream_id} is sealed at {info.end_offset}"
        )
    if item.epoch != info.epoch:
        error = EpochFencedError if item.epoch < info.epoch else RangeNotFoundError
        raise error(
            f"range {info.range_index} of stream {item.stream_id} is at epoch {info.epoch} "
            f"here, REPLICATE names {item.epoch}"
        )
    assert state is not None
    return max(state.next_offset, info.start_offset)


def catch_up(
    ctx: WriteContext,
    items: Sequence[ReplicaBatch],
    covered_to: int = 0,
    where: tuple[int, int] | None = None,
) -> int:
    """Catch-up: store batches of a sealed range this replica is short of,
    copied from a replica that holds them, in offset order from where this
    one's records stop. Returns how far the range is held afterwards.
    Batches already held are skipped. The holder serves its batches without
    a gap of its own, so offsets it skips were emptied by compaction (SPEC
    §13): a gap marker keeps them here too, as up to ``covered_to`` when it
    answered that nothing is left below it (``where``: the stream and range
    then, without items)."""
    if items:
        stream_id, range_index = items[0].stream_id, items[0].range_index
    elif where is not None:
        stream_id, range_index = where
    else:
        raise InvalidRequestError("nothing to catch up")
    state = ctx.current(stream_id)
    info = _replica_range(state, stream_id, range_index, ctx.store.node_id)
    assert state is not None
    if info.is_open:
        raise InvalidRequestError(
            f"range {info.range_index} of stream {stream_id} is open: it is replicated"
        )
    start = max(info.start_offset, state.first_offset)
    held = ctx.held_end(stream_id, start, info.end_offset)
    state = ctx.for_update(stream_id)
    for item in items:
        item_end = item.base_offset + item.record_count
        if item_end <= held:
            continue
        # A trim may have cut the range's first batch: every replica keeps
        # it whole (reads return whole batches), and so does this one.
        cut_by_trim = held == start and item.base_offset < held
        if item_end > info.end_offset:
            break
        if item.base_offset > held:  # emptied by compaction where it was copied from
            ctx.add_batch(
                state,
                held,
                gap_marker(item.base_offset - held),
                item.base_offset - held,
                advance=False,
            )
        elif item.base_offset != held and not cut_by_trim:
            break
        ctx.add_batch(state, item.base_offset, item.batch, item.record_count, advance=False)
        if 0 <= state.producers_from <= held:
            # copied without its producer's fields: the table is not whole
            # past here until it is taken in from a replica (SPEC §10)
            state.producers_from = -1
            ctx.refresh_producers_ready(state)
            ctx.save_stream(state)
        held = item_end
    end = min(covered_to, info.end_offset)
    if end > held:
        ctx.add_batch(state, held, gap_marker(end - held), end - held, advance=False)
        held = end
    return held


def take_in_producers(
    ctx: WriteContext, stream_id: int, as_of: int, inherited: ProducerTable | None
) -> bool:
    """Take in the stream's producer state as of ``as_of`` (the open range's
    start) from another replica, or go on without it (None); whether the
    primary may now decide idempotent appends."""
    state = _live_stream(ctx, stream_id)
    ctx.take_in_producers(state, as_of, inherited)
    return state.producers_ready


def _replica_range(
    state: StreamState | None, stream_id: int, range_index: int, node_id: int | None
) -> RangeInfo:
    if state is None:
        raise RangeNotFoundError(f"stream {stream_id} is unknown here")
    if state.deleted:
        raise StreamDeletedError(f"stream {stream_id} is deleted")
    info = state.find_range(range_index)
    if not hosts(info, node_id):
        raise RangeNotFoundError(
            f"range {range_index} of stream {stream_id} is not hosted on this node"
        )
    return info


def trim_stream(ctx: WriteContext, stream_id: int, trim_offset: int) -> int:
    """Drop the batches wholly below ``trim_offset`` (capped at the next offset;
    later transactions free their chunks) and the sealed ranges that end at or
    below it; returns the new first offset."""
    state = _live_stream(ctx, stream_id)
    trim_offset = min(trim_offset, state.next_offset)
    if trim_offset <= state.first_offset:
        return state.first_offset
    ctx.forget_chunks(stream_id, trim_offset)
    kept = tuple(r for r in state.ranges if not (not r.is_open and r.end_offset <= trim_offset))
    for info in state.ranges:
        if info not in kept:
            ctx.delete_range(info)
    state.ranges = kept
    state.first_offset = trim_offset
    ctx.save_stream(state)
    return trim_offset


def expire_stream(ctx: WriteContext, stream_id: int) -> Expired | None:
    """Apply the stream's retention period: drop the batches appended more
    than that long ago. None when nothing was old enough."""
    state = ctx.current(stream_id)
    if state is None or state.deleted or state.retention_period_ms <= 0:
        return None
    cutoff = ctx.now_ms - state.retention_period_ms
    expired_end: int | None = None
    for base_offset, entry in ctx.index_entries(stream_id):
        # append times never decrease along a stream (the writer's clock is monotonic)
        if entry.append_time_ms >= cutoff:
            break
        expired_end = base_offset + entry.record_count
    if expired_end is None or expired_end <= state.first_offset:
        return None
    bytes_before = ctx.stored_bytes
    first_offset = trim_stream(ctx, stream_id, expired_end)
    return Expired(stream_id, state.first_offset, first_offset, bytes_before - ctx.stored_bytes)


def expire_streams(ctx: WriteContext, stream_ids: Iterable[int] | None = None) -> list[Expired]:
    """``expire_stream`` for the given streams (every stream by default)."""
    ids = list(ctx.store.streams) if stream_ids is None else list(stream_ids)
    return [done for sid in ids if (done := expire_stream(ctx, sid)) is not None]


def set_retentions(ctx: WriteContext, periods: dict[int, int]) -> None:
    """Record each live stream's retention period (ms, 0 keeps forever); streams
    not hosted here or deleted are skipped."""
    for stream_id, period in periods.items():
        state = ctx.current(stream_id)
        if state is None or state.deleted or state.retention_period_ms == max(0, period):
            continue
        set_retention(ctx, stream_id, period)


def set_retention(ctx: WriteContext, stream_id: int, retention_period_ms: int) -> None:
    state = _live_stream(ctx, stream_id)
    state.retention_period_ms = max(0, retention_period_ms)
    ctx.save_stream(state)


def delete_stream(ctx: WriteContext, stream_id: int) -> None:
    """Mark the stream deleted (appends and reads refused from now on); its
    data no longer counts as stored, and later transactions free its chunks
    (``WriteContext.free_dropped``).

    Idempotent; a stream never seen here is recorded as deleted too.
    """
    state = ctx.current(stream_id)
    if state is not None and state.deleted:
        return
    state = StreamState(stream_id) if state is None else state.copy()
    ctx.pending[stream_id] = state
    ctx.forget_chunks(stream_id)
    ctx.drop_producers(stream_id)
    state.ranges = tuple(dataclasses.replace(r, deleted=True) for r in state.ranges)
    for info in state.ranges:
        ctx.save_range(info)
    state.deleted = True
    ctx.save_stream(state)


def learn_ranges(ctx: WriteContext, stream_id: int, ranges: list[RangeInfo]) -> list[RangeInfo]:
    """Apply a view of a stream's ranges that this node asked the PM for
    (LIST_RANGES), unless it may be older than the view held here.

    SYNC_RANGES of one stream reach the node in the order the PM committed
    them; an answer to a lookup has no place in that order, and applied
    after a newer SYNC_RANGES it would take the node off a range it was
    just placed on and drop what it held of it. A view is certainly newer
    when the stream is unknown here or the view has a range above every one
    known here: ranges are only ever added at the top, so every later view
    has that range too. Any other view is left alone, and the live ranges
    held here are returned: what the lookup was for comes with the PM's
    SYNC_RANGES.
    """
    existing = ctx.current(stream_id)
    if existing is not None and existing.ranges and not existing.deleted:
        top = existing.ranges[-1].range_index  # sorted by index
        if all(r.range_index <= top for r in ranges):
            return [existing.live(r) for r in existing.ranges]
    return sync_ranges(ctx, stream_id, ranges)


def sync_ranges(
    ctx: WriteContext, stream_id: int, ranges: list[RangeInfo], cleanup_policy: int | None = None
) -> list[RangeInfo]:
    """Apply the PM's view of a stream's ranges; returns them with live next offsets.

    Ranges missing from ``ranges`` are forgotten; data below the first range's
    start offset is dropped (the PM trimmed it). A range sealed here stays
    sealed even if an older view still shows it open: sealing is one-way. An
    empty list forgets the stream and its data.
    """
    incoming = sorted(ranges, key=lambda r: r.range_index)
    indexes = [r.range_index for r in incoming]
    if len(set(indexes)) != len(indexes) or any(r.stream_id != stream_id for r in incoming):
        raise InvalidRequestError(f"inconsistent ranges for stream {stream_id}: {indexes}")
    if any(not r.is_open and r.end_offset < r.start_offset for r in incoming):
        raise InvalidRequestError(f"a range of stream {stream_id} ends before it starts")
    existing = ctx.current(stream_id)
    if existing is not None and existing.deleted:
        raise StreamDeletedError(f"stream {stream_id} is deleted")
    state = StreamState(stream_id) if existing is None else existing.copy()
    ctx.pending[stream_id] = state
    known = {r.range_index: r for r in state.ranges}
    if cleanup_policy is not None:
        state.cleanup_policy = cleanup_policy

    if not incoming:
        ctx.drop_chunks(stream_id)
        for info in state.ranges:
            ctx.delete_range(info)
        ctx.txn.delete(stream_key(stream_id), db=ctx.store.dbs[layout.STREAMS_DB])
        ctx.pending[stream_id] = None
        return []

    merged: list[RangeInfo] = []
    #: where a range sealed by the PM ends below what this replica holds of it
    excess_from: int | None = None
    moved_off: list[RangeInfo] = []
    node_id = ctx.store.node_id
    for incoming_info in incoming:
        local = known.get(incoming_info.range_index)
        synced = replica_transitions.sync_range(local, incoming_info, state.next_offset, node_id)
        info = synced.info
        if synced.excess_from is not None:
            excess_from = synced.excess_from
        if synced.moved_off:
            moved_off.append(info)
        merged.append(info)
        if info != local:
            ctx.save_range(info)
    for index, info in known.items():
        if index not in indexes:
            ctx.delete_range(info)
    for info in moved_off:
        ctx.drop_span(stream_id, max(info.start_offset, state.first_offset), info.end_offset)

    first_start = merged[0].start_offset
    if existing is None:
        state.first_offset = first_start
        # a stream first heard of at its open first range holds no batch
        # anywhere yet; else the ranges before were written elsewhere
        state.producers_from = first_start if merged[0].is_open else -1
    elif first_start > state.first_offset:
        ctx.forget_chunks(stream_id, first_start)
        state.first_offset = first_start
    if excess_from is not None and state.next_offset > excess_from:
        # SPEC §7: records past a sealed end were never acknowledged and are
        # never served; the next range starts at that end.
        ctx.drop_from(stream_id, excess_from)
        state.next_offset = excess_from
        state.producers_from = min(state.producers_from, excess_from)
    last = merged[-1]
    floor = last.start_offset if last.end_offset == OPEN_END_OFFSET else last.end_offset
    state.next_offset = max(state.next_offset, state.first_offset, floor)
    state.ranges = tuple(merged)
    ctx.refresh_producers_ready(state)
    ctx.save_stream(state)
    return [state.live(r) for r in merged]


def apply_compaction(ctx: WriteContext, stream_id: int, rewrites: list[ChunkRewrite]) -> int:
    """Put compacted chunks in place of the ones they were made from (SPEC
    §13), in this one transaction; one whose stored size changed meanwhile
    is skipped. The bytes freed."""
    freed = 0
    for rewrite in rewrites:
        assert rewrite.value is not None
        freed += ctx.replace_chunk(
            stream_id, rewrite.base_offset, rewrite.old_size, rewrite.value, rewrite.batches
        )
    return freed
