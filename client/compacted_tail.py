"""Telling a compacted range's empty tail from a replica that lacks records.

Compaction (SPEC §13) may remove every record from some offset to a sealed
range's end; a FETCH there answers nothing, as it does on a replica that has
not caught up yet and still takes the range for open. Only the replica's own
view tells the two apart: a node that holds the range sealed answers empty
below its end only where every record was compacted away (anything it merely
lacks is RANGE_NOT_FOUND).
"""

from __future__ import annotations

from sbp import messages

from .datanode_client import DataNodeClient


async def compacted_end(
    node: DataNodeClient, stream_id: int, range_index: int, offset: int
) -> int | None:
    """The range's end when ``node`` holds it sealed and has nothing from
    ``offset`` to there (compacted away); None otherwise. The FETCH is asked
    again after the range is seen sealed: an answer given while the node took
    the range for open proves nothing."""
    described = await node.describe_range(stream_id, range_index)
    if described.is_open or offset >= described.end_offset:
        return None
    info = messages.FetchInfo(stream_id=stream_id, fetch_offset=offset, batch_max_bytes=1)
    async with node.fetch([info]) as results:
        async for fetched in results:
            if fetched.result.error_code or len(fetched.data):
                return None
    return described.end_offset
