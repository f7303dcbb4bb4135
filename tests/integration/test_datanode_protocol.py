"""Every opcode a data node serves, checked on the wire (SPEC §1-§5), and every
kind of bad frame from a raw socket, against a node process started per test."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator

import pytest
import trio

from client.datanode_client import DataNodeClient
from sbp import messages
from sbp.batches import build_batch, decode_batches, peek_header
from sbp.constants import (
    DEFAULT_MAX_FRAME_LENGTH,
    FIXED_HEADER,
    MAGIC,
    OPEN_END_OFFSET,
    SERVER_STREAM_ID_BIT,
)
from sbp.enums import ClientRole, ErrorCode, Flags, Opcode
from sbp.frames import DiscardedFrame, Frame, encode_frame

from .conftest import DataNodes, append_request, fetch_request, hosted_range
from .procs import RawConnection, ServerProcess

pytestmark = pytest.mark.integration

END = Flags.RESPONSE | Flags.RESPONSE_END
SYSTEM_ERROR_END = END | Flags.SYSTEM_ERROR


@pytest.fixture
async def node(datanodes: DataNodes) -> AsyncIterator[ServerProcess]:
    yield await datanodes.start(1)


@pytest.fixture
async def raw(node: ServerProcess) -> AsyncIterator[RawConnection]:
    connection = await RawConnection.open(node.address)
    try:
        yield connection
    finally:
        await connection.aclose()


async def raw_sync(raw: RawConnection, *ranges: messages.Range) -> messages.SyncRangesResponse:
    request = messages.SyncRangesRequest(
        stream_ranges=tuple(
            messages.StreamRanges(stream_id=r.stream_id, ranges=(r,)) for r in ranges
        )
    )
    (frame,) = await raw.call(Opcode.SYNC_RANGES, request, stream_id=900)
    assert frame.flags == END
    return messages.SyncRangesResponse.decode(frame.header)


async def raw_append(
    raw: RawConnection, items: list[tuple[int, bytes | bytearray]], stream_id: int = 10
) -> messages.AppendResponse:
    header, payload = append_request(items)
    frames = await raw.call(Opcode.APPEND, header, payload, stream_id=stream_id)
    assert frames[-1].flags == END
    results: list[messages.AppendResult] = []
    for frame in frames:
        results += messages.AppendResponse.decode(frame.header).append_responses
    return messages.AppendResponse(append_responses=tuple(results))


def system_error(frame: Frame) -> messages.SystemErrorHeader:
    assert frame.flags == SYSTEM_ERROR_END, frame
    return messages.SystemErrorHeader.decode(frame.header)


def batch_of(*values: bytes) -> bytearray:
    return build_batch(list(values), base_timestamp=1_700_000_000_000)


async def test_ping_is_echoed(raw: RawConnection) -> None:
    (frame,) = await raw.call(Opcode.PING, b"opaque-header", b"some payload", stream_id=77)
    assert (frame.opcode, frame.flags, frame.stream_id) == (Opcode.PING, END, 77)
    assert frame.header == b"opaque-header"
    assert bytes(frame.payload) == b"some payload"


async def test_heartbeat_describes_the_node(raw: RawConnection, node: ServerProcess) -> None:
    request = messages.HeartbeatRequest(client_id="pm-1", client_role=ClientRole.PM)
    (frame,) = await raw.call(Opcode.HEARTBEAT, request, stream_id=3)
    assert frame.flags == END
    response = messages.HeartbeatResponse.decode(frame.header)
    assert response.client_id == "pm-1"
    assert response.client_role == ClientRole.DATA_NODE
    assert response.data_node == messages.DataNode(node_id=1, advertise_addr=node.address)


async def test_sync_append_fetch_on_the_wire(raw: RawConnection, node: ServerProcess) -> None:
    synced = await raw_sync(raw, hosted_range(5, node), hosted_range(6, node, start=100))
    assert [(r.stream_id, r.error_code) for r in synced.sync_responses] == [(5, 0), (6, 0)]
    assert synced.sync_responses[1].ranges[0].next_offset == 100

    first, second, third = batch_of(b"a", b"bb"), batch_of(b"ccc"), batch_of(b"d", b"e", b"f")
    appended = await raw_append(raw, [(5, first), (6, second), (5, third)])
    by_index = {r.request_index: r for r in appended.append_responses}
    assert [(by_index[i].stream_id, by_index[i].base_offset) for i in range(3)] == [
        (5, 0),
        (6, 100),
        (5, 2),
    ]
    assert all(r.error_code == ErrorCode.NONE for r in appended.append_responses)
    assert all(r.stream_append_time_ms > 1_700_000_000_000 for r in appended.append_responses)

    frames = await raw.call(Opcode.FETCH, fetch_request((5, 0), (6, 100)), stream_id=11)
    results: list[messages.FetchResult] = []
    payload = b""
    for frame in frames:
        results += messages.FetchResponse.decode(frame.header).fetch_responses
        payload += bytes(frame.payload)
    assert frames[-1].flags == END
    assert {r.stream_id: r.batch_length for r in results} == {
        5: len(first) + len(third),
        6: len(second),
    }
    # Each result's batches follow in result order, base offsets stamped by the node.
    position = 0
    decoded: dict[int, list[tuple[int, bytes]]] = {}
    for result in results:
        chunk = payload[position : position + result.batch_length]
        position += result.batch_length
        records = decode_batches(chunk)
        decoded[result.stream_id] = list(
            zip(records.offsets.tolist(), records.to_list(), strict=True)
        )
    assert position == len(payload)
    assert decoded == {
        5: [(0, b"a"), (1, b"bb"), (2, b"d"), (3, b"e"), (4, b"f")],
        6: [(100, b"ccc")],
    }

    # FETCH from the middle of a batch returns that whole batch.
    (frame,) = await raw.call(Opcode.FETCH, fetch_request((5, 3)), stream_id=12)
    (result,) = messages.FetchResponse.decode(frame.header).fetch_responses
    assert peek_header(bytes(frame.payload)).base_offset == 2
    assert result.batch_length == len(third)


async def test_fetch_of_many_streams_answers_each_from_its_batches(
    raw: RawConnection, node: ServerProcess
) -> None:
    """More items than a pass keeps read transactions open for (8): the
    first items' batches go out from LMDB's map, the later ones copied;
    every item's batches arrive in order with their own base offsets."""
    streams = list(range(20, 32))
    await raw_sync(raw, *(hosted_range(s, node, start=1000 * s) for s in streams))
    expected: dict[int, list[tuple[int, bytes]]] = {}
    for round_ in range(3):
        items = [(s, batch_of(b"%d-%d" % (s, round_), b"x" * s)) for s in streams]
        await raw_append(raw, items, stream_id=20 + round_)
        for s in streams:
            expected.setdefault(s, []).extend(
                [
                    (1000 * s + 2 * round_, b"%d-%d" % (s, round_)),
                    (1000 * s + 2 * round_ + 1, b"x" * s),
                ]
            )
    frames = await raw.call(
        Opcode.FETCH, fetch_request(*((s, 1000 * s) for s in streams)), stream_id=30
    )
    decoded: dict[int, list[tuple[int, bytes]]] = {}
    for frame in frames:
        position = 0
        for result in messages.FetchResponse.decode(frame.header).fetch_responses:
            assert result.error_code == ErrorCode.NONE
            chunk = bytes(frame.payload[position : position + result.batch_length])
            position += result.batch_length
            records = decode_batches(chunk)
            decoded[result.stream_id] = list(
                zip(records.offsets.tolist(), records.to_list(), strict=True)
            )
        assert position == len(frame.payload)
    assert decoded == expected


