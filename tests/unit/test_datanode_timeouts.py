"""The TimeoutQueue: entries expire at their deadlines in deadline order,
finished ones never do, and finished entries do not pile up."""

from __future__ import annotations

import trio
import trio.testing

from datanode.timeouts import COMPACT_AFTER, TimeoutQueue


class Entry:
    def __init__(self, name: str, expired: list[tuple[str, float]]) -> None:
        self.name = name
        self.expired = expired
        self.finished = False

    def expire(self) -> None:
        assert not self.finished
        self.finished = True
        self.expired.append((self.name, trio.current_time()))


async def test_entries_expire_at_their_deadlines_unless_finished(
    autojump_clock: trio.abc.Clock,
) -> None:
    queue = TimeoutQueue()
    expired: list[tuple[str, float]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)
        start = trio.current_time()
        late, early, done = (Entry(n, expired) for n in ("late", "early", "done"))
        queue.add(start + 5, late)
        queue.add(start + 3, done)
        await trio.sleep(1)
        # an earlier deadline than the one the queue sleeps until wakes it
        queue.add(start + 2, early)
        done.finished = True
        queue.finished()
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    assert expired == [("early", start + 2), ("late", start + 5)]
    assert len(queue) == 0


async def test_finished_entries_are_dropped_long_before_their_deadlines() -> None:
    queue = TimeoutQueue()
    expired: list[tuple[str, float]] = []
    now = trio.current_time()
    live = Entry("live", expired)
    queue.add(now + 3600, live)
    for index in range(10 * COMPACT_AFTER):
        entry = Entry(str(index), expired)
        queue.add(now + 3600, entry)
        entry.finished = True
        queue.finished()
        assert len(queue) <= 2 * COMPACT_AFTER + 2
    assert not expired
    assert any(item[2] is live for item in queue._heap)
