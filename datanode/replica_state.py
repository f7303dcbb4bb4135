"""A range replica's lifecycle on this node (SPEC §7). Two modules hold
every rule: the transitions that change what storage holds (a seal, the
PM's view of a range, the fence after a failed commit) are the pure
functions of ``storage.replica_transitions``, which storage carries out in
the writer's transaction; everything else (a replica's state, its commit
offset, how far it may be read, when a range sealed here is settled, the
fence after a restart) is decided in this file. The handlers and the
replication code ask here.

States, from what storage holds and what this node has learned::

    LEADING     open, this node its primary: takes APPENDs, replicates them
    FOLLOWING   open, another node its primary: takes REPLICATE
    FENCED      open and led here, but takes no APPENDs: a commit failed
                after its batches went to the followers, or the node
                restarted while leading it (followers may hold offsets this
                node would hand out again)
    SEALED_HERE sealed by a SEAL_RANGES at what this replica held; the PM's
                end (maybe lower) is not known here yet
    SHORT       sealed where the PM sealed it, and this replica holds less
                than the end (catch-up copies the rest)
    WHOLE       sealed where the PM sealed it, and held in full

Transitions::

    (none)      --SYNC_RANGES (open)------------------> LEADING | FOLLOWING
    LEADING     --commit failed after hand-over-------> FENCED    (``fenced_by_failed_commit``)
    LEADING     --restart-----------------------------> FENCED    (``fence_after_restart``)
    LEADING, FOLLOWING, FENCED
                --SEAL_RANGES-------------------------> SEALED_HERE (``seal_here``)
    any         --SYNC_RANGES (sealed, end known)-----> SHORT | WHOLE (``sync_range``)
    SEALED_HERE --SETTLE_AFTER_S without the PM's end-> asks the PM to seal it
    SHORT       --catch-up copies the rest------------> WHOLE

Reads: a FETCH stops at the commit offset of the stream's first replicated
range whose end the PM has not fixed (LEADING, FOLLOWING, FENCED,
SEALED_HERE). Commit offsets are not persisted: after a restart a range's
commit offset is unknown until its primary (or, on the primary, the
followers' answers) says it, so a restart never serves a record a failure
could take back; meanwhile a FETCH of records the replica holds is refused
with NOT_PRIMARY (retriable, a reader tries another replica), never
answered as if the stream ended there.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from sbp.errors import NotPrimaryError, ProtocolError
from storage.engine import StorageEngine
from storage.model import RangeInfo

from .waiters import StreamWaiters

#: a range sealed here that the PM has not ended after this long is sealed
#: on the PM by this node (``Replicator``, asking ``ReplicaStates.due_to_settle``)
SETTLE_AFTER_S: Final = 3.0


class ReplicaState(enum.Enum):
    LEADING = "leading"
    FOLLOWING = "following"
    FENCED = "fenced"
    SEALED_HERE = "sealed here"
    SHORT = "short"
    WHOLE = "whole"


class CommitOffsets:
    """``(stream_id, range_index)`` -> commit offset; only ever moves up.
    Moving wakes the stream's waiting FETCHes."""

    def __init__(self, waiters: StreamWaiters) -> None:
        self._waiters = waiters
        self._offsets: dict[tuple[int, int], int] = {}

    def get(self, stream_id: int, range_index: int, default: int) -> int:
        return self._offsets.get((stream_id, range_index), default)

    def known(self, stream_id: int, range_index: int) -> bool:
        """Whether this node has learned the range's commit offset since it started."""
        return (stream_id, range_index) in self._offsets

    def advance(self, stream_id: int, range_index: int, offset: int) -> bool:
        """Raise the range's commit offset to ``offset``; True when it moved."""
        key = (stream_id, range_index)
        if offset <= self._offsets.get(key, -1):
            return False
        self._offsets[key] = offset
        self._waiters.notify(stream_id)
        return True


