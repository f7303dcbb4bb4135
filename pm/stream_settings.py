"""A stream's settings as CREATE_STREAMS and UPDATE_STREAMS give them:
checked, and merged with the current ones on an update.

The settings of SPEC §3's ``Stream``, and how an update reads each:

=======================  ===================================  ========================
setting                  allowed                              in UPDATE_STREAMS
=======================  ===================================  ========================
replica_nums             1 .. 127                             0 keeps it
ack_nums                 0 (a majority) .. replica_nums        0 keeps it
retention_period_ms      >= 0 (0: forever)                    negative keeps it
retention_bytes          >= 0 (0: no limit)                   0 keeps it, -1 removes it
cleanup_policy           0 delete, 1 compact, 2 both (§13)    as given
min_compaction_lag_ms    >= 0                                 as given
delete_retention_ms      >= 0                                 as given
local_retention_ms       -1 (not tiered) or >= 0 (§14)        as given
table_interval_ms        -1 (no table) or >= 100 (§16)        as given
=======================  ===================================  ========================

The settings of §13 to §16 have defaults that are meaningful values, so an
update cannot tell "unchanged" from "set to the default": it carries them as
they are to be, and a client changes one by sending the stream's current
settings with that one changed (``PMClient.update_stream`` does). A stream is
not both compacted and tiered, and not tiered without an object store.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Final

from sbp.errors import EpochFencedError, InvalidRequestError
from sbp.replication import check_acks

from .records import StreamRecord

MAX_REPLICA_NUMS: Final = 127
CLEANUP_POLICIES: Final = (0, 1, 2)
#: SPEC §16: a table committed more often than this is refused
MIN_TABLE_INTERVAL_MS: Final = 100


def compacted(stream: StreamRecord) -> bool:
    return stream.cleanup_policy in (1, 2)


def tiered(stream: StreamRecord) -> bool:
    return stream.local_retention_ms >= 0


def check_new(spec: StreamRecord, *, object_store: bool) -> None:
    """Refuse a stream to create whose settings are not allowed."""
    _check_replicas(spec.replica_nums)
    if spec.retention_period_ms < 0:
        raise InvalidRequestError(
            f"retention_period_ms must be >= 0, got {spec.retention_period_ms}"
        )
    if spec.retention_bytes < 0:
        raise InvalidRequestError(f"retention_bytes must be >= 0, got {spec.retention_bytes}")
    check_acks(spec.replica_nums, spec.ack_nums)
    _check_later_settings(spec, object_store=object_store)


def updated(current: StreamRecord, spec: StreamRecord, *, object_store: bool) -> StreamRecord:
    """``current`` as UPDATE_STREAMS ``spec`` changes it (see the module
    docstring), checked."""
    replica_nums = spec.replica_nums or current.replica_nums
    _check_replicas(replica_nums)
    retention = (
        current.retention_period_ms if spec.retention_period_ms < 0 else spec.retention_period_ms
    )
    ack_nums = spec.ack_nums or current.ack_nums
    check_acks(replica_nums, ack_nums)
    if spec.retention_bytes < -1:
        raise InvalidRequestError(
            f"retention_bytes must be >= -1 in an update, got {spec.retention_bytes}"
        )
    retention_bytes = {0: current.retention_bytes, -1: 0}.get(
        spec.retention_bytes, spec.retention_bytes
    )
    if spec.epoch < current.epoch:
        raise EpochFencedError(
            f"stream {spec.stream_id} is at epoch {current.epoch}, update names {spec.epoch}"
        )
    new = replace(
        current,
        replica_nums=replica_nums,
        retention_period_ms=retention,
        epoch=spec.epoch,
        ack_nums=ack_nums,
        retention_bytes=retention_bytes,
        cleanup_policy=spec.cleanup_policy,
        min_compaction_lag_ms=spec.min_compaction_lag_ms,
        delete_retention_ms=spec.delete_retention_ms,
        local_retention_ms=spec.local_retention_ms,
        table_interval_ms=spec.table_interval_ms,
    )
    _check_later_settings(new, object_store=object_store)
    return new


def _check_replicas(replica_nums: int) -> None:
    if not 1 <= replica_nums <= MAX_REPLICA_NUMS:
        raise InvalidRequestError(
            f"replica_nums must be 1 to {MAX_REPLICA_NUMS}, got {replica_nums}"
        )


def _check_later_settings(stream: StreamRecord, *, object_store: bool) -> None:
    """The settings of SPEC §13, §14 and §16."""
    if stream.cleanup_policy not in CLEANUP_POLICIES:
        raise InvalidRequestError(
            f"cleanup_policy is 0 (delete), 1 (compact) or 2 (both), not {stream.cleanup_policy}"
        )
    for name in ("min_compaction_lag_ms", "delete_retention_ms"):
        if getattr(stream, name) < 0:
            raise InvalidRequestError(f"{name} must be >= 0, got {getattr(stream, name)}")
    if stream.local_retention_ms < -1:
        raise InvalidRequestError(
            f"local_retention_ms is -1 (not tiered) or >= 0, not {stream.local_retention_ms}"
        )
    if tiered(stream) and compacted(stream):
        raise InvalidRequestError(
            "a stream is not both compacted and tiered (cleanup_policy "
            f"{stream.cleanup_policy}, local_retention_ms {stream.local_retention_ms})"
        )
    if tiered(stream) and not object_store:
        raise InvalidRequestError(
            "a tiered stream (local_retention_ms >= 0) needs an object store; this PM has "
            "none (--object-store)"
        )
    table = stream.table_interval_ms
    if table != -1 and table < MIN_TABLE_INTERVAL_MS:
        raise InvalidRequestError(
            f"table_interval_ms is -1 (no table) or at least {MIN_TABLE_INTERVAL_MS}, not {table}"
        )
