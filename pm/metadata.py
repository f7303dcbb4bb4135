"""The PM's metadata in LMDB: streams, ranges, data nodes, named producers,
consumer group positions, the next stream and producer ids.

Layout (one LMDB environment, named databases, every integer big-endian so
that byte order is numeric order for the non-negative ids used as keys):

=============  ===============================  ==================================
database       key                              value
=============  ===============================  ==================================
``streams``    stream_id (q)                    replica_nums (b), retention (q), epoch (q),
                                                ack_nums (b), retention_bytes (q),
                                                cleanup_policy (b), min compaction
                                                lag (q), delete retention (q), local
                                                retention (q), table interval (q)
``ranges``     stream_id (q), range_index (i)   start (q), end (q), epoch (q), n (B),
                                                n node ids (i), primary first, and
                                                replicas wanted (B) when the range
                                                is on fewer nodes than that
``by_node``    node_id (i), stream_id (q),      empty: the index behind LIST_RANGES
               range_index (i)                  by data node
``nodes``      node_id (i)                      advertise address, UTF-8
``draining``   node_id (i)                      empty: the node is draining (SPEC §12)
``moves``      stream_id (q), range_index (i)   from node (i), cause (B), n (B), n
                                                node ids (i): a replica being moved
                                                (``pm.moves``; a rebalance's first
                                                values: from node, to node)
``producers``  producer name, UTF-8             producer_id (q), epoch (i)
``groups``     name length (B), group name,     offset (q), commit time ms (q),
               stream_id (q)                    metadata, UTF-8
``group_by_    stream_id (q), group name        empty: the index that finds a
stream``                                        deleted stream's positions
``members``    name length (B), group name,     JSON: epoch, session timeout,
               member id, UTF-8                 subscribed and held streams (§15)
``meta``       name                             schema version, next stream id,
                                                next producer id
=============  ===============================  ==================================

Values are encoded by ``pm.stored_values``, the same bytes etcd keeps.

Durability: every ``apply`` is one write transaction committed with a sync
(LMDB's ``sync`` and ``metasync`` stay on), so a change that was applied
survives SIGKILL and power loss. ``commit`` runs ``apply`` on a worker thread:
an LMDB write transaction must stay on the thread that began it, and a synced
commit takes about a millisecond that the event loop should not wait out.
Reads are short and run inline on the caller's thread.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import lmdb
import trio

from .changes import (
    Change,
    DeleteGroup,
    DeleteMember,
    DeleteMove,
    DeleteNode,
    DeleteRange,
    DeleteStream,
    MarkForeignStream,
    MetadataCounts,
    PutGroupOffsets,
    PutMember,
    PutMove,
    PutNode,
    PutProducer,
    PutRange,
    PutStream,
    RaiseNextProducerId,
    RaiseNextStreamId,
    SetDraining,
)
from .records import (
    GroupOffsetRecord,
    MemberRecord,
    MoveRecord,
    NodeRecord,
    ProducerRecord,
    RangeRecord,
    StreamRecord,
)
from .stored_values import (
    decode_move,
    encode_group_offset,
    encode_member,
    encode_move,
    encode_producer,
    encode_range,
    encode_stream,
    group_offset_from_value,
    member_from_value,
    producer_from_value,
    range_from_value,
    stream_from_value,
)

SCHEMA_VERSION: Final = 1
#: LMDB reserves the map as sparse address space; the file grows only with data.
#: 4 GiB holds tens of millions of streams. LMDB's own default (10 MiB) would
#: fill at about 50,000 streams.
DEFAULT_MAP_SIZE: Final = 4 << 30
_MAX_DBS: Final = 13

_STREAM_KEY: Final = struct.Struct(">q")
_RANGE_KEY: Final = struct.Struct(">qi")
_NODE_KEY: Final = struct.Struct(">i")
U64: Final = struct.Struct(">Q")

_META_SCHEMA: Final = b"schema_version"
_META_NEXT_STREAM_ID: Final = b"next_stream_id"
_META_NEXT_PRODUCER_ID: Final = b"next_producer_id"
#: followed by a stream id (U64): a stream another PM placed (MarkForeignStream)
_META_FOREIGN_STREAM: Final = b"foreign_stream/"
#: stream ids start at 1; 0 means "not yet assigned" on the wire
FIRST_STREAM_ID: Final = 1
#: producer ids start at 1; 0 on an APPEND item means "not idempotent"
FIRST_PRODUCER_ID: Final = 1


class MetadataError(Exception):
    """The metadata directory cannot be opened or holds an unknown layout."""


def _decode_stream(key: bytes, value: bytes) -> StreamRecord:
    (stream_id,) = _STREAM_KEY.unpack(key)
    return stream_from_value(stream_id, value)


def _group_prefix(group: str) -> bytes:
    name = group.encode()
    return bytes([len(name)]) + name


def _decode_group_key(key: bytes) -> tuple[str, int]:
    length = key[0]
    return key[1 : 1 + length].decode(), _STREAM_KEY.unpack_from(key, 1 + length)[0]


def _decode_range(key: bytes, value: bytes) -> RangeRecord:
    stream_id, range_index = _RANGE_KEY.unpack(key)
    return range_from_value(stream_id, range_index, value)


# -- the store ----------------------------------------------------------------


class _PendingCommit:
    """One ``MetadataStore.commit`` waiting for its transaction."""

    __slots__ = ("changes", "done", "error")

    def __init__(self, changes: Sequence[Change]) -> None:
        self.changes = changes
        self.done = False
        self.error: Exception | None = None


class MetadataStore:
    """Streams, ranges and data nodes of one PM, persisted in LMDB."""

    def __init__(self, path: Path | str, *, map_size: int = DEFAULT_MAP_SIZE) -> None:
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._env = lmdb.open(
                str(self.path), map_size=map_size, max_dbs=_MAX_DBS, sync=True, metasync=True
            )
        except (OSError, lmdb.Error) as exc:
            raise MetadataError(f"cannot open metadata in {self.path}: {exc}") from exc
        self._streams = self._env.open_db(b"streams")
        self._ranges = self._env.open_db(b"ranges")
        self._by_node = self._env.open_db(b"by_node")
        self._nodes = self._env.open_db(b"nodes")
        self._draining = self._env.open_db(b"draining")
        self._moves = self._env.open_db(b"moves")
        self._meta = self._env.open_db(b"meta")
        self._producers = self._env.open_db(b"producers")
        self._groups = self._env.open_db(b"groups")
        self._group_by_stream = self._env.open_db(b"group_by_stream")
        self._members = self._env.open_db(b"members")
        self._check_schema()
        # One writer at a time: LMDB serialises write transactions anyway, and
        # commits that arrive meanwhile wait here, off worker threads, to go
        # together in the next transaction.
        self._writer = trio.Lock()
        self._waiting: list[_PendingCommit] = []

    def _check_schema(self) -> None:
        with self._env.begin(write=True) as txn:
            stored = txn.get(_META_SCHEMA, db=self._meta)
            if stored is None:
                txn.put(_META_SCHEMA, U64.pack(SCHEMA_VERSION), db=self._meta)
                return
            (version,) = U64.unpack(stored)
        if version != SCHEMA_VERSION:
            self._env.close()
            raise MetadataError(
                f"metadata in {self.path} has schema version {version}, "
                f"this PM reads version {SCHEMA_VERSION}"
            )

    def close(self) -> None:
        self._env.close()

    # -- reads ----------------------------------------------------------------

    def _read(self) -> Any:
        return self._env.begin(buffers=False)

    def stream(self, stream_id: int) -> StreamRecord | None:
        key = _STREAM_KEY.pack(stream_id)
        with self._read() as txn:
            value = txn.get(key, db=self._streams)
        return None if value is None else _decode_stream(key, value)

    def streams(self, *, start_after: int = 0, limit: int) -> list[StreamRecord]:
        """Up to ``limit`` streams with ids above ``start_after``, in id order."""
        found: list[StreamRecord] = []
        if limit <= 0:
            return found
        with self._read() as txn:
            cursor = txn.cursor(db=self._streams)
            if not cursor.set_range(_STREAM_KEY.pack(max(start_after + 1, 0))):
                return found
            for key, value in cursor:
                found.append(_decode_stream(key, value))
                if len(found) >= limit:
                    break
        return found

    def ranges(self, stream_id: int) -> list[RangeRecord]:
        """Every range of a stream, in range_index order."""
        with self._read() as txn:
            return list(self._scan_ranges(txn, stream_id))

    def _scan_ranges(self, txn: Any, stream_id: int) -> Iterator[RangeRecord]:
        prefix = _STREAM_KEY.pack(stream_id)
        cursor = txn.cursor(db=self._ranges)
        if not cursor.set_range(prefix):
            return
        for key, value in cursor:
            if not key.startswith(prefix):
                return
            yield _decode_range(key, value)

    def range(self, stream_id: int, range_index: int) -> RangeRecord | None:
        key = _RANGE_KEY.pack(stream_id, range_index)
        with self._read() as txn:
            value = txn.get(key, db=self._ranges)
        return None if value is None else _decode_range(key, value)

    def last_range(self, stream_id: int) -> RangeRecord | None:
        """The stream's last (highest index) range: the open one while the stream lives."""
        # The largest key of this stream is just below the first key of the next id.
        with self._read() as txn:
            cursor = txn.cursor(db=self._ranges)
            if cursor.set_range(_STREAM_KEY.pack(stream_id + 1)):
                if not cursor.prev():
                    return None
            elif not cursor.last():
                return None
            key, value = cursor.item()
            if not key.startswith(_STREAM_KEY.pack(stream_id)):
                return None
            return _decode_range(key, value)

    def ranges_on_node(self, node_id: int) -> list[RangeRecord]:
        """Every range that lists ``node_id`` among its replicas, by stream and index."""
        prefix = _NODE_KEY.pack(node_id)
        found: list[RangeRecord] = []
        with self._read() as txn:
            cursor = txn.cursor(db=self._by_node)
            if not cursor.set_range(prefix):
                return found
            for key in cursor.iternext(keys=True, values=False):
                if not key.startswith(prefix):
                    break
                range_key = key[_NODE_KEY.size :]
                value = txn.get(range_key, db=self._ranges)
                if value is not None:
                    found.append(_decode_range(range_key, value))
        return found

    def nodes(self) -> list[NodeRecord]:
        with self._read() as txn:
            return [
                NodeRecord(_NODE_KEY.unpack(key)[0], value.decode())
                for key, value in txn.cursor(db=self._nodes)
            ]

    def draining_nodes(self) -> set[int]:
        """The data nodes marked draining (SPEC §12)."""
        with self._read() as txn:
            return {
                _NODE_KEY.unpack(key)[0]
                for key in txn.cursor(db=self._draining).iternext(keys=True, values=False)
            }

    def moves(self) -> list[MoveRecord]:
        """The ranges being moved by a rebalance, by key."""
        with self._read() as txn:
            return [
                decode_move(stream_id, range_index, value)
                for key, value in txn.cursor(db=self._moves)
                for stream_id, range_index in [_RANGE_KEY.unpack(key)]
            ]

    def next_stream_id(self) -> int:
        """The lowest stream id never handed out."""
        with self._read() as txn:
            value = txn.get(_META_NEXT_STREAM_ID, db=self._meta)
        return FIRST_STREAM_ID if value is None else int(U64.unpack(value)[0])

    def foreign_streams(self) -> frozenset[int]:
        """Streams data nodes hold that this PM never created (MarkForeignStream)."""
        found: set[int] = set()
        with self._read() as txn:
            cursor = txn.cursor(db=self._meta)
            if cursor.set_range(_META_FOREIGN_STREAM):
                for key in cursor.iternext(keys=True, values=False):
                    if not key.startswith(_META_FOREIGN_STREAM):
                        break
                    found.add(int(U64.unpack(key[len(_META_FOREIGN_STREAM) :])[0]))
        return frozenset(found)

    def producer(self, name: str) -> ProducerRecord | None:
        with self._read() as txn:
            value = txn.get(name.encode(), db=self._producers)
        return None if value is None else producer_from_value(name, value)

    def producers(self) -> list[ProducerRecord]:
        with self._read() as txn:
            return [
                producer_from_value(key.decode(), value)
                for key, value in txn.cursor(db=self._producers)
            ]

    def next_producer_id(self) -> int:
        """The lowest producer id never handed out."""
        with self._read() as txn:
            value = txn.get(_META_NEXT_PRODUCER_ID, db=self._meta)
        return FIRST_PRODUCER_ID if value is None else int(U64.unpack(value)[0])

    def group_offsets(self, group: str) -> list[GroupOffsetRecord]:
        """The group's positions, by stream id (none: an unknown group)."""
        prefix = _group_prefix(group)
        found: list[GroupOffsetRecord] = []
        with self._read() as txn:
            cursor = txn.cursor(db=self._groups)
            if not cursor.set_range(prefix):
                return found
            for key, value in cursor:
                if not key.startswith(prefix):
                    break
                found.append(self._decode_group_offset(key, value))
        return found

    def all_group_offsets(self) -> list[GroupOffsetRecord]:
        """Every group's positions, by group name bytes and stream id."""
        with self._read() as txn:
            found = [
                self._decode_group_offset(key, value) for key, value in txn.cursor(db=self._groups)
            ]
        # keys lead with the name's length: put them in name order
        found.sort(key=lambda r: (r.group.encode(), r.stream_id))
        return found

    def all_members(self) -> list[MemberRecord]:
        """Every consumer group member (SPEC §15)."""
        found = []
        with self._read() as txn:
            for key, value in txn.cursor(db=self._members):
                length = key[0]
                group = key[1 : 1 + length].decode()
                found.append(member_from_value(group, key[1 + length :].decode(), value))
        return found

    @staticmethod
    def _decode_group_offset(key: bytes, value: bytes) -> GroupOffsetRecord:
        group, stream_id = _decode_group_key(key)
        return group_offset_from_value(group, stream_id, value)

    def counts(self) -> MetadataCounts:
        """Entry counts, read from LMDB's page statistics (no scan)."""
        with self._read() as txn:
            return MetadataCounts(
                streams=txn.stat(self._streams)["entries"],
                ranges=txn.stat(self._ranges)["entries"],
                nodes=txn.stat(self._nodes)["entries"],
            )

    def range_counts_by_node(self) -> dict[int, int]:
        """How many ranges each node hosts (one scan of the node index; for start-up)."""
        counts: dict[int, int] = {}
        with self._read() as txn:
            for key in txn.cursor(db=self._by_node).iternext(keys=True, values=False):
                node_id = _NODE_KEY.unpack_from(key)[0]
                counts[node_id] = counts.get(node_id, 0) + 1
        return counts

    # -- writes ---------------------------------------------------------------

    async def commit(self, changes: Sequence[Change]) -> None:
        """Apply ``changes`` durably and atomically, off the event loop.

        Commits made while another is being written wait for it, then go
        together in one transaction: one sync for all of them, which is what
        many concurrent seals or moves wait on. When that transaction fails,
        each commit of it is tried again alone, so that only one that fails
        on its own fails.

        Not cancellable: the caller must learn whether its changes were
        committed before it answers anyone.
        """
        if not changes:
            return
        pending = _PendingCommit(changes)
        self._waiting.append(pending)
        with trio.CancelScope(shield=True):
            async with self._writer:
                if not pending.done:
                    group, self._waiting = self._waiting, []
                    await trio.to_thread.run_sync(self._apply_group, group)
        if pending.error is not None:
            raise pending.error

    def _apply_group(self, group: Sequence[_PendingCommit]) -> None:
        try:
            self.apply(change for pending in group for change in pending.changes)
        except Exception as error:
            if len(group) == 1:
                group[0].error = error
            else:
                for pending in group:
                    try:
                        self.apply(pending.changes)
                    except Exception as alone:
                        pending.error = alone
        for pending in group:
            pending.done = True

    def apply(self, changes: Iterable[Change]) -> None:
        """Apply ``changes`` in one write transaction, synced on commit."""
        with self._env.begin(write=True) as txn:
            for change in changes:
                self._apply_one(txn, change)

    def _apply_one(self, txn: Any, change: Change) -> None:
        match change:
            case PutStream(stream):
                txn.put(_STREAM_KEY.pack(stream.stream_id), encode_stream(stream), db=self._streams)
            case DeleteStream(stream_id):
                for rng in list(self._scan_ranges(txn, stream_id)):
                    self._delete_range(txn, rng.stream_id, rng.range_index)
                txn.delete(_STREAM_KEY.pack(stream_id), db=self._streams)
                self._delete_positions_of_stream(txn, stream_id)
            case PutRange(rng):
                self._put_range(txn, rng)
            case DeleteRange(stream_id, range_index):
                self._delete_range(txn, stream_id, range_index)
            case PutNode(node):
                txn.put(_NODE_KEY.pack(node.node_id), node.address.encode(), db=self._nodes)
            case DeleteNode(node_id):
                txn.delete(_NODE_KEY.pack(node_id), db=self._nodes)
                txn.delete(_NODE_KEY.pack(node_id), db=self._draining)
            case SetDraining(node_id, draining):
                if draining:
                    txn.put(_NODE_KEY.pack(node_id), b"", db=self._draining)
                else:
                    txn.delete(_NODE_KEY.pack(node_id), db=self._draining)
            case PutMove(move):
                txn.put(_RANGE_KEY.pack(*move.key), encode_move(move), db=self._moves)
            case DeleteMove(stream_id, range_index):
                txn.delete(_RANGE_KEY.pack(stream_id, range_index), db=self._moves)
            case RaiseNextStreamId(value):
                self._raise(txn, _META_NEXT_STREAM_ID, value)
            case MarkForeignStream(stream_id):
                txn.put(_META_FOREIGN_STREAM + U64.pack(stream_id), b"", db=self._meta)
            case PutProducer(producer):
                txn.put(producer.name.encode(), encode_producer(producer), db=self._producers)
            case RaiseNextProducerId(value):
                self._raise(txn, _META_NEXT_PRODUCER_ID, value)
            case PutGroupOffsets(offsets):
                for record in offsets:
                    stream_key = _STREAM_KEY.pack(record.stream_id)
                    key = _group_prefix(record.group) + stream_key
                    txn.put(key, encode_group_offset(record), db=self._groups)
                    txn.put(stream_key + record.group.encode(), b"", db=self._group_by_stream)
            case PutMember(member):
                key = _group_prefix(member.group) + member.member_id.encode()
                txn.put(key, encode_member(member), db=self._members)
            case DeleteMember(group, member_id):
                txn.delete(_group_prefix(group) + member_id.encode(), db=self._members)
            case DeleteGroup(group):
                prefix = _group_prefix(group)
                cursor = txn.cursor(db=self._groups)
                doomed = []
                if cursor.set_range(prefix):
                    for key in cursor.iternext(keys=True, values=False):
                        if not key.startswith(prefix):
                            break
                        doomed.append(key)
                for key in doomed:
                    txn.delete(key, db=self._groups)
                    stream_key = key[len(prefix) :]
                    txn.delete(stream_key + group.encode(), db=self._group_by_stream)

    def _delete_positions_of_stream(self, txn: Any, stream_id: int) -> None:
        stream_key = _STREAM_KEY.pack(stream_id)
        cursor = txn.cursor(db=self._group_by_stream)
        doomed = []
        if cursor.set_range(stream_key):
            for key in cursor.iternext(keys=True, values=False):
                if not key.startswith(stream_key):
                    break
                doomed.append(key)
        for key in doomed:
            group = key[len(stream_key) :].decode()
            txn.delete(_group_prefix(group) + stream_key, db=self._groups)
            txn.delete(key, db=self._group_by_stream)

    def _raise(self, txn: Any, key: bytes, value: int) -> None:
        stored = txn.get(key, db=self._meta)
        if stored is None or U64.unpack(stored)[0] < value:
            txn.put(key, U64.pack(value), db=self._meta)

    def _put_range(self, txn: Any, rng: RangeRecord) -> None:
        key = _RANGE_KEY.pack(rng.stream_id, rng.range_index)
        old = txn.get(key, db=self._ranges)
        old_nodes = () if old is None else _decode_range(key, old).nodes
        for node_id in set(old_nodes) - set(rng.nodes):
            txn.delete(_NODE_KEY.pack(node_id) + key, db=self._by_node)
        txn.put(key, encode_range(rng), db=self._ranges)
        for node_id in set(rng.nodes) - set(old_nodes):
            txn.put(_NODE_KEY.pack(node_id) + key, b"", db=self._by_node)

    def _delete_range(self, txn: Any, stream_id: int, range_index: int) -> None:
        key = _RANGE_KEY.pack(stream_id, range_index)
        old = txn.get(key, db=self._ranges)
        if old is None:
            return
        for node_id in _decode_range(key, old).nodes:
            txn.delete(_NODE_KEY.pack(node_id) + key, db=self._by_node)
        txn.delete(key, db=self._ranges)
        txn.delete(key, db=self._moves)
