"""Where the readers of the tables (``sbp tables``, ``spark_jobs.read_stream``)
find the catalog when not told: ``$SBP_CATALOG`` and ``$SBP_WAREHOUSE``, else
those of a local cluster started from this directory (``sbp-cluster`` puts
them under ``var/tables``). No pyiceberg here: the CLI imports this module."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

CATALOG_ENV: Final = "SBP_CATALOG"
WAREHOUSE_ENV: Final = "SBP_WAREHOUSE"


def local_tables(data_dir: Path) -> tuple[str, str]:
    """The catalog URI and warehouse of the tables a local cluster keeps
    under ``DATA_DIR/tables``."""
    tables = data_dir / "tables"
    return f"sqlite:///{tables / 'catalog.db'}", str(tables / "warehouse")


LOCAL_CATALOG, LOCAL_WAREHOUSE = local_tables(Path("var"))


def default_catalog() -> str:
    return os.environ.get(CATALOG_ENV, LOCAL_CATALOG)


def default_warehouse() -> str:
    return os.environ.get(WAREHOUSE_ENV, LOCAL_WAREHOUSE)
