"""The placement manager's suite (tests/unit/test_pm_manager.py) once more,
with its metadata in etcd (a real member) instead of LMDB: the manager must
not know which store it runs on (SPEC §8). Every test of that module is
collected here again; only the ``store`` fixture differs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pm.etcd import Etcd, create_revision_is, put_op, version_is
from pm.etcd_metadata import EtcdMetadataStore
from tests.unit.test_pm_manager import *  # noqa: F403  (the same tests, collected here)

from .etcd_cluster import etcd_cluster

PREFIX = b"/sbp-suite/"
LEADER_KEY = PREFIX + b"leader"


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[EtcdMetadataStore]:
    async with etcd_cluster(tmp_path, size=1) as cluster, Etcd(cluster.endpoints) as etcd:
        # this test's manager leads: it holds the leader key, and writes under its term
        held = await etcd.txn([version_is(LEADER_KEY, 0)], [put_op(LEADER_KEY, b"test")])
        assert held.succeeded
        opened = EtcdMetadataStore(
            etcd, PREFIX, lambda: [create_revision_is(LEADER_KEY, held.revision)]
        )
        await opened.load()
        yield opened
