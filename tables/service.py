"""The ``sbp-tables`` process (SPEC §16): a member of a consumer group
(§15) that reads the tabled streams the PM assigns it and keeps each in its
Iceberg table.

Each assigned stream gets a ``TableWriter`` that starts from its table's
``sbp.end-offset``; its rows are committed every ``table_interval_ms``
(the stream's setting) while records arrive, or sooner once
``--target-file-bytes`` are gathered. A stream taken away is committed
first and then let go of; a stream lost (this process was fenced, or silent
past its session) is let go of without a commit, and a commit is only made
while the process still holds its stream. An idle stream costs a timer
check. Every ``--maintenance-interval-ms`` each table's small files are
rewritten, its old snapshots expired and its unnamed data files deleted
(``tables.maintenance``, ``tables.sweep``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pyiceberg.catalog import Catalog

from client._routing import ClientContext
from client.by_time import stream_end
from client.group_member import GroupConsumer
from net.metrics import new_registry
from net.metrics_http import bound_metrics
from net.service import LISTENING_PREFIX, METRICS_PREFIX, ShutdownSignals, announce
from net.tls import ServerSecurity
from sbp import messages
from sbp.errors import SBPError

from .catalog import open_catalog
from .config import TablesConfig
from .sweep import sweep
from .writer import TableWriter

log = logging.getLogger(__name__)

#: how often the writers are looked at for a commit that is due
COMMIT_CHECK_S: Final = 0.05
#: how often the streams' ends are asked for (the lag metrics)
ENDS_REFRESH_S: Final = 5.0
#: a failed commit is tried again after this long (doubling up to the max)
RETRY_S: Final = 0.5
RETRY_MAX_S: Final = 30.0
#: the per-stream series on /metrics at most (the furthest behind first)
MAX_SERIES: Final = 1000


@dataclass
class TableStats:
    """What the writers did (/metrics)."""

    commits: int = 0
    failed_commits: int = 0
    rows: int = 0
    bytes: int = 0
    files: int = 0
    rewritten_files: int = 0
    swept_files: int = 0
    #: by stream: the stream's end as last asked
    ends: dict[int, int] = field(default_factory=dict)


class TablesService:
    """See the module docstring."""

    def __init__(self, config: TablesConfig, catalog: Catalog) -> None:
        self.config = config
        self.catalog = catalog
        self.writers: dict[int, TableWriter] = {}
        self._locks: dict[int, trio.Lock] = {}
        self._failures: dict[int, tuple[int, float]] = {}  # stream -> (in a row, next try)
        self.stats = TableStats()
        self.member: GroupConsumer | None = None
        self._context: ClientContext | None = None

    async def run(self, context: ClientContext, stopping: trio.Event) -> None:
        """Read and commit until ``stopping``; then commit what is gathered
        and leave the group."""
        config = self.config
        self._context = context
        self.member = GroupConsumer(
            context.pm,
            config.group,
            "all",
            where=lambda stream: stream.table_interval_ms > 0,
            member_id=config.member_id,
            session_timeout=config.session_timeout_s,
            auto_commit_interval=None,  # the tables hold the positions
            start_at=self._open_writer,
            on_revoked=self._hand_over,
            on_lost=self._let_go,
            pool=context.pool,
        )
        async with self.member as member, trio.open_nursery() as nursery:
            nursery.start_soon(self._commit_when_due)
            nursery.start_soon(self._refresh_ends, context)
            nursery.start_soon(self._maintain_now_and_then)
            with trio.CancelScope() as reading:
                nursery.start_soon(_cancel_on, stopping, reading)
                async for batch in member:
                    writer = self.writers.get(batch.stream_id)
                    if writer is not None:
                        writer.add(batch.records)
                    await self._wait_for_room()
            for stream_id in list(self.writers):  # stopping: what is gathered goes in
                await self._commit(stream_id)
            nursery.cancel_scope.cancel()

    def gathered_bytes(self) -> int:
        return sum(writer.pending_bytes for writer in self.writers.values())

    async def _wait_for_room(self) -> None:
        """Read no further while too much waits for a commit (the catalog
        down): the records stay in the streams, not in this process's memory."""
        if self.gathered_bytes() <= self.config.max_gathered_bytes:
            return
        log.warning(
            "%d bytes gathered and not committed (--max-gathered-bytes): reading waits "
            "for the commits",
            self.gathered_bytes(),
        )
        while self.gathered_bytes() > self.config.max_gathered_bytes:
            await trio.sleep(COMMIT_CHECK_S)

    # -- streams given and taken away -----------------------------------------------

    async def _open_writer(self, stream_id: int) -> int | None:
        """A stream given: its table's end is where its reading starts."""
        assert self.member is not None
        interval_ms = await self._interval_ms(stream_id)
        writer = TableWriter(
            self.catalog,
            stream_id,
            interval_s=interval_ms / 1000,
            target_bytes=self.config.target_file_bytes,
        )
        end = await trio.to_thread.run_sync(writer.open)
        self.writers[stream_id] = writer
        log.info(
            "stream %d: keeping its table from offset %s",
            stream_id,
            "the start" if end is None else end,
        )
        return end

    async def _interval_ms(self, stream_id: int) -> int:
        assert self._context is not None
        [result] = await self._context.pm.get_streams([stream_id])
        stream = result.stream if result.stream is not None else messages.Stream()
        return max(int(stream.table_interval_ms), 100)

    async def _hand_over(self, stream_ids: list[int]) -> None:
        """Taken away: commit what is gathered, then let go."""
        for stream_id in stream_ids:
            await self._commit(stream_id)
        self._let_go(stream_ids)

    def _let_go(self, stream_ids: list[int]) -> None:
        for stream_id in stream_ids:
            self.writers.pop(stream_id, None)
            self._failures.pop(stream_id, None)

    # -- commits ----------------------------------------------------------------------

    async def _commit_when_due(self) -> None:
        while True:
            await trio.sleep(COMMIT_CHECK_S)
            now = time.monotonic()
            for stream_id, writer in list(self.writers.items()):
                waiting = self._failures.get(stream_id)
                if writer.due() and (waiting is None or now >= waiting[1]):
                    await self._commit(stream_id)

    async def _commit(self, stream_id: int) -> None:
        writer = self.writers.get(stream_id)
        assert self.member is not None
        if writer is None or not self.member.holds(stream_id):
            return  # not ours (any more): a fenced writer commits nothing
        async with self._locks.setdefault(stream_id, trio.Lock()):
            taken = writer.take()
            if taken is None:
                return
            try:
                done = await trio.to_thread.run_sync(writer.commit, taken)
            except Exception as error:  # the catalog or the files: tried again later
                writer.give_back(taken)
                in_a_row = self._failures.get(stream_id, (0, 0.0))[0] + 1
                wait = min(RETRY_S * 2 ** (in_a_row - 1), RETRY_MAX_S)
                self._failures[stream_id] = (in_a_row, time.monotonic() + wait)
                self.stats.failed_commits += 1
                log.warning(
                    "stream %d: a commit to its table failed (%s); trying again in %.1f s",
                    stream_id,
                    error,
                    wait,
                )
                return
        self._failures.pop(stream_id, None)
        stats = self.stats
        stats.commits += 1
        stats.rows += done.rows
        stats.bytes += done.bytes
        stats.files += done.files

    # -- upkeep -------------------------------------------------------------------------

    async def _refresh_ends(self, context: ClientContext) -> None:
        while True:
            for stream_id in list(self.writers):
                with contextlib.suppress(SBPError, OSError):  # the last end known stays
                    self.stats.ends[stream_id] = await stream_end(context, stream_id)
            for gone in set(self.stats.ends) - set(self.writers):
                del self.stats.ends[gone]
            await trio.sleep(ENDS_REFRESH_S)

    async def _maintain_now_and_then(self) -> None:
        """Every ``--maintenance-interval-ms``, each table held: its small
        files rewritten and old snapshots expired (under its writer's lock,
        between commits), then the files no snapshot names deleted."""
        while True:
            await trio.sleep(self.config.maintenance_interval_s)
            for stream_id, writer in list(self.writers.items()):
                assert self.member is not None
                if writer.table is None or not self.member.holds(stream_id):
                    continue
                try:
                    async with self._locks.setdefault(stream_id, trio.Lock()):
                        rewritten = await trio.to_thread.run_sync(writer.maintain)
                    swept = await trio.to_thread.run_sync(sweep, writer.table)
                except Exception as error:  # the catalog or the files: next time
                    log.info("stream %d: upkeep of its table: %s", stream_id, error)
                    continue
                if rewritten is not None:
                    self.stats.rewritten_files += rewritten.files_in
                self.stats.swept_files += len(swept)


