"""The Iceberg catalog and the tables' shape (SPEC §16): ``sbp.stream_<id>``,
one row per record, partitioned by the day of the record's timestamp.

A catalog is ``sqlite:///PATH`` (pyiceberg's SQL catalog, the embedded
default) or ``http(s)://...`` (an Iceberg REST catalog); the warehouse is a
path or a URI where data files go. Every table is made with pyiceberg's
own retries of a commit turned off: a commit that meets a newer snapshot
must fail, not be rebased on it, or the rows it carries would land twice
(``tables.writer``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Final

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NamespaceAlreadyExistsError, NoSuchTableError
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.transforms import DayTransform
from pyiceberg.types import BinaryType, LongType, MapType, NestedField, StringType, TimestampType

NAMESPACE: Final = "sbp"
#: the snapshot summary property naming the next offset the table will add
END_OFFSET: Final = "sbp.end-offset"
#: the stream a table keeps, in its properties
STREAM_PROPERTY: Final = "sbp.stream-id"

SCHEMA: Final = Schema(
    NestedField(1, "stream_id", LongType(), required=True),
    NestedField(2, "offset", LongType(), required=True),
    NestedField(3, "timestamp", TimestampType(), required=True),
    NestedField(4, "key", BinaryType(), required=False),
    NestedField(5, "value", BinaryType(), required=False),
    NestedField(
        6,
        "headers",
        MapType(7, StringType(), 8, BinaryType(), value_required=False),
        required=False,
    ),
)
#: by the day of the record's own timestamp
PARTITION_SPEC: Final = PartitionSpec(
    PartitionField(source_id=3, field_id=1000, transform=DayTransform(), name="timestamp_day")
)
#: the rows' Arrow schema as pyiceberg writes them
ARROW_SCHEMA: Final[pa.Schema] = SCHEMA.as_arrow()
#: a commit that meets a newer snapshot fails (see the module docstring);
#: set on tables made without them too
TABLE_PROPERTIES: Final = {
    "commit.retry.num-retries": "0",
    # a commit every few seconds: manifests merged, old metadata files deleted
    "commit.manifest-merge.enabled": "true",
    "write.metadata.delete-after-commit.enabled": "true",
    "write.metadata.previous-versions-max": "20",
    # files of at most 128 MiB before compression: each is a task of its own
    # for Spark's Parquet reader (whose splits are 128 MiB), so that a
    # table's files share the cores evenly
    "write.target-file-size-bytes": str(128 << 20),
}


class CatalogError(ValueError):
    """A catalog or warehouse that cannot be used (one line for the user)."""


def table_name(stream_id: int) -> str:
    return f"{NAMESPACE}.stream_{stream_id}"


def open_catalog(uri: str, warehouse: str) -> Catalog:
    """The catalog at ``uri``, with the namespace ``sbp`` in it;
    ``CatalogError`` naming what is wrong when it cannot be reached."""
    location = _warehouse_uri(warehouse)
    try:
        if uri.startswith("sqlite:///"):
            from pyiceberg.catalog.sql import SqlCatalog

            Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            catalog: Catalog = SqlCatalog("sbp", uri=uri, warehouse=location)
        elif uri.startswith(("http://", "https://")):
            from pyiceberg.catalog.rest import RestCatalog

            catalog = RestCatalog("sbp", uri=uri, warehouse=location)
        else:
            raise CatalogError(
                f"a catalog is sqlite:///PATH or a REST catalog's http(s)://URL, not {uri!r}"
            )
        with contextlib.suppress(NamespaceAlreadyExistsError):
            catalog.create_namespace(NAMESPACE)
    except CatalogError:
        raise
    except Exception as error:  # pyiceberg and its drivers raise many kinds
        raise CatalogError(f"cannot use the catalog {uri}: {error}") from error
    return catalog


def _warehouse_uri(warehouse: str) -> str:
    if "://" in warehouse:
        return warehouse
    path = Path(warehouse).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path.as_uri()


def load_table(catalog: Catalog, stream_id: int) -> Table | None:
    try:
        return catalog.load_table(table_name(stream_id))
    except NoSuchTableError:
        return None


def load_or_create_table(catalog: Catalog, stream_id: int) -> Table:
    """The stream's table, made the first time (see the module docstring)."""
    table = load_table(catalog, stream_id)
    if table is None:
        properties = {**TABLE_PROPERTIES, STREAM_PROPERTY: str(stream_id)}
        table = catalog.create_table_if_not_exists(
            table_name(stream_id),
            schema=SCHEMA,
            partition_spec=PARTITION_SPEC,
            properties=properties,
        )
    if any(table.properties.get(name) != value for name, value in TABLE_PROPERTIES.items()):
        with table.transaction() as change:
            change.set_properties(TABLE_PROPERTIES)
        table = catalog.load_table(table_name(stream_id))
    return table


def end_offset(table: Table) -> int | None:
    """The next offset the table will add (its latest snapshot's
    ``sbp.end-offset``); None before its first commit."""
    snapshot = table.current_snapshot()
    if snapshot is None:
        return None
    value = snapshot.summary.additional_properties.get(END_OFFSET) if snapshot.summary else None
    return None if value is None else int(value)
