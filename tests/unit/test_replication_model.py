"""A property of SPEC §7 over real storage engines: whatever the
interleaving of appends on the primary, REPLICATEs to followers, commits,
restarts and a seal by the PM's rule, no acknowledged offset lands above
the sealed end, and once caught up every replica holds the same records
(one value per offset)."""

from __future__ import annotations

import tempfile
from concurrent.futures import Future
from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st

from sbp.batches import batch_spans, build_batch, decode_batches, peek_header, stamp_base_offset
from sbp.replication import commit_offset, seal_end
from storage import RangeInfo, ReplicaBatch, ReplicaInfo, StorageEngine
from storage.model import AppendItem, AppendOutcome, AppendResult

STREAM = 5
NODES = (1, 2, 3)
MAP = 16 << 20


def replicas() -> tuple[ReplicaInfo, ...]:
    return tuple(ReplicaInfo(n, f"127.0.0.1:{9000 + n}", n == NODES[0]) for n in NODES)


def range_of(index: int, start: int, end: int = -1) -> RangeInfo:
    return RangeInfo(STREAM, index, start, end, replicas=replicas(), epoch=1)


def records(engine: StorageEngine, start: int, end: int) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    offset = start
    while offset < end:
        decoded = decode_batches(engine.read(STREAM, offset, 1 << 20))
        for position, value in zip(decoded.offsets.tolist(), decoded.to_list(), strict=True):
            if offset <= position < end:
                out.append((position, value))
        offset = int(decoded.offsets[-1]) + 1
    return out


def replica_batches(engine: StorageEngine, offset: int, index: int) -> list[ReplicaBatch]:
    data = engine.read(STREAM, offset, 1 << 20)
    items = []
    for start, end in batch_spans(data):
        header = peek_header(data, start)
        view = memoryview(bytes(data[start:end]))
        items.append(ReplicaBatch(STREAM, index, 1, header.base_offset, view, header.record_count))
    return items


def seal_and_check(
    engines: dict[int, StorageEngine],
    acks: int,
    answering: set[int],
    acknowledged: dict[int, bytes],
) -> None:
    """The PM's seal with whoever answers (when enough do), every replica
    caught up from one that holds the whole range; then every acknowledged
    record is below the end, and the replicas hold the same dense records."""
    if len(answering) < len(NODES) - acks + 1:
        return
    answers = [engines[n].seal_range(STREAM, 0).result().end_offset for n in sorted(answering)]
    end = seal_end(answers, len(NODES), acks)
    assert all(offset < end for offset in acknowledged)
    for engine in engines.values():
        engine.sync_ranges(STREAM, [range_of(0, 0, end), range_of(1, end)]).result()
    source = next(e for e in engines.values() if e.held_end(STREAM, 0, end) == end)
    for engine in engines.values():
        while (held := engine.held_end(STREAM, 0, end)) < end:
            items = replica_batches(source, held, 0)
            engine.catch_up(items).result()
            assert engine.held_end(STREAM, 0, end) > held, "the catch-up is stuck"
    contents = [records(engine, 0, end) for engine in engines.values()]
    assert contents[0] == contents[1] == contents[2]
    assert [offset for offset, _ in contents[0]] == list(range(end))
    stored = dict(contents[0])
    assert all(stored[offset] == value for offset, value in acknowledged.items())


operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 3)),
        st.tuples(st.just("replicate"), st.sampled_from(NODES[1:])),
        st.tuples(st.just("restart"), st.sampled_from(NODES)),
    ),
    max_size=25,
)


@settings(max_examples=40, deadline=None)
@given(ops=operations, acks=st.integers(1, 3), answering=st.sets(st.sampled_from(NODES)))
def test_a_seal_keeps_every_acknowledged_record_and_replicas_agree(
    ops: list[tuple[str, int]], acks: int, answering: set[int]
) -> None:
    with tempfile.TemporaryDirectory() as root:
        paths = {n: Path(root, f"node-{n}") for n in NODES}
        engines = {n: StorageEngine(paths[n], node_id=n, map_size=MAP) for n in NODES}
        try:
            for engine in engines.values():
                engine.sync_ranges(STREAM, [range_of(0, 0)]).result()
            primary = engines[NODES[0]]
            acknowledged: dict[int, bytes] = {}
            #: durable on the primary, waiting for the commit offset to pass them
            pending: dict[int, bytes] = {}
            number = 0
            for op, arg in ops:
                if op == "append":
                    values = [f"v{number + i}".encode() for i in range(arg)]
                    number += arg
                    result = primary.append(STREAM, build_batch(values, 1)).result()
                    pending.update(enumerate(values, start=result.base_offset))
                elif op == "replicate":
                    follower = engines[arg]
                    held = follower.next_offset(STREAM) or 0
                    items = replica_batches(primary, held, 0)
                    if items:
                        follower.replicate(items[:1]).result()
                else:
                    engines[arg].close()
                    engines[arg] = StorageEngine(paths[arg], node_id=arg, map_size=MAP)
                    primary = engines[NODES[0]]
                # the primary's commit offset and the records it acknowledges
                offsets = [engines[n].next_offset(STREAM) or 0 for n in NODES]
                committed = commit_offset(offsets, acks)
                for offset in [o for o in pending if o < committed]:
                    acknowledged[offset] = pending.pop(offset)

            seal_and_check(engines, acks, answering, acknowledged)
        finally:
            for engine in engines.values():
                engine.close()


