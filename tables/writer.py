"""One stream's table (SPEC §16): rows gathered from its records, committed
as one snapshot with ``sbp.end-offset``, the next offset the table adds.

Exactly once rests on two things. A writer starts (and starts again, after
any failed commit) from the table's latest ``sbp.end-offset``, dropping
what it holds below it; and a commit is made on the snapshot the writer
last saw and fails if the table moved on meanwhile (pyiceberg's own
rebasing retries are off: ``tables.catalog``), so two writers, a zombie
among them, never both add the same offsets. A commit whose answer was lost
is found in the table when it is read again, and its rows are not sent
twice. Data files written by a commit that did not land belong to no
snapshot; ``tables.sweep`` removes them.

The calls that talk to the catalog or write files block: the service runs
them in worker threads, one at a time per writer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import numpy as np
import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.table import Table

from sbp.batches import DecodedRecords
from spark_jobs.arrow import records_to_arrow

from .catalog import ARROW_SCHEMA, END_OFFSET, end_offset, load_or_create_table, table_name
from .maintenance import Rewritten, expire_snapshots, rewrite_small_files

log = logging.getLogger(__name__)

#: a commit is made once this much is gathered, whatever the interval says
#: (files of 64-256 MiB where the stream's rate allows)
DEFAULT_TARGET_BYTES: Final = 128 << 20


@dataclass(frozen=True, slots=True)
class Taken:
    """Rows taken for one commit, and the end offset it records."""

    batches: list[pa.RecordBatch]
    next_offset: int
    oldest_ms: int | None


@dataclass(frozen=True, slots=True)
class Committed:
    """What a commit added: its rows, their bytes (Arrow), the files."""

    rows: int
    bytes: int
    files: int
    end_offset: int


class TableWriter:
    """See the module docstring."""

    def __init__(
        self,
        catalog: Catalog,
        stream_id: int,
        *,
        interval_s: float,
        target_bytes: int = DEFAULT_TARGET_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.catalog = catalog
        self.stream_id = stream_id
        self.interval_s = interval_s
        self.target_bytes = target_bytes
        self._clock = clock
        self.table: Table | None = None
        #: the next offset the table adds (None: a table with no commit yet)
        self.end: int | None = None
        self._pending: list[pa.RecordBatch] = []
        self.pending_bytes = 0
        self.pending_rows = 0
        #: when the oldest row gathered arrived, and the record time of it (ms)
        self.pending_since: float | None = None
        self.oldest_pending_ms: int | None = None
        #: the offset after the last record gathered
        self.next_offset: int | None = None

    # -- blocking calls (worker threads) ----------------------------------------

    def open(self) -> int | None:
        """Load (or make) the table; the offset to read from (None: the
        stream's first stored offset, for a table with no commit)."""
        self.table = load_or_create_table(self.catalog, self.stream_id)
        self.end = end_offset(self.table)
        return self.end

    def commit(self, taken: Taken) -> Committed:
        """Commit what ``take`` took as one snapshot (see the module
        docstring). On a failure the table is read again (what it holds
        already is then dropped by ``give_back``) and the error raised."""
        assert self.table is not None
        rows = pa.Table.from_batches(taken.batches, schema=ARROW_SCHEMA)
        try:
            self.table.append(rows, snapshot_properties={END_OFFSET: str(taken.next_offset)})
        except Exception:
            self._reread()
            raise
        snapshot = self.table.current_snapshot()
        summary = (
            {}
            if snapshot is None or snapshot.summary is None
            else snapshot.summary.additional_properties
        )
        self.end = taken.next_offset
        return Committed(
            rows.num_rows, rows.nbytes, int(summary.get("added-data-files", 0)), taken.next_offset
        )

    def maintain(self) -> Rewritten | None:
        """Rewrite the table's small files and expire its old snapshots
        (``tables.maintenance``), on the table this writer commits to, so
        that its next commit follows on. On a failure the table is read
        again and the error raised."""
        assert self.table is not None
        try:
            rewritten = rewrite_small_files(self.table, self.target_bytes)
            expire_snapshots(self.table)
        except Exception:
            self._reread()
            raise
        return rewritten

    def _reread(self) -> None:
        """After a failed commit: the table as it is now."""
        try:
            self.table = self.catalog.load_table(table_name(self.stream_id))
        except Exception as error:  # the catalog is down: the next commit tries again
            log.info("stream %d: reading its table again: %s", self.stream_id, error)
            return
        end = end_offset(self.table)
        if end is not None and (self.end is None or end > self.end):
            log.info(
                "stream %d: its table holds records up to offset %d (a commit of another "
                "writer, or of ours whose answer was lost)",
                self.stream_id,
                end,
            )
            self.end = end

    # -- gathering (the event loop) ---------------------------------------------

    def take(self) -> Taken | None:
        """What is gathered, for ``commit`` (in a worker thread: gathering
        goes on meanwhile); None when nothing is."""
        if not self._pending or self.next_offset is None:
            return None
        taken = Taken(self._pending, self.next_offset, self.oldest_pending_ms)
        self._clear()
        return taken

    def give_back(self, taken: Taken) -> None:
        """After a failed commit: what it took goes before what was gathered
        since, less what the table holds already."""
        self._pending = taken.batches + self._pending
        if self.pending_since is None:
            self.pending_since = self._clock()
        self._recount()
        if self.end is not None:
            self._drop_below(self.end)

    def add(self, records: DecodedRecords) -> None:
        """The records' rows, those at or past the table's end."""
        if not len(records):
            return
        batch = records_to_arrow(self.stream_id, records, include_headers=True)
        if self.end is not None and int(records.offsets[0]) < self.end:
            keep = int(np.searchsorted(records.offsets, self.end))
            if keep >= len(records):
                return
            batch = batch.slice(keep)
        batch = batch.cast(ARROW_SCHEMA)
        if self.pending_since is None:
            self.pending_since = self._clock()
            self.oldest_pending_ms = int(batch.column("timestamp")[0].value // 1000)
        self._pending.append(batch)
        self.pending_rows += batch.num_rows
        self.pending_bytes += batch.nbytes
        self.next_offset = int(records.offsets[-1]) + 1

    def due(self) -> bool:
        """Whether what is gathered should be committed now."""
        if self.pending_since is None:
            return False
        waited = self._clock() - self.pending_since
        return waited >= self.interval_s or self.pending_bytes >= self.target_bytes

    def _drop_below(self, end: int) -> None:
        kept: list[pa.RecordBatch] = []
        for batch in self._pending:
            offsets = batch.column("offset").to_numpy()
            start = int(np.searchsorted(offsets, end))
            if start < len(offsets):
                kept.append(batch.slice(start))
        if not kept:
            self._clear()
            return
        self._pending = kept
        self._recount()

    def _recount(self) -> None:
        self.pending_rows = sum(b.num_rows for b in self._pending)
        self.pending_bytes = sum(b.nbytes for b in self._pending)
        self.oldest_pending_ms = int(self._pending[0].column("timestamp")[0].value // 1000)

    def _clear(self) -> None:
        self._pending = []
        self.pending_rows = self.pending_bytes = 0
        self.pending_since = None
        self.oldest_pending_ms = None