async def test_append_items_fail_alone(raw: RawConnection, node: ServerProcess) -> None:
    await raw_sync(raw, hosted_range(20, node), hosted_range(21, node, node_id=1, primary=False))
    corrupt = batch_of(b"xyz")
    corrupt[-1] ^= 0xFF  # breaks the CRC-32C
    appended = await raw_append(
        raw,
        [(20, batch_of(b"ok")), (20, corrupt), (999, batch_of(b"no stream")), (21, batch_of(b"r"))],
    )
    codes = {r.request_index: (r.error_code, r.base_offset) for r in appended.append_responses}
    assert codes[0] == (ErrorCode.NONE, 0)
    assert codes[1][0] == ErrorCode.INVALID_RECORD_BATCH
    assert codes[2][0] == ErrorCode.RANGE_NOT_FOUND
    assert codes[3][0] == ErrorCode.NOT_PRIMARY
    # The good item's successor gets the next offset: nothing of the bad ones was applied.
    again = await raw_append(raw, [(20, batch_of(b"next"))])
    assert again.append_responses[0].base_offset == 1


async def test_append_payload_size_mismatch_is_invalid_request(
    raw: RawConnection, node: ServerProcess
) -> None:
    await raw_sync(raw, hosted_range(30, node))
    batch = batch_of(b"v")
    header, payload = append_request([(30, batch)])
    (frame,) = await raw.call(Opcode.APPEND, header, payload + b"extra", stream_id=5)
    assert system_error(frame).error_code == ErrorCode.INVALID_REQUEST
    # Nothing was appended.
    appended = await raw_append(raw, [(30, batch)])
    assert appended.append_responses[0].base_offset == 0


