"""How the PM's records are stored: the value bytes of each, the same in
LMDB (``pm.metadata``) and etcd (``pm.etcd_metadata``), so that a
migration between the two copies values as they are. Every integer is
big-endian; a value that grew a field later is recognised by its length,
and values written before it decode with the field's default."""

from __future__ import annotations

import json
import struct
from typing import Final

from .records import (
    GroupOffsetRecord,
    MemberRecord,
    MoveCause,
    MoveRecord,
    ProducerRecord,
    RangeRecord,
    StreamRecord,
)

_STREAM_VALUE: Final = struct.Struct(">bqq")
#: a stream with ack_nums (SPEC §7): the value above and one more byte; values
#: written before it existed decode with ack_nums 0 (a majority)
_STREAM_VALUE_ACKS: Final = struct.Struct(">bqqb")
#: a stream with a size limit (SPEC §12): eight more bytes; values written
#: before it existed decode with no limit
_STREAM_VALUE_BYTES: Final = struct.Struct(">bqqbq")
#: a stream with the settings of compaction, tiering and tables (SPEC §13,
#: §14, §16): values written before decode with their defaults
_STREAM_VALUE_SETTINGS: Final = struct.Struct(">bqqbqbqqqq")
#: a rebalance's move as first stored: from node, to node
_MOVE_VALUE: Final = struct.Struct(">ii")
#: any move: from node, cause, the count of nodes it moves to, then their ids
_MOVE_HEAD: Final = struct.Struct(">iBB")
_RANGE_HEAD: Final = struct.Struct(">qqqB")
_WANTED: Final = struct.Struct(">B")
#: a copied range's object state, last append time and object size (SPEC §14)
_OBJECT: Final = struct.Struct(">Bqq")
_PRODUCER_VALUE: Final = struct.Struct(">qi")
_GROUP_VALUE_HEAD: Final = struct.Struct(">qq")


def encode_stream(stream: StreamRecord) -> bytes:
    return _STREAM_VALUE_SETTINGS.pack(
        stream.replica_nums,
        stream.retention_period_ms,
        stream.epoch,
        stream.ack_nums,
        stream.retention_bytes,
        stream.cleanup_policy,
        stream.min_compaction_lag_ms,
        stream.delete_retention_ms,
        stream.local_retention_ms,
        stream.table_interval_ms,
    )


def stream_from_value(stream_id: int, value: bytes) -> StreamRecord:
    """A stream from its stored value (both stores keep the same one)."""
    if len(value) == _STREAM_VALUE.size:
        replica_nums, retention, epoch = _STREAM_VALUE.unpack(value)
        return StreamRecord(stream_id, replica_nums, retention, epoch)
    if len(value) == _STREAM_VALUE_ACKS.size:
        replica_nums, retention, epoch, acks = _STREAM_VALUE_ACKS.unpack(value)
        return StreamRecord(stream_id, replica_nums, retention, epoch, acks)
    if len(value) == _STREAM_VALUE_BYTES.size:
        return StreamRecord(stream_id, *_STREAM_VALUE_BYTES.unpack(value))
    return StreamRecord(stream_id, *_STREAM_VALUE_SETTINGS.unpack(value))


def encode_move(move: MoveRecord) -> bytes:
    head = _MOVE_HEAD.pack(move.from_node, move.cause, len(move.to_nodes))
    return head + struct.pack(f">{len(move.to_nodes)}i", *move.to_nodes)


def decode_move(stream_id: int, range_index: int, value: bytes) -> MoveRecord:
    """A move from its stored value (both stores keep the same one)."""
    if len(value) == _MOVE_VALUE.size:
        from_node, to_node = _MOVE_VALUE.unpack(value)
        return MoveRecord(stream_id, range_index, from_node, (to_node,))
    from_node, cause, count = _MOVE_HEAD.unpack_from(value)
    to_nodes = struct.unpack_from(f">{count}i", value, _MOVE_HEAD.size)
    return MoveRecord(stream_id, range_index, from_node, tuple(to_nodes), MoveCause(cause))


def encode_producer(producer: ProducerRecord) -> bytes:
    return _PRODUCER_VALUE.pack(producer.producer_id, producer.epoch)


def producer_from_value(name: str, value: bytes) -> ProducerRecord:
    producer_id, epoch = _PRODUCER_VALUE.unpack(value)
    return ProducerRecord(name, producer_id, epoch)


def encode_group_offset(record: GroupOffsetRecord) -> bytes:
    head = _GROUP_VALUE_HEAD.pack(record.offset, record.commit_time_ms)
    return head + record.metadata.encode()


def group_offset_from_value(group: str, stream_id: int, value: bytes) -> GroupOffsetRecord:
    offset, commit_time_ms = _GROUP_VALUE_HEAD.unpack_from(value)
    metadata = bytes(value[_GROUP_VALUE_HEAD.size :]).decode()
    return GroupOffsetRecord(group, stream_id, offset, commit_time_ms, metadata)


def encode_member(member: MemberRecord) -> bytes:
    return json.dumps(
        {
            "epoch": member.epoch,
            "session_timeout_ms": member.session_timeout_ms,
            "subscribed": list(member.subscribed),
            "held": list(member.held),
            "assigned": list(member.assigned),
        },
        separators=(",", ":"),
    ).encode()


def member_from_value(group: str, member_id: str, value: bytes) -> MemberRecord:
    """A member from its stored value (both stores keep the same one)."""
    fields = json.loads(value)
    return MemberRecord(
        group,
        member_id,
        int(fields["epoch"]),
        int(fields["session_timeout_ms"]),
        tuple(int(s) for s in fields["subscribed"]),
        tuple(int(s) for s in fields["held"]),
        tuple(int(s) for s in fields.get("assigned", ())),
    )


def encode_range(rng: RangeRecord) -> bytes:
    head = _RANGE_HEAD.pack(rng.start_offset, rng.end_offset, rng.epoch, len(rng.nodes))
    value = head + struct.pack(f">{len(rng.nodes)}i", *rng.nodes)
    # Only a short-handed range carries the count it wants, and only a
    # copied one its object, so every value written before either existed
    # decodes unchanged, as a whole range on the nodes only.
    if rng.object_state:
        return (
            value
            + _WANTED.pack(rng.replicas_wanted if rng.short_handed else 0)
            + _OBJECT.pack(rng.object_state, rng.last_append_ms, rng.object_bytes)
        )
    return value + _WANTED.pack(rng.replicas_wanted) if rng.short_handed else value


def range_from_value(stream_id: int, range_index: int, value: bytes) -> RangeRecord:
    """A range from its stored value (both stores keep the same one)."""
    start, end, epoch, count = _RANGE_HEAD.unpack_from(value)
    nodes = struct.unpack_from(f">{count}i", value, _RANGE_HEAD.size)
    wanted_at = _RANGE_HEAD.size + 4 * count
    wanted = _WANTED.unpack_from(value, wanted_at)[0] if len(value) > wanted_at else 0
    object_at = wanted_at + _WANTED.size
    state, last_append_ms, object_bytes = (
        _OBJECT.unpack_from(value, object_at) if len(value) > object_at else (0, 0, 0)
    )
    return RangeRecord(
        stream_id,
        range_index,
        start,
        tuple(nodes),
        end,
        epoch,
        wanted,
        state,
        last_append_ms,
        object_bytes,
    )
