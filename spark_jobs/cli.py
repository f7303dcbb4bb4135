"""What the Spark jobs share: common arguments, progress lines, and calls
to the cluster from the driver."""

from __future__ import annotations

import argparse
import sys
import time

from .options import EARLIEST, LATEST


def job_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser with the arguments every job takes (``--pm``, ``--master``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=(
            "Runs as `python -m spark_jobs.<job>` (local[2] unless --master) or with "
            "spark-submit (give PYSPARK_PYTHON the interpreter that has the sbp-streams "
            "package installed)."
        ),
    )
    parser.add_argument("--pm", required=True, help="the placement manager, host:port")
    parser.add_argument(
        "--master", help="Spark master (default: local[2], or spark-submit's --master)"
    )
    return parser


def add_read_arguments(parser: argparse.ArgumentParser) -> None:
    """``--streams``, ``--starting-offsets`` and ``--ending-offsets``."""
    parser.add_argument(
        "--streams", default="all", help="comma-separated stream ids, or 'all' (default)"
    )
    parser.add_argument(
        "--starting-offsets",
        default=EARLIEST,
        help="earliest (default), latest, or JSON like '{\"1\": 100}'",
    )
    parser.add_argument(
        "--ending-offsets",
        default=LATEST,
        help="latest (default), earliest, or JSON like '{\"1\": 200}' (exclusive)",
    )


def read_options(args: argparse.Namespace) -> dict[str, str]:
    """The ``sbp`` source options for a job's read arguments."""
    return {
        "pm": args.pm,
        "streams": args.streams,
        "startingOffsets": args.starting_offsets,
        "endingOffsets": args.ending_offsets,
    }


class Progress:
    """Progress lines on stderr, each with the seconds since the job began;
    results go to stdout."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.started = time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def __call__(self, message: str) -> None:
        print(f"[{self.job} {self.elapsed:6.1f}s] {message}", file=sys.stderr, flush=True)
