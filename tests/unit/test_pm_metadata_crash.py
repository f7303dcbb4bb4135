"""Crash safety of the PM's LMDB store: a process committing from 16 tasks
at once, whose commits go together in shared transactions, is killed with
SIGKILL at random moments, again and again. After each kill every commit it
acknowledged is there, and every commit is there whole or not at all."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pm.metadata import MetadataStore

from .test_storage_crash import MAP_SIZE, lines_until_killed

# Each of 16 tasks commits a stream and its range 0 on node <lane>, both in
# one commit, and prints "stream_id lane" once the commit has returned.
CHILD = r"""
import itertools, os, sys, trio
from pm.metadata import MetadataStore
from pm.changes import PutRange, PutStream
from pm.records import RangeRecord, StreamRecord

store = MetadataStore(sys.argv[1], map_size=int(sys.argv[2]))
first = 1 + max((s.stream_id for s in store.streams(limit=1_000_000)), default=0)
ids = itertools.count(first)

async def lane(node_id):
    while True:
        stream_id = next(ids)
        stream = PutStream(StreamRecord(stream_id, 1))
        await store.commit([stream, PutRange(RangeRecord(stream_id, 0, 0, (node_id,)))])
        os.write(1, b"%d %d\n" % (stream_id, node_id))

async def main():
    os.write(1, b"ready\n")
    async with trio.open_nursery() as nursery:
        for node_id in range(1, 17):
            nursery.start_soon(lane, node_id)

trio.run(main)
"""


@pytest.mark.slow
def test_commits_made_together_survive_sigkill_whole(tmp_path: Path) -> None:
    rng = random.Random(20261128)
    acknowledged: dict[int, int] = {}
    for _ in range(10):
        for line in lines_until_killed(tmp_path, rng, CHILD):
            stream_id, node_id = map(int, line.split())
            acknowledged[stream_id] = node_id
        store = MetadataStore(tmp_path, map_size=MAP_SIZE)
        try:
            streams = {s.stream_id for s in store.streams(limit=1_000_000)}
            assert set(acknowledged) <= streams
            for stream_id in streams:
                # the stream and its range went in one commit: both or neither
                [rng0] = store.ranges(stream_id)
                if stream_id in acknowledged:
                    assert rng0.nodes == (acknowledged[stream_id],)
        finally:
            store.close()
    assert len(acknowledged) > 16  # the kills came while it was committing
