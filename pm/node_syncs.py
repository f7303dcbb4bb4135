"""What the PM tells the data nodes, SYNC_RANGES and DELETE_STREAMS: one
ordered queue per node, one call at a time, the streams of the changes made
while one is under way going together in the next.

A burst of changes (the seals after a primary dies, thousands at once) would
otherwise send one SYNC_RANGES per stream to each node at the same moment,
more than the PM and the nodes get through before the changes' deadlines;
each node that missed one must then be reconciled. Queued this way, a burst
costs a node a few calls.

- A call reads the streams' ranges from the metadata when it is sent, and a
  node's calls go one after another, so a node never gets an older view of a
  stream after a newer one, nor a view of a stream after its deletion: of
  the changes waiting together, the deletions go first (DELETE_STREAMS),
  and a deleted stream is not synced.
- The calls are sent by a task of their own per node, not by the changes
  waiting for them: a change whose deadline passes stops waiting, and its
  streams still go. A call that fails is reported (``on_failure``) once,
  for all its streams.
- A slow node holds up only the calls to itself.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Final

import trio

from sbp.errors import RequestTimeoutError, SBPError, ShuttingDownError

log = logging.getLogger(__name__)

#: how long one call may take, retries included
SEND_TIMEOUT_S: Final = 10.0

#: sends SYNC_RANGES of the streams (their ranges as they are now) to a
#: node, or DELETE_STREAMS of them
Send = Callable[[int, Sequence[int]], Awaitable[None]]
#: told of each call that failed: the node, the streams and why
OnFailure = Callable[[int, Sequence[int], Exception], None]


class _Batch:
    """The streams of the changes waiting for the same call."""

    __slots__ = ("deleted", "done", "error", "stream_ids")

    def __init__(self) -> None:
        self.stream_ids: set[int] = set()
        self.deleted: set[int] = set()
        self.done = trio.Event()
        self.error: Exception | None = None

    @property
    def empty(self) -> bool:
        return not (self.stream_ids or self.deleted)

    def finish(self, error: Exception | None) -> None:
        self.error = error
        self.done.set()


class _NodeQueue:
    """One node's next call, and whether its sending task runs."""

    __slots__ = ("sending", "waiting")

    def __init__(self) -> None:
        self.waiting = _Batch()
        self.sending = False


class NodeSyncs:
    """See the module docstring."""

    def __init__(self, send: Send, on_failure: OnFailure, delete: Send | None = None) -> None:
        self._send = send
        self._delete = delete
        self._on_failure = on_failure
        self._queues: dict[int, _NodeQueue] = {}
        self._calls: set[trio.CancelScope] = set()
        self._stopped = False

    async def sync(self, node_id: int, stream_ids: Iterable[int]) -> None:
        """SYNC_RANGES of ``stream_ids`` to ``node_id`` in the node's next
        call; returns once that call is answered, and raises what it failed
        with. Cancelled while waiting, the streams still go."""
        await self._queue(node_id, stream_ids, deleted=False)

    async def delete(self, node_id: int, stream_ids: Iterable[int]) -> None:
        """DELETE_STREAMS of ``stream_ids`` to ``node_id``, in the node's next
        call; as ``sync``."""
        assert self._delete is not None, "made without a delete call"
        await self._queue(node_id, stream_ids, deleted=True)

    async def _queue(self, node_id: int, stream_ids: Iterable[int], *, deleted: bool) -> None:
        queue = self._queues.setdefault(node_id, _NodeQueue())
        batch = queue.waiting
        (batch.deleted if deleted else batch.stream_ids).update(stream_ids)
        if not queue.sending:
            queue.sending = True
            trio.lowlevel.spawn_system_task(
                self._send_queued, node_id, queue, name=f"calls to node {node_id}"
            )
        await batch.done.wait()
        if batch.error is not None:
            raise batch.error

    def stop(self) -> None:
        """Shutdown: end the calls under way and send none after them."""
        self._stopped = True
        for scope in list(self._calls):
            scope.cancel()

    async def _send_queued(self, node_id: int, queue: _NodeQueue) -> None:
        try:
            while not queue.waiting.empty and not self._stopped:
                batch, queue.waiting = queue.waiting, _Batch()
                error = None
                if batch.deleted:
                    assert self._delete is not None
                    error = await self._call(node_id, sorted(batch.deleted), self._delete)
                synced = sorted(batch.stream_ids - batch.deleted)
                if synced:
                    error = await self._call(node_id, synced, self._send) or error
                batch.finish(error)
        finally:
            queue.sending = False
            if not queue.waiting.empty:
                queue.waiting.finish(ShuttingDownError("the PM is shutting down"))
                queue.waiting = _Batch()

    async def _call(self, node_id: int, stream_ids: Sequence[int], send: Send) -> Exception | None:
        """One call; what it failed with, after telling ``on_failure``."""
        error: Exception
        with trio.CancelScope() as scope:
            self._calls.add(scope)
            try:
                with trio.fail_after(SEND_TIMEOUT_S):
                    await send(node_id, stream_ids)
                return None
            except (SBPError, OSError) as failed:
                error = failed
            except trio.TooSlowError:
                error = RequestTimeoutError(f"no answer in {SEND_TIMEOUT_S:.0f} s")
            except Exception as bug:  # a task of its own: nothing above it to fail
                log.exception("a call to node %d about streams %s", node_id, stream_ids)
                error = bug
            finally:
                self._calls.discard(scope)
        if scope.cancelled_caught:
            error = ShuttingDownError("the PM is shutting down")
        self._on_failure(node_id, stream_ids, error)
        return error