async def test_seal_describe_list_and_sealed_errors(
    raw: RawConnection, node: ServerProcess
) -> None:
    await raw_sync(raw, hosted_range(40, node))
    await raw_append(raw, [(40, batch_of(b"1", b"2", b"3"))])

    (frame,) = await raw.call(
        Opcode.DESCRIBE_RANGES,
        messages.DescribeRangesRequest(ranges=(messages.RangeId(stream_id=40, range_index=0),)),
        stream_id=2,
    )
    (described,) = messages.DescribeRangesResponse.decode(frame.header).describe_responses
    assert described.range is not None
    assert (described.range.end_offset, described.range.next_offset) == (OPEN_END_OFFSET, 3)

    seal = messages.SealRangesRequest(ranges=(messages.RangeId(stream_id=40, range_index=0),))
    (frame,) = await raw.call(Opcode.SEAL_RANGES, seal, stream_id=3)
    (sealed,) = messages.SealRangesResponse.decode(frame.header).seal_responses
    assert sealed.error_code == ErrorCode.NONE
    assert [(r.end_offset, r.next_offset) for r in sealed.ranges] == [(3, 3)]
    # Sealing again returns the same state (an idempotent retry).
    (frame,) = await raw.call(Opcode.SEAL_RANGES, seal, stream_id=4)
    (again,) = messages.SealRangesResponse.decode(frame.header).seal_responses
    assert again == sealed

    appended = await raw_append(raw, [(40, batch_of(b"late"))])
    assert appended.append_responses[0].error_code == ErrorCode.RANGE_SEALED
    (frame,) = await raw.call(Opcode.FETCH, fetch_request((40, 3), max_wait_ms=5000), stream_id=6)
    (result,) = messages.FetchResponse.decode(frame.header).fetch_responses
    assert result.error_code == ErrorCode.RANGE_SEALED

    owners = (
        messages.RangeOwner(stream_id=40),
        messages.RangeOwner(data_node=messages.DataNode(node_id=1, advertise_addr=node.address)),
        messages.RangeOwner(data_node=messages.DataNode(node_id=2)),
    )
    (frame,) = await raw.call(
        Opcode.LIST_RANGES, messages.ListRangesRequest(range_owners=owners), stream_id=7
    )
    by_stream, by_node, other_node = messages.ListRangesResponse.decode(frame.header).list_responses
    assert [(r.stream_id, r.end_offset) for r in by_stream.ranges] == [(40, 3)]
    assert (40, 0) in {(r.stream_id, r.range_index) for r in by_node.ranges}
    assert other_node.error_code == ErrorCode.DATA_NODE_NOT_FOUND


async def test_a_node_with_more_ranges_than_a_frame_holds_lists_them_in_several(
    raw: RawConnection, node: ServerProcess
) -> None:
    count = 50_000  # ~9 MB of ranges: over the 4 MiB of ranges a frame is given
    for first in range(0, count, 10_000):
        await raw_sync(raw, *(hosted_range(s, node) for s in range(first, first + 10_000)))
    owner = messages.RangeOwner(data_node=messages.DataNode(node_id=1, advertise_addr=node.address))
    frames = await raw.call(
        Opcode.LIST_RANGES, messages.ListRangesRequest(range_owners=(owner,)), stream_id=8
    )
    assert len(frames) >= 2
    assert [frame.flags for frame in frames] == [Flags.RESPONSE] * (len(frames) - 1) + [END]
    answers = [messages.ListRangesResponse.decode(frame.header) for frame in frames]
    for answer in answers:  # each frame a part of the one result, in order
        (part,) = answer.list_responses
        assert (part.range_owner, part.error_code) == (owner, ErrorCode.NONE)
    listed = [r.stream_id for answer in answers for r in answer.list_responses[0].ranges]
    assert sorted(listed) == list(range(count))
    async with DataNodeClient(node.address, timeout=30) as client:
        ranges = await client.list_node_ranges(owner.data_node)  # type: ignore[arg-type]
    assert [r.stream_id for r in ranges] == listed


