"""The ``sbp`` command against a real local cluster (``sbp-cluster`` with a PM
and two data nodes as processes): printed values, JSON fields, exit codes."""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client import format as fmt
from client.cli import main

from ..eventually import eventually_blocking
from .local_cluster import LocalCluster, lines, new_stream, running_cluster, sbp, sbp_json
from .procs import _child_env

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("cli") / "var") as running:
        yield running


def test_append_and_read_round_trip(cluster: LocalCluster) -> None:
    pm = cluster.pm_address
    stream = new_stream(pm)
    values = [f"record {i} é" for i in range(25_000)] + ["", "last"]
    appended = sbp(pm, "append", str(stream), stdin=lines(values))
    assert appended.returncode == 0, appended.stderr
    assert "appended 25,002 records" in appended.stdout
    assert f"to stream {stream}, offsets 0..25001" in appended.stdout

    read = sbp(pm, "read", str(stream))
    assert read.returncode == 0, read.stderr
    assert read.stdout.split("\n")[:-1] == values
    assert read.stderr == ""  # no progress line when stderr is not a terminal

    exported = sbp(pm, "read", str(stream), "--progress")
    assert exported.stdout == read.stdout
    # redrawn over itself with \r (which the captured text reads as line ends)
    final = exported.stderr.strip().splitlines()[-1]
    assert final.startswith("[##############################] 100% 25,002 records read, ")
    assert final.endswith("/s")

    with_offsets = sbp(pm, "read", str(stream), "--from", "24999", "--offsets")
    assert with_offsets.stdout.splitlines() == ["24999\trecord 24999 é", "25000\t", "25001\tlast"]

    as_hex = sbp(pm, "read", str(stream), "--count", "1", "--hex")
    assert as_hex.stdout.strip() == "record 0 é".encode().hex()

    records = [
        json.loads(line)
        for line in sbp(pm, "--json", "read", str(stream), "--count", "2").stdout.splitlines()
    ]
    assert [(r["offset"], r["value"]) for r in records] == [(0, "record 0 é"), (1, "record 1 é")]
    assert all(r["timestamp_ms"] > 1_600_000_000_000 for r in records)

    stats = sbp_json(pm, "read", str(stream), "--stats")
    assert stats == {
        "stream_id": stream,
        "records": 25_002,
        "bytes": sum(len(v.encode()) for v in values),
        "first_offset": 0,
        "last_offset": 25_001,
    }


def test_append_from_a_file_with_progress(cluster: LocalCluster, tmp_path: Path) -> None:
    pm = cluster.pm_address
    stream = new_stream(pm)
    source = tmp_path / "input.txt"
    source.write_bytes(lines([f"line-{i}" for i in range(1000)]))
    result = sbp(pm, "append", str(stream), str(source), "--progress")
    assert result.returncode == 0, result.stderr
    assert "100%" in result.stderr and "1,000 records" in result.stderr
    # the progress line and the summary count the same bytes: the values'
    # (the bar measures the file, line ends included)
    values = fmt.size_text(sum(len(f"line-{i}") for i in range(1000)))
    assert f"1,000 records stored, {values}," in result.stderr.splitlines()[-1]
    assert f"appended 1,000 records ({values})" in result.stdout
    summary = sbp_json(pm, "append", str(stream), str(source))
    assert (summary["records"], summary["first_offset"], summary["last_offset"]) == (
        1000,
        1000,
        1999,
    )
    assert sbp_json(pm, "read", str(stream), "--stats")["records"] == 2000


