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
from typing import Final

import trio

from client.pm_client import PMClient
from net.pool import ConnectionPool
from sbp import messages
from sbp.enums import ClientRole, ErrorCode
from sbp.errors import ProtocolError, SBPError, error_for
from storage.model import RangeInfo

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
        #: every call goes through the client library's PM client (one or
        #: several PM addresses, NOT_LEADER followed)
        self._pm = PMClient(address, pool=pool, timeout=PM_REQUEST_TIMEOUT_S)
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
            try:
                await self._pm.heartbeat(
                    f"datanode-{identity.node_id}", role=ClientRole.DATA_NODE, data_node=identity
                )
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
                await self._pm.report_metrics(self._build_report())
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
        try:
            return list(await self._pm.list_stream_ranges(stream_id))
        except ProtocolError as error:
            logger.debug("the PM has no ranges for stream %d: %s", stream_id, error)
            return None
        except (SBPError, OSError) as error:
            logger.info("LIST_RANGES for stream %d on the PM failed: %s", stream_id, error)
            return None

    async def retention_periods(self, stream_ids: Sequence[int]) -> dict[int, int] | None:
        """Each stream's retention period as the PM has it (GET_STREAMS);
        streams the PM does not know are left out. None when the PM cannot
        be asked."""
        try:
            results = await self._pm.get_streams(stream_ids)
        except (SBPError, OSError) as error:
            logger.info("GET_STREAMS of %d streams on the PM failed: %s", len(stream_ids), error)
            return None
        # a stream only compacted (cleanup_policy 1, SPEC §13) has no time retention
        return {
            result.stream.stream_id: (
                0 if result.stream.cleanup_policy == 1 else result.stream.retention_period_ms
            )
            for result in results
            if result.error_code == ErrorCode.NONE and result.stream is not None
        }

    async def ack_nums(self, stream_id: int) -> int | None:
        """The stream's ``ack_nums`` as the PM has it (0: a majority); None
        when the PM cannot be asked or does not know the stream."""
        try:
            [result] = await self._pm.get_streams([stream_id])
        except (SBPError, OSError, ValueError) as error:
            logger.info("GET_STREAMS of stream %d on the PM failed: %s", stream_id, error)
            return None
        if result.error_code != ErrorCode.NONE or result.stream is None:
            return None
        return int(result.stream.ack_nums)

    async def seal_range(self, info: RangeInfo) -> bool:
        """Ask the PM to seal a range (SEAL_RANGES, as a writer would): True
        once it is sealed there, by this call or before it."""
        try:
            await self._pm.seal_range(info.stream_id, info.range_index)
        except ProtocolError as error:
            if error.code in (ErrorCode.STREAM_NOT_FOUND, ErrorCode.RANGE_NOT_FOUND):
                return True  # gone: nothing left to seal
            logger.info(
                "SEAL_RANGES of stream %d range %d on the PM: %s",
                info.stream_id,
                info.range_index,
                error,
            )
            return False
        except (SBPError, OSError) as error:
            logger.info("SEAL_RANGES on the PM failed: %s", error)
            return False
        return True

    async def report_trims(self, trims: Sequence[tuple[int, int]]) -> bool:
        """Tell the PM the streams' new first offsets (TRIM_STREAMS); False
        when the PM could not be asked. Items the PM refuses (a stream
        deleted meanwhile) are logged and count as told."""
        wanted = [
            messages.TrimmedStream(stream_id=sid, trim_offset=offset) for sid, offset in trims
        ]
        try:
            results = await self._pm.trim_streams(wanted)
        except (SBPError, OSError) as error:
            logger.info("TRIM_STREAMS of %d streams on the PM failed: %s", len(trims), error)
            return False
        for (stream_id, _), result in zip(trims, results, strict=False):
            if result.error_code != ErrorCode.NONE:
                logger.info(
                    "the PM did not take stream %d's retention trim: %s",
                    stream_id,
                    error_for(result.error_code, result.error_message),
                )
        return True


class _Lookup:
    __slots__ = ("done", "found")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.found = False
