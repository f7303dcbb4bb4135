"""Consumer groups on the PM (SPEC §11): positions checked, stored at once,
kept across a restart and gone with their stream; the ends that give the
lag, and how old the oldest unread record is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pm.changes import DeleteGroup, DeleteStream, Metadata, PutGroupOffsets, PutRange, PutStream
from pm.groups import ConsumerGroups, OffsetItem, RecordTimes, StreamEnds
from pm.members import GroupMembers
from pm.metadata import MetadataStore
from pm.records import GroupOffsetRecord, Outcome, RangeRecord, StreamRecord
from sbp.constants import MAX_GROUP_COMMIT_ITEMS
from sbp.enums import ErrorCode
from sbp.errors import GroupNotFoundError, InvalidRequestError

from .test_pm_manager import FakeDataNodes

NOW = 1_700_000_000_000


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MetadataStore]:
    opened = MetadataStore(tmp_path / "pm", map_size=64 << 20)
    yield opened
    opened.close()


async def _streams(store: MetadataStore) -> FakeDataNodes:
    """Stream 1: ranges [0, 100) sealed and [100, ...) open, 150 next;
    stream 2 trimmed to 20, open, 30 next."""
    await store.commit(
        [
            PutStream(StreamRecord(1, 1)),
            PutRange(RangeRecord(1, 0, 0, (1,), end_offset=100)),
            PutRange(RangeRecord(1, 1, 100, (1,))),
            PutStream(StreamRecord(2, 1)),
            PutRange(RangeRecord(2, 0, 20, (2,))),
        ]
    )
    nodes = FakeDataNodes()
    nodes.next_offsets = {1: 150, 2: 30}
    return nodes


def _groups(store: MetadataStore, nodes: FakeDataNodes) -> ConsumerGroups:
    return ConsumerGroups(
        store,
        store.commit,
        StreamEnds(store, nodes),
        RecordTimes(store, nodes),
        GroupMembers(store, store.commit),
        clock_ms=lambda: NOW,
    )


def _codes(outcomes: list[Outcome[GroupOffsetRecord]]) -> list[int]:
    return [0 if o.error is None else o.error.code for o in outcomes]


async def check_position_store(store: Metadata) -> None:
    """What every metadata store does with positions (run on LMDB here and on
    etcd in tests/integration/test_pm_etcd.py): any name, a rewrite, gone with
    their stream or their group."""
    positions = (
        GroupOffsetRecord("etl/daily", 7, 40, 1000, "run 3"),
        GroupOffsetRecord("etl/daily", 8, 0, 1000),
        GroupOffsetRecord("ü", 7, 50, 1001),
        GroupOffsetRecord("e", 9, 5, 1002),  # a name that is a prefix of another
    )
    await store.commit([PutGroupOffsets(positions)])
    assert store.group_offsets("etl/daily") == list(positions[:2])
    assert store.group_offsets("e") == [positions[3]]
    rewound = GroupOffsetRecord("etl/daily", 7, 10, 2000, "rewound")
    await store.commit([PutGroupOffsets((rewound,))])
    await store.commit([DeleteStream(8), DeleteGroup("nobody")])
    assert store.group_offsets("etl/daily") == [rewound]
    assert store.all_group_offsets() == [positions[3], rewound, positions[2]]
    await store.commit([DeleteGroup("ü")])
    assert store.group_offsets("ü") == []
    assert store.all_group_offsets() == [positions[3], rewound]


async def test_the_lmdb_store_keeps_positions(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "pm", map_size=64 << 20)
    await check_position_store(store)
    store.close()
    reopened = MetadataStore(tmp_path / "pm", map_size=64 << 20)
    assert [r.group for r in reopened.all_group_offsets()] == ["e", "etl/daily"]
    reopened.close()


async def test_positions_are_checked_then_stored_together(store: MetadataStore) -> None:
    groups = _groups(store, await _streams(store))
    outcomes = await groups.commit(
        "etl",
        [
            OffsetItem(1, 120, "batch 9"),
            OffsetItem(2, 30),  # the end itself: everything read
            OffsetItem(2 + 1, 0),  # no such stream
        ],
    )
    assert _codes(outcomes) == [0, 0, ErrorCode.STREAM_NOT_FOUND]
    assert outcomes[0].value == GroupOffsetRecord("etl", 1, 120, NOW, "batch 9")
    refused = await groups.commit("etl", [OffsetItem(1, 151), OffsetItem(2, 19)])
    assert _codes(refused) == [ErrorCode.OFFSET_OUT_OF_RANGE] * 2
    assert [r.offset for r in store.group_offsets("etl")] == [120, 30]
    # a rewind is a commit like any other
    await groups.commit("etl", [OffsetItem(1, 0)])
    [first, second] = groups.fetch("etl", [])
    assert (first.record.offset, first.end_offset, first.lag_records) == (0, 150, 150)
    assert (second.record.offset, second.lag_records, second.lag_ms) == (30, 0, 0)
    [unread] = groups.fetch("etl", [7])
    assert unread.record.offset == -1 and unread.lag_records == -1


@pytest.mark.parametrize(
    ("group", "items", "problem"),
    [
        ("", [OffsetItem(1, 0)], "it is empty"),
        ("g" * 256, [OffsetItem(1, 0)], "256 given"),
        ("etl", [OffsetItem(1, 0, "m" * 4097)], "4097 given"),
        ("etl", [OffsetItem(1, 0), OffsetItem(1, 5)], "each stream once"),
        ("etl", [OffsetItem(1, 0)] * (MAX_GROUP_COMMIT_ITEMS + 1), "at most 100"),
    ],
    ids=["empty name", "long name", "long metadata", "a stream twice", "too many"],
)
async def test_bad_commits_change_nothing(
    store: MetadataStore, group: str, items: list[OffsetItem], problem: str
) -> None:
    groups = _groups(store, await _streams(store))
    outcomes = await groups.commit(group, items)
    errors = [o.error for o in outcomes]
    assert all(isinstance(e, InvalidRequestError) and problem in e.message for e in errors)
    assert store.all_group_offsets() == []


async def test_groups_are_listed_deleted_and_gone_with_their_stream(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "pm", map_size=64 << 20)
    groups = _groups(store, await _streams(store))
    await groups.commit("etl", [OffsetItem(1, 100), OffsetItem(2, 25)])
    await groups.commit("audit", [OffsetItem(2, 20)])
    with pytest.raises(GroupNotFoundError):
        groups.fetch("nobody", [])
    store.close()
    store = MetadataStore(tmp_path / "pm", map_size=64 << 20)  # restarted
    groups = _groups(store, FakeDataNodes())
    assert [(r.group, r.stream_id) for r in store.all_group_offsets()] == [
        ("audit", 2),
        ("etl", 1),
        ("etl", 2),
    ]
    await store.commit([DeleteStream(2)])
    groups.forget_streams([2])  # as PlacementManager.delete_streams does after that commit
    assert [(r.group, r.stream_id) for r in store.all_group_offsets()] == [("etl", 1)]
    assert [(r.group, r.stream_id) for r in groups.records()] == [("etl", 1)]
    with pytest.raises(GroupNotFoundError):
        groups.fetch("audit", [])
    outcomes = await groups.delete(["etl", "audit", ""])
    assert outcomes[0] is None
    assert isinstance(outcomes[1], GroupNotFoundError)
    assert isinstance(outcomes[2], InvalidRequestError)
    assert store.all_group_offsets() == []
    store.close()


async def test_ends_come_from_the_primaries(store: MetadataStore) -> None:
    nodes = await _streams(store)
    ends = StreamEnds(store, nodes)
    await ends.refresh([1, 2, 99])
    assert (ends.end(1), ends.end(2), ends.end(99)) == (150, 30, None)
    nodes.next_offsets[1] = 250
    await ends.refresh([1])
    assert ends.end(1) == 250
    nodes.unreachable.add(1)
    await ends.refresh([1])  # a node that does not answer keeps the last end
    assert ends.end(1) == 250


def test_an_answer_that_arrives_late_does_not_take_an_open_ranges_end_back(
    store: MetadataStore,
) -> None:
    """Two refreshes of a stream may be answered in either order: the older
    answer of an open range, arriving last, leaves the higher end, and one
    from a range known sealed since is not taken. A sealed end is taken as
    it is."""
    ends = StreamEnds(store, FakeDataNodes())
    ends.note({1: 500}, {1: 0}, sealed=False)
    ends.note({1: 0}, {1: 0}, sealed=False)
    assert ends.end(1) == 500
    ends.note({1: 480}, {1: 0}, sealed=True)  # sealed below the primary's next offset
    assert ends.end(1) == 480
    ends.note({1: 500}, {1: 0}, sealed=False)  # from before the seal
    assert ends.end(1) == 480
    ends.note({1: 530}, {1: 1}, sealed=False)  # the next range
    ends.note({1: 480}, {1: 0}, sealed=False)
    assert ends.end(1) == 530


async def test_the_lag_in_seconds_is_the_age_of_the_oldest_unread_record(
    store: MetadataStore,
) -> None:
    """Dated by the record's own timestamp, read once from a replica of the
    range holding it, whatever this PM saw of the stream before: a PM just
    started (a new ``ConsumerGroups``) says the same."""
    nodes = await _streams(store)
    nodes.record_times = {(1, 40): NOW - 77_400, (1, 120): NOW - 3_000}
    for _ in range(2):  # as a PM would, then as one that just restarted
        groups = _groups(store, nodes)
        await groups.commit("etl", [OffsetItem(1, 40)])
        await groups.commit("tail", [OffsetItem(1, 120)])
        await groups.commit("done", [OffsetItem(1, 150)])
        await groups.ends.refresh([1])
        behind = [(1, 40), (1, 120)]
        await groups.times.learn(behind)
        lags = {p.record.group: p.lag_ms for p in groups.furthest_behind(10)[0]}
        assert lags == {"etl": 77_400, "tail": 3_000, "done": 0}
    read = len(nodes.times_read)
    await groups.times.learn(behind)
    assert len(nodes.times_read) == read  # each record's time is read once
    await groups.times.learn([(1, 120)])
    assert groups.times.get(1, 40) is None  # forgotten once no group is there
