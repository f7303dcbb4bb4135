"""The data node process: storage, the SBP server, the PM link, /metrics, and
the shutdown sequence.

Start-up: lock and open the data directory (a second node on the same
directory is refused), bind /metrics and the SBP listener, print both
addresses, then register with the PM in the background (the node serves
whether or not the PM is reachable).

Shutdown (SIGTERM/SIGINT): GOAWAY on every connection, requests in flight get
up to ``drain_timeout_s`` to finish, connections close, the storage writer
commits what it was given and the environment closes; exit status 0.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Final

import lmdb
import trio

from net.address import format_address
from net.authz import access_control
from net.budget import ByteBudget, ServerBudgets
from net.dirlock import locked_dir
from net.limits import KEEPALIVE_INTERVAL_S, ConnectionLimits
from net.metrics_http import bound_metrics
from net.pool import ConnectionPool
from net.server import Dispatcher, Server
from net.service import (
    EXIT_OK,
    LISTENING_PREFIX,
    METRICS_PREFIX,
    ServiceError,
    ShutdownSignals,
    announce,
    drain_on_signals,
)
from sbp.allocator import TRIM_THRESHOLD, give_back_free_heap
from sbp.enums import Opcode
from storage.engine import StorageEngine

from .config import DataNodeConfig
from .handlers.append import AppendHandler
from .handlers.control import ControlHandlers
from .handlers.fetch import FetchHandler
from .handlers.ranges import RangeHandlers
from .handlers.replicate import ReplicateHandler
from .handlers.streams import StreamHandlers
from .node import DataNode, PMSettings
from .quotas import quotas_from
from .tiered import NodeTiering

logger = logging.getLogger(__name__)

LOCK_FILE: Final = "datanode.lock"
#: how often the node looks whether freed heap should go back to the kernel
GIVE_BACK_INTERVAL_S: Final = 2.0


def node_tiering(config: DataNodeConfig, engine: StorageEngine) -> NodeTiering | None:
    """Copies to the object store and reads from it, when the node has one."""
    if config.object_store is None:
        return None
    return NodeTiering(
        engine,
        config.object_store,
        config.data_dir,
        upload_bytes_per_s=config.max_upload_bytes_per_s,
        cache_bytes=config.object_cache_bytes,
        timeout=config.object_store_timeout_s,
    )


def build_dispatcher(node: DataNode, max_frame_bytes: int) -> Dispatcher:
    """Every opcode a data node serves (SPEC §2); the rest are UNSUPPORTED_OPERATION."""
    dispatcher = Dispatcher("data node")
    ranges = RangeHandlers(node)
    dispatcher.register(Opcode.HEARTBEAT, ControlHandlers(node).heartbeat)
    dispatcher.register_handler(Opcode.APPEND, AppendHandler(node))
    dispatcher.register(Opcode.FETCH, FetchHandler(node, max_frame_bytes))
    dispatcher.register_handler(Opcode.REPLICATE, ReplicateHandler(node))
    dispatcher.register(Opcode.LIST_RANGES, ranges.list_ranges)
    dispatcher.register(Opcode.SEAL_RANGES, ranges.seal_ranges)
    dispatcher.register(Opcode.SYNC_RANGES, ranges.sync_ranges)
    dispatcher.register(Opcode.DESCRIBE_RANGES, ranges.describe_ranges)
    dispatcher.register(Opcode.FIND_OFFSETS, ranges.find_offsets)
    dispatcher.register(Opcode.RANGE_HOLDINGS, ranges.range_holdings)
    dispatcher.register(Opcode.COMPACTION_KEYS, ranges.compaction_keys)
    dispatcher.register(Opcode.COMPACT_RANGES, ranges.compact_ranges)
    dispatcher.register(Opcode.UPLOAD_RANGE, ranges.upload_range)
    streams = StreamHandlers(node)
    dispatcher.register(Opcode.DELETE_STREAMS, streams.delete_streams)
    dispatcher.register(Opcode.PRODUCER_STATE, streams.producer_state)
    return dispatcher


def connection_limits(config: DataNodeConfig) -> ConnectionLimits:
    return ConnectionLimits(
        max_frame_length=config.max_frame_bytes,
        max_concurrent_requests=config.max_in_flight,
        idle_timeout=config.idle_timeout_s,
        keepalive_interval=KEEPALIVE_INTERVAL_S,
        drain_timeout=config.drain_timeout_s,
    )


def locked_data_dir(path: Path) -> contextlib.AbstractContextManager[None]:
    """Hold the node's data directory for as long as it runs (see ``net.dirlock``)."""
    return locked_dir(path, LOCK_FILE, "data node")


