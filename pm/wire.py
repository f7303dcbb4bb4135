"""Conversions between the PM's records and the wire messages (``sbp.messages``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Final

from sbp import messages
from sbp.errors import InvalidRequestError

from .records import NodeRecord, RangeRecord, StreamRecord

#: the REPORT_METRICS fields the PM keeps, every field but the reporting node
REPORT_FIELDS: Final = tuple(
    f.name for f in fields(messages.ReportMetricsRequest) if f.name != "data_node"
)


class DataNodeCache:
    """``DataNode`` messages by node id, built once per address: a response
    listing thousands of ranges repeats the same few nodes."""

    def __init__(self, address_of: Callable[[int], str]) -> None:
        self._address_of = address_of
        self._cache: dict[int, messages.DataNode] = {}

    def __call__(self, node_id: int) -> messages.DataNode:
        cached = self._cache.get(node_id)
        address = self._address_of(node_id)
        if cached is None or cached.advertise_addr != address:
            cached = self._cache[node_id] = messages.DataNode(
                node_id=node_id, advertise_addr=address
            )
        return cached


def range_message(
    rng: RangeRecord,
    data_node: Callable[[int], messages.DataNode],
    serving: Sequence[int] = (),
) -> messages.Range:
    """The wire form of a range. ``next_offset`` and ``commit_offset`` are
    the PM's snapshot: the end of a sealed range (everything below it is
    final, as its replicas report it too), the start of an open one (the
    replicas know the live values; DESCRIBE_RANGES on a data node returns
    them). A range in the object store only (SPEC §14) has no replica; to a
    reader, ``serving`` are the nodes that read it from the store, none of
    them primary."""
    snapshot = rng.start_offset if rng.is_open else rng.end_offset
    if serving:
        replicas = tuple(
            messages.ReplicaNode(data_node=data_node(node_id), is_primary=False)
            for node_id in serving
        )
    else:
        replicas = tuple(
            messages.ReplicaNode(data_node=data_node(node_id), is_primary=position == 0)
            for position, node_id in enumerate(rng.nodes)
        )
    return messages.Range(
        stream_id=rng.stream_id,
        range_index=rng.range_index,
        start_offset=rng.start_offset,
        end_offset=rng.end_offset,
        next_offset=snapshot,
        commit_offset=snapshot,
        replica_nodes=replicas,
        epoch=rng.epoch,
        object_state=rng.object_state,
    )


def range_record(rng: messages.Range) -> RangeRecord:
    """A range as a data node lists it, as a record (primary first)."""
    return RangeRecord(
        stream_id=rng.stream_id,
        range_index=rng.range_index,
        start_offset=rng.start_offset,
        nodes=tuple(node.node_id for node in rng.nodes_primary_first()),
        end_offset=rng.end_offset,
        epoch=rng.epoch,
    )


#: the fields a stream record and the wire's ``Stream`` share, all of them
_STREAM_FIELDS: Final = tuple(f.name for f in fields(StreamRecord))


def stream_message(stream: StreamRecord) -> messages.Stream:
    return messages.Stream(**{name: getattr(stream, name) for name in _STREAM_FIELDS})


def stream_record(stream: messages.Stream) -> StreamRecord:
    return StreamRecord(**{name: getattr(stream, name) for name in _STREAM_FIELDS})


def node_record(node: messages.DataNode | None) -> NodeRecord:
    """A data node as it identified itself; INVALID_REQUEST when it did not."""
    if node is None:
        raise InvalidRequestError("a data node must identify itself (data_node is missing)")
    return NodeRecord(node.node_id, node.advertise_addr)


def report_fields(report: messages.ReportMetricsRequest) -> dict[str, int]:
    return {name: int(getattr(report, name)) for name in REPORT_FIELDS}


def report_message(
    node: messages.DataNode, metrics: Mapping[str, int]
) -> messages.ReportMetricsRequest:
    known = {name: metrics[name] for name in REPORT_FIELDS if name in metrics}
    return messages.ReportMetricsRequest(data_node=node, **known)
