"""Ranges as the PM puts them on the wire: its snapshot of the next and the
commit offsets is the end of a sealed range and the start of an open one."""

from __future__ import annotations

from pm.records import RangeRecord
from pm.wire import range_message
from sbp import messages


def _node(node_id: int) -> messages.DataNode:
    return messages.DataNode(node_id=node_id, advertise_addr=f"127.0.0.1:{9000 + node_id}")


def test_a_sealed_range_is_committed_up_to_its_end() -> None:
    sealed = range_message(RangeRecord(4, 0, 0, (1, 2, 3), 1000), _node)
    assert (sealed.next_offset, sealed.commit_offset) == (1000, 1000)
    assert [r.is_primary for r in sealed.replica_nodes] == [True, False, False]


def test_an_open_range_snapshot_is_its_start() -> None:
    opened = range_message(RangeRecord(4, 1, 1000, (1, 2, 3)), _node)
    assert opened.is_open
    assert (opened.next_offset, opened.commit_offset) == (1000, 1000)
