"""A property of SPEC §7 over real storage engines: whatever the
interleaving of appends on the primary, REPLICATEs to followers, commits,
restarts and a seal by the PM's rule, no acknowledged offset lands above
the sealed end, and once caught up every replica holds the same records
(one value per offset)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from sbp.batches import batch_spans, build_batch, decode_batches, peek_header
from sbp.replication import commit_offset, seal_end
from storage import RangeInfo, ReplicaInfo, StorageEngine, writes

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


def replica_batches(engine: StorageEngine, offset: int, index: int) -> list[writes.ReplicaBatch]:
    data = engine.read(STREAM, offset, 1 << 20)
    items = []
    for start, end in batch_spans(data):
        header = peek_header(data, start)
        view = memoryview(bytes(data[start:end]))
        items.append(
            writes.ReplicaBatch(STREAM, index, 1, header.base_offset, view, header.record_count)
        )
    return items


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
                engine.sync_ranges(STREAM, [range_of(0, 0)])
            primary = engines[NODES[0]]
            acknowledged: dict[int, bytes] = {}
            #: durable on the primary, waiting for the commit offset to pass them
            pending: dict[int, bytes] = {}
            number = 0
            for op, arg in ops:
                if op == "append":
                    values = [f"v{number + i}".encode() for i in range(arg)]
                    number += arg
                    result = primary.append(STREAM, build_batch(values, 1))
                    pending.update(enumerate(values, start=result.base_offset))
                elif op == "replicate":
                    follower = engines[arg]
                    held = follower.next_offset(STREAM) or 0
                    items = replica_batches(primary, held, 0)
                    if items:
                        follower.submit_replicas(items[:1]).result()
                else:
                    engines[arg].close()
                    engines[arg] = StorageEngine(paths[arg], node_id=arg, map_size=MAP)
                    primary = engines[NODES[0]]
                # the primary's commit offset and the records it acknowledges
                offsets = [engines[n].next_offset(STREAM) or 0 for n in NODES]
                committed = commit_offset(offsets, acks)
                for offset in [o for o in pending if o < committed]:
                    acknowledged[offset] = pending.pop(offset)

            # The PM seals with whoever answers, when enough do.
            needed = len(NODES) - acks + 1
            if len(answering) < needed:
                return
            answers = []
            for n in sorted(answering):
                answers.append(engines[n].seal_range(STREAM, 0).end_offset)
            end = seal_end(answers, len(NODES), acks)
            assert all(offset < end for offset in acknowledged)
            for engine in engines.values():
                engine.sync_ranges(STREAM, [range_of(0, 0, end), range_of(1, end)])
            # catch-up from a replica that holds the whole range
            source = next(e for e in engines.values() if e.held_end(STREAM, 0, end) == end)
            for engine in engines.values():
                while engine.held_end(STREAM, 0, end) < end:
                    held = engine.held_end(STREAM, 0, end)
                    items = replica_batches(source, held, 0)
                    engine.submit_command(lambda ctx, i=items: writes.fill(ctx, i)).result()
            contents = [records(engine, 0, end) for engine in engines.values()]
            assert contents[0] == contents[1] == contents[2]
            assert [offset for offset, _ in contents[0]] == list(range(end))
            stored = dict(contents[0])
            assert all(stored[offset] == value for offset, value in acknowledged.items())
        finally:
            for engine in engines.values():
                engine.close()
