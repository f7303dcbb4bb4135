"""What a new user ran into with ``sbp``, each against a real cluster: input
too large, live pipes, Ctrl-C, --timeout, refused updates, trims that change
nothing, and the smaller faults of the command line."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from ..eventually import eventually_blocking
from .local_cluster import (
    LocalCluster,
    lines,
    new_stream,
    running_cluster,
    sbp,
    sbp_json,
)
from .pm_cluster import append_values, pm_cluster
from .procs import _child_env

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("cli-faults") / "var") as running:
        yield running


def stored(pm: str, stream: int) -> list[str]:
    result = sbp(pm, "read", str(stream))
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def sbp_process(pm: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "client.cli", "--pm", pm, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_child_env(),
    )


def test_an_oversized_record_is_refused_before_it_is_sent(cluster: LocalCluster) -> None:
    pm = cluster.pm_address
    stream = new_stream(pm)
    started = time.monotonic()
    result = sbp(pm, "append", str(stream), stdin=b"small\n" + b"x" * (20 << 20) + b"\n")
    assert time.monotonic() - started < 20  # not retried for a minute
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"sbp: stored the first 1 line of the input in stream {stream}, offsets 0..0 before the "
        "error",
        f"sbp: to store the rest once, append from line 2: tail -n +2 INPUT | sbp append {stream}",
        "sbp: line 2 is longer than the largest record a request can carry (8,388,573 bytes)",
    ]
    assert stored(pm, stream) == ["small"]


def test_a_live_pipe_is_stored_as_it_arrives_and_ctrl_c_keeps_what_was_read(
    cluster: LocalCluster,
) -> None:
    pm = cluster.pm_address
    stream = new_stream(pm)
    append = sbp_process(pm, "append", str(stream), "--progress")
    assert append.stdin is not None
    try:
        append.stdin.write(b"first\n")
        append.stdin.flush()
        # Stored while the pipe is still open: no wait for EOF or 10,000 lines.
        eventually_blocking(lambda: stored(pm, stream) == ["first"], timeout=10)
        append.stdin.write(b"second\r\nthird\r\r\n")
        append.stdin.flush()
        eventually_blocking(lambda: len(stored(pm, stream)) == 3, timeout=10)
        append.send_signal(signal.SIGINT)
        out, err = append.communicate(timeout=30)
    finally:
        append.kill()
    assert append.returncode == 130, err
    assert f"appended 3 records (17 B) to stream {stream}, offsets 0..2" in out.decode()
    # Progress counts what the cluster acknowledged.
    assert "3 records stored" in err.decode()
    assert "interrupted" in err.decode()
    # One \r before the \n goes (CRLF input); any other stays in the value.
    as_hex = sbp(pm, "read", str(stream), "--hex").stdout.split()
    assert [bytes.fromhex(value) for value in as_hex] == [b"first", b"second", b"third\r"]


def test_storage_full_says_what_was_stored(tmp_path: Path) -> None:
    async def scenario() -> tuple[subprocess.CompletedProcess[str], str, int]:
        async with pm_cluster(tmp_path, node_ids=()) as running:
            node = await running.start_node(1, "--map-size", "4MiB")
            await running.wait_alive({1})
            pm = running.pm_address
            stream = await trio.to_thread.run_sync(new_stream, pm)
            values = [f"{i:08d}" + "v" * 200 for i in range(40_000)]
            result = await trio.to_thread.run_sync(
                lambda: sbp(pm, "append", str(stream), stdin=lines(values))
            )
            stats = await trio.to_thread.run_sync(
                lambda: sbp_json(pm, "read", str(stream), "--stats")
            )
            return result, node.log(), stats["records"]

    result, node_log, count = trio.run(scenario)
    assert result.returncode == 1
    assert 0 < count < 40_000
    # exactly what the stream holds, as the stream says, and how to go on
    assert result.stderr.splitlines()[:2] == [
        f"sbp: stored the first {count:,} lines of the input in stream 1, "
        f"offsets 0..{count - 1} before the error",
        f"sbp: to store the rest once, append from line {count + 1}: "
        f"tail -n +{count + 1} INPUT | sbp append 1",
    ]
    assert "STORAGE_FULL" in result.stderr
    assert "APPEND to stream 1 refused: STORAGE_FULL" in node_log


def test_timeout_bounds_a_command_against_a_silent_server() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        host, port = silent.getsockname()
        address = f"{host}:{port}"
        started = time.monotonic()
        result = sbp(address, "--timeout", "1.5", "streams", "list")
        took = time.monotonic() - started
    assert result.returncode == 4, result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert took < 8


def test_update_to_more_replicas_than_nodes_is_refused(cluster: LocalCluster) -> None:
    pm = cluster.pm_address
    stream = new_stream(pm)
    refused = sbp(pm, "streams", "update", str(stream), "--replicas", "9")
    assert refused.returncode == 1
    assert "NO_AVAILABLE_DATA_NODE" in refused.stderr
    assert "9 replicas wanted, 2 live data nodes" in refused.stderr
    assert sbp_json(pm, "streams", "get", str(stream))[0]["stream"]["replica_nums"] == 1
    # A count the nodes can hold is taken, and seals go on working.
    assert sbp_json(pm, "streams", "update", str(stream), "--replicas", "2")["replica_nums"] == 2
    assert sbp(pm, "ranges", "seal", str(stream)).returncode == 0


def test_a_trim_that_changes_nothing_says_so(cluster: LocalCluster) -> None:
    pm = cluster.pm_address
    stream = new_stream(pm)
    assert sbp(pm, "append", str(stream), stdin=lines([str(i) for i in range(10)])).returncode == 0
    assert sbp(pm, "streams", "trim", str(stream), "5").stdout.strip() == (
        f"trimmed stream {stream} below offset 5"
    )
    again = sbp(pm, "streams", "trim", str(stream), "3")
    assert again.returncode == 0
    assert again.stdout.strip() == (
        f"nothing changed: stream {stream} already starts at offset 5, not below 3"
    )


def test_smaller_command_line_faults(cluster: LocalCluster) -> None:
    pm = cluster.pm_address
    huge = sbp(pm, "read", "99999999999999999999999")
    assert huge.returncode == 2
    assert "Traceback" not in huge.stderr and "ExceptionGroup" not in huge.stderr
    assert "must be from 1 to 9,223,372,036,854,775,807" in huge.stderr

    stream = new_stream(pm)
    twice = sbp(pm, "streams", "delete", str(stream), str(stream))
    assert twice.returncode == 2
    assert twice.stderr == f"sbp: stream {stream} named more than once: nothing deleted\n"
    assert sbp_json(pm, "streams", "get", str(stream))[0]["stream"]["stream_id"] == stream
    deleted = sbp(pm, "streams", "delete", str(stream))
    assert deleted.returncode == 0, deleted.stderr
    assert deleted.stdout.strip() == f"deleted stream {stream}"

    # a usage error is one line and where the usage is, not the usage itself
    empty_group = sbp(pm, "read", "1", "--group", "")
    assert empty_group.returncode == 2
    assert empty_group.stderr == (
        "sbp read: argument --group: a group name is 1 to 255 bytes, not 0 (see sbp read --help)\n"
    )
    missing = sbp(pm, "read")
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [
        "sbp: read needs a STREAM (or --group G --subscribe STREAMS)"
    ]
    # a stream that is not there, even with nothing to append
    nowhere = sbp(pm, "append", "999999", stdin=b"")
    assert nowhere.returncode == 1
    assert nowhere.stderr == "sbp: STREAM_NOT_FOUND: no stream 999999\n"

    status = sbp_json(pm, "cluster", "status")
    for row in status["data_nodes"]:
        assert isinstance(row["heartbeat_age_s"], float) and row["heartbeat_age_s"] < 30
        assert isinstance(row["last_heartbeat_ms"], int)


def test_top_json_prints_json_lines_without_escapes(cluster: LocalCluster) -> None:
    top = sbp_process(cluster.pm_address, "--json", "top", "--interval", "0.2")
    try:
        assert top.stdout is not None
        first, second = top.stdout.readline(), top.stdout.readline()
    finally:
        top.send_signal(signal.SIGINT)
        top.communicate(timeout=30)
    assert top.returncode == 0
    for line in (first, second):
        assert b"\x1b" not in line
        frame = json.loads(line)
        assert len(frame["data_nodes"]) == 2


async def test_tail_outlives_a_pm_restart(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, node_ids=(1,)) as cluster:
        created = await cluster.pm_client().create_stream(1)
        assert created.stream is not None and created.range is not None
        pm = cluster.pm_address
        await append_values(cluster, created.range, [b"before"])
        tail = sbp_process(
            pm,
            "--timeout",
            "2",
            "tail",
            str(created.stream.stream_id),
            "--from",
            "0",
            "--count",
            "3",
        )
        try:
            # its first record printed: it follows the stream's end now
            assert tail.stdout is not None
            with trio.fail_after(30):
                first = await trio.to_thread.run_sync(tail.stdout.readline, abandon_on_cancel=True)
            assert first == b"before\n"
            assert cluster.pm is not None
            await cluster.pm.terminate()
            await trio.sleep(4)  # twice its --timeout without a PM
            await append_values(cluster, created.range, [b"while the PM is down"])
            await cluster.start_pm(pm)
            await append_values(cluster, created.range, [b"after it is back"])
            out, err = await trio.to_thread.run_sync(lambda: tail.communicate(timeout=30))
        finally:
            tail.kill()
        assert tail.returncode == 0, err
        assert out.decode().splitlines() == ["while the PM is down", "after it is back"]


async def test_timeout_bounds_an_append_to_a_dead_primary(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, node_ids=(1,)) as cluster:
        created = await cluster.pm_client().create_stream(1)
        assert created.stream is not None
        await cluster.nodes[1].kill()
        started = time.monotonic()
        result = await trio.to_thread.run_sync(
            lambda: sbp(
                cluster.pm_address,
                "--timeout",
                "3",
                "append",
                str(created.stream.stream_id),  # type: ignore[union-attr]
                stdin=b"x\n",
            )
        )
        took = time.monotonic() - started
        assert result.returncode == 3, result.stderr
        assert took < 20  # was over a minute: the delivery timeout and the connection attempts
        # the stream cannot be asked: what is known, and that it may be short
        assert result.stderr.splitlines()[0] == (
            "sbp: nothing acknowledged in stream 1 (more may be stored) before the error"
        )


TOP_ARGS = ("top", "--interval", "0.2")


def test_top_on_a_terminal_quits_on_q_and_fits_the_width(cluster: LocalCluster) -> None:
    import fcntl
    import os
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 60, 0, 0))
    top = subprocess.Popen(
        [sys.executable, "-m", "client.cli", "--pm", cluster.pm_address, *TOP_ARGS],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env={**_child_env(), "COLUMNS": "", "LINES": ""},
        start_new_session=True,
    )
    os.close(follower)
    screen = b""
    try:
        deadline = time.monotonic() + 20
        while b"q or Ctrl-C quits" not in screen:
            assert time.monotonic() < deadline, screen
            screen += os.read(leader, 65536)
        os.write(leader, b"q")
        assert top.wait(20) == 0
    finally:
        top.kill()
        os.close(leader)
    frame = screen.decode(errors="replace").split("\x1b[H\x1b[2J")[-1]
    lines = [line.rstrip("\r") for line in frame.split("\n")]
    assert max(len(line) for line in lines) <= 60
    assert any(line.startswith("sbp top") for line in lines)


def test_tls_settings_found_in_the_directory_are_named_when_the_server_speaks_plain(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    from client.pki import local_cluster_pki

    local_cluster_pki(tmp_path / "var" / "pki")  # what `sbp-cluster --tls` left there

    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "client.cli", "--pm", cluster.pm_address, *flags,
             "streams", "list"],
            capture_output=True, text=True, timeout=60, env=_child_env(), cwd=tmp_path,
            check=False,
        )  # fmt: skip

    result = run()
    assert result.returncode == 3, result.stderr
    [line] = result.stderr.splitlines()
    assert line.endswith(
        "(the server speaks plain SBP, not TLS; the TLS settings came from var/pki/ in this "
        "directory (made by `sbp-cluster --tls`; --no-tls ignores it))"
    ), line
    assert run("--no-tls").returncode == 0


def test_an_address_that_answers_http_is_named_so() -> None:
    """A PM address that is another service's (the metrics port, say)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        host, port = server.getsockname()

        def answer_http() -> None:
            connection, _ = server.accept()
            with connection:
                connection.recv(100)
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

        import threading

        threading.Thread(target=answer_http, daemon=True).start()
        result = sbp(f"{host}:{port}", "streams", "list")
    assert result.returncode == 3
    assert result.stderr.splitlines() == [
        f"sbp: cannot connect: connection to {host}:{port} closed: bad frame from "
        f"{host}:{port}: that address does not speak SBP (it answered HTTP)"
    ]


