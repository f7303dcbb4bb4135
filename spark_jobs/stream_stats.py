"""``stream_stats``: per stream, its records, bytes, first and last offset and time span.

python -m spark_jobs.stream_stats --pm 127.0.0.1:7400 [--streams 1,2]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from spark_jobs.cli import Progress, add_read_arguments, job_parser, read_options
from spark_jobs.session import spark_session


@dataclass(frozen=True)
class StreamStats:
    stream_id: int
    records: int
    bytes: int
    first_offset: int
    last_offset: int
    first_time: datetime
    last_time: datetime

    @property
    def span_seconds(self) -> float:
        return (self.last_time - self.first_time).total_seconds()


def format_table(stats: Sequence[StreamStats]) -> str:
    header = (
        f"{'stream':>8} {'records':>12} {'bytes':>14} {'first':>12} {'last':>12} "
        f"{'first time':>26} {'span s':>10}"
    )
    lines = [header]
    for s in stats:
        lines.append(
            f"{s.stream_id:>8} {s.records:>12} {s.bytes:>14} {s.first_offset:>12} "
            f"{s.last_offset:>12} {s.first_time.isoformat(sep=' '):>26} {s.span_seconds:>10.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = job_parser(
        "spark_jobs.stream_stats",
        "Per stream: records, bytes of values, first and last offset, and the time span "
        "of the records' timestamps, read through the sbp data source.",
    )
    add_read_arguments(parser)
    args = parser.parse_args(argv)
    progress = Progress("stream_stats")
    progress("starting Spark")
    spark = spark_session("sbp-stream-stats", master=args.master)
    from pyspark.sql import functions as F

    progress(f"reading streams {args.streams} from {args.pm}")
    df = spark.read.format("sbp").options(**read_options(args)).load()
    rows = (
        df.groupBy("stream_id")
        .agg(
            F.count("*").alias("records"),
            F.sum(F.length("value")).alias("bytes"),
            F.min("offset").alias("first_offset"),
            F.max("offset").alias("last_offset"),
            F.min("timestamp").alias("first_time"),
            F.max("timestamp").alias("last_time"),
        )
        .orderBy("stream_id")
        .collect()
    )
    stats = [StreamStats(**row.asDict()) for row in rows]
    progress(f"read {sum(s.records for s in stats)} records of {len(stats)} streams")
    print(format_table(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
