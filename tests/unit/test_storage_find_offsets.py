"""FIND_OFFSETS in storage (SPEC §11): append times never go backwards within
a range, even across a restart with the wall clock set back, and the first
offset appended at or after a time is found from the index."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbp.batches import build_batch
from sbp.errors import RangeNotFoundError, StreamDeletedError
from storage import AppendResult, StorageEngine
from storage.model import RangeInfo, ReplicaInfo

ONE = (ReplicaInfo(1, "a:1", True),)


def _append(engine: StorageEngine, count: int) -> AppendResult:
    return engine.append(1, build_batch([b"v"] * count, 1)).result()


def test_the_first_offset_at_or_after_a_time_is_found(tmp_path: Path) -> None:
    clock = [1000]
    with StorageEngine(tmp_path, map_size=64 << 20, node_id=1, clock=lambda: clock[0]) as engine:
        engine.sync_ranges(1, [RangeInfo(1, 0, 0, replicas=ONE)]).result()
        for step in range(10):  # offsets 3k .. 3k+2 appended at 1000 + 10k
            clock[0] = 1000 + 10 * step
            assert _append(engine, 3).append_time_ms == clock[0]
        assert engine.find_offset(1, 0, 0) == (0, 1000)
        assert engine.find_offset(1, 0, 1000) == (0, 1000)
        assert engine.find_offset(1, 0, 1001) == (3, 1010)
        assert engine.find_offset(1, 0, 1055) == (18, 1060)
        assert engine.find_offset(1, 0, 1090) == (27, 1090)
        assert engine.find_offset(1, 0, 1091) == (30, -1)  # none: the next offset
        # a sealed range answers its end; a trim moves the first answer up
        engine.sync_ranges(1, [RangeInfo(1, 0, 0, 30, replicas=ONE)]).result()
        engine.trim(1, 7).result()
        assert engine.find_offset(1, 0, 0) == (7, 1020)
        assert engine.find_offset(1, 0, 5000) == (30, -1)
        with pytest.raises(RangeNotFoundError):
            engine.find_offset(1, 4, 0)
        engine.delete_stream(1).result()
        with pytest.raises(StreamDeletedError):
            engine.find_offset(1, 0, 0)


def test_append_times_never_go_back_across_a_restart(tmp_path: Path) -> None:
    with StorageEngine(tmp_path, map_size=64 << 20, node_id=1, clock=lambda: 50_000) as engine:
        engine.sync_ranges(1, [RangeInfo(1, 0, 0, replicas=ONE)]).result()
        assert _append(engine, 1).append_time_ms == 50_000
    # the wall clock was set back an hour while the node was down
    with StorageEngine(tmp_path, map_size=64 << 20, node_id=1, clock=lambda: 10_000) as engine:
        assert _append(engine, 1).append_time_ms == 50_000
        assert engine.find_offset(1, 0, 50_000) == (0, 50_000)
