"""A PM on etcd (SPEC §8): ``sbp-pm --etcd URL,...``.

Every PM on the same etcd and prefix serves SBP; one of them leads
(``pm.leadership``). While this PM leads, requests reach a
``PlacementManager`` built for the term:

1. the metadata is read from etcd (``pm.etcd_metadata``), and every write of
   the term is guarded by the leader key;
2. every data node the metadata names counts as alive until a full node
   timeout has passed without its heartbeat (``NodeRegistry.restore``), so
   the failover itself seals nothing;
3. the manager's own work starts (liveness, seals of dead primaries,
   repairs, returning nodes): a seal or a repair the last leader left half
   done is taken up from the metadata as it stands;
4. SYNC_RANGES and SEAL_RANGES carry the term; data nodes refuse older terms.

A PM that does not lead answers every request but PING with SYSTEM_ERROR
NOT_LEADER naming the leader (``LeaderGate``); clients and data nodes given
several PM addresses follow it. When the term ends (a renewal failed, a
guarded write was refused, etcd lost its majority) the manager is dropped
at once and the PM campaigns again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Iterator

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from net.address import format_address
from net.authz import AccessCollector, access_control
from net.metrics import histogram_family
from net.request import Request, Responder
from net.server import Dispatcher
from net.service import EXIT_OK, LISTENING_PREFIX, METRICS_PREFIX, ShutdownSignals, announce
from sbp.errors import NotLeaderError

from .config import PMConfig
from .datanode_link import DataNodeLink
from .etcd import Etcd
from .etcd_metadata import EtcdMetadataStore
from .handlers import PMHandlers
from .leadership import Leadership
from .liveness import NodeRegistry
from .manager import PlacementManager
from .metrics import PMMetrics
from .server import build_server, drain, metrics_endpoint, object_store, run_manager

log = logging.getLogger(__name__)


class LeaderGate:
    """The request handler of a PM on etcd: the term's dispatcher while this
    PM leads, NOT_LEADER with the leader's address otherwise."""

    def __init__(self, leadership: Leadership) -> None:
        self._leadership = leadership
        self.dispatcher: Dispatcher | None = None

    def start(self, request: Request, responder: Responder) -> Awaitable[None] | None:
        dispatcher = self.dispatcher
        if dispatcher is None or not self._leadership.is_leader:
            leader = self._leadership.leader_addr
            error = NotLeaderError(
                f"this PM does not lead; the leader is {leader}"
                if leader
                else "this PM does not lead, and no leader is known yet"
            )
            error.leader_addr = leader
            raise error
        return dispatcher.start(request, responder)


class LeadershipCollector(Collector):
    def __init__(self, leadership: Leadership, etcd: Etcd) -> None:
        self._leadership = leadership
        self._etcd = etcd

    def collect(self) -> Iterator[Metric]:
        leadership = self._leadership
        yield histogram_family(
            "sbp_pm_etcd_request_seconds",
            "etcd calls answered by a member (range, txn, lease …), seconds",
            self._etcd.latency.snapshot(),
        )
        yield GaugeMetricFamily(
            "sbp_pm_leader", "1 while this PM leads (SPEC §8)", value=int(leadership.is_leader)
        )
        yield GaugeMetricFamily(
            "sbp_pm_term", "the PM term this PM leads in (0 when it does not)", leadership.term or 0
        )
        yield CounterMetricFamily(
            "sbp_pm_terms_won", "terms this PM won: failovers to it", leadership.terms_won
        )


async def run_pm_on_etcd(config: PMConfig) -> int:
    # httpx logs every request at INFO: one per etcd call, several a second.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    prefix = config.etcd_prefix.encode()
    with ShutdownSignals() as signals:
        async with (
            Etcd(config.etcd, tls=config.etcd_tls.context() if config.etcd_tls else None) as etcd,
            DataNodeLink.new_pool(config.security.client_context()) as pool,
        ):
            leadership = Leadership(etcd, prefix, "", config.lease_ttl_s)
            gate = LeaderGate(leadership)
            current: list[PlacementManager] = []
            metrics = PMMetrics(
                lambda: current[0] if current else None,
                lag_max_series=config.lag_metrics_max_series,
            )
            access = access_control(config.security)
            metrics.registry.register(AccessCollector(access))
            metrics.registry.register(LeadershipCollector(leadership, etcd))
            server = build_server(config, gate, metrics)

            async def lead(term: int) -> None:
                store = EtcdMetadataStore(etcd, prefix, leadership.guard, leadership.step_down)
                await store.load()
                registry = NodeRegistry(config.node_timeout_s)
                manager = PlacementManager(
                    store,
                    registry,
                    DataNodeLink(pool, registry.address, term=term, stream_of=store.stream),
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
                counts = manager.counts()
                log.info(
                    "term %d: %d streams, %d ranges, %d data nodes in etcd",
                    term,
                    counts.streams,
                    counts.ranges,
                    counts.nodes,
                )
                current[:] = [manager]
                gate.dispatcher = PMHandlers(manager, access).dispatcher()
                try:
                    await run_manager(manager, config.end_offsets_interval_s)
                finally:
                    gate.dispatcher = None
                    current.clear()
                    manager.stop_outgoing()

            with metrics_endpoint(config, metrics) as endpoint:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(signals.watch)
                    nursery.start_soon(access.reload_on_sighup)
                    host, port = await nursery.start(server.serve, *config.listen)
                    leadership.advertise = format_address(*(config.advertise or (host, port)))
                    if endpoint is not None:
                        announce(METRICS_PREFIX, *endpoint.address)
                    announce(LISTENING_PREFIX, host, port)
                    log.info(
                        "PM %s on etcd %s, prefix %s",
                        leadership.advertise,
                        ",".join(config.etcd),
                        config.etcd_prefix,
                    )
                    nursery.start_soon(leadership.run, lead)
                    await signals.requested.wait()
                    await drain(server, signals, config, list(current))
                    nursery.cancel_scope.cancel()
    log.info("stopped")
    return EXIT_OK
