"""``load_files``: text or JSON-lines files into a stream, one record per line.

    python -m spark_jobs.load_files --pm 127.0.0.1:7400 --stream 1 logs/*.txt
    python -m spark_jobs.load_files --pm 127.0.0.1:7400 --create-stream --format jsonl a.jsonl

With ``--format jsonl`` blank lines are skipped and a line that is not JSON
fails the job; each record is the line as written. By default the files are
appended by one task, in the order given and line by line; ``--parallel``
lets several tasks append at once (faster; order kept only within a task).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import reduce
from typing import TYPE_CHECKING

from client.sync import SyncClient
from spark_jobs.cli import Progress, job_parser
from spark_jobs.layout import stream_layouts
from spark_jobs.session import spark_session

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def _create_stream(pm: str, replicas: int) -> int:
    with SyncClient(pm) as client:
        return int(client.create_stream(replicas).stream_id)


def _stream_end(pm: str, stream_id: int) -> int:
    return stream_layouts(pm, [stream_id])[stream_id].next_offset


def _lines(spark: SparkSession, paths: Sequence[str], file_format: str) -> DataFrame:
    from pyspark.sql import functions as F

    # One read per file, unioned in argument order: a single read of all of
    # them would order its splits by size, not as given.
    df = reduce(lambda a, b: a.union(b), [spark.read.text(path) for path in paths])
    if file_format == "jsonl":
        df = df.where(F.trim("value") != "")
        df = df.select(
            F.when(
                F.try_parse_json("value").isNull(),
                F.raise_error(F.concat(F.lit("load_files: a line is not JSON: "), "value")),
            )
            .otherwise(F.col("value"))
            .alias("value")
        )
    return df


def main(argv: Sequence[str] | None = None) -> int:
    parser = job_parser(
        "spark_jobs.load_files",
        "Append text or JSON-lines files to a stream, one record per line.",
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--stream", type=int, help="the stream to append to")
    target.add_argument(
        "--create-stream", action="store_true", help="create a new stream and append to it"
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="replicas of a stream --create-stream makes"
    )
    parser.add_argument("--format", choices=("text", "jsonl"), default="text")
    parser.add_argument(
        "--parallel",
        action="store_true",
        help="append with several tasks at once (order kept only within each task)",
    )
    parser.add_argument("paths", nargs="+", help="files (or directories) to load")
    args = parser.parse_args(argv)
    progress = Progress("load_files")
    stream_id = args.stream
    if args.create_stream:
        stream_id = _create_stream(args.pm, args.replicas)
        progress(f"created stream {stream_id}")
    before = _stream_end(args.pm, stream_id)
    progress("starting Spark")
    spark = spark_session("sbp-load-files", master=args.master)
    df = _lines(spark, args.paths, args.format)
    if not args.parallel:
        df = df.coalesce(1)
    progress(f"appending {len(args.paths)} file(s) to stream {stream_id} at offset {before}")
    (
        df.write.format("sbp")
        .mode("append")
        .option("pm", args.pm)
        .option("stream", str(stream_id))
        .save()
    )
    after = _stream_end(args.pm, stream_id)
    print(f"stream {stream_id}: appended offsets [{before}, {after})", flush=True)
    progress("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
