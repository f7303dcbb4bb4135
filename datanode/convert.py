"""Between the wire's messages and the storage engine's records: ranges
(``sbp.messages.Range``, ``RangeInfo``) and producer state
(``ProducerSnapshot``, ``ProducerState``)."""

from __future__ import annotations

from collections.abc import Sequence

from sbp import messages
from sbp.enums import ObjectState
from sbp.ranges import check_range
from storage.model import RangeInfo, ReplicaInfo
from storage.producers import ProducerState, SequenceEntry
from storage.transaction import ProducerTable


def range_to_info(wire: messages.Range) -> RangeInfo:
    """A range as the PM (or a test) sent it, for the storage engine; a range
    whose fields are out of range is ``InvalidRequestError``. A range in the
    object store only has no replica: the nodes LIST_RANGES names for it
    serve it from the store (SPEC §14), and a node that took itself for one
    would copy it back onto its disk (catch-up)."""
    check_range(wire.stream_id, wire.range_index, wire.start_offset, wire.end_offset)
    in_store_only = wire.object_state == ObjectState.IN_STORE_ONLY
    return RangeInfo(
        stream_id=wire.stream_id,
        range_index=wire.range_index,
        start_offset=wire.start_offset,
        end_offset=wire.end_offset,
        epoch=wire.epoch,
        replicas=tuple(
            ReplicaInfo(
                replica.data_node.node_id, replica.data_node.advertise_addr, replica.is_primary
            )
            for replica in (() if in_store_only else wire.replica_nodes)
        ),
        object_state=wire.object_state,
    )


def info_to_range(info: RangeInfo, commit_offset: int | None = None) -> messages.Range:
    """A range as this node knows it, with its live next offset, for the wire.
    ``commit_offset`` defaults to what an unreplicated range has committed:
    everything stored (SPEC §7)."""
    if commit_offset is None:
        commit_offset = info.next_offset
    return messages.Range(
        stream_id=info.stream_id,
        range_index=info.range_index,
        start_offset=info.start_offset,
        end_offset=info.end_offset,
        next_offset=info.next_offset,
        replica_nodes=tuple(
            messages.ReplicaNode(
                data_node=messages.DataNode(
                    node_id=replica.node_id, advertise_addr=replica.address
                ),
                is_primary=replica.is_primary,
            )
            for replica in info.replicas
        ),
        epoch=info.epoch,
        commit_offset=commit_offset,
        object_state=info.object_state,
    )


def table_to_snapshots(table: ProducerTable) -> tuple[messages.ProducerSnapshot, ...]:
    return tuple(
        messages.ProducerSnapshot(
            producer_id=producer_id,
            last_append_ms=state.last_append_ms,
            batches=tuple(messages.ProducerBatch(*entry) for entry in state.entries()),
        )
        for producer_id, state in sorted(table.items())
    )


def snapshots_to_table(snapshots: Sequence[messages.ProducerSnapshot]) -> ProducerTable:
    return {
        snapshot.producer_id: ProducerState.of(
            [
                SequenceEntry(b.epoch, b.base_sequence, b.record_count, b.base_offset)
                for b in snapshot.batches
            ],
            snapshot.last_append_ms,
        )
        for snapshot in snapshots
        if snapshot.batches
    }
