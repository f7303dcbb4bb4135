"""TLS, mutual TLS and ACLs on real processes (SPEC §9): a PM and data nodes
serving mutual TLS with an ACL file, certificates made by the tests' own CA,
clients with principals alice, bob and eve, and the refusals."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from client import Consumer, Producer
from client.datanode_client import DataNodeClient
from client.pki import LocalCA
from client.pm_client import PMClient
from client.sync import SyncClient
from net.pool import ConnectionPool
from net.tls import TLSSettings
from sbp import messages
from sbp.batches import build_batch, decode_batches
from sbp.enums import ClientRole, ErrorCode
from sbp.errors import ConnectionClosed, ProtocolError

from ..eventually import eventually
from .local_cluster import start_cluster
from .pm_cluster import primary_address
from .procs import ServerProcess, start_server

pytestmark = pytest.mark.deadline(120)

#: bob may FETCH stream 1 only; nobody may DELETE; eve has no entry
ACL: dict[str, Any] = {
    "acls": [
        {
            "principal": "alice",
            "operations": ["CREATE", "APPEND", "FETCH", "DESCRIBE", "ALTER"],
            "resource": "streams:*",
            "effect": "allow",
        },
        {"principal": "bob", "operations": ["FETCH"], "resource": "streams:1", "effect": "allow"},
        {"principal": "*", "operations": ["DELETE"], "resource": "streams:*", "effect": "deny"},
    ]
}


@dataclass
class SecureCluster:
    root: Path
    ca: LocalCA
    acl_path: Path
    pm: ServerProcess
    nodes: list[ServerProcess]

    def tls(self, principal: str) -> ssl.SSLContext:
        issued = self.ca.issue(principal)
        return TLSSettings(ca=self.ca.cert_path, cert=issued.cert, key=issued.key).client_context()

    @contextlib.asynccontextmanager
    async def pm_as(self, principal: str) -> AsyncIterator[PMClient]:
        async with ConnectionPool(tls=self.tls(principal)) as pool:
            yield PMClient(self.pm.address, pool=pool, timeout=10)

    @contextlib.asynccontextmanager
    async def node_as(self, principal: str, address: str) -> AsyncIterator[DataNodeClient]:
        async with ConnectionPool(tls=self.tls(principal)) as pool:
            yield DataNodeClient(address, pool=pool, timeout=10)

    def signal_all(self, signum: int) -> None:
        for server in (self.pm, *self.nodes):
            server.process.send_signal(signum)


@contextlib.asynccontextmanager
async def secure_cluster(root: Path, nodes: int = 2) -> AsyncIterator[SecureCluster]:
    ca = LocalCA(root / "pki")
    acl_path = root / "acl.json"
    acl_path.write_text(json.dumps(ACL))
    servers: list[ServerProcess] = []

    def security(role: str) -> list[str]:
        own = ca.issue(role)
        return [
            *("--tls-cert", str(own.cert), "--tls-key", str(own.key)),
            *("--tls-ca", str(ca.cert_path), "--acl-file", str(acl_path)),
        ]

    try:
        pm = await start_server(
            "pm",
            [
                *("--listen", "127.0.0.1:0", "--data-dir", str(root / "pm")),
                *("--metrics-listen", "127.0.0.1:0", "--node-timeout-ms", "1500"),
                *security("pm"),
            ],
            root / "logs",
        )
        servers.append(pm)
        for node_id in range(1, nodes + 1):
            node = await start_server(
                "datanode",
                [
                    *("--listen", "127.0.0.1:0", "--data-dir", str(root / f"node-{node_id}")),
                    *("--node-id", str(node_id), "--pm", pm.address),
                    *("--heartbeat-interval-ms", "200"),
                    *security("datanode"),
                    # /metrics over HTTPS, with the node's own certificate
                    *("--metrics-listen", "127.0.0.1:0"),
                    *("--metrics-tls-cert", str(ca.issue("datanode").cert)),
                    *("--metrics-tls-key", str(ca.issue("datanode").key)),
                ],
                root / "logs",
                name=f"node-{node_id}",
            )
            servers.append(node)
        cluster = SecureCluster(root, ca, acl_path, pm, servers[1:])
        # The data nodes reached the PM over mutual TLS, as principal "datanode".
        async with cluster.pm_as("pm") as admin:
            await eventually(
                admin.describe_cluster,
                until=lambda st: sum(s.alive for s in st) >= nodes,
                timeout=20,
            )
        yield cluster
    finally:
        with trio.CancelScope(shield=True):
            for server in servers:
                await server.kill()


async def read_all(
    cluster: SecureCluster, principal: str, address: str, stream: int
) -> list[bytes]:
    info = messages.FetchInfo(stream_id=stream, fetch_offset=0, batch_max_bytes=1 << 20)
    async with cluster.node_as(principal, address) as node, node.fetch([info]) as results:
        fetched = [f async for f in results]
    assert fetched[0].result.error_code == ErrorCode.NONE, fetched[0].result
    return [bytes(v) for f in fetched for v in decode_batches(f.data).to_list()]


async def test_replicated_streams_over_mutual_tls_with_per_item_authorization(
    tmp_path: Path,
) -> None:
    async with secure_cluster(tmp_path) as cluster:
        async with cluster.pm_as("alice") as alice:
            first = (await alice.create_stream(2)).stream
            second = (await alice.create_stream(1)).stream
            assert first is not None and second is not None
            assert first.stream_id == 1
            # The client library over TLS: the producer writes, replication
            # to the follower runs over mutual TLS, the consumer reads.
            tls = cluster.tls("alice")
            async with Producer(cluster.pm.address, 1, tls=tls) as producer:
                handle = await producer.send_many([b"a", b"b", b"c"])
                await producer.flush()
                assert (await handle.offsets()).tolist() == [0, 1, 2]
            async with Consumer(cluster.pm.address, 1, 0, tls=tls) as consumer:
                assert [r.value async for r in consumer.records()] == [b"a", b"b", b"c"]
            # the blocking client (what the Spark source runs on) takes the settings
            settings = TLSSettings(
                ca=cluster.ca.cert_path,
                cert=cluster.ca.issue("alice").cert,
                key=cluster.ca.issue("alice").key,
            )

            def read_synchronously() -> list[bytes]:
                with SyncClient(cluster.pm.address, timeout=10, tls=settings) as sync:
                    return [r.value for r in sync.consumer(1, from_offset=0)]

            assert await trio.to_thread.run_sync(read_synchronously) == [b"a", b"b", b"c"]
            (rng,) = await alice.list_stream_ranges(1)
            follower = next(r for r in rng.replica_nodes if not r.is_primary)
            await eventually(
                lambda: read_all(cluster, "alice", follower.data_node.advertise_addr, 1),
                until=lambda records: len(records) >= 3,
                what="the follower holding the three records",
            )
            # nobody may DELETE ("*" deny)
            with pytest.raises(ProtocolError) as denied:
                await alice.delete_stream(1)
            assert denied.value.code == ErrorCode.AUTHORIZATION_FAILED
            assert "'alice' may not DELETE on streams:1" in denied.value.message

        primary = primary_address(rng)
        async with cluster.node_as("bob", primary) as bob:
            # bob may read stream 1 and nothing else: per item, in one request
            infos = [
                messages.FetchInfo(
                    stream_id=s, request_index=s, fetch_offset=0, batch_max_bytes=1 << 16
                )
                for s in (1, 2)
            ]
            async with bob.fetch(infos) as results:
                codes = {f.result.stream_id: f.result.error_code async for f in results}
            assert codes == {1: ErrorCode.NONE, 2: ErrorCode.AUTHORIZATION_FAILED}
            batch = bytes(build_batch([b"x"], 1))
            one, two = await bob.append([(1, batch), (1, batch)])
            assert one.error_code == two.error_code == ErrorCode.AUTHORIZATION_FAILED
            assert "'bob' may not APPEND on streams:1" in one.error_message
        async with cluster.node_as("alice", primary) as alice_node:
            # mixed: alice's items are stored, none of bob's were
            (stored,) = await alice_node.append([(1, bytes(build_batch([b"d"], 1)))])
            assert (stored.error_code, stored.base_offset) == (ErrorCode.NONE, 3)

        async with cluster.pm_as("bob") as bob_pm, cluster.pm_as("eve") as eve_pm:
            # listings show what the principal may describe
            assert [s.stream_id for s in await bob_pm.get_streams_page()] == [1]
            assert await eve_pm.get_streams_page() == ()
            with pytest.raises(ProtocolError) as refused:
                await eve_pm.describe_cluster()
            assert refused.value.code == ErrorCode.AUTHORIZATION_FAILED

            # consumer groups (SPEC §11): a position needs FETCH of its stream,
            # deleting a group DELETE on the cluster
            mine, not_mine = await bob_pm.commit_offsets(
                "bob-etl",
                [
                    messages.GroupOffset(stream_id=1, offset=1),
                    messages.GroupOffset(stream_id=2, offset=0),
                ],
            )
            assert (mine.error_code, not_mine.error_code) == (
                ErrorCode.NONE,
                ErrorCode.AUTHORIZATION_FAILED,
            )
            assert [p.stream_id for p in await bob_pm.fetch_offsets("bob-etl")] == [1]
            assert await eve_pm.list_groups() == ()  # eve may describe no stream
            (kept,) = await bob_pm.delete_groups(["bob-etl"])
            assert kept.error_code == ErrorCode.AUTHORIZATION_FAILED
            assert "may not DELETE on cluster" in kept.error_message

        # The cluster-internal requests: only "datanode" and "pm" may send them.
        async with cluster.node_as("alice", primary) as alice_node:
            (sealed,) = await alice_node.seal_ranges([messages.RangeId(stream_id=1, range_index=0)])
            assert sealed.error_code == ErrorCode.AUTHORIZATION_FAILED
            (synced,) = await alice_node.sync_ranges([messages.StreamRanges(stream_id=1)])
            assert synced.error_code == ErrorCode.AUTHORIZATION_FAILED
        async with cluster.pm_as("alice") as alice:
            with pytest.raises(ProtocolError) as posing:
                await alice.heartbeat(
                    "fake-node",
                    role=ClientRole.DATA_NODE,
                    data_node=messages.DataNode(node_id=9, advertise_addr="127.0.0.1:1"),
                )
            assert posing.value.code == ErrorCode.AUTHORIZATION_FAILED
            assert len(await alice.list_stream_ranges(1)) == 1  # still open, not sealed

        assert cluster.pm.metrics_address is not None
        scrape = urllib.request.urlopen(f"http://{cluster.pm.metrics_address}/metrics", timeout=5)
        text = scrape.read().decode()
        assert 'sbp_authorization_denied_total{operation="DELETE"} 2.0' in text
        assert "sbp_acl_entries 3.0" in text


async def test_plain_text_and_unacceptable_certificates_are_refused(tmp_path: Path) -> None:
    async with secure_cluster(tmp_path, nodes=1) as cluster:
        async with ConnectionPool(connect_attempts=1) as plain:
            with pytest.raises(ConnectionClosed):
                await PMClient(cluster.pm.address, pool=plain, timeout=5).describe_cluster()
        no_certificate = TLSSettings(ca=cluster.ca.cert_path).client_context()
        stranger = LocalCA(tmp_path / "other-ca").issue("alice")
        other_ca = TLSSettings(
            ca=cluster.ca.cert_path, cert=stranger.cert, key=stranger.key
        ).client_context()
        old = cluster.ca.issue("alice-expired", days=-2)
        expired = TLSSettings(ca=cluster.ca.cert_path, cert=old.cert, key=old.key).client_context()
        for context in (no_certificate, other_ca, expired):
            async with ConnectionPool(tls=context, connect_attempts=1) as pool:
                with pytest.raises((ConnectionClosed, OSError)):
                    await PMClient(cluster.pm.address, pool=pool, timeout=5).describe_cluster()
        # /metrics over HTTPS: a scraper that trusts the CA reads it; plain HTTP does not
        metrics = cluster.nodes[0].metrics_address
        assert metrics is not None
        scraper = ssl.create_default_context(cafile=str(cluster.ca.cert_path))
        with urllib.request.urlopen(
            f"https://{metrics}/metrics", context=scraper, timeout=5
        ) as page:
            assert "sbp_acl_entries 3.0" in page.read().decode()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read()
        # and the servers go on serving the principals they accept
        async with cluster.pm_as("alice") as alice:
            assert (await alice.create_stream(1)).stream is not None
        assert "TLS handshake with" in cluster.pm.log()


async def test_sighup_reloads_the_acl_file_and_a_bad_file_changes_nothing(
    tmp_path: Path,
) -> None:
    async with secure_cluster(tmp_path, nodes=1) as cluster:
        async with cluster.pm_as("alice") as alice:
            created = await alice.create_stream(1)
        assert created.range is not None
        address = primary_address(created.range)
        batch = bytes(build_batch([b"b"], 1))
        async with cluster.node_as("bob", address) as bob:
            (refused,) = await bob.append([(1, batch)])
            assert refused.error_code == ErrorCode.AUTHORIZATION_FAILED
            grant = {"principal": "bob", "operations": ["APPEND"], "resource": "streams:1"}
            cluster.acl_path.write_text(
                json.dumps({"acls": [*ACL["acls"], {**grant, "effect": "allow"}]})
            )
            cluster.signal_all(signal.SIGHUP)
            await eventually(
                lambda: bob.append([(1, batch)]),
                until=lambda results: results[0].error_code == ErrorCode.NONE,
                timeout=10,
            )
            cluster.acl_path.write_text('{"acls": [ {"principal": "bob"')
            cluster.signal_all(signal.SIGHUP)
            await eventually(lambda: "ACL file refused" in cluster.nodes[0].log(), timeout=10)
            (kept,) = await bob.append([(1, batch)])
            assert kept.error_code == ErrorCode.NONE  # the previous entries stay in force
        assert cluster.pm.running and cluster.nodes[0].running


def test_servers_refuse_unusable_security_settings(tmp_path: Path) -> None:
    ca = LocalCA(tmp_path / "pki")
    pm = ca.issue("pm")
    bad_acl = tmp_path / "bad.json"
    bad_acl.write_text('{"acls": [{"principal": "x"}]}')
    cases = [
        (["--acl-file", str(bad_acl)], "--acl-file needs mutual TLS"),
        (["--tls-cert", str(pm.cert)], "--tls-cert and --tls-key go together"),
        (
            ["--tls-cert", str(pm.cert), "--tls-key", str(pm.key), "--tls-ca", str(ca.cert_path),
             "--acl-file", str(bad_acl)],
            "entry 1: missing",
        ),
        (["--tls-cert", str(tmp_path / "none.pem"), "--tls-key", str(pm.key)], "does not exist"),
    ]  # fmt: skip
    for flags, problem in cases:
        run = subprocess.run(
            [sys.executable, "-m", "pm", "--data-dir", str(tmp_path / "pm"), *flags],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert run.returncode == 2, run.stderr
        assert problem in run.stderr and "Traceback" not in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1


def test_sbp_cluster_tls_and_the_cli_round_trip(tmp_path: Path) -> None:
    """The README's round trip on ``sbp-cluster --tls``: the CLI, run next
    to the data directory, finds the local CA and its certificate."""
    cluster = start_cluster(tmp_path / "var", nodes=2, extra=("--tls",))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SBP_")}

    def sbp(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "client.cli", "--pm", cluster.pm_address, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env=env,
            check=False,
        )

    try:
        assert (tmp_path / "var" / "pki" / "ca.pem").is_file()
        created = sbp("streams", "create", "--replicas", "2")
        assert created.returncode == 0, created.stderr
        appended = sbp("append", "1", stdin="one\ntwo\nthree\n")
        assert appended.returncode == 0, appended.stderr
        read = sbp("read", "1", "--from", "0", "--count", "3")
        assert read.stdout.split() == ["one", "two", "three"], read.stderr
        # from elsewhere, without the certificates: one clear line
        plain = subprocess.run(
            [sys.executable, "-m", "client.cli", "--pm", cluster.pm_address, "cluster", "status"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path / "var",
            env=env,
            check=False,
        )
        assert plain.returncode == 3
        assert "give --tls-ca" in plain.stderr and len(plain.stderr.strip().splitlines()) == 1
    finally:
        assert cluster.stop() == 0, cluster.output()
