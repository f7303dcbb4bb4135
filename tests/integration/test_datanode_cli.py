"""The ``python -m datanode`` command line: help, config files, and the
one-line errors for everything a user can get wrong."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbp import messages
from sbp.enums import ClientRole, Opcode

from .conftest import DataNodes, connect
from .procs import run_cli

pytestmark = pytest.mark.integration

EVERY_FLAG = (
    "--listen",
    "--advertise",
    "--node-id",
    "--data-dir",
    "--pm",
    "--metrics-listen",
    "--sync",
    "--map-size",
    "--page-cache-window",
    "--max-frame-bytes",
    "--max-connections",
    "--max-in-flight",
    "--idle-timeout-s",
    "--drain-timeout-s",
    "--heartbeat-interval-ms",
    "--metrics-interval-ms",
    "--config",
    "--log-level",
)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("sbp-datanode: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0]
    assert "Traceback" not in result.stderr


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_help_explains_every_flag() -> None:
    result = run_cli("datanode", ["--help"])
    assert result.returncode == 0
    for flag in EVERY_FLAG:
        assert flag in result.stdout
    assert "SIGTERM" in result.stdout


@pytest.mark.parametrize(
    ("args", "fragments", "code"),
    [
        (["--bogus"], ["unrecognized arguments: --bogus"], 2),
        (["--node-id", "1", "--data-dir", "d", "--listen", "nowhere"], ["--listen"], 2),
        (["--node-id", "0", "--data-dir", "d"], ["--node-id"], 2),
        (["--node-id", "1", "--data-dir", "d", "--sync", "sometimes"], ["--sync"], 2),
        (["--node-id", "1", "--data-dir", "d", "--map-size", "lots"], ["--map-size"], 2),
        (
            ["--node-id", "1", "--data-dir", "d", "--page-cache-window", "-1"],
            ["--page-cache-window"],
            2,
        ),
        (["--data-dir", "d"], ["--node-id is required"], 2),
        (["--node-id", "1"], ["--data-dir is required"], 2),
    ],
)
def test_bad_flags(args: list[str], fragments: list[str], code: int) -> None:
    result = run_cli("datanode", args)
    assert_one_line_error(result, *fragments)
    assert result.returncode == code


def test_busy_port(tmp_path: Path, busy_port: int) -> None:
    args = ["--node-id", "1", "--data-dir", str(tmp_path / "d"), "--listen"]
    result = run_cli("datanode", [*args, f"127.0.0.1:{busy_port}"])
    assert_one_line_error(result, f"cannot listen on 127.0.0.1:{busy_port}", "in use")
    assert result.returncode == 1


def test_busy_metrics_port(tmp_path: Path, busy_port: int) -> None:
    args = ["--node-id", "1", "--data-dir", str(tmp_path / "d")]
    result = run_cli("datanode", [*args, "--metrics-listen", f"127.0.0.1:{busy_port}"])
    assert_one_line_error(result, "metrics", str(busy_port))
    assert result.returncode == 1


def test_unusable_data_dir(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("I am a file")
    for data_dir in (not_a_dir, not_a_dir / "below"):
        result = run_cli("datanode", ["--node-id", "1", "--data-dir", str(data_dir)])
        assert_one_line_error(result, str(not_a_dir))
        assert result.returncode == 1


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ('node-id = 1\ndata-dir = "d"\nlisten_port = 5\n', ["unknown key 'listen_port'"]),
        ('node-id = "one"\n', ["node-id"]),
        ("node-id = [1]\n", ["node-id"]),
        ("node-id = \n", ["not valid TOML"]),
    ],
)
def test_bad_config_file(tmp_path: Path, text: str, fragments: list[str]) -> None:
    config = tmp_path / "node.toml"
    config.write_text(text)
    result = run_cli("datanode", ["--config", str(config)])
    assert_one_line_error(result, str(config), *fragments)
    assert result.returncode == 2


def test_missing_config_file(tmp_path: Path) -> None:
    result = run_cli("datanode", ["--config", str(tmp_path / "absent.toml")])
    assert_one_line_error(result, "absent.toml")


async def test_config_file_under_flags(tmp_path: Path, datanodes: DataNodes) -> None:
    config = tmp_path / "node.toml"
    config.write_text(
        "\n".join(
            [
                "node-id = 3",
                f'data-dir = "{tmp_path / "from-config"}"',
                'advertise = "config.example:1"',
                'sync = "never"',
                'map_size = "64MiB"',
                'log-level = "debug"',
            ]
        )
    )
    # --advertise on the command line wins over the file; the rest comes from the file
    node = await datanodes.start(
        3, "--config", str(config), "--advertise", "flag.example:2", data_dir=tmp_path / "x"
    )
    async with connect(node.address) as connection:
        response = await connection.request(
            Opcode.HEARTBEAT,
            messages.HeartbeatRequest(client_id="t", client_role=ClientRole.CLIENT),
            timeout=5,
        )
    assert response.header.data_node == messages.DataNode(
        node_id=3, advertise_addr="flag.example:2"
    )
    assert "sync never" in node.log()
    assert "DEBUG" in node.log()