class ReplicaStates:
    """The state of every range replica this node holds; see the module docstring."""

    def __init__(self, node_id: int, engine: StorageEngine, waiters: StreamWaiters) -> None:
        self.node_id = node_id
        self.engine = engine
        self.commits = CommitOffsets(waiters)

    def state_of(self, info: RangeInfo) -> ReplicaState:
        if info.is_open:
            if info.primary_node_id != self.node_id:
                return ReplicaState.FOLLOWING
            if self.engine.fenced(info.stream_id, info.range_index):
                return ReplicaState.FENCED
            return ReplicaState.LEADING
        if info.sealed_here:
            return ReplicaState.SEALED_HERE
        first = self.engine.first_offset(info.stream_id) or 0
        start = max(info.start_offset, first)
        if start < info.end_offset and (
            self.engine.held_end(info.stream_id, start, info.end_offset) < info.end_offset
        ):
            return ReplicaState.SHORT
        return ReplicaState.WHOLE

    # -- leading ------------------------------------------------------------------

    def leads_replicated(self, info: RangeInfo) -> bool:
        """Whether this node is the primary of ``info`` and it has followers."""
        return info.primary_node_id == self.node_id and len(info.replicas) > 1

    def leads(self, stream_id: int) -> bool:
        """Whether this node is the primary of the stream's open range."""
        info = self.engine.open_range(stream_id)
        return info is not None and info.primary_node_id == self.node_id

    def fence_after_restart(self) -> list[int]:
        """At start-up, LEADING -> FENCED for every open replicated range led
        here: it may have handed batches to followers that its last commit
        never made durable, at offsets it would hand out again. The PM seals
        it upon the RANGE_SEALED its next writer gets. The streams of
        ranges this node leads, fenced or not."""
        led = []
        for stream_id in self.engine.stream_ids():
            info = self.engine.open_range(stream_id)
            if info is not None and self.leads_replicated(info):
                self.engine.fence(stream_id, info.range_index)
                led.append(stream_id)
        return led

    # -- sealing --------------------------------------------------------------------

    def unsettled(self, stream_id: int) -> list[RangeInfo]:
        """The stream's replicated ranges in SEALED_HERE: they take no appends
        and serve only what is committed until the PM's end is known here."""
        try:
            hosted = self.engine.list_ranges(stream_id)
        except ProtocolError:  # forgotten or deleted meanwhile
            return []
        return [info for info in hosted if info.sealed_here and len(info.replicas) > 1]

    def due_to_settle(
        self, waiting_since: Mapping[int, float], now: float
    ) -> tuple[list[RangeInfo], list[int]]:
        """SEALED_HERE past ``SETTLE_AFTER_S``: of the streams that may hold
        ranges sealed here (by when each was noted), the ranges whose wait is
        over, to be sealed on the PM by this node; and the streams whose
        wait is over with nothing left to settle, to be forgotten."""
        due: list[RangeInfo] = []
        settled: list[int] = []
        for stream_id, since in waiting_since.items():
            if now - since < SETTLE_AFTER_S:
                continue
            unsettled = self.unsettled(stream_id)
            due += unsettled
            if not unsettled:
                settled.append(stream_id)
        return due, settled

    # -- commit offsets and reads -----------------------------------------------------

    def commit_of(self, info: RangeInfo) -> int:
        """The range's commit offset as this node knows it: a sealed range's
        end, an unreplicated range's next offset, else the commit table's;
        -1 while not known here (since a restart, until the primary, or on
        the primary the followers, said)."""
        if len(info.replicas) <= 1:
            return info.next_offset
        if info.end_is_final:
            return info.end_offset
        return self.commits.get(info.stream_id, info.range_index, -1)

    def read_limit(self, stream_id: int, offset: int) -> int | None:
        """Where a FETCH at ``offset`` must stop: the commit offset of the
        stream's first replicated range whose end the PM has not fixed, None
        when there is none (SPEC §7: only acknowledged records are served).
        Raises NOT_PRIMARY for records held here whose commit offset this
        node has not learned since it started."""
        info = self.engine.unsettled_range(stream_id)
        if info is None:
            return None
        if not self.commits.known(stream_id, info.range_index):
            held = self.engine.next_offset(stream_id) or info.start_offset
            if info.start_offset <= offset < held:
                raise NotPrimaryError(
                    f"data node {self.node_id} does not know the commit offset of stream "
                    f"{stream_id} range {info.range_index} yet (it restarted and has not "
                    "heard from the primary): read from another replica"
                )
        return self.commits.get(stream_id, info.range_index, info.start_offset)

    def waits_past_end(self, stream_id: int, offset: int, limit: int | None) -> bool:
        """Whether a FETCH past what this replica holds waits for the records
        instead of being refused OFFSET_OUT_OF_RANGE: a follower of a
        replicated range behind its primary, which may already have that
        offset. The primary, and an unreplicated range, refuse."""
        return (
            limit is not None
            and offset >= (self.engine.first_offset(stream_id) or 0)
            and not self.leads(stream_id)
        )
