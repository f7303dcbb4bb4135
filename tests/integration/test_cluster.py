"""``sbp-cluster``, the main job: it starts, serves, stops cleanly on SIGTERM,
and a restart on the same directory finds every stream and record again."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from .local_cluster import lines, sbp, sbp_json, start_cluster

pytestmark = pytest.mark.integration


def test_serves_stops_cleanly_and_restarts_with_its_data(tmp_path: Path) -> None:
    data_dir = tmp_path / "var"
    cluster = start_cluster(data_dir, nodes=2)
    try:
        banner = cluster.output()
        assert f"PM          {cluster.pm_address}" in banner
        assert "node-1" in banner and "node-2" in banner and "Try:" in banner
        children = psutil.Process(cluster.process.pid).children()
        assert len(children) == 3  # the PM and two data nodes

        stream = sbp_json(cluster.pm_address, "streams", "create")[0]["stream"]["stream_id"]
        values = [f"value-{i}" for i in range(5000)]
        assert sbp(cluster.pm_address, "append", str(stream), stdin=lines(values)).returncode == 0
    finally:
        status = cluster.stop()
    assert status == 0, cluster.output()
    assert "cluster stopped" in cluster.output()
    assert not any(child.is_running() and child.status() != "zombie" for child in children)
    assert sorted(p.name for p in data_dir.iterdir()) == ["logs", "node-1", "node-2", "pm"]

    again = start_cluster(data_dir, nodes=2)
    try:
        listed = sbp_json(again.pm_address, "streams", "list")
        assert [s["stream_id"] for s in listed] == [stream]
        read = sbp(again.pm_address, "read", str(stream))
        assert read.returncode == 0, read.stderr
        assert read.stdout.splitlines() == values
        more = sbp_json(again.pm_address, "append", str(stream), stdin=lines(["after restart"]))
        assert more["first_offset"] == 5000
    finally:
        assert again.stop() == 0, again.output()


def test_help_and_bad_flags() -> None:
    from .procs import run_cli

    usage = run_cli("client.cluster", ["--help"])
    assert usage.returncode == 0 and "--port-base" in usage.stdout and "--data-dir" in usage.stdout
    bad = run_cli("client.cluster", ["--nodes", "0"])
    assert bad.returncode == 2 and "between 1 and 64" in bad.stderr
