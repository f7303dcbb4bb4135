"""Batches sent to the followers while the primary's own commit syncs
(SPEC §7, datanode.replication.primary): they go from memory, the commit
offset still waits for the primary's durability, and an offset the followers
may hold is never handed to another batch: a commit that fails after the
hand-over, and a restart, fence the range until the PM seals it."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import trio

from datanode.replica_state import ReplicaStates
from datanode.replication.primary import Replicator
from datanode.waiters import StreamWaiters
from sbp.batches import build_batch
from sbp.errors import ProtocolError, RangeSealedError
from storage import RangeInfo, ReplicaInfo, StorageEngine
from storage.model import AppendItem, AppendOutcome, AppendResult
from storage.producers import ProducerStamp

from ..eventually import eventually
from .test_replication_pipeline import STREAM, FakeEngine, FakeFollower, pipeline_of

REPLICAS = (
    ReplicaInfo(1, "127.0.0.1:9001", True),
    ReplicaInfo(2, "127.0.0.1:9002", False),
    ReplicaInfo(3, "127.0.0.1:9003", False),
)


async def test_a_batch_goes_to_the_followers_before_it_is_durable_here() -> None:
    """Both followers hold the batch and answered; the item is acknowledged
    only once the primary's commit makes it durable here too."""
    engine = FakeEngine()
    pipeline = pipeline_of(engine)
    connections = [FakeFollower(), FakeFollower()]
    acknowledged: list[bool] = []
    batch = build_batch([b"v"], 0)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for follower, connection in zip(pipeline.followers, connections, strict=True):
                follower.send_offset = 0
                nursery.start_soon(pipeline._stream_to, follower, connection)  # type: ignore[arg-type]
            pipeline.applied(0, 1, batch)  # written here, the commit syncing
            pipeline.wait_commit(1, acknowledged.append)
            await eventually(lambda: all(c.next >= 1 for c in connections), interval=0.001)
            await trio.sleep(0.01)
            assert [f.match for f in pipeline.followers] == [1, 1]
            assert pipeline.commit == 0 and acknowledged == []

            engine.append(1)  # the commit is durable now
            pipeline.new_data()
            assert pipeline.commit == 1 and acknowledged == [True]
            nursery.cancel_scope.cancel()


def test_only_a_batch_that_continues_what_is_held_is_kept_in_memory() -> None:
    engine = FakeEngine()
    engine.append(2)
    pipeline = pipeline_of(engine)
    batch = build_batch([b"v"], 0)
    pipeline.applied(1, 1, batch)  # durable already: read from storage
    pipeline.applied(3, 1, batch)  # not where the durable records end
    assert pipeline._next_frame(2) is None
    pipeline.applied(2, 1, batch)
    pipeline.applied(3, 1, batch)
    frame = pipeline._next_frame(2)
    assert frame is not None
    items, payload, next_offset = frame
    assert [item.base_offset for item in items] == [2, 3]
    assert next_offset == 4 and len(payload) == 2 * len(batch)
    engine.append(1)
    pipeline.new_data()  # offset 2 is durable: it leaves the memory
    assert [base for base, *_ in pipeline._ahead] == [3]


def test_the_producer_fields_go_with_each_batch_from_memory_and_from_storage() -> None:
    """REPLICATE carries the APPEND's producer fields (SPEC §10): a durable
    batch's from its stored stamp, a batch still syncing from memory, and a
    batch without a producer with zeros."""
    engine = FakeEngine()
    engine.append(2, ProducerStamp(9, 1, 40))
    engine.append(1)
    pipeline = pipeline_of(engine)
    pipeline.applied(3, 2, build_batch([b"v", b"w"], 0), ProducerStamp(9, 1, 43))
    stored = pipeline._next_frame(0)
    assert stored is not None
    assert [
        (i.base_offset, i.producer_id, i.producer_epoch, i.base_sequence) for i in stored[0]
    ] == [
        (0, 9, 1, 40),
        (2, 0, 0, 0),
    ]
    ahead = pipeline._next_frame(3)
    assert ahead is not None
    assert [(i.producer_id, i.base_sequence) for i in ahead[0]] == [(9, 43)]


class _FailingCommit:
    """A write transaction whose commit fails like a broken disk would."""

    def __init__(self, txn: Any) -> None:
        self._txn = txn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)

    def commit(self) -> None:
        self._txn.abort()
        raise OSError(5, "Input/output error")


class _Env:
    """The engine's LMDB environment, with the next write commit failing."""

    def __init__(self, env: Any) -> None:
        self._env = env
        self.fail_next = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def begin(self, *, write: bool = False, **kwargs: Any) -> Any:
        txn = self._env.begin(write=write, **kwargs)
        if write and self.fail_next.is_set():
            self.fail_next.clear()
            return _FailingCommit(txn)
        return txn


