"""``sbp-cluster``, the main job: it starts, serves, stops cleanly on SIGTERM,
and a restart on the same directory finds every stream and record again."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ..eventually import eventually_blocking
from .local_cluster import all_gone, lines, sbp, sbp_json, start_cluster
from .procs import _child_env

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
    assert sorted(p.name for p in data_dir.iterdir()) == [
        "cluster.lock",
        "logs",
        "node-1",
        "node-2",
        "pm",
    ]

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


def _node_addresses(pm: str) -> dict[int, str]:
    status = sbp_json(pm, "cluster", "status")
    return {n["node_id"]: n["address"] for n in status["data_nodes"]}


def test_a_cluster_restarted_on_other_ports_serves_every_acknowledged_record(
    tmp_path: Path,
) -> None:
    """A node's address is what it advertises now: after a restart on other
    ports, primaries replicate to the followers' new addresses, a read sees
    every record at once (not "0 records" from replicas that cannot reach
    each other), and what is appended there is there after going back."""
    data_dir = tmp_path / "var"
    cluster = start_cluster(data_dir, nodes=3)
    try:
        stream = sbp_json(cluster.pm_address, "streams", "create", "--replicas", "3")[0]
        stream_id = str(stream["stream"]["stream_id"])
        first = [f"before-{i}" for i in range(20_000)]
        assert sbp(cluster.pm_address, "append", stream_id, stdin=lines(first)).returncode == 0
        before = _node_addresses(cluster.pm_address)
    finally:
        assert cluster.stop() == 0, cluster.output()

    elsewhere = start_cluster(data_dir, nodes=3)  # --port-base 0: other free ports
    try:
        pm = elsewhere.pm_address
        moved = eventually_blocking(
            lambda: _node_addresses(pm), until=lambda now: len(now) == 3 and now != before
        )
        assert all(moved[n] != before[n] for n in before)
        stats = sbp_json(pm, "read", stream_id, "--stats")
        assert (stats["records"], stats["last_offset"]) == (20_000, 19_999)
        ranges = sbp_json(pm, "ranges", "list", stream_id)
        assert [r["commit_offset"] for r in ranges] == [r["next_offset"] for r in ranges]
        appended = sbp_json(pm, "append", stream_id, stdin=lines(["elsewhere"]))
        assert appended["first_offset"] == 20_000
    finally:
        assert elsewhere.stop() == 0, elsewhere.output()
    log = (data_dir / "logs" / "pm.log").read_text()
    assert all(f"data node {n} moved from" in log for n in before)

    back = start_cluster(data_dir, nodes=3)
    try:
        read = sbp(back.pm_address, "read", stream_id)
        assert read.returncode == 0, read.stderr
        assert read.stdout.splitlines() == [*first, "elsewhere"]
    finally:
        assert back.stop() == 0, back.output()


def test_help_and_bad_flags() -> None:
    from .procs import run_cli

    usage = run_cli("client.launcher", ["--help"])
    assert usage.returncode == 0 and "--port-base" in usage.stdout and "--data-dir" in usage.stdout
    bad = run_cli("client.launcher", ["--nodes", "0"])
    assert bad.returncode == 2 and "between 1 and 64" in bad.stderr


def _children_of(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children()


def test_a_second_launcher_is_refused_and_leaves_nothing_behind(tmp_path: Path) -> None:
    data_dir = tmp_path / "var"
    cluster = start_cluster(data_dir, nodes=1)
    try:
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "client.launcher",
                "--data-dir",
                str(data_dir),
                "--port-base",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=_child_env(),
            check=False,
        )
        assert second.returncode == 1
        assert second.stderr.strip() == (
            f"sbp-cluster: data directory {data_dir.resolve()} is in use by another "
            f"sbp-cluster (pid {cluster.process.pid})"
        )
        assert "Traceback" not in second.stdout + second.stderr
        # It started nothing: the first cluster's PM is the only one there.
        assert len(_children_of(cluster.process.pid)) == 2
    finally:
        assert cluster.stop() == 0, cluster.output()


def test_a_dead_node_is_restarted_and_the_cluster_keeps_serving(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path / "var", nodes=2)
    try:
        pm = cluster.pm_address
        stream = sbp_json(pm, "streams", "create")[0]["stream"]["stream_id"]
        assert sbp(pm, "append", str(stream), stdin=lines(["before"])).returncode == 0
        node = next(
            child for child in _children_of(cluster.process.pid) if "datanode" in child.cmdline()
        )
        node.send_signal(signal.SIGKILL)
        eventually_blocking(lambda: "is back on" in cluster.output())
        assert cluster.process.poll() is None  # the launcher kept running
        eventually_blocking(
            lambda: all(row["alive"] for row in sbp_json(pm, "cluster", "status")["data_nodes"])
        )
        more = sbp_json(pm, "append", str(stream), stdin=lines(["after"]))
        assert more["first_offset"] == 1
        assert sbp(pm, "read", str(stream)).stdout.splitlines() == ["before", "after"]
    finally:
        assert cluster.stop() == 0, cluster.output()


def test_no_restart_stops_the_cluster_when_a_node_dies(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path / "var", nodes=2, extra=("--no-restart",))
    children = _children_of(cluster.process.pid)
    node = next(child for child in children if "datanode" in child.cmdline())
    node.send_signal(signal.SIGKILL)
    assert cluster.process.wait(60) == 1
    assert "node-" in cluster.output() and "exited with status -9" in cluster.output()
    eventually_blocking(lambda: all_gone(children))


def test_children_stop_when_the_launcher_is_killed(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path / "var", nodes=1, tables=True)
    children = _children_of(cluster.process.pid)
    cluster.process.send_signal(signal.SIGKILL)
    cluster.process.wait()
    assert len(children) == 3  # the PM, the node and sbp-tables
    eventually_blocking(lambda: all_gone(children))


def _control(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``sbp-cluster --data-dir DIR ACTION …``, from another shell."""
    return subprocess.run(
        [sys.executable, "-m", "client.launcher", "--data-dir", str(data_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=_child_env(),
        check=False,
    )


def test_a_node_is_stopped_started_and_added_from_another_shell(tmp_path: Path) -> None:
    """``sbp-cluster stop-node`` keeps a node stopped (the launcher does not
    start it again); a read of a range only it holds then says which stream,
    range and node, at once once the PM counts the node dead; ``start-node``
    brings it back and ``add-node`` a third, which the next run keeps."""
    data_dir = tmp_path / "var"
    cluster = start_cluster(data_dir, nodes=2)
    try:
        pm = cluster.pm_address
        created = sbp_json(pm, "streams", "create")[0]
        stream = str(created["stream"]["stream_id"])
        node = created["range"]["replica_nodes"][0]["data_node"]["node_id"]
        assert sbp(pm, "append", stream, stdin=lines([f"v{i}" for i in range(10)])).returncode == 0

        refused = _control(data_dir, "stop-node", str(node))
        assert refused.returncode == 1
        assert refused.stderr == (
            f"sbp-cluster: node-{node} holds 1 range: stopping it leaves them short of a "
            f"replica, or unreadable; drain it first (sbp nodes drain {node} --wait), or stop "
            "it anyway with --force\n"
        )
        stopped = _control(data_dir, "stop-node", str(node), "--force")
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.startswith(f"node-{node} stopped")
        assert f"node-{node}" in _control(data_dir, "list-nodes").stdout
        assert "stopped" in _control(data_dir, "list-nodes").stdout
        again = _control(data_dir, "stop-node", str(node))
        assert again.returncode == 1 and "stopped already" in again.stderr
        eventually_blocking(
            lambda: (
                not next(
                    n
                    for n in sbp_json(pm, "cluster", "status")["data_nodes"]
                    if n["node_id"] == node
                )["alive"]
            )
        )
        started = time.monotonic()
        read = sbp(pm, "read", stream, "--stats")
        assert time.monotonic() - started < 5  # not the --timeout window
        assert read.returncode == 3
        [line] = read.stderr.splitlines()
        assert line.startswith(f"sbp: no replica of stream {stream} range 0 serves its records")
        assert f"node {node} at " in line and f"no heartbeat from node {node} for " in line

        back = _control(data_dir, "start-node", str(node))
        assert back.returncode == 0, back.stderr
        assert sbp_json(pm, "read", stream, "--stats")["records"] == 10
        added = _control(data_dir, "add-node")
        assert added.returncode == 0, added.stderr
        assert added.stdout.startswith("node-3 is up on 127.0.0.1:")
        assert len(sbp_json(pm, "cluster", "status")["data_nodes"]) == 3
        unknown = _control(data_dir, "start-node", "9")
        assert unknown.returncode == 1 and "has no data node 9" in unknown.stderr
    finally:
        assert cluster.stop() == 0, cluster.output()
    assert not (data_dir / "launcher.json").exists()
    gone = _control(data_dir, "list-nodes")
    assert gone.returncode == 1 and "no sbp-cluster runs on" in gone.stderr

    again = start_cluster(data_dir, nodes=2)
    try:
        status = sbp_json(again.pm_address, "cluster", "status")["data_nodes"]
        assert sorted(n["node_id"] for n in status if n["alive"]) == [1, 2, 3]
    finally:
        assert again.stop() == 0, again.output()


def test_the_port_base_comes_from_the_environment_too() -> None:
    """``SBP_PORT_BASE`` (what ``make run PORT_BASE=…`` sets through the
    flag) is the default of ``--port-base``; a bad one is one line."""
    from .procs import run_cli

    bad = subprocess.run(
        [sys.executable, "-m", "client.launcher"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**_child_env(), "SBP_PORT_BASE": "70000"},
        check=False,
    )
    assert bad.returncode == 2
    assert bad.stderr.splitlines()[-1].startswith("sbp-cluster: error: $SBP_PORT_BASE: must be")
    usage = run_cli("client.launcher", ["--help"])
    assert "$SBP_PORT_BASE" in usage.stdout
