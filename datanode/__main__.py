"""``sbp-datanode`` / ``python -m datanode``: run one data node."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import trio

from net.service import configure_logging, run_main
from sbp.allocator import keep_freed_memory

from .config import PROG, parse_config
from .server import run_data_node


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, run the node until SIGTERM/SIGINT; the process exit code."""

    def body() -> int:
        config = parse_config(argv)
        configure_logging(config.log_level)
        # FETCH answers are megabytes, each read out of LMDB into a buffer of
        # its own: reuse the pages of the last one (sbp/allocator.py)
        keep_freed_memory()
        return trio.run(run_data_node, config)

    return run_main(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
