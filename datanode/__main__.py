"""``sbp-datanode`` / ``python -m datanode``: run one data node."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import trio

from net.service import configure_logging, run_main

from .config import PROG, parse_config
from .server import run_data_node


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, run the node until SIGTERM/SIGINT; the process exit code."""

    def body() -> int:
        config = parse_config(argv)
        configure_logging(config.log_level)
        return trio.run(run_data_node, config)

    return run_main(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