async def test_fetch_errors(raw: RawConnection, node: ServerProcess) -> None:
    await raw_sync(raw, hosted_range(50, node, start=10))
    await raw_append(raw, [(50, batch_of(b"x"))])
    frames = await raw.call(
        Opcode.FETCH, fetch_request((50, 12), (50, 5), (4242, 0), (50, 11)), stream_id=8
    )
    results = [
        result
        for frame in frames
        for result in messages.FetchResponse.decode(frame.header).fetch_responses
    ]
    codes = {r.request_index: (r.error_code, r.batch_length) for r in results}
    assert codes == {
        0: (ErrorCode.OFFSET_OUT_OF_RANGE, 0),
        1: (ErrorCode.OFFSET_OUT_OF_RANGE, 0),
        2: (ErrorCode.RANGE_NOT_FOUND, 0),
        3: (ErrorCode.NONE, 0),  # the tail, max_wait_ms 0: an empty answer
    }


async def test_delete_streams_refuses_writes(raw: RawConnection, node: ServerProcess) -> None:
    await raw_sync(raw, hosted_range(60, node))
    await raw_append(raw, [(60, batch_of(b"gone soon"))])
    request = messages.DeleteStreamsRequest(streams=(messages.Stream(stream_id=60),))
    (frame,) = await raw.call(Opcode.DELETE_STREAMS, request, stream_id=9)
    (deleted,) = messages.DeleteStreamsResponse.decode(frame.header).delete_responses
    assert deleted.error_code == ErrorCode.NONE
    assert deleted.deleted_stream == messages.Stream(stream_id=60)
    appended = await raw_append(raw, [(60, batch_of(b"more"))])
    assert appended.append_responses[0].error_code == ErrorCode.STREAM_DELETED


@pytest.mark.parametrize(
    "opcode",
    [
        Opcode.CREATE_STREAMS,
        Opcode.UPDATE_STREAMS,
        Opcode.GET_STREAMS,
        Opcode.TRIM_STREAMS,
        Opcode.REPORT_METRICS,
        Opcode.DESCRIBE_CLUSTER,
    ],
)
async def test_pm_opcodes_are_unsupported(raw: RawConnection, opcode: Opcode) -> None:
    (frame,) = await raw.call(opcode, b"", stream_id=13)
    assert frame.opcode == opcode
    assert system_error(frame).error_code == ErrorCode.UNSUPPORTED_OPERATION


# -- bad frames (SPEC §1) ---------------------------------------------------------


async def assert_alive(raw: RawConnection) -> None:
    (frame,) = await raw.call(Opcode.PING, b"", b"still there", stream_id=4000)
    assert bytes(frame.payload) == b"still there"


async def test_bad_magic_and_unknown_opcode_are_discarded(raw: RawConnection) -> None:
    good = encode_frame(Opcode.PING, 0, 1, b"", b"p")
    bad_magic = bytearray(good)
    bad_magic[4] = MAGIC + 1
    unknown = bytearray(good)
    struct.pack_into(">H", unknown, 5, 0x7777)
    await raw.send(bytes(bad_magic) + bytes(unknown))
    await assert_alive(raw)


async def test_bad_header_format_and_checksum_get_system_errors(raw: RawConnection) -> None:
    frame = bytearray(encode_frame(Opcode.PING, 0, 21, b"", b"payload"))
    frame[12] = 0x02  # header_format
    await raw.send(bytes(frame))
    answer = await raw.next_frame()
    assert answer.stream_id == 21
    assert system_error(answer).error_code == ErrorCode.INVALID_REQUEST

    frame = bytearray(encode_frame(Opcode.PING, 0, 22, b"", b"payload"))
    frame[-1] ^= 0x01  # checksum
    await raw.send(bytes(frame))
    answer = await raw.next_frame()
    assert answer.stream_id == 22
    assert system_error(answer).error_code == ErrorCode.CHECKSUM_MISMATCH
    await assert_alive(raw)


