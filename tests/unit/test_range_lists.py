"""LIST_RANGES answers cut into frames and joined back (sbp.range_lists)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from sbp import messages
from sbp.enums import ErrorCode
from sbp.frames import MAX_HEADER_LENGTH
from sbp.range_lists import FRAME_RANGE_BYTES, encoded_size, join_list_frames, list_frames


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
    [frame] = list_frames(results)
    assert frame == messages.ListRangesResponse(list_responses=results)
    assert join_list_frames([frame]) == frame


def test_the_estimate_bounds_the_encoded_size() -> None:
    for replicas, host in ((0, ""), (1, "h"), (3, "10.0.0.1"), (5, "x" * 250)):
        rng = a_range(1, replicas, host)
        alone = len(messages.ListRangesResponse(list_responses=(by_node(0),)).encode())
        many = messages.ListRangesResult(range_owner=by_node(0).range_owner, ranges=(rng,) * 100)
        encoded = len(messages.ListRangesResponse(list_responses=(many,)).encode())
        assert (encoded - alone) / 100 <= encoded_size(rng)


def test_a_node_with_too_many_ranges_for_one_frame_answers_in_several() -> None:
    # five replicas with long host names: over the 16 MiB a header holds
    results = (by_node(14_000, replicas=5, host="h" * 200),)
    assert len(messages.ListRangesResponse(list_responses=results).encode()) > MAX_HEADER_LENGTH
    frames = list(list_frames(results))
    assert len(frames) > 1
    for frame in frames:
        assert len(frame.encode()) <= FRAME_RANGE_BYTES < MAX_HEADER_LENGTH
    decoded = [messages.ListRangesResponse.decode(frame.encode()) for frame in frames]
    assert join_list_frames(decoded).list_responses == results


def test_a_result_is_cut_only_inside_and_goes_on_in_the_next_frame() -> None:
    # each range ~350 bytes: 3 ranges per 1,200-byte frame
    error = messages.ListRangesResult(
        range_owner=messages.RangeOwner(stream_id=9),
        error_code=ErrorCode.STREAM_NOT_FOUND,
        error_message="no stream 9",
    )
    results = (by_node(4), error, by_node(2), by_node(3))
    frames = list(list_frames(results, frame_bytes=1_200))
    assert [[len(r.ranges) for r in f.list_responses] for f in frames] == [
        [3],
        [1, 0, 2, 0],
        [3],
    ]
    assert join_list_frames(frames).list_responses == results


@given(
    counts=st.lists(st.integers(min_value=0, max_value=12), max_size=6),
    frame_bytes=st.integers(min_value=1, max_value=3_000),
)
def test_joining_the_frames_gives_back_the_answer(counts: list[int], frame_bytes: int) -> None:
    results = tuple(by_node(count, replicas=count % 4) for count in counts)
    frames = list(list_frames(results, frame_bytes))
    assert join_list_frames(frames).list_responses == results
    # every frame but the last ends inside a result, which the next goes on with
    for before, after in itertools.pairwise(frames):
        assert before.list_responses[-1].range_owner == after.list_responses[0].range_owner
    for frame in frames:
        sizes = [encoded_size(rng) for result in frame.list_responses for rng in result.ranges]
        assert sum(sizes) <= frame_bytes or len(sizes) == 1
