"""Writes dashboards/sbp-cluster.json, the Grafana dashboard of an SBP cluster.

The panels are listed here as (title, description, unit, PromQL queries);
``python dashboards/build.py`` regenerates the JSON, and a test checks that
the committed file matches and that every query returns data from a real
Prometheus scraping a real cluster (tests/integration/test_prometheus.py).

Scrape jobs are named ``sbp-datanode`` and ``sbp-pm`` (docs/metrics.md);
``$node`` picks data nodes by their ``instance`` label.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Final, NamedTuple

OUTPUT: Final = Path(__file__).with_name("sbp-cluster.json")
NODE: Final = 'job="sbp-datanode",instance=~"$node"'
PM: Final = 'job="sbp-pm"'
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
                (('sum(sbp_pm_data_nodes{state="alive"})', "alive"),),
                "stat",
            ),
            Panel(
                "Data nodes dead",
                "Data nodes the PM knows that missed heartbeats for the node timeout.",
                "none",
                (('sum(sbp_pm_data_nodes{state="dead"})', "dead"),),
                "stat",
            ),
            Panel(
                "Streams",
                "Streams in the PM's metadata.",
                "none",
                (("sbp_pm_streams", ""),),
                "stat",
            ),
            Panel(
                "Ranges",
                "Ranges in the PM's metadata: open (one per stream) and sealed.",
                "none",
                (("sum by (state) (sbp_pm_ranges)", "{{state}}"),),
                "stat",
            ),
            Panel(
                "Cluster throughput",
                "Record batch bytes appended (durable) and returned by FETCH, all nodes.",
                "Bps",
                (
                    (f"sum(rate(sbp_datanode_appended_bytes_total{RATE}))", "appended"),
                    (f"sum(rate(sbp_datanode_fetched_bytes_total{RATE}))", "fetched"),
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
                (("sbp_pm_data_node_seconds_since_heartbeat", "node {{node}}"),),
            ),
            Panel(
                "Data node alive",
                "1 while the PM counts the node alive.",
                "none",
                (("sbp_pm_data_node_alive", "node {{node}}"),),
            ),
            Panel(
                "Reported load",
                "Each node's latest REPORT_METRICS as the PM holds it: appends/s and open ranges.",
                "none",
                (
                    ("sbp_pm_data_node_network_append_rate", "appends/s node {{node}}"),
                    ("sbp_pm_data_node_range_active_cnt", "open ranges node {{node}}"),
                ),
            ),
            Panel(
                "PM requests/s and p99",
                "Requests the PM served per second by opcode, and the p99 of all of them.",
                "reqps",
                (
                    (f"sum by (opcode) (rate(sbp_requests_total{{{PM}}}{RATE}))", "{{opcode}}"),
                    (quantile(0.99, PM, "job"), "p99 seconds"),
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
                (('sbp_connections{job=~"sbp-.*"}', "{{job}} {{instance}}"),),
            ),
            Panel(
                "Requests in flight",
                "Requests being served on each server.",
                "none",
                (('sbp_requests_in_flight{job=~"sbp-.*"}', "{{job}} {{instance}}"),),
            ),
            Panel(
                "CPU",
                "CPU time per second of each server process (1 = one core).",
                "none",
                (
                    (
                        f'rate(process_cpu_seconds_total{{job=~"sbp-.*"}}{RATE})',
                        "{{job}} {{instance}}",
                    ),
                ),
            ),
            Panel(
                "Memory",
                "Resident memory of each server process.",
                "bytes",
                (('process_resident_memory_bytes{job=~"sbp-.*"}', "{{job}} {{instance}}"),),
            ),
        ),
    ),
)


def expressions() -> list[str]:
    """Every PromQL query of the dashboard, in order."""
    return [expr for _, panels in ROWS for panel in panels for expr, _ in panel.queries]


def build() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    next_id = 1
    y = 0
    for row_title, row_panels in ROWS:
        panels.append(
            {"type": "row", "title": row_title, "id": next_id, "collapsed": False,
             "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []}
        )  # fmt: skip
        next_id += 1
        y += 1
        width = 24 // len(row_panels)
        for i, panel in enumerate(row_panels):
            height = 4 if panel.kind == "stat" else 8
            panels.append(
                {
                    "type": panel.kind,
                    "title": panel.title,
                    "description": panel.description,
                    "id": next_id,
                    "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
                    "gridPos": {"h": height, "w": width, "x": i * width, "y": y},
                    "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                    "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                    "targets": [
                        {
                            "refId": chr(ord("A") + n),
                            "expr": expr,
                            "legendFormat": legend,
                            "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
                        }
                        for n, (expr, legend) in enumerate(panel.queries)
                    ],
                }
            )
            next_id += 1
        y += 8
    return {
        "__inputs": [
            {
                "name": "DS_PROMETHEUS",
                "label": "Prometheus",
                "description": "The Prometheus that scrapes the SBP cluster",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
            }
        ],
        "title": "SBP cluster",
        "uid": "sbp-cluster",
        "description": "Data nodes and placement manager of an SBP cluster (docs/metrics.md)",
        "tags": ["sbp"],
        "timezone": "browser",
        "schemaVersion": 38,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "DS_PROMETHEUS",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "node",
                    "label": "Data node",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
                    "query": 'label_values(sbp_datanode_storage_map_size_bytes{job="sbp-datanode"}, instance)',
                    "definition": 'label_values(sbp_datanode_storage_map_size_bytes{job="sbp-datanode"}, instance)',
                    "refresh": 2,
                    "multi": True,
                    "includeAll": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "hide": 0,
                },
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT} ({len(expressions())} queries)", file=sys.stderr)
