"""The placement manager's own view of its metadata: plain frozen records.

The wire messages (``sbp.messages``) describe a range with full ``DataNode``
tables; the PM stores and reasons about node ids only and resolves addresses
when it answers. Keeping these records separate lets the metadata store,
placement and the request logic be tested without any wire code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from sbp.constants import OPEN_END_OFFSET
from sbp.errors import ProtocolError
from sbp.ranges import RangeSpan

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T]):
    """The result of one item of a batch: a value, or the error of that item."""

    value: T | None = None
    error: ProtocolError | None = None


@dataclass(frozen=True, slots=True)
class StreamRecord:
    """A stream: ids start at 1; ``retention_period_ms`` 0 keeps forever;
    ``ack_nums`` 0 acknowledges once a majority of replicas hold a record;
    ``retention_bytes`` 0 sets no size limit (SPEC §12); the settings of
    compaction (§13), tiering (§14) and tables (§16) as SPEC §3 has them
    (``pm.stream_settings``)."""

    stream_id: int
    replica_nums: int
    retention_period_ms: int = 0
    epoch: int = 0
    ack_nums: int = 0
    retention_bytes: int = 0
    cleanup_policy: int = 0
    min_compaction_lag_ms: int = 0
    delete_retention_ms: int = 86_400_000
    local_retention_ms: int = -1
    table_interval_ms: int = -1


@dataclass(frozen=True, slots=True)
class ProducerRecord:
    """A named idempotent producer (SPEC §10): its id never changes, its
    epoch only grows. Unnamed producers have no record, only an id."""

    name: str
    producer_id: int
    epoch: int


@dataclass(frozen=True, slots=True)
class GroupOffsetRecord:
    """A consumer group's position on one stream (SPEC §11): ``offset`` is
    the next offset the group will read; ``commit_time_ms`` the PM's clock
    when it was committed."""

    group: str
    stream_id: int
    offset: int
    commit_time_ms: int
    metadata: str = ""


@dataclass(frozen=True, slots=True)
class MemberRecord:
    """A member of a consumer group (SPEC §15) as the metadata keeps it:
    its epoch, the streams it subscribes to, the streams it holds (it was
    told it may read them and has not let go of them yet), the streams its
    last answer gave it, and its session timeout. When it was last heard of
    is the leader's, in memory."""

    group: str
    member_id: str
    epoch: int
    session_timeout_ms: int
    subscribed: tuple[int, ...] = ()
    held: tuple[int, ...] = ()
    assigned: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RangeRecord(RangeSpan):
    """One range of a stream, ``[start_offset, end_offset)``.

    ``nodes`` are the replica node ids with the primary first; ``end_offset``
    is ``OPEN_END_OFFSET`` while the range is open (writable).
    ``replicas_wanted`` is set when the PM had to leave the range on fewer
    nodes than its stream's replica_nums (a degraded placement, or a full
    replica that left): it is under-replicated until ``nodes`` reach it again.
    """

    stream_id: int
    range_index: int
    start_offset: int
    nodes: tuple[int, ...]
    end_offset: int = OPEN_END_OFFSET
    epoch: int = 0
    replicas_wanted: int = 0
    #: 0 on the data nodes only, 1 also in the object store, 2 there only
    #: (SPEC §14; ``nodes`` is empty then)
    object_state: int = 0
    #: when the last batch of a copied range was appended (its object says)
    last_append_ms: int = 0
    #: the bytes of a copied range's batches in the object store
    object_bytes: int = 0

    @property
    def short_handed(self) -> bool:
        """Left on fewer nodes than its stream wanted (see ``replicas_wanted``)."""
        return len(self.nodes) < self.replicas_wanted

    @property
    def primary(self) -> int:
        return self.nodes[0]

    @property
    def key(self) -> tuple[int, int]:
        return (self.stream_id, self.range_index)


class MoveCause(enum.IntEnum):
    """Why a replica moves (``pm.moves``); stored with the move."""

    REBALANCE = 0
    DRAIN = 1
    REPAIR = 2
    TOP_UP = 3


@dataclass(frozen=True, slots=True)
class MoveRecord:
    """A sealed range's replica being moved (``pm.moves``): ``to_nodes``
    join its replicas and copy it, then ``from_node`` leaves them. Kept in
    the metadata from the commit that adds ``to_nodes`` (or, for a
    rebalance, from its plan) to the commit that drops ``from_node``."""

    stream_id: int
    range_index: int
    from_node: int
    to_nodes: tuple[int, ...]
    cause: MoveCause = MoveCause.REBALANCE

    @property
    def key(self) -> tuple[int, int]:
        return (self.stream_id, self.range_index)

    @property
    def to_node(self) -> int:
        """The first node it moves to (a rebalance moves to one)."""
        return self.to_nodes[0]


class Holding(NamedTuple):
    """What one replica holds of a range (RANGE_HOLDINGS)."""

    #: it holds every record from the range's (trimmed) start to here
    held_end: int
    #: record batch bytes of that
    size: int
    #: where to cut the range to drop the bytes asked (0: not asked)
    cut: int = 0
    #: the offset after the last batch the replica holds of the stream with a
    #: record without a key (0: none; SPEC §13)
    keyless_below: int = 0

    def covers(self, rng: RangeRecord) -> bool:
        """Whether the replica holds all of ``rng``, a sealed range."""
        return not rng.is_open and self.held_end >= rng.end_offset


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A data node as registered by its first HEARTBEAT."""

    node_id: int
    address: str
