"""Crash safety: a process appending with sync always is killed with SIGKILL at
random moments, again and again. After each restart every acknowledged append
is there with its offset and bytes, nothing unacknowledged is half-visible,
and appends continue at the right offset."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest

from sbp.batches import batch_spans, build_batch, decode_batches, peek_header
from sbp.errors import StreamDeletedError
from storage import AppendItem, AppendOutcome, AppendResult, ProducerStamp, StorageEngine

from ..eventually import eventually_blocking

STREAM = 1
MAP_SIZE = 256 * 1024 * 1024

# The child appends batches whose base_timestamp is their sequence number, 16
# requests in flight, and prints "offset count sha256(batch[8:])" for each
# append as it is acknowledged (from the writer thread, after the commit).
CHILD = r"""
import hashlib, os, sys, threading
from sbp.batches import build_batch
from storage import AppendItem, RangeInfo, ReplicaInfo, StorageEngine

engine = StorageEngine(sys.argv[1], map_size=int(sys.argv[2]), node_id=1)
if engine.next_offset(1) is None:
    replica = ReplicaInfo(1, "127.0.0.1:1", True)
    engine.sync_ranges(1, [RangeInfo(1, 0, 0, replicas=(replica,))]).result()
seq = engine.stats().stored_batches
in_flight = threading.Semaphore(16)

def make(seq):
    n = 1 + seq % 5
    return build_batch([(b"%d:%d|" % (seq, i)) * (1 + (seq * 7 + i) % 300) for i in range(n)], seq)

def acked(batch):
    def on_done(outcomes):
        result = outcomes[0]
        digest = hashlib.sha256(batch[8:]).hexdigest()
        os.write(1, b"%d %d %s\n" % (result.base_offset, result.record_count, digest.encode()))
        in_flight.release()
    return on_done

os.write(1, b"ready\n")
while True:
    in_flight.acquire()
    batch = make(seq)
    engine.submit([AppendItem(1, batch)], acked(batch))
    seq += 1
"""


def lines_until_killed(
    path: Path,
    rng: random.Random,
    program: str,
    until: Path | None = None,
    longest: float = 0.25,
) -> list[bytes]:
    """Run ``program`` as a child on ``path``, SIGKILL it a random while (up
    to ``longest`` seconds) after it is ready, or once the file ``until``
    exists, and return the lines it printed whole."""
    child = subprocess.Popen(
        [sys.executable, "-c", program, str(path), str(MAP_SIZE)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert child.stdout is not None
    assert child.stdout.readline() == b"ready\n"
    if until is None:
        time.sleep(rng.uniform(0.02, longest))
        child.send_signal(signal.SIGKILL)
        output = child.stdout.read()
    else:
        # read its acknowledgements meanwhile: a full pipe would stop its writer
        chunks: list[bytes] = []
        reader = threading.Thread(target=lambda: chunks.append(child.stdout.read()))  # type: ignore[union-attr]
        reader.start()
        eventually_blocking(until.exists, timeout=30, what=f"the child writing {until.name}")
        child.send_signal(signal.SIGKILL)
        reader.join()
        output = b"".join(chunks)
    child.wait()
    child.stdout.close()
    return output.split(b"\n")[:-1]  # a line cut by the kill is not complete


def run_child_and_kill(
    path: Path, rng: random.Random, program: str = CHILD, until: Path | None = None
) -> list[tuple[int, int, str]]:
    """``lines_until_killed``: the appends the child acknowledged."""
    acks = []
    for line in lines_until_killed(path, rng, program, until):
        offset, count, digest = line.split()
        acks.append((int(offset), int(count), digest.decode()))
    return acks


def acknowledgements_of(payload: bytearray) -> dict[int, tuple[int, str]]:
    """base offset -> (record count, digest) of each stored batch, as the
    child prints them when acknowledged."""
    return {
        peek_header(payload, start).base_offset: (
            peek_header(payload, start).record_count,
            hashlib.sha256(payload[start + 8 : end]).hexdigest(),
        )
        for start, end in batch_spans(payload)
    }


@pytest.mark.slow
def test_acknowledged_appends_survive_sigkill(tmp_path: Path) -> None:
    rng = random.Random(20240611)
    path = tmp_path / "data"
    acknowledged: dict[int, tuple[int, str]] = {}
    total_acks = 0
    for _round in range(20):
        acks = run_child_and_kill(path, rng)
        total_acks += len(acks)
        for offset, count, digest in acks:
            assert offset not in acknowledged, "an offset was handed out twice"
            acknowledged[offset] = (count, digest)

        with StorageEngine(path, map_size=MAP_SIZE, node_id=1) as engine:
            next_offset = engine.next_offset(STREAM)
            assert next_offset is not None
            payload = engine.read(STREAM, 0, 1 << 40) if next_offset else bytearray()
            # every stored batch is whole and valid: nothing half-written is visible
            decoded = decode_batches(payload)
            assert decoded.offsets.tolist() == list(range(next_offset))
            seen: dict[int, tuple[int, str]] = {}
            for sequence, (start, end) in enumerate(batch_spans(payload)):
                header = peek_header(payload, start)
                assert header.base_timestamp == sequence  # no batch lost or reordered
                digest = hashlib.sha256(payload[start + 8 : end]).hexdigest()
                seen[header.base_offset] = (header.record_count, digest)
            # every acknowledged append is there with the same offset and bytes
            for offset, expected in acknowledged.items():
                assert seen.get(offset) == expected
            # unacknowledged appends may have committed; they count as stored from now on
            acknowledged = seen
    assert total_acks > 100


# The same child, with a 300 ms retention period applied every 20 ms on a
# thread of its own while the appends go on.
RETENTION_CHILD = CHILD.replace(
    'os.write(1, b"ready\\n")',
    """engine.set_retentions({1: 300}).result()

