"""sbp.messages: the opcode registry, field conventions, and the decode
failures that must all become HeaderDecodeError."""

from __future__ import annotations

import struct

import flatbuffers
import pytest

from sbp import messages as m
from sbp.enums import ClientRole, ErrorCode, Flags, Opcode
from sbp.errors import HeaderDecodeError, InvalidRequestError, ProtocolError, error_for
from tests.unit.message_strategies import MESSAGE_TYPES

# --------------------------------------------------------------------------- registry

REQUESTS = {
    Opcode.PING: None,
    Opcode.GOAWAY: m.GoAway,
    Opcode.HEARTBEAT: m.HeartbeatRequest,
    Opcode.APPEND: m.AppendRequest,
    Opcode.FETCH: m.FetchRequest,
    Opcode.REPLICATE: m.ReplicateRequest,
    Opcode.LIST_RANGES: m.ListRangesRequest,
    Opcode.SEAL_RANGES: m.SealRangesRequest,
    Opcode.SYNC_RANGES: m.SyncRangesRequest,
    Opcode.DESCRIBE_RANGES: m.DescribeRangesRequest,
    Opcode.CREATE_STREAMS: m.CreateStreamsRequest,
    Opcode.DELETE_STREAMS: m.DeleteStreamsRequest,
    Opcode.UPDATE_STREAMS: m.UpdateStreamsRequest,
    Opcode.GET_STREAMS: m.GetStreamsRequest,
    Opcode.TRIM_STREAMS: m.TrimStreamsRequest,
    Opcode.REPORT_METRICS: m.ReportMetricsRequest,
    Opcode.DESCRIBE_CLUSTER: m.DescribeClusterRequest,
    Opcode.INIT_PRODUCER: m.InitProducerRequest,
    Opcode.PRODUCER_STATE: m.ProducerStateRequest,
    Opcode.DRAIN_DATA_NODES: m.DrainDataNodesRequest,
    Opcode.RANGE_HOLDINGS: m.RangeHoldingsRequest,
    Opcode.REMOVE_DATA_NODES: m.RemoveDataNodesRequest,
    Opcode.REBALANCE: m.RebalanceRequest,
    Opcode.DESCRIBE_MEMBERS: m.DescribeMembersRequest,
    Opcode.COMPACTION_KEYS: m.CompactionKeysRequest,
    Opcode.COMPACT_RANGES: m.CompactRangesRequest,
    Opcode.UPLOAD_RANGE: m.UploadRangeRequest,
    Opcode.FIND_OFFSETS: m.FindOffsetsRequest,
    Opcode.COMMIT_OFFSETS: m.CommitOffsetsRequest,
    Opcode.FETCH_OFFSETS: m.FetchOffsetsRequest,
    Opcode.LIST_GROUPS: m.ListGroupsRequest,
    Opcode.DELETE_GROUPS: m.DeleteGroupsRequest,
    Opcode.GROUP_HEARTBEAT: m.GroupHeartbeatRequest,
}
RESPONSES = {
    Opcode.PING: None,
    Opcode.GOAWAY: None,
    Opcode.HEARTBEAT: m.HeartbeatResponse,
    Opcode.APPEND: m.AppendResponse,
    Opcode.FETCH: m.FetchResponse,
    Opcode.REPLICATE: m.ReplicateResponse,
    Opcode.LIST_RANGES: m.ListRangesResponse,
    Opcode.SEAL_RANGES: m.SealRangesResponse,
    Opcode.SYNC_RANGES: m.SyncRangesResponse,
    Opcode.DESCRIBE_RANGES: m.DescribeRangesResponse,
    Opcode.CREATE_STREAMS: m.CreateStreamsResponse,
    Opcode.DELETE_STREAMS: m.DeleteStreamsResponse,
    Opcode.UPDATE_STREAMS: m.UpdateStreamsResponse,
    Opcode.GET_STREAMS: m.GetStreamsResponse,
    Opcode.TRIM_STREAMS: m.TrimStreamsResponse,
    Opcode.REPORT_METRICS: m.ReportMetricsResponse,
    Opcode.DESCRIBE_CLUSTER: m.DescribeClusterResponse,
    Opcode.INIT_PRODUCER: m.InitProducerResponse,
    Opcode.PRODUCER_STATE: m.ProducerStateResponse,
    Opcode.DRAIN_DATA_NODES: m.DrainDataNodesResponse,
    Opcode.RANGE_HOLDINGS: m.RangeHoldingsResponse,
    Opcode.REMOVE_DATA_NODES: m.RemoveDataNodesResponse,
    Opcode.REBALANCE: m.RebalanceResponse,
    Opcode.DESCRIBE_MEMBERS: m.DescribeMembersResponse,
    Opcode.COMPACTION_KEYS: m.CompactionKeysResponse,
    Opcode.COMPACT_RANGES: m.CompactRangesResponse,
    Opcode.UPLOAD_RANGE: m.UploadRangeResponse,
    Opcode.FIND_OFFSETS: m.FindOffsetsResponse,
    Opcode.COMMIT_OFFSETS: m.CommitOffsetsResponse,
    Opcode.FETCH_OFFSETS: m.FetchOffsetsResponse,
    Opcode.LIST_GROUPS: m.ListGroupsResponse,
    Opcode.DELETE_GROUPS: m.DeleteGroupsResponse,
    Opcode.GROUP_HEARTBEAT: m.GroupHeartbeatResponse,
}


