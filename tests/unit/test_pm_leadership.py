"""The PM's leadership loop (pm/leadership.py) on a fake etcd: a term whose
start fails on etcd (the metadata cannot be read) ends, and the PM
campaigns again instead of crashing."""

from __future__ import annotations

from typing import Any

import trio

from pm.etcd import EtcdUnavailable, KeyValue, TxnResult
from pm.leadership import Leadership


class FakeEtcd:
    """Every campaign wins, in a new term."""

    def __init__(self) -> None:
        self.revision = 0
        self.revoked: list[int] = []

    async def lease_grant(self, ttl_s: int) -> int:
        return 100 + self.revision

    async def txn(self, compare: Any, success: Any, failure: Any = ()) -> TxnResult:
        self.revision += 1
        return TxnResult(succeeded=True, revision=self.revision, responses=())

    async def lease_keepalive(self, lease: int) -> int:
        return 3

    async def lease_revoke(self, lease: int) -> None:
        self.revoked.append(lease)

    async def get(self, key: bytes) -> KeyValue | None:
        return None


async def test_a_term_that_cannot_start_on_etcd_is_given_up_and_campaigned_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    etcd = FakeEtcd()
    leadership = Leadership(etcd, b"/sbp/", "127.0.0.1:7400", ttl_s=3)  # type: ignore[arg-type]
    terms: list[int] = []
    serving = trio.Event()

    async def lead(term: int) -> None:
        terms.append(term)
        if len(terms) == 1:
            raise EtcdUnavailable("no etcd member answered /v3/kv/range")
        serving.set()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(leadership.run, lead)
        with trio.fail_after(10):
            await serving.wait()
        assert leadership.is_leader and leadership.term == 2
        nursery.cancel_scope.cancel()
    assert terms == [1, 2]
    assert etcd.revoked == [100, 101]  # the failed term's lease, then the last one's at the end
    assert not leadership.is_leader
