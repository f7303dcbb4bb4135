"""Reading a tabled stream (SPEC §16) at Parquet speed: its history from
its Iceberg table through Spark's own Parquet reader, the records past the
table's ``sbp.end-offset`` from the stream through the ``sbp`` source, as
one DataFrame with the source's schema.

Reading an Iceberg table's data files directly is correct when its
snapshot has no delete files: the table of a stream is only ever appended
to (``sbp-tables`` adds rows and never deletes or rewrites them), and
``read_stream`` checks each snapshot's plan for delete files and refuses a
table that has any. Each record appears once: the files hold exactly the
offsets below ``sbp.end-offset``, the source reads from there on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spark_jobs.layout import stream_layouts
from spark_jobs.options import parse_tls
from tables.catalog import end_offset, load_table, open_catalog
from tables.defaults import default_catalog, default_warehouse

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: the sbp source's columns, in its order
COLUMNS = ("stream_id", "offset", "timestamp", "key", "value")


class TableWithDeletesError(ValueError):
    """A table whose snapshot has delete files: not a plain append-only table."""


def read_stream(
    spark: SparkSession,
    *,
    pm: str,
    streams: Sequence[int],
    catalog: str | None = None,
    warehouse: str | None = None,
    include_headers: bool = False,
    **options: str,
) -> DataFrame:
    """Every record of ``streams`` (see the module docstring), from the
    catalog and warehouse ``sbp-tables`` writes to (by default
    ``$SBP_CATALOG`` and ``$SBP_WAREHOUSE``, else a local cluster's); ``options``
    go to the ``sbp`` source for the part past the tables (its
    ``endingOffsets`` included: the table part is the tables' snapshots)."""
    columns = [*COLUMNS, "headers"] if include_headers else list(COLUMNS)
    tables = open_catalog(catalog or default_catalog(), warehouse or default_warehouse())
    starting: dict[str, int] = {}
    files: list[str] = []
    for stream_id in streams:
        table = load_table(tables, stream_id)
        end = None if table is None else end_offset(table)
        if table is None or end is None:
            starting[str(stream_id)] = -2  # no commit yet: all from the stream
            continue
        tasks = list(table.scan().plan_files())
        if any(task.delete_files for task in tasks):
            raise TableWithDeletesError(
                f"the table of stream {stream_id} has delete files: read it with an Iceberg "
                "engine, or read the stream with the sbp source"
            )
        files += [task.file.file_path for task in tasks]
        starting[str(stream_id)] = end
    if "endingOffsets" not in options:
        # The streams' ends now: a stream whose table reaches its end needs
        # no source (whose planning alone costs a Python worker's round trip).
        layouts = stream_layouts(pm, streams, tls=parse_tls(options))
        ends = {str(s): layouts[s].next_offset for s in streams}
        starting = {
            s: start
            for s, start in starting.items()
            if ends[s] > max(start, layouts[int(s)].first_offset)
        }
        if files and not starting:
            return _history(spark, files, columns)
        options = {**options, "endingOffsets": json.dumps({s: ends[s] for s in starting})}
    source_options: dict[str, Any] = {
        "pm": pm,
        "streams": ",".join(starting) if starting else ",".join(str(s) for s in streams),
        "startingOffsets": json.dumps(starting),
        **({"includeHeaders": "true"} if include_headers else {}),
        **options,
    }
    rest = spark.read.format("sbp").options(**source_options).load().select(*columns)
    if not files:
        return rest
    return _history(spark, files, columns).unionByName(rest)


def _history(spark: SparkSession, files: list[str], columns: list[str]) -> DataFrame:
    """The tables' rows, from their Parquet files, in the source's columns."""
    from pyspark.sql import functions as F

    return spark.read.parquet(*files).select(
        *[
            # the table's timestamp is a UTC time without a zone (SPEC §16);
            # the session reads it in UTC
            F.col(name).cast("timestamp") if name == "timestamp" else F.col(name)
            for name in columns
        ]
    )