def test_a_metrics_port_given_as_the_pm_is_named_at_once() -> None:
    """A real HTTP server (a /metrics port, as prometheus_client serves it)
    waits for a line end before it answers: the first request's stream id
    gives it one, so ``sbp ping`` says what is there at once instead of
    timing out."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        host, port = server.server_address[:2]
        started = time.monotonic()
        result = sbp(f"{host}:{port}", "ping")
        took = time.monotonic() - started
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 3, result.stderr
    assert result.stderr.rstrip().endswith("that address does not speak SBP (it answered HTTP)")
    assert took < 5  # not the 10 s deadline


async def test_tail_says_it_cannot_connect_once_the_cluster_is_gone(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, node_ids=(1,)) as cluster:
        created = await cluster.pm_client().create_stream(1)
        assert created.range is not None
        await append_values(cluster, created.range, [b"before"])
        with sbp_process(
            cluster.pm_address, "--timeout", "2", "tail", str(created.range.stream_id),
            "--from", "0",
        ) as tail:  # fmt: skip
            assert tail.stdout is not None and tail.stderr is not None
            try:
                line = await trio.to_thread.run_sync(tail.stdout.readline)
                assert line == b"before\n"
                await cluster.stop_all()
                code = await trio.to_thread.run_sync(lambda: tail.wait(60))
            finally:
                tail.kill()
            stderr = tail.stderr.read().decode()
        assert code == 3, stderr
        [message] = stderr.splitlines()
        assert message.startswith("sbp: cannot connect: "), message
