"""UPDATE_STREAMS: a stream's settings changed, under its lock (SPEC §5,
with §12's limits, §13's compaction, §14's tiering and §16's tables)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager

import trio

from sbp.errors import ProtocolError, RequestTimeoutError

from . import stream_settings
from .changes import Change, Metadata, PutStream, require_stream
from .compaction import CompactionCalls, check_all_keyed
from .liveness import NodeRegistry
from .placement import place
from .records import Outcome, StreamRecord


class StreamUpdates:
    """See the module docstring."""

    def __init__(
        self,
        store: Metadata,
        registry: NodeRegistry,
        link: CompactionCalls,
        hold_all: Callable[[Iterable[int]], AbstractAsyncContextManager[None]],
        commit: Callable[[Sequence[Change]], Awaitable[None]],
        sync_streams: Callable[[Iterable[int], float], Awaitable[None]],
        *,
        object_store: bool,
        min_free_space: int,
    ) -> None:
        self._store = store
        self._registry = registry
        self._link = link
        self._hold_all = hold_all
        self._commit = commit
        self._sync_streams = sync_streams
        self._object_store = object_store
        self._min_free_space = min_free_space

    async def update(
        self, specs: Sequence[StreamRecord], timeout: float
    ) -> list[Outcome[StreamRecord]]:
        """Change streams' replica_nums (0 keeps it), ack_nums (0 keeps it),
        retention (negative keeps it), retention_bytes (0 keeps it, -1
        removes it) and epoch (which may not go back:
        EPOCH_FENCED). New ranges use the new replica_nums and epoch;
        existing ranges stay where they are."""
        deadline = trio.current_time() + timeout
        results: list[Outcome[StreamRecord]] = [
            Outcome(error=RequestTimeoutError("the request's deadline passed"))
        ] * len(specs)
        with trio.move_on_at(deadline):
            async with self._hold_all(spec.stream_id for spec in specs):
                # Later items of the batch see the earlier ones' changes.
                updated: dict[int, StreamRecord] = {}
                retention_changed: set[int] = set()
                for index, spec in enumerate(specs):
                    try:
                        current = updated.get(spec.stream_id) or require_stream(
                            self._store, spec.stream_id
                        )
                        new = stream_settings.updated(
                            current, spec, object_store=self._object_store
                        )
                        if stream_settings.compacted(new) and not stream_settings.compacted(
                            current
                        ):
                            await check_all_keyed(self._store, self._link, spec.stream_id, deadline)
                        if new.replica_nums != current.replica_nums:
                            # As CREATE_STREAMS would: a count no live nodes can
                            # hold would make every later seal fail.
                            place(
                                self._registry.loads(),
                                new.replica_nums,
                                min_free_space=self._min_free_space,
                            )
                    except ProtocolError as exc:
                        results[index] = Outcome(error=exc)
                        continue
                    if new.retention_period_ms != current.retention_period_ms:
                        retention_changed.add(spec.stream_id)
                    updated[spec.stream_id] = new
                    results[index] = Outcome(new)
                await self._commit([PutStream(stream) for stream in updated.values()])
                # The hosting data nodes apply retention; a SYNC_RANGES makes
                # them read the stream's new period now rather than on their
                # next pass.
                await self._sync_streams(retention_changed, deadline)
        return results