async def _cancel_on(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


class TablesCollector(Collector):
    """The tables' lag and the writers' work, on /metrics."""

    def __init__(self, service: TablesService) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        service = self._service
        stats = service.stats
        now_ms = int(time.time() * 1000)
        lag_records = GaugeMetricFamily(
            "sbp_table_lag_records",
            "records of the stream not in its table yet (the stream's end as last asked)",
            labels=["stream"],
        )
        lag_seconds = GaugeMetricFamily(
            "sbp_table_lag_seconds",
            "age of the oldest record gathered but not committed, by its own timestamp (0: none)",
            labels=["stream"],
        )
        rows = []
        for stream_id, writer in list(service.writers.items()):
            end = stats.ends.get(stream_id)
            behind = -1 if end is None else max(end - (writer.end or 0), 0)
            oldest = writer.oldest_pending_ms
            rows.append(
                (stream_id, behind, 0.0 if oldest is None else max(now_ms - oldest, 0) / 1000)
            )
        rows.sort(key=lambda row: -row[1])
        for stream_id, behind, seconds in rows[:MAX_SERIES]:
            if behind >= 0:
                lag_records.add_metric([str(stream_id)], behind)
            lag_seconds.add_metric([str(stream_id)], seconds)
        yield lag_records
        yield lag_seconds
        yield GaugeMetricFamily(
            "sbp_table_oldest_uncommitted_seconds",
            "age of the oldest record gathered and not committed, over every stream",
            value=max((row[2] for row in rows), default=0.0),
        )
        yield GaugeMetricFamily(
            "sbp_table_streams", "tabled streams this process keeps now", value=len(rows)
        )
        for name, text, value in (
            ("commits", "snapshots committed", stats.commits),
            ("failed_commits", "commits that failed (tried again)", stats.failed_commits),
            ("rows", "rows committed", stats.rows),
            ("bytes", "bytes of rows committed (as Arrow holds them)", stats.bytes),
            ("files", "data files committed", stats.files),
            ("rewritten_files", "small data files rewritten as larger ones", stats.rewritten_files),
            ("swept_files", "data files deleted because no snapshot names them", stats.swept_files),
        ):
            yield CounterMetricFamily(f"sbp_table_{name}", text, value=value)


async def run_tables(config: TablesConfig) -> int:
    """Serve until SIGTERM/SIGINT; the exit code."""
    catalog = await trio.to_thread.run_sync(open_catalog, config.catalog, config.warehouse)
    service = TablesService(config, catalog)
    registry = new_registry()
    registry.register(TablesCollector(service))
    with (
        ShutdownSignals() as signals,
        bound_metrics(config.metrics_listen, registry, ServerSecurity()) as endpoint,
    ):
        async with ClientContext(config.pm, None, 10.0) as context, trio.open_nursery() as nursery:
            nursery.start_soon(signals.watch)
            # its one port is /metrics: tools wait for the line naming it
            announce(METRICS_PREFIX, *endpoint.address)
            announce(LISTENING_PREFIX, *endpoint.address)
            log.info(
                "keeping tabled streams in %s (warehouse %s) as a member of group %r",
                config.catalog,
                config.warehouse,
                config.group,
            )
            await service.run(context, signals.requested)
            nursery.cancel_scope.cancel()
    log.info("stopped")
    return 0
