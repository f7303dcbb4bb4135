"""Tiered storage (SPEC §14): sealed ranges of tiered streams copied to an
S3 object store, and read from it once they leave the data nodes' disks.

``store`` reaches the object store, ``layout`` is the object format, the
data node's side is ``upload`` (one object per sealed range) and
``reader`` with its bounded ``cache``; the PM's side is ``pm.tiering``.
See docs/operations.md#tiered-storage."""
