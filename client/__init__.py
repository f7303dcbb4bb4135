"""The SBP client library: ``Producer`` and ``Consumer`` for streams, the
blocking ``SyncClient`` facade over them, and the protocol clients
``PMClient`` and ``DataNodeClient`` over the ``net`` connection machinery.
See docs/client.md."""

from ._base import DEFAULT_TIMEOUT, SBPClient
from .consumer import Consumer, Record
from .datanode_client import DataNodeClient, FetchedBatches
from .pm_client import PMClient
from .producer import (
    Producer,
    ProducerClosedError,
    RecordHandle,
    RecordsHandle,
    RecordTooLargeError,
)
from .sync import SyncClient, SyncConsumer, SyncProducer

__all__ = [
    "DEFAULT_TIMEOUT",
    "Consumer",
    "DataNodeClient",
    "FetchedBatches",
    "PMClient",
    "Producer",
    "ProducerClosedError",
    "Record",
    "RecordHandle",
    "RecordTooLargeError",
    "RecordsHandle",
    "SBPClient",
    "SyncClient",
    "SyncConsumer",
    "SyncProducer",
]
