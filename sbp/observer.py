"""The hook through which connections report what they do (for metrics)."""

from __future__ import annotations

from .enums import ErrorCode


class ConnectionObserver:
    """Receives connection events; every method is a no-op here.

    Called on the hot path, once or twice per frame: implementations should
    only bump counters (cache labelled metric children up front).
    """

    def connection_opened(self) -> None:
        """A connection started running."""

    def connection_closed(self) -> None:
        """A connection ended, for whatever reason."""

    def frame_received(self, opcode: int, nbytes: int) -> None:
        """A well-formed frame arrived (``nbytes`` on the wire)."""

    def frame_sent(self, opcode: int, nbytes: int) -> None:
        """A frame was queued for the wire (``nbytes`` long)."""

    def frame_discarded(self, reason: str) -> None:
        """A frame was dropped or rejected: ``bad_magic``, ``unknown_opcode``,
        ``late_response``, ``unexpected_response``, ``rejected_<code>``,
        ``rejected_response_<code>`` or ``fatal``."""

    def request_started(self, opcode: int) -> None:
        """This end started serving a request of the peer."""

    def request_finished(self, opcode: int, seconds: float, error_code: ErrorCode) -> None:
        """This end finished serving a request; ``error_code`` is the
        SYSTEM_ERROR code it answered with, NONE otherwise."""


NULL_OBSERVER = ConnectionObserver()
