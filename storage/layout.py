"""How the engine lays data out in LMDB: database names, keys and records.

Keys are big-endian so that LMDB's byte order is numeric order:

=============  ==========================  ==========================================
database       key                         value
=============  ==========================  ==========================================
``batches``    stream_id u64, base u64     a chunk: the stream's batches of one group
                                           commit, end to end, exactly as appended
``index``      stream_id u64, base u64     append_time_ms i64, record_count i32,
                                           size i32, batch count i32 (of the chunk)
``ranges``     stream_id u64, index u32    JSON range record (``RangeInfo``)
``streams``    stream_id u64               JSON stream record (first offset, deleted, retention)
``meta``       name                        engine-wide counters, format version, PM term
``sequences``  stream_id u64, base u64     producer id i64, epoch i32, base sequence
                                           i64 of an idempotent batch (SPEC §10)
``producers``  stream_id u64, producer u64  last append ms i64, then its last batches:
                                           epoch i32, base sequence i64, record
                                           count i32, base offset i64 each
=============  ==========================  ==========================================

A group commit writes each stream's appends as one value (a chunk) keyed by
its first base offset: LMDB then does one put per stream per group instead of
one per batch, and py-lmdb lets go of the GIL (and must get it back) on every
put, which is what a busy data node's writer spends its time waiting for.

The chunk holding an offset is one ``set_range`` seek plus at most one step
back; the batch inside it is found by walking the chunk's batch headers.
``index`` mirrors ``batches`` with the small per-chunk facts, so that a
stream's next offset (its last index entry), trims and retention never touch
the batch values. Format 1 wrote one batch per value and a 16-byte index
entry: exactly a chunk of one batch, so it is read as is.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Final, NamedTuple

from .model import RangeInfo, ReplicaInfo, StreamRecord

BATCHES_DB: Final = b"batches"
INDEX_DB: Final = b"index"
RANGES_DB: Final = b"ranges"
STREAMS_DB: Final = b"streams"
META_DB: Final = b"meta"
SEQUENCES_DB: Final = b"sequences"
PRODUCERS_DB: Final = b"producers"
ALL_DBS: Final = (BATCHES_DB, INDEX_DB, RANGES_DB, STREAMS_DB, META_DB, SEQUENCES_DB, PRODUCERS_DB)

FORMAT_VERSION: Final = 2
#: formats this code opens (format 1 is upgraded in place: see the module doc)
READABLE_FORMATS: Final = (1, 2)
FORMAT_KEY: Final = b"format"
STORED_BYTES_KEY: Final = b"stored_bytes"
STORED_BATCHES_KEY: Final = b"stored_batches"
#: the highest PM term this node has seen (SPEC §8): older ones are fenced,
#: across restarts too
PM_TERM_KEY: Final = b"pm_term"

BATCH_KEY: Final = struct.Struct(">QQ")
RANGE_KEY: Final = struct.Struct(">QI")
STREAM_KEY: Final = struct.Struct(">Q")
INDEX_VALUE: Final = struct.Struct(">qiii")
#: the index value of format 1: no batch count (one batch per value)
INDEX_VALUE_V1: Final = struct.Struct(">qii")
COUNTER: Final = struct.Struct(">q")

MAX_STREAM_ID: Final = (1 << 63) - 1
#: sorts after every base offset of a stream
MAX_OFFSET_KEY: Final = (1 << 64) - 1


class IndexEntry(NamedTuple):
    """What the index holds about one chunk."""

    append_time_ms: int
    record_count: int
    size: int
    batches: int


def encode_index(entry: IndexEntry) -> bytes:
    return INDEX_VALUE.pack(*entry)


def decode_index(value: bytes) -> IndexEntry:
    if len(value) == INDEX_VALUE_V1.size:
        append_time_ms, record_count, size = INDEX_VALUE_V1.unpack(value)
        return IndexEntry(append_time_ms, record_count, size, 1)
    return IndexEntry(*INDEX_VALUE.unpack(value))


def batch_key(stream_id: int, base_offset: int) -> bytes:
    return BATCH_KEY.pack(stream_id, base_offset)


def stream_key(stream_id: int) -> bytes:
    return STREAM_KEY.pack(stream_id)


def range_key(stream_id: int, range_index: int) -> bytes:
    return RANGE_KEY.pack(stream_id, range_index)


def encode_range(info: RangeInfo) -> bytes:
    record: dict[str, Any] = {
        "start_offset": info.start_offset,
        "end_offset": info.end_offset,
        "epoch": info.epoch,
        "deleted": info.deleted,
        "replicas": [[r.node_id, r.address, r.is_primary] for r in info.replicas],
    }
    if info.sealed_here:
        record["sealed_here"] = True
    if info.object_state:
        record["object_state"] = info.object_state
    return json.dumps(record, separators=(",", ":")).encode()


def decode_range(key: bytes, value: bytes) -> RangeInfo:
    stream_id, range_index = RANGE_KEY.unpack(key)
    record = json.loads(value)
    return RangeInfo(
        stream_id=stream_id,
        range_index=range_index,
        start_offset=record["start_offset"],
        end_offset=record["end_offset"],
        epoch=record["epoch"],
        replicas=tuple(ReplicaInfo(n, a, p) for n, a, p in record["replicas"]),
        deleted=record["deleted"],
        sealed_here=record.get("sealed_here", False),
        object_state=record.get("object_state", 0),
    )


def encode_stream(record: StreamRecord) -> bytes:
    return json.dumps(
        {
            "first_offset": record.first_offset,
            "deleted": record.deleted,
            "retention_period_ms": record.retention_period_ms,
            "producers_from": record.producers_from,
            "cleanup_policy": record.cleanup_policy,
            "keyless_below": record.keyless_below,
        },
        separators=(",", ":"),
    ).encode()


def decode_stream(value: bytes) -> StreamRecord:
    record = json.loads(value)
    return StreamRecord(
        first_offset=record["first_offset"],
        deleted=record["deleted"],
        retention_period_ms=record["retention_period_ms"],
        producers_from=record.get("producers_from"),
        cleanup_policy=record.get("cleanup_policy", 0),
        keyless_below=record.get("keyless_below", 0),
    )


def seek_floor(cursor: Any, key: bytes) -> bool:
    """Put ``cursor`` on the largest key <= ``key``; False if there is none."""
    if cursor.set_range(key):
        return cursor.key() == key or bool(cursor.prev())
    return bool(cursor.last())


def held_end(index_cursor: Any, stream_id: int, start: int, end: int) -> int:
    """How far from ``start`` the index under ``index_cursor`` holds the
    stream's records without a gap, up to ``end`` (``start`` when nothing)."""
    return held_span(index_cursor, stream_id, start, end)[0]


