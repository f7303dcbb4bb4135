"""One data directory, one mode: ``sbp-cluster`` refuses to run a directory
made with one PM as ``--ha`` and the other way round, leaves no etcd member
behind when it is killed, and does not report up over a port some other
process holds; the data nodes refuse a PM of an older term and say why."""

from __future__ import annotations

import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import trio

from net.address import port_free
from sbp import messages
from sbp.errors import RangeNotFoundError

from ..eventually import eventually_blocking
from .local_cluster import all_gone, lines, sbp, sbp_json, start_cluster
from .pm_cluster import pm_cluster
from .procs import _child_env

pytestmark = pytest.mark.integration


def launch(data_dir: Path, *flags: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``sbp-cluster`` expected to exit by itself."""
    return subprocess.run(
        [sys.executable, "-m", "client.launcher", "--data-dir", str(data_dir), "--nodes", "1",
         "--port-base", "0", *flags],
        capture_output=True, text=True, timeout=timeout, env=_child_env(),
        stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip


#: the ports `sbp-cluster --ha --nodes 1` takes from its port base
HA_OFFSETS = (0, 1, 80, 81, 82, 85, 86, 87, 90, 91, 100, 101, 190, 191)


def free_port_base() -> int:
    """A port base whose --ha ports are all free (etcd keeps its members'
    addresses: a directory run with --ha is run on the same ports again)."""
    for _ in range(200):
        base = random.randrange(20_000, 30_000)
        if all(port_free("127.0.0.1", base + offset) for offset in HA_OFFSETS):
            return base
    raise AssertionError("no free port base")


def descendants(pid: int) -> list[psutil.Process]:
    return list(psutil.Process(pid).children(recursive=True))


def test_a_directory_is_run_in_the_mode_it_was_made_in(tmp_path: Path) -> None:
    plain_dir = tmp_path / "plain"
    plain = start_cluster(plain_dir, nodes=1)
    stream = sbp_json(plain.pm_address, "streams", "create")[0]["stream"]["stream_id"]
    assert sbp(plain.pm_address, "append", str(stream), stdin=lines(["kept"])).returncode == 0
    assert plain.stop() == 0, plain.output()

    refused = launch(plain_dir, "--ha")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip() == (
        f"sbp-cluster: the cluster in {plain_dir} was made with one PM (its metadata in LMDB "
        f"under {plain_dir / 'pm'}): run it without --ha, or move that metadata into etcd with "
        "`sbp-pm migrate --from-data-dir DIR/pm --etcd URLS` first (docs/pm.md)"
    )
    assert not any(plain_dir.glob("etcd-*"))  # nothing was started there

    again = start_cluster(plain_dir, nodes=1)
    try:
        assert sbp(again.pm_address, "read", str(stream)).stdout == "kept\n"
    finally:
        assert again.stop() == 0, again.output()

    ha_dir = tmp_path / "ha"
    ha_flags = ("--ha", "--port-base", str(free_port_base()))
    ha = start_cluster(ha_dir, nodes=1, extra=ha_flags)
    members = [p for p in descendants(ha.process.pid) if "etcd" in " ".join(p.cmdline())]
    assert len(members) >= 3  # each member and what keeps it tied to the launcher
    ha.process.send_signal(signal.SIGKILL)
    ha.process.wait()
    # every child, the etcd members included, ends by itself
    eventually_blocking(lambda: all_gone(members), timeout=30)

    refused = launch(ha_dir)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip() == (
        f"sbp-cluster: the cluster in {ha_dir} was made with --ha (its metadata in etcd under "
        f"{ha_dir}/etcd-*): run it with --ha again"
    )
    back = start_cluster(ha_dir, nodes=1, extra=ha_flags)
    try:
        assert sbp(back.pm_address, "streams", "list").returncode == 0
    finally:
        stopping = time.monotonic()
        assert back.stop() == 0, back.output()
    # the etcd members stop one after another: none waits out a handover of
    # leadership to a member stopping with it (7 s)
    assert time.monotonic() - stopping < 6


def test_an_etcd_port_held_by_another_process_stops_the_launcher(tmp_path: Path) -> None:
    """What a stale etcd from an earlier run looks like: the port answers,
    but not for this launcher's member."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        base = port - 80  # etcd-1's client port is port-base + 80
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "client.launcher", "--data-dir", str(tmp_path / "var"),
             "--nodes", "1", "--ha", "--port-base", str(base)],
            capture_output=True, text=True, timeout=60, env=_child_env(),
            stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
    assert time.monotonic() - started < 30
    assert result.returncode == 1, result.stdout + result.stderr
    assert "is up" not in result.stdout
    # the member's peer port (port-base + 85) may be some other process's too
    assert re.search(
        rf"sbp-cluster: etcd-1 cannot listen on 127\.0\.0\.1 port {port}(, \d+)?: in use",
        result.stderr,
    ), result.stderr


