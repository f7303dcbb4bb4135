"""The one place the PM's ranges and streams change: ``RangeLog.commit``
runs a metadata transaction, then tells its observers what it changed, so
that the state each keeps from the ranges (each node's range count, the
short-handed ranges, the streams under a size limit) follows every commit
and nothing else has to remember to update it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from .changes import Change, DeleteRange, DeleteStream, Metadata, PutRange


@dataclass(frozen=True, slots=True)
class Committed:
    """One commit: its changes, in order, and the nodes of every range they
    replaced or removed, as they were before."""

    changes: Sequence[Change]
    replaced: dict[tuple[int, int], tuple[int, ...]]


class CommitObserver(Protocol):
    def committed(self, done: Committed) -> None:
        """Follow a commit (on the event loop, right after it)."""
        ...


class RangeLog:
    """See the module docstring."""

    def __init__(self, store: Metadata) -> None:
        self.store = store
        self._observers: list[CommitObserver] = []

    def observe(self, *observers: CommitObserver) -> None:
        self._observers.extend(observers)

    async def commit(self, changes: Sequence[Change]) -> None:
        """Commit ``changes`` atomically, then tell the observers."""
        done = Committed(changes, self._replaced(changes))
        # Shielded: once the transaction starts, the caller must see how it ended.
        with trio.CancelScope(shield=True):
            await self.store.commit(changes)
        for observer in self._observers:
            observer.committed(done)

    def _replaced(self, changes: Sequence[Change]) -> dict[tuple[int, int], tuple[int, ...]]:
        """The nodes of every range the changes replace or remove, as they are now."""
        hosting: dict[tuple[int, int], tuple[int, ...]] = {}
        for change in changes:
            if isinstance(change, PutRange | DeleteRange):
                sid, index = (
                    change.range.key
                    if isinstance(change, PutRange)
                    else (change.stream_id, change.range_index)
                )
                current = self.store.range(sid, index)
                if current is not None:
                    hosting[current.key] = current.nodes
            elif isinstance(change, DeleteStream):
                for rng in self.store.ranges(change.stream_id):
                    hosting[rng.key] = rng.nodes
        return hosting