def test_tables_cover_every_opcode() -> None:
    assert set(REQUESTS) == set(RESPONSES) == set(Opcode)


@pytest.mark.parametrize("opcode", list(Opcode), ids=lambda op: op.name)
def test_registry_maps_every_opcode(opcode: Opcode) -> None:
    assert m.request_type(opcode) is REQUESTS[opcode]
    assert m.response_type(opcode) is RESPONSES[opcode]
    assert m.request_type(int(opcode)) is REQUESTS[opcode]


def test_registry_returns_none_for_unknown_opcodes() -> None:
    assert m.request_type(0x7777) is None
    assert m.response_type(0x7777) is None


def test_header_type_follows_the_flags() -> None:
    response = Flags.RESPONSE | Flags.RESPONSE_END
    assert m.header_type(Opcode.APPEND, Flags.NONE) is m.AppendRequest
    assert m.header_type(Opcode.APPEND, response) is m.AppendResponse
    assert m.header_type(Opcode.APPEND, Flags.RESPONSE) is m.AppendResponse
    assert m.header_type(Opcode.APPEND, response | Flags.SYSTEM_ERROR) is m.SystemErrorHeader
    assert m.header_type(Opcode.PING, response | Flags.SYSTEM_ERROR) is m.SystemErrorHeader
    assert m.header_type(Opcode.PING, response) is None
    assert m.header_type(Opcode.GOAWAY, Flags.NONE) is m.GoAway


def test_every_registered_type_is_a_message() -> None:
    registered = {t for t in (*REQUESTS.values(), *RESPONSES.values()) if t is not None}
    assert registered | {m.SystemErrorHeader} <= set(MESSAGE_TYPES)


# --------------------------------------------------------------------------- conventions


def test_defaults_match_the_schema() -> None:
    assert m.Range() == m.Range.decode(m.Range().encode())
    assert m.Range().end_offset == -1
    assert m.Range().is_open
    assert not m.Range(end_offset=10).is_open
    result = m.FetchResult.decode(m.FetchResult().encode())
    assert result.error_code is ErrorCode.NONE
    assert result.error_message == ""
    assert m.HeartbeatRequest().client_role is ClientRole.UNKNOWN
    assert m.GetStreamsRequest().stream_ids == ()


