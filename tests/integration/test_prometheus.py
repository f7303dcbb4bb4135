"""The dashboard against a real Prometheus (Debian's ``prometheus``) scraping
a real local cluster (``sbp-cluster``: a PM and two data nodes) every second
while a producer and a consumer run: every PromQL query of
dashboards/sbp-cluster.json must parse and return data, what the PM holds
from each node's REPORT_METRICS must match the node's own metrics, and every
metric the docs name must be one a server shows."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from client import DataNodeClient, SyncClient
from dashboards.build import expressions, render
from net.address import free_ports
from net.service import METRICS_PREFIX
from sbp.batches import build_batch
from sbp.errors import UnsupportedOperationError

from ..docs_text import named_in_docs
from .local_cluster import LocalCluster, start_cluster

pytestmark = pytest.mark.integration

SCRAPE_INTERVAL_S = 1
RATE_INTERVAL = "10s"
LOAD_SECONDS = 12.0
RECORDS_PER_TICK = 1000
TICK_S = 0.05  # 1,000 records of 100 bytes every 50 ms: ~2 MB/s, steady


def metrics_addresses(cluster: LocalCluster) -> dict[str, str]:
    """Each server's /metrics address, from the line it printed into its log."""
    found = {}
    for log in sorted((cluster.data_dir / "logs").glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(METRICS_PREFIX):
                found[log.stem] = line[len(METRICS_PREFIX) :].strip()
    return found


class Prometheus:
    def __init__(self, root: Path, jobs: dict[str, list[str]]) -> None:
        [self.port] = free_ports(1)
        config = root / "prometheus.yml"
        scrape_configs = [
            {"job_name": job, "static_configs": [{"targets": targets}]}
            for job, targets in jobs.items()
        ]
        config.write_text(
            json.dumps(
                {
                    "global": {
                        "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                        "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
                    },
                    "scrape_configs": scrape_configs,
                }
            )
        )
        self.log_path = root / "prometheus.log"
        self.log = self.log_path.open("wb")
        binary = shutil.which("prometheus")
        assert binary, "prometheus is installed by scripts/install-system-deps.sh (make test)"
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={root / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        url = f"http://127.0.0.1:{self.port}/api/v1/query?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                body: dict[str, Any] = json.load(answer)
        except urllib.error.HTTPError as error:
            # A query that does not parse (400) or cannot run (422) is
            # answered in JSON; anything else, such as 503 while Prometheus
            # starts, is raised (an OSError: wait_ready polls again).
            if error.code not in (400, 422):
                raise
            body = json.load(error)
        return body

    def values(self, expr: str, at: float | None = None) -> dict[str, float]:
        """Sample values by their label set (``{}`` for none)."""
        answer = self.query(expr, at)
        assert answer["status"] == "success", (expr, answer)
        return {
            json.dumps(item["metric"], sort_keys=True): float(item["value"][1])
            for item in answer["data"]["result"]
        }

    def wait_ready(self, jobs: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        up: dict[str, float] = {}
        while time.monotonic() < deadline:
            try:
                up = self.values("up")
                if len(up) == jobs and all(value == 1 for value in up.values()):
                    return
            except OSError:  # not listening yet
                pass
            time.sleep(0.2)
        log = self.log_path.read_text(errors="replace")[-3000:]
        raise AssertionError(f"prometheus did not scrape every target: {up}\n{log}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    running = start_cluster(tmp_path / "var", nodes=2, extra=["--object-store"], tables=True)
    try:
        yield running
    finally:
        assert running.stop() == 0, running.output()


def run_load(pm: str, stream_id: int, seconds: float) -> tuple[int, int]:
    """A paced producer and a tailing consumer; (records sent, records read)."""
    total: list[int] = []  # set, with the final count, before the last record goes out
    read = 0
    with SyncClient(pm) as client:

        def consume() -> None:
            nonlocal read
            # a consumer group: its lag and commits feed the Consumers row
            with client.consumer(
                stream_id, 0, tail=True, group="dashboard", auto_commit_interval=0.5
            ) as consumer:
                # A tailing read never ends by itself; the last record is sent
                # after ``total`` is known, so one more batch always comes.
                while not (total and read >= total[0]):
                    batch = consumer.next_batch()
                    read += len(batch) if batch is not None else 0

        reader = threading.Thread(target=consume)
        reader.start()
        sent = 0
        with client.producer(stream_id) as producer:
            value = b"v" * 100
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                producer.send_many([value] * RECORDS_PER_TICK)
                sent += RECORDS_PER_TICK
                time.sleep(TICK_S)
            total.append(sent + 1)
            producer.send_many([b"last"])
            producer.flush()
        reader.join(60)
        assert not reader.is_alive(), f"the consumer read {read} of {sent + 1} records"
    return sent + 1, read


async def provoke_errors(pm: str, node: str) -> None:
    """One SYSTEM_ERROR answer (APPEND to the PM) and one bad frame (to a node)."""
    async with DataNodeClient(pm) as wrong_server:
        with pytest.raises(UnsupportedOperationError):
            await wrong_server.append_batch(1, memoryview(build_batch([b"x"], 0)))
    host, _, port = node.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(b"\x00\x00\x00\x10\x99" + bytes(15))  # bad magic byte
        with trio.move_on_after(5):
            while await stream.receive_some(4096):
                pass


@pytest.mark.deadline(180)
def test_dashboard_queries_return_data_from_a_live_cluster(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    addresses = metrics_addresses(cluster)
    assert sorted(addresses) == ["node-1", "node-2", "pm", "tables"]
    prometheus = Prometheus(
        tmp_path,
        {
            "sbp-pm": [addresses["pm"]],
            "sbp-datanode": [addresses["node-1"], addresses["node-2"]],
            "sbp-tables": [addresses["tables"]],
        },
    )
    try:
        prometheus.wait_ready(jobs=4)
        with SyncClient(cluster.pm_address) as client:
            # the loaded stream has two replicas: the replication panels get data
            streams = [client.create_stream(replicas).stream_id for replicas in (2, 1, 1)]
            primary = client.list_ranges(streams[0])[-1]
            # and is kept as a table: the Tables row gets data
            client.update_stream(streams[0], table_interval_ms=1_000)
            # and one is tiered: the Tiered storage row gets data
            client.update_stream(streams[1], local_retention_ms=0)
        node_address = next(
            r.data_node.advertise_addr for r in primary.replica_nodes if r.is_primary
        )
        trio.run(provoke_errors, cluster.pm_address, node_address)

        started = time.time()
        sent, read = run_load(cluster.pm_address, streams[0], LOAD_SECONDS)
        assert read == sent > 0
        during = started + LOAD_SECONDS - 1  # inside the load, scraped by now
        time.sleep(2 * SCRAPE_INTERVAL_S)

        empty = []
        for expr in expressions():
            concrete = (
                expr.replace("$__rate_interval", RATE_INTERVAL)
                .replace("$node", ".*")
                .replace("$datanode_job", "sbp-datanode")
                .replace("$pm_job", "sbp-pm")
                .replace("$tables_job", "sbp-tables")
            )
            answer = prometheus.query(concrete, at=during)
            if answer["status"] == "success" and not answer["data"]["result"]:
                # a series a loaded machine exported late in the load (a
                # group's lag, once the PM has seen its first commit)
                answer = prometheus.query(concrete)
            assert answer["status"] == "success", (concrete, answer)
            if not answer["data"]["result"]:
                empty.append(concrete)
        assert not empty, "queries with no data:\n" + "\n".join(empty)

        appended = prometheus.values(
            f"rate(sbp_datanode_appended_records_total[{RATE_INTERVAL}])", at=during
        )
        assert max(appended.values()) > 0.5 * RECORDS_PER_TICK / TICK_S

        check_reports_match_node_metrics(prometheus, during)
        check_documented_metrics_are_exported(addresses.values())
    finally:
        prometheus.stop()


#: a metric name as the docs write it (a name ending in ``_`` is a prefix)
DOCUMENTED_METRIC = re.compile(r"\bsbp_[a-z0-9_]*[a-z0-9]\b")
#: exported only by PMs on etcd (docs/pm.md); this cluster has one PM on LMDB
ETCD_ONLY_METRICS = frozenset(
    {"sbp_pm_etcd_request_seconds", "sbp_pm_leader", "sbp_pm_term", "sbp_pm_terms_won_total"}
)


def exported_metrics(address: str) -> set[str]:
    """The family and sample names a server's /metrics shows."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def check_documented_metrics_are_exported(addresses: Iterable[str]) -> None:
    """Every metric the docs name is shown by the PM's or a node's /metrics."""
    exported = set().union(*(exported_metrics(address) for address in addresses))
    missing = {
        f"{page}: {name}"
        for page, name in named_in_docs(DOCUMENTED_METRIC)
        if name not in exported and name not in ETCD_ONLY_METRICS
    }
    assert not missing, sorted(missing)


def check_reports_match_node_metrics(prometheus: Prometheus, at: float) -> None:
    """The PM's per-node gauges (the latest REPORT_METRICS) against the nodes'
    own /metrics, matched through the node id each report carries."""
    by_instance = {
        json.loads(labels)["instance"]: value
        for labels, value in prometheus.values('sbp_datanode_ranges{state="open"}', at=at).items()
    }
    reported = prometheus.values("sbp_pm_data_node_open_ranges", at=at)
    assert sorted(reported.values()) == sorted(by_instance.values())
    assert sum(reported.values()) == 4  # one open range per stream, on each of its replicas

    own_rates = prometheus.values(
        f"sum by (instance) (rate(sbp_datanode_appended_bytes_total[{RATE_INTERVAL}]))", at=at
    )
    reported_rates = prometheus.values("sbp_pm_data_node_disk_written_bytes_per_second", at=at)
    busiest_own = max(own_rates.values())
    busiest_reported = max(reported_rates.values())
    assert busiest_own > 0 and busiest_reported > 0
    # Different windows (the node's 5 s report against a 10 s rate) of a steady load.
    assert 1 / 3 < busiest_reported / busiest_own < 3, (reported_rates, own_rates)


def test_committed_dashboard_is_generated() -> None:
    committed = (
        Path(__file__).resolve().parents[2] / "dashboards" / "sbp-cluster.json"
    ).read_text()
    assert committed == render(), "run: python dashboards/build.py"


def test_alert_rules_load_and_fire_as_their_tests_say() -> None:
    """dashboards/alerts.yml parses, and promtool's rule tests (each alert on
    the series that should raise it) pass."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool comes with prometheus (scripts/install-system-deps.sh)"
    folder = Path(__file__).resolve().parents[2] / "dashboards"
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        done = subprocess.run(
            [promtool, *args], cwd=folder, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
