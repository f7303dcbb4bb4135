"""The data node's storage engine: streams, ranges and record batches in LMDB.

No sockets and no event loop here (a test enforces it): the data node adapts
``StorageEngine`` to trio. See docs/storage.md.
"""

from sbp.producer_stamp import ProducerStamp

from .engine import DEFAULT_MAP_SIZE, StorageEngine, SyncMode
from .model import (
    AppendItem,
    AppendOutcome,
    AppendResult,
    Expired,
    RangeInfo,
    ReplicaBatch,
    ReplicaInfo,
    StorageStats,
)

__all__ = [
    "DEFAULT_MAP_SIZE",
    "AppendItem",
    "AppendOutcome",
    "AppendResult",
    "Expired",
    "ProducerStamp",
    "RangeInfo",
    "ReplicaBatch",
    "ReplicaInfo",
    "StorageEngine",
    "StorageStats",
    "SyncMode",
]
