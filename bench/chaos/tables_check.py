"""With ``--tables``: each stream's Iceberg table (SPEC §16) against the
stream as read back at the end. The table must reach the stream's end and
hold every stored offset once, with the stream's value; an offset below a
trim may be in the table only (it was tabled before the trim), and on
compacted streams an offset the stream no longer holds may be too (it was
tabled before compaction removed it). Each break is a ``table`` violation
of the run's verdict."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import trio

from tables.catalog import end_offset, load_table, open_catalog
from tables.defaults import local_tables

from .checker import StoredStream, Verdict
from .history import History

#: how long the tables get to reach the streams' ends once the faults are healed
TABLES_SETTLE_S = 60.0


def _read_table(root: Path, stream_id: int) -> tuple[int, list[tuple[int, bytes]]]:
    """(end offset, rows as (offset, value)) of the stream's table."""
    catalog = open_catalog(*local_tables(root))
    table = load_table(catalog, stream_id)
    if table is None:
        return 0, []
    rows = table.scan(selected_fields=("offset", "value")).to_arrow()
    offsets = rows.column("offset").to_pylist()
    values = rows.column("value").to_pylist()
    return end_offset(table) or 0, list(zip(offsets, values, strict=True))


async def read_tables(
    root: Path, stored: list[StoredStream], timeout: float = TABLES_SETTLE_S
) -> dict[int, tuple[int, list[tuple[int, bytes]]]]:
    """Each stream's table once it reaches the stream's end (or as it is
    when ``timeout`` runs out)."""
    found: dict[int, tuple[int, list[tuple[int, bytes]]]] = {}
    deadline = trio.current_time() + timeout
    for stream in stored:
        end = stream.records[-1][0] + 1 if stream.records else 0
        while True:
            found[stream.stream_id] = await trio.to_thread.run_sync(
                _read_table, root, stream.stream_id
            )
            if found[stream.stream_id][0] >= end or trio.current_time() >= deadline:
                break
            await trio.sleep(0.5)
    return found


def check_tables(
    verdict: Verdict,
    history: History,
    stored: list[StoredStream],
    tables: dict[int, tuple[int, list[tuple[int, bytes]]]],
) -> None:
    for stream in stored:
        if stream.read_error:
            continue
        sid = stream.stream_id
        table_end, rows = tables.get(sid, (0, []))
        at = dict(stream.records)
        end = stream.records[-1][0] + 1 if stream.records else 0
        if table_end < end:
            verdict.add("table", f"stream {sid}: the table ends at {table_end}, not {end}")
        counts = Counter(offset for offset, _ in rows)
        for offset, times in counts.items():
            if times > 1:
                verdict.add("table", f"stream {sid} offset {offset}: {times} rows in the table")
        trimmed_to = history.trimmed_to.get(sid, 0)
        for offset, value in rows:
            if offset in at:
                if at[offset] != value:
                    verdict.add("table", f"stream {sid} offset {offset}: another value")
            elif offset >= trimmed_to and not history.compacted_keys:
                verdict.add("table", f"stream {sid} offset {offset}: not in the stream")
        for offset in at:
            if offset < table_end and offset not in counts:
                verdict.add("table", f"stream {sid} offset {offset}: missing from the table")
