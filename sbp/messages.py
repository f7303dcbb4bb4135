"""Typed SBP headers (SPEC §3): one frozen dataclass per FlatBuffers table.

Handlers and clients see only these classes. Every message encodes to the
FlatBuffers bytes of its table (``encode()``) and decodes from them
(``decode(buf)``); any failure to decode, including a missing required field,
is ``HeaderDecodeError`` (answered with SYSTEM_ERROR ``INVALID_REQUEST``).
The wire ids and types of each field are declared beside it and must match
``fbs/*.fbs``; tests check that against the generated code in ``sbp/_fbs``.

Wire conventions of the Python values:

- absent strings read as ``""`` and ``""`` is not written; absent sub-tables
  read as ``None``; absent vectors read as ``()``; vectors are tuples;
- error codes are ``ErrorCode`` members, or the bare int for a code this
  version does not know (it still reaches ``sbp.errors.error_for``);
- a ``ClientRole`` this version does not know reads as ``ClientRole.UNKNOWN``.

Required fields, whose absence makes a header undecodable: the item vector of
every request that has one (``append_requests``, ``fetch_requests``,
``range_owners``, ``ranges``, ``stream_ranges``, ``streams``,
``trimmed_streams``; an empty vector is present, so "no items" is still
expressible), and the ``data_node`` of ``ReplicaNode``,
``ReportMetricsRequest`` and ``DataNodeStatus``. Everything else may be left
out and reads as its default. ``GetStreamsRequest.stream_ids`` is optional:
empty means "list every stream".

PING has no header table: its header bytes are opaque and echoed back, so
``request_type(PING)`` and ``response_type(PING)`` are ``None``. A GOAWAY
frame's header is ``GoAway`` and it is never answered. A response sent with
the SYSTEM_ERROR flag carries ``SystemErrorHeader`` (the SPEC's ``SystemError``) whatever its opcode
(``header_type`` picks the right class for a received frame).
"""

# The field helpers (fb.int64(0), ...) return dataclasses.field() specifiers,
# which RUF009 does not recognise as such.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

from . import _flatbuf as fb
from .constants import OPEN_END_OFFSET
from .enums import ClientRole, ErrorCode, Flags, Opcode
from .ranges import RangeSpan

_ERROR_CODES: dict[int, ErrorCode] = {int(code): code for code in ErrorCode}
_CLIENT_ROLES: dict[int, ClientRole] = {int(role): role for role in ClientRole}


def _error_code(value: int) -> ErrorCode | int:
    # A dict lookup: this runs once per result on the hot path, and calling the
    # enum (ErrorCode.coerce) costs several times more.
    return _ERROR_CODES.get(value, value)


def _client_role(value: int) -> ClientRole:
    return _CLIENT_ROLES.get(value, ClientRole.UNKNOWN)


def _error_code_field(id: int) -> ErrorCode | int:
    default: ErrorCode | int = ErrorCode.NONE
    return fb.enum16(id, _error_code, default)


def _client_role_field(id: int) -> ClientRole:
    return fb.enum8(id, _client_role, ClientRole.UNKNOWN)


class Message:
    """A FlatBuffers table of the protocol; any of them can be a buffer's root."""

    __slots__ = ()
    _fb_codec: ClassVar[Any]

    def encode(self) -> bytes:
        """The FlatBuffers bytes of this table as a header."""
        return fb.encode_root(self)

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview) -> Self:
        """Decode a header; raises ``HeaderDecodeError`` for anything malformed."""
        return fb.decode_root(cls, buf)


# --------------------------------------------------------------------------- shared tables


@fb.table
@dataclass(frozen=True, slots=True)
class DataNode(Message):
    node_id: int = fb.int32(0)
    advertise_addr: str = fb.string(1)  # "host:port"


@fb.table
@dataclass(frozen=True, slots=True)
class ReplicaNode(Message):
    data_node: DataNode = fb.required_subtable(0, DataNode)
    is_primary: bool = fb.boolean(1)


@fb.table
@dataclass(frozen=True, slots=True)
class Range(RangeSpan, Message):
    """``[start_offset, end_offset)`` of a stream; ``end_offset`` is -1 while open.
    (The schema calls this table ``RangeDescriptor``; see fbs/common.fbs.)"""

    stream_id: int = fb.int64(0)
    range_index: int = fb.int32(1)
    start_offset: int = fb.int64(2)
    end_offset: int = fb.int64(3, default=OPEN_END_OFFSET)
    next_offset: int = fb.int64(4)  # the next offset to be assigned; a snapshot
    replica_nodes: tuple[ReplicaNode, ...] = fb.vector(5, ReplicaNode)
    epoch: int = fb.int64(6)  # the stream epoch the range was created in
    commit_offset: int = fb.int64(7)  # records below it are acknowledged (§7); a snapshot
    #: 0 on the data nodes only, 1 also in the object store, 2 there only (§14)
    object_state: int = fb.int8(8)

    def nodes_primary_first(self) -> tuple[DataNode, ...]:
        """The range's data nodes, its primary first: the order readers try them in."""
        ordered = sorted(self.replica_nodes, key=lambda replica: not replica.is_primary)
        return tuple(replica.data_node for replica in ordered)

    def primary_node(self) -> DataNode | None:
        """The data node of the primary replica (None when none is marked)."""
        for replica in self.replica_nodes:
            if replica.is_primary and replica.data_node is not None:
                return replica.data_node
        return None


