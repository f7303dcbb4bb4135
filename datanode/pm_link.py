"""The data node's link to the placement manager.

- registers and stays alive: HEARTBEAT (role DATA_NODE, node id, advertise
  address) every ``heartbeat_interval``, the first one at start-up;
- reports load: REPORT_METRICS every ``metrics_interval``;
- looks up streams the node does not know (LIST_RANGES by stream), one
  lookup at a time per stream, so a burst of appends to a new stream costs
  the PM one request.

The PM may be absent or restart at any time: every call goes through a
``ConnectionPool``, which reconnects with exponential backoff and jitter, and
the loops only log the transitions (lost, back), never stop the node.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import trio

from net.pool import ConnectionPool
from sbp import messages
from sbp.enums import ClientRole, ErrorCode, Opcode
from sbp.errors import SBPError, error_for

logger = logging.getLogger(__name__)

#: a PM call that takes longer than this is treated as failed
PM_REQUEST_TIMEOUT_S: Final = 5.0
#: an unknown stream the PM did not know either is not asked about again for this long
NEGATIVE_LOOKUP_TTL_S: Final = 1.0
#: a lookup holds up the request that needs it (and, for APPEND, the appends
#: behind it on its connection), so it gives up early
LOOKUP_TIMEOUT_S: Final = 2.0
MAX_REMEMBERED_UNKNOWN: Final = 10_000


class PMLink:
    """HEARTBEAT, REPORT_METRICS and stream lookups against one PM address."""

    def __init__(
        self,
        address: str,
        pool: ConnectionPool,
        identity: Callable[[], messages.DataNode],
        build_report: Callable[[], messages.ReportMetricsRequest],
        install: Callable[[int, list[messages.Range]], Awaitable[None]],
        *,
        heartbeat_interval: float,
        metrics_interval: float,
    ) -> None:
        self.address = address
        self._pool = pool
        self._identity = identity
        self._build_report = build_report
        self._install = install
        self._heartbeat_interval = heartbeat_interval
        self._metrics_interval = metrics_interval
        self._lookups: dict[int, _Lookup] = {}
        self._not_found_until: dict[int, float] = {}
        #: True while the last HEARTBEAT got an answer
        self.connected = False
        self.heartbeats_sent = 0
        self.reports_sent = 0
        self.registered = trio.Event()

    async def run(self) -> None:
        """Heartbeat and report until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._heartbeat_loop)
            nursery.start_soon(self._report_loop)

    async def _heartbeat_loop(self) -> None:
        while True:
            identity = self._identity()
            request = messages.HeartbeatRequest(
                client_id=f"datanode-{identity.node_id}",
                client_role=ClientRole.DATA_NODE,
                data_node=identity,
            )
            try:
                await self._call(Opcode.HEARTBEAT, request)
            except (SBPError, OSError) as error:
                if self.connected:
                    logger.warning("lost the PM at %s: %s", self.address, error)
                elif self.heartbeats_sent == 0:
                    logger.warning("cannot reach the PM at %s yet: %s", self.address, error)
                self.connected = False
            else:
                if not self.connected:
                    logger.info("registered with the PM at %s", self.address)
                self.connected = True
                self.registered.set()
            self.heartbeats_sent += 1
            await trio.sleep(self._heartbeat_interval)

    async def _report_loop(self) -> None:
        while True:
            await trio.sleep(self._metrics_interval)
            if not self.connected:
                continue
            try:
                await self._call(Opcode.REPORT_METRICS, self._build_report())
            except (SBPError, OSError) as error:
                logger.debug("REPORT_METRICS to %s failed: %s", self.address, error)
            else:
                self.reports_sent += 1

    async def refresh_stream(self, stream_id: int) -> bool:
        """Look ``stream_id`` up on the PM and hand its ranges to ``install``;
        False when the PM does not know the stream or cannot be reached.
        Concurrent calls for one stream share the first one's lookup."""
        running = self._lookups.get(stream_id)
        if running is not None:
            await running.done.wait()
            return running.found
        if trio.current_time() < self._not_found_until.get(stream_id, 0.0):
            return False
        if not self.connected and self.heartbeats_sent > 0:
            return False  # the PM is known to be unreachable: do not wait for it
        lookup = self._lookups[stream_id] = _Lookup()
        try:
            ranges = None
            with trio.move_on_after(LOOKUP_TIMEOUT_S):
                ranges = await self._list_ranges(stream_id)
            if ranges:
                await self._install(stream_id, ranges)
                lookup.found = True
                self._not_found_until.pop(stream_id, None)
            else:
                self._remember_not_found(stream_id)
        finally:
            del self._lookups[stream_id]
            lookup.done.set()
        return lookup.found

    def _remember_not_found(self, stream_id: int) -> None:
        now = trio.current_time()
        if len(self._not_found_until) >= MAX_REMEMBERED_UNKNOWN:
            # Random stream ids must not grow this without bound.
            self._not_found_until = {s: t for s, t in self._not_found_until.items() if t > now}
        if len(self._not_found_until) < MAX_REMEMBERED_UNKNOWN:
            self._not_found_until[stream_id] = now + NEGATIVE_LOOKUP_TTL_S

    async def _list_ranges(self, stream_id: int) -> list[messages.Range] | None:
        request = messages.ListRangesRequest(
            timeout_ms=int(PM_REQUEST_TIMEOUT_S * 1000),
            range_owners=(messages.RangeOwner(stream_id=stream_id),),
        )
        try:
            response = await self._call(Opcode.LIST_RANGES, request)
        except (SBPError, OSError) as error:
            logger.info("LIST_RANGES for stream %d on the PM failed: %s", stream_id, error)
            return None
        for result in response.list_responses:
            if result.error_code != ErrorCode.NONE:
                logger.debug(
                    "the PM has no ranges for stream %d: %s",
                    stream_id,
                    error_for(result.error_code, result.error_message),
                )
                return None
            return list(result.ranges)
        return None

    async def retention_periods(self, stream_ids: Sequence[int]) -> dict[int, int] | None:
        """Each stream's retention period as the PM has it (GET_STREAMS);
        streams the PM does not know are left out. None when the PM cannot
        be asked."""
        request = messages.GetStreamsRequest(
            timeout_ms=int(PM_REQUEST_TIMEOUT_S * 1000), stream_ids=tuple(stream_ids)
        )
        try:
            response = await self._call(Opcode.GET_STREAMS, request)
        except (SBPError, OSError) as error:
            logger.info("GET_STREAMS of %d streams on the PM failed: %s", len(stream_ids), error)
            return None
        return {
            result.stream.stream_id: result.stream.retention_period_ms
            for result in response.get_responses
            if result.error_code == ErrorCode.NONE and result.stream is not None
        }

    async def report_trims(self, trims: Sequence[tuple[int, int]]) -> bool:
        """Tell the PM the streams' new first offsets (TRIM_STREAMS); False
        when the PM could not be asked. Items the PM refuses (a stream
        deleted meanwhile) are logged and count as told."""
        request = messages.TrimStreamsRequest(
            timeout_ms=int(PM_REQUEST_TIMEOUT_S * 1000),
            trimmed_streams=tuple(
                messages.TrimmedStream(stream_id=sid, trim_offset=offset) for sid, offset in trims
            ),
        )
        try:
            response = await self._call(Opcode.TRIM_STREAMS, request)
        except (SBPError, OSError) as error:
            logger.info("TRIM_STREAMS of %d streams on the PM failed: %s", len(trims), error)
            return False
        for (stream_id, _), result in zip(trims, response.trim_responses, strict=False):
            if result.error_code != ErrorCode.NONE:
                logger.info(
                    "the PM did not take stream %d's retention trim: %s",
                    stream_id,
                    error_for(result.error_code, result.error_message),
                )
        return True

    async def _call(self, opcode: Opcode, request: messages.Message) -> Any:
        connection = await self._pool.get(self.address)
        response = await connection.request(opcode, request, timeout=PM_REQUEST_TIMEOUT_S)
        return response.header


class _Lookup:
    __slots__ = ("done", "found")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.found = False
