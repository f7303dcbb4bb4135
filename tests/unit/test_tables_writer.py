"""A table writer over a real SQL catalog in a temporary directory (SPEC
§16): it resumes from the table's ``sbp.end-offset``, a commit that meets a
newer snapshot adds nothing twice (a zombie's, or a lost answer's), and the
sweep deletes only the data files no snapshot names."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException

from sbp.batch_v2 import build_batch_v2
from sbp.batches import DecodedRecords, decode_batches, stamp_base_offset
from tables.catalog import END_OFFSET, end_offset, load_or_create_table, open_catalog
from tables.maintenance import expire_snapshots, rewrite_small_files
from tables.sweep import sweep
from tables.writer import TableWriter


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    return open_catalog(f"sqlite:///{tmp_path}/catalog.db", str(tmp_path / "warehouse"))


def records(first: int, count: int) -> DecodedRecords:
    batch = build_batch_v2(
        [b"v%d" % i for i in range(first, first + count)],
        1_795_000_000_000,
        keys=[b"k%d" % (i % 3) for i in range(first, first + count)],
        headers=[[("n", b"%d" % i)] for i in range(count)],
    )
    stamp_base_offset(batch, first)
    return decode_batches(bytes(batch))


def offsets_in(catalog: Catalog, stream_id: int) -> list[int]:
    table = load_or_create_table(catalog, stream_id)
    return sorted(table.scan(selected_fields=("offset",)).to_arrow().column("offset").to_pylist())


def commit(writer: TableWriter) -> None:
    taken = writer.take()
    assert taken is not None
    writer.commit(taken)


def test_a_writer_resumes_from_the_tables_end(catalog: Catalog) -> None:
    first = TableWriter(catalog, 1, interval_s=1)
    assert first.open() is None  # a new table: from the stream's start
    first.add(records(0, 10))
    commit(first)
    again = TableWriter(catalog, 1, interval_s=1)
    assert again.open() == 10
    again.add(records(5, 10))  # what it reads from 10 on may come in a batch from 5
    commit(again)
    assert offsets_in(catalog, 1) == list(range(15))
    table = load_or_create_table(catalog, 1)
    assert end_offset(table) == 15
    snapshot = table.current_snapshot()
    assert snapshot is not None and snapshot.summary is not None
    assert snapshot.summary.additional_properties[END_OFFSET] == "15"


def test_a_commit_behind_the_table_adds_nothing_twice(catalog: Catalog) -> None:
    """A zombie that opened the table at 0 commits after another writer
    took the stream and committed up to 20: its commit fails, it drops what
    the table holds and commits only what lies past it."""
    zombie = TableWriter(catalog, 2, interval_s=1)
    zombie.open()
    successor = TableWriter(catalog, 2, interval_s=1)
    successor.open()
    successor.add(records(0, 20))
    commit(successor)
    zombie.add(records(0, 25))
    taken = zombie.take()
    assert taken is not None
    with pytest.raises(Exception, match=r"(?i)commit|requirement|update"):
        zombie.commit(taken)
    zombie.give_back(taken)
    assert zombie.end == 20 and zombie.pending_rows == 5
    commit(zombie)
    assert offsets_in(catalog, 2) == list(range(25))


def test_the_sweep_deletes_only_what_no_snapshot_names(catalog: Catalog, tmp_path: Path) -> None:
    writer = TableWriter(catalog, 3, interval_s=1)
    writer.open()
    writer.add(records(0, 5))
    commit(writer)
    table = load_or_create_table(catalog, 3)
    data = tmp_path / "warehouse" / "sbp" / "stream_3" / "data"
    named = [p for p in data.rglob("*.parquet")]
    orphan = named[0].parent / "left-by-a-crash.parquet"
    orphan.write_bytes(named[0].read_bytes())
    young = named[0].parent / "a-commit-under-way.parquet"
    young.write_bytes(b"x")
    old = time.time() - 7200
    os.utime(orphan, (old, old))
    assert sweep(table) == [str(orphan)]
    assert not orphan.exists() and young.exists() and all(p.exists() for p in named)
    assert offsets_in(catalog, 3) == list(range(5))


def test_a_repeated_header_name_keeps_its_last_value(catalog: Catalog) -> None:
    batch = build_batch_v2([b"x"], 1, keys=[b"k"], headers=[[("a", b"1"), ("a", b"2")]])
    stamp_base_offset(batch, 0)
    writer = TableWriter(catalog, 4, interval_s=1)
    writer.open()
    writer.add(decode_batches(bytes(batch)))
    commit(writer)
    rows = load_or_create_table(catalog, 4).scan().to_arrow().to_pylist()
    assert rows[0]["headers"] == [("a", b"2")]


def test_small_files_are_rewritten_and_old_snapshots_expired(
    catalog: Catalog, tmp_path: Path
) -> None:
    writer = TableWriter(catalog, 1, interval_s=1, target_bytes=1 << 20)
    writer.open()
    for first in range(0, 100, 10):  # ten commits, a small file each
        writer.add(records(first, 10))
        commit(writer)
    table = writer.table
    assert table is not None and len(table.inspect.files()) == 10
    done = writer.maintain()
    assert done is not None and (done.files_in, done.files_out, done.rows) == (10, 1, 100)
    table = load_or_create_table(catalog, 1)
    assert end_offset(table) == 100  # the same rows, the same end
    assert offsets_in(catalog, 1) == list(range(100))
    assert len(table.inspect.files()) == 1
    # the writer commits on after it
    writer.add(records(100, 5))
    commit(writer)
    assert offsets_in(catalog, 1) == list(range(105))
    # the snapshots replaced are expired, then their files swept; rows stay
    assert expire_snapshots(writer.table, keep_s=0) == 11
    for path in (tmp_path / "warehouse").rglob("*.parquet"):
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    assert len(sweep(load_or_create_table(catalog, 1))) == 10
    assert offsets_in(catalog, 1) == list(range(105))
    assert writer.maintain() is None  # two files: nothing to rewrite


def test_a_rewrite_behind_the_table_changes_nothing(catalog: Catalog) -> None:
    writer = TableWriter(catalog, 1, interval_s=1, target_bytes=1 << 20)
    writer.open()
    for first in range(0, 80, 10):
        writer.add(records(first, 10))
        commit(writer)
    other = TableWriter(catalog, 1, interval_s=1)
    other.open()
    other.add(records(80, 10))
    commit(other)  # the table moved on since the first writer's view
    with pytest.raises(CommitFailedException):
        rewrite_small_files(writer.table, 1 << 20)
    assert offsets_in(catalog, 1) == list(range(90))
    assert len(load_or_create_table(catalog, 1).inspect.files()) == 9
