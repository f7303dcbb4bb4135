"""Write the golden frame vectors in tests/vectors/frames/ (one JSON file each).

Run ``python tests/vectors/make_frame_vectors.py`` after a deliberate change
to the wire format, and review the diff: tests/unit/test_vectors_frames.py
compares the codec against the committed files, not against this script.

Each file holds the whole frame in hex and what it decodes to: opcode,
flags, stream id, the header's table and fields (``dataclasses.asdict`` of
the sbp.messages value; enums as their wire numbers), and the raw header and
payload in hex.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

from sbp import messages as m
from sbp.constants import SERVER_STREAM_ID_BIT
from sbp.enums import ClientRole, ErrorCode, Flags, Opcode
from sbp.frames import encode_frame

OUT_DIR = Path(__file__).resolve().parent / "frames"
RESPONSE = Flags.RESPONSE | Flags.RESPONSE_END
TIMESTAMP_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z

_BATCH_PREFIX = struct.Struct(">qiBI")  # base_offset, batch_length, magic, crc
_BATCH_BODY_HEAD = struct.Struct(">hiq")  # flags, record_count, base_timestamp


def crc32c_bitwise(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected) one bit at a time, the definition:
    independent of the implementation under test (tests/unit/test_batches.py
    checks that one against it), fast enough for small bodies."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def record_batch(base_offset: int, values: list[bytes]) -> bytes:
    """A record batch as SPEC §4 lays it out, so that the APPEND and FETCH
    vectors carry realistic payloads (the frame itself treats them as opaque)."""
    body = _BATCH_BODY_HEAD.pack(0, len(values), TIMESTAMP_MS)
    body += struct.pack(f">{len(values)}I", *map(len, values)) + b"".join(values)
    crc = crc32c_bitwise(body)
    batch_length = 1 + 4 + len(body)  # magic, crc, then the body
    return _BATCH_PREFIX.pack(base_offset, batch_length, 1, crc) + body


NODE_1 = m.DataNode(node_id=1, advertise_addr="10.0.0.1:9201")
NODE_2 = m.DataNode(node_id=2, advertise_addr="10.0.0.2:9201")
OPEN_RANGE = m.Range(
    stream_id=42,
    range_index=1,
    start_offset=1000,
    next_offset=1500,
    replica_nodes=(m.ReplicaNode(NODE_1, is_primary=True), m.ReplicaNode(NODE_2)),
    epoch=3,
)
SEALED_RANGE = dataclasses.replace(OPEN_RANGE, range_index=0, start_offset=0, end_offset=1000)
STREAM = m.Stream(stream_id=42, replica_nums=2, retention_period_ms=86_400_000, epoch=3)
APPEND_BATCHES = [record_batch(-1, [b"hello", b"world"]), record_batch(-1, [b"\x00\xff"])]
FETCHED_BATCH = record_batch(1500, [b"hello", b"world"])


@dataclasses.dataclass(frozen=True)
class Vector:
    name: str
    description: str
    opcode: Opcode
    flags: Flags
    stream_id: int
    header: m.Message | bytes = b""  # bytes: PING's opaque header
    payload: bytes = b""


VECTORS = [
    Vector("ping_request", "the smallest frame: PING without header or payload",
           Opcode.PING, Flags.NONE, 0),
    Vector("ping_request_opaque", "PING with opaque header bytes and a payload, both echoed",
           Opcode.PING, Flags.NONE, 5, b"\x01\x02\x03\x04", b"keepalive"),
    Vector("ping_response", "the answer to ping_request_opaque",
           Opcode.PING, RESPONSE, 5, b"\x01\x02\x03\x04", b"keepalive"),
    Vector("goaway", "a server draining: a frame it starts, so the id's top bit is set",
           Opcode.GOAWAY, Flags.NONE, SERVER_STREAM_ID_BIT,
           m.GoAway(ErrorCode.SHUTTING_DOWN, "server shutting down")),
    Vector("system_error_response", "APPEND sent to the placement manager",
           Opcode.APPEND, RESPONSE | Flags.SYSTEM_ERROR, 9,
           m.SystemErrorHeader(ErrorCode.UNSUPPORTED_OPERATION, "APPEND is not served here")),
    Vector("heartbeat_request", "a data node registering with the PM",
           Opcode.HEARTBEAT, Flags.NONE, 1,
           m.HeartbeatRequest("datanode-1", ClientRole.DATA_NODE, NODE_1)),
    Vector("heartbeat_response", "the PM's answer: client_id echoed, the responder's role",
           Opcode.HEARTBEAT, RESPONSE, 1, m.HeartbeatResponse("datanode-1", ClientRole.PM)),
    Vector("append_request", "two batches for two streams; payload = the batches in order",
           Opcode.APPEND, Flags.NONE, 2,
           m.AppendRequest(5000, (
               m.AppendInfo(42, 0, len(APPEND_BATCHES[0])),
               m.AppendInfo(43, 1, len(APPEND_BATCHES[1])),
           )),
           b"".join(APPEND_BATCHES)),
    Vector("append_response", "one item appended, one failed on a sealed range",
           Opcode.APPEND, RESPONSE, 2,
           m.AppendResponse(0, (
               m.AppendResult(42, 0, 1500, TIMESTAMP_MS),
               m.AppendResult(43, 1, 0, 0, ErrorCode.RANGE_SEALED, "range 43/0 is sealed"),
           ))),
    Vector("append_request_idempotent", "an idempotent producer's batch (SPEC §10)",
           Opcode.APPEND, Flags.NONE, 16,
           m.AppendRequest(5000, (
               m.AppendInfo(42, 0, len(APPEND_BATCHES[0]), 9, 3, 120),
           )),
           APPEND_BATCHES[0]),
    Vector("append_response_out_of_order_sequence", "a gap in the producer's sequences",
           Opcode.APPEND, RESPONSE, 16,
           m.AppendResponse(0, (
               m.AppendResult(42, 0, 0, 0, ErrorCode.OUT_OF_ORDER_SEQUENCE, "expected 118", 118),
           ))),
    Vector("replicate_request", "a primary sends one stamped batch, then the commit offset alone",
           Opcode.REPLICATE, Flags.NONE, 4,
           m.ReplicateRequest(5000, (
               m.ReplicateInfo(42, 0, 1, 1500, len(FETCHED_BATCH), 1500),
               m.ReplicateInfo(43, 2, 1, 0, 0, 77),
           )),
           FETCHED_BATCH),
    Vector("replicate_response", "one batch held, one gap: resend from next_offset",
           Opcode.REPLICATE, RESPONSE, 4,
           m.ReplicateResponse(0, (
               m.ReplicateResult(42, 0, ErrorCode.NONE, "", 1502),
               m.ReplicateResult(43, 2, ErrorCode.OUT_OF_ORDER, "expected 80", 80),
           ))),
    Vector("fetch_request", "a long poll for one stream",
           Opcode.FETCH, Flags.NONE, 3,
           m.FetchRequest(500, 1, (m.FetchInfo(42, 0, 1500, 1 << 20),))),
    Vector("fetch_response_partial", "a first response frame: more follow (no RESPONSE_END)",
           Opcode.FETCH, Flags.RESPONSE, 3,
           m.FetchResponse(0, (m.FetchResult(42, 0, batch_length=len(FETCHED_BATCH)),)),
           FETCHED_BATCH),
    Vector("fetch_response", "the last frame: an item whose wait ran out",
           Opcode.FETCH, RESPONSE, 3,
           m.FetchResponse(0, (m.FetchResult(43, 1, ErrorCode.NONE, "", 0),))),
    Vector("list_ranges_request", "by stream and by data node",
           Opcode.LIST_RANGES, Flags.NONE, 4,
           m.ListRangesRequest(1000, (m.RangeOwner(stream_id=42), m.RangeOwner(NODE_2)))),
    Vector("list_ranges_response", "every range of stream 42; data node 2 unknown",
           Opcode.LIST_RANGES, RESPONSE, 4,
           m.ListRangesResponse(0, (
               m.ListRangesResult(m.RangeOwner(stream_id=42), ranges=(SEALED_RANGE, OPEN_RANGE)),
               m.ListRangesResult(m.RangeOwner(NODE_2), ErrorCode.DATA_NODE_NOT_FOUND, "node 2"),
           ))),
    Vector("seal_ranges_request", "seal the open range of stream 42",
           Opcode.SEAL_RANGES, Flags.NONE, 5,
           m.SealRangesRequest(1000, (m.RangeId(42, 1),))),
    Vector("seal_ranges_response", "the sealed range and the next one",
           Opcode.SEAL_RANGES, RESPONSE, 5,
           m.SealRangesResponse(0, (
               m.SealRangesResult(42, ranges=(
                   dataclasses.replace(OPEN_RANGE, end_offset=1500),
                   dataclasses.replace(OPEN_RANGE, range_index=2, start_offset=1500),
               )),
           ))),
    Vector("sync_ranges_request", "the PM telling a data node its ranges",
           Opcode.SYNC_RANGES, Flags.NONE, SERVER_STREAM_ID_BIT | 1,
           m.SyncRangesRequest(2000, (m.StreamRanges(42, (SEALED_RANGE, OPEN_RANGE)),))),
    Vector("sync_ranges_response", "applied",
           Opcode.SYNC_RANGES, RESPONSE, SERVER_STREAM_ID_BIT | 1,
           m.SyncRangesResponse(0, (m.SyncRangesResult(42, ranges=(OPEN_RANGE,)),))),
    Vector("describe_ranges_request", "the live next offset of two ranges",
           Opcode.DESCRIBE_RANGES, Flags.NONE, 6,
           m.DescribeRangesRequest(1000, (m.RangeId(42, 1), m.RangeId(7, 0)))),
    Vector("describe_ranges_response", "one found, one not hosted here",
           Opcode.DESCRIBE_RANGES, RESPONSE, 6,
           m.DescribeRangesResponse(0, (
               m.DescribeRangeResult(42, range=OPEN_RANGE),
               m.DescribeRangeResult(7, ErrorCode.RANGE_NOT_FOUND, "range 7/0 not hosted"),
           ))),
    Vector("create_streams_request", "a stream with two replicas, kept one day",
           Opcode.CREATE_STREAMS, Flags.NONE, 7,
           m.CreateStreamsRequest(3000, (
               m.Stream(replica_nums=2, retention_period_ms=86_400_000),
           ))),
    Vector("create_streams_response", "the stream and its first writable range",
           Opcode.CREATE_STREAMS, RESPONSE, 7,
           m.CreateStreamsResponse(0, (
               m.CreateStreamResult(STREAM, range=dataclasses.replace(
                   SEALED_RANGE, end_offset=-1, next_offset=0)),
           ))),
    Vector("delete_streams_request", "only stream_id is read",
           Opcode.DELETE_STREAMS, Flags.NONE, 8, m.DeleteStreamsRequest(1000, (m.Stream(42),))),
    Vector("delete_streams_response", "deleted",
           Opcode.DELETE_STREAMS, RESPONSE, 8,
           m.DeleteStreamsResponse(0, (m.DeleteStreamResult(STREAM),))),
    Vector("update_streams_request", "a new retention period",
           Opcode.UPDATE_STREAMS, Flags.NONE, 10,
           m.UpdateStreamsRequest(1000, (dataclasses.replace(STREAM, retention_period_ms=0),))),
    Vector("update_streams_response", "throttled",
           Opcode.UPDATE_STREAMS, RESPONSE, 10,
           m.UpdateStreamsResponse(250, (
               m.UpdateStreamResult(error_code=ErrorCode.THROTTLED, error_message="slow down"),
           ))),
    Vector("get_streams_request", "two streams by id",
           Opcode.GET_STREAMS, Flags.NONE, 11, m.GetStreamsRequest(1000, (42, 43))),
    Vector("get_streams_request_paged", "every stream, a page of 100 after id 42",
           Opcode.GET_STREAMS, Flags.NONE, 12, m.GetStreamsRequest(1000, (), 42, 100)),
    Vector("get_streams_response", "one found, one not",
           Opcode.GET_STREAMS, RESPONSE, 11,
           m.GetStreamsResponse(0, (
               m.GetStreamResult(STREAM),
               m.GetStreamResult(m.Stream(43), ErrorCode.STREAM_NOT_FOUND, "no stream 43"),
           ))),
    Vector("trim_streams_request", "drop everything below offset 1200",
           Opcode.TRIM_STREAMS, Flags.NONE, 13,
           m.TrimStreamsRequest(1000, (m.TrimmedStream(42, 1200),))),
    Vector("trim_streams_response", "the stream's first range after the trim",
           Opcode.TRIM_STREAMS, RESPONSE, 13,
           m.TrimStreamsResponse(0, (
               m.TrimStreamResult(STREAM, range=dataclasses.replace(OPEN_RANGE, start_offset=1200)),
           ))),
    Vector("report_metrics_request", "a data node's load report",
           Opcode.REPORT_METRICS, Flags.NONE, 14,
           m.ReportMetricsRequest(
               NODE_1, disk_in_rate=52_428_800, disk_out_rate=10_485_760,
               disk_free_space=500 << 30, disk_unindexed_data_size=0, memory_used=256 << 20,
               uring_task_rate=180, uring_inflight_task_cnt=16, uring_pending_task_cnt=40,
               uring_task_avg_latency=2, network_append_rate=3000, network_fetch_rate=1200,
               network_failed_append_rate=1, network_failed_fetch_rate=0,
               network_append_avg_latency=4, network_fetch_avg_latency=1,
               range_missing_replica_cnt=0, range_active_cnt=12,
           )),
    Vector("report_metrics_response", "acknowledged",
           Opcode.REPORT_METRICS, RESPONSE, 14, m.ReportMetricsResponse(NODE_1)),
    Vector("describe_cluster_request", "what the PM knows of its data nodes",
           Opcode.DESCRIBE_CLUSTER, Flags.NONE, 15, m.DescribeClusterRequest(1000)),
    Vector("describe_cluster_response", "one live node with a report, one dead node",
           Opcode.DESCRIBE_CLUSTER, RESPONSE, 15,
           m.DescribeClusterResponse(0, (
               m.DataNodeStatus(NODE_1, True, TIMESTAMP_MS, m.ReportMetricsRequest(
                   NODE_1, disk_free_space=500 << 30, range_active_cnt=12), 12),
               m.DataNodeStatus(NODE_2, False, TIMESTAMP_MS - 60_000, None, 3),
           ))),
    Vector("init_producer_request", "a named producer fencing its older instance (epoch -1)",
           Opcode.INIT_PRODUCER, Flags.NONE, 17, m.InitProducerRequest(1000, "billing", -1)),
    Vector("init_producer_response", "its id and the epoch now in force",
           Opcode.INIT_PRODUCER, RESPONSE, 17, m.InitProducerResponse(0, 9, 4)),
    Vector("producer_state_request", "(private) a stream's producers as of offset 4000",
           Opcode.PRODUCER_STATE, Flags.NONE, 18, m.ProducerStateRequest(1000, 42, 4000)),
    Vector("producer_state_response", "(private) one producer with its two last batches",
           Opcode.PRODUCER_STATE, RESPONSE, 18,
           m.ProducerStateResponse(0, ErrorCode.NONE, "", (
               m.ProducerSnapshot(9, TIMESTAMP_MS, (
                   m.ProducerBatch(2, 100, 10, 3980), m.ProducerBatch(2, 110, 10, 3990),
               )),
           ))),
    Vector("find_offsets_request", "the first offset of range 3 appended at or after a time",
           Opcode.FIND_OFFSETS, Flags.NONE, 19,
           m.FindOffsetsRequest(1000, (m.FindOffset(42, 3, TIMESTAMP_MS),))),
    Vector("find_offsets_response", "found at 4000, appended 12 ms after the time asked",
           Opcode.FIND_OFFSETS, RESPONSE, 19,
           m.FindOffsetsResponse(0, (
               m.FindOffsetResult(42, 3, ErrorCode.NONE, "", 4000, TIMESTAMP_MS + 12),
           ))),
    Vector("commit_offsets_request", "group etl at 4000 of stream 42, with metadata",
           Opcode.COMMIT_OFFSETS, Flags.NONE, 20,
           m.CommitOffsetsRequest(1000, "etl", (m.GroupOffset(42, 4000, "run 7"),))),
    Vector("commit_offsets_response", "stored",
           Opcode.COMMIT_OFFSETS, RESPONSE, 20,
           m.CommitOffsetsResponse(0, (
               m.GroupOffsetResult(42, ErrorCode.NONE, "", 4000, "run 7", TIMESTAMP_MS),
           ))),
    Vector("fetch_offsets_request", "every position of group etl",
           Opcode.FETCH_OFFSETS, Flags.NONE, 21, m.FetchOffsetsRequest(1000, "etl", ())),
    Vector("fetch_offsets_response", "one position 96 records behind the stream's end",
           Opcode.FETCH_OFFSETS, RESPONSE, 21,
           m.FetchOffsetsResponse(0, (
               m.GroupOffsetResult(42, ErrorCode.NONE, "", 4000, "run 7", TIMESTAMP_MS, 4096, 96),
           ))),
    Vector("fetch_offsets_response_unknown_group", "no such group",
           Opcode.FETCH_OFFSETS, RESPONSE, 21,
           m.FetchOffsetsResponse(0, (), ErrorCode.GROUP_NOT_FOUND, "no group etl")),
    Vector("list_groups_request", "every group",
           Opcode.LIST_GROUPS, Flags.NONE, 22, m.ListGroupsRequest(1000)),
    Vector("list_groups_response", "one group with positions on two streams",
           Opcode.LIST_GROUPS, RESPONSE, 22,
           m.ListGroupsResponse(0, (m.GroupListing("etl", (42, 43), TIMESTAMP_MS),))),
    Vector("delete_groups_request", "forget two groups",
           Opcode.DELETE_GROUPS, Flags.NONE, 23, m.DeleteGroupsRequest(1000, ("etl", "old"))),
    Vector("delete_groups_response", "one forgotten, one unknown",
           Opcode.DELETE_GROUPS, RESPONSE, 23,
           m.DeleteGroupsResponse(0, (
               m.DeleteGroupResult("etl"),
               m.DeleteGroupResult("old", ErrorCode.GROUP_NOT_FOUND, "no group old"),
           ))),
    Vector("group_heartbeat_request", "a member joins, subscribing to streams 1, 2 and 3",
           Opcode.GROUP_HEARTBEAT, Flags.NONE, 25,
           m.GroupHeartbeatRequest(1000, "etl", "worker-a", 0, (1, 2, 3), (), 10_000)),
    Vector("group_heartbeat_response", "epoch 4, streams 1 and 3 to read",
           Opcode.GROUP_HEARTBEAT, RESPONSE, 25,
           m.GroupHeartbeatResponse(0, ErrorCode.NONE, "", 4, 3000, (1, 3))),
    Vector("drain_data_nodes_request", "drain nodes 1 and 7",
           Opcode.DRAIN_DATA_NODES, Flags.NONE, 24, m.DrainDataNodesRequest(1000, (1, 7), False)),
    Vector("drain_data_nodes_response", "node 1 draining, node 7 unknown",
           Opcode.DRAIN_DATA_NODES, RESPONSE, 24,
           m.DrainDataNodesResponse(0, (
               m.DrainResult(1, ErrorCode.NONE, "", 1),
               m.DrainResult(7, ErrorCode.DATA_NODE_NOT_FOUND, "no data node 7", 0),
           ))),
    Vector("range_holdings_request", "(private) what a replica holds of range 3 of stream 42",
           Opcode.RANGE_HOLDINGS, Flags.NONE, 25,
           m.RangeHoldingsRequest(1000, (m.RangeId(42, 3),))),
    Vector("range_holdings_response", "(private) held to offset 4000, 1 MiB",
           Opcode.RANGE_HOLDINGS, RESPONSE, 25,
           m.RangeHoldingsResponse(0, (m.RangeHolding(42, 3, ErrorCode.NONE, "", 4000, 1 << 20),))),
    Vector("remove_data_nodes_request", "(private) forget node 7",
           Opcode.REMOVE_DATA_NODES, Flags.NONE, 26, m.RemoveDataNodesRequest(1000, (7,))),
    Vector("remove_data_nodes_response", "(private) refused: it still holds ranges",
           Opcode.REMOVE_DATA_NODES, RESPONSE, 26,
           m.RemoveDataNodesResponse(0, (
               m.RemoveResult(7, ErrorCode.INVALID_REQUEST, "data node 7 holds 3 ranges"),
           ))),
    Vector("rebalance_request", "(private) the plan only",
           Opcode.REBALANCE, Flags.NONE, 27, m.RebalanceRequest(1000, True)),
    Vector("rebalance_response", "(private) one range of 1 MiB from node 1 to node 4",
           Opcode.REBALANCE, RESPONSE, 27,
           m.RebalanceResponse(0, ErrorCode.NONE, "", (m.RangeMove(42, 3, 1, 4, 1 << 20),), 0)),
    Vector("compaction_keys_request", "(private) the keys of stream 42 range 3",
           Opcode.COMPACTION_KEYS, Flags.NONE, 28, m.CompactionKeysRequest(1000, 42, 3)),
    Vector("compaction_keys_response", "(private) no key in the range",
           Opcode.COMPACTION_KEYS, RESPONSE, 28,
           m.CompactionKeysResponse(0, ErrorCode.NONE, "", 0, 0, 4096, 1_795_000_000_000)),
    Vector("compact_ranges_request", "(private) ranges 0 and 1 by an empty map",
           Opcode.COMPACT_RANGES, Flags.NONE, 29,
           m.CompactRangesRequest(1000, 42, (m.CompactRange(0, True), m.CompactRange(1, False)))),
    Vector("compact_ranges_response", "(private) range 0 halved",
           Opcode.COMPACT_RANGES, RESPONSE, 29,
           m.CompactRangesResponse(
               0, (m.CompactRangeResult(0, ErrorCode.NONE, "", 2048, 1024, 10, 1),))),
    Vector("describe_members_request", "(private) the members of group etl",
           Opcode.DESCRIBE_MEMBERS, Flags.NONE, 30, m.DescribeMembersRequest(1000, "etl")),
    Vector("describe_members_response", "(private) one member holding streams 1 and 2",
           Opcode.DESCRIBE_MEMBERS, RESPONSE, 30,
           m.DescribeMembersResponse(0, ErrorCode.NONE, "", (
               m.MemberDescription("m-1", 3, (1, 2), (1, 2, 3), 1_795_000_000_000, 45_000),
           ))),
    Vector("upload_range_request", "(private) copy stream 42 range 3 of epoch 2",
           Opcode.UPLOAD_RANGE, Flags.NONE, 31, m.UploadRangeRequest(60000, 42, 3, 2)),
    Vector("upload_range_response", "(private) an object of 64 MiB",
           Opcode.UPLOAD_RANGE, RESPONSE, 31,
           m.UploadRangeResponse(0, ErrorCode.NONE, "", 64 << 20, 1_795_000_000_000)),
]  # fmt: skip


def header_fields(header: m.Message | bytes) -> dict[str, Any] | None:
    """The decoded fields as stored in a vector file (None for PING)."""
    if isinstance(header, bytes):
        return None
    fields: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(header)))  # type: ignore[call-overload]
    return fields


def vector_json(vector: Vector) -> dict[str, Any]:
    header = vector.header if isinstance(vector.header, bytes) else vector.header.encode()
    frame = encode_frame(vector.opcode, vector.flags, vector.stream_id, header, vector.payload)
    return {
        "description": vector.description,
        "frame_hex": frame.hex(),
        "opcode": int(vector.opcode),
        "opcode_name": vector.opcode.name,
        "flags": int(vector.flags),
        "stream_id": vector.stream_id,
        "header_type": None if isinstance(vector.header, bytes) else type(vector.header).__name__,
        "header": header_fields(vector.header),
        "header_hex": header.hex(),
        "payload_hex": vector.payload.hex(),
    }


def main() -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for stale in OUT_DIR.glob("*.json"):
        stale.unlink()
    for vector in VECTORS:
        path = OUT_DIR / f"{vector.name}.json"
        path.write_text(json.dumps(vector_json(vector), indent=2) + "\n")
    print(f"wrote {len(VECTORS)} vectors to {OUT_DIR}")


if __name__ == "__main__":
    main()
