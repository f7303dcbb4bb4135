"""Where the readers of the tables (``sbp tables``, ``spark_jobs.read_stream``)
find the catalog when not told: ``$SBP_CATALOG`` and ``$SBP_WAREHOUSE``, else
those of a local cluster started from this directory (``sbp-cluster`` puts
them under ``var/tables``). No pyiceberg here: the CLI imports this module."""

from __future__ import annotations

import os
from typing import Final

CATALOG_ENV: Final = "SBP_CATALOG"
WAREHOUSE_ENV: Final = "SBP_WAREHOUSE"
LOCAL_CATALOG: Final = "sqlite:///var/tables/catalog.db"
LOCAL_WAREHOUSE: Final = "var/tables/warehouse"


def default_catalog() -> str:
    return os.environ.get(CATALOG_ENV, LOCAL_CATALOG)


def default_warehouse() -> str:
    return os.environ.get(WAREHOUSE_ENV, LOCAL_WAREHOUSE)