def test_streams_commands(cluster: LocalCluster) -> None:
    pm = cluster.pm_address
    created = sbp_json(
        pm, "streams", "create", "--count", "3", "--replicas", "2", "--acks", "1",
        "--retention-ms", "60000",
    )  # fmt: skip
    ids = [item["stream"]["stream_id"] for item in created]
    assert len(set(ids)) == 3
    assert all(item["stream"]["replica_nums"] == 2 for item in created)
    assert all(item["stream"]["ack_nums"] == 1 for item in created)
    assert all(len(item["range"]["replica_nodes"]) == 2 for item in created)

    table = sbp(pm, "streams", "create")
    assert table.returncode == 0 and table.stdout.splitlines()[0].split()[:4] == [
        "stream",
        "replicas",
        "acks",
        "retention",
    ]
    too_many = sbp(pm, "streams", "create", "--replicas", "2", "--acks", "3")
    assert too_many.returncode == 2 and "--acks 3 is more than --replicas 2" in too_many.stderr

    ranges = sbp(pm, "ranges", "list", str(ids[0]))
    assert ranges.returncode == 0 and "commit" in ranges.stdout.splitlines()[0]
    [state] = [line for line in ranges.stdout.splitlines() if line.startswith("replicas of")]
    assert state.count("next 0 commit 0") == 2, state

    listed = {s["stream_id"]: s for s in sbp_json(pm, "streams", "list")}
    assert set(ids) <= set(listed)
    assert listed[ids[0]]["retention_period_ms"] == 60000

    got = sbp(pm, "streams", "get", str(ids[0]))
    assert got.returncode == 0
    assert got.stdout.splitlines()[1].split()[:4] == [str(ids[0]), "2", "1", "1m"]

    updated = sbp_json(pm, "streams", "update", str(ids[1]), "--retention-ms", "0")
    assert (updated["stream_id"], updated["retention_period_ms"], updated["replica_nums"]) == (
        ids[1],
        0,
        2,
    )

    # size retention (SPEC §12): set, kept by an update that does not name it, removed by 0
    limited = sbp_json(pm, "streams", "update", str(ids[1]), "--retention-bytes", "10GiB")
    assert limited["retention_bytes"] == 10 << 30
    shown = sbp(pm, "streams", "get", str(ids[1])).stdout
    assert "forever, at most 10.0 GiB" in shown, shown
    assert sbp_json(pm, "streams", "update", str(ids[1]), "--acks", "2")["retention_bytes"] == (
        10 << 30
    )
    unlimited = sbp_json(pm, "streams", "update", str(ids[1]), "--retention-bytes", "0")
    assert unlimited["retention_bytes"] == 0
    bad_size = sbp(pm, "streams", "create", "--retention-bytes", "lots")
    assert bad_size.returncode == 2 and "--retention-bytes" in bad_size.stderr

    deleted = sbp(pm, "streams", "delete", str(ids[2]))
    assert deleted.returncode == 0 and deleted.stdout.strip() == f"deleted stream {ids[2]}"
    gone = sbp(pm, "streams", "get", str(ids[2]))
    assert gone.returncode == 1
    assert gone.stderr.strip().startswith("sbp: STREAM_NOT_FOUND")


def test_trim_then_read_starts_at_the_first_kept_record(cluster: LocalCluster) -> None:
    pm = cluster.pm_address
    stream = new_stream(pm)
    assert sbp(pm, "append", str(stream), stdin=lines([str(i) for i in range(100)])).returncode == 0
    assert sbp(pm, "ranges", "seal", str(stream)).returncode == 0
    assert sbp(pm, "append", str(stream), stdin=lines(["a", "b"])).returncode == 0
    trimmed = sbp(pm, "streams", "trim", str(stream), "100")
    assert trimmed.returncode == 0, trimmed.stderr
    assert sbp(pm, "read", str(stream), "--offsets").stdout.splitlines() == ["100\ta", "101\tb"]
    below = sbp(pm, "read", str(stream), "--from", "5")
    assert below.returncode == 1 and "OFFSET_OUT_OF_RANGE" in below.stderr


