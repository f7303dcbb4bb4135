"""``sbp-pm`` / ``python -m pm``: run the placement manager."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import trio

from net.service import configure_logging, run_main

from .config import PROG, parse_config
from .server import run_pm


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, run the PM until SIGTERM/SIGINT; the process exit code.
    ``sbp-pm migrate ...`` copies an LMDB PM's metadata into etcd instead."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["migrate"]:
        from .migrate import main as migrate

        return migrate(args[1:])

    def body() -> int:
        config = parse_config(args)
        configure_logging(config.log_level)
        if config.etcd:
            from .ha import run_pm_on_etcd  # the etcd client is only loaded when used

            return trio.run(run_pm_on_etcd, config)
        return trio.run(run_pm, config)

    return run_main(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