def expire():
    import time
    while True:
        engine.expire().result()
        time.sleep(0.02)

threading.Thread(target=expire, daemon=True).start()
os.write(1, b"ready\\n")""",
)


@pytest.mark.slow
def test_retention_under_appends_survives_sigkill(tmp_path: Path) -> None:
    """Killed while retention drops batches under a stream of appends: after
    each restart the stream starts no earlier than before, what it holds is
    whole and dense up to its end, every acknowledged append still there is
    intact, and the period is still set."""
    rng = random.Random(20261124)
    path = tmp_path / "data"
    acknowledged: dict[int, tuple[int, str]] = {}
    first_before = 0
    for _round in range(12):
        acks = run_child_and_kill(path, rng, RETENTION_CHILD)
        acknowledged.update((offset, (count, digest)) for offset, count, digest in acks)
        with StorageEngine(path, map_size=MAP_SIZE, node_id=1) as engine:
            assert engine.retention_periods() == {STREAM: 300}
            first = engine.first_offset(STREAM)
            next_offset = engine.next_offset(STREAM)
            assert first is not None and next_offset is not None
            assert first_before <= first <= next_offset
            first_before = first
            if first == next_offset:
                assert engine.stats().stored_batches == 0
                continue
            payload = engine.read(STREAM, first, 1 << 40)
            # what lies below the first offset no longer counts, freed or not
            # (retention trims at chunk ends: no chunk straddles the first offset)
            assert engine.stats().stored_batches == len(batch_spans(payload))
            assert engine.stats().stored_bytes == len(payload)
            decoded = decode_batches(payload)
            offsets = decoded.offsets.tolist()
            # whole batches, the first holding ``first``, dense to the end
            assert offsets[0] <= first and offsets == list(range(offsets[0], next_offset))
            seen = acknowledgements_of(payload)
            for offset, expected in acknowledged.items():
                if offset >= offsets[0]:
                    assert seen.get(offset) == expected
            acknowledged = seen
    assert first_before > 0  # retention did drop batches along the way


# The same child appending to stream 2, after it first filled stream 1 and
# deleted it: each of its transactions frees some of stream 1's chunks.
DELETED_STREAM_CHILD = CHILD.replace(
    "if engine.next_offset(1) is None:\n"
    '    replica = ReplicaInfo(1, "127.0.0.1:1", True)\n'
    "    engine.sync_ranges(1, [RangeInfo(1, 0, 0, replicas=(replica,))]).result()",
    'replica = ReplicaInfo(1, "127.0.0.1:1", True)\n'
    "if engine.next_offset(2) is None:\n"
    "    engine.sync_ranges(1, [RangeInfo(1, 0, 0, replicas=(replica,))]).result()\n"
    "    for i in range(1000):\n"
    '        engine.append(1, build_batch([b"gone" * 5000], i))\n'
    "    engine.prefetch_chunks(1)\n"
    "    engine.delete_stream(1).result()\n"
    "    engine.sync_ranges(2, [RangeInfo(2, 0, 0, replicas=(replica,))]).result()",
).replace("[AppendItem(1, batch)]", "[AppendItem(2, batch)]")

# The same with three deleted streams, written interleaved: the transactions
# free them in turns (storage.transaction.WriteContext.free_dropped).
DELETED_STREAMS = (1, 3, 4)
DELETED_STREAMS_CHILD = DELETED_STREAM_CHILD.replace(
    "    engine.sync_ranges(1, [RangeInfo(1, 0, 0, replicas=(replica,))]).result()\n"
    "    for i in range(1000):\n"
    '        engine.append(1, build_batch([b"gone" * 5000], i))\n'
    "    engine.prefetch_chunks(1)\n"
    "    engine.delete_stream(1).result()\n",
    f"    for s in {DELETED_STREAMS}:\n"
    "        engine.sync_ranges(s, [RangeInfo(s, 0, 0, replicas=(replica,))]).result()\n"
    "    for i in range(999):\n"
    f'        engine.append({DELETED_STREAMS}[i % 3], build_batch([b"gone" * 5000], i))\n'
    f"    for s in {DELETED_STREAMS}:\n"
    "        engine.prefetch_chunks(s)\n"
    "        engine.delete_stream(s).result()\n",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("child", "deleted"),
    [(DELETED_STREAM_CHILD, (1,)), (DELETED_STREAMS_CHILD, DELETED_STREAMS)],
    ids=["one-stream", "three-streams-in-turns"],
)
def test_freeing_deleted_streams_under_appends_survives_sigkill(
    tmp_path: Path, child: str, deleted: tuple[int, ...]
) -> None:
    """Killed while appends to one stream free deleted streams' chunks: after
    each restart the deleted streams stay deleted and their chunks only go,
    every acknowledged append of the other stream is intact, and the stored
    counters count that stream alone."""
    assert "delete_stream" in child and "AppendItem(2, batch)" in child
    rng = random.Random(20261125)
    path = tmp_path / "data"
    acknowledged: dict[int, tuple[int, str]] = {}
    chunks_left: list[list[int]] = []
    for _round in range(10):
        acks = run_child_and_kill(path, rng, child)
        acknowledged.update((offset, (count, digest)) for offset, count, digest in acks)
        with StorageEngine(path, map_size=MAP_SIZE, node_id=1) as engine:
            for stream_id in deleted:
                with pytest.raises(StreamDeletedError):
                    engine.read(stream_id, 0, 100)
            chunks_left.append([engine.prefetch_chunks(s) for s in deleted])
            next_offset = engine.next_offset(2)
            assert next_offset is not None
            payload = engine.read(2, 0, 1 << 40) if next_offset else bytearray()
            assert decode_batches(payload).offsets.tolist() == list(range(next_offset))
            seen = acknowledgements_of(payload)
            for offset, expected in acknowledged.items():
                assert seen.get(offset) == expected
            acknowledged = seen
            stats = engine.stats()
            assert stats.stored_batches == len(seen)
            assert stats.stored_bytes == len(payload)
    for i in range(len(deleted)):  # each stream's chunks freed, never back
        left = [counts[i] for counts in chunks_left]
        assert left == sorted(left, reverse=True)
    assert sum(chunks_left[-1]) < 999  # the killed appends freed some
    with StorageEngine(path, map_size=MAP_SIZE, node_id=1) as engine:
        engine.append(2, build_batch([b"x" * 500_000], 0)).result()
        assert all(engine.prefetch_chunks(s) == 0 for s in deleted)


# The same child as an idempotent producer (SPEC §10): every batch stamped
# with producer 7, epoch 0, its first record's sequence, which is its offset;
# a restarted child goes on from the sequence the stored state says is next.
PRODUCER_CHILD = CHILD.replace(
    "seq = engine.stats().stored_batches\n",
    "seq = engine.stats().stored_batches\n"
    "from storage import ProducerStamp\n"
    "held = engine.producers(1).get(7)\n"
    "sequence = [held.last.next_sequence if held is not None else 0]\n",
).replace(
    "    engine.submit([AppendItem(1, batch)], acked(batch))\n",
    "    stamp = ProducerStamp(7, 0, sequence[0])\n"
    "    sequence[0] += 1 + seq % 5\n"
    "    engine.submit([AppendItem(1, batch, stamp)], acked(batch))\n",
)


def test_producer_state_is_durable_with_its_batches_through_sigkill(tmp_path: Path) -> None:
    """After each kill the stored stamps and the producer's state agree with
    the batches exactly: each batch's stamp is there with it, the next
    sequence is the next offset, and the last batch sent again is a resend."""
    rng = random.Random(20261127)
    path = tmp_path / "data"
    for _round in range(12):
        acks = run_child_and_kill(path, rng, PRODUCER_CHILD)
        with StorageEngine(path, map_size=MAP_SIZE, node_id=1) as engine:
            next_offset = engine.next_offset(STREAM)
            assert next_offset is not None and next_offset > 0
            payload = engine.read(STREAM, 0, 1 << 40)
            stamps = engine.producer_stamps(STREAM, 0, next_offset)
            spans = list(batch_spans(payload))
            bases = [peek_header(payload, start).base_offset for start, _ in spans]
            assert stamps == {base: ProducerStamp(7, 0, base) for base in bases}
            state = engine.producers(STREAM)[7]
            assert state.last.next_sequence == next_offset
            for offset, _count, _digest in acks:
                assert offset in stamps  # acknowledged: stored with its stamp
            start, end = spans[-1]
            last = bytes(payload[start:end])
            done: Future[list[AppendOutcome]] = Future()
            engine.submit(
                [AppendItem(STREAM, last, ProducerStamp(7, 0, bases[-1]))], done.set_result
            )
            (outcome,) = done.result(10)
            assert isinstance(outcome, AppendResult) and outcome.duplicate
            assert outcome.base_offset == bases[-1]
            assert engine.next_offset(STREAM) == next_offset


# A node that holds a sealed range of stream 1 hears that the range moved to
# node 2 (SPEC §12) while it appends to stream 2: the SYNC_RANGES that drops
# the range's chunks is submitted a random while after the appends start.
MOVE_CHILD = (
    CHILD.replace(
        '    replica = ReplicaInfo(1, "127.0.0.1:1", True)\n'
        "    engine.sync_ranges(1, [RangeInfo(1, 0, 0, replicas=(replica,))]).result()\n",
        '    replica = ReplicaInfo(1, "127.0.0.1:1", True)\n'
        "    engine.sync_ranges(1, [RangeInfo(1, 0, 0, replicas=(replica,))]).result()\n"
        "    for i in range(200):\n"
        '        engine.append(1, build_batch([b"m" * 2000], i)).result()\n'
        "    engine.sync_ranges(1, [RangeInfo(1, 0, 0, 200, replicas=(replica,)),\n"
        "                           RangeInfo(1, 1, 200, replicas=(replica,))]).result()\n"
        "    engine.sync_ranges(2, [RangeInfo(2, 0, 0, replicas=(replica,))]).result()\n",
    )
    .replace(
        'os.write(1, b"ready\\n")\n',
        "import random, time\n"
        "def move():\n"
        "    time.sleep(random.uniform(0.0, 0.2))\n"
        '    here = ReplicaInfo(1, "127.0.0.1:1", True)\n'
        '    there = ReplicaInfo(2, "127.0.0.1:2", True)\n'
        "    engine.sync_ranges(1, [RangeInfo(1, 0, 0, 200, replicas=(there,)),\n"
        "                           RangeInfo(1, 1, 200, replicas=(here,))]).result()\n"
        "    open(os.path.join(sys.argv[1], 'moved'), 'w').close()\n"
        "threading.Thread(target=move, daemon=True).start()\n"
        'os.write(1, b"ready\\n")\n',
    )
    .replace("[AppendItem(1, batch)]", "[AppendItem(2, batch)]")
)


def check_stream_2(
    engine: StorageEngine, acknowledged: dict[int, tuple[int, str]], held: tuple[int, int]
) -> dict[int, tuple[int, str]]:
    """Every acknowledged append of stream 2 is there, and the stored
    counters count stream 2 and what is ``held`` of stream 1's 200-record
    range; returns stream 2's appends as found."""
    next_offset = engine.next_offset(2)
    payload = engine.read(2, 0, 1 << 40) if next_offset else bytearray()
    seen = acknowledgements_of(payload)
    for offset, expected in acknowledged.items():
        assert seen.get(offset) == expected
    stats = engine.stats()
    assert stats.stored_bytes == len(payload) + held[1]
    assert stats.stored_batches == len(seen) + (200 if held[1] else 0)
    return seen