@fb.table
@dataclass(frozen=True, slots=True)
class RangeId(Message):
    stream_id: int = fb.int64(0)
    range_index: int = fb.int32(1)


@fb.table
@dataclass(frozen=True, slots=True)
class Stream(Message):
    stream_id: int = fb.int64(0)  # ids start at 1; 0 = not yet assigned
    replica_nums: int = fb.int8(1)
    retention_period_ms: int = fb.int64(2)  # 0 = keep forever
    epoch: int = fb.int64(3)
    #: replicas that must hold a record before it is acknowledged; 0 = a majority (§7)
    ack_nums: int = fb.int8(4)
    #: bytes of record batches kept at most; 0 = no size limit (§12). In
    #: UPDATE_STREAMS 0 keeps the current limit and -1 removes it.
    retention_bytes: int = fb.int64(5)
    #: 0 delete (retention only), 1 compact, 2 both (§13)
    cleanup_policy: int = fb.int8(6)
    #: a record stays uncompacted at least this long (§13)
    min_compaction_lag_ms: int = fb.int64(7)
    #: a tombstone is kept this long once it is its key's latest record (§13)
    delete_retention_ms: int = fb.int64(8, default=86_400_000)
    #: -1: not tiered; >= 0: sealed ranges go to the object store, and leave
    #: the nodes' disks once this old (§14)
    local_retention_ms: int = fb.int64(9, default=-1)
    #: -1: no table; > 0: kept as a table, committed at least this often (§16)
    table_interval_ms: int = fb.int64(10, default=-1)


@fb.table
@dataclass(frozen=True, slots=True)
class RangeOwner(Message):
    """Selects ranges by the data node hosting them or by stream: set exactly one."""

    data_node: DataNode | None = fb.subtable(0, DataNode)
    stream_id: int = fb.int64(1)


# --------------------------------------------------------------------------- connection


@fb.table
@dataclass(frozen=True, slots=True)
class SystemErrorHeader(Message):  # SPEC §1 "SystemError": a header, never raised
    """The header of a SYSTEM_ERROR response: an error that belongs to no item."""

    error_code: ErrorCode | int = _error_code_field(0)
    error_message: str = fb.string(1)
    leader_addr: str = fb.string(2)  # with NOT_LEADER: the PM leader's "host:port" (§8)


@fb.table
@dataclass(frozen=True, slots=True)
class GoAway(Message):
    """The header of a GOAWAY frame: the sender accepts no new requests."""

    error_code: ErrorCode | int = _error_code_field(0)
    error_message: str = fb.string(1)


@fb.table
@dataclass(frozen=True, slots=True)
class HeartbeatRequest(Message):
    client_id: str = fb.string(0)
    client_role: ClientRole = _client_role_field(1)
    data_node: DataNode | None = fb.subtable(2, DataNode)


@fb.table
@dataclass(frozen=True, slots=True)
class HeartbeatResponse(Message):
    """Echoes ``client_id``; ``client_role`` and ``data_node`` describe the responder."""

    client_id: str = fb.string(0)
    client_role: ClientRole = _client_role_field(1)
    data_node: DataNode | None = fb.subtable(2, DataNode)


# --------------------------------------------------------------------------- APPEND, FETCH


@fb.table
@dataclass(frozen=True, slots=True)
class AppendInfo(Message):
    stream_id: int = fb.int64(0)
    request_index: int = fb.int32(1)
    batch_length: int = fb.int32(2)  # bytes of this item's batch in the payload
    producer_id: int = fb.int64(3)  # 0: not idempotent (SPEC §10)
    producer_epoch: int = fb.int32(4)
    base_sequence: int = fb.int64(5)  # the sequence of the batch's first record


@fb.table
@dataclass(frozen=True, slots=True)
class AppendRequest(Message):
    """The payload is the record batches concatenated in ``append_requests`` order."""

    timeout_ms: int = fb.int32(0)
    append_requests: tuple[AppendInfo, ...] = fb.vector(1, AppendInfo, required=True)


@fb.table
@dataclass(frozen=True, slots=True)
class AppendResult(Message):
    stream_id: int = fb.int64(0)
    request_index: int = fb.int32(1)
    base_offset: int = fb.int64(2)
    stream_append_time_ms: int = fb.int64(3)
    error_code: ErrorCode | int = _error_code_field(4)
    error_message: str = fb.string(5)
    next_sequence: int = fb.int64(6, default=-1)  # with OUT_OF_ORDER_SEQUENCE (SPEC §10)


@fb.table
@dataclass(frozen=True, slots=True)
class AppendResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    append_responses: tuple[AppendResult, ...] = fb.vector(1, AppendResult)


@fb.table
@dataclass(frozen=True, slots=True)
class FetchInfo(Message):
    stream_id: int = fb.int64(0)
    request_index: int = fb.int32(1)
    fetch_offset: int = fb.int64(2)
    batch_max_bytes: int = fb.int32(3)


