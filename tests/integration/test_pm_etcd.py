"""The PM's leadership and metadata on three real etcd members (SPEC §8):
one leader at a time, terms that grow, writes that only the leader's term
can make, and metadata that a new leader reads back whole."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from pm.changes import (
    Change,
    DeleteStream,
    MarkForeignStream,
    PutNode,
    PutRange,
    PutStream,
    RaiseNextStreamId,
)
from pm.etcd import Etcd
from pm.etcd_metadata import MAX_TXN_OPS, EtcdMetadataStore
from pm.leadership import Leadership
from pm.producers import ProducerIds
from pm.records import NodeRecord, ProducerRecord, RangeRecord, StreamRecord
from sbp.errors import NotLeaderError, ProducerFencedError

from ..eventually import eventually
from ..unit.test_pm_groups import check_position_store
from ..unit.test_pm_members import check_member_store
from ..unit.test_pm_metadata import check_draining_store
from .etcd_cluster import etcd_cluster

pytestmark = pytest.mark.deadline(90)

PREFIX = b"/sbp-test/"


async def test_one_leader_at_a_time_and_only_its_term_writes(tmp_path: Path) -> None:
    async with etcd_cluster(tmp_path) as cluster, Etcd(cluster.endpoints) as etcd:
        first = Leadership(etcd, PREFIX, "127.0.0.1:1001", ttl_s=2)
        second = Leadership(etcd, PREFIX, "127.0.0.1:1002", ttl_s=2)
        first_store = EtcdMetadataStore(etcd, PREFIX, first.guard)
        second_store = EtcdMetadataStore(etcd, PREFIX, second.guard)
        terms: list[tuple[str, int]] = []

        def lead_as(name: str) -> Callable[[int], Awaitable[None]]:
            async def lead(term: int) -> None:
                terms.append((name, term))
                await trio.sleep_forever()

            return lead

        async with trio.open_nursery() as nursery:
            first_scope = trio.CancelScope()

            async def run_first() -> None:
                with first_scope:
                    await first.run(lead_as("first"))

            nursery.start_soon(run_first)
            await eventually(lambda: first.is_leader)
            nursery.start_soon(second.run, lead_as("second"))
            await eventually(lambda: second.leader_addr == "127.0.0.1:1001")
            assert not second.is_leader

            await first_store.commit([PutNode(NodeRecord(1, "127.0.0.1:7401"))])
            with pytest.raises(NotLeaderError):
                await second_store.commit([PutNode(NodeRecord(2, "127.0.0.1:7402"))])

            # The leader key vanishes (its lease expired, say): the old
            # leader's next write is refused, it steps down and (here) goes
            # away; the other PM takes over in a later term.
            old_term = first.term
            assert old_term is not None
            await etcd.delete(first.key)
            with pytest.raises(NotLeaderError):
                await first_store.commit([PutNode(NodeRecord(3, "127.0.0.1:7403"))])
            first.step_down("its write was refused")
            first_scope.cancel()
            await eventually(lambda: second.is_leader)
            assert second.term is not None and second.term > old_term
            await second_store.load()
            assert [n.node_id for n in second_store.nodes()] == [1]
            await second_store.commit([PutNode(NodeRecord(2, "127.0.0.1:7402"))])
            with pytest.raises(NotLeaderError):  # the deposed PM's store stays refused
                await first_store.commit([PutNode(NodeRecord(3, "127.0.0.1:7403"))])

            # A PM that joins later follows the leader of the day.
            third = Leadership(etcd, PREFIX, "127.0.0.1:1003", ttl_s=2)
            nursery.start_soon(third.run, lead_as("third"))
            await eventually(lambda: third.leader_addr == "127.0.0.1:1002")
            assert not third.is_leader
            nursery.cancel_scope.cancel()
        assert [name for name, _ in terms] == ["first", "second"]
        assert terms[0][1] < terms[1][1]


async def test_metadata_round_trips_and_large_commits_are_cut(tmp_path: Path) -> None:
    async with etcd_cluster(tmp_path) as cluster, Etcd(cluster.endpoints) as etcd:
        leadership = Leadership(etcd, PREFIX, "127.0.0.1:1001", ttl_s=2)
        store = EtcdMetadataStore(etcd, PREFIX, leadership.guard)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(leadership.run, lambda _term: trio.sleep_forever())
            await eventually(lambda: leadership.is_leader)
            await store.load()
            assert store.next_stream_id() == 1 and store.counts().streams == 0
            count = MAX_TXN_OPS  # twice the operations one transaction may hold
            changes: list[Change] = [
                PutStream(StreamRecord(i, 3, -1, 0, 2)) for i in range(1, count + 1)
            ]
            changes += [PutRange(RangeRecord(i, 0, 0, (1, 2, 3))) for i in range(1, count + 1)]
            changes.append(RaiseNextStreamId(count + 1))
            changes.append(MarkForeignStream(count))
            changes.append(PutNode(NodeRecord(1, "127.0.0.1:7401")))
            await store.commit(changes)
            sealed = RangeRecord(7, 0, 0, (1, 2, 3), end_offset=50)
            await store.commit([PutRange(sealed), PutRange(RangeRecord(7, 1, 50, (2, 3, 4)))])
            await store.commit([DeleteStream(9)])

            reread = EtcdMetadataStore(etcd, PREFIX, leadership.guard)
            await reread.load()
            for view in (store, reread):
                assert view.next_stream_id() == count + 1
                assert view.foreign_streams() == {count}
                assert view.counts().streams == count - 1
                assert view.counts().ranges == count  # one each, stream 7 two, 9 none
                assert view.stream(9) is None and view.ranges(9) == []
                stream = view.stream(7)
                assert stream is not None and (stream.replica_nums, stream.ack_nums) == (3, 2)
                assert [r.end_offset for r in view.ranges(7)] == [50, -1]
                last = view.last_range(7)
                assert last is not None and last.nodes == (2, 3, 4)
                assert [(r.stream_id, r.range_index) for r in view.ranges_on_node(4)] == [(7, 1)]
                assert view.range_counts_by_node()[1] == count - 1
                assert [s.stream_id for s in view.streams(start_after=5, limit=3)] == [6, 7, 8]
                assert view.nodes() == [NodeRecord(1, "127.0.0.1:7401")]

            # INIT_PRODUCER's ids and epochs (SPEC §10), as a new leader reads them
            producers = ProducerIds(store, store.commit)
            assert (await producers.init("", -1)).producer_id == 1
            assert (await producers.init("billing", -1)) == ProducerRecord("billing", 2, 0)
            assert (await producers.init("billing", -1)).epoch == 1
            with pytest.raises(ProducerFencedError):
                await producers.init("billing", 0)
            successor = EtcdMetadataStore(etcd, PREFIX, leadership.guard)
            await successor.load()
            assert successor.producers() == [ProducerRecord("billing", 2, 1)]
            assert successor.next_producer_id() == 3
            again = ProducerIds(successor, successor.commit)
            assert (await again.init("billing", -1)) == ProducerRecord("billing", 2, 2)
            assert (await again.init("", -1)).producer_id == 3

            # consumer group positions (SPEC §11): the LMDB store's checks,
            # then as a new leader reads them
            await check_position_store(store)
            later = EtcdMetadataStore(etcd, PREFIX, leadership.guard)
            await later.load()
            assert later.all_group_offsets() == store.all_group_offsets()

            # draining marks (SPEC §12), as a new leader reads them
            await check_draining_store(store)
            latest = EtcdMetadataStore(etcd, PREFIX, leadership.guard)
            await latest.load()
            assert latest.draining_nodes() == {2}

            # consumer group members (SPEC §15), as a new leader reads them
            await check_member_store(store)
            newest = EtcdMetadataStore(etcd, PREFIX, leadership.guard)
            await newest.load()
            assert newest.all_members() == store.all_members()
            assert [m.key for m in latest.moves()] == [(8, 0)]
            nursery.cancel_scope.cancel()