async def test_undecodable_header_is_invalid_request(raw: RawConnection) -> None:
    (frame,) = await raw.call(Opcode.APPEND, b"\xff\xff\xff\x7f garbage", b"", stream_id=23)
    assert system_error(frame).error_code == ErrorCode.INVALID_REQUEST
    # A required field missing (FetchRequest without fetch_requests).
    (frame,) = await raw.call(Opcode.FETCH, messages.DescribeClusterRequest(), stream_id=24)
    assert system_error(frame).error_code == ErrorCode.INVALID_REQUEST
    await assert_alive(raw)


async def test_unexpected_response_is_discarded(raw: RawConnection) -> None:
    await raw.send_frame(Opcode.PING, b"", b"", stream_id=25, flags=END)
    await raw.send_frame(Opcode.HEARTBEAT, b"", b"", stream_id=26, flags=SYSTEM_ERROR_END)
    await assert_alive(raw)


async def test_duplicate_stream_id_is_refused_and_the_first_goes_on(
    raw: RawConnection, node: ServerProcess
) -> None:
    await raw_sync(raw, hosted_range(70, node))
    # A long poll holds stream id 31 while the same id arrives again.
    await raw.send_frame(Opcode.FETCH, fetch_request((70, 0), max_wait_ms=20_000), stream_id=31)
    await raw.send_frame(Opcode.PING, b"", b"", stream_id=31)
    refusal = await raw.next_frame()
    assert refusal.stream_id == 31
    assert system_error(refusal).error_code == ErrorCode.INVALID_REQUEST
    # The waiting FETCH is still served: an append wakes it.
    header, payload = append_request([(70, batch_of(b"wake"))])
    await raw.send_frame(Opcode.APPEND, header, payload, stream_id=32)
    answers: dict[int, Frame] = {}
    while len(answers) < 2:
        frame = await raw.next_frame()
        answers[frame.stream_id] = frame
    fetched = messages.FetchResponse.decode(answers[31].header).fetch_responses
    assert answers[31].flags == END
    assert fetched[0].batch_length == len(batch_of(b"wake"))


@pytest.mark.parametrize(
    ("frame_length", "code"),
    [(DEFAULT_MAX_FRAME_LENGTH + 1, ErrorCode.FRAME_TOO_LARGE), (15, ErrorCode.INVALID_REQUEST)],
)
async def test_unframeable_input_gets_goaway_and_close(
    node: ServerProcess, raw: RawConnection, frame_length: int, code: ErrorCode
) -> None:
    bystander = await RawConnection.open(node.address)
    await assert_alive(bystander)
    await raw.send(FIXED_HEADER.pack(frame_length, MAGIC, Opcode.PING, 0, 1) + b"\x00" * 8)
    seen = await raw.wait_closed()
    goaways = [e for e in seen if isinstance(e, Frame) and e.opcode == Opcode.GOAWAY]
    assert len(goaways) == 1
    assert goaways[0].stream_id & SERVER_STREAM_ID_BIT
    assert not goaways[0].is_response
    assert messages.GoAway.decode(goaways[0].header).error_code == code
    # Logged (at most once per 10 s per kind: a flood of them is one line).
    assert f"WARNING net.connection: {code.name} from " in node.log()
    # Another connection is unaffected, and new ones are accepted.
    await assert_alive(bystander)
    await bystander.aclose()
    fresh = await RawConnection.open(node.address)
    await assert_alive(fresh)
    await fresh.aclose()


async def test_discarded_frames_do_not_desynchronise_the_stream(raw: RawConnection) -> None:
    """Many bad frames back to back, split at awkward byte boundaries."""
    good = encode_frame(Opcode.PING, 0, 50, b"", b"after")
    bad = bytearray(encode_frame(Opcode.PING, 0, 51, b"", b"x" * 100))
    bad[4] = 0
    stream = bytes(bad) * 20 + good
    for start in range(0, len(stream), 37):
        await raw.send(stream[start : start + 37])
        await trio.sleep(0)
    frame = await raw.next_frame()
    assert (frame.stream_id, bytes(frame.payload)) == (50, b"after")
    assert not isinstance(frame, DiscardedFrame)