ahead_operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 3)),
        st.tuples(st.just("sync"), st.just(0)),
        st.tuples(st.just("replicate"), st.sampled_from(NODES[1:])),
        st.tuples(st.just("restart"), st.sampled_from(NODES)),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(ops=ahead_operations, acks=st.integers(1, 3), answering=st.sets(st.sampled_from(NODES)))
@example(
    ops=[("append", 1), ("replicate", 3), ("restart", 1), ("append", 1), ("replicate", 2)],
    acks=3,
    answering={2},
)
@example(
    ops=[("append", 1), ("replicate", 3), ("restart", 1), ("append", 2), ("replicate", 2)],
    acks=2,
    answering={1, 2, 3},
)
def test_batches_sent_before_the_primary_synced_them_never_give_one_offset_two_values(
    ops: list[tuple[str, int]], acks: int, answering: set[int]
) -> None:
    """As above, with the primary sending batches it has written but not yet
    made durable ("append" writes one, "sync" makes the oldest durable), as
    the data node does while its fsync runs. A restart of the primary loses
    what it had not synced and fences the range (the data node's rule): its
    later appends are refused before they are written, so an offset a
    follower may hold is never given to another batch, and the seal still
    keeps every acknowledged record with the replicas in agreement. Without
    the fence this fails: append, replicate to node 3, restart node 1,
    append, replicate to node 2 leaves two values at offset 0. Appends to the
    fenced primary go to its engine, several batches in one transaction: a
    fence that refused only the first of them failed the second example."""
    with tempfile.TemporaryDirectory() as root:
        paths = {n: Path(root, f"node-{n}") for n in NODES}
        engines = {n: StorageEngine(paths[n], node_id=n, map_size=MAP) for n in NODES}
        try:
            for engine in engines.values():
                engine.sync_ranges(STREAM, [range_of(0, 0)]).result()
            primary = engines[NODES[0]]
            acknowledged: dict[int, bytes] = {}
            pending: dict[int, bytes] = {}
            #: written on the primary, not durable: (base offset, values, stamped batch)
            unsynced: list[tuple[int, list[bytes], bytearray]] = []
            #: the primary's restart fenced the range: appends go to its engine,
            #: whose fence must refuse them
            fenced = False
            number = 0
            for op, arg in ops:
                durable = primary.next_offset(STREAM) or 0
                if op == "append":
                    values = [f"v{number + i}".encode() for i in range(arg)]
                    number += arg
                    if fenced:
                        # the engine's fence decides, for every batch of one
                        # transaction: none may take an offset a follower holds
                        outcomes: Future[list[AppendOutcome]] = Future()
                        primary.submit(
                            [AppendItem(STREAM, build_batch([value], 1)) for value in values],
                            outcomes.set_result,
                        )
                        for outcome, value in zip(outcomes.result(), values, strict=True):
                            if isinstance(outcome, AppendResult):
                                pending[outcome.base_offset] = value
                    else:
                        base = unsynced[-1][0] + len(unsynced[-1][1]) if unsynced else durable
                        batch = build_batch(values, 1)
                        stamp_base_offset(batch, base)
                        unsynced.append((base, values, batch))
                elif op == "sync" and unsynced:
                    base, values, _ = unsynced.pop(0)
                    result = primary.append(STREAM, build_batch(values, 1)).result()
                    assert result.base_offset == base
                    pending.update(enumerate(values, start=base))
                elif op == "replicate":
                    follower = engines[arg]
                    held = follower.next_offset(STREAM) or 0
                    items = replica_batches(primary, held, 0) if held < durable else []
                    items += [
                        ReplicaBatch(STREAM, 0, 1, base, memoryview(batch), len(values))
                        for base, values, batch in unsynced
                        if base == held
                    ]
                    if items:
                        follower.replicate(items[:1]).result()
                elif op == "restart":
                    engines[arg].close()
                    engines[arg] = StorageEngine(paths[arg], node_id=arg, map_size=MAP)
                    primary = engines[NODES[0]]
                    if arg == NODES[0]:
                        unsynced.clear()  # never durable: lost with the process
                        primary.fence(STREAM, 0)
                        fenced = True
                # never above what the primary holds durably
                offsets = [engines[n].next_offset(STREAM) or 0 for n in NODES]
                committed = min(commit_offset(offsets, acks), offsets[0])
                for offset in [o for o in pending if o < committed]:
                    acknowledged[offset] = pending.pop(offset)

            seal_and_check(engines, acks, answering, acknowledged)
        finally:
            for engine in engines.values():
                engine.close()