def kill_and_check(
    path: Path,
    rng: random.Random,
    child: str,
    rounds: int,
    marker: str,
    check: Callable[[StorageEngine], tuple[int, int]],
) -> list[tuple[int, int]]:
    """Run ``child`` ``rounds`` times, each killed at random (the last once
    it has written ``marker``); after each restart ``check`` the engine (it
    returns what is held of stream 1's range 0) and every acknowledged
    append of stream 2. Returns what ``check`` returned, round by round."""
    acknowledged: dict[int, tuple[int, str]] = {}
    held_after: list[tuple[int, int]] = []
    for round_index in range(rounds):
        until = path / marker if round_index == rounds - 1 else None
        acks = run_child_and_kill(path, rng, child, until)
        acknowledged.update((offset, (count, digest)) for offset, count, digest in acks)
        with StorageEngine(path, map_size=MAP_SIZE, node_id=1) as engine:
            held = check(engine)
            held_after.append(held)
            acknowledged = check_stream_2(engine, acknowledged, held)
    return held_after


@pytest.mark.slow
def test_a_range_moved_off_the_node_goes_whole_or_not_at_all_through_sigkill(
    tmp_path: Path,
) -> None:
    """Killed around the SYNC_RANGES that moves a sealed range off the node:
    after each restart the range's chunks are all there or all gone (and
    once gone stay gone), the stored counters agree, and every acknowledged
    append of the other stream is intact."""

    def whole_or_gone(engine: StorageEngine) -> tuple[int, int]:
        held = engine.range_holding(1, 0)
        whole = engine.read(1, 0, 1 << 40) if held[0] == 200 else bytearray()
        assert held in ((200, len(whole)), (0, 0)), held
        return held

    # the last child is killed once its move is committed, whatever the load
    held_after = kill_and_check(
        tmp_path / "data", random.Random(20261127), MOVE_CHILD, 8, "moved", whole_or_gone
    )
    moved = [held == (0, 0) for held in held_after]
    assert moved == sorted(moved) and moved[-1]  # once gone, gone; and it went


