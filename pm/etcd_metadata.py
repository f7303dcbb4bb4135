"""The PM's metadata in etcd (SPEC §8): the same reads and ``commit`` as the
LMDB store (``pm.metadata.MetadataStore``), so that ``PlacementManager``
does not know which one it runs on.

The leader loads every key under its prefix when it takes office and keeps
them in memory; reads are answered from there (the manager reads on the
event loop, synchronously, as it does from LMDB). A commit is one etcd
transaction that writes the changes only if the leader key is still this
PM's (``guard``); the copy in memory changes once etcd said yes. A PM whose
guard fails was deposed: ``NotLeaderError``, and it steps down.

Keys, under the prefix (``/sbp/`` by default); values are the LMDB store's
encodings, so that ``sbp-pm migrate`` copies them as they are:

=====================================  ====================================
``streams/<stream_id:020>``             replica_nums, retention, epoch, acks
``ranges/<stream_id:020>/<index:010>``  start, end, epoch, node ids
``nodes/<node_id:010>``                 advertise address
``draining/<node_id:010>``              empty: the node is draining (SPEC §12)
``moves/<stream_id:020>/<index:010>``   from node, cause, to nodes: a replica being moved
``producers/<name>``                    producer id, epoch (SPEC §10)
``groups/<group, hex>/<stream_id:020>`` offset, commit time, metadata (SPEC §11)
``members/<group, hex>/<member, hex>``  epoch, session timeout, streams (SPEC §15)
``meta/next_stream_id``                 the lowest id never handed out
``meta/next_producer_id``               the lowest producer id never handed out
``meta/foreign_stream/<stream_id:020>`` empty: a stream another PM placed on a data node
=====================================  ====================================

etcd limits a transaction's operations (``--max-txn-ops``, 128 by default):
a larger commit (a batch of creates) goes as several transactions, each
guarded, each holding whole streams, the raised next stream id in the first.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import trio

from sbp.errors import NotLeaderError, RequestTimeoutError

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
from .etcd import Etcd, EtcdUnavailable, TxnResult, delete_op, delete_prefix_op, put_op
from .metadata import FIRST_PRODUCER_ID, FIRST_STREAM_ID, U64
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

#: operations per transaction, below etcd's default limit of 128
MAX_TXN_OPS: Final = 120
#: how long a write is tried again while etcd has no leader (a member lost:
#: its election takes about a second) before the PM answers TIMEOUT
COMMIT_RETRY_S: Final = 3.0
COMMIT_RETRY_PAUSE_S: Final = 0.1

Guard = Callable[[], list[dict[str, Any]]]


class EtcdMetadataStore:
    """See the module docstring. ``guard`` gives the compares every write
    carries (the leader key is still ours); ``load`` must run first."""

    def __init__(
        self,
        etcd: Etcd,
        prefix: bytes,
        guard: Guard,
        on_deposed: Callable[[str], None] = lambda _why: None,
    ) -> None:
        self._etcd = etcd
        self._prefix = prefix
        self._guard = guard
        #: told when a guarded write was refused: this PM must step down
        self._on_deposed = on_deposed
        self._clear()

    def _clear(self) -> None:
        self._streams: dict[int, StreamRecord] = {}
        self._stream_ids: list[int] = []  # sorted
        self._ranges: dict[int, dict[int, RangeRecord]] = {}
        self._by_node: dict[int, set[tuple[int, int]]] = {}
        self._nodes: dict[int, NodeRecord] = {}
        self._draining: set[int] = set()
        self._moves: dict[tuple[int, int], MoveRecord] = {}
        self._next_stream_id = FIRST_STREAM_ID
        self._foreign: set[int] = set()
        self._producers: dict[str, ProducerRecord] = {}
        self._next_producer_id = FIRST_PRODUCER_ID
        #: group -> stream id -> position
        self._groups: dict[str, dict[int, GroupOffsetRecord]] = {}
        #: (group, member id) -> member
        self._members: dict[tuple[str, str], MemberRecord] = {}

    # -- keys ----------------------------------------------------------------------

    def _stream_key(self, stream_id: int) -> bytes:
        return self._prefix + b"streams/%020d" % stream_id

    def _range_key(self, stream_id: int, range_index: int) -> bytes:
        return self._prefix + b"ranges/%020d/%010d" % (stream_id, range_index)

    def _node_key(self, node_id: int) -> bytes:
        return self._prefix + b"nodes/%010d" % node_id

    def _draining_key(self, node_id: int) -> bytes:
        return self._prefix + b"draining/%010d" % node_id

    def _move_key(self, stream_id: int, range_index: int) -> bytes:
        return self._prefix + b"moves/%020d/%010d" % (stream_id, range_index)

    @property
    def _next_id_key(self) -> bytes:
        return self._prefix + b"meta/next_stream_id"

    def _foreign_key(self, stream_id: int) -> bytes:
        return self._prefix + b"meta/foreign_stream/%020d" % stream_id

    def _producer_key(self, name: str) -> bytes:
        return self._prefix + b"producers/" + name.encode()

    @property
    def _next_producer_id_key(self) -> bytes:
        return self._prefix + b"meta/next_producer_id"

    def _group_prefix(self, group: str) -> bytes:
        # hex: a group name may hold any character, "/" included
        return self._prefix + b"groups/" + group.encode().hex().encode() + b"/"

    def _group_key(self, group: str, stream_id: int) -> bytes:
        return self._group_prefix(group) + b"%020d" % stream_id

    def _member_key(self, group: str, member_id: str) -> bytes:
        return (
            self._prefix
            + b"members/"
            + group.encode().hex().encode()
            + b"/"
            + member_id.encode().hex().encode()
        )

    # -- loading ---------------------------------------------------------------------

    async def load(self) -> None:
        """Read every key under the prefix into memory (a new leader's first
        step; ``EtcdUnavailable`` when etcd cannot be read)."""
        kvs, _revision = await self._etcd.get_prefix(self._prefix)
        self._clear()
        streams = self._prefix + b"streams/"
        ranges = self._prefix + b"ranges/"
        nodes = self._prefix + b"nodes/"
        draining = self._prefix + b"draining/"
        moves = self._prefix + b"moves/"
        producers = self._prefix + b"producers/"
        groups = self._prefix + b"groups/"
        members = self._prefix + b"members/"
        foreign = self._prefix + b"meta/foreign_stream/"
        for kv in kvs:
            if kv.key.startswith(streams):
                stream_id = int(kv.key[len(streams) :])
                self._remember_stream(stream_from_value(stream_id, kv.value))
            elif kv.key.startswith(ranges):
                stream_id, index = (int(part) for part in kv.key[len(ranges) :].split(b"/"))
                self._remember_range(range_from_value(stream_id, index, kv.value))
            elif kv.key.startswith(nodes):
                node_id = int(kv.key[len(nodes) :])
                self._nodes[node_id] = NodeRecord(node_id, kv.value.decode())
            elif kv.key.startswith(draining):
                self._draining.add(int(kv.key[len(draining) :]))
            elif kv.key.startswith(moves):
                stream_id, index = (int(part) for part in kv.key[len(moves) :].split(b"/"))
                move = decode_move(stream_id, index, kv.value)
                self._moves[move.key] = move
            elif kv.key.startswith(producers):
                name = kv.key[len(producers) :].decode()
                self._producers[name] = producer_from_value(name, kv.value)
            elif kv.key.startswith(groups):
                name_hex, stream = kv.key[len(groups) :].split(b"/")
                record = group_offset_from_value(
                    bytes.fromhex(name_hex.decode()).decode(), int(stream), kv.value
                )
                self._groups.setdefault(record.group, {})[record.stream_id] = record
            elif kv.key.startswith(members):
                group_hex, member_hex = kv.key[len(members) :].split(b"/")
                member = member_from_value(
                    bytes.fromhex(group_hex.decode()).decode(),
                    bytes.fromhex(member_hex.decode()).decode(),
                    kv.value,
                )
                self._members[member.group, member.member_id] = member
            elif kv.key.startswith(foreign):
                self._foreign.add(int(kv.key[len(foreign) :]))
            elif kv.key == self._next_id_key:
                self._next_stream_id = int(U64.unpack(kv.value)[0])
            elif kv.key == self._next_producer_id_key:
                self._next_producer_id = int(U64.unpack(kv.value)[0])

    def close(self) -> None:
        """Nothing to close: the etcd client belongs to the caller."""

    # -- reads (the LMDB store's, from memory) -------------------------------------------

    def stream(self, stream_id: int) -> StreamRecord | None:
        return self._streams.get(stream_id)

    def streams(self, *, start_after: int = 0, limit: int) -> list[StreamRecord]:
        if limit <= 0:
            return []
        start = bisect.bisect_right(self._stream_ids, start_after)
        return [self._streams[i] for i in self._stream_ids[start : start + limit]]

    def ranges(self, stream_id: int) -> list[RangeRecord]:
        held = self._ranges.get(stream_id, {})
        return [held[index] for index in sorted(held)]

    def range(self, stream_id: int, range_index: int) -> RangeRecord | None:
        return self._ranges.get(stream_id, {}).get(range_index)

    def last_range(self, stream_id: int) -> RangeRecord | None:
        held = self._ranges.get(stream_id)
        return held[max(held)] if held else None

    def ranges_on_node(self, node_id: int) -> list[RangeRecord]:
        return [
            self._ranges[stream_id][index]
            for stream_id, index in sorted(self._by_node.get(node_id, ()))
        ]

    def nodes(self) -> list[NodeRecord]:
        return [self._nodes[i] for i in sorted(self._nodes)]

    def draining_nodes(self) -> set[int]:
        return set(self._draining)

    def moves(self) -> list[MoveRecord]:
        return [self._moves[key] for key in sorted(self._moves)]

    def next_stream_id(self) -> int:
        return self._next_stream_id

    def foreign_streams(self) -> frozenset[int]:
        return frozenset(self._foreign)

    def producer(self, name: str) -> ProducerRecord | None:
        return self._producers.get(name)

    def producers(self) -> list[ProducerRecord]:
        return [self._producers[name] for name in sorted(self._producers)]

    def next_producer_id(self) -> int:
        return self._next_producer_id

    def group_offsets(self, group: str) -> list[GroupOffsetRecord]:
        held = self._groups.get(group, {})
        return [held[stream_id] for stream_id in sorted(held)]

    def all_members(self) -> list[MemberRecord]:
        return list(self._members.values())

    def all_group_offsets(self) -> list[GroupOffsetRecord]:
        # Also read by /metrics from its own thread: copy before iterating
        # (list() of a dict is one step under the GIL).
        groups = sorted(list(self._groups.items()), key=lambda item: item[0].encode())
        found: list[GroupOffsetRecord] = []
        for _, held in groups:
            records = list(held.values())
            found += sorted(records, key=lambda r: r.stream_id)
        return found

    def counts(self) -> MetadataCounts:
        return MetadataCounts(
            streams=len(self._streams),
            ranges=sum(len(held) for held in self._ranges.values()),
            nodes=len(self._nodes),
        )

    def range_counts_by_node(self) -> dict[int, int]:
        return {node_id: len(keys) for node_id, keys in self._by_node.items() if keys}

    # -- writes --------------------------------------------------------------------------

    async def commit(self, changes: Sequence[Change]) -> None:
        """Write ``changes`` in guarded transactions, then to memory. Raises
        ``NotLeaderError`` when this PM is no longer the leader, and
        ``RequestTimeoutError`` (retriable) when etcd does not answer."""
        for group in _groups(changes, lambda change: len(self._ops(change))):
            ops = [op for change in group for op in self._ops(change)]
            result = await self._txn(ops)
            if not result.succeeded:
                self._on_deposed("a metadata write was refused: the leader key is not ours")
                raise NotLeaderError("this PM is no longer the leader")
            for change in group:
                self._apply(change)

    async def _txn(self, ops: list[dict[str, Any]]) -> TxnResult:
        """One guarded transaction, tried again for ``COMMIT_RETRY_S`` while
        etcd does not answer (a transaction that did go through before its
        answer was lost is harmless again: puts and deletes of the same keys,
        under the same guard)."""
        give_up = trio.current_time() + COMMIT_RETRY_S
        while True:
            try:
                return await self._etcd.txn(self._guard(), ops)
            except EtcdUnavailable as error:
                if trio.current_time() >= give_up:
                    raise RequestTimeoutError(f"etcd did not take the write: {error}") from None
            await trio.sleep(COMMIT_RETRY_PAUSE_S)

    def _ops(self, change: Change) -> list[dict[str, Any]]:
        match change:
            case PutStream(stream):
                return [put_op(self._stream_key(stream.stream_id), encode_stream(stream))]
            case DeleteStream(stream_id):
                return [
                    delete_op(self._stream_key(stream_id)),
                    delete_prefix_op(self._prefix + b"ranges/%020d/" % stream_id),
                    delete_prefix_op(self._prefix + b"moves/%020d/" % stream_id),
                    *(
                        delete_op(self._group_key(group, stream_id))
                        for group, held in self._groups.items()
                        if stream_id in held
                    ),
                ]
            case PutRange(rng):
                return [put_op(self._range_key(rng.stream_id, rng.range_index), encode_range(rng))]
            case DeleteRange(stream_id, range_index):
                return [
                    delete_op(self._range_key(stream_id, range_index)),
                    delete_op(self._move_key(stream_id, range_index)),
                ]
            case PutMove(move):
                return [put_op(self._move_key(*move.key), encode_move(move))]
            case DeleteMove(stream_id, range_index):
                return [delete_op(self._move_key(stream_id, range_index))]
            case PutNode(node):
                return [put_op(self._node_key(node.node_id), node.address.encode())]
            case DeleteNode(node_id):
                return [delete_op(self._node_key(node_id)), delete_op(self._draining_key(node_id))]
            case SetDraining(node_id, draining):
                key = self._draining_key(node_id)
                return [put_op(key, b"") if draining else delete_op(key)]
            case RaiseNextStreamId(value):
                if value <= self._next_stream_id:
                    return []
                return [put_op(self._next_id_key, U64.pack(value))]
            case MarkForeignStream(stream_id):
                return [put_op(self._foreign_key(stream_id), b"")]
            case PutProducer(producer):
                return [put_op(self._producer_key(producer.name), encode_producer(producer))]
            case RaiseNextProducerId(value):
                if value <= self._next_producer_id:
                    return []
                return [put_op(self._next_producer_id_key, U64.pack(value))]
            case PutGroupOffsets(offsets):
                return [
                    put_op(self._group_key(r.group, r.stream_id), encode_group_offset(r))
                    for r in offsets
                ]
            case DeleteGroup(group):
                return [delete_prefix_op(self._group_prefix(group))]
            case PutMember(member):
                key = self._member_key(member.group, member.member_id)
                return [put_op(key, encode_member(member))]
            case DeleteMember(group, member_id):
                return [delete_op(self._member_key(group, member_id))]
        raise TypeError(f"unknown change {change!r}")

    def _apply(self, change: Change) -> None:
        match change:
            case PutStream(stream):
                self._remember_stream(stream)
            case DeleteStream(stream_id):
                for rng in self.ranges(stream_id):
                    self._forget_range(rng.stream_id, rng.range_index)
                    self._moves.pop(rng.key, None)
                if self._streams.pop(stream_id, None) is not None:
                    self._stream_ids.remove(stream_id)
                for group in list(self._groups):
                    held = self._groups[group]
                    held.pop(stream_id, None)
                    if not held:
                        del self._groups[group]
            case PutRange(rng):
                self._remember_range(rng)
            case DeleteRange(stream_id, range_index):
                self._forget_range(stream_id, range_index)
                self._moves.pop((stream_id, range_index), None)
            case PutNode(node):
                self._nodes[node.node_id] = node
            case DeleteNode(node_id):
                self._nodes.pop(node_id, None)
                self._draining.discard(node_id)
            case SetDraining(node_id, draining):
                if draining:
                    self._draining.add(node_id)
                else:
                    self._draining.discard(node_id)
            case PutMove(move):
                self._moves[move.key] = move
            case DeleteMove(stream_id, range_index):
                self._moves.pop((stream_id, range_index), None)
            case RaiseNextStreamId(value):
                self._next_stream_id = max(self._next_stream_id, value)
            case MarkForeignStream(stream_id):
                self._foreign.add(stream_id)
            case PutProducer(producer):
                self._producers[producer.name] = producer
            case RaiseNextProducerId(value):
                self._next_producer_id = max(self._next_producer_id, value)
            case PutGroupOffsets(offsets):
                for record in offsets:
                    self._groups.setdefault(record.group, {})[record.stream_id] = record
            case DeleteGroup(group):
                self._groups.pop(group, None)
            case PutMember(member):
                self._members[member.group, member.member_id] = member
            case DeleteMember(group, member_id):
                self._members.pop((group, member_id), None)

    def _remember_stream(self, stream: StreamRecord) -> None:
        if stream.stream_id not in self._streams:
            bisect.insort(self._stream_ids, stream.stream_id)
        self._streams[stream.stream_id] = stream

    def _remember_range(self, rng: RangeRecord) -> None:
        self._forget_range(rng.stream_id, rng.range_index)
        self._ranges.setdefault(rng.stream_id, {})[rng.range_index] = rng
        for node_id in rng.nodes:
            self._by_node.setdefault(node_id, set()).add((rng.stream_id, rng.range_index))

    def _forget_range(self, stream_id: int, range_index: int) -> None:
        held = self._ranges.get(stream_id)
        old = held.pop(range_index, None) if held is not None else None
        if old is None:
            return
        if not held:
            del self._ranges[stream_id]
        for node_id in old.nodes:
            self._by_node.get(node_id, set()).discard((stream_id, range_index))


def _groups(changes: Sequence[Change], op_count: Callable[[Change], int]) -> Iterable[list[Change]]:
    """The changes cut into transactions of at most ``MAX_TXN_OPS``
    operations: a stream's changes stay together (only a migration's stream
    with very many ranges is cut), and the raised next stream id goes in
    the first."""
    units: list[list[Change]] = [[c] for c in changes if isinstance(c, RaiseNextStreamId)]
    alone = (
        PutNode
        | DeleteNode
        | SetDraining
        | MarkForeignStream
        | PutProducer
        | RaiseNextProducerId
        | PutGroupOffsets
        | DeleteGroup
        | PutMember
        | DeleteMember
    )
    units += [[c] for c in changes if isinstance(c, alone)]
    by_stream: dict[int, list[Change]] = {}
    for change in changes:
        if isinstance(change, PutStream):
            by_stream.setdefault(change.stream.stream_id, []).append(change)
        elif isinstance(change, PutRange):
            by_stream.setdefault(change.range.stream_id, []).append(change)
        elif isinstance(change, DeleteStream | DeleteRange | DeleteMove):
            by_stream.setdefault(change.stream_id, []).append(change)
        elif isinstance(change, PutMove):
            by_stream.setdefault(change.move.stream_id, []).append(change)
    cap = MAX_TXN_OPS // 2  # changes, when each may take two operations
    for stream_changes in by_stream.values():
        units += [stream_changes[i : i + cap] for i in range(0, len(stream_changes), cap)]
    placed = sum(len(unit) for unit in units)
    if placed != len(changes):  # a kind of change this function does not know
        raise TypeError(f"{len(changes) - placed} changes of a kind not cut into transactions")
    group: list[Change] = []
    ops = 0
    for unit in units:
        unit_ops = sum(op_count(change) for change in unit)
        if group and ops + unit_ops > MAX_TXN_OPS:
            yield group
            group, ops = [], 0
        group.extend(unit)
        ops += unit_ops
    if group:
        yield group
