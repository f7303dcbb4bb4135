"""The stream ids a PM hands out: on the event loop, one after another;
each commit that creates streams records the high-water mark
(``RaiseNextStreamId``), so that a restart never hands out an acknowledged
id again."""

from __future__ import annotations


class StreamIds:
    def __init__(self, next_id: int) -> None:
        #: the id the next stream gets
        self.next = next_id

    def take(self) -> int:
        """An id for a new stream."""
        taken = self.next
        self.next += 1
        return taken

    def move_past(self, stream_id: int) -> bool:
        """Never hand out ``stream_id`` (a stream a node holds that this PM
        never created); whether the next id moved."""
        if stream_id < self.next:
            return False
        self.next = stream_id + 1
        return True