# A node was placed on sealed range 0 of stream 1 and holds it; answers to
# its own lookups of stream 1 that the PM gave before that (range 0 on node 2
# only) keep arriving while it appends to stream 2.
STALE_LOOKUP_CHILD = MOVE_CHILD.replace(
    "    engine.sync_ranges(1, [RangeInfo(1, 0, 0, 200, replicas=(there,)),\n"
    "                           RangeInfo(1, 1, 200, replicas=(here,))]).result()\n"
    "    open(os.path.join(sys.argv[1], 'moved'), 'w').close()\n",
    "    while True:\n"
    "        engine.learn_ranges(1, [RangeInfo(1, 0, 0, 200, replicas=(there,)),\n"
    "                                RangeInfo(1, 1, 200, replicas=(here,))]).result()\n"
    "        open(os.path.join(sys.argv[1], 'learned'), 'w').close()\n"
    "        time.sleep(0.01)\n",
)


@pytest.mark.slow
def test_an_old_lookup_answer_drops_no_range_through_sigkill(tmp_path: Path) -> None:
    """Killed while old lookup answers are applied again and again: after
    each restart the node still holds the whole range it was placed on, the
    stored counters agree, and every acknowledged append is intact."""
    assert "learn_ranges" in STALE_LOOKUP_CHILD

    def still_whole(engine: StorageEngine) -> tuple[int, int]:
        held = engine.range_holding(1, 0)
        assert held[0] == 200 and held[1] == len(engine.read(1, 0, 1 << 40)), held
        assert [r.range_index for r in engine.list_ranges(1)] == [0, 1]
        return held

    # the last child is killed once old answers were applied
    kill_and_check(
        tmp_path / "data", random.Random(20261128), STALE_LOOKUP_CHILD, 6, "learned", still_whole
    )