def test_fields_decode_to_their_python_types() -> None:
    request = m.HeartbeatRequest(
        client_id="client-ü", client_role=ClientRole.DATA_NODE, data_node=m.DataNode(3, "h:1")
    )
    decoded = m.HeartbeatRequest.decode(request.encode())
    assert decoded.client_role is ClientRole.DATA_NODE
    assert decoded.client_id == "client-ü"
    assert decoded.data_node == m.DataNode(node_id=3, advertise_addr="h:1")
    status = m.DataNodeStatus.decode(m.DataNodeStatus(m.DataNode(1), alive=True).encode())
    assert status.alive is True
    get = m.GetStreamsRequest.decode(m.GetStreamsRequest(stream_ids=[1, 2]).encode())  # type: ignore[arg-type]
    assert get.stream_ids == (1, 2)
    names = m.DeleteGroupsRequest(groups=("etl", "", "ü" * 100))
    assert m.DeleteGroupsRequest.decode(names.encode()).groups == ("etl", "", "ü" * 100)
    assert m.DeleteGroupsRequest.decode(m.DeleteGroupsRequest().encode()).groups == ()


def test_unknown_error_codes_are_kept_as_ints() -> None:
    decoded = m.FetchResult.decode(m.FetchResult(error_code=999).encode())
    assert decoded.error_code == 999
    assert not isinstance(decoded.error_code, ErrorCode)
    error = error_for(decoded.error_code)
    assert type(error) is ProtocolError
    assert error.code == 999


def test_known_error_codes_decode_to_members() -> None:
    decoded = m.AppendResult.decode(m.AppendResult(error_code=102).encode())
    assert decoded.error_code is ErrorCode.RANGE_SEALED


def _generated_heartbeat(role: int) -> bytes:
    from sbp._fbs import HeartbeatRequest as Generated

    builder = flatbuffers.Builder(64)
    Generated.Start(builder)
    Generated.AddClientRole(builder, role)
    builder.Finish(Generated.End(builder))
    return bytes(builder.Output())


def test_unknown_client_roles_read_as_unknown() -> None:
    assert m.HeartbeatRequest.decode(_generated_heartbeat(2)).client_role is ClientRole.DATA_NODE
    assert m.HeartbeatRequest.decode(_generated_heartbeat(9)).client_role is ClientRole.UNKNOWN


def test_empty_strings_and_absent_tables_are_not_written() -> None:
    bare = m.SystemErrorHeader(ErrorCode.UNKNOWN).encode()
    with_text = m.SystemErrorHeader(ErrorCode.UNKNOWN, "x").encode()
    assert len(with_text) > len(bare)
    assert m.SystemErrorHeader.decode(bare).error_message == ""


def test_encoding_is_deterministic_and_shares_vtables() -> None:
    results = tuple(m.FetchResult(stream_id=i, batch_length=10) for i in range(10))
    encoded = m.FetchResponse(fetch_responses=results).encode()
    assert encoded == m.FetchResponse(fetch_responses=results).encode()
    # FetchResult's vtable: 4 + 2 * 5 fields bytes, object size 28; written once.
    assert encoded.count(struct.pack("<HH", 14, 28)) == 1


def test_encode_rejects_values_outside_their_wire_type() -> None:
    with pytest.raises(ValueError, match=r"AppendInfo\.stream_id"):
        m.AppendRequest(append_requests=(m.AppendInfo(stream_id=1 << 63),)).encode()
    with pytest.raises(ValueError, match=r"Stream\.replica_nums"):
        m.Stream(replica_nums=128).encode()
    with pytest.raises(ValueError, match="vector element"):
        m.GetStreamsRequest(stream_ids=(1, -(1 << 63) - 1)).encode()


# --------------------------------------------------------------------------- decode failures


@pytest.mark.parametrize(
    "cls", [t for t in REQUESTS.values() if t is not None], ids=lambda t: t.__name__
)
def test_an_empty_header_does_not_decode(cls: type[m.Message]) -> None:
    with pytest.raises(HeaderDecodeError):
        cls.decode(b"")


