"""A server as a child process, started the way a user starts it.

``start_child`` runs the child's command with its output (stdout and stderr)
appended to its log file, and returns once the child has printed its
``listening on HOST:PORT`` line (an etcd member, which prints none, once its
port takes connections). ``sbp-cluster``, the benchmarks, the chaos harness
and the integration tests all start their servers through it, so a server
that starts for one starts for all.

Every child gets ``SBP_EXIT_WITH_PARENT`` set to this process: it drains and
exits by itself once its parent is gone, however the parent went.
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import trio

from net.address import port_free
from net.service import LISTENING_PREFIX, METRICS_PREFIX, PARENT_ENV

#: how long a child gets to report its address
READY_TIMEOUT_S = 30.0
#: how long a child gets to exit after SIGTERM before it is killed
STOP_TIMEOUT_S = 15.0
_POLL_S = 0.02


class ClusterError(Exception):
    """A child failed to start; the message says which and where its log is."""


@dataclass
class Child:
    """One server process."""

    name: str
    argv: list[str]
    log_path: Path
    address: str = ""
    #: where it serves /metrics, when it said so
    metrics_address: str | None = None
    process: trio.Process | None = field(default=None, repr=False)
    #: the arguments it was last started with beyond ``argv`` (kept for restarts)
    extra_args: tuple[str, ...] = ()
    started_at: float = 0.0
    #: prints "listening on HOST:PORT" once ready (the SBP servers); else
    #: (etcd) ready once ``address`` takes connections
    announces: bool = True
    #: the fixed ports it listens on, checked free before it starts (etcd)
    ports: tuple[int, ...] = ()

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def log(self) -> str:
        """Everything the child wrote, over all its starts."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


async def start_child(
    child: Child, extra_args: tuple[str, ...] | list[str] = (), timeout: float = READY_TIMEOUT_S
) -> None:
    """Start ``child`` (its ``argv`` plus ``extra_args``) and wait until it
    listens; ``ClusterError`` with its last log line if it exits or stays
    silent instead."""
    child.log_path.parent.mkdir(parents=True, exist_ok=True)
    if not child.announces:
        # it is taken for up once its port answers: a port some other process
        # holds (an etcd left from an earlier run) would answer for it
        busy = [port for port in child.ports if not port_free(child.host, port)]
        if busy:
            raise ClusterError(
                f"{child.name} cannot listen on {child.host} port "
                f"{', '.join(map(str, busy))}: in use by another process "
                f"(`ss -ltnp` names it; an etcd left from an earlier run?)"
            )
    child.extra_args = tuple(extra_args)
    with child.log_path.open("ab") as log:
        start_of_run = log.tell()
        child.process = await trio.lowlevel.open_process(
            [*child.argv, *extra_args],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"},
        )
    child.started_at = trio.current_time()
    ready = _announced if child.announces else _takes_connections
    with trio.move_on_after(timeout):
        while child.process.returncode is None and child.process.poll() is None:
            if await ready(child, start_of_run):
                return
            await trio.sleep(_POLL_S)
    code = child.process.poll()
    if code is None:
        child.process.kill()
        await child.process.wait()
        why = "did not report its address" if child.announces else "did not open its port"
        why += f" within {timeout:g} s"
    else:
        why = f"exited with status {code}"
    last = _last_log_line(child.log_path)
    raise ClusterError(
        f"{child.name} {why}" + (f": {last}" if last else "") + f" (log: {child.log_path})"
    )


async def _announced(child: Child, start_of_run: int) -> bool:
    """Whether this run's output holds the ``listening on`` line (and, if it
    serves metrics, the ``metrics on`` line printed before it)."""
    with child.log_path.open("rb") as log:
        log.seek(start_of_run)
        output = log.read().decode("utf-8", "replace")
    for line in output.splitlines():
        line = line.strip()
        if line.startswith(METRICS_PREFIX):
            child.metrics_address = line[len(METRICS_PREFIX) :].split()[0]
        elif line.startswith(LISTENING_PREFIX):
            child.address = line[len(LISTENING_PREFIX) :].split()[0]
            return True
    return False


async def _takes_connections(child: Child, start_of_run: int) -> bool:
    host, _, port = child.address.rpartition(":")
    try:
        stream = await trio.open_tcp_stream(host, int(port))
    except OSError:
        return False
    await stream.aclose()
    return True


def _last_log_line(path: Path) -> str:
    """The last non-empty line a child wrote (its one-line error, usually)."""
    try:
        with path.open("rb") as log:
            log.seek(0, 2)
            log.seek(max(0, log.tell() - 4096))
            lines = [line.strip() for line in log.read().decode("utf-8", "replace").splitlines()]
    except OSError:
        return ""
    lines = [line for line in lines if line]
    return lines[-1] if lines else ""


async def stop_child(child: Child, timeout: float = STOP_TIMEOUT_S) -> int | None:
    """SIGTERM, wait for a graceful exit, SIGKILL as a last resort; the exit
    status (None if it never started)."""
    return await signal_child(child, signal.SIGTERM, timeout)


async def signal_child(child: Child, signum: int, timeout: float = STOP_TIMEOUT_S) -> int | None:
    """Send ``signum`` and wait ``timeout`` for the exit; SIGKILL after that."""
    process = child.process
    if process is None:
        return None
    if process.returncode is None:
        process.send_signal(signum)
    with trio.move_on_after(timeout):
        return await process.wait()
    process.kill()
    return await process.wait()


async def kill_child(child: Child) -> int | None:
    """SIGKILL: no chance to clean up (a crash)."""
    process = child.process
    if process is None:
        return None
    if process.returncode is None:
        process.kill()
    return await process.wait()


async def wait_for_nodes(
    pm_address: str, expected: int, timeout: float, tls: ssl.SSLContext | None = None
) -> int:
    """Wait until the PM sees ``expected`` live data nodes; returns how many it saw."""
    from client.pm_client import PMClient

    alive = 0
    with trio.move_on_after(timeout):
        async with PMClient(pm_address, tls=tls) as pm:
            while True:
                try:
                    statuses = await pm.describe_cluster(timeout=2.0)
                    alive = sum(1 for status in statuses if status.alive)
                except Exception:  # the PM may still be starting up
                    alive = 0
                if alive >= expected:
                    return alive
                await trio.sleep(0.2)
    return alive
