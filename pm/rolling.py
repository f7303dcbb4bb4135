"""Sealing a stream's open range once it holds a given size, so that its
records go on to what only sealed ranges get: compaction (SPEC §13) and the
object store (SPEC §14)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol

from .changes import Metadata
from .records import Holding


class HoldingsLink(Protocol):
    async def range_holdings(
        self, node_id: int, keys: Sequence[tuple[int, int]], skips: Sequence[int] = ()
    ) -> dict[tuple[int, int], Holding]: ...


async def roll_if_full(
    store: Metadata,
    link: HoldingsLink,
    seal: Callable[[int, int], Awaitable[object]],
    stream_id: int,
    roll_bytes: int,
) -> bool:
    """Seal the stream's open range if its primary holds ``roll_bytes`` or
    more of it; whether it did."""
    last = store.last_range(stream_id)
    if last is None or not last.is_open or roll_bytes <= 0:
        return False
    held = await link.range_holdings(last.primary, [last.key])
    holding = held.get(last.key)
    if holding is None or holding.size < roll_bytes:
        return False
    await seal(stream_id, last.range_index)
    return True


async def roll_full(
    store: Metadata,
    link: HoldingsLink,
    seal: Callable[[int, int], Awaitable[object]],
    stream_ids: Iterable[int],
    roll_bytes: int,
) -> int:
    """``roll_if_full`` for many streams, with one RANGE_HOLDINGS per
    primary; how many open ranges it sealed."""
    if roll_bytes <= 0:
        return 0
    by_primary: dict[int, list[tuple[int, int]]] = {}
    for stream_id in stream_ids:
        last = store.last_range(stream_id)
        if last is not None and last.is_open and last.nodes:
            by_primary.setdefault(last.primary, []).append(last.key)
    rolled = 0
    for primary, keys in by_primary.items():
        held = await link.range_holdings(primary, keys)
        for (stream_id, range_index), holding in held.items():
            if holding.size >= roll_bytes:
                await seal(stream_id, range_index)
                rolled += 1
    return rolled
