"""The replica state rules (datanode/replica_state.py) over a real storage
engine: each state of a range replica, the transitions that lead to it,
and what each lets a FETCH read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from datanode.replica_state import ReplicaState, ReplicaStates
from datanode.waiters import StreamWaiters
from sbp.batches import build_batch, stamp_base_offset
from sbp.errors import NotPrimaryError, RangeSealedError
from storage import RangeInfo, ReplicaBatch, ReplicaInfo, StorageEngine

HERE, OTHER = 1, 2
STREAM = 5


def replicas(primary: int) -> tuple[ReplicaInfo, ...]:
    other = OTHER if primary == HERE else HERE
    return (
        ReplicaInfo(primary, f"127.0.0.1:{9000 + primary}", True),
        ReplicaInfo(other, f"127.0.0.1:{9000 + other}", False),
    )


def stamped(base_offset: int, count: int) -> ReplicaBatch:
    batch = build_batch([b"v%d" % i for i in range(count)], 1000)
    stamp_base_offset(batch, base_offset)
    return ReplicaBatch(STREAM, 0, 0, base_offset, batch, count)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[StorageEngine]:
    with StorageEngine(tmp_path / "node", node_id=HERE, map_size=64 << 20) as opened:
        yield opened


def states(engine: StorageEngine) -> ReplicaStates:
    return ReplicaStates(HERE, engine, StreamWaiters())


def only_range(engine: StorageEngine) -> RangeInfo:
    [info] = engine.list_ranges(STREAM)
    return info


def test_an_open_range_is_leading_or_following_by_its_primary(engine: StorageEngine) -> None:
    replica = states(engine)
    engine.sync_ranges(STREAM, [RangeInfo(STREAM, 0, 0, replicas=replicas(HERE))]).result()
    assert replica.state_of(only_range(engine)) is ReplicaState.LEADING
    assert replica.leads(STREAM)
    engine.sync_ranges(STREAM, [RangeInfo(STREAM, 0, 0, replicas=replicas(OTHER))]).result()
    assert replica.state_of(only_range(engine)) is ReplicaState.FOLLOWING
    assert not replica.leads(STREAM)


def test_a_restart_fences_the_replicated_ranges_led_here(engine: StorageEngine) -> None:
    """LEADING -> FENCED: appends are refused until the PM seals the range;
    an unreplicated range led here and a range followed here go on."""
    engine.sync_ranges(STREAM, [RangeInfo(STREAM, 0, 0, replicas=replicas(HERE))]).result()
    alone = (ReplicaInfo(HERE, "127.0.0.1:9001", True),)
    engine.sync_ranges(STREAM + 1, [RangeInfo(STREAM + 1, 0, 0, replicas=alone)]).result()
    followed = RangeInfo(STREAM + 2, 0, 0, replicas=replicas(OTHER))
    engine.sync_ranges(STREAM + 2, [followed]).result()
    replica = states(engine)

    assert replica.fence_after_restart() == [STREAM]
    assert replica.state_of(only_range(engine)) is ReplicaState.FENCED
    with pytest.raises(RangeSealedError):
        engine.append(STREAM, build_batch([b"x"], 1)).result()
    assert engine.append(STREAM + 1, build_batch([b"x"], 1)).result().base_offset == 0
    [info] = engine.list_ranges(STREAM + 2)
    assert replica.state_of(info) is ReplicaState.FOLLOWING


def test_a_seal_here_then_the_pm_end_then_catch_up(engine: StorageEngine) -> None:
    """FOLLOWING -> SEALED_HERE (at what it holds) -> SHORT (the PM's end
    is past it) -> WHOLE (the rest copied)."""
    engine.sync_ranges(STREAM, [RangeInfo(STREAM, 0, 0, replicas=replicas(OTHER))]).result()
    assert engine.replicate([stamped(0, 2)]).result() == [2]
    replica = states(engine)

    sealed = engine.seal_range(STREAM, 0).result()
    assert (sealed.end_offset, replica.state_of(sealed)) == (2, ReplicaState.SEALED_HERE)
    assert replica.unsettled(STREAM) == [sealed]

    pm_view = [
        RangeInfo(STREAM, 0, 0, 5, replicas=replicas(OTHER)),
        RangeInfo(STREAM, 1, 5, replicas=replicas(OTHER)),
    ]
    engine.sync_ranges(STREAM, pm_view).result()
    first = engine.list_ranges(STREAM)[0]
    assert (first.end_offset, replica.state_of(first)) == (5, ReplicaState.SHORT)
    assert replica.unsettled(STREAM) == []

    assert engine.catch_up([stamped(2, 3)]).result() == 5
    assert replica.state_of(engine.list_ranges(STREAM)[0]) is ReplicaState.WHOLE


def test_reads_stop_at_the_commit_offset_and_wait_for_it_after_a_restart(
    engine: StorageEngine,
) -> None:
    """A follower that holds records of an open range but has not learned
    its commit offset refuses to serve them (NOT_PRIMARY, a reader tries
    another replica) rather than answer nothing; once told, it serves up
    to the commit offset, and a read past what it holds waits."""
    engine.sync_ranges(STREAM, [RangeInfo(STREAM, 0, 0, replicas=replicas(OTHER))]).result()
    assert engine.replicate([stamped(0, 4)]).result() == [4]
    replica = states(engine)

    with pytest.raises(NotPrimaryError, match="does not know the commit offset"):
        replica.read_limit(STREAM, 0)
    assert replica.commits.advance(STREAM, 0, 3)
    assert not replica.commits.advance(STREAM, 0, 2)  # never moves back
    assert replica.read_limit(STREAM, 0) == 3
    assert replica.commit_of(only_range(engine)) == 3
    assert replica.waits_past_end(STREAM, 9, replica.read_limit(STREAM, 9))


def test_the_commit_offset_of_sealed_and_unreplicated_ranges(engine: StorageEngine) -> None:
    replica = states(engine)
    alone = (ReplicaInfo(HERE, "127.0.0.1:9001", True),)
    engine.sync_ranges(STREAM, [RangeInfo(STREAM, 0, 0, replicas=alone)]).result()
    engine.append(STREAM, build_batch([b"a", b"b"], 1)).result()
    info = only_range(engine)
    assert replica.commit_of(info) == info.next_offset == 2
    assert replica.read_limit(STREAM, 0) is None  # nothing replicated to wait for
    assert not replica.waits_past_end(STREAM, 5, None)  # refused, as ever

    sealed = RangeInfo(STREAM + 1, 0, 0, 7, replicas=replicas(OTHER))
    engine.sync_ranges(STREAM + 1, [sealed]).result()
    [held] = engine.list_ranges(STREAM + 1)
    assert replica.commit_of(held) == 7  # the PM's end is final