def test_header_decode_error_is_an_invalid_request() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        m.AppendRequest.decode(b"\x00")
    assert caught.value.code is ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize(
    ("cls", "field"),
    [
        (m.AppendRequest, "append_requests"),
        (m.FetchRequest, "fetch_requests"),
        (m.ListRangesRequest, "range_owners"),
        (m.SealRangesRequest, "ranges"),
        (m.SyncRangesRequest, "stream_ranges"),
        (m.DescribeRangesRequest, "ranges"),
        (m.CreateStreamsRequest, "streams"),
        (m.DeleteStreamsRequest, "streams"),
        (m.UpdateStreamsRequest, "streams"),
        (m.TrimStreamsRequest, "trimmed_streams"),
        (m.ReportMetricsRequest, "data_node"),
    ],
)
def test_a_missing_required_field_does_not_decode(cls: type[m.Message], field: str) -> None:
    # A table with no fields at all: a 4-byte vtable and the soffset.
    bare = struct.pack("<IHHi", 8, 4, 4, 4)
    with pytest.raises(HeaderDecodeError, match=field):
        cls.decode(bare)


def test_required_fields_may_be_empty_vectors() -> None:
    decoded = m.AppendRequest.decode(m.AppendRequest(timeout_ms=5).encode())
    assert decoded == m.AppendRequest(timeout_ms=5, append_requests=())


def test_a_missing_required_sub_table_inside_a_vector_does_not_decode() -> None:
    from sbp._fbs import RangeDescriptor, ReplicaNode

    builder = flatbuffers.Builder(64)
    ReplicaNode.Start(builder)
    ReplicaNode.AddIsPrimary(builder, True)
    replica = ReplicaNode.End(builder)
    RangeDescriptor.StartReplicaNodesVector(builder, 1)
    builder.PrependUOffsetTRelative(replica)
    replicas = builder.EndVector()
    RangeDescriptor.Start(builder)
    RangeDescriptor.AddReplicaNodes(builder, replicas)
    builder.Finish(RangeDescriptor.End(builder))
    with pytest.raises(HeaderDecodeError, match="data_node"):
        m.Range.decode(bytes(builder.Output()))


def _replace_once(buf: bytes, old: bytes, new: bytes) -> bytes:
    assert buf.count(old) == 1
    return buf.replace(old, new)


def test_invalid_utf8_does_not_decode() -> None:
    encoded = m.SystemErrorHeader(ErrorCode.UNKNOWN, "abc").encode()
    with pytest.raises(HeaderDecodeError, match="UnicodeDecodeError"):
        m.SystemErrorHeader.decode(_replace_once(encoded, b"abc", b"a\xff\xfe"))


def test_a_vector_longer_than_the_buffer_does_not_decode() -> None:
    items = tuple(m.AppendInfo(stream_id=100 + i, batch_length=77) for i in range(3))
    encoded = m.AppendRequest(timeout_ms=50, append_requests=items).encode()
    forged = _replace_once(encoded, struct.pack("<I", 3), struct.pack("<I", 1 << 30))
    with pytest.raises(HeaderDecodeError, match="overruns"):
        m.AppendRequest.decode(forged)


def test_a_string_longer_than_the_buffer_does_not_decode() -> None:
    encoded = m.GoAway(ErrorCode.SHUTTING_DOWN, "bye").encode()
    forged = _replace_once(encoded, struct.pack("<I", 3) + b"bye", struct.pack("<I", 4000) + b"bye")
    with pytest.raises(HeaderDecodeError, match="overruns"):
        m.GoAway.decode(forged)


@pytest.mark.parametrize("root", [8, 1 << 31, 0xFFFFFFFF])
def test_a_root_offset_outside_the_buffer_does_not_decode(root: int) -> None:
    with pytest.raises(HeaderDecodeError):
        m.FetchRequest.decode(struct.pack("<II", root, 0))


def test_a_vtable_outside_the_buffer_does_not_decode() -> None:
    with pytest.raises(HeaderDecodeError, match="vtable"):
        m.FetchRequest.decode(struct.pack("<Ii", 4, -100))


def test_a_field_outside_its_table_does_not_decode() -> None:
    # vtable: 6 bytes, object size 4, field 0 at offset 40 (past the object)
    forged = struct.pack("<IHHHxxi", 12, 6, 4, 40, 8)
    with pytest.raises(HeaderDecodeError, match="outside its table"):
        m.DescribeClusterRequest.decode(forged)


