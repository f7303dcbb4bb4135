"""Telling data nodes of committed changes: SYNC_RANGES of streams with
their current ranges, and DELETE_STREAMS, each through the node's one
ordered queue (``pm.node_syncs``), so that a node never gets an older view
after a newer one.

A call is waited for until the caller's deadline and sent after it all the
same; the change is already the truth. A live node that does not take its
call is reconciled as a returning node is (``on_failed``), a dead one when
it is back.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import trio

from sbp.errors import SBPError

from . import reconcile
from .changes import Metadata
from .datanode_link import DataNodeCalls
from .liveness import NodeRegistry
from .node_syncs import NodeSyncs

log = logging.getLogger(__name__)


class NodeTelling:
    """See the module docstring. ``on_failed(node_id)``: a live node missed
    a call."""

    def __init__(
        self,
        store: Metadata,
        registry: NodeRegistry,
        link: DataNodeCalls,
        on_failed: Callable[[int], None],
    ) -> None:
        self._store = store
        self._registry = registry
        self._link = link
        self._on_failed = on_failed
        #: SYNC_RANGES and DELETE_STREAMS to the data nodes, one call at a time per node
        self.queues = NodeSyncs(self._send_sync, self._sync_failed, delete=link.delete_streams)
        self.stopping = False

    def stop(self) -> None:
        """Shutdown: end every call running, and any that would start."""
        self.stopping = True
        self.queues.stop()

    async def sync_streams(
        self, stream_ids: Iterable[int], deadline: float, also: Iterable[int] = ()
    ) -> None:
        """SYNC_RANGES of each stream, with its current ranges, to every live
        node of its ranges and to ``also``."""
        by_node: dict[int, list[int]] = defaultdict(list)
        extra = set(also)
        for stream_id in sorted(set(stream_ids)):
            ranges = self._store.ranges(stream_id)
            for node_id in sorted({n for rng in ranges for n in rng.nodes} | extra):
                by_node[node_id].append(stream_id)
        await self._tell(by_node, deadline, deleted=False)

    async def delete_streams(self, by_node: dict[int, list[int]], deadline: float) -> None:
        """DELETE_STREAMS of the streams to each live node."""
        await self._tell(by_node, deadline, deleted=True)

    async def _tell(self, by_node: dict[int, list[int]], deadline: float, *, deleted: bool) -> None:
        what = "DELETE_STREAMS" if deleted else "SYNC_RANGES"
        # Shielded: the change is committed, and its request learns it was
        # even when the calls run out of its time.
        with trio.CancelScope(deadline=deadline, shield=True):
            async with trio.open_nursery() as nursery:
                for node_id, ids in by_node.items():
                    if self._registry.is_alive(node_id):
                        nursery.start_soon(self._tell_node, node_id, ids, deleted)
                    else:
                        log.info(
                            "%s of %s to node %d skipped: the node is dead",
                            what,
                            streams_text(ids),
                            node_id,
                        )

    async def _tell_node(self, node_id: int, stream_ids: Sequence[int], deleted: bool) -> None:
        # a failure was logged and the node is reconciled (_sync_failed)
        with contextlib.suppress(SBPError, OSError):
            if deleted:
                await self.queues.delete(node_id, stream_ids)
            else:
                await self.queues.sync(node_id, stream_ids)

    async def _send_sync(self, node_id: int, stream_ids: Sequence[int]) -> None:
        """SYNC_RANGES of the streams, with their ranges as they are now."""
        streams = [(stream_id, self._store.ranges(stream_id)) for stream_id in stream_ids]
        await self._link.sync_ranges(node_id, streams)

    def _sync_failed(self, node_id: int, stream_ids: Sequence[int], error: Exception) -> None:
        """A live node that did not take a SYNC_RANGES or DELETE_STREAMS (cut
        off from the PM, say, while its heartbeats still come) is reconciled
        as a returning node is: until then it could hold a range open that the
        PM sealed, short of its end, with nobody to tell it."""
        if not self.stopping:
            log.warning(
                "telling node %d of %s failed: %s", node_id, streams_text(stream_ids), error
            )
        self._on_failed(node_id)


def streams_text(stream_ids: Sequence[int]) -> str:
    if len(stream_ids) == 1:
        return f"stream {stream_ids[0]}"
    return f"{len(stream_ids)} streams ({reconcile.id_list(stream_ids)})"