# A new replica of sealed range 0 of stream 1, whose start a trim put at 4,
# inside the batch [3, 6), copies it from offset 3 on, 20 batches per
# catch-up, printing how far it holds the range after each one.
TRIMMED_COPY_CHILD = r"""
import os, sys
from sbp.batches import build_batch, stamp_base_offset
from storage import RangeInfo, ReplicaBatch, ReplicaInfo, StorageEngine

engine = StorageEngine(sys.argv[1], map_size=int(sys.argv[2]), node_id=2)
if engine.next_offset(1) is None:
    on = (ReplicaInfo(1, "127.0.0.1:1", True), ReplicaInfo(2, "127.0.0.1:2", False))
    engine.sync_ranges(1, [RangeInfo(1, 0, 4, 30000, replicas=on),
                           RangeInfo(1, 1, 30000, replicas=on)]).result()

def copied(base):
    data = build_batch([b"%d|" % (base + i) * 40 for i in range(3)], base)
    stamp_base_offset(data, base)
    return ReplicaBatch(1, 0, 0, base, data, 3)

os.write(1, b"ready\n")
held = engine.held_end(1, 4, 30000)
while held < 30000:
    base = held - held % 3
    held = engine.catch_up([copied(b) for b in range(base, min(base + 60, 30000), 3)]).result()
    os.write(1, b"%d\n" % held)
"""


@pytest.mark.slow
def test_a_copy_of_a_range_a_trim_cut_mid_batch_survives_sigkill(tmp_path: Path) -> None:
    """Killed while it copies a range whose start is inside a batch: after
    each restart it holds at least what it said it held, from the cut batch
    on without a gap, and it goes on to the range's end."""
    rng = random.Random(20261128)
    path = tmp_path / "data"
    said = 4
    for _round in range(30):
        lines = lines_until_killed(path, rng, TRIMMED_COPY_CHILD, longest=0.12)
        said = max([said, *(int(line) for line in lines if line.isdigit())])
        with StorageEngine(path, map_size=MAP_SIZE, node_id=2) as engine:
            held = engine.held_end(1, 4, 30000)
            assert held >= said
            records = decode_batches(engine.read(1, 4, 1 << 40))
            assert records.offsets.tolist() == list(range(3, held))
            assert all(records.value(i) == b"%d|" % (i + 3) * 40 for i in range(len(records)))
        if held == 30000:
            break
    assert held == 30000
