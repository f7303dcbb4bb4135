"""A table's upkeep (SPEC §16): small data files rewritten as larger ones,
then old snapshots expired, so that a table committed every few seconds
stays quick to plan and to read.

A stream committed every ``table_interval_ms`` adds a file per commit (and
per day partition); at a low rate those are small. ``rewrite_small_files``
reads a partition's small files and writes their rows back, in offset
order, as one file, in one ``overwrite`` snapshot that carries the table's
``sbp.end-offset`` unchanged: the rows a reader sees are the same before
and after. It is made on the snapshot the writer last saw, with rebasing
retries off (``tables.catalog``), so it cannot cross a commit of another
writer. ``expire_snapshots`` then drops the snapshots older than an hour
(those replaced over an hour ago); the files only they named are left to
``tables.sweep``, which deletes them once no reader can still be at them.
Neither writes a delete file, so the table stays one that
``spark_jobs.read_stream`` reads directly.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Final

from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io.pyarrow import ArrowScan, _dataframe_to_data_files
from pyiceberg.table import FileScanTask, Table

from .catalog import ARROW_SCHEMA, END_OFFSET, end_offset

log = logging.getLogger(__name__)

#: a file under this share of the target size is small
SMALL_SHARE: Final = 0.25
#: a partition's small files are rewritten once there are this many
MIN_SMALL_FILES: Final = 8
#: snapshots younger than this are kept (a reader may be planning on one)
SNAPSHOT_KEEP_S: Final = 3600.0


@dataclass(frozen=True, slots=True)
class Rewritten:
    """What one rewrite did: files read and written, rows moved."""

    files_in: int
    files_out: int
    rows: int


def rewrite_small_files(
    table: Table, target_bytes: int, min_files: int = MIN_SMALL_FILES
) -> Rewritten | None:
    """Rewrite each partition's small files (at least ``min_files`` of them,
    and at most ``target_bytes`` of them at a time) as one file; None when
    no partition has enough. Raises what the commit raises (the table moved
    on, or the catalog is down): nothing is changed then."""
    end = end_offset(table)
    if end is None:
        return None
    groups = _small_file_groups(table, int(target_bytes * SMALL_SHARE), target_bytes, min_files)
    if not groups:
        return None
    scan = ArrowScan(table.metadata, table.io, table.schema(), AlwaysTrue())
    files_in = files_out = rows = 0
    with (
        table.transaction() as transaction,
        transaction.update_snapshot(
            snapshot_properties={END_OFFSET: str(end)}
        ).overwrite() as rewrite,
    ):
        for tasks in groups:
            data = scan.to_table(tasks).sort_by("offset").cast(ARROW_SCHEMA)
            for task in tasks:
                rewrite.delete_data_file(task.file)
            for data_file in _dataframe_to_data_files(
                table_metadata=transaction.table_metadata,
                df=data,
                io=table.io,
                write_uuid=rewrite.commit_uuid,
            ):
                rewrite.append_data_file(data_file)
                files_out += 1
            files_in += len(tasks)
            rows += data.num_rows
    log.info(
        "%s: rewrote %d small data files as %d (%d rows)", table.name(), files_in, files_out, rows
    )
    return Rewritten(files_in, files_out, rows)


def _small_file_groups(
    table: Table, small_bytes: int, target_bytes: int, min_files: int
) -> list[list[FileScanTask]]:
    """Per partition, runs of small files of at most ``target_bytes``
    together, each of at least ``min_files``."""
    by_partition: defaultdict[tuple[object, ...], list[FileScanTask]] = defaultdict(list)
    for task in table.scan().plan_files():
        if task.file.file_size_in_bytes < small_bytes:
            partition = task.file.partition
            by_partition[tuple(partition[i] for i in range(len(partition)))].append(task)
    groups = []
    for tasks in by_partition.values():
        tasks.sort(key=lambda task: task.file.file_size_in_bytes)
        group: list[FileScanTask] = []
        size = 0
        for task in tasks:
            if group and size + task.file.file_size_in_bytes > target_bytes:
                if len(group) >= min_files:
                    groups.append(group)
                group, size = [], 0
            group.append(task)
            size += task.file.file_size_in_bytes
        if len(group) >= min_files:
            groups.append(group)
    return groups


def expire_snapshots(table: Table, keep_s: float = SNAPSHOT_KEEP_S) -> int:
    """Drop the snapshots that stopped being the current one (a later one
    was committed) over ``keep_s`` ago; how many were dropped. A reader
    plans on the current snapshot, so one that planned on a dropped one
    began over ``keep_s`` ago."""
    cutoff_ms = (time.time() - keep_s) * 1000
    history = sorted(table.snapshots(), key=lambda snapshot: snapshot.timestamp_ms)
    old = [
        snapshot.snapshot_id
        for snapshot, successor in itertools.pairwise(history)
        if successor.timestamp_ms < cutoff_ms
    ]
    if old:
        table.maintenance.expire_snapshots().by_ids(old).commit()
        log.info("%s: expired %d snapshots", table.name(), len(old))
    return len(old)
