"""Fixtures for the Spark tests: ONE SparkSession and ONE local cluster (a PM
and two data nodes as real processes) for the whole run, since a session
costs seconds to start. The tests are synchronous; they reach the cluster
through ``StreamOps`` and Spark through the ``spark`` fixture."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from .streams import StreamOps

#: seconds the cluster gets to start its PM and data nodes
CLUSTER_START_TIMEOUT_S = 60.0
CLUSTER_STOP_TIMEOUT_S = 30.0


@pytest.fixture(scope="session")
def pm_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local cluster (``python -m client.launcher``, 2 data nodes, free ports)."""
    root = tmp_path_factory.mktemp("sbp-cluster")
    ready = root / "ready"
    log = (root / "cluster.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "client.launcher",
            "--data-dir",
            str(root / "data"),
            "--nodes",
            "2",
            "--port-base",
            "0",
            "--ready-file",
            str(ready),
            "--no-tables",  # the tables' tests write them themselves
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + CLUSTER_START_TIMEOUT_S
        while not (ready.exists() and ready.read_text().strip()):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the local cluster did not start:\n{_tail(root / 'cluster.log')}"
                )
            time.sleep(0.1)
        yield ready.read_text().strip()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(CLUSTER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _tail(path: Path, size: int = 4000) -> str:
    return path.read_text(errors="replace")[-size:] if path.exists() else ""


@pytest.fixture(scope="session")
def ops(pm_address: str) -> Iterator[StreamOps]:
    with StreamOps(pm_address) as stream_ops:
        yield stream_ops


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    from spark_jobs.session import spark_session

    # local[2, 2]: a failed task is tried once more, as on a cluster
    session = spark_session("sbp-tests", master="local[2,2]")
    yield session
    session.stop()
