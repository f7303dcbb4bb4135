"""PySpark over SBP streams: the ``sbp`` data source (``spark_jobs.source``),
the jobs, and ``read_stream`` for tabled streams (docs/spark.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


def read_stream(spark: Any, **options: Any) -> DataFrame:
    """``spark_jobs.tables.read_stream``: a tabled stream's history from its
    Iceberg table at Parquet speed, the rest from the stream. Imported on use,
    so that the source needs no pyiceberg."""
    from .tables import read_stream as read

    return read(spark, **options)
