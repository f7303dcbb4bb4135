"""Assembling and running one PM process: metadata, registry, link to the data
nodes, handlers, the SBP server and /metrics, until SIGTERM/SIGINT."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Final

import trio

from net.authz import AccessCollector, access_control
from net.budget import ServerBudgets
from net.dirlock import locked_dir
from net.limits import KEEPALIVE_INTERVAL_S, ConnectionLimits
from net.metrics_http import MetricsHTTPServer, bound_metrics
from net.server import RequestHandler, Server
from net.service import (
    EXIT_OK,
    LISTENING_PREFIX,
    METRICS_PREFIX,
    ServiceError,
    ShutdownSignals,
    announce,
    drain_on_signals,
)
from tiering.store import ObjectStore

from .config import PMConfig
from .datanode_link import DataNodeLink
from .handlers import PMHandlers
from .liveness import NodeRegistry
from .manager import PlacementManager
from .metadata import MetadataError, MetadataStore
from .metrics import PMMetrics

log = logging.getLogger(__name__)

#: held in the data directory while the PM runs: a second PM there is refused
LOCK_FILE: Final = "pm.lock"
#: liveness is checked this often (and at most every quarter of the node timeout)
LIVENESS_CHECK_S: Final = 1.0


async def run_pm(config: PMConfig) -> int:
    """Serve with the metadata in LMDB until SIGTERM/SIGINT, then drain and
    close; the exit code. (On etcd: ``pm.ha.run_pm_on_etcd``.)"""
    with ShutdownSignals() as signals, _open_store(config) as store:
        # Links to the data nodes speak TLS with this PM's certificate.
        async with DataNodeLink.new_pool(config.security.client_context()) as pool:
            registry = NodeRegistry(config.node_timeout_s)
            manager = PlacementManager(
                store,
                registry,
                DataNodeLink(pool, registry.address, stream_of=store.stream),
                min_free_space=config.min_free_space,
                repair_after=config.repair_after_s,
                max_move_bytes_per_s=config.max_move_bytes_per_s,
                size_retention_interval=config.size_retention_interval_s,
                rebalance_threshold=config.rebalance_threshold,
                rebalance_interval=config.rebalance_interval_s,
                reconcile_interval=config.reconcile_interval_s,
                compaction=config.compaction,
                objects=object_store(config),
                object_sweep_interval=config.object_sweep_interval_s,
                tiered_roll_bytes=config.tiered_roll_bytes,
                tiering_interval=config.tiering_interval_s,
            )
            metrics = PMMetrics(manager, lag_max_series=config.lag_metrics_max_series)
            access = access_control(config.security)
            metrics.registry.register(AccessCollector(access))
            server = build_server(config, PMHandlers(manager, access).dispatcher(), metrics)
            with metrics_endpoint(config, metrics) as endpoint:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(signals.watch)
                    nursery.start_soon(access.reload_on_sighup)
                    host, port = await nursery.start(server.serve, *config.listen)
                    if endpoint is not None:
                        announce(METRICS_PREFIX, *endpoint.address)
                    counts = manager.counts()
                    log.info(
                        "metadata in %s: %d streams, %d ranges, %d data nodes",
                        config.data_dir,
                        counts.streams,
                        counts.ranges,
                        counts.nodes,
                    )
                    announce(LISTENING_PREFIX, host, port)
                    nursery.start_soon(run_manager, manager, config.end_offsets_interval_s)
                    await signals.requested.wait()
                    await drain(server, signals, config, [manager])
                    nursery.cancel_scope.cancel()
    log.info("stopped")
    return EXIT_OK


def object_store(config: PMConfig) -> ObjectStore | None:
    """The object store of tiered streams (SPEC §14), when the PM has one."""
    return None if config.object_store is None else ObjectStore(config.object_store)


def build_server(config: PMConfig, handler: RequestHandler, metrics: PMMetrics) -> Server:
    return Server(
        handler,
        limits=ConnectionLimits(
            max_frame_length=config.max_frame_bytes,
            max_concurrent_requests=config.max_in_flight,
            keepalive_interval=KEEPALIVE_INTERVAL_S,
            drain_timeout=config.drain_timeout_s,
        ),
        observer=metrics.connections,
        max_connections=config.max_connections,
        budgets=ServerBudgets.of(config.max_request_bytes, config.max_answer_bytes),
        tls=config.security.server_context(),
    )


async def run_manager(manager: PlacementManager, end_offsets_interval: float) -> None:
    """The manager's own work, for as long as it runs: liveness, the seals
    of dead primaries and repairs, writes moved off full nodes, replicas
    restored, drains, nodes that come back (and every live node now and
    then), the ends of streams groups
    read, streams' size limits, compacted streams' passes, group members'
    sessions."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_liveness, manager.registry)
        nursery.start_soon(manager.upkeep.watch_nodes)
        nursery.start_soon(manager.reconciler.run)
        nursery.start_soon(manager.size_retention.run)
        nursery.start_soon(manager.compactor.run)
        if manager.tiering is not None:
            nursery.start_soon(manager.tiering.run)
        nursery.start_soon(manager.members.expire)
        nursery.start_soon(manager.groups.run, end_offsets_interval)


async def drain(
    server: Server, signals: ShutdownSignals, config: PMConfig, managers: list[PlacementManager]
) -> None:
    """GOAWAY and the drain; calls to data nodes get the drain's time."""
    async with trio.open_nursery() as stopping:
        for manager in managers:
            stopping.start_soon(
                _stop_outgoing_after, manager, config.drain_timeout_s, signals.forced
            )
        await drain_on_signals(server, signals, config.drain_timeout_s)
        for manager in managers:
            manager.stop_outgoing()
        stopping.cancel_scope.cancel()


async def _stop_outgoing_after(
    manager: PlacementManager, drain_timeout: float, forced: trio.Event
) -> None:
    """Calls to data nodes get the drain's time to finish, not their requests'
    deadlines (up to 300 s): a node that does not answer cannot hold the PM."""
    with trio.move_on_after(drain_timeout):
        await forced.wait()
    manager.stop_outgoing()


@contextlib.contextmanager
def _open_store(config: PMConfig) -> Iterator[MetadataStore]:
    assert config.data_dir is not None
    # Two PMs on one directory would hand out the same stream ids.
    with locked_dir(config.data_dir, LOCK_FILE, "PM"):
        try:
            store = MetadataStore(config.data_dir, map_size=config.map_size)
        except MetadataError as exc:
            raise ServiceError(str(exc)) from exc
        try:
            yield store
        finally:
            store.close()


@contextlib.contextmanager
def metrics_endpoint(config: PMConfig, metrics: PMMetrics) -> Iterator[MetricsHTTPServer | None]:
    if config.metrics_listen is None:
        yield None
        return
    with bound_metrics(config.metrics_listen, metrics.registry, config.security) as endpoint:
        yield endpoint


async def _watch_liveness(registry: NodeRegistry) -> None:
    """Check liveness periodically, so that a node going silent is logged when
    it turns dead, not at the next request that looks."""
    interval = min(LIVENESS_CHECK_S, registry.node_timeout / 4)
    while True:
        await trio.sleep(interval)
        registry.sweep()
