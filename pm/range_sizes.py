"""The bytes of ranges, as their replicas hold them (RANGE_HOLDINGS), for
size retention and rebalancing (SPEC §12).

A sealed range's size changes only when a trim moves its start, so it is
asked once per start and kept; an open range is asked every time. Each
range is asked of its first live replica, one request per node for all the
ranges asked of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from .liveness import NodeRegistry
from .records import Holding, RangeRecord


class HoldingsLink(Protocol):
    async def range_holdings(
        self, node_id: int, keys: Sequence[tuple[int, int]], skips: Sequence[int] = ()
    ) -> dict[tuple[int, int], Holding]: ...


class RangeSizes:
    """See the module docstring."""

    def __init__(self, registry: NodeRegistry, link: HoldingsLink) -> None:
        self._registry = registry
        self._link = link
        #: sealed ranges by key: (start offset when sized, bytes)
        self._sealed: dict[tuple[int, int], tuple[int, int]] = {}

    async def sizes(self, ranges: Sequence[RangeRecord]) -> dict[tuple[int, int], int]:
        """Each range's bytes; a range no live replica answers for is left out."""
        sizes: dict[tuple[int, int], int] = {}
        asked: dict[int, list[tuple[int, int]]] = {}
        by_key = {rng.key: rng for rng in ranges}
        for rng in ranges:
            if not rng.nodes and rng.object_state:
                sizes[rng.key] = rng.object_bytes  # in the object store only (SPEC §14)
                continue
            cached = self._sealed.get(rng.key)
            if not rng.is_open and cached is not None and cached[0] == rng.start_offset:
                sizes[rng.key] = cached[1]
                continue
            holder = self.holder(rng)
            if holder is not None:
                asked.setdefault(holder, []).append(rng.key)
        for holder, keys in asked.items():
            found = await self._link.range_holdings(holder, keys)
            for key, holding in found.items():
                sizes[key] = holding.size
                rng = by_key[key]
                if holding.covers(rng):
                    self._sealed[key] = (rng.start_offset, holding.size)
        return sizes

    async def cut(self, rng: RangeRecord, skip: int) -> int | None:
        """Where to cut ``rng`` to drop about its first ``skip`` bytes, as a
        live replica finds it at a batch boundary (None: none answered)."""
        holder = self.holder(rng)
        if holder is None:
            return None
        found = await self._link.range_holdings(holder, [rng.key], [skip])
        holding = found.get(rng.key)
        return None if holding is None else holding.cut

    def holder(self, rng: RangeRecord) -> int | None:
        """The replica to ask about a range: its first live one."""
        return next((n for n in rng.nodes if self._registry.is_alive(n)), None)

    def forget(self, keys: Iterable[tuple[int, int]]) -> None:
        for key in keys:
            self._sealed.pop(key, None)

    def forget_stream(self, stream_id: int) -> None:
        self.forget([key for key in self._sealed if key[0] == stream_id])

    def keys_of(self, stream_id: int) -> list[tuple[int, int]]:
        return [key for key in self._sealed if key[0] == stream_id]