def offset_after_bytes(index_cursor: Any, stream_id: int, start: int, end: int, skip: int) -> int:
    """The first chunk boundary from ``start`` with at least ``skip`` bytes of
    the stream's chunks before it (counted from the chunk holding ``start``),
    up to ``end``: where to cut to drop about ``skip`` bytes, whole batches."""
    passed = 0
    if not seek_floor(index_cursor, batch_key(stream_id, start)):
        return start
    for key, value in index_cursor:
        key_stream, base_offset = BATCH_KEY.unpack(key)
        if key_stream != stream_id or base_offset >= end:
            break
        entry = decode_index(value)
        passed += entry.size
        if passed >= skip:
            return min(max(int(base_offset) + entry.record_count, start), end)
    return end


def held_span(index_cursor: Any, stream_id: int, start: int, end: int) -> tuple[int, int]:
    """``held_end``, and the bytes of the chunks that hold those records (a
    chunk that starts before ``start`` counts whole)."""
    position = start
    size = 0
    if not seek_floor(index_cursor, batch_key(stream_id, start)):
        return position, size
    for key, value in index_cursor:
        key_stream, base_offset = BATCH_KEY.unpack(key)
        if key_stream != stream_id or base_offset > position or position >= end:
            break
        entry = decode_index(value)
        position = max(position, base_offset + entry.record_count)
        size += entry.size
    return min(position, end), size