@fb.table
@dataclass(frozen=True, slots=True)
class FetchRequest(Message):
    max_wait_ms: int = fb.int32(0)
    min_bytes: int = fb.int32(1)
    fetch_requests: tuple[FetchInfo, ...] = fb.vector(2, FetchInfo, required=True)


@fb.table
@dataclass(frozen=True, slots=True)
class FetchResult(Message):
    stream_id: int = fb.int64(0)
    request_index: int = fb.int32(1)
    error_code: ErrorCode | int = _error_code_field(2)
    error_message: str = fb.string(3)
    batch_length: int = fb.int32(4)  # bytes of whole record batches in the payload


@fb.table
@dataclass(frozen=True, slots=True)
class FetchResponse(Message):
    """The payload holds, for each result in order, ``batch_length`` bytes."""

    throttle_time_ms: int = fb.int32(0)
    fetch_responses: tuple[FetchResult, ...] = fb.vector(1, FetchResult)


@fb.table
@dataclass(frozen=True, slots=True)
class ReplicateInfo(Message):
    stream_id: int = fb.int64(0)
    range_index: int = fb.int32(1)
    epoch: int = fb.int64(2)
    base_offset: int = fb.int64(3)
    batch_length: int = fb.int32(4)  # 0: the item only carries commit_offset
    commit_offset: int = fb.int64(5)  # the primary's commit offset
    producer_id: int = fb.int64(6)  # as the APPEND carried them (SPEC §10)
    producer_epoch: int = fb.int32(7)
    base_sequence: int = fb.int64(8)


@fb.table
@dataclass(frozen=True, slots=True)
class ReplicateRequest(Message):
    """The payload is the record batches, base offsets stamped, in item order (§7)."""

    timeout_ms: int = fb.int32(0)
    replicate_requests: tuple[ReplicateInfo, ...] = fb.vector(1, ReplicateInfo, required=True)


@fb.table
@dataclass(frozen=True, slots=True)
class ReplicateResult(Message):
    stream_id: int = fb.int64(0)
    range_index: int = fb.int32(1)
    error_code: ErrorCode | int = _error_code_field(2)
    error_message: str = fb.string(3)
    next_offset: int = fb.int64(4)  # this replica's durable next offset of the range


@fb.table
@dataclass(frozen=True, slots=True)
class ReplicateResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    replicate_responses: tuple[ReplicateResult, ...] = fb.vector(1, ReplicateResult)


# --------------------------------------------------------------------------- ranges


@fb.table
@dataclass(frozen=True, slots=True)
class ListRangesRequest(Message):
    timeout_ms: int = fb.int32(0)
    range_owners: tuple[RangeOwner, ...] = fb.vector(1, RangeOwner, required=True)


@fb.table
@dataclass(frozen=True, slots=True)
class ListRangesResult(Message):
    range_owner: RangeOwner | None = fb.subtable(0, RangeOwner)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)
    ranges: tuple[Range, ...] = fb.vector(3, Range)


@fb.table
@dataclass(frozen=True, slots=True)
class ListRangesResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    list_responses: tuple[ListRangesResult, ...] = fb.vector(1, ListRangesResult)


@fb.table
@dataclass(frozen=True, slots=True)
class SealRangesRequest(Message):
    timeout_ms: int = fb.int32(0)
    ranges: tuple[RangeId, ...] = fb.vector(1, RangeId, required=True)
    pm_term: int = fb.int64(2)  # set when the PM sends it (§8)


@fb.table
@dataclass(frozen=True, slots=True)
class SealRangesResult(Message):
    stream_id: int = fb.int64(0)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)
    ranges: tuple[Range, ...] = fb.vector(3, Range)


@fb.table
@dataclass(frozen=True, slots=True)
class SealRangesResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    seal_responses: tuple[SealRangesResult, ...] = fb.vector(1, SealRangesResult)


@fb.table
@dataclass(frozen=True, slots=True)
class StreamRanges(Message):
    stream_id: int = fb.int64(0)
    ranges: tuple[Range, ...] = fb.vector(1, Range)
    #: implementation-private: the stream's settings as the PM holds them
    #: (its cleanup_policy decides which appends a data node refuses, §13)
    stream: Stream | None = fb.subtable(2, Stream)


@fb.table
@dataclass(frozen=True, slots=True)
class SyncRangesRequest(Message):
    timeout_ms: int = fb.int32(0)
    stream_ranges: tuple[StreamRanges, ...] = fb.vector(1, StreamRanges, required=True)
    pm_term: int = fb.int64(2)  # (§8)


@fb.table
@dataclass(frozen=True, slots=True)
class SyncRangesResult(Message):
    stream_id: int = fb.int64(0)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)
    ranges: tuple[Range, ...] = fb.vector(3, Range)


@fb.table
@dataclass(frozen=True, slots=True)
class SyncRangesResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    sync_responses: tuple[SyncRangesResult, ...] = fb.vector(1, SyncRangesResult)


@fb.table
@dataclass(frozen=True, slots=True)
class DescribeRangesRequest(Message):
    timeout_ms: int = fb.int32(0)
    ranges: tuple[RangeId, ...] = fb.vector(1, RangeId, required=True)


