"""What every range model of the project means by a range's state (SPEC §5):
``[start_offset, end_offset)``, open (writable) while ``end_offset`` is
``OPEN_END_OFFSET``. The wire's ``messages.Range``, the PM's
``pm.records.RangeRecord`` and the data node's ``storage.model.RangeInfo``
carry different facts about a range, but they all answer these questions
through this one base, so "open", "holds offset" and "where it ends" mean
the same everywhere."""

from __future__ import annotations

from .constants import OPEN_END_OFFSET


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
