"""Times and consumer groups for the ``sbp`` source (SPEC §11): offsets by
append time, a group's positions to start from, and a streaming query's
processed ends committed to its group. Each call runs in the Spark process
that plans the query (the driver's Python worker), with a client of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from client._routing import ClientContext
from client.by_time import offset_at_time
from client.sync import SyncClient
from sbp import messages
from sbp.constants import MAX_GROUP_COMMIT_ITEMS
from sbp.errors import GroupNotFoundError, raise_for_code

from .options import OffsetSpec, ReadOptions, TimeSpec


def _client(options: ReadOptions) -> SyncClient:
    return SyncClient(options.pm, timeout=options.timeout, tls=options.tls)


def offsets_by_time(
    options: ReadOptions, times: TimeSpec, stream_ids: Iterable[int], spec: OffsetSpec
) -> OffsetSpec:
    """``spec`` with each stream that ``times`` names a time for set to the
    first offset appended at or after it (the stream's end when none was)."""
    wanted = {s: t for s in stream_ids if (t := times.for_stream(s)) is not None}
    if not wanted:
        return spec

    async def find(client: SyncClient) -> dict[int, int]:
        async with ClientContext(client.pm, client.pool, options.timeout) as context:
            return {s: await offset_at_time(context, s, t) for s, t in wanted.items()}

    with _client(options) as client:
        found = client.run(find, client)
    return OffsetSpec(spec.default, {**spec.per_stream, **found})


def group_positions(options: ReadOptions, group: str) -> dict[int, int]:
    """The group's committed offsets by stream (none for a new group)."""
    with _client(options) as client:
        try:
            positions = client.run(client.pm.fetch_offsets, group)
        except GroupNotFoundError:
            return {}
    return {p.stream_id: p.offset for p in positions if p.offset >= 0}


def commit_positions(options: ReadOptions, group: str, ends: Mapping[str, int]) -> None:
    """Store a micro-batch's processed ends as the group's positions, in
    commits of at most ``MAX_GROUP_COMMIT_ITEMS`` streams (a commit's limit)."""
    items = [messages.GroupOffset(stream_id=int(key), offset=int(end)) for key, end in ends.items()]
    with _client(options) as client:
        for start in range(0, len(items), MAX_GROUP_COMMIT_ITEMS):
            chunk = items[start : start + MAX_GROUP_COMMIT_ITEMS]
            results = client.run(client.pm.commit_offsets, group, chunk)
            for result in results:
                raise_for_code(result.error_code, result.error_message)
