"""The SBP client library: ``Producer`` and ``Consumer`` for streams,
``GroupConsumer`` for a member of a consumer group that shares streams, the
blocking ``SyncClient`` facade over them, and the protocol clients
``PMClient`` and ``DataNodeClient`` over the ``net`` connection machinery.
See docs/client.md."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._base import DEFAULT_TIMEOUT, SBPClient
    from .consumer import Consumer, Record
    from .datanode_client import DataNodeClient, FetchedBatches
    from .group_member import GroupConsumer, StreamBatch
    from .pm_client import PMClient
    from .producer import (
        Producer,
        ProducerClosedError,
        RecordHandle,
        RecordsHandle,
        RecordTooLargeError,
    )
    from .sync import SyncClient, SyncConsumer, SyncProducer

#: where each public name lives; imported on first use, so that a server
#: using ``client.retry`` or ``client.pm_client`` does not load the producer,
#: the consumer and numpy with them
_LOCATIONS = {
    "DEFAULT_TIMEOUT": "_base",
    "SBPClient": "_base",
    "Consumer": "consumer",
    "Record": "consumer",
    "DataNodeClient": "datanode_client",
    "FetchedBatches": "datanode_client",
    "GroupConsumer": "group_member",
    "StreamBatch": "group_member",
    "PMClient": "pm_client",
    "Producer": "producer",
    "ProducerClosedError": "producer",
    "RecordHandle": "producer",
    "RecordsHandle": "producer",
    "RecordTooLargeError": "producer",
    "SyncClient": "sync",
    "SyncConsumer": "sync",
    "SyncProducer": "sync",
}


def __getattr__(name: str) -> Any:
    module = _LOCATIONS.get(name)
    if module is None:
        raise AttributeError(f"module 'client' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)


__all__ = [
    "DEFAULT_TIMEOUT",
    "Consumer",
    "DataNodeClient",
    "FetchedBatches",
    "GroupConsumer",
    "PMClient",
    "Producer",
    "ProducerClosedError",
    "Record",
    "RecordHandle",
    "RecordTooLargeError",
    "RecordsHandle",
    "SBPClient",
    "StreamBatch",
    "SyncClient",
    "SyncConsumer",
    "SyncProducer",
]