def _append(
    engine: StorageEngine, stream_id: int, *, ahead: list[AppendOutcome] | None = None
) -> AppendOutcome:
    done: Future[AppendOutcome] = Future()
    on_applied = None if ahead is None else ahead.extend
    engine.submit(
        [AppendItem(stream_id, build_batch([b"v"], 0))],
        lambda outcomes: done.set_result(outcomes[0]),
        on_applied,
    )
    return done.result(timeout=10)


def test_a_commit_that_fails_after_the_hand_over_fences_the_range(tmp_path: Path) -> None:
    """The failed batch's offset went to the followers: the range takes no
    more appends here (the next one would get that offset). A range whose
    batches were not handed over goes on as before."""
    with StorageEngine(tmp_path / "node", node_id=1, map_size=64 << 20) as engine:
        engine.sync_ranges(STREAM, [RangeInfo(STREAM, 0, 0, replicas=REPLICAS)]).result()
        engine.sync_ranges(
            STREAM + 1, [RangeInfo(STREAM + 1, 0, 0, replicas=REPLICAS[:1])]
        ).result()
        env = _Env(engine._store.env)
        engine._store.env = env
        handed: list[AppendOutcome] = []
        assert isinstance(_append(engine, STREAM, ahead=handed), AppendResult)

        env.fail_next.set()
        failed = _append(engine, STREAM, ahead=handed)
        assert isinstance(failed, ProtocolError)
        assert [o.base_offset for o in handed if isinstance(o, AppendResult)] == [0, 1]
        assert engine.next_offset(STREAM) == 1

        refused = _append(engine, STREAM)
        assert isinstance(refused, RangeSealedError)
        assert "the PM must seal it" in refused.message

        env.fail_next.set()
        assert isinstance(_append(engine, STREAM + 1), ProtocolError)
        after = _append(engine, STREAM + 1)
        assert isinstance(after, AppendResult) and after.base_offset == 0


class _Unreachable:
    """A connection pool whose connections never open."""

    async def get(self, address: str) -> None:
        await trio.sleep_forever()


async def test_a_restarted_primary_fences_the_replicated_ranges_it_led(tmp_path: Path) -> None:
    """Its followers may hold batches its last commit never made durable:
    appends to those ranges are refused until the PM seals them. A range of
    one replica, and a replicated range led by another node, go on."""
    with StorageEngine(tmp_path / "node", node_id=1, map_size=64 << 20) as engine:
        followed = (ReplicaInfo(2, "127.0.0.1:9002", True), *REPLICAS[:1])
        engine.sync_ranges(STREAM, [RangeInfo(STREAM, 0, 0, replicas=REPLICAS)]).result()
        engine.sync_ranges(
            STREAM + 1, [RangeInfo(STREAM + 1, 0, 0, replicas=REPLICAS[:1])]
        ).result()
        engine.sync_ranges(STREAM + 2, [RangeInfo(STREAM + 2, 0, 0, replicas=followed)]).result()

        replicas = ReplicaStates(1, engine, StreamWaiters())
        replicator = Replicator(replicas, None, _Unreachable())  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            await nursery.start(replicator.run)
            nursery.cancel_scope.cancel()

        assert isinstance(_append(engine, STREAM), RangeSealedError)
        assert isinstance(_append(engine, STREAM + 1), AppendResult)
        # a follower here: its appends are refused as they always were
        assert not isinstance(_append(engine, STREAM + 2), AppendResult)


def test_every_append_of_a_transaction_to_a_fenced_range_is_refused(tmp_path: Path) -> None:
    """Several batches of one stream in one transaction (one APPEND carrying
    three, as a Producer packs them): the first refusal must not let the
    others through at the offset the followers may already hold. A chaos
    run found exactly that: a restarted primary refused the first batch of
    a group and wrote the second at the offset its followers held another
    value at."""
    with StorageEngine(tmp_path / "node", node_id=1, map_size=64 << 20) as engine:
        engine.sync_ranges(STREAM, [RangeInfo(STREAM, 0, 0, replicas=REPLICAS)]).result()
        engine.sync_ranges(
            STREAM + 1, [RangeInfo(STREAM + 1, 0, 0, replicas=REPLICAS[:1])]
        ).result()
        assert isinstance(_append(engine, STREAM), AppendResult)
        engine.fence(STREAM, 0)
        done: Future[list[AppendOutcome]] = Future()
        items = [
            AppendItem(STREAM, build_batch([b"a"], 0)),
            AppendItem(STREAM + 1, build_batch([b"b"], 0)),
            AppendItem(STREAM, build_batch([b"c"], 0)),
            AppendItem(STREAM, build_batch([b"d"], 0)),
        ]
        engine.submit(items, done.set_result)
        outcomes = done.result(timeout=10)
        assert [type(o) for o in outcomes] == [
            RangeSealedError,
            AppendResult,
            RangeSealedError,
            RangeSealedError,
        ]
        assert engine.next_offset(STREAM) == 1
