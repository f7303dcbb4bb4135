"""Rows of ``sbp cluster status`` and ``sbp top``: numbers in JSON, ``-``
for what a node has not reported yet."""

from __future__ import annotations

from client import format as fmt
from client.cluster_view import node_summary
from client.top import fit_width, render_frame
from sbp import messages

NODE = messages.DataNode(node_id=3, advertise_addr="127.0.0.1:7403")


def test_a_node_without_a_report_shows_no_free_space_and_numbers_for_its_heartbeat() -> None:
    status = messages.DataNodeStatus(data_node=NODE, alive=True, last_heartbeat_ms=1_000_500)
    row = node_summary(status, now=1_002.0)
    assert row["disk_free_bytes"] is None and row["reported"] is False
    assert row["heartbeat_age_s"] == 1.5 and row["last_heartbeat_ms"] == 1_000_500
    assert fmt.optional_size_text(row["disk_free_bytes"]) == "-"
    never = node_summary(messages.DataNodeStatus(data_node=NODE), now=1_002.0)
    assert never["heartbeat_age_s"] is None
    reported = messages.DataNodeStatus(
        data_node=NODE,
        alive=True,
        last_heartbeat_ms=1_000_500,
        metrics=messages.ReportMetricsRequest(data_node=NODE, disk_free_space=2 << 30),
    )
    assert node_summary(reported, now=1_002.0)["disk_free_bytes"] == 2 << 30


def test_top_lines_are_cut_to_the_width() -> None:
    status = messages.DataNodeStatus(data_node=NODE, alive=True, last_heartbeat_ms=1_000_500)
    frame = render_frame("127.0.0.1:7400", [node_summary(status, 1_002.0)], 1_002.0)
    assert max(len(line) for line in frame.splitlines()) > 80
    cut = fit_width(frame, 80)
    assert max(len(line) for line in cut.splitlines()) == 80
    assert cut.splitlines()[0] == frame.splitlines()[0][:80]
    assert frame.splitlines()[-1].endswith("  -")  # disk free not reported yet


def test_top_shows_the_groups_furthest_behind() -> None:
    status = messages.DataNodeStatus(data_node=NODE, alive=True, last_heartbeat_ms=1_000_500)
    groups = [
        {
            "group": "etl",
            "streams": 2,
            "members": 3,
            "lag_records": 1200,
            "last_commit_ms": 1_001_000,
        }
    ]
    frame = render_frame("127.0.0.1:7400", [node_summary(status, 1_002.0)], 1_002.0, groups)
    part = frame.split("consumer groups furthest behind\n")[1].splitlines()
    assert part[0].split() == ["group", "streams", "members", "lag", "last", "commit"]
    assert part[1].split()[:4] == ["etl", "2", "3", "1,200"]