@fb.table
@dataclass(frozen=True, slots=True)
class DescribeRangeResult(Message):
    stream_id: int = fb.int64(0)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)
    range: Range | None = fb.subtable(3, Range)


@fb.table
@dataclass(frozen=True, slots=True)
class DescribeRangesResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    describe_responses: tuple[DescribeRangeResult, ...] = fb.vector(1, DescribeRangeResult)


@fb.table
@dataclass(frozen=True, slots=True)
class RangeHoldingsRequest(Message):
    """Implementation-private (PM to data node): what a replica holds of ranges."""

    timeout_ms: int = fb.int32(0)
    ranges: tuple[RangeId, ...] = fb.vector(1, RangeId, required=True)
    #: per range (absent or 0: not asked): cut it to drop about that many of
    #: its first bytes (size retention, §12)
    skip_bytes: tuple[int, ...] = fb.int64_vector(2)


@fb.table
@dataclass(frozen=True, slots=True)
class RangeHolding(Message):
    stream_id: int = fb.int64(0)
    range_index: int = fb.int32(1)
    error_code: ErrorCode | int = _error_code_field(2)
    error_message: str = fb.string(3)
    held_end: int = fb.int64(4)  # every record from the range's (trimmed) start to here
    bytes: int = fb.int64(5)  # record batch bytes held of the range
    offset_after_skip: int = fb.int64(6)  # the cut for skip_bytes, at a batch boundary
    #: the offset after the last batch held with a record without a key (§13)
    keyless_below: int = fb.int64(7)


@fb.table
@dataclass(frozen=True, slots=True)
class RangeHoldingsResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    holdings: tuple[RangeHolding, ...] = fb.vector(1, RangeHolding)


# --------------------------------------------------------------------------- streams


@fb.table
@dataclass(frozen=True, slots=True)
class CreateStreamsRequest(Message):
    timeout_ms: int = fb.int32(0)
    streams: tuple[Stream, ...] = fb.vector(1, Stream, required=True)


@fb.table
@dataclass(frozen=True, slots=True)
class CreateStreamResult(Message):
    stream: Stream | None = fb.subtable(0, Stream)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)
    range: Range | None = fb.subtable(3, Range)  # the first writable range


@fb.table
@dataclass(frozen=True, slots=True)
class CreateStreamsResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    create_responses: tuple[CreateStreamResult, ...] = fb.vector(1, CreateStreamResult)


@fb.table
@dataclass(frozen=True, slots=True)
class DeleteStreamsRequest(Message):
    """Only ``stream_id`` of each stream is read."""

    timeout_ms: int = fb.int32(0)
    streams: tuple[Stream, ...] = fb.vector(1, Stream, required=True)


@fb.table
@dataclass(frozen=True, slots=True)
class DeleteStreamResult(Message):
    deleted_stream: Stream | None = fb.subtable(0, Stream)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)


@fb.table
@dataclass(frozen=True, slots=True)
class DeleteStreamsResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    delete_responses: tuple[DeleteStreamResult, ...] = fb.vector(1, DeleteStreamResult)


@fb.table
@dataclass(frozen=True, slots=True)
class UpdateStreamsRequest(Message):
    timeout_ms: int = fb.int32(0)
    streams: tuple[Stream, ...] = fb.vector(1, Stream, required=True)


@fb.table
@dataclass(frozen=True, slots=True)
class UpdateStreamResult(Message):
    stream: Stream | None = fb.subtable(0, Stream)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)


@fb.table
@dataclass(frozen=True, slots=True)
class UpdateStreamsResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    update_responses: tuple[UpdateStreamResult, ...] = fb.vector(1, UpdateStreamResult)


@fb.table
@dataclass(frozen=True, slots=True)
class GetStreamsRequest(Message):
    """Empty ``stream_ids`` lists every stream: a page of at most ``limit``
    streams with ids greater than ``start_after``."""

    timeout_ms: int = fb.int32(0)
    stream_ids: tuple[int, ...] = fb.int64_vector(1)
    start_after: int = fb.int64(2)
    limit: int = fb.int32(3)


@fb.table
@dataclass(frozen=True, slots=True)
class GetStreamResult(Message):
    stream: Stream | None = fb.subtable(0, Stream)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)


@fb.table
@dataclass(frozen=True, slots=True)
class GetStreamsResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    get_responses: tuple[GetStreamResult, ...] = fb.vector(1, GetStreamResult)


@fb.table
@dataclass(frozen=True, slots=True)
class TrimmedStream(Message):
    stream_id: int = fb.int64(0)
    trim_offset: int = fb.int64(1)


@fb.table
@dataclass(frozen=True, slots=True)
class TrimStreamsRequest(Message):
    timeout_ms: int = fb.int32(0)
    trimmed_streams: tuple[TrimmedStream, ...] = fb.vector(1, TrimmedStream, required=True)


@fb.table
@dataclass(frozen=True, slots=True)
class TrimStreamResult(Message):
    trimmed_stream: Stream | None = fb.subtable(0, Stream)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)
    range: Range | None = fb.subtable(3, Range)  # the stream's first range after the trim


@fb.table
@dataclass(frozen=True, slots=True)
class TrimStreamsResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    trim_responses: tuple[TrimStreamResult, ...] = fb.vector(1, TrimStreamResult)


