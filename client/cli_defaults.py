"""The command line's defaults and exit codes, in a module of their own so
that parsing the command line (and ``sbp --help``) loads nothing else."""

from __future__ import annotations

from typing import Final

DEFAULT_PM: Final = "127.0.0.1:7400"
#: where ``sbp-cluster --tls`` keeps the local cluster's CA and certificates
#: (under its default data directory); the CLI uses them when told no others
LOCAL_PKI: Final = "var/pki"
DEFAULT_TIMEOUT_S: Final = 10.0

EXIT_OK: Final = 0
EXIT_SERVER_ERROR: Final = 1
EXIT_USAGE: Final = 2
EXIT_CONNECT: Final = 3
EXIT_TIMEOUT: Final = 4
EXIT_INTERRUPTED: Final = 130