async def test_a_node_refuses_a_pm_of_an_older_term_and_says_why_once(tmp_path: Path) -> None:
    """Data placed by PMs on etcd (here: a term raised by hand), then run
    with one PM (term 0): the seal fails naming the term, not "0 of 3
    replicas answered", and each node's log says why once."""
    async with pm_cluster(tmp_path, (1, 2, 3)) as cluster:
        created = await cluster.pm_client().create_stream(3)
        assert created.stream is not None
        stream_id = created.stream.stream_id
        for node in cluster.nodes.values():
            # records the term, whatever it answers of a range it does not have
            with pytest.raises(RangeNotFoundError):
                await cluster.node_client(node.address).seal_range(999, 0, pm_term=15)
        for _ in range(2):
            result = await trio.to_thread.run_sync(
                lambda: sbp(cluster.pm_address, "ranges", "seal", str(stream_id))
            )
            assert result.returncode == 1
            [line] = result.stderr.splitlines()
            fenced = "sbp: EPOCH_FENCED: the replicas refuse this PM's term (node 1: "
            assert line.startswith(fenced)
            assert "PM term 0 is older than term 15" in line
        [rng] = await cluster.pm_client().list_stream_ranges(stream_id)
        assert rng.is_open and isinstance(rng, messages.Range)
        for node in cluster.nodes.values():
            assert node.log().count("Likely cause: one PM keeping its metadata in LMDB") == 1


def test_ha_with_tls_puts_etcd_behind_mutual_tls_too(tmp_path: Path) -> None:
    """``sbp-cluster --ha --tls``: etcd's client port speaks only TLS and
    takes only clients with a certificate of the cluster's CA; the PMs
    present theirs (``--etcd-ca/--etcd-cert/--etcd-key``) and serve."""
    import ssl
    import urllib.error
    import urllib.request

    data_dir = tmp_path / "var"
    cluster = start_cluster(data_dir, nodes=1, extra=("--ha", "--tls"))
    try:
        etcd = next(
            line.split()[1]
            for line in cluster.output().splitlines()
            if line.strip().startswith("etcd-1")
        )
        assert etcd.startswith("https://")
        pki = data_dir / "pki"
        version = f"{etcd}/version"
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(version.replace("https://", "http://"), timeout=10)
        anonymous = ssl.create_default_context(cafile=pki / "ca.pem")
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(version, timeout=10, context=anonymous).read()
        known = ssl.create_default_context(cafile=pki / "ca.pem")
        known.load_cert_chain(pki / "pm.pem", pki / "pm.key")
        with urllib.request.urlopen(version, timeout=10, context=known) as answer:
            assert b"etcdserver" in answer.read()

        # the PMs reach etcd: they serve
        tls = (
            "--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "client.pem"),
            "--tls-key", str(pki / "client.key"),
        )  # fmt: skip
        created = sbp(cluster.pm_address, *tls, "streams", "create")
        assert created.returncode == 0, created.stderr
    finally:
        assert cluster.stop() == 0, cluster.output()