def test_ranges_commands(cluster: LocalCluster) -> None:
    pm = cluster.pm_address
    stream = new_stream(pm)
    assert sbp(pm, "append", str(stream), stdin=lines(["x"] * 10)).returncode == 0
    sealed = sbp_json(pm, "ranges", "seal", str(stream))
    assert [(r["range_index"], r["start_offset"], r["end_offset"]) for r in sealed["ranges"]] == [
        (0, 0, 10),
        (1, 10, -1),
    ]
    ranges = sbp_json(pm, "ranges", "list", str(stream))
    assert [r["range_index"] for r in ranges] == [0, 1]
    described = sbp_json(pm, "ranges", "describe", str(stream), "0")
    assert (described["end_offset"], described["stream_id"]) == (10, stream)

    primary = next(r for r in ranges[1]["replica_nodes"] if r["is_primary"])["data_node"]
    on_node = sbp_json(pm, "ranges", "list", "--node", str(primary["node_id"]))
    assert (stream, 1) in {(r["stream_id"], r["range_index"]) for r in on_node}

    table = sbp(pm, "ranges", "list", str(stream)).stdout.splitlines()
    assert table[0].split()[:4] == ["stream", "range", "start", "end"]
    assert table[2].split()[3] == "open"


def test_tail_prints_new_records(cluster: LocalCluster) -> None:
    pm = cluster.pm_address
    stream = new_stream(pm)
    assert sbp(pm, "append", str(stream), stdin=lines(["old"])).returncode == 0
    tail = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "client.cli",
            "--pm",
            pm,
            "tail",
            str(stream),
            "--count",
            "2",
            "--offsets",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(),
    )
    try:
        time.sleep(1.5)  # let it find the end of the stream before appending
        assert sbp(pm, "append", str(stream), stdin=lines(["new-1", "new-2"])).returncode == 0
        out, err = tail.communicate(timeout=30)
    finally:
        tail.kill()
    assert tail.returncode == 0, err
    assert out.splitlines() == ["1\tnew-1", "2\tnew-2"]


def test_cluster_status_ping_and_top(cluster: LocalCluster) -> None:
    pm = cluster.pm_address

    # a node's first load report comes a few seconds after it starts
    def reported() -> dict[str, Any] | None:
        found: dict[str, Any] = sbp_json(pm, "cluster", "status")
        return found if all(n["disk_free_bytes"] is not None for n in found["data_nodes"]) else None

    status = eventually_blocking(reported, timeout=20, what="every node's first load report")
    assert status is not None
    nodes = status["data_nodes"]
    assert [n["node_id"] for n in nodes] == [1, 2] and all(n["alive"] for n in nodes)
    assert all(n["disk_free_bytes"] > 0 for n in nodes)
    human = sbp(pm, "cluster", "status").stdout
    assert "2 of 2 data nodes alive" in human

    pings = sbp_json(pm, "ping", "--all")
    assert [p["name"] for p in pings] == ["pm", "node-1", "node-2"]
    assert all(p["rtt_ms"] > 0 for p in pings)

    top = sbp(pm, "top", "--once")
    assert top.returncode == 0, top.stderr
    assert "nodes 2/2 alive" in top.stdout
    nodes_part = top.stdout.split("\n\n")[1]
    rows = [line.split() for line in nodes_part.splitlines()[1:]]
    assert [(row[0], row[2]) for row in rows] == [("1", "alive"), ("2", "alive")]
    assert "\x1b[" not in top.stdout


def test_errors_are_one_line_with_exit_codes(cluster: LocalCluster) -> None:
    pm = cluster.pm_address
    unknown = sbp(pm, "read", "999999")
    assert unknown.returncode == 1
    assert (
        unknown.stderr.startswith("sbp: STREAM_NOT_FOUND") and len(unknown.stderr.splitlines()) == 1
    )

    bad = sbp(pm, "streams", "get", "x")
    assert bad.returncode == 2 and "not a whole number: 'x'" in bad.stderr
    assert sbp(pm, "streams", "update", "1").returncode == 2
    assert sbp(pm, "ranges", "list").returncode == 2
    assert sbp(pm, "append", "1", "/no/such/file").returncode == 2

    unreachable = sbp("127.0.0.1:1", "ping", timeout=60)
    assert unreachable.returncode == 3
    assert (
        unreachable.stderr.startswith("sbp: cannot connect")
        and "Traceback" not in unreachable.stderr
    )


