"""How far behind a reader is in time (SPEC §11): the age of the oldest
record it has not consumed. One computation, used by the PM for
``sbp_group_lag_seconds`` and by ``sbp groups describe``, so the dashboard
and the command line cannot disagree.

The age is taken from that record's own timestamp (the batch's base
timestamp plus the record's delta), read from a replica with a FETCH of the
one batch holding it. It does not depend on what the asker saw before, so
it is the same however long the PM has been up.
"""

from __future__ import annotations

from sbp import messages
from sbp.batches import decode_batches

from .datanode_client import DataNodeClient


async def record_timestamp(node: DataNodeClient, stream_id: int, offset: int) -> int | None:
    """The timestamp (ms since the Unix epoch) of the record at ``offset``,
    or of the first one after it when compaction removed it; None when the
    replica answers no record there."""
    wanted = messages.FetchInfo(stream_id=stream_id, fetch_offset=offset, batch_max_bytes=1)
    async with node.fetch([wanted]) as results:
        data = b"".join([bytes(fetched.data) async for fetched in results])
    if not data:
        return None
    records = decode_batches(data)
    if not len(records):
        return None
    # the answer starts with the batch holding the offset
    first = min(int(records.offsets.searchsorted(offset)), len(records) - 1)
    return int(records.timestamps[first])


def lag_seconds(
    offset: int, end_offset: int, oldest_unread_ms: int | None, now_ms: int
) -> float | None:
    """The lag in seconds of a reader at ``offset`` of a stream ending at
    ``end_offset``: 0 at the end, else the age of the record at ``offset``
    (``oldest_unread_ms``, from ``record_timestamp``); None when unknown."""
    if end_offset >= 0 and offset >= end_offset:
        return 0.0
    if offset < 0 or end_offset < 0 or oldest_unread_ms is None:
        return None
    return max(now_ms - oldest_unread_ms, 0) / 1000