# --------------------------------------------------------------------------- cluster


@fb.table
@dataclass(frozen=True, slots=True)
class ReportMetricsRequest(Message):
    """A data node's load report. The ``uring_*`` fields describe its storage
    write path: commits per second, appends in the transaction being
    committed, appends waiting, mean commit latency in ms. Rates and latencies
    that overflow int16 are clamped by the sender."""

    data_node: DataNode = fb.required_subtable(0, DataNode)
    disk_in_rate: int = fb.int64(1)
    disk_out_rate: int = fb.int64(2)
    disk_free_space: int = fb.int64(3)
    disk_unindexed_data_size: int = fb.int64(4)
    memory_used: int = fb.int64(5)
    uring_task_rate: int = fb.int16(6)
    uring_inflight_task_cnt: int = fb.int16(7)
    uring_pending_task_cnt: int = fb.int32(8)
    uring_task_avg_latency: int = fb.int16(9)
    network_append_rate: int = fb.int16(10)
    network_fetch_rate: int = fb.int16(11)
    network_failed_append_rate: int = fb.int16(12)
    network_failed_fetch_rate: int = fb.int16(13)
    network_append_avg_latency: int = fb.int16(14)
    network_fetch_avg_latency: int = fb.int16(15)
    range_missing_replica_cnt: int = fb.int16(16)
    range_active_cnt: int = fb.int16(17)


@fb.table
@dataclass(frozen=True, slots=True)
class ReportMetricsResponse(Message):
    data_node: DataNode | None = fb.subtable(0, DataNode)


@fb.table
@dataclass(frozen=True, slots=True)
class DescribeClusterRequest(Message):
    timeout_ms: int = fb.int32(0)


@fb.table
@dataclass(frozen=True, slots=True)
class DataNodeStatus(Message):
    data_node: DataNode = fb.required_subtable(0, DataNode)
    alive: bool = fb.boolean(1)
    last_heartbeat_ms: int = fb.int64(2)  # ms since the Unix epoch
    metrics: ReportMetricsRequest | None = fb.subtable(3, ReportMetricsRequest)  # latest report
    range_count: int = fb.int32(4)
    state: int = fb.int8(5)  # NodeState: active, draining, drained (SPEC §12)
    bytes_to_move: int = fb.int64(6)  # while draining: bytes still to copy off


@fb.table
@dataclass(frozen=True, slots=True)
class DescribeClusterResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    data_nodes: tuple[DataNodeStatus, ...] = fb.vector(1, DataNodeStatus)
    error_code: ErrorCode | int = _error_code_field(2)
    error_message: str = fb.string(3)


@fb.table
@dataclass(frozen=True, slots=True)
class ProducerStateRequest(Message):
    """Implementation-private: a stream's producer state as of an offset."""

    timeout_ms: int = fb.int32(0)
    stream_id: int = fb.int64(1)
    as_of_offset: int = fb.int64(2)


@fb.table
@dataclass(frozen=True, slots=True)
class ProducerBatch(Message):
    epoch: int = fb.int32(0)
    base_sequence: int = fb.int64(1)
    record_count: int = fb.int32(2)
    base_offset: int = fb.int64(3)


@fb.table
@dataclass(frozen=True, slots=True)
class ProducerSnapshot(Message):
    producer_id: int = fb.int64(0)
    last_append_ms: int = fb.int64(1)
    batches: tuple[ProducerBatch, ...] = fb.vector(2, ProducerBatch)  # oldest first


@fb.table
@dataclass(frozen=True, slots=True)
class ProducerStateResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)
    producers: tuple[ProducerSnapshot, ...] = fb.vector(3, ProducerSnapshot)


@fb.table
@dataclass(frozen=True, slots=True)
class InitProducerRequest(Message):
    """SPEC §10. An empty name gets a new id; epoch -1 asks for the stored
    epoch + 1, E >= 0 for max(stored, E)."""

    timeout_ms: int = fb.int32(0)
    producer_name: str = fb.string(1)
    producer_epoch: int = fb.int32(2, default=-1)


@fb.table
@dataclass(frozen=True, slots=True)
class InitProducerResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    producer_id: int = fb.int64(1)
    producer_epoch: int = fb.int32(2)
    error_code: ErrorCode | int = _error_code_field(3)
    error_message: str = fb.string(4)


@fb.table
@dataclass(frozen=True, slots=True)
class FindOffset(Message):
    stream_id: int = fb.int64(0)
    range_index: int = fb.int32(1)
    timestamp_ms: int = fb.int64(2)


@fb.table
@dataclass(frozen=True, slots=True)
class FindOffsetsRequest(Message):
    """SPEC §11: per range, the first offset appended at or after a time."""

    timeout_ms: int = fb.int32(0)
    find_requests: tuple[FindOffset, ...] = fb.vector(1, FindOffset)


@fb.table
@dataclass(frozen=True, slots=True)
class FindOffsetResult(Message):
    stream_id: int = fb.int64(0)
    range_index: int = fb.int32(1)
    error_code: ErrorCode | int = _error_code_field(2)
    error_message: str = fb.string(3)
    offset: int = fb.int64(4)  # the range's end (or next offset) when no batch is that late
    timestamp_ms: int = fb.int64(5)  # that batch's append time; -1 when none


