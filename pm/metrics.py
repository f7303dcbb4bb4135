"""What the PM exposes on /metrics.

Cluster state (streams, ranges, data nodes, their heartbeats and load
reports) is read when scraped, by a collector, so it is never stale and costs
nothing between scrapes. The scrape runs on the HTTP server's thread: the
collector reads LMDB through its own read transaction and copies the node
states before iterating them, never holding anything the event loop needs.

Requests, frames and connections are counted by ``net.metrics.ServerMetrics``,
the connection observer both servers share.

To add a metric: a cluster gauge is one more ``yield`` in
``ClusterCollector.collect``; a request-level one goes on ``ServerMetrics``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from net.metrics import ServerMetrics, new_registry
from sbp.enums import DataNodeState

from .manager import PlacementManager
from .records import MoveCause

NAMESPACE: Final = "sbp_pm"

#: REPORT_METRICS fields (wire names, fixed by the spec) as metrics named by
#: Prometheus' conventions, in base units: (field, name, help, scale to the unit)
REPORTED: Final = (
    ("disk_in_rate", "disk_written_bytes_per_second", "bytes written to storage per second", 1),
    ("disk_out_rate", "disk_read_bytes_per_second", "bytes read from storage per second", 1),
    ("disk_free_space", "disk_free_bytes", "free bytes of storage", 1),
    ("disk_unindexed_data_size", "unindexed_bytes", "bytes appended but not yet indexed", 1),
    ("memory_used", "memory_used_bytes", "resident memory of the node", 1),
    ("uring_task_rate", "storage_commits_per_second", "group commits per second", 1),
    ("uring_inflight_task_cnt", "storage_committing_appends",
     "appends in the transaction being committed", 1),
    ("uring_pending_task_cnt", "storage_waiting_appends", "appends waiting for a commit", 1),
    ("uring_task_avg_latency", "storage_commit_latency_seconds",
     "mean time of one group commit", 0.001),
    ("network_append_rate", "appends_per_second", "APPEND requests served per second", 1),
    ("network_fetch_rate", "fetches_per_second", "FETCH requests served per second", 1),
    ("network_failed_append_rate", "failed_appends_per_second",
     "APPEND items answered with an error per second", 1),
    ("network_failed_fetch_rate", "failed_fetches_per_second",
     "FETCH items answered with an error per second", 1),
    ("network_append_avg_latency", "append_latency_seconds", "mean APPEND latency", 0.001),
    ("network_fetch_avg_latency", "fetch_latency_seconds", "mean FETCH latency", 0.001),
    ("range_missing_replica_cnt", "under_replicated_ranges", "ranges missing a replica", 1),
    ("range_active_cnt", "open_ranges", "open ranges hosted", 1),
)  # fmt: skip


class PMMetrics:
    """Every metric of one PM, in its own registry."""

    def __init__(
        self,
        manager: PlacementManager | Callable[[], PlacementManager | None],
        *,
        lag_max_series: int = 1000,
    ) -> None:
        self.registry = new_registry()
        current = manager if callable(manager) else (lambda: manager)
        self.registry.register(ClusterCollector(current))
        self.registry.register(GroupCollector(current, lag_max_series))
        self.registry.register(CompactionCollector(current, lag_max_series))
        self.registry.register(TieringCollector(current, lag_max_series))
        self.connections = ServerMetrics(self.registry)


class ClusterCollector(Collector):
    """Streams, ranges and data nodes, computed at scrape time; nothing from a
    PM on etcd that does not lead (its metadata is the leader's to report)."""

    def __init__(self, current: Callable[[], PlacementManager | None]) -> None:
        self._current = current

    def collect(self) -> Iterator[Metric]:
        manager = self._current()
        if manager is None:
            return
        yield from self._cluster(manager)

    def _cluster(self, manager: PlacementManager) -> Iterator[Metric]:
        counts = manager.counts()
        yield GaugeMetricFamily(f"{NAMESPACE}_streams", "streams", value=counts.streams)
        # Every stream has exactly one open range, its last one.
        ranges = GaugeMetricFamily(f"{NAMESPACE}_ranges", "ranges by state", labels=["state"])
        ranges.add_metric(["open"], counts.streams)
        ranges.add_metric(["sealed"], max(counts.ranges - counts.streams, 0))
        yield ranges
        yield GaugeMetricFamily(
            f"{NAMESPACE}_under_replicated_ranges",
            "replicated ranges with a replica on a dead node, or on fewer nodes than they want",
            value=manager.upkeep.under_replicated(),
        )
        seals = CounterMetricFamily(
            f"{NAMESPACE}_seals", "ranges sealed, by cause", labels=["cause"]
        )
        for cause in (
            "request",
            "compaction",
            "dead_primary",
            "repair",
            "full_node",
            "under_replicated",
            "drain",
        ):
            seals.add_metric([cause], manager.seals[cause])
        yield seals
        reconciled = CounterMetricFamily(
            f"{NAMESPACE}_reconciled_streams",
            "streams sent to a data node whose view of them differed from the metadata, by cause",
            labels=["cause"],
        )
        for cause in ("returning", "periodic"):
            reconciled.add_metric([cause], manager.reconciler.reconciled[cause])
        yield reconciled
        yield CounterMetricFamily(
            f"{NAMESPACE}_repairs",
            "ranges given a replica on a live node (a dead one replaced, or one they lacked)",
            value=manager.upkeep.repairs,
        )

        yield CounterMetricFamily(
            f"{NAMESPACE}_size_retention_trims",
            "trims of streams over their size limit (retention_bytes)",
            value=manager.size_retention.trims,
        )
        yield CounterMetricFamily(
            f"{NAMESPACE}_size_retention_dropped_bytes",
            "bytes of record batches those trims dropped (as sized by a replica)",
            value=manager.size_retention.trimmed_bytes,
        )
        yield CounterMetricFamily(
            f"{NAMESPACE}_rebalance_moved_ranges",
            "ranges a rebalance moved to another data node",
            value=manager.rebalancer.moved,
        )
        yield GaugeMetricFamily(
            f"{NAMESPACE}_rebalance_pending_moves",
            "range moves of a rebalance not done yet",
            value=manager.rebalancer.pending(),
        )
        in_flight = GaugeMetricFamily(
            f"{NAMESPACE}_range_moves",
            "moves of sealed ranges' replicas under way (recorded in the metadata), by cause",
            labels=["cause"],
        )
        waiting = Counter(move.cause for move in manager.moves.in_flight())
        for move_cause in MoveCause:
            in_flight.add_metric([move_cause.name.lower()], waiting[move_cause])
        yield in_flight
        yield CounterMetricFamily(
            f"{NAMESPACE}_drain_moved_ranges",
            "ranges whose replica on a draining data node left once others held all of it",
            value=manager.drains.moved,
        )
        registry = manager.registry
        states = list(registry.states())
        by_state = GaugeMetricFamily(
            f"{NAMESPACE}_data_nodes", "data nodes by liveness", labels=["state"]
        )
        by_state.add_metric(["alive"], sum(1 for s in states if s.alive))
        by_state.add_metric(["dead"], sum(1 for s in states if not s.alive))
        yield by_state
        drain_states = [manager.drains.state(s.node_id) for s in states]
        by_drain = GaugeMetricFamily(
            f"{NAMESPACE}_data_nodes_by_drain_state",
            "data nodes active, draining, or drained (SPEC §12)",
            labels=["state"],
        )
        for kind in DataNodeState:
            by_drain.add_metric([kind.name.lower()], drain_states.count(kind))
        yield by_drain
        to_move = GaugeMetricFamily(
            f"{NAMESPACE}_data_node_drain_bytes_to_move",
            "bytes of the draining data node's ranges still to copy to other nodes",
            labels=["node"],
        )
        for node_id in sorted(list(manager.drains.bytes_to_move)):
            to_move.add_metric([str(node_id)], manager.drains.to_move(node_id))
        yield to_move

        since = GaugeMetricFamily(
            f"{NAMESPACE}_data_node_seconds_since_heartbeat",
            "seconds since the data node's last HEARTBEAT or REPORT_METRICS",
            labels=["node"],
        )
        hosted = GaugeMetricFamily(
            f"{NAMESPACE}_data_node_ranges", "ranges hosted by the data node", labels=["node"]
        )
        alive = GaugeMetricFamily(
            f"{NAMESPACE}_data_node_alive", "1 while the data node is alive", labels=["node"]
        )
        reported = {
            field: (
                GaugeMetricFamily(
                    f"{NAMESPACE}_data_node_{name}",
                    f"{text}, from the data node's latest REPORT_METRICS ({field})",
                    labels=["node"],
                ),
                scale,
            )
            for field, name, text, scale in REPORTED
        }
        floor = manager.min_free_space
        to_full = GaugeMetricFamily(
            f"{NAMESPACE}_data_node_seconds_to_full",
            "seconds until the data node has less free space than --min-free-space at the "
            "write rate of its latest report (nodes that write)",
            labels=["node"],
        )
        yield GaugeMetricFamily(
            f"{NAMESPACE}_data_nodes_near_full",
            "live data nodes with less than twice --min-free-space free, or full within "
            "an hour at their write rate",
            value=sum(1 for s in states if s.alive and s.is_near_full(floor)),
        )
        for state in states:
            node = str(state.node_id)
            left = state.seconds_to_full(floor)
            if left is not None:
                to_full.add_metric([node], left)
            since.add_metric([node], registry.seconds_since_seen(state))
            hosted.add_metric([node], state.hosted_ranges)
            alive.add_metric([node], 1 if state.alive else 0)
            for field, value in dict(state.metrics).items():
                if field in reported:
                    family, scale = reported[field]
                    family.add_metric([node], value * scale)
        yield since
        yield to_full
        yield hosted
        yield alive
        yield from (family for family, _ in reported.values())


class GroupCollector(Collector):
    """Consumer groups' positions and lag (SPEC §11), at scrape time: at
    most ``max_series`` (group, stream) pairs, the furthest behind first,
    so that many groups cannot flood Prometheus."""

    def __init__(self, current: Callable[[], PlacementManager | None], max_series: int) -> None:
        self._current = current
        self._max_series = max_series

    def collect(self) -> Iterator[Metric]:
        manager = self._current()
        if manager is None:
            return
        groups = manager.groups
        shown, total = groups.furthest_behind(self._max_series)
        labels = ["group", "stream"]
        records = GaugeMetricFamily(
            "sbp_group_lag_records",
            "records between the group's committed offset and the stream's end",
            labels=labels,
        )
        seconds = GaugeMetricFamily(
            "sbp_group_lag_seconds",
            "age of the oldest record the group has not consumed (0 at the end)",
            labels=labels,
        )
        committed = GaugeMetricFamily(
            "sbp_group_committed_offset",
            "the group's committed offset (the next it reads)",
            labels=labels,
        )
        for position in shown:
            key = [position.record.group, str(position.record.stream_id)]
            committed.add_metric(key, position.record.offset)
            if position.lag_records >= 0:
                records.add_metric(key, position.lag_records)
            if position.lag_ms is not None:
                seconds.add_metric(key, position.lag_ms / 1000)
        yield records
        yield seconds
        yield committed
        yield GaugeMetricFamily(
            "sbp_group_positions",
            "(group, stream) positions stored, shown on /metrics or not",
            value=total,
        )
        commits = CounterMetricFamily(
            "sbp_group_commits", "COMMIT_OFFSETS stored, by group", labels=["group"]
        )
        for group, count in sorted(groups.commits.items()):
            commits.add_metric([group], count)
        yield commits
        yield from _members(manager, self._max_series)


def _members(manager: PlacementManager, max_series: int) -> Iterator[Metric]:
    """Consumer group members (SPEC §15): how many, how often streams
    moved, and streams no member reads (at most ``max_series`` each)."""
    members = manager.members
    count = GaugeMetricFamily("sbp_group_members", "live members of the group", labels=["group"])
    for group in members.groups()[:max_series]:
        count.add_metric([group], len(members.members(group)))
    yield count
    rebalances = CounterMetricFamily(
        "sbp_group_rebalances",
        "heartbeat answers that changed a member's streams (joins, leaves, moves)",
        labels=["group"],
    )
    for group, moved in sorted(members.rebalances.items())[:max_series]:
        rebalances.add_metric([group], moved)
    yield rebalances
    unowned = GaugeMetricFamily(
        "sbp_group_stream_unowned_seconds",
        "seconds since a member last read a stream the group subscribes to that none reads now",
        labels=["group", "stream"],
    )
    for group, stream, seconds in sorted(members.unowned(), key=lambda u: -u[2])[:max_series]:
        unowned.add_metric([group, str(stream)], seconds)
    yield unowned


class CompactionCollector(Collector):
    """Compacted streams' passes (SPEC §13): what they removed, and each
    stream's dirty ratio (at most ``max_series`` streams, the dirtiest first)."""

    def __init__(self, current: Callable[[], PlacementManager | None], max_series: int) -> None:
        self._current = current
        self._max_series = max_series

    def collect(self) -> Iterator[Metric]:
        manager = self._current()
        if manager is None:
            return
        compactor = manager.compactor
        stats = compactor.stats
        passes = CounterMetricFamily(
            f"{NAMESPACE}_compaction_passes",
            "passes over a compacted stream that rewrote its ranges, by result",
            labels=["result"],
        )
        passes.add_metric(["done"], stats.passes - stats.failed_passes)
        passes.add_metric(["failed"], stats.failed_passes)
        yield passes
        for name, help_text, value in (
            (
                "compaction_rewritten_bytes",
                "bytes of sealed range replicas rewritten by compaction, before",
                stats.bytes_before,
            ),
            (
                "compaction_removed_bytes",
                "bytes compaction removed from sealed range replicas",
                stats.bytes_before - stats.bytes_after,
            ),
            (
                "compaction_removed_records",
                "records compaction removed from replicas (superseded, or expired tombstones)",
                stats.records_removed,
            ),
            (
                "compaction_removed_tombstones",
                "tombstones compaction removed from replicas",
                stats.tombstones_removed,
            ),
            (
                "compaction_rolled_ranges",
                "open ranges of compacted streams sealed on reaching the roll size",
                stats.rolls,
            ),
        ):
            yield CounterMetricFamily(f"{NAMESPACE}_{name}", help_text, value=value)
        dirty = GaugeMetricFamily(
            f"{NAMESPACE}_compaction_dirty_ratio",
            "share of a compacted stream's sealed bytes not compacted yet",
            labels=["stream"],
        )
        streams = sorted(compactor.streams.items(), key=lambda item: -item[1].dirty)
        for stream_id, state in streams[: self._max_series]:
            dirty.add_metric([str(stream_id)], state.dirty)
        yield dirty


class TieringCollector(Collector):
    """Tiered storage (SPEC §14): the ranges' moves to the object store, and
    each tiered stream's bytes on the nodes and in the store (at most
    ``max_series`` streams, the largest first)."""

    def __init__(self, current: Callable[[], PlacementManager | None], max_series: int) -> None:
        self._current = current
        self._max_series = max_series

    def collect(self) -> Iterator[Metric]:
        manager = self._current()
        if manager is None or manager.tiering is None:
            return
        tiering = manager.tiering
        for name, help_text, value in (
            ("tiering_copied_ranges", "sealed ranges copied to the object store", tiering.copied),
            (
                "tiering_offloaded_ranges",
                "copied ranges dropped from the data nodes (in the object store only)",
                tiering.offloaded,
            ),
            ("tiering_deleted_objects", "objects deleted from the store", tiering.deleted_objects),
            ("tiering_copy_failures", "copies that failed (tried again)", tiering.copy_failures),
            (
                "tiering_rolled_ranges",
                "open ranges of tiered streams sealed on reaching the roll size",
                tiering.rolls,
            ),
        ):
            yield CounterMetricFamily(f"{NAMESPACE}_{name}", help_text, value=value)
        yield GaugeMetricFamily(
            f"{NAMESPACE}_tiering_pending_copies",
            "sealed ranges of tiered streams not copied to the object store yet",
            value=tiering.pending_copies(),
        )
        yield GaugeMetricFamily(
            f"{NAMESPACE}_tiering_oldest_uncopied_seconds",
            "how long the sealed range waiting longest for its copy has waited",
            value=tiering.oldest_uncopied_seconds(),
        )
        stored = GaugeMetricFamily(
            f"{NAMESPACE}_tiered_stream_bytes",
            "bytes of a tiered stream's record batches on the data nodes (one replica's) and "
            "in the object store",
            labels=["stream", "where"],
        )
        largest = sorted(tiering.bytes_by_stream().items(), key=lambda item: -sum(item[1]))
        for stream_id, (on_nodes, in_store) in largest[: self._max_series]:
            stored.add_metric([str(stream_id), "nodes"], on_nodes)
            stored.add_metric([str(stream_id), "store"], in_store)
        yield stored
