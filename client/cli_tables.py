"""``sbp tables``: the streams kept as Iceberg tables (SPEC §16; docs/tables.md).

A tabled stream's table holds every record below its latest snapshot's
``sbp.end-offset``; the lag is what the stream holds past it. The catalog
is opened here with pyiceberg (the ``tables`` extra), read-only.
"""

from __future__ import annotations

from typing import Any

from net.service import UsageError

from . import format as fmt
from ._routing import ClientContext
from .by_time import stream_end
from .cli_commands import Env
from .cli_defaults import EXIT_OK


def _catalog(env: Env) -> Any:
    try:
        from tables.catalog import CatalogError, open_catalog
    except ImportError:
        raise UsageError("sbp tables needs pyiceberg: pip install 'sbp-streams[tables]'") from None
    try:
        return open_catalog(env.args.catalog, env.args.warehouse)
    except CatalogError as error:
        raise UsageError(str(error)) from None


async def _summary(env: Env, catalog: Any, stream_id: int, interval_ms: int) -> dict[str, Any]:
    from tables.catalog import end_offset, load_table, table_name

    table = load_table(catalog, stream_id)
    snapshot = None if table is None else table.current_snapshot()
    summary = (
        {}
        if snapshot is None or snapshot.summary is None
        else snapshot.summary.additional_properties
    )
    end = None if table is None else end_offset(table)
    async with ClientContext(env.pm, env.pool, env.args.timeout) as context:
        stream_next = await stream_end(context, stream_id)
    return {
        "stream_id": stream_id,
        "table": table_name(stream_id),
        "interval_ms": interval_ms,
        "end_offset": end,
        "stream_end": stream_next,
        "lag_records": max(stream_next - (end or 0), 0),
        "last_commit_ms": None if snapshot is None else snapshot.timestamp_ms,
        "rows": int(summary.get("total-records", 0)),
        "files": int(summary.get("total-data-files", 0)),
        "bytes": int(summary.get("total-files-size", 0)),
        "snapshots": 0 if table is None else len(table.snapshots()),
        "location": None if table is None else table.location(),
        "metadata": None if table is None else table.metadata_location,
    }


async def cmd_tables_list(env: Env) -> int:
    """Every stream with a table_interval_ms, its table's end and lag."""
    catalog = _catalog(env)
    rows = [
        await _summary(env, catalog, stream.stream_id, stream.table_interval_ms)
        async for stream in env.pm.list_streams()
        if stream.table_interval_ms > 0
    ]
    if env.json:
        env.emit_json(rows)
        return EXIT_OK
    if not rows:
        env.emit("no stream is kept as a table (sbp streams update STREAM --table-interval 1m)")
        return EXIT_OK
    env.emit(
        fmt.table(
            ["stream", "table", "end offset", "lag", "rows", "files", "last commit"],
            [
                [
                    r["stream_id"],
                    r["table"],
                    "-" if r["end_offset"] is None else f"{r['end_offset']:,}",
                    f"{r['lag_records']:,}",
                    f"{r['rows']:,}",
                    r["files"],
                    "-" if r["last_commit_ms"] is None else fmt.age_text(r["last_commit_ms"]),
                ]
                for r in rows
            ],
        )
    )
    return EXIT_OK


async def cmd_tables_describe(env: Env) -> int:
    """One stream's table: where it is, its end offset, lag, size and snapshots."""
    stream = await env.pm.get_stream(env.args.stream_id)
    if stream.table_interval_ms <= 0:
        raise UsageError(
            f"stream {stream.stream_id} is not kept as a table "
            f"(sbp streams update {stream.stream_id} --table-interval 1m)"
        )
    row = await _summary(env, _catalog(env), stream.stream_id, stream.table_interval_ms)
    if env.json:
        env.emit_json(row)
        return EXIT_OK
    end = "no commit yet" if row["end_offset"] is None else f"{row['end_offset']:,}"
    every = fmt.retention_text(row["interval_ms"])
    size = fmt.size_text(row["bytes"])
    env.emit(
        "\n".join(
            [
                f"table       {row['table']} (committed every {every})",
                f"location    {row['location'] or '-'}",
                f"metadata    {row['metadata'] or '-'}",
                f"end offset  {end} (the stream's end: {row['stream_end']:,}; "
                f"lag {row['lag_records']:,} records)",
                f"rows        {row['rows']:,} in {row['files']} files, {size}",
                f"snapshots   {row['snapshots']}",
            ]
        )
    )
    return EXIT_OK
