"""The PM's etcd client (pm/etcd.py) against three real etcd members on
loopback: the key-value calls, guarded transactions, leases, watches, a
lost member (nothing visible) and a lost majority (a prompt, retriable
error, and recovery when the members return)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from pm.etcd import (
    Etcd,
    EtcdUnavailable,
    create_revision_is,
    delete_op,
    get_op,
    put_op,
    version_is,
)

from .etcd_cluster import etcd_cluster

pytestmark = pytest.mark.deadline(90)


async def test_keys_transactions_and_watches(tmp_path: Path) -> None:
    async with etcd_cluster(tmp_path) as cluster, Etcd(cluster.endpoints) as etcd:
        assert await etcd.get(b"/sbp/absent") is None
        revision = await etcd.put(b"/sbp/streams/1", b"one")
        await etcd.put(b"/sbp/streams/2", b"two")
        await etcd.put(b"/sbp/other", b"x")
        one = await etcd.get(b"/sbp/streams/1")
        assert one is not None and (one.value, one.create_revision) == (b"one", revision)
        listed, at = await etcd.get_prefix(b"/sbp/streams/")
        assert [(kv.key, kv.value) for kv in listed] == [
            (b"/sbp/streams/1", b"one"),
            (b"/sbp/streams/2", b"two"),
        ]
        assert at >= revision + 2

        # create-if-absent: the first wins, the second is told who holds it
        first = await etcd.txn([version_is(b"/sbp/leader", 0)], [put_op(b"/sbp/leader", b"a")])
        second = await etcd.txn(
            [version_is(b"/sbp/leader", 0)],
            [put_op(b"/sbp/leader", b"b")],
            [get_op(b"/sbp/leader")],
        )
        assert first.succeeded and not second.succeeded
        held = second.responses[0]["response_range"]["kvs"][0]
        assert int(held["create_revision"]) == first.revision
        # a write guarded by the leader key's creation goes through only for its holder
        guarded = await etcd.txn(
            [create_revision_is(b"/sbp/leader", first.revision)],
            [put_op(b"/sbp/streams/3", b"three"), delete_op(b"/sbp/other")],
        )
        assert guarded.succeeded and await etcd.get(b"/sbp/other") is None
        stale = await etcd.txn(
            [create_revision_is(b"/sbp/leader", first.revision - 1)],
            [put_op(b"/sbp/streams/4", b"four")],
        )
        assert not stale.succeeded and await etcd.get(b"/sbp/streams/4") is None

        seen = []
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for event in etcd.watch(b"/sbp/streams/", prefix=True):
                    seen.append((event.kind, event.kv.key, event.kv.value))
                    if len(seen) == 2:
                        nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await trio.sleep(0.3)  # the watch is set up
            await etcd.put(b"/sbp/streams/5", b"five")
            assert await etcd.delete(b"/sbp/streams/5") == 1
            with trio.fail_after(10):
                await trio.sleep_forever()
        assert seen == [("PUT", b"/sbp/streams/5", b"five"), ("DELETE", b"/sbp/streams/5", b"")]


async def test_leases_keep_keys_alive_and_take_them_away(tmp_path: Path) -> None:
    async with etcd_cluster(tmp_path) as cluster, Etcd(cluster.endpoints) as etcd:
        kept = await etcd.lease_grant(2)
        dropped = await etcd.lease_grant(2)
        await etcd.put(b"/sbp/kept", b"1", lease=kept)
        await etcd.put(b"/sbp/dropped", b"1", lease=dropped)
        for _ in range(8):  # 4 s: twice the TTL
            assert await etcd.lease_keepalive(kept) > 0
            await trio.sleep(0.5)
        assert await etcd.get(b"/sbp/kept") is not None
        assert await etcd.get(b"/sbp/dropped") is None  # expired with its lease
        assert await etcd.lease_keepalive(dropped) == 0
        await etcd.lease_revoke(kept)
        assert await etcd.get(b"/sbp/kept") is None
        await etcd.lease_revoke(kept)  # already gone: no error


async def test_a_lost_member_is_invisible_and_a_lost_majority_fails_fast(tmp_path: Path) -> None:
    async with etcd_cluster(tmp_path) as cluster:
        first, second, third = cluster.members
        async with Etcd(cluster.endpoints, timeout=1.0) as etcd:
            await etcd.put(b"/sbp/k", b"1")
            await cluster.kill(first)  # the member the client was using
            await etcd.put(b"/sbp/k", b"2")
            value = await etcd.get(b"/sbp/k")
            assert value is not None and value.value == b"2"

            await cluster.kill(second)
            started = trio.current_time()
            with pytest.raises(EtcdUnavailable):
                await etcd.put(b"/sbp/k", b"3")
            assert trio.current_time() - started < 5.0  # prompt, never a hang

            await cluster.start(first, state="existing")
            await cluster.start(second, state="existing")
            with trio.fail_after(30):
                while True:
                    try:
                        await etcd.put(b"/sbp/k", b"4")
                        break
                    except EtcdUnavailable:
                        await trio.sleep(0.2)
            value = await etcd.get(b"/sbp/k")
            assert value is not None and value.value == b"4"
        assert third.process is not None and third.process.returncode is None
