"""pm.range_log: every commit, and the observers that follow it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from pm.changes import DeleteStream, PutRange, PutStream
from pm.metadata import MetadataStore
from pm.range_log import Committed, RangeLog
from pm.records import RangeRecord, StreamRecord


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MetadataStore]:
    opened = MetadataStore(tmp_path / "pm", map_size=16 << 20)
    yield opened
    opened.close()


class Seen:
    def __init__(self) -> None:
        self.commits: list[Committed] = []

    def committed(self, done: Committed) -> None:
        self.commits.append(done)


async def test_observers_hear_each_commit_with_the_nodes_it_replaced(
    store: MetadataStore,
) -> None:
    log = RangeLog(store)
    first, second = Seen(), Seen()
    log.observe(first, second)
    created = [PutStream(StreamRecord(1, 2)), PutRange(RangeRecord(1, 0, 0, (1, 2)))]
    await log.commit(created)
    assert first.commits == second.commits == [Committed(created, {})]
    assert store.ranges(1) == [RangeRecord(1, 0, 0, (1, 2))]
    moved = [PutRange(RangeRecord(1, 0, 0, (2, 3)))]
    await log.commit(moved)
    assert first.commits[-1] == Committed(moved, {(1, 0): (1, 2)})
    await log.commit([DeleteStream(1)])
    assert first.commits[-1].replaced == {(1, 0): (2, 3)}
    assert store.stream(1) is None and len(second.commits) == 3


async def test_a_failed_commit_tells_no_observer(store: MetadataStore) -> None:
    log = RangeLog(store)
    seen = Seen()
    log.observe(seen)
    store.close()
    with pytest.raises(lmdb.Error):
        await log.commit([PutStream(StreamRecord(1, 1))])
    assert seen.commits == []
