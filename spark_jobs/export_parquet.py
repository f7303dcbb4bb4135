"""``export_parquet``: streams, or single ranges of them, to Parquet partitioned by stream.

    python -m spark_jobs.export_parquet --pm 127.0.0.1:7400 --streams 1,2 --output out/
    python -m spark_jobs.export_parquet --pm 127.0.0.1:7400 --ranges 1:0,1:1 --output out/

The output holds ``offset, timestamp, value`` in ``stream_id=<id>/`` directories.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from spark_jobs.cli import Progress, add_read_arguments, job_parser, read_options
from spark_jobs.layout import stream_layouts
from spark_jobs.session import spark_session

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def parse_ranges(text: str) -> list[tuple[int, int]]:
    """``STREAM:RANGE_INDEX`` pairs, comma-separated."""
    pairs = []
    for part in text.split(","):
        stream, sep, index = part.strip().partition(":")
        if not sep or not stream.isdigit() or not index.isdigit():
            raise argparse.ArgumentTypeError(
                f"--ranges takes STREAM:RANGE_INDEX pairs like 1:0,1:2; got {part.strip()!r}"
            )
        pairs.append((int(stream), int(index)))
    return pairs


def _range_bounds(pm: str, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(stream_id, start, end)`` of each range; an open one ends at its live end."""
    bounds = []
    layouts = stream_layouts(pm, list(dict.fromkeys(stream_id for stream_id, _ in ranges)))
    for stream_id, index in ranges:
        layout = layouts[stream_id]
        found = [rng for rng in layout.ranges if rng.range_index == index]
        if not found:
            raise SystemExit(f"export_parquet: stream {stream_id} has no range {index}")
        rng = found[0]
        end = layout.next_offset if rng.is_open else rng.end_offset
        bounds.append((stream_id, max(rng.start_offset, layout.first_offset), end))
    return bounds


def _ranges_frame(spark: SparkSession, pm: str, ranges: Sequence[tuple[int, int]]) -> DataFrame:
    frames = []
    for stream_id, start, end in _range_bounds(pm, ranges):
        frames.append(
            spark.read.format("sbp")
            .option("pm", pm)
            .option("streams", str(stream_id))
            .option("startingOffsets", json.dumps({str(stream_id): start}))
            .option("endingOffsets", json.dumps({str(stream_id): end}))
            .load()
        )
    union = frames[0]
    for frame in frames[1:]:
        union = union.unionByName(frame)
    return union


def main(argv: Sequence[str] | None = None) -> int:
    parser = job_parser(
        "spark_jobs.export_parquet",
        "Export streams (or single ranges) to Parquet, partitioned by stream_id.",
    )
    add_read_arguments(parser)
    parser.add_argument(
        "--ranges",
        type=parse_ranges,
        help="export these ranges instead, as STREAM:RANGE_INDEX pairs (e.g. 1:0,1:2)",
    )
    parser.add_argument("--output", required=True, help="directory to write the Parquet files to")
    parser.add_argument(
        "--mode",
        choices=("error", "overwrite", "append"),
        default="error",
        help="when --output exists: fail (default), replace it, or add to it",
    )
    args = parser.parse_args(argv)
    progress = Progress("export_parquet")
    progress("starting Spark")
    spark = spark_session("sbp-export-parquet", master=args.master)
    if args.ranges:
        progress(f"exporting ranges {args.ranges} from {args.pm}")
        df = _ranges_frame(spark, args.pm, args.ranges)
    else:
        progress(f"exporting streams {args.streams} from {args.pm}")
        df = spark.read.format("sbp").options(**read_options(args)).load()
    df.write.mode(args.mode).partitionBy("stream_id").parquet(args.output)
    progress(f"wrote {args.output}; counting what it holds")
    written = spark.read.parquet(args.output).groupBy("stream_id").count().orderBy("stream_id")
    for row in written.collect():
        print(f"stream {row['stream_id']}: {row['count']} records", flush=True)
    progress("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
