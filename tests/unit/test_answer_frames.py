"""Answers that grow with the cluster, cut into frames and joined back
(sbp.answer_frames): LIST_RANGES, LIST_GROUPS, FETCH_OFFSETS."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from sbp import messages
from sbp.answer_frames import (
    FRAME_BYTES,
    fetch_offsets_frames,
    join_fetch_offsets,
    join_list_groups,
    join_list_ranges,
    list_groups_frames,
    list_ranges_frames,
    listing_bytes,
    position_bytes,
    range_bytes,
)
from sbp.enums import ErrorCode
from sbp.frames import MAX_HEADER_LENGTH


def a_range(stream_id: int, replicas: int = 3, host: str = "10.0.0.1") -> messages.Range:
    nodes = tuple(
        messages.ReplicaNode(
            data_node=messages.DataNode(node_id=n, advertise_addr=f"{host}:{9100 + n}"),
            is_primary=n == 0,
        )
        for n in range(replicas)
    )
    return messages.Range(
        stream_id=stream_id, range_index=7, start_offset=1 << 40, end_offset=1 << 41,
        next_offset=1 << 41, replica_nodes=nodes, epoch=3, commit_offset=1 << 41,
    )  # fmt: skip


def by_node(count: int, **kwargs: object) -> messages.ListRangesResult:
    owner = messages.RangeOwner(data_node=messages.DataNode(node_id=1, advertise_addr="n1:1"))
    ranges = tuple(a_range(i, **kwargs) for i in range(count))  # type: ignore[arg-type]
    return messages.ListRangesResult(range_owner=owner, ranges=ranges)


def test_a_small_answer_is_one_plain_frame() -> None:
    results = (by_node(10),)
    [frame] = list_ranges_frames(results)
    assert frame == messages.ListRangesResponse(list_responses=results)
    assert join_list_ranges([frame]) == frame


def test_the_estimate_bounds_the_range_bytes() -> None:
    for replicas, host in ((0, ""), (1, "h"), (3, "10.0.0.1"), (5, "x" * 250)):
        rng = a_range(1, replicas, host)
        alone = len(messages.ListRangesResponse(list_responses=(by_node(0),)).encode())
        many = messages.ListRangesResult(range_owner=by_node(0).range_owner, ranges=(rng,) * 100)
        encoded = len(messages.ListRangesResponse(list_responses=(many,)).encode())
        assert (encoded - alone) / 100 <= range_bytes(rng)


def test_a_node_with_too_many_ranges_for_one_frame_answers_in_several() -> None:
    # five replicas with long host names: over the 16 MiB a header holds
    results = (by_node(14_000, replicas=5, host="h" * 200),)
    assert len(messages.ListRangesResponse(list_responses=results).encode()) > MAX_HEADER_LENGTH
    frames = list(list_ranges_frames(results))
    assert len(frames) > 1
    for frame in frames:
        assert len(frame.encode()) <= FRAME_BYTES < MAX_HEADER_LENGTH
    decoded = [messages.ListRangesResponse.decode(frame.encode()) for frame in frames]
    assert join_list_ranges(decoded).list_responses == results


def test_a_result_is_cut_only_inside_and_goes_on_in_the_next_frame() -> None:
    # each range ~350 bytes: 3 ranges per 1,200-byte frame
    error = messages.ListRangesResult(
        range_owner=messages.RangeOwner(stream_id=9),
        error_code=ErrorCode.STREAM_NOT_FOUND,
        error_message="no stream 9",
    )
    results = (by_node(4), error, by_node(2), by_node(3))
    frames = list(list_ranges_frames(results, frame_bytes=1_200))
    assert [[len(r.ranges) for r in f.list_responses] for f in frames] == [
        [3],
        [1, 0, 2, 0],
        [3],
    ]
    assert join_list_ranges(frames).list_responses == results


@given(
    counts=st.lists(st.integers(min_value=0, max_value=12), max_size=6),
    frame_bytes=st.integers(min_value=1, max_value=3_000),
)
def test_joining_the_frames_gives_back_the_answer(counts: list[int], frame_bytes: int) -> None:
    results = tuple(by_node(count, replicas=count % 4) for count in counts)
    frames = list(list_ranges_frames(results, frame_bytes))
    assert join_list_ranges(frames).list_responses == results
    # every frame but the last ends inside a result, which the next goes on with
    for before, after in itertools.pairwise(frames):
        assert before.list_responses[-1].range_owner == after.list_responses[0].range_owner
    for frame in frames:
        sizes = [range_bytes(rng) for result in frame.list_responses for rng in result.ranges]
        assert sum(sizes) <= frame_bytes or len(sizes) == 1


def a_listing(group: str, count: int) -> messages.GroupListing:
    return messages.GroupListing(
        group=group, stream_ids=tuple(range(1 << 50, (1 << 50) + count)), last_commit_ms=1 << 40
    )


def a_position(stream_id: int, metadata: str = "", error: str = "") -> messages.GroupOffsetResult:
    return messages.GroupOffsetResult(
        stream_id=stream_id, error_code=ErrorCode.NONE if not error else ErrorCode.UNKNOWN,
        error_message=error, offset=1 << 40, metadata=metadata, commit_time_ms=1 << 40,
        end_offset=1 << 41, lag_records=1 << 40,
    )  # fmt: skip


def test_the_group_estimates_bound_the_encoded_sizes() -> None:
    for name in ("g", "é" * 127):
        empty = len(messages.ListGroupsResponse().encode())
        one = len(messages.ListGroupsResponse(groups=(a_listing(name, 0),)).encode())
        many = len(messages.ListGroupsResponse(groups=(a_listing(name, 1000),)).encode())
        assert one - empty <= listing_bytes(a_listing(name, 0))
        assert (many - one) / 1000 <= 8
    for metadata, error in (("", ""), ("m" * 4096, ""), ("", "why " * 50), ("é" * 2000, "x")):
        position = a_position(1, metadata, error)
        alone = len(messages.FetchOffsetsResponse().encode())
        many = len(messages.FetchOffsetsResponse(fetch_responses=(position,) * 100).encode())
        assert (many - alone) / 100 <= position_bytes(position)


def test_a_group_with_too_many_positions_for_one_frame_is_listed_in_several() -> None:
    # 2.2 M stream ids of one group, beside two small ones: over 16 MiB
    listings = (a_listing("a", 3), a_listing("b" * 255, 2_200_000), a_listing("c", 5))
    whole = messages.ListGroupsResponse(groups=listings)
    assert len(whole.encode()) > MAX_HEADER_LENGTH
    frames = list(list_groups_frames(listings))
    assert len(frames) > 1
    for frame in frames:
        assert len(frame.encode()) <= FRAME_BYTES + 64 < MAX_HEADER_LENGTH
    decoded = [messages.ListGroupsResponse.decode(frame.encode()) for frame in frames]
    assert join_list_groups(decoded) == whole


def test_a_group_listing_is_cut_only_inside_and_goes_on_in_the_next_frame() -> None:
    # each listing 65 bytes besides its ids, each id 8: 200-byte frames
    listings = (a_listing("a", 10), a_listing("b", 0), a_listing("c", 30))
    frames = list(list_groups_frames(listings, frame_bytes=200))
    assert [[(g.group, len(g.stream_ids)) for g in f.groups] for f in frames] == [
        [("a", 10), ("b", 0), ("c", 0)],
        [("c", 16)],
        [("c", 14)],
    ]
    assert join_list_groups(frames).groups == listings
    [empty] = list(list_groups_frames(()))
    assert empty == messages.ListGroupsResponse()


def test_a_group_with_too_many_positions_for_one_frame_answers_in_several() -> None:
    # 5,000 positions with 4 KiB of metadata each: 20 MiB
    positions = tuple(a_position(i, metadata="m" * 4096) for i in range(5_000))
    whole = messages.FetchOffsetsResponse(fetch_responses=positions)
    assert len(whole.encode()) > MAX_HEADER_LENGTH
    frames = list(fetch_offsets_frames(positions))
    per_frame = FRAME_BYTES // position_bytes(positions[0])
    assert len(frames) == -(-len(positions) // per_frame)  # 6
    for frame in frames:
        assert len(frame.encode()) <= FRAME_BYTES
    decoded = [messages.FetchOffsetsResponse.decode(frame.encode()) for frame in frames]
    assert join_fetch_offsets(decoded) == whole


@given(
    counts=st.lists(st.integers(min_value=0, max_value=20), max_size=6),
    frame_bytes=st.integers(min_value=1, max_value=600),
)
def test_joining_group_frames_gives_back_the_answer(counts: list[int], frame_bytes: int) -> None:
    listings = tuple(a_listing(str(i), count) for i, count in enumerate(counts))
    frames = list(list_groups_frames(listings, frame_bytes))
    assert join_list_groups(frames).groups == listings
    for before, after in itertools.pairwise(frames):
        assert before.groups[-1].group == after.groups[0].group
    positions = tuple(a_position(i, metadata="m" * count) for i, count in enumerate(counts))
    parts = list(fetch_offsets_frames(positions, frame_bytes))
    assert join_fetch_offsets(parts).fetch_responses == positions
    for part in parts:
        sizes = [position_bytes(p) for p in part.fetch_responses]
        assert sum(sizes) <= frame_bytes or len(sizes) == 1
