"""``sbp-tables`` / ``python -m tables``: keep tabled streams as Iceberg tables."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import trio

from net.service import ServiceError, configure_logging, run_main

from .catalog import CatalogError
from .config import PROG, parse_config
from .service import run_tables


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, keep the tables until SIGTERM/SIGINT; the exit code."""

    def body() -> int:
        config = parse_config(argv)
        configure_logging(config.log_level)
        try:
            return trio.run(run_tables, config)
        except CatalogError as error:
            raise ServiceError(str(error)) from None

    return run_main(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