def test_shared_sub_objects_cannot_multiply_decode_work() -> None:
    """Thousands of vector entries pointing at one big string would make a
    small buffer decode into megabytes; the reader gives up instead."""
    from sbp._fbs import FetchResponse as GeneratedResponse
    from sbp._fbs import FetchResult as GeneratedResult

    builder = flatbuffers.Builder(16384)
    message = builder.CreateString("x" * 4000)
    GeneratedResult.Start(builder)
    GeneratedResult.AddErrorMessage(builder, message)
    result = GeneratedResult.End(builder)
    count = 2000
    GeneratedResponse.StartFetchResponsesVector(builder, count)
    for _ in range(count):
        builder.PrependUOffsetTRelative(result)
    results = builder.EndVector()
    GeneratedResponse.Start(builder)
    GeneratedResponse.AddFetchResponses(builder, results)
    builder.Finish(GeneratedResponse.End(builder))
    forged = bytes(builder.Output())
    assert len(forged) < 13_000
    with pytest.raises(HeaderDecodeError, match="too many times"):
        m.FetchResponse.decode(forged)


def test_a_few_shared_sub_objects_still_decode() -> None:
    from sbp._fbs import FetchResponse as GeneratedResponse
    from sbp._fbs import FetchResult as GeneratedResult

    builder = flatbuffers.Builder(1024)
    message = builder.CreateString("shared")
    GeneratedResult.Start(builder)
    GeneratedResult.AddErrorMessage(builder, message)
    result = GeneratedResult.End(builder)
    GeneratedResponse.StartFetchResponsesVector(builder, 2)
    builder.PrependUOffsetTRelative(result)
    builder.PrependUOffsetTRelative(result)
    results = builder.EndVector()
    GeneratedResponse.Start(builder)
    GeneratedResponse.AddFetchResponses(builder, results)
    builder.Finish(GeneratedResponse.End(builder))
    decoded = m.FetchResponse.decode(bytes(builder.Output()))
    assert decoded.fetch_responses == (m.FetchResult(error_message="shared"),) * 2


def test_overlapping_fields_written_by_someone_else_still_decode() -> None:
    # AppendInfo with stream_id and request_index both at table offset 4.
    stream_id = (5 << 32) | 7
    forged = struct.pack("<IHHHHHxxiq", 16, 10, 12, 4, 4, 0, 12, stream_id)
    assert m.AppendInfo.decode(forged) == m.AppendInfo(stream_id=stream_id, request_index=7)


def test_headers_without_the_producer_fields_decode_with_their_defaults() -> None:
    """A writer that omits SPEC §10's fields (an older one, or one that
    leaves defaults out) is read as not idempotent: producer_id 0 and
    next_sequence -1 (bytes from before the fields existed)."""
    appended = m.AppendResponse.decode(
        bytes.fromhex(
            "0c00000008000c000400080008000000000000000400000002000000180000004c00000010002800"
            "04001c000c00140020000000100000002a00000000000000dc0500000000000000a8da769b010000"
            "0000000000000000000000001000280004001c000c00140020002400100000002b00000000000000"
            "000000000000000000000000000000000100000066000000040000001400000072616e6765203433"
            "2f30206973207365616c656400"
        )
    )
    assert [r.next_sequence for r in appended.append_responses] == [-1, -1]
    assert appended.append_responses[0].base_offset == 1500
    replicated = m.ReplicateRequest.decode(
        bytes.fromhex(
            "0c00000008000c000400080008000000881300000400000002000000180000004400000010002c00"
            "040024000c00140028001c00100000002a000000000000000100000000000000dc05000000000000"
            "dc05000000000000000000003100000000000000400000002b000000000000000100000000000000"
            "00000000000000004d000000000000000200000000000000"
        )
    )
    first = replicated.replicate_requests[0]
    assert (first.base_offset, first.commit_offset) == (1500, 1500)
    assert (first.producer_id, first.producer_epoch, first.base_sequence) == (0, 0, 0)
