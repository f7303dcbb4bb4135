"""What the engine knows about streams and ranges, and the rules that follow.

``StreamState`` answers "which range does this append go to" and "which range
serves a read at this offset" (SPEC §5, data node), raising the wire error for
each refusal. Published states are never mutated: the writer copies a state,
changes the copy inside its transaction and publishes it after the commit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from sbp.batches import Buffer
from sbp.constants import OPEN_END_OFFSET
from sbp.errors import (
    NotPrimaryError,
    OffsetOutOfRangeError,
    ProtocolError,
    RangeNotFoundError,
    RangeSealedError,
    StreamDeletedError,
)
from sbp.producer_stamp import ProducerStamp
from sbp.ranges import RangeSpan
from sbp.stats import BucketCounts


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """A data node holding a copy of a range."""

    node_id: int
    address: str
    is_primary: bool


@dataclass(frozen=True, slots=True)
class RangeInfo(RangeSpan):
    """One range of a stream: ``[start_offset, end_offset)``, open while end is -1.

    ``next_offset`` is a snapshot the engine fills in when it returns a range
    (the live next offset of an open range, the end offset of a sealed one).
    """

    stream_id: int
    range_index: int
    start_offset: int
    end_offset: int = OPEN_END_OFFSET
    epoch: int = 0
    replicas: tuple[ReplicaInfo, ...] = ()
    deleted: bool = False
    next_offset: int = 0
    #: sealed by a SEAL_RANGES to this node, at what it held, and not yet told
    #: where the PM ended it: with followers, records past the PM's end (which
    #: may be lower) were never acknowledged, so they are not served meanwhile
    sealed_here: bool = False
    #: 0 on the data nodes only, 1 also in the object store, 2 there only
    #: (SPEC §14): a range in state 2 is read from the store
    object_state: int = 0

    @property
    def end_is_final(self) -> bool:
        """Sealed where the PM sealed it: every record below the end belongs
        to the stream (SPEC §7)."""
        return not self.is_open and not self.sealed_here

    @property
    def primary_node_id(self) -> int | None:
        return next((r.node_id for r in self.replicas if r.is_primary), None)


class StreamRecord(NamedTuple):
    """The persisted per-stream facts that are not derived from ranges or batches."""

    first_offset: int
    deleted: bool
    retention_period_ms: int
    #: ``StreamState.producers_from``; None in records written before it existed
    producers_from: int | None = None
    cleanup_policy: int = 0
    keyless_below: int = 0


@dataclass(slots=True)
class StreamState:
    """A stream as this node sees it. ``next_offset`` is the next offset to assign."""

    stream_id: int
    first_offset: int = 0
    next_offset: int = 0
    deleted: bool = False
    retention_period_ms: int = 0
    #: sorted by range_index; every range of the stream the PM told this node about
    ranges: tuple[RangeInfo, ...] = ()
    #: the producer table (SPEC §10) holds every idempotent batch of the
    #: stream below this offset, and every batch stored here at or above it
    #: came with its producer's fields (by APPEND or REPLICATE, not by
    #: catch-up); -1: not known to be whole anywhere
    producers_from: int = 0
    #: whether the table is whole as of the open range's start, so that its
    #: primary may decide idempotent appends (derived, not stored)
    producers_ready: bool = True
    #: the stream's cleanup policy as the PM last said it (SPEC §13): 1 and 2
    #: compact it, and an append of a record without a key is refused
    cleanup_policy: int = 0
    #: the offset after the last batch stored here holding a record without a
    #: key (0: none); turning compaction on needs it below the first offset
    keyless_below: int = 0

    def copy(self) -> StreamState:
        return dataclasses.replace(self)

    def record(self) -> StreamRecord:
        return StreamRecord(
            self.first_offset,
            self.deleted,
            self.retention_period_ms,
            self.producers_from,
            self.cleanup_policy,
            self.keyless_below,
        )

    def live(self, info: RangeInfo) -> RangeInfo:
        """``info`` with its next_offset filled in."""
        next_offset = (
            info.end_offset if not info.is_open else max(self.next_offset, info.start_offset)
        )
        return dataclasses.replace(info, next_offset=next_offset)

    def find_range(self, range_index: int) -> RangeInfo:
        for info in self.ranges:
            if info.range_index == range_index:
                return info
        raise RangeNotFoundError(f"stream {self.stream_id} has no range {range_index} here")

    def append_range(self, node_id: int | None) -> RangeInfo:
        """The range an append to this stream goes to, or the wire error refusing it.

        ``node_id`` None means this engine hosts and leads every range (tests, tools).
        """
        if self.deleted:
            raise StreamDeletedError(f"stream {self.stream_id} is deleted")
        if not self.ranges:
            raise RangeNotFoundError(f"stream {self.stream_id} has no range here")
        last = self.ranges[-1]
        if not last.is_open:
            raise RangeSealedError(
                f"range {last.range_index} of stream {self.stream_id} is sealed "
                f"at {last.end_offset}"
            )
        if not hosts(last, node_id):
            # the open range lives elsewhere; any range here is an earlier, sealed one
            if any(hosts(info, node_id) for info in self.ranges):
                raise RangeSealedError(
                    f"stream {self.stream_id} is open in range {last.range_index}, "
                    "which this node does not host"
                )
            raise RangeNotFoundError(f"stream {self.stream_id} has no range on this node")
        if node_id is not None and last.primary_node_id != node_id:
            raise NotPrimaryError(
                f"node {node_id} is not the primary of range {last.range_index} "
                f"of stream {self.stream_id} (primary: {last.primary_node_id})"
            )
        return last

    def read_range(self, offset: int, node_id: int | None) -> RangeInfo | None:
        """The hosted range a read at ``offset`` is served from, None at the open tail.

        Raises the wire error of SPEC §5 (FETCH) when the read cannot be served here.
        """
        if self.deleted:
            raise StreamDeletedError(f"stream {self.stream_id} is deleted")
        if offset < self.first_offset or not self.ranges or offset < self.ranges[0].start_offset:
            raise OffsetOutOfRangeError(
                f"offset {offset} is below the first offset {self.first_offset} "
                f"of stream {self.stream_id}"
            )
        holder = next((r for r in self.ranges if r.holds(offset)), None)
        if holder is not None and hosts(holder, node_id):
            if not holder.is_open:
                return holder
            if offset > self.next_offset:
                raise OffsetOutOfRangeError(
                    f"offset {offset} is above the next offset {self.next_offset} "
                    f"of stream {self.stream_id}"
                )
            return None if offset == self.next_offset else holder
        if any(not r.is_open and r.end_offset == offset and hosts(r, node_id) for r in self.ranges):
            raise RangeSealedError(
                f"offset {offset} is the end of a sealed range of stream {self.stream_id}; "
                "read on in the next range"
            )
        if holder is None:
            raise OffsetOutOfRangeError(
                f"offset {offset} is beyond the ranges of stream {self.stream_id}"
            )
        raise RangeNotFoundError(
            f"offset {offset} of stream {self.stream_id} is in range {holder.range_index}, "
            "which this node does not host"
        )


def hosts(info: RangeInfo, node_id: int | None) -> bool:
    """Whether the node ``node_id`` holds a replica of ``info`` (None: every range)."""
    return node_id is None or any(r.node_id == node_id for r in info.replicas)


@dataclass(frozen=True, slots=True)
class ReplicaBatch:
    """A batch the range's primary stored, with its offsets (SPEC §7);
    ``record_count`` is the offsets it covers (its span: its records, unless
    compaction removed some); 0 and an empty batch: nothing to store (the
    primary only sent its commit offset)."""

    stream_id: int
    range_index: int
    epoch: int
    base_offset: int
    batch: Buffer
    record_count: int
    #: an idempotent producer's fields, as the APPEND carried them (SPEC §10)
    producer: ProducerStamp | None = None


@dataclass(frozen=True, slots=True)
class Expired:
    """What retention freed in one stream: the first offset before and after,
    and the stored bytes (batch values and headers) that went."""

    stream_id: int
    old_first_offset: int
    first_offset: int
    freed_bytes: int

    @property
    def freed_records(self) -> int:
        return self.first_offset - self.old_first_offset


class AppendItem(NamedTuple):
    """One batch to append: a whole, single record batch (SPEC §4), and the
    fields of an idempotent producer, if one sent it (SPEC §10)."""

    stream_id: int
    batch: Buffer
    producer: ProducerStamp | None = None


@dataclass(frozen=True, slots=True)
class AppendResult:
    """A durable append: the batch covers offsets base_offset .. +record_count-1
    (its span: as producers write batches, one offset per record)."""

    base_offset: int
    record_count: int
    append_time_ms: int
    #: an idempotent producer's resend: stored before at ``base_offset``,
    #: nothing written now
    duplicate: bool = False


#: one per submitted item: the result, or the error that item failed with
AppendOutcome = AppendResult | ProtocolError


#: upper bounds of the commit-latency buckets, seconds: from a fast device's fsync to a slow disk's
COMMIT_SECONDS_BOUNDS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
#: upper bounds of the group-size buckets, appends per group commit
GROUP_SIZE_BOUNDS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True, slots=True)
class StorageStats:
    """A snapshot of the engine's counters, for metrics.

    Counters ending in ``_total`` only grow; rates come from differences.
    """

    stored_bytes: int
    stored_batches: int
    map_size: int
    used_bytes: int
    file_bytes: int
    #: what appends may still take of the map (LMDB keeps a reserve of its own)
    append_room_bytes: int
    commits_total: int
    commit_seconds_total: float
    last_commit_seconds: float
    appends_total: int
    last_group_size: int
    max_group_size: int
    appends_waiting: int
    appends_in_commit: int
    streams: int
    ranges: int
    #: streams with dropped chunks (deleted, or trimmed away) that later
    #: appends have not all freed yet
    streams_freeing: int
    #: (stream, idempotent producer) states kept (SPEC §10)
    producers: int
    #: whole group commits: writing the group and committing it
    commit_seconds: BucketCounts
    #: the commit call alone: with sync ``always`` the fsyncs, the durability point
    sync_seconds: BucketCounts
    #: appends per group commit
    group_sizes: BucketCounts
