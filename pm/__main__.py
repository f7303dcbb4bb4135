"""``sbp-pm`` / ``python -m pm``: run the placement manager."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import trio

from net.service import configure_logging, run_main

from .config import PROG, parse_config
from .server import run_pm


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, run the PM until SIGTERM/SIGINT; the process exit code."""

    def body() -> int:
        config = parse_config(argv)
        configure_logging(config.log_level)
        return trio.run(run_pm, config)

    return run_main(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