def test_groups_keep_where_a_reader_stopped(cluster: LocalCluster) -> None:
    pm = cluster.pm_address
    stream = new_stream(pm)
    values = [f"v{i}" for i in range(10)]
    assert sbp(pm, "append", str(stream), stdin=lines(values)).returncode == 0

    first = sbp(pm, "read", str(stream), "--group", "etl", "--count", "4", "--commit")
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == values[:4]
    peek = sbp(pm, "read", str(stream), "--group", "etl", "--count", "2")  # no --commit
    assert peek.stdout.split() == values[4:6]
    [position] = sbp_json(pm, "groups", "describe", "etl")
    assert (position["stream_id"], position["offset"]) == (stream, 4)
    listed = sbp_json(pm, "groups", "list")
    assert [g["group"] for g in listed] == ["etl"]
    assert "etl" in sbp(pm, "groups", "list").stdout

    reset = sbp(pm, "groups", "reset", "etl", "--to", "latest")
    assert reset.returncode == 0, reset.stderr
    assert sbp_json(pm, "groups", "describe", "etl")[0]["offset"] == 10
    assert sbp(pm, "read", str(stream), "--group", "etl").stdout == ""
    sbp(pm, "groups", "reset", "etl", "--to", "1h", "--stream", str(stream))
    assert sbp_json(pm, "groups", "describe", "etl")[0]["offset"] == 0
    assert sbp(pm, "read", str(stream), "--since", "1h", "--count", "3").stdout.split() == [
        "v0",
        "v1",
        "v2",
    ]

    future = sbp(pm, "read", str(stream), "--since", "2999-01-01T00:00")
    assert future.returncode == 2 and "is in the future" in future.stderr
    assert sbp(pm, "read", str(stream), "--commit").returncode == 2  # needs --group
    assert sbp(pm, "groups", "describe", "").returncode == 2
    assert sbp(pm, "groups", "delete", "etl").returncode == 0
    gone = sbp(pm, "groups", "delete", "etl")
    assert gone.returncode == 1 and gone.stderr.startswith("sbp: GROUP_NOT_FOUND")
    missing = sbp(pm, "groups", "describe", "etl")
    assert missing.returncode == 1 and "GROUP_NOT_FOUND" in missing.stderr
    no_reset = sbp(pm, "groups", "reset", "etl", "--to", "earliest", "--stream", str(stream))
    assert no_reset.returncode == 1 and "GROUP_NOT_FOUND" in no_reset.stderr


def test_a_time_finds_the_records_before_an_empty_newest_range(cluster: LocalCluster) -> None:
    """Right after a seal (by hand, a drain or a failover) the newest range
    holds nothing: a lookup by time goes on to the ranges before it, in
    ``sbp read --since``, ``sbp groups reset --to TIME`` and the library."""
    pm = cluster.pm_address
    stream = new_stream(pm)
    assert sbp(pm, "append", str(stream), stdin=lines([f"v{i}" for i in range(10)])).returncode == 0
    assert sbp(pm, "ranges", "seal", str(stream)).returncode == 0
    assert sbp(pm, "ranges", "seal", str(stream)).returncode == 0  # an empty sealed range too

    stats = sbp_json(pm, "read", str(stream), "--since", "10m", "--stats")
    assert (stats["records"], stats["first_offset"], stats["last_offset"]) == (10, 0, 9)
    assert sbp(pm, "read", str(stream), "--group", "g-time", "--commit").returncode == 0
    assert sbp_json(pm, "groups", "describe", "g-time")[0]["offset"] == 10
    reset = sbp(pm, "groups", "reset", "g-time", "--to", "10m")
    assert reset.returncode == 0, reset.stderr
    assert sbp_json(pm, "groups", "describe", "g-time")[0]["offset"] == 0

    from client.sync import SyncClient

    with SyncClient(pm) as client, client.consumer(stream) as consumer:
        assert consumer.seek_to_time(int(time.time() * 1000) - 600_000) == 0
        assert consumer.seek_to_time(int(time.time() * 1000) + 60_000) == 10


