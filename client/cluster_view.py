"""One data node as ``sbp cluster status`` and ``sbp top`` show it: a row of
plain values (numbers, not text) from the PM's DESCRIBE_CLUSTER; and the
consumer groups as ``sbp groups list`` and ``sbp top`` show them."""

from __future__ import annotations

from typing import Any

from sbp import messages
from sbp.enums import DataNodeState
from sbp.errors import GroupNotFoundError

from .pm_client import PMClient


def state_name(state: int) -> str:
    """``active``, ``draining`` or ``drained`` (SPEC §12)."""
    try:
        return DataNodeState(state).name.lower()
    except ValueError:
        return f"state {state}"


def node_summary(status: messages.DataNodeStatus, now: float) -> dict[str, Any]:
    """One data node's row of ``cluster status`` and ``top``."""
    report = status.metrics or messages.ReportMetricsRequest(data_node=status.data_node)
    return {
        "node_id": status.data_node.node_id,
        "address": status.data_node.advertise_addr,
        "alive": status.alive,
        "last_heartbeat_ms": status.last_heartbeat_ms,
        # seconds since the last heartbeat (None: never heard from)
        "heartbeat_age_s": (
            round(max(0.0, now - status.last_heartbeat_ms / 1000), 3)
            if status.last_heartbeat_ms > 0
            else None
        ),
        "state": state_name(status.state),
        # while draining: bytes of its ranges still to copy to other nodes
        "bytes_to_move": status.bytes_to_move,
        "ranges": status.range_count,
        "active_ranges": report.range_active_cnt,
        # ranges the node knows to be missing a replica (SPEC §7)
        "under_replicated": report.range_missing_replica_cnt,
        "in_bytes_per_s": report.disk_in_rate,
        "out_bytes_per_s": report.disk_out_rate,
        "appends_per_s": report.network_append_rate,
        "fetches_per_s": report.network_fetch_rate,
        "failed_per_s": report.network_failed_append_rate + report.network_failed_fetch_rate,
        "append_ms": report.network_append_avg_latency,
        "fetch_ms": report.network_fetch_avg_latency,
        "commit_ms": report.uring_task_avg_latency,
        # None until the node's first REPORT_METRICS
        "disk_free_bytes": report.disk_free_space if status.metrics is not None else None,
        "memory_bytes": report.memory_used,
        "reported": status.metrics is not None,
    }


async def group_summaries(pm: PMClient, limit: int | None = None) -> list[dict[str, Any]]:
    """Each consumer group (the first ``limit`` listed) by name: its streams,
    its lag in records over all of them as the PM last learned the ends
    (None while no end is known), its last commit and its members (SPEC §15)."""
    summaries: list[dict[str, Any]] = []
    for listing in sorted(await pm.list_groups(), key=lambda g: g.group)[:limit]:
        try:
            positions = await pm.fetch_offsets(listing.group)
        except GroupNotFoundError:  # deleted meanwhile
            continue
        known = [p.lag_records for p in positions if p.lag_records >= 0]
        summaries.append(
            {
                "group": listing.group,
                "stream_ids": list(listing.stream_ids),
                "lag_records": sum(known) if known else None,
                "last_commit_ms": listing.last_commit_ms,
                "members": len(await pm.describe_members(listing.group)),
            }
        )
    return summaries
