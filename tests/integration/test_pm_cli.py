"""``python -m pm`` as a user runs it: --help, bad flags, unusable data
directory, busy port, config file under flags, /metrics."""

from __future__ import annotations

import contextlib
import signal
import socket
import urllib.request
from pathlib import Path

import pytest
import trio

from net.request import Request, Responder
from net.server import Dispatcher, Server
from sbp import messages
from sbp.enums import ErrorCode, Flags, Opcode
from sbp.frames import Frame, encode_frame

from ..eventually import eventually
from .pm_cluster import pm_cluster
from .procs import RawConnection, ServerProcess, run_cli, start_server

pytestmark = pytest.mark.integration


def test_help_explains_the_flags() -> None:
    result = run_cli("pm", ["--help"])
    assert result.returncode == 0
    for flag in ("--listen", "--data-dir", "--metrics-listen", "--node-timeout-ms", "--config"):
        assert flag in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--listen", "nowhere"], "'nowhere' is not HOST:PORT"),
        (["--node-timeout-ms", "0"], "0 is not a positive integer"),
        (["--listen", "127.0.0.1:0"], "--data-dir is required"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--data-dir", "d", "--etcd-ca", "ca.pem"], "go with --etcd"),
        (["--etcd", "http://127.0.0.1:1", "--etcd-ca", "ca.pem"], "need https:// etcd URLs"),
        (["--etcd", "https://127.0.0.1:1", "--etcd-cert", "c.pem"], "go together"),
        (["--etcd", "https://127.0.0.1:1", "--etcd-ca", "/nonexistent.pem"], "etcd TLS files"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = run_cli("pm", args)
    assert result.returncode == 2
    assert result.stderr.startswith("sbp-pm: error: ")
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unusable_data_dir_exits_1(tmp_path: Path) -> None:
    occupied = tmp_path / "a-file"
    occupied.write_text("not a directory")
    result = run_cli("pm", ["--data-dir", str(occupied)])
    assert result.returncode == 1
    assert "cannot use data directory" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_busy_port_exits_1(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("pm", ["--data-dir", str(tmp_path), "--listen", f"127.0.0.1:{port}"])
    assert result.returncode == 1
    assert result.stderr == (
        f"sbp-pm: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    )


async def test_config_file_under_flags_and_sigterm_exits_0(tmp_path: Path) -> None:
    config = tmp_path / "pm.toml"
    config.write_text(f'data-dir = "{tmp_path / "meta"}"\nlisten = "127.0.0.1:1"\n')
    pm = await start_server(
        "pm", ["--config", str(config), "--listen", "127.0.0.1:0"], tmp_path / "logs"
    )
    try:
        assert pm.port != 1
        assert (tmp_path / "meta" / "data.mdb").exists()
    finally:
        assert await pm.terminate() == 0


async def test_metrics_show_streams_ranges_and_nodes(tmp_path: Path) -> None:
    async with pm_cluster(tmp_path, node_ids=(1, 2)) as cluster:
        assert cluster.pm is not None
        address = cluster.pm.address
        await cluster.pm.kill()
        await cluster.start_pm(address, "--metrics-listen", "127.0.0.1:0")
        await cluster.wait_alive({1, 2})
        pm = cluster.pm_client()
        created = await pm.create_streams([messages.Stream(replica_nums=1)] * 3)
        stream_id = created[0].stream.stream_id if created[0].stream else 0
        await pm.seal_range(stream_id, 0)

        assert cluster.pm.metrics_address is not None
        url = f"http://{cluster.pm.metrics_address}/metrics"
        with trio.fail_after(10):  # until both nodes sent a load report
            while True:
                text = await trio.to_thread.run_sync(
                    lambda: urllib.request.urlopen(url).read().decode()
                )
                lines = set(text.splitlines())
                reported = [line for line in lines if "data_node_disk_free_bytes{" in line]
                if len(reported) == 2:
                    break
                await trio.sleep(0.1)
        assert "sbp_pm_streams 3.0" in lines
        assert 'sbp_pm_ranges{state="open"} 3.0' in lines
        assert 'sbp_pm_ranges{state="sealed"} 1.0' in lines
        assert 'sbp_pm_data_nodes{state="alive"} 2.0' in lines
        assert 'sbp_pm_data_nodes{state="dead"} 0.0' in lines
        assert any(
            line.startswith('sbp_pm_data_node_seconds_since_heartbeat{node="1"}') for line in lines
        )
        assert any(line.startswith('sbp_pm_data_node_disk_free_bytes{node="2"}') for line in lines)
        assert 'sbp_requests_total{code="NONE",opcode="CREATE_STREAMS"} 1.0' in lines


async def test_second_pm_on_a_data_dir_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first = await start_server("pm", ["--data-dir", str(tmp_path)], tmp_path / "logs", name="pm1")
    try:
        second = await trio.to_thread.run_sync(
            run_cli, "pm", ["--data-dir", str(tmp_path), "--listen", "127.0.0.1:0"]
        )
        assert second.returncode == 1
        assert second.stderr.strip() == (
            f"sbp-pm: error: data directory {tmp_path} is in use by another PM "
            f"(pid {first.process.pid})"
        )
    finally:
        await first.terminate()
    # The lock goes with its holder: a PM starts there again.
    again = await start_server("pm", ["--data-dir", str(tmp_path)], tmp_path / "logs", name="pm2")
    await again.terminate()


@pytest.mark.deadline(60)
async def test_sigterm_is_not_held_by_a_call_to_a_node_that_never_answers(tmp_path: Path) -> None:
    """A CREATE_STREAMS with the longest timeout_ms, its SYNC_RANGES waiting
    on a registered node that answers PING but never SYNC_RANGES: SIGTERM
    still stops the PM within its drain time (it took over 110 s)."""
    pm = await start_server(
        "pm",
        ["--data-dir", str(tmp_path), "--drain-timeout-s", "2", "--node-timeout-ms", "60000"],
        tmp_path / "logs",
    )
    silent = Dispatcher("silent data node")
    silent.register(Opcode.SYNC_RANGES, _never_answer)
    silent.register(Opcode.LIST_RANGES, _never_answer)
    try:
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(Server(silent).serve, "127.0.0.1", 0)
            await _create_then_sigterm(pm, f"{host}:{port}")
            nursery.cancel_scope.cancel()
    finally:
        if pm.process.returncode is None:
            pm.process.kill()


async def _never_answer(request: Request, responder: Responder) -> None:
    await trio.sleep_forever()


async def test_a_heartbeat_from_an_address_that_does_not_answer_is_refused(
    tmp_path: Path,
) -> None:
    from client import PMClient
    from sbp.enums import ClientRole
    from sbp.errors import InvalidRequestError

    pm = await start_server("pm", ["--data-dir", str(tmp_path)], tmp_path / "logs")
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{unused.getsockname()[1]}"
    try:
        async with PMClient(pm.address, timeout=5) as client:
            with pytest.raises(InvalidRequestError, match="does not answer PING"):
                await client.heartbeat(
                    "fake",
                    role=ClientRole.DATA_NODE,
                    data_node=messages.DataNode(node_id=13, advertise_addr=nowhere),
                )
            assert await client.describe_cluster() == ()
            created = await client.create_streams([messages.Stream(replica_nums=1)])
            assert created[0].error_code == ErrorCode.NO_AVAILABLE_DATA_NODE
    finally:
        await pm.terminate()


async def _create_then_sigterm(pm: ServerProcess, nowhere: str) -> None:
    from client import PMClient
    from sbp.enums import ClientRole

    async with PMClient(pm.address, timeout=5) as client:
        await client.heartbeat(
            "datanode-9",
            role=ClientRole.DATA_NODE,
            data_node=messages.DataNode(node_id=9, advertise_addr=nowhere),
        )
        async with trio.open_nursery() as nursery:

            async def create() -> None:
                with contextlib.suppress(Exception):
                    await client.create_streams(
                        [messages.Stream(replica_nums=1)], timeout=(2**31 - 1) / 1000
                    )

            nursery.start_soon(create)
            await trio.sleep(1.5)  # committed; SYNC_RANGES to the node retries
            started = trio.current_time()
            pm.process.send_signal(signal.SIGTERM)
            with trio.fail_after(20):
                code = await pm.process.wait()
            nursery.cancel_scope.cancel()
        assert code == 0, pm.log()
        assert trio.current_time() - started < 10


@pytest.mark.deadline(60)
async def test_past_the_descriptor_limit_clients_are_refused_not_left_hanging(
    tmp_path: Path,
) -> None:
    """A PM allowed 48 descriptors, 120 clients: those it cannot take get
    GOAWAY THROTTLED at once instead of waiting in the backlog; the log says
    so in a line or two, no traceback; a client already connected is served."""
    import resource
    import subprocess

    from .procs import _child_env, python_command

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    logs = tmp_path / "logs"
    logs.mkdir()
    with (logs / "pm.stdout").open("wb") as out, (logs / "pm.stderr").open("wb") as err:
        process = subprocess.Popen(
            python_command("pm", ["--data-dir", str(tmp_path / "pm")]),
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=_child_env(),
            preexec_fn=low_limit,
        )
    try:

        def listening_address() -> str:
            lines = (logs / "pm.stdout").read_text().splitlines()
            return next((ln.split()[-1] for ln in lines if ln.startswith("listening on ")), "")

        address = await eventually(listening_address, timeout=20, what="the PM's address")
        host, port = address.rsplit(":", 1)
        first = await RawConnection.open(address)
        opened = [first]
        answered = refused = 0
        with trio.fail_after(30):
            for i in range(120):
                stream = await trio.open_tcp_stream(host, int(port))
                raw = RawConnection(stream)
                opened.append(raw)
                await raw.send(encode_frame(Opcode.PING, Flags.NONE, i, b"", b"p"))
                event = await raw.next_event(timeout=10)
                if isinstance(event, Frame) and event.opcode == Opcode.GOAWAY:
                    assert messages.GoAway.decode(event.header).error_code == ErrorCode.THROTTLED
                    refused += 1
                else:
                    assert event is not None, "a client was left hanging"
                    answered += 1
            assert refused > 0 and answered > 0
            await first.send(encode_frame(Opcode.PING, Flags.NONE, 7, b"", b"still"))
            pong = await first.next_frame()
            assert bytes(pong.payload) == b"still"
        for raw in opened:
            await raw.aclose()
    finally:
        process.terminate()
        process.wait(20)
    stderr = (logs / "pm.stderr").read_text()
    assert "Traceback" not in stderr
    assert 1 <= stderr.count("out of file descriptors") <= 3
