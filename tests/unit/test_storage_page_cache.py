"""Dropping written pages from the OS page cache behind a window
(storage/page_cache.py): which ranges are advised, when, and that the
engine drives it from its commits."""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path

import pytest

from sbp.batches import build_batch, decode_batches
from storage.engine import StorageEngine
from storage.model import AppendItem, AppendOutcome, AppendResult, RangeInfo, ReplicaInfo
from storage.page_cache import DROP_STEP_BYTES, WrittenPageDropper

MiB = 1024 * 1024


@pytest.fixture
def advice(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """The (offset, length, advice) of every posix_fadvise call, made for real."""
    calls: list[tuple[int, int, int]] = []
    real = os.posix_fadvise

    def record(fd: int, offset: int, length: int, how: int) -> None:
        calls.append((offset, length, how))
        real(fd, offset, length, how)

    monkeypatch.setattr(os, "posix_fadvise", record)
    return calls


def grow(path: Path, size: int) -> None:
    with path.open("r+b" if path.exists() else "wb") as file:
        file.truncate(size)


def dropper_over(tmp_path: Path, window: int, *, synced: bool) -> tuple[Path, WrittenPageDropper]:
    """A 40 MiB data file and a dropper keeping ``window`` bytes of it."""
    data = tmp_path / "data.mdb"
    grow(data, 40 * MiB)
    return data, WrittenPageDropper(data, window, synced=synced)


def test_drops_what_falls_behind_the_window_once_per_step(
    tmp_path: Path, advice: list[tuple[int, int, int]]
) -> None:
    data, dropper = dropper_over(tmp_path, 8 * MiB, synced=True)
    dropper.committed(DROP_STEP_BYTES - 1)
    assert advice == []  # less than a step written: no system call at all
    dropper.committed(1)
    assert advice == [(0, 32 * MiB, os.POSIX_FADV_DONTNEED)]
    grow(data, 72 * MiB)
    dropper.committed(DROP_STEP_BYTES)
    # only what was not dropped before, up to the window behind the new end
    assert advice[1:] == [(32 * MiB, 32 * MiB, os.POSIX_FADV_DONTNEED)]
    dropper.committed(DROP_STEP_BYTES)  # the file did not grow: nothing new to drop
    assert len(advice) == 2
    dropper.close()


def test_unsynced_ranges_are_advised_twice(
    tmp_path: Path, advice: list[tuple[int, int, int]]
) -> None:
    # with sync never the pages may still be dirty when first advised (the
    # kernel then only starts writing them back), so each range is advised
    # again one step later, when they are clean and can be dropped
    data, dropper = dropper_over(tmp_path, 8 * MiB, synced=False)
    dropper.committed(DROP_STEP_BYTES)
    grow(data, 72 * MiB)
    dropper.committed(DROP_STEP_BYTES)
    grow(data, 104 * MiB)
    dropper.committed(DROP_STEP_BYTES)
    assert [(offset, length) for offset, length, _ in advice] == [
        (0, 32 * MiB),
        (0, 64 * MiB),
        (32 * MiB, 64 * MiB),
    ]
    dropper.close()


def test_window_zero_leaves_the_cache_alone(
    tmp_path: Path, advice: list[tuple[int, int, int]]
) -> None:
    _, dropper = dropper_over(tmp_path, 0, synced=True)
    dropper.committed(10 * DROP_STEP_BYTES)
    dropper.close()
    assert advice == []


def test_a_missing_file_is_not_an_error(tmp_path: Path) -> None:
    dropper = WrittenPageDropper(tmp_path / "absent.mdb", 8 * MiB, synced=True)
    dropper.committed(10 * DROP_STEP_BYTES)  # nothing to drop, nothing raised
    dropper.close()


def test_engine_drops_behind_the_window_as_it_commits(
    tmp_path: Path, advice: list[tuple[int, int, int]]
) -> None:
    batch = bytes(build_batch([b"x" * 60_000], 0))
    window = 4 * MiB
    with StorageEngine(
        tmp_path / "data", map_size=1 << 30, node_id=1, page_cache_window=window
    ) as engine:
        engine.sync_ranges(1, [RangeInfo(1, 0, 0, replicas=(ReplicaInfo(1, "n", True),))]).result()
        appended = 0
        while appended * len(batch) < 2 * DROP_STEP_BYTES + MiB:
            done: Future[list[AppendOutcome]] = Future()
            engine.submit([AppendItem(1, batch)] * 16, done.set_result)
            assert all(isinstance(outcome, AppendResult) for outcome in done.result())
            appended += 16
        file_size = (tmp_path / "data" / "data.mdb").stat().st_size
        # every batch reads back intact: dropping is about the cache only
        read = decode_batches(engine.read(1, 0, max_bytes=1 << 30))
        assert read.offsets.tolist() == list(range(appended))
        assert set(read.to_list()) == {b"x" * 60_000}
    assert len(advice) >= 1
    dropped_until = max(offset + length for offset, length, _ in advice)
    assert dropped_until <= file_size - window
    assert dropped_until >= file_size - window - DROP_STEP_BYTES - 2 * MiB


def test_negative_window_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="page_cache_window"):
        StorageEngine(tmp_path / "data", page_cache_window=-1)
