"""Streams as Apache Iceberg tables (SPEC §16): ``sbp-tables`` keeps every
stream with ``table_interval_ms`` > 0 as the table ``sbp.stream_<id>``,
exactly once, through pyiceberg. See docs/tables.md."""
