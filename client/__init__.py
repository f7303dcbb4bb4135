"""The SBP client library: ``PMClient`` and ``DataNodeClient`` over the
``net`` connection machinery."""

from ._base import DEFAULT_TIMEOUT, SBPClient
from .datanode_client import DataNodeClient, FetchedBatches
from .pm_client import PMClient

__all__ = ["DEFAULT_TIMEOUT", "DataNodeClient", "FetchedBatches", "PMClient", "SBPClient"]