@fb.table
@dataclass(frozen=True, slots=True)
class FindOffsetsResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    find_responses: tuple[FindOffsetResult, ...] = fb.vector(1, FindOffsetResult)


@fb.table
@dataclass(frozen=True, slots=True)
class GroupOffset(Message):
    stream_id: int = fb.int64(0)
    offset: int = fb.int64(1)  # the next offset the group will read
    metadata: str = fb.string(2)


@fb.table
@dataclass(frozen=True, slots=True)
class CommitOffsetsRequest(Message):
    """SPEC §11: store a consumer group's positions, all items at once."""

    timeout_ms: int = fb.int32(0)
    group: str = fb.string(1)
    offsets: tuple[GroupOffset, ...] = fb.vector(2, GroupOffset)
    #: set by a group member (§15): commits are then fenced by its epoch
    member_id: str = fb.string(3)
    member_epoch: int = fb.int32(4, default=-1)


@fb.table
@dataclass(frozen=True, slots=True)
class GroupOffsetResult(Message):
    stream_id: int = fb.int64(0)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)
    offset: int = fb.int64(3, default=-1)  # -1: the group has no position here
    metadata: str = fb.string(4)
    commit_time_ms: int = fb.int64(5)
    end_offset: int = fb.int64(6, default=-1)  # the stream's next offset as last learned
    lag_records: int = fb.int64(7, default=-1)  # end_offset - offset when both are known


@fb.table
@dataclass(frozen=True, slots=True)
class CommitOffsetsResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    commit_responses: tuple[GroupOffsetResult, ...] = fb.vector(1, GroupOffsetResult)


@fb.table
@dataclass(frozen=True, slots=True)
class FetchOffsetsRequest(Message):
    """SPEC §11: a group's positions (no stream ids: all of them)."""

    timeout_ms: int = fb.int32(0)
    group: str = fb.string(1)
    stream_ids: tuple[int, ...] = fb.int64_vector(2)


@fb.table
@dataclass(frozen=True, slots=True)
class FetchOffsetsResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    fetch_responses: tuple[GroupOffsetResult, ...] = fb.vector(1, GroupOffsetResult)
    error_code: ErrorCode | int = _error_code_field(2)
    error_message: str = fb.string(3)


@fb.table
@dataclass(frozen=True, slots=True)
class ListGroupsRequest(Message):
    timeout_ms: int = fb.int32(0)


@fb.table
@dataclass(frozen=True, slots=True)
class GroupListing(Message):
    group: str = fb.string(0)
    stream_ids: tuple[int, ...] = fb.int64_vector(1)
    last_commit_ms: int = fb.int64(2)


@fb.table
@dataclass(frozen=True, slots=True)
class ListGroupsResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    groups: tuple[GroupListing, ...] = fb.vector(1, GroupListing)
    error_code: ErrorCode | int = _error_code_field(2)
    error_message: str = fb.string(3)


@fb.table
@dataclass(frozen=True, slots=True)
class DeleteGroupsRequest(Message):
    timeout_ms: int = fb.int32(0)
    groups: tuple[str, ...] = fb.string_vector(1)


@fb.table
@dataclass(frozen=True, slots=True)
class DeleteGroupResult(Message):
    group: str = fb.string(0)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)


@fb.table
@dataclass(frozen=True, slots=True)
class DeleteGroupsResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    delete_responses: tuple[DeleteGroupResult, ...] = fb.vector(1, DeleteGroupResult)


@fb.table
@dataclass(frozen=True, slots=True)
class GroupHeartbeatRequest(Message):
    """SPEC §15: join (epoch 0), stay in, or leave (epoch -1) a consumer group."""

    timeout_ms: int = fb.int32(0)
    group: str = fb.string(1)
    #: chosen by the client, 1-64 bytes, kept for its life
    member_id: str = fb.string(2)
    #: 0 joins, -1 leaves, else the epoch last answered
    member_epoch: int = fb.int32(3)
    #: the streams it subscribes to; empty = unchanged
    streams: tuple[int, ...] = fb.int64_vector(4)
    #: the streams it still reads now
    owned: tuple[int, ...] = fb.int64_vector(5)
    #: 0 = the PM's default
    session_timeout_ms: int = fb.int32(6)


@fb.table
@dataclass(frozen=True, slots=True)
class GroupHeartbeatResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)
    member_epoch: int = fb.int32(3)
    heartbeat_interval_ms: int = fb.int32(4)
    #: the streams this member may read, complete
    assigned: tuple[int, ...] = fb.int64_vector(5)


@fb.table
@dataclass(frozen=True, slots=True)
class DrainDataNodesRequest(Message):
    timeout_ms: int = fb.int32(0)
    node_ids: tuple[int, ...] = fb.int32_vector(1)
    cancel: bool = fb.boolean(2)


@fb.table
@dataclass(frozen=True, slots=True)
class DrainResult(Message):
    node_id: int = fb.int32(0)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)
    state: int = fb.int8(3)  # NodeState after the request


@fb.table
@dataclass(frozen=True, slots=True)
class DrainDataNodesResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    drain_responses: tuple[DrainResult, ...] = fb.vector(1, DrainResult)


