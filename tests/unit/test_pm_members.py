"""Consumer group members on the PM (SPEC §15): the assignor's balance and
stickiness, revoke before assign, fencing of commits and heartbeats, and
the member store; a Hypothesis run of joins, leaves, expiries and
heartbeats never has a stream held by two members."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pm.assignor import answerable, target_assignment
from pm.changes import Metadata, PutStream
from pm.members import GroupMembers, Heartbeat, heartbeat_interval_ms
from pm.metadata import MetadataStore
from pm.records import MemberRecord, StreamRecord
from sbp.errors import (
    FencedMemberEpochError,
    InvalidRequestError,
    StreamNotFoundError,
    UnknownMemberIdError,
)


def test_a_new_stream_goes_to_the_least_loaded_member_open_to_it() -> None:
    subs = {"a": {1, 2, 3}, "b": {1, 2, 3, 4}}
    assert target_assignment(subs, {}) in (
        {"a": {1, 3}, "b": {2, 4}},
        {"a": {1, 2}, "b": {3, 4}},
        {"a": {2, 3}, "b": {1, 4}},
    )
    assert target_assignment({"a": {1}, "b": {2}}, {}) == {"a": {1}, "b": {2}}


@pytest.mark.parametrize(
    ("subscriptions", "current", "moved_at_most"),
    [
        # a join takes only what is above the new share: 12 streams, 3 -> 4 members
        (
            {m: set(range(12)) for m in "abcd"},
            {"a": set(range(4)), "b": set(range(4, 8)), "c": set(range(8, 12))},
            3,
        ),
        # a leave gives away only the leaver's streams
        ({m: set(range(12)) for m in "ab"}, {"a": set(range(4)), "b": set(range(4, 8))}, 4),
        # nothing changes, nothing moves
        ({m: set(range(6)) for m in "ab"}, {"a": {0, 1, 2}, "b": {3, 4, 5}}, 0),
    ],
)
def test_balanced_and_sticky(
    subscriptions: dict[str, set[int]], current: dict[str, set[int]], moved_at_most: int
) -> None:
    targets = target_assignment(subscriptions, current)
    counts = sorted(len(t) for t in targets.values())
    assert counts[-1] - counts[0] <= 1
    assert sorted(s for t in targets.values() for s in t) == sorted(
        set().union(*subscriptions.values())
    )
    moved = sum(1 for m, t in targets.items() for s in t if s not in current.get(m, set()))
    assert moved <= moved_at_most


def test_streams_no_member_subscribes_to_or_that_are_gone_are_dropped() -> None:
    targets = target_assignment({"a": {1, 2}}, {"a": {1, 2, 9}}, streams={1})
    assert targets == {"a": {1}}


def test_a_member_may_read_its_target_less_what_another_still_holds() -> None:
    assert answerable("b", {1, 2}, {1: "a", 2: "b"}) == {2}
    assert answerable("b", {1, 2}, {}) == {1, 2}


def test_heartbeat_interval_is_a_tenth_of_the_session_within_bounds() -> None:
    assert heartbeat_interval_ms(45_000) == 3_000
    assert heartbeat_interval_ms(3_000) == 300
    assert heartbeat_interval_ms(500) == 100


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MetadataStore]:
    opened = MetadataStore(tmp_path / "pm", map_size=64 << 20)
    yield opened
    opened.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def with_streams(store: MetadataStore, count: int) -> None:
    await store.commit([PutStream(StreamRecord(s, 1)) for s in range(1, count + 1)])


def beat(
    member: str, epoch: int, owned: tuple[int, ...] = (), streams: tuple[int, ...] = ()
) -> Heartbeat:
    return Heartbeat("g", member, epoch, streams, owned, 3000)


async def test_a_stream_moves_only_after_its_member_let_go(store: MetadataStore) -> None:
    await with_streams(store, 4)
    members = GroupMembers(store, store.commit, Clock())
    a = await members.heartbeat(beat("a", 0, streams=(1, 2, 3, 4)))
    assert (a.epoch, a.assigned) == (1, (1, 2, 3, 4))
    b = await members.heartbeat(beat("b", 0, streams=(1, 2, 3, 4)))
    assert (b.epoch, b.assigned) == (1, ())  # a still holds all four
    a = await members.heartbeat(beat("a", 1, owned=(1, 2, 3, 4)))
    assert a.epoch == 2 and len(a.assigned) == 2  # two taken away from a
    b = await members.heartbeat(beat("b", 1))
    assert b.assigned == ()  # ... which a still reads
    kept = a.assigned
    a = await members.heartbeat(beat("a", 2, owned=kept))  # a let go
    assert a.assigned == kept and a.epoch == 2
    b = await members.heartbeat(beat("b", 1))
    assert set(b.assigned) == {1, 2, 3, 4} - set(kept) and b.epoch == 2
    # a commit is fenced unless the member holds the stream at its epoch (or the one before)
    held_by_b = b.assigned[0]
    assert members.check_commit("g", "b", 2, [held_by_b]) == [None]
    assert members.check_commit("g", "b", 1, [held_by_b]) == [None]
    [stale] = members.check_commit("g", "b", 0, [held_by_b])
    assert isinstance(stale, FencedMemberEpochError)
    [foreign] = members.check_commit("g", "a", 2, [held_by_b])
    assert isinstance(foreign, FencedMemberEpochError) and "does not hold" in foreign.message
    [nobody] = members.check_commit("g", "zz", 1, [held_by_b])
    assert isinstance(nobody, UnknownMemberIdError)
    [outside] = members.check_commit("g", "", -1, [held_by_b])
    assert isinstance(outside, FencedMemberEpochError) and "2 live members" in outside.message
    assert members.check_commit("other", "", -1, [1]) == [None]


async def test_sessions_expire_and_heartbeats_are_fenced(store: MetadataStore) -> None:
    await with_streams(store, 2)
    clock = Clock()
    members = GroupMembers(store, store.commit, clock)
    await members.heartbeat(beat("a", 0, streams=(1, 2)))
    with pytest.raises(FencedMemberEpochError):
        await members.heartbeat(beat("a", 5, owned=(1, 2)))
    with pytest.raises(UnknownMemberIdError):
        await members.heartbeat(beat("b", 3))
    clock.now += 3.1  # past the 3 s session
    async with trio.open_nursery() as nursery:
        nursery.start_soon(members.expire)
        await trio.sleep(0.3)
        nursery.cancel_scope.cancel()
    assert not members.has_members("g") and store.all_members() == []
    with pytest.raises(UnknownMemberIdError):
        await members.heartbeat(beat("a", 1, owned=(1, 2)))
    # bad input changes nothing
    for bad, error in (
        (Heartbeat("g", "x" * 65, 0, (1,)), InvalidRequestError),
        (Heartbeat("g", "m", 0, (1,), (), 500), InvalidRequestError),
        (Heartbeat("g", "m", 0, (1, 9)), StreamNotFoundError),
        (Heartbeat("g", "m", 0, ()), InvalidRequestError),
    ):
        with pytest.raises(error):
            await members.heartbeat(bad)
    assert store.all_members() == []


async def test_members_survive_a_new_leader_with_their_epochs(store: MetadataStore) -> None:
    await with_streams(store, 2)
    members = GroupMembers(store, store.commit, Clock())
    first = await members.heartbeat(beat("a", 0, streams=(1, 2)))
    # what a new leader loads from the metadata
    again = GroupMembers(store, store.commit, Clock())
    [kept] = again.members("g")
    assert kept.record.epoch == first.epoch and kept.record.held == (1, 2)
    answer = await again.heartbeat(beat("a", first.epoch, owned=(1, 2)))
    assert answer.epoch == first.epoch and answer.assigned == (1, 2)


async def check_member_store(store: Metadata) -> None:
    """What every metadata store does with members (run on LMDB here and on
    etcd in tests/integration/test_pm_etcd.py)."""
    from pm.changes import DeleteMember, PutMember

    member = MemberRecord("etl/daily", "m-1", 7, 45_000, (1, 2, 3), (2,))
    other = MemberRecord("etl/daily", "m/2", 1, 3000, (1,), ())
    await store.commit([PutMember(member), PutMember(other)])
    assert sorted(store.all_members(), key=lambda m: m.member_id) == [member, other]
    await store.commit([DeleteMember("etl/daily", "m-1")])
    assert store.all_members() == [other]


async def test_the_lmdb_store_keeps_members(store: MetadataStore) -> None:
    await check_member_store(store)


Action = tuple[str, int, int]  # what, member index, stream set index


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["join", "beat", "beat", "beat", "leave", "expire", "drop"]),
            st.integers(0, 3),
            st.integers(0, 2),
        ),
        min_size=1,
        max_size=40,
    )
)
def test_no_step_ever_has_a_stream_on_two_members(tmp_path: Path, actions: list[Action]) -> None:
    subscriptions = [(1, 2, 3, 4, 5), (1, 2, 3), (4, 5, 6)]

    async def run() -> None:
        store = MetadataStore(tmp_path / f"pm-{len(actions)}-{id(actions)}", map_size=64 << 20)
        try:
            await with_streams(store, 6)
            clock = Clock()
            members = GroupMembers(store, store.commit, clock)
            epochs: dict[str, int] = {}
            reading: dict[str, set[int]] = {}
            for what, index, subs in actions:
                name = f"m{index}"
                try:
                    if what == "join":
                        answer = await members.heartbeat(
                            Heartbeat(
                                "g",
                                name,
                                0,
                                subscriptions[subs],
                                tuple(reading.get(name, ())),
                                3000,
                            )
                        )
                    elif what in ("beat", "drop") and name in epochs:
                        if what == "drop" and reading.get(name):
                            reading[name].pop()  # it let go of one (a revoke it acted on)
                        answer = await members.heartbeat(
                            Heartbeat("g", name, epochs[name], (), tuple(reading[name]), 3000)
                        )
                    elif what == "leave" and name in epochs:
                        await members.heartbeat(Heartbeat("g", name, -1))
                        epochs.pop(name)
                        reading.pop(name, None)
                        continue
                    elif what == "expire" and name in epochs:
                        await members.remove("g", [name])
                        epochs.pop(name)
                        reading.pop(name, None)
                        continue
                    else:
                        continue
                except (UnknownMemberIdError, FencedMemberEpochError):
                    epochs.pop(name, None)
                    reading.pop(name, None)
                    continue
                epochs[name] = answer.epoch
                # the member reads what it may, and keeps what it still reads until it acts
                reading[name] = set(answer.assigned) | (
                    reading.get(name, set()) & set(answer.assigned)
                )
                held = [set(m.record.held) for m in members.members("g")]
                for i, first in enumerate(held):
                    for second in held[i + 1 :]:
                        assert not first & second, held
                reads = list(reading.values())
                for i, first in enumerate(reads):
                    for second in reads[i + 1 :]:
                        assert not first & second, reading
        finally:
            store.close()

    trio.run(run)
