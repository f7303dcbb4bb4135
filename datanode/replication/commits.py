"""The commit offsets this node knows, per replicated range (SPEC §7).

On the primary the commit offset is computed from the followers' answers; on
a follower it is what the primary last sent. FETCH of an open replicated
range serves only what lies below it, and a FETCH waiting at the tail wakes
when it moves (``StreamWaiters.notify``). Nothing here is persisted: after a
restart a range's commit offset is unknown until the primary (or the
followers' answers) says it, so a restart never serves a record that a
failure could take back; until then FETCH of records the replica holds is
refused (``NOT_PRIMARY``, retriable), never answered as if the stream ended
there.
"""

from __future__ import annotations

from ..waiters import StreamWaiters


class CommitOffsets:
    """``(stream_id, range_index)`` -> commit offset; only ever moves up."""

    def __init__(self, waiters: StreamWaiters) -> None:
        self._waiters = waiters
        self._offsets: dict[tuple[int, int], int] = {}

    def get(self, stream_id: int, range_index: int, default: int) -> int:
        return self._offsets.get((stream_id, range_index), default)

    def known(self, stream_id: int, range_index: int) -> bool:
        """Whether this node has learned the range's commit offset since it
        started."""
        return (stream_id, range_index) in self._offsets

    def advance(self, stream_id: int, range_index: int, offset: int) -> bool:
        """Raise the range's commit offset to ``offset``; True (and the
        stream's waiting FETCHes woken) when it moved."""
        key = (stream_id, range_index)
        if offset <= self._offsets.get(key, -1):
            return False
        self._offsets[key] = offset
        self._waiters.notify(stream_id)
        return True

    def forget(self, stream_id: int, range_index: int) -> None:
        self._offsets.pop((stream_id, range_index), None)

    def __len__(self) -> int:
        return len(self._offsets)