@fb.table
@dataclass(frozen=True, slots=True)
class RemoveDataNodesRequest(Message):
    """Implementation-private (client to PM): forget stopped nodes holding no range."""

    timeout_ms: int = fb.int32(0)
    node_ids: tuple[int, ...] = fb.int32_vector(1)


@fb.table
@dataclass(frozen=True, slots=True)
class RemoveResult(Message):
    node_id: int = fb.int32(0)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)


@fb.table
@dataclass(frozen=True, slots=True)
class RemoveDataNodesResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    remove_responses: tuple[RemoveResult, ...] = fb.vector(1, RemoveResult)


@fb.table
@dataclass(frozen=True, slots=True)
class RebalanceRequest(Message):
    """Implementation-private (client to PM): plan, and start unless ``dry_run``."""

    timeout_ms: int = fb.int32(0)
    dry_run: bool = fb.boolean(1)


@fb.table
@dataclass(frozen=True, slots=True)
class DescribeMembersRequest(Message):
    """Implementation-private (client to PM): a consumer group's members (§15)."""

    timeout_ms: int = fb.int32(0)
    group: str = fb.string(1)


@fb.table
@dataclass(frozen=True, slots=True)
class MemberDescription(Message):
    member_id: str = fb.string(0)
    member_epoch: int = fb.int32(1)
    streams: tuple[int, ...] = fb.int64_vector(2)  # the streams it holds
    subscribed: tuple[int, ...] = fb.int64_vector(3)
    last_heartbeat_ms: int = fb.int64(4)  # the leader's clock
    session_timeout_ms: int = fb.int32(5)


@fb.table
@dataclass(frozen=True, slots=True)
class DescribeMembersResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)
    members: tuple[MemberDescription, ...] = fb.vector(3, MemberDescription)


@fb.table
@dataclass(frozen=True, slots=True)
class RangeMove(Message):
    stream_id: int = fb.int64(0)
    range_index: int = fb.int32(1)
    from_node: int = fb.int32(2)
    to_node: int = fb.int32(3)
    bytes: int = fb.int64(4)


@fb.table
@dataclass(frozen=True, slots=True)
class RebalanceResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)
    moves: tuple[RangeMove, ...] = fb.vector(3, RangeMove)  # the new plan
    pending: int = fb.int32(4)  # moves of an earlier plan under way (then no new plan)


# --------------------------------------------------------------------------- registry


@fb.table
@dataclass(frozen=True, slots=True)
class CompactionKeysRequest(Message):
    """Implementation-private (PM to data node): what a sealed range holds
    of each key (§13); the answer's payload is the key map."""

    timeout_ms: int = fb.int32(0)
    stream_id: int = fb.int64(1)
    range_index: int = fb.int32(2)


@fb.table
@dataclass(frozen=True, slots=True)
class CompactionKeysResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)
    keys: int = fb.int64(3)
    records: int = fb.int64(4)
    bytes: int = fb.int64(5)
    last_append_ms: int = fb.int64(6)


@fb.table
@dataclass(frozen=True, slots=True)
class CompactRange(Message):
    range_index: int = fb.int32(0)
    drop_tombstones: bool = fb.boolean(1)


@fb.table
@dataclass(frozen=True, slots=True)
class CompactRangesRequest(Message):
    """Implementation-private (PM to data node): rewrite sealed ranges of a
    stream by the key map in the payload (§13)."""

    timeout_ms: int = fb.int32(0)
    stream_id: int = fb.int64(1)
    ranges: tuple[CompactRange, ...] = fb.vector(2, CompactRange, required=True)


@fb.table
@dataclass(frozen=True, slots=True)
class CompactRangeResult(Message):
    range_index: int = fb.int32(0)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)
    bytes_before: int = fb.int64(3)
    bytes_after: int = fb.int64(4)
    records_removed: int = fb.int64(5)
    tombstones_removed: int = fb.int64(6)


@fb.table
@dataclass(frozen=True, slots=True)
class CompactRangesResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    results: tuple[CompactRangeResult, ...] = fb.vector(1, CompactRangeResult)


@fb.table
@dataclass(frozen=True, slots=True)
class UploadRangeRequest(Message):
    """Implementation-private (PM to data node): copy a sealed range held
    whole on the node to the object store (§14)."""

    timeout_ms: int = fb.int32(0)
    stream_id: int = fb.int64(1)
    range_index: int = fb.int32(2)
    epoch: int = fb.int64(3)


@fb.table
@dataclass(frozen=True, slots=True)
class UploadRangeResponse(Message):
    throttle_time_ms: int = fb.int32(0)
    error_code: ErrorCode | int = _error_code_field(1)
    error_message: str = fb.string(2)
    object_bytes: int = fb.int64(3)
    last_append_ms: int = fb.int64(4)