def open_engine(config: DataNodeConfig) -> StorageEngine:
    try:
        return StorageEngine(
            config.data_dir,
            map_size=config.map_size,
            sync="always" if config.sync else "never",
            node_id=config.node_id,
            page_cache_window=config.page_cache_window,
            producer_expiry_ms=config.producer_expiry_ms,
        )
    except (OSError, lmdb.Error) as error:
        raise ServiceError(f"cannot open storage in {config.data_dir}: {error}") from None


async def run_data_node(config: DataNodeConfig) -> int:
    """Run the node until SIGTERM/SIGINT; returns the exit status."""
    logger.debug("settings: %s", config)
    with ShutdownSignals() as signals, locked_data_dir(config.data_dir):
        engine = open_engine(config)
        try:
            await _serve(config, engine, signals)
        finally:
            # Commits what the writer still holds; every acknowledged append
            # was durable already.
            engine.close()
        logger.info("data node %d stopped", config.node_id)
        return EXIT_OK


async def _serve(config: DataNodeConfig, engine: StorageEngine, signals: ShutdownSignals) -> None:
    # Links to the PM and to followers speak TLS with this node's certificate.
    pool = ConnectionPool(tls=config.security.client_context())
    pm = None
    if config.pm is not None:
        pm = PMSettings(
            config.pm_address or "",
            heartbeat_interval_s=config.heartbeat_interval_s,
            metrics_interval_s=config.metrics_interval_s,
        )
    node = DataNode(
        config.node_id,
        engine,
        access=access_control(config.security),
        quotas=quotas_from(config.quota_file),
        pool=pool,
        pm=pm,
        data_dir=config.data_dir,
        retention_interval_s=config.retention_interval_s,
        compaction_bytes_per_s=config.compaction_bytes_per_s,
        tiering=node_tiering(config, engine),
    )
    metrics = node.metrics
    server = Server(
        build_dispatcher(node, config.max_frame_bytes),
        limits=connection_limits(config),
        # Without a /metrics endpoint nobody reads the per-frame counters:
        # skip them on the hot path (the counters REPORT_METRICS needs stay).
        observer=metrics.connections if config.metrics_listen is not None else None,
        max_connections=config.max_connections,
        budgets=ServerBudgets.of(config.max_request_bytes, config.max_answer_bytes),
        tls=config.security.server_context(),
    )
    with contextlib.ExitStack() as exits:
        metrics_server = None
        if config.metrics_listen is not None:
            metrics_server = exits.enter_context(
                bound_metrics(config.metrics_listen, metrics.registry, config.security)
            )
        async with pool, trio.open_nursery() as nursery:
            nursery.start_soon(signals.watch)
            nursery.start_soon(_give_back_heap_after_bursts, server.budgets.requests)
            await nursery.start(node.run)
            host, port = await nursery.start(server.serve, *config.listen)
            node.serving_at(format_address(*(config.advertise or (host, port))))
            if metrics_server is not None:
                announce(METRICS_PREFIX, *metrics_server.address)
            announce(LISTENING_PREFIX, host, port)
            logger.info(
                "data node %d serving on %s:%d (advertised as %s), data in %s, sync %s",
                config.node_id,
                host,
                port,
                node.advertise_addr,
                config.data_dir,
                "always" if config.sync else "never",
            )
            await signals.requested.wait()
            node.drain()
            await drain_on_signals(server, signals, config.drain_timeout_s)
            nursery.cancel_scope.cancel()


async def _give_back_heap_after_bursts(requests: ByteBudget) -> None:
    """Once requests held at once (half-sent frames of peers that went away,
    say) have dropped by ``TRIM_THRESHOLD`` or more, hand the freed heap
    beyond what ``sbp.allocator`` keeps for reuse back to the kernel: glibc
    alone keeps all of it resident whenever a live block lies above it."""
    while True:
        await trio.sleep(GIVE_BACK_INTERVAL_S)
        if requests.peak - requests.used >= TRIM_THRESHOLD:
            requests.peak = requests.used
            await trio.to_thread.run_sync(give_back_free_heap)
