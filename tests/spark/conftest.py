"""Fixtures for the Spark tests: ONE SparkSession and ONE local cluster (a PM
and two data nodes as real processes) for the whole run, since a session
costs seconds to start. The tests are synchronous; they reach the cluster
through ``StreamOps`` and Spark through the ``spark`` fixture."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from client.local_cluster import start_local_cluster

from .streams import StreamOps


@pytest.fixture(scope="session")
def pm_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local cluster (``sbp-cluster``, 2 data nodes, an object store, free
    ports); the tables' tests write their tables themselves."""
    root = tmp_path_factory.mktemp("sbp-cluster")
    cluster = start_local_cluster(
        root / "data",
        ["--nodes", "2", "--no-tables", "--object-store"],
        log_path=root / "cluster.log",
    )
    try:
        yield cluster.pm_address
    finally:
        cluster.stop()


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
