"""What every range model of the project means by a range's state (SPEC §5):
``[start_offset, end_offset)``, open (writable) while ``end_offset`` is
``OPEN_END_OFFSET``. The wire's ``messages.Range``, the PM's
``pm.records.RangeRecord`` and the data node's ``storage.model.RangeInfo``
carry different facts about a range, but they all answer these questions
through this one base, so "open", "holds offset" and "where it ends" mean
the same everywhere."""

from __future__ import annotations

from .constants import OPEN_END_OFFSET
from .errors import InvalidRequestError


class RangeSpan:
    """Mixed into a range class with ``start_offset`` and ``end_offset``."""

    __slots__ = ()
    start_offset: int
    end_offset: int

    @property
    def is_open(self) -> bool:
        """Writable: no end offset yet."""
        return self.end_offset == OPEN_END_OFFSET

    def holds(self, offset: int) -> bool:
        """Whether ``offset`` falls in the range (an open range holds every
        offset from its start on)."""
        return self.start_offset <= offset and (self.is_open or offset < self.end_offset)


def check_range(stream_id: int, range_index: int, start_offset: int, end_offset: int) -> None:
    """Refuse a range from the wire whose fields are out of their range
    (``InvalidRequestError``), before it reaches storage keys or metadata."""
    if stream_id < 0:
        raise InvalidRequestError(f"stream id {stream_id} is negative")
    if range_index < 0:
        raise InvalidRequestError(f"range index {range_index} of stream {stream_id} is negative")
    if start_offset < 0:
        raise InvalidRequestError(
            f"range {range_index} of stream {stream_id} starts at a negative offset {start_offset}"
        )
    if end_offset != OPEN_END_OFFSET and end_offset < start_offset:
        raise InvalidRequestError(
            f"range {range_index} of stream {stream_id} ends at {end_offset}, "
            f"before its start {start_offset}"
        )
