"""The pure rules of a replica's stored transitions (SPEC §7): a seal here,
each range of the PM's view against the one held, the fence after a
failed commit."""

from __future__ import annotations

from sbp.constants import OPEN_END_OFFSET
from storage.model import RangeInfo, ReplicaInfo
from storage.replica_transitions import fenced_by_failed_commit, seal_here, sync_range

HERE, OTHER, THIRD = 1, 2, 3


def a_range(
    *nodes: int, start: int = 0, end: int = OPEN_END_OFFSET, sealed_here: bool = False
) -> RangeInfo:
    replicas = tuple(
        ReplicaInfo(node, f"127.0.0.1:{9000 + node}", index == 0)
        for index, node in enumerate(nodes)
    )
    return RangeInfo(7, 2, start, end, 1, replicas, sealed_here=sealed_here)


def test_a_seal_ends_an_open_range_at_what_is_held_and_marks_it_sealed_here() -> None:
    sealed = seal_here(a_range(HERE, OTHER, start=100), held_next=140)
    assert (sealed.end_offset, sealed.sealed_here, sealed.end_is_final) == (140, True, False)


def test_a_seal_of_a_range_holding_nothing_ends_it_at_its_start() -> None:
    # the stream's next offset is below the range's start until a batch lands in it
    assert seal_here(a_range(HERE, start=100), held_next=90).end_offset == 100


def test_a_seal_is_one_way() -> None:
    sealed = a_range(HERE, OTHER, start=100, end=120)
    assert seal_here(sealed, held_next=200) is sealed


def test_a_range_new_here_takes_the_pms_view_without_local_fields() -> None:
    incoming = RangeInfo(7, 2, 0, OPEN_END_OFFSET, 1, a_range(HERE).replicas, deleted=True)
    synced = sync_range(None, incoming, held_next=0, node_id=HERE)
    assert synced.info.deleted is False
    assert (synced.excess_from, synced.moved_off) == (None, False)


def test_a_range_sealed_here_stays_sealed_while_the_pm_still_shows_it_open() -> None:
    local = a_range(HERE, OTHER, start=100, end=130, sealed_here=True)
    synced = sync_range(local, a_range(HERE, OTHER, start=100), held_next=130, node_id=HERE)
    assert (synced.info.end_offset, synced.info.sealed_here) == (130, True)
    assert (synced.excess_from, synced.moved_off) == (None, False)


def test_the_pms_end_below_what_is_held_drops_the_excess() -> None:
    local = a_range(HERE, OTHER, start=100, end=130, sealed_here=True)
    synced = sync_range(local, a_range(HERE, OTHER, start=100, end=120), 130, HERE)
    assert (synced.info.end_offset, synced.info.end_is_final) == (120, True)
    assert synced.excess_from == 120


def test_an_open_replica_sealed_by_the_pm_below_its_next_offset_drops_the_excess() -> None:
    synced = sync_range(
        a_range(OTHER, HERE, start=100), a_range(OTHER, HERE, start=100, end=110), 125, HERE
    )
    assert synced.excess_from == 110


def test_the_pms_end_at_or_above_what_is_held_drops_nothing() -> None:
    local = a_range(HERE, OTHER, start=100, end=120, sealed_here=True)
    for end in (120, 150):  # at: WHOLE; above: SHORT, catch-up copies the rest
        synced = sync_range(local, a_range(HERE, OTHER, start=100, end=end), 120, HERE)
        assert synced.excess_from is None
        assert synced.info.end_offset == end


def test_a_sealed_range_moved_to_other_nodes_drops_its_records_here() -> None:
    local = a_range(HERE, OTHER, start=0, end=50)
    synced = sync_range(local, a_range(OTHER, THIRD, start=0, end=50), 80, HERE)
    assert synced.moved_off is True


def test_an_open_range_moved_off_keeps_its_records_until_sealed() -> None:
    synced = sync_range(a_range(HERE, OTHER), a_range(OTHER, THIRD), 80, HERE)
    assert synced.moved_off is False


def test_a_range_sealed_here_and_moved_off_in_an_older_view_drops_its_records() -> None:
    local = a_range(HERE, OTHER, start=0, end=50, sealed_here=True)
    synced = sync_range(local, a_range(OTHER, THIRD, start=0), 50, HERE)
    assert (synced.info.end_offset, synced.moved_off) == (50, True)


def test_a_failed_commit_fences_only_the_ranges_of_streams_handed_on() -> None:
    appended = [(7, 2), (8, 0), (9, 4)]
    assert fenced_by_failed_commit(appended, {7, 9}) == {(7, 2), (9, 4)}
    assert fenced_by_failed_commit(appended, set()) == set()
