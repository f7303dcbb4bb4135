"""What the PM's metadata is read through (``Metadata``) and changed by
(the ``Change`` records a commit applies, all at once), whichever store
keeps it: ``pm.metadata.MetadataStore`` (LMDB) or
``pm.etcd_metadata.EtcdMetadataStore`` (etcd, SPEC §8)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sbp.errors import StreamNotFoundError

from .records import (
    GroupOffsetRecord,
    MemberRecord,
    MoveRecord,
    NodeRecord,
    ProducerRecord,
    RangeRecord,
    StreamRecord,
)


@dataclass(frozen=True, slots=True)
class PutStream:
    stream: StreamRecord


@dataclass(frozen=True, slots=True)
class DeleteStream:
    """Remove a stream with all of its ranges."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class PutRange:
    range: RangeRecord


@dataclass(frozen=True, slots=True)
class DeleteRange:
    stream_id: int
    range_index: int


@dataclass(frozen=True, slots=True)
class PutNode:
    node: NodeRecord


@dataclass(frozen=True, slots=True)
class DeleteNode:
    """Forget a data node (``sbp nodes remove``), its draining mark included."""

    node_id: int


@dataclass(frozen=True, slots=True)
class SetDraining:
    """Mark a data node draining (SPEC §12), or active again."""

    node_id: int
    draining: bool


@dataclass(frozen=True, slots=True)
class PutMove:
    move: MoveRecord


@dataclass(frozen=True, slots=True)
class DeleteMove:
    stream_id: int
    range_index: int


@dataclass(frozen=True, slots=True)
class RaiseNextStreamId:
    """Record that ids below ``value`` are taken; never lowers the stored value."""

    value: int


@dataclass(frozen=True, slots=True)
class MarkForeignStream:
    """Record that a data node holds stream ``stream_id``, which this PM
    never created (``pm.reconcile``): a reconcile never deletes it, though
    the next stream id has since moved past it."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class PutProducer:
    producer: ProducerRecord


@dataclass(frozen=True, slots=True)
class RaiseNextProducerId:
    """Record that producer ids below ``value`` are taken; never lowers it."""

    value: int


@dataclass(frozen=True, slots=True)
class PutGroupOffsets:
    """Store positions of one group, all at once (one COMMIT_OFFSETS)."""

    offsets: tuple[GroupOffsetRecord, ...]


@dataclass(frozen=True, slots=True)
class DeleteGroup:
    """Forget every position of a group."""

    group: str


@dataclass(frozen=True, slots=True)
class PutMember:
    """Store a consumer group member (SPEC §15)."""

    member: MemberRecord


@dataclass(frozen=True, slots=True)
class DeleteMember:
    """Forget a consumer group member: it left, or its session expired."""

    group: str
    member_id: str


Change = (
    PutStream
    | DeleteStream
    | PutRange
    | DeleteRange
    | PutNode
    | DeleteNode
    | SetDraining
    | PutMove
    | DeleteMove
    | RaiseNextStreamId
    | MarkForeignStream
    | PutProducer
    | RaiseNextProducerId
    | PutGroupOffsets
    | DeleteGroup
    | PutMember
    | DeleteMember
)


@dataclass(frozen=True, slots=True)
class MetadataCounts:
    streams: int
    ranges: int
    nodes: int


class Metadata(Protocol):
    """What the placement manager reads and writes, whichever store holds it:
    ``MetadataStore`` (LMDB, one PM) or ``pm.etcd_metadata.EtcdMetadataStore``
    (etcd, SPEC §8)."""

    def stream(self, stream_id: int) -> StreamRecord | None: ...
    def streams(self, *, start_after: int = 0, limit: int) -> list[StreamRecord]: ...
    def ranges(self, stream_id: int) -> list[RangeRecord]: ...
    def range(self, stream_id: int, range_index: int) -> RangeRecord | None: ...
    def last_range(self, stream_id: int) -> RangeRecord | None: ...
    def ranges_on_node(self, node_id: int) -> list[RangeRecord]: ...
    def nodes(self) -> list[NodeRecord]: ...
    def draining_nodes(self) -> set[int]: ...
    def moves(self) -> list[MoveRecord]: ...
    def next_stream_id(self) -> int: ...
    def foreign_streams(self) -> frozenset[int]: ...
    def producer(self, name: str) -> ProducerRecord | None: ...
    def producers(self) -> list[ProducerRecord]: ...
    def next_producer_id(self) -> int: ...
    def group_offsets(self, group: str) -> list[GroupOffsetRecord]: ...
    def all_group_offsets(self) -> list[GroupOffsetRecord]: ...
    def all_members(self) -> list[MemberRecord]: ...
    def counts(self) -> MetadataCounts: ...
    def range_counts_by_node(self) -> dict[int, int]: ...
    async def commit(self, changes: Sequence[Change]) -> None: ...


def no_stream(stream_id: int) -> StreamNotFoundError:
    """The error of a request naming a stream the metadata does not hold."""
    return StreamNotFoundError(f"no stream {stream_id}")


def require_stream(store: Metadata, stream_id: int) -> StreamRecord:
    """The stream, or ``no_stream``'s error raised."""
    stream = store.stream(stream_id)
    if stream is None:
        raise no_stream(stream_id)
    return stream
