"""Writes dashboards/sbp-cluster.json, the Grafana dashboard of an SBP cluster.

The panels are listed here as (title, description, unit, PromQL queries);
``python dashboards/build.py`` regenerates the JSON, and a test checks that
the committed file matches and that every query returns data from a real
Prometheus scraping a real cluster (tests/integration/test_prometheus.py).

The dashboard is built with Grafana's typed builders (the
``grafana-foundation-sdk`` package), so its JSON has the shape Grafana
expects. Variables: ``$datasource`` (any Prometheus; nothing is baked in on
import), ``$datanode_job`` and ``$pm_job`` (the scrape jobs, by default
``sbp-datanode`` and ``sbp-pm``, docs/metrics.md) and ``$node`` (data nodes
by their ``instance`` label).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Final, NamedTuple

from grafana_foundation_sdk.builders.dashboard import (
    AnnotationQuery,
    Dashboard,
    DatasourceVariable,
    QueryVariable,
    Row,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery as PromQuery
from grafana_foundation_sdk.builders.stat import Panel as StatPanel
from grafana_foundation_sdk.builders.timeseries import Panel as TimeseriesPanel
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    VariableOption,
    VariableRefresh,
)

OUTPUT: Final = Path(__file__).with_name("sbp-cluster.json")
NODE: Final = 'job="$datanode_job",instance=~"$node"'
PM: Final = 'job="$pm_job"'
TABLES: Final = 'job="$tables_job"'
RATE: Final = "[$__rate_interval]"


class Panel(NamedTuple):
    title: str
    description: str
    unit: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    kind: str = "timeseries"


def quantile(
    q: float, selector: str, by: str, histogram: str = "sbp_request_duration_seconds"
) -> str:
    return (
        f"histogram_quantile({q}, sum by (le, {by}) (rate({histogram}_bucket{{{selector}}}{RATE})))"
    )


ROWS: Final[tuple[tuple[str, tuple[Panel, ...]], ...]] = (
    (
        "Cluster overview",
        (
            Panel(
                "Data nodes alive",
                "Data nodes the PM counts alive (heartbeat within its node timeout).",
                "none",
                ((f'sum(sbp_pm_data_nodes{{{PM},state="alive"}})', "alive"),),
                "stat",
            ),
            Panel(
                "Data nodes dead",
                "Data nodes the PM knows that missed heartbeats for the node timeout.",
                "none",
                ((f'sum(sbp_pm_data_nodes{{{PM},state="dead"}})', "dead"),),
                "stat",
            ),
            Panel(
                "Streams",
                "Streams in the PM's metadata.",
                "none",
                ((f"sum(sbp_pm_streams{{{PM}}})", ""),),
                "stat",
            ),
            Panel(
                "Ranges",
                "Ranges in the PM's metadata: open (one per stream) and sealed.",
                "none",
                ((f"sum by (state) (sbp_pm_ranges{{{PM}}})", "{{state}}"),),
                "stat",
            ),
            Panel(
                "Cluster throughput",
                "Record batch bytes appended (durable) and returned by FETCH, all nodes.",
                "Bps",
                (
                    (f"sum(rate(sbp_datanode_appended_bytes_total{{{NODE}}}{RATE}))", "appended"),
                    (f"sum(rate(sbp_datanode_fetched_bytes_total{{{NODE}}}{RATE}))", "fetched"),
                ),
            ),
        ),
    ),
    (
        "Throughput per data node",
        (
            Panel(
                "Appended bytes/s",
                "Record batch bytes made durable per second, per node.",
                "Bps",
                (
                    (
                        f"sum by (instance) (rate(sbp_datanode_appended_bytes_total{{{NODE}}}{RATE}))",
                        "{{instance}}",
                    ),
                ),
            ),
            Panel(
                "Appended records/s",
                "Records made durable per second, per node.",
                "rps",
                (
                    (
                        f"sum by (instance) (rate(sbp_datanode_appended_records_total{{{NODE}}}{RATE}))",
                        "{{instance}}",
                    ),
                ),
            ),
            Panel(
                "Fetched bytes/s",
                "Record batch bytes returned by FETCH per second, per node.",
                "Bps",
                (
                    (
                        f"sum by (instance) (rate(sbp_datanode_fetched_bytes_total{{{NODE}}}{RATE}))",
                        "{{instance}}",
                    ),
                ),
            ),
            Panel(
                "Requests/s by opcode",
                "Requests served per second, per node and opcode.",
                "reqps",
                (
                    (
                        f"sum by (instance, opcode) (rate(sbp_requests_total{{{NODE}}}{RATE}))",
                        "{{instance}} {{opcode}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Latency",
        (
            Panel(
                "APPEND latency",
                "Receipt to the last result (durable), p50 and p99 per node.",
                "s",
                (
                    (quantile(0.5, f'{NODE},opcode="APPEND"', "instance"), "p50 {{instance}}"),
                    (quantile(0.99, f'{NODE},opcode="APPEND"', "instance"), "p99 {{instance}}"),
                ),
            ),
            Panel(
                "FETCH latency",
                "Receipt to the last response frame, p50 and p99 per node; long polls wait "
                "up to their max_wait_ms by design.",
                "s",
                (
                    (quantile(0.5, f'{NODE},opcode="FETCH"', "instance"), "p50 {{instance}}"),
                    (quantile(0.99, f'{NODE},opcode="FETCH"', "instance"), "p99 {{instance}}"),
                ),
            ),
            Panel(
                "Group commit and sync time, p99",
                "The storage writer: writing and committing one group, and the commit "
                "call alone (the fsyncs with sync always).",
                "s",
                (
                    (
                        quantile(
                            0.99, NODE, "instance", "sbp_datanode_group_commit_duration_seconds"
                        ),
                        "commit {{instance}}",
                    ),
                    (
                        quantile(0.99, NODE, "instance", "sbp_datanode_sync_duration_seconds"),
                        "sync {{instance}}",
                    ),
                ),
            ),
            Panel(
                "Appends per group commit",
                "Mean group size: appends committed together in one LMDB transaction.",
                "none",
                (
                    (
                        f"sum by (instance) (rate(sbp_datanode_group_commit_appends_sum{{{NODE}}}{RATE})) / sum by (instance) (rate(sbp_datanode_group_commit_appends_count{{{NODE}}}{RATE}))",
                        "{{instance}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Errors",
        (
            Panel(
                "Error answers/s",
                "Requests answered with a SYSTEM_ERROR, by server and code.",
                "reqps",
                (
                    (
                        f'sum by (job, code) (rate(sbp_requests_total{{code!="NONE"}}{RATE}))',
                        "{{job}} {{code}}",
                    ),
                ),
            ),
            Panel(
                "Failed items/s",
                "APPEND and FETCH items answered with an error code, per node.",
                "ops",
                (
                    (
                        f"sum by (instance) (rate(sbp_datanode_append_items_failed_total{{{NODE}}}{RATE}))",
                        "append {{instance}}",
                    ),
                    (
                        f"sum by (instance) (rate(sbp_datanode_fetch_items_failed_total{{{NODE}}}{RATE}))",
                        "fetch {{instance}}",
                    ),
                ),
            ),
            Panel(
                "Bad frames/s",
                "Frames discarded or rejected by the bad-frame rules, by server and reason.",
                "ops",
                (
                    (
                        f"sum by (job, reason) (rate(sbp_frames_discarded_total{RATE}))",
                        "{{job}} {{reason}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Idempotent producers",
        (
            Panel(
                "Producers tracked",
                "Idempotent producers whose state each node keeps, once per stream they "
                "append to (SPEC §10).",
                "none",
                ((f"sbp_datanode_producers{{{NODE}}}", "{{instance}}"),),
            ),
            Panel(
                "Resends and refusals/s",
                "Resends answered with the offset they were stored at (not stored again), and "
                "items refused as fenced, out of order or of an unknown producer, per node.",
                "ops",
                (
                    (
                        f"sum by (instance) (rate(sbp_datanode_duplicates_answered_total{{{NODE}}}{RATE}))",
                        "resent {{instance}}",
                    ),
                    (
                        f"sum by (instance) (rate(sbp_datanode_producers_fenced_total{{{NODE}}}{RATE}))",
                        "fenced {{instance}}",
                    ),
                    (
                        f"sum by (instance) (rate(sbp_datanode_out_of_order_sequences_total{{{NODE}}}{RATE}))",
                        "out of order {{instance}}",
                    ),
                    (
                        f"sum by (instance) (rate(sbp_datanode_unknown_producers_total{{{NODE}}}{RATE}))",
                        "unknown {{instance}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Consumers",
        (
            Panel(
                "Lag in records, furthest behind",
                "Records between each consumer group's committed position and its streams' "
                "ends, summed per group: the ten groups furthest behind (SPEC §11).",
                "none",
                (
                    (
                        f"topk(10, sum by (group) (sbp_group_lag_records{{{PM}}}))",
                        "{{group}}",
                    ),
                ),
            ),
            Panel(
                "Lag in seconds, furthest behind",
                "Age of the oldest record each group has not consumed, on its slowest stream "
                "(0 at the end): the ten groups furthest behind.",
                "s",
                (
                    (
                        f"topk(10, max by (group) (sbp_group_lag_seconds{{{PM}}}))",
                        "{{group}}",
                    ),
                ),
            ),
            Panel(
                "Commits/s",
                "COMMIT_OFFSETS stored per second, per group.",
                "ops",
                (
                    (
                        f"sum by (group) (rate(sbp_group_commits_total{{{PM}}}{RATE}))",
                        "{{group}}",
                    ),
                ),
            ),
            Panel(
                "Group members",
                "Live members per group (SPEC §15), streams moved between members per second, "
                "and the longest any subscribed stream has gone unread since a member let it go.",
                "none",
                (
                    (f"sum by (group) (sbp_group_members{{{PM}}}) or on() vector(0)", "{{group}}"),
                    (
                        f"sum(rate(sbp_group_rebalances_total{{{PM}}}{RATE})) or on() vector(0)",
                        "rebalances/s",
                    ),
                    (
                        f"max(sbp_group_stream_unowned_seconds{{{PM}}}) or on() vector(0)",
                        "longest unread (s)",
                    ),
                ),
            ),
        ),
    ),
    (
        "Storage",
        (
            Panel(
                "LMDB map in use",
                "Share of each node's LMDB map size in use; appends fail with STORAGE_FULL at 100%.",
                "percentunit",
                (
                    (
                        f"sbp_datanode_storage_used_bytes{{{NODE}}} / sbp_datanode_storage_map_size_bytes{{{NODE}}}",
                        "{{instance}}",
                    ),
                ),
            ),
            Panel(
                "Stored bytes",
                "Record batch bytes stored, per node.",
                "bytes",
                ((f"sbp_datanode_storage_stored_bytes{{{NODE}}}", "{{instance}}"),),
            ),
            Panel(
                "Streams with chunks to free",
                "Streams whose deleted or trimmed chunks later appends have not all freed; "
                "their pages count as in use until then.",
                "none",
                ((f"sbp_datanode_storage_streams_freeing{{{NODE}}}", "{{instance}}"),),
            ),
            Panel(
                "Ranges per node",
                "Ranges hosted by each node, open and sealed.",
                "none",
                (
                    (
                        f"sum by (instance, state) (sbp_datanode_ranges{{{NODE}}})",
                        "{{instance}} {{state}}",
                    ),
                ),
            ),
            Panel(
                "Waiting FETCHes and pending appends",
                "Long-polling FETCH requests parked, and appends queued for the next group commit.",
                "none",
                (
                    (f"sbp_datanode_waiting_fetches{{{NODE}}}", "fetches {{instance}}"),
                    (f"sbp_datanode_storage_pending_appends{{{NODE}}}", "appends {{instance}}"),
                ),
            ),
        ),
    ),
    (
        "PM and liveness",
        (
            Panel(
                "Seconds since heartbeat",
                "Per data node, as the PM sees it; past the node timeout it is dead.",
                "s",
                ((f"sbp_pm_data_node_seconds_since_heartbeat{{{PM}}}", "node {{node}}"),),
            ),
            Panel(
                "Data node alive",
                "1 while the PM counts the node alive.",
                "none",
                ((f"sbp_pm_data_node_alive{{{PM}}}", "node {{node}}"),),
            ),
            Panel(
                "Reported appends",
                "Each node's latest REPORT_METRICS as the PM holds it: appends per second.",
                "ops",
                ((f"sbp_pm_data_node_appends_per_second{{{PM}}}", "node {{node}}"),),
            ),
            Panel(
                "Reported open ranges",
                "Each node's latest REPORT_METRICS as the PM holds it: open ranges hosted.",
                "none",
                ((f"sbp_pm_data_node_open_ranges{{{PM}}}", "node {{node}}"),),
            ),
            Panel(
                "PM requests/s",
                "Requests the PM served per second, by opcode.",
                "reqps",
                ((f"sum by (opcode) (rate(sbp_requests_total{{{PM}}}{RATE}))", "{{opcode}}"),),
            ),
            Panel(
                "PM request latency p99",
                "The p99 of every request the PM served.",
                "s",
                ((quantile(0.99, PM, "job"), "p99"),),
            ),
        ),
    ),
    (
        "Operations",
        (
            Panel(
                "Data nodes by drain state",
                "Active, draining and drained data nodes (SPEC §12). A drained node holds no "
                "range: it can be stopped and removed (docs/operations.md).",
                "none",
                ((f"sbp_pm_data_nodes_by_drain_state{{{PM}}}", "{{state}}"),),
            ),
            Panel(
                "Bytes left to move off draining nodes",
                "Bytes of the draining nodes' ranges still to copy to other nodes; it falls "
                "to 0 as the drain ends.",
                "bytes",
                ((f"sum(sbp_pm_data_node_drain_bytes_to_move{{{PM}}}) or on() vector(0)", "left"),),
            ),
            Panel(
                "Data nodes near full",
                "Live nodes with less than twice --min-free-space free or full within an hour "
                "(docs/datanode.md, Disk pressure).",
                "none",
                ((f"sbp_pm_data_nodes_near_full{{{PM}}}", "near full"),),
            ),
            Panel(
                "Quota throttle",
                "Seconds of throttle told per second, by principal and kind: 1 means a "
                "principal's clients wait all the time (over its quota, SPEC §12).",
                "s",
                (
                    (
                        f"sum by (principal, kind) (rate(sbp_quota_throttle_seconds_total{{{NODE}}}{RATE})) "
                        "or on() vector(0)",
                        "{{principal}} {{kind}}",
                    ),
                ),
            ),
            Panel(
                "Range moves under way",
                "Moves of sealed ranges' replicas recorded in the metadata, by cause (a drain, "
                "a rebalance, SPEC §12): each copies the range to its new node, then drops it "
                "from the old one. A repair or a top-up ends in the commit that starts it.",
                "none",
                ((f"sbp_pm_range_moves{{{PM}}}", "{{cause}}"),),
            ),
            Panel(
                "Size retention trims/s",
                "Streams trimmed by the PM for holding more than their retention_bytes.",
                "ops",
                ((f"rate(sbp_pm_size_retention_trims_total{{{PM}}}{RATE})", "trims"),),
            ),
        ),
    ),
    (
        "Compaction",
        (
            Panel(
                "Compaction removed bytes/s",
                "Bytes compaction rewrote and removed per second, over every replica of the "
                "compacted streams' sealed ranges (SPEC §13).",
                "Bps",
                (
                    (f"rate(sbp_pm_compaction_rewritten_bytes_total{{{PM}}}{RATE})", "rewritten"),
                    (f"rate(sbp_pm_compaction_removed_bytes_total{{{PM}}}{RATE})", "removed"),
                ),
            ),
            Panel(
                "Dirty ratio",
                "Share of each compacted stream's sealed bytes not compacted yet (the 10 "
                "dirtiest streams); it falls after each pass (--compaction-interval-ms).",
                "percentunit",
                (
                    (
                        f"topk(10, sbp_pm_compaction_dirty_ratio{{{PM}}}) or on() vector(0)",
                        "stream {{stream}}",
                    ),
                ),
            ),
            Panel(
                "Records and tombstones removed/s",
                "Records compaction removed per second (superseded by a later record of "
                "their key, or tombstones past delete_retention_ms), and of them tombstones.",
                "ops",
                (
                    (f"rate(sbp_pm_compaction_removed_records_total{{{PM}}}{RATE})", "records"),
                    (
                        f"rate(sbp_pm_compaction_removed_tombstones_total{{{PM}}}{RATE})",
                        "tombstones",
                    ),
                ),
            ),
            Panel(
                "Compaction read rate per node",
                "Bytes of sealed ranges each node read for compaction per second; at most "
                "its --compaction-bytes-per-s.",
                "Bps",
                (
                    (
                        f"sum by (instance) "
                        f"(rate(sbp_datanode_compaction_scanned_bytes_total{{{NODE}}}{RATE}))",
                        "{{instance}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Tiered storage",
        (
            Panel(
                "Tiered bytes: nodes and store",
                "Bytes of the tiered streams' record batches on the data nodes (one "
                "replica's) and in the object store (SPEC §14); sized every 30 s.",
                "bytes",
                (
                    (f'sum(sbp_pm_tiered_stream_bytes{{{PM},where="nodes"}})', "on the nodes"),
                    (f'sum(sbp_pm_tiered_stream_bytes{{{PM},where="store"}})', "in the store"),
                ),
            ),
            Panel(
                "Upload and download rates",
                "Bytes the data nodes copied to the object store and read from it per second.",
                "Bps",
                (
                    (f"sum(rate(sbp_datanode_uploaded_bytes_total{{{NODE}}}{RATE}))", "upload"),
                    (
                        f"sum(rate(sbp_datanode_downloaded_bytes_total{{{NODE}}}{RATE}))",
                        "download",
                    ),
                ),
            ),
            Panel(
                "Oldest range not copied",
                "How long the sealed range waiting longest for its copy has waited, and "
                "how many wait: it grows while the store is down.",
                "s",
                (
                    (f"sbp_pm_tiering_oldest_uncopied_seconds{{{PM}}}", "oldest"),
                    (f"sbp_pm_tiering_pending_copies{{{PM}}}", "ranges waiting"),
                ),
            ),
            Panel(
                "Object store errors and cache hits",
                "Copies and reads that failed per second, and the share of chunk reads the "
                "nodes' disk caches served.",
                "ops",
                (
                    (
                        f"sum(rate(sbp_datanode_upload_errors_total{{{NODE}}}{RATE}))",
                        "upload errors",
                    ),
                    (
                        f"sum(rate(sbp_datanode_download_errors_total{{{NODE}}}{RATE}))",
                        "download errors",
                    ),
                    (
                        f"sum(rate(sbp_datanode_object_cache_hits_total{{{NODE}}}{RATE})) / "
                        f"clamp_min(sum(rate(sbp_datanode_object_cache_hits_total{{{NODE}}}"
                        f"{RATE})) + sum(rate(sbp_datanode_object_cache_misses_total{{{NODE}}}"
                        f"{RATE})), 1)",
                        "cache hit share",
                    ),
                ),
            ),
        ),
    ),
    (
        "Tables",
        (
            Panel(
                "Table lag in records",
                "Records of each tabled stream not in its Iceberg table yet (SPEC §16): the ten "
                "furthest behind. It falls at each commit (every table_interval_ms).",
                "none",
                (
                    (
                        f"topk(10, sbp_table_lag_records{{{TABLES}}})",
                        "stream {{stream}}",
                    ),
                ),
            ),
            Panel(
                "Oldest uncommitted record",
                "Age of the oldest record gathered and not committed to its table, over every "
                "stream and sbp-tables process; within about 2x table_interval_ms when keeping up.",
                "s",
                (
                    (
                        f"max(sbp_table_oldest_uncommitted_seconds{{{TABLES}}})",
                        "oldest",
                    ),
                ),
            ),
            Panel(
                "Table commits and rows/s",
                "Snapshots committed and rows added per second, and commits that failed (tried "
                "again: the catalog down, or another writer's newer snapshot).",
                "ops",
                (
                    (
                        f"sum(rate(sbp_table_commits_total{{{TABLES}}}{RATE}))",
                        "commits",
                    ),
                    (
                        f"sum(rate(sbp_table_rows_total{{{TABLES}}}{RATE}))",
                        "rows",
                    ),
                    (
                        f"sum(rate(sbp_table_failed_commits_total{{{TABLES}}}{RATE}))",
                        "failed commits",
                    ),
                ),
            ),
            Panel(
                "Table files and bytes/s",
                "Data files and bytes (as Arrow) committed to the tables per second.",
                "Bps",
                (
                    (
                        f"sum(rate(sbp_table_bytes_total{{{TABLES}}}{RATE}))",
                        "bytes",
                    ),
                    (
                        f"sum(rate(sbp_table_files_total{{{TABLES}}}{RATE}))",
                        "files",
                    ),
                ),
            ),
        ),
    ),
    (
        "Replication",
        (
            Panel(
                "Under-replicated ranges",
                "Ranges missing a replica: on a dead node (PM), or with a follower behind or "
                "not yet copied whole (data nodes).",
                "none",
                (
                    (f"sum(sbp_pm_under_replicated_ranges{{{PM}}})", "replica on a dead node"),
                    (f"sum(sbp_datanode_under_replicated_ranges{{{NODE}}})", "reported by nodes"),
                ),
            ),
            Panel(
                "Replication lag",
                "Records durable on a primary that a follower does not hold yet.",
                "none",
                (
                    (
                        f"sum by (instance, follower) "
                        f"(sbp_datanode_replication_lag_records{{{NODE}}})",
                        "{{instance}} to node {{follower}}",
                    ),
                ),
            ),
            Panel(
                "Replication lag bytes",
                "Batch bytes a primary sent a follower and has no answer for yet.",
                "bytes",
                (
                    (
                        f"sum by (instance, follower) "
                        f"(sbp_datanode_replication_in_flight_bytes{{{NODE}}})",
                        "{{instance}} to node {{follower}}",
                    ),
                ),
            ),
            Panel(
                "REPLICATE latency p99",
                "The p99 round trip of REPLICATE from each primary to its followers.",
                "s",
                (
                    (
                        quantile(0.99, NODE, "instance", "sbp_datanode_replicate_seconds"),
                        "{{instance}}",
                    ),
                ),
            ),
            Panel(
                "Seals and repairs",
                "Ranges sealed per second by cause (a writer's request, a dead primary, a "
                "repair), and ranges whose dead replica was replaced.",
                "ops",
                (
                    (f"sum by (cause) (rate(sbp_pm_seals_total{{{PM}}}{RATE}))", "seal: {{cause}}"),
                    (f"sum(rate(sbp_pm_repairs_total{{{PM}}}{RATE}))", "repairs"),
                ),
            ),
        ),
    ),
    (
        "Connections and processes",
        (
            Panel(
                "Open connections",
                "SBP connections open on each server.",
                "none",
                (('sbp_connections{job=~"$datanode_job|$pm_job"}', "{{job}} {{instance}}"),),
            ),
            Panel(
                "Requests in flight",
                "Requests being served on each server.",
                "none",
                (('sbp_requests_in_flight{job=~"$datanode_job|$pm_job"}', "{{job}} {{instance}}"),),
            ),
            Panel(
                "CPU",
                "CPU time per second of each server process (1 = one core).",
                "none",
                (
                    (
                        f'rate(process_cpu_seconds_total{{job=~"$datanode_job|$pm_job"}}{RATE})',
                        "{{job}} {{instance}}",
                    ),
                ),
            ),
            Panel(
                "Memory",
                "Resident memory of each server process.",
                "bytes",
                (
                    (
                        'process_resident_memory_bytes{job=~"$datanode_job|$pm_job"}',
                        "{{job}} {{instance}}",
                    ),
                ),
            ),
        ),
    ),
)


def expressions() -> list[str]:
    """Every PromQL query of the dashboard, in order."""
    return [expr for _, panels in ROWS for panel in panels for expr, _ in panel.queries]


#: a data source variable, so that importing the dashboard asks for none and
#: bakes no uid in: panels follow whatever Prometheus the variable names
DATASOURCE: Final = DataSourceRef(type_val="prometheus", uid="${datasource}")


def _variables() -> list[Any]:
    jobs = [
        (
            "datanode_job",
            "Data node job",
            "sbp_datanode_storage_map_size_bytes",
            "sbp-datanode",
            "the Prometheus job that scrapes the data nodes",
        ),
        (
            "pm_job",
            "PM job",
            "sbp_pm_streams",
            "sbp-pm",
            "the Prometheus job that scrapes the PM",
        ),
        (
            "tables_job",
            "Tables job",
            "sbp_table_streams",
            "sbp-tables",
            "the Prometheus job that scrapes the sbp-tables processes",
        ),
    ]
    variables: list[Any] = [
        DatasourceVariable("datasource").label("Data source").type("prometheus"),
    ]
    for name, label, metric, default, description in jobs:
        variables.append(
            QueryVariable(name)
            .label(label)
            .description(description)
            .datasource(DATASOURCE)
            .query(f"label_values({metric}, job)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .current(VariableOption(text=default, value=default, selected=True))
        )
    variables.append(
        QueryVariable("node")
        .label("Data node")
        .description("data nodes by their instance label")
        .datasource(DATASOURCE)
        .query('label_values(sbp_datanode_storage_map_size_bytes{job="$datanode_job"}, instance)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(VariableOption(text="All", value="$__all", selected=True))
    )
    return variables


def _panel(panel: Panel, width: int) -> Any:
    builder = StatPanel() if panel.kind == "stat" else TimeseriesPanel()
    builder = (
        builder.title(panel.title)
        .description(panel.description)
        .unit(panel.unit)
        .datasource(DATASOURCE)
        .height(4 if panel.kind == "stat" else 8)
        .span(width)
    )
    for n, (expr, legend) in enumerate(panel.queries):
        builder = builder.with_target(
            PromQuery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + n))
        )
    return builder


def build() -> Any:
    """The dashboard, built with Grafana's own typed builders."""
    dashboard = (
        Dashboard("SBP cluster")
        .uid("sbp-cluster")
        .description("Data nodes and placement manager of an SBP cluster (docs/metrics.md)")
        .tags(["sbp"])
        .timezone("browser")
        .editable()
        .refresh("10s")
        .time("now-1h", "now")
        .variables(_variables())
        .annotation(
            AnnotationQuery()
            .name("Annotations & Alerts")
            .datasource(DataSourceRef(type_val="grafana", uid="-- Grafana --"))
            .enable(True)
            .hide(True)
            .icon_color("rgba(0, 211, 255, 1)")
            .type("dashboard")
        )
    )
    for row_title, row_panels in ROWS:
        dashboard = dashboard.with_row(Row(row_title))
        width = 24 // len(row_panels)
        for panel in row_panels:
            dashboard = dashboard.with_panel(_panel(panel, width))
    return dashboard.build()


def render() -> str:
    return json.dumps(build(), cls=JSONEncoder, indent=2) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT} ({len(expressions())} queries)", file=sys.stderr)