_REQUEST_TYPES: dict[int, type[Message]] = {
    Opcode.GOAWAY: GoAway,
    Opcode.HEARTBEAT: HeartbeatRequest,
    Opcode.APPEND: AppendRequest,
    Opcode.FETCH: FetchRequest,
    Opcode.REPLICATE: ReplicateRequest,
    Opcode.LIST_RANGES: ListRangesRequest,
    Opcode.SEAL_RANGES: SealRangesRequest,
    Opcode.SYNC_RANGES: SyncRangesRequest,
    Opcode.DESCRIBE_RANGES: DescribeRangesRequest,
    Opcode.CREATE_STREAMS: CreateStreamsRequest,
    Opcode.DELETE_STREAMS: DeleteStreamsRequest,
    Opcode.UPDATE_STREAMS: UpdateStreamsRequest,
    Opcode.GET_STREAMS: GetStreamsRequest,
    Opcode.TRIM_STREAMS: TrimStreamsRequest,
    Opcode.REPORT_METRICS: ReportMetricsRequest,
    Opcode.DESCRIBE_CLUSTER: DescribeClusterRequest,
    Opcode.INIT_PRODUCER: InitProducerRequest,
    Opcode.PRODUCER_STATE: ProducerStateRequest,
    Opcode.FIND_OFFSETS: FindOffsetsRequest,
    Opcode.COMMIT_OFFSETS: CommitOffsetsRequest,
    Opcode.FETCH_OFFSETS: FetchOffsetsRequest,
    Opcode.LIST_GROUPS: ListGroupsRequest,
    Opcode.DELETE_GROUPS: DeleteGroupsRequest,
    Opcode.GROUP_HEARTBEAT: GroupHeartbeatRequest,
    Opcode.DRAIN_DATA_NODES: DrainDataNodesRequest,
    Opcode.RANGE_HOLDINGS: RangeHoldingsRequest,
    Opcode.REMOVE_DATA_NODES: RemoveDataNodesRequest,
    Opcode.REBALANCE: RebalanceRequest,
    Opcode.DESCRIBE_MEMBERS: DescribeMembersRequest,
    Opcode.COMPACTION_KEYS: CompactionKeysRequest,
    Opcode.COMPACT_RANGES: CompactRangesRequest,
    Opcode.UPLOAD_RANGE: UploadRangeRequest,
}

_RESPONSE_TYPES: dict[int, type[Message]] = {
    Opcode.HEARTBEAT: HeartbeatResponse,
    Opcode.APPEND: AppendResponse,
    Opcode.FETCH: FetchResponse,
    Opcode.REPLICATE: ReplicateResponse,
    Opcode.LIST_RANGES: ListRangesResponse,
    Opcode.SEAL_RANGES: SealRangesResponse,
    Opcode.SYNC_RANGES: SyncRangesResponse,
    Opcode.DESCRIBE_RANGES: DescribeRangesResponse,
    Opcode.CREATE_STREAMS: CreateStreamsResponse,
    Opcode.DELETE_STREAMS: DeleteStreamsResponse,
    Opcode.UPDATE_STREAMS: UpdateStreamsResponse,
    Opcode.GET_STREAMS: GetStreamsResponse,
    Opcode.TRIM_STREAMS: TrimStreamsResponse,
    Opcode.REPORT_METRICS: ReportMetricsResponse,
    Opcode.DESCRIBE_CLUSTER: DescribeClusterResponse,
    Opcode.INIT_PRODUCER: InitProducerResponse,
    Opcode.PRODUCER_STATE: ProducerStateResponse,
    Opcode.FIND_OFFSETS: FindOffsetsResponse,
    Opcode.COMMIT_OFFSETS: CommitOffsetsResponse,
    Opcode.FETCH_OFFSETS: FetchOffsetsResponse,
    Opcode.LIST_GROUPS: ListGroupsResponse,
    Opcode.DELETE_GROUPS: DeleteGroupsResponse,
    Opcode.GROUP_HEARTBEAT: GroupHeartbeatResponse,
    Opcode.DRAIN_DATA_NODES: DrainDataNodesResponse,
    Opcode.RANGE_HOLDINGS: RangeHoldingsResponse,
    Opcode.REMOVE_DATA_NODES: RemoveDataNodesResponse,
    Opcode.REBALANCE: RebalanceResponse,
    Opcode.DESCRIBE_MEMBERS: DescribeMembersResponse,
    Opcode.COMPACTION_KEYS: CompactionKeysResponse,
    Opcode.COMPACT_RANGES: CompactRangesResponse,
    Opcode.UPLOAD_RANGE: UploadRangeResponse,
}


def request_type(opcode: int) -> type[Message] | None:
    """The header class of a request frame; ``None`` for PING (opaque, echoed
    header bytes) and for opcodes this version does not know."""
    return _REQUEST_TYPES.get(opcode)


def response_type(opcode: int) -> type[Message] | None:
    """The header class of a normal response frame; ``None`` for PING (opaque,
    echoed header bytes), GOAWAY (never answered) and unknown opcodes."""
    return _RESPONSE_TYPES.get(opcode)


def header_type(opcode: int, flags: int) -> type[Message] | None:
    """The header class of a received frame, from its opcode and flags:
    ``SystemErrorHeader`` for SYSTEM_ERROR responses whatever the opcode."""
    if flags & Flags.RESPONSE:
        return SystemErrorHeader if flags & Flags.SYSTEM_ERROR else _RESPONSE_TYPES.get(opcode)
    return _REQUEST_TYPES.get(opcode)