def test_a_read_stops_at_an_offset_or_a_time_and_a_reset_can_be_tried_first(
    cluster: LocalCluster,
) -> None:
    pm = cluster.pm_address
    stream = new_stream(pm)
    assert sbp(pm, "append", str(stream), stdin=lines([f"a{i}" for i in range(5)])).returncode == 0
    time.sleep(0.1)
    between = time.time()
    time.sleep(0.1)
    assert sbp(pm, "append", str(stream), stdin=lines([f"b{i}" for i in range(5)])).returncode == 0

    assert sbp(pm, "read", str(stream), "--to", "3").stdout.split() == ["a0", "a1", "a2"]
    assert sbp(pm, "read", str(stream), "--from", "2", "--to", "4").stdout.split() == ["a2", "a3"]
    assert sbp(pm, "read", str(stream), "--from", "4", "--to", "4").stdout == ""
    assert sbp(pm, "read", str(stream), "--to", "99").stdout.split()[-1] == "b4"
    stamp = datetime.datetime.fromtimestamp(between).isoformat(timespec="milliseconds")
    stats = sbp_json(pm, "read", str(stream), "--until", stamp, "--stats")
    assert (stats["records"], stats["last_offset"]) == (5, 4)  # the a's, appended before
    assert sbp(pm, "read", str(stream), "--until", stamp, "--to", "3").stdout.split() == [
        "a0",
        "a1",
        "a2",
    ]

    assert (
        sbp(pm, "read", str(stream), "--group", "tried", "--count", "7", "--commit").returncode == 0
    )
    dry = sbp(pm, "groups", "reset", "tried", "--to", "earliest", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[-1] == "dry run: nothing changed"
    assert dry.stdout.splitlines()[1].split() == [str(stream), "7", "0", "-7"]
    planned = sbp_json(pm, "groups", "reset", "tried", "--to", "latest", "--dry-run")
    assert planned == [{"stream_id": stream, "offset": 7, "new_offset": 10}]
    assert sbp_json(pm, "groups", "describe", "tried")[0]["offset"] == 7  # unchanged


def test_help_explains_every_command() -> None:
    commands = [
        [], ["ping"], ["streams"], ["streams", "create"], ["streams", "list"], ["streams", "get"],
        ["streams", "update"], ["streams", "delete"], ["streams", "trim"], ["ranges"],
        ["ranges", "list"], ["ranges", "describe"], ["ranges", "seal"], ["append"], ["read"],
        ["tail"], ["cluster"], ["cluster", "status"], ["top"], ["groups"], ["groups", "list"],
        ["groups", "describe"], ["groups", "reset"], ["groups", "delete"],
    ]  # fmt: skip
    # In process: argparse prints the help and exits before any connection.
    for command in commands:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
            main([*command, "--help"])
        assert exited.value.code == 0, command
        assert out.getvalue().startswith("usage: sbp"), command
        assert len(out.getvalue().splitlines()) >= 4, command


def test_append_resumed_after_an_interruption_stores_the_input_once(
    cluster: LocalCluster,
) -> None:
    """``--producer-name N --resume``: a run that stored the first 3,000 lines
    and stopped, then the whole input again: the second run skips what the
    stream holds from N's run and stores the rest, each line once."""
    pm = cluster.pm_address
    stream = new_stream(pm)
    values = [f"line {i}" for i in range(5_000)]
    flags = ("--producer-name", f"loader-{stream}", "--resume")
    first = sbp(pm, "--json", "append", str(stream), *flags, stdin=lines(values[:3_000]))
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["skipped"] == 0
    again = sbp(pm, "append", str(stream), *flags, stdin=lines(values))
    assert again.returncode == 0, again.stderr
    assert "appended 2,000 records" in again.stdout
    assert "offsets 3000..4999" in again.stdout
    assert "skipped the first 3,000 lines" in again.stdout
    done = sbp(pm, "append", str(stream), *flags, stdin=lines(values))
    assert "it holds all of the input" in done.stdout
    assert sbp(pm, "read", str(stream)).stdout.splitlines() == values

    refused = sbp(pm, "append", str(stream), "--resume", stdin=lines(values))
    assert refused.returncode == 2
    assert (
        refused.stderr.strip()
        == "sbp: --resume needs --producer-name: the producer whose run to continue"
    )
