"""Per-stream wake-ups for FETCH long polls.

A FETCH at a stream's tail subscribes to the streams it reads and sleeps on
one event; the append completion path calls ``notify(stream_id)`` once a batch
of that stream is durable (and sealing or deleting a stream does the same), so
a waiting consumer wakes within one event-loop turn of the acknowledgement,
without polling. ``notify`` is a dict lookup when nobody waits.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import trio


class StreamWaiters:
    """Who waits for which stream; every method runs on the trio thread."""

    def __init__(self) -> None:
        self._by_stream: dict[int, set[trio.Event]] = {}
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Subscriptions open right now (FETCH requests waiting for data)."""
        return self._waiting

    @contextmanager
    def subscribe(self, stream_ids: Iterable[int]) -> Iterator[trio.Event]:
        """An event set as soon as any of ``stream_ids`` gets new data (or is
        sealed or deleted). Subscribe *before* the last check for data: trio
        runs nothing else between that check and the wait, so no append can
        slip in unnoticed."""
        event = trio.Event()
        streams = frozenset(stream_ids)
        for stream_id in streams:
            self._by_stream.setdefault(stream_id, set()).add(event)
        self._waiting += 1
        try:
            yield event
        finally:
            self._waiting -= 1
            for stream_id in streams:
                events = self._by_stream.get(stream_id)
                if events is not None:
                    events.discard(event)
                    if not events:
                        del self._by_stream[stream_id]

    def notify(self, stream_id: int) -> None:
        """Wake every FETCH waiting on ``stream_id``."""
        events = self._by_stream.pop(stream_id, None)
        if events:
            for event in events:
                event.set()

    def notify_all(self) -> None:
        """Wake every waiting FETCH (shutdown, a PM range refresh)."""
        by_stream, self._by_stream = self._by_stream, {}
        for events in by_stream.values():
            for event in events:
                event.set()
