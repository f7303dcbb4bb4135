"""Compaction through SIGKILL: a process appends to one stream (acknowledged
appends checked as in test_storage_crash) while it fills a compacted stream
round after round, seals each round's range and compacts every sealed range
by the merged map, and is killed at random. After each restart every range
of the compacted stream is held whole to its end, every record in it is one
that was written, at its own offset, every key's latest record is there
(a tombstone may have gone), the stored counters agree with what is held,
and every acknowledged append of the other stream is intact."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sbp.batches import batch_spans, decode_batches, peek_header
from storage import StorageEngine

from .test_storage_crash import CHILD, MAP_SIZE, acknowledgements_of, run_child_and_kill

#: records per round of the compacted stream (stream 1), over KEYS keys;
#: the record at offset o has key o % KEYS, and is a tombstone when o % 7 == 0
ROUND = 300
KEYS = 97

COMPACTING_CHILD = CHILD.replace(
    "if engine.next_offset(1) is None:\n"
    '    replica = ReplicaInfo(1, "127.0.0.1:1", True)\n'
    "    engine.sync_ranges(1, [RangeInfo(1, 0, 0, replicas=(replica,))]).result()",
    'replica = ReplicaInfo(1, "127.0.0.1:1", True)\n'
    "if engine.next_offset(2) is None:\n"
    "    first = RangeInfo(1, 0, 0, replicas=(replica,))\n"
    "    engine.sync_ranges(1, [first], cleanup_policy=1).result()\n"
    "    engine.sync_ranges(2, [RangeInfo(2, 0, 0, replicas=(replica,))]).result()\n"
    "import numpy as np\n"
    "from sbp.batch_v2 import build_batch_v2\n"
    "from sbp.key_hash import KeyMap\n"
    f"ROUND, KEYS = {ROUND}, {KEYS}\n"
    "def compact_rounds():\n"
    "    while True:\n"
    "        ranges = engine.list_ranges(1)\n"
    "        last, nxt = ranges[-1], engine.next_offset(1)\n"
    "        if nxt == last.start_offset:\n"
    "            offsets = range(nxt, nxt + ROUND)\n"
    "            engine.append(1, build_batch_v2(\n"
    "                [None if o % 7 == 0 else b'v%d' % o * 20 for o in offsets], 1,\n"
    "                keys=[b'k%d' % (o % KEYS) for o in offsets])).result()\n"
    "            nxt += ROUND\n"
    "        # as the PM seals: the open range where it ends, a new one after it\n"
    "        view = [RangeInfo(1, r.range_index, r.start_offset, r.end_offset,\n"
    "                          replicas=(replica,)) for r in ranges[:-1]]\n"
    "        view.append(RangeInfo(1, last.range_index, last.start_offset, nxt,\n"
    "                              replicas=(replica,)))\n"
    "        view.append(RangeInfo(1, last.range_index + 1, nxt, replicas=(replica,)))\n"
    "        engine.sync_ranges(1, view, cleanup_policy=1).result()\n"
    "        sealed = len(view) - 1\n"
    "        found = [engine.range_keys(1, i).keys for i in range(sealed)]\n"
    "        keys = KeyMap.latest(np.concatenate([m.hashes for m in found]),\n"
    "                             np.concatenate([m.offsets for m in found]))\n"
    "        for i in range(sealed):\n"
    "            rewrites = engine.compaction_rewrites(1, i, keys, i < sealed - 2)\n"
    "            engine.apply_compaction(1, i, rewrites).result()\n"
    "        if sealed >= 3:\n"
    "            open(os.path.join(sys.argv[1], 'compacted'), 'w').close()\n"
    "threading.Thread(target=compact_rounds, daemon=True).start()",
).replace("[AppendItem(1, batch)]", "[AppendItem(2, batch)]")


def check_compacted_stream(engine: StorageEngine) -> int:
    """The checks of the module docstring for stream 1; its bytes held."""
    ranges = engine.list_ranges(1)
    sealed = [r for r in ranges if not r.is_open]
    held_bytes = 0
    records: dict[int, tuple[bytes | None, bytes | None]] = {}
    for rng in ranges:
        end = rng.end_offset if not rng.is_open else engine.next_offset(1)
        assert end is not None
        held_end, size = engine.range_holding(1, rng.range_index)
        assert held_end == end, (rng, held_end)
        held_bytes += size
        offset = rng.start_offset
        while offset < end:
            data = engine.read(1, offset, 1 << 20)
            if not data:
                break  # compacted away to the range's end
            decoded = decode_batches(data)
            for i, at in enumerate(decoded.offsets.tolist()):
                records[at] = (decoded.key(i), decoded.value(i))
            last_start, _ = batch_spans(data)[-1]
            offset = peek_header(data, last_start).next_offset
    for at, (key, value) in records.items():
        assert key == b"k%d" % (at % KEYS)
        assert value == (None if at % 7 == 0 else b"v%d" % at * 20)
    sealed_end = sealed[-1].end_offset if sealed else 0
    for latest in range(max(sealed_end - KEYS, 0), sealed_end):
        assert latest in records or latest % 7 == 0, latest
    return held_bytes


@pytest.mark.slow
def test_compaction_under_appends_survives_sigkill(tmp_path: Path) -> None:
    rng = random.Random(20261129)
    path = tmp_path / "data"
    acknowledged: dict[int, tuple[int, str]] = {}
    removed_any = False
    for round_index in range(8):
        until = path / "compacted" if round_index == 7 else None
        acks = run_child_and_kill(path, rng, COMPACTING_CHILD, until)
        acknowledged.update((offset, (count, digest)) for offset, count, digest in acks)
        with StorageEngine(path, map_size=MAP_SIZE, node_id=1) as engine:
            held = check_compacted_stream(engine)
            next_offset = engine.next_offset(2)
            payload = engine.read(2, 0, 1 << 40) if next_offset else bytearray()
            seen = acknowledgements_of(payload)
            for offset, expected in acknowledged.items():
                assert seen.get(offset) == expected
            acknowledged = seen
            stats = engine.stats()
            assert stats.stored_bytes == held + len(payload)
            written = engine.next_offset(1) or 0
            removed_any |= held < written * 40
    assert removed_any
