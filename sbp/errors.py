"""One exception tree for the whole project.

``SBPError`` is the root. Errors that travel on the wire are ``ProtocolError``
subclasses carrying their ``ErrorCode``; ``for_code`` maps a code received in a
response to the exception class to raise (unknown codes map to
``ProtocolError`` itself), and ``retriable`` says whether sending the same
request again may succeed.
"""

from __future__ import annotations

from typing import ClassVar

from .enums import ErrorCode


class SBPError(Exception):
    """Root of every error this project raises on purpose."""


class ProtocolError(SBPError):
    """An error with a wire ``ErrorCode``."""

    code: ClassVar[ErrorCode | int] = ErrorCode.UNKNOWN

    def __init__(self, message: str = "", *, code: ErrorCode | int | None = None) -> None:
        if code is not None:
            self.code = ErrorCode.coerce(code)  # type: ignore[misc]
        self.message = message
        super().__init__(message or self.code_name)

    @property
    def code_name(self) -> str:
        return self.code.name if isinstance(self.code, ErrorCode) else f"ERROR_{self.code}"

    @property
    def retriable(self) -> bool:
        return isinstance(self.code, ErrorCode) and self.code.retriable

    def __str__(self) -> str:
        return f"{self.code_name}: {self.message}" if self.message else self.code_name


class UnknownServerError(ProtocolError):
    code = ErrorCode.UNKNOWN


class InvalidRequestError(ProtocolError):
    code = ErrorCode.INVALID_REQUEST


class UnsupportedVersionError(ProtocolError):
    code = ErrorCode.UNSUPPORTED_VERSION


class ChecksumMismatchError(ProtocolError):
    code = ErrorCode.CHECKSUM_MISMATCH


class NotLeaderError(ProtocolError):
    code = ErrorCode.NOT_LEADER
    #: the leader's "host:port" when the answer named it (SPEC §8), else ""
    leader_addr: str = ""


class RequestTimeoutError(ProtocolError):
    code = ErrorCode.TIMEOUT


class ThrottledError(ProtocolError):
    code = ErrorCode.THROTTLED


class UnsupportedOperationError(ProtocolError):
    code = ErrorCode.UNSUPPORTED_OPERATION


class ShuttingDownError(ProtocolError):
    code = ErrorCode.SHUTTING_DOWN


class FrameTooLargeError(ProtocolError):
    code = ErrorCode.FRAME_TOO_LARGE


class StreamNotFoundError(ProtocolError):
    code = ErrorCode.STREAM_NOT_FOUND


class RangeNotFoundError(ProtocolError):
    code = ErrorCode.RANGE_NOT_FOUND


class RangeSealedError(ProtocolError):
    code = ErrorCode.RANGE_SEALED


class OffsetOutOfRangeError(ProtocolError):
    code = ErrorCode.OFFSET_OUT_OF_RANGE


class StreamDeletedError(ProtocolError):
    code = ErrorCode.STREAM_DELETED


class InvalidRecordBatchError(ProtocolError):
    code = ErrorCode.INVALID_RECORD_BATCH


class StorageFullError(ProtocolError):
    code = ErrorCode.STORAGE_FULL


class NotPrimaryError(ProtocolError):
    code = ErrorCode.NOT_PRIMARY


class EpochFencedError(ProtocolError):
    code = ErrorCode.EPOCH_FENCED


class NotEnoughReplicasError(ProtocolError):
    code = ErrorCode.NOT_ENOUGH_REPLICAS


class OutOfOrderError(ProtocolError):
    """A REPLICATE batch that is not at the replica's next offset (SPEC §7)."""

    code = ErrorCode.OUT_OF_ORDER

    def __init__(
        self, message: str = "", *, code: ErrorCode | int | None = None, next_offset: int = -1
    ) -> None:
        super().__init__(message, code=code)
        #: the replica's durable next offset, to resend from
        self.next_offset = next_offset


class ProducerFencedError(ProtocolError):
    """A newer epoch of this producer has appended to the stream, or the PM
    has handed one out (SPEC §10): this instance must stop."""

    code = ErrorCode.PRODUCER_FENCED


class OutOfOrderSequenceError(ProtocolError):
    """A batch whose sequence is neither the next one nor one the stream
    holds (SPEC §10): the producer has lost track of what is stored."""

    code = ErrorCode.OUT_OF_ORDER_SEQUENCE

    def __init__(
        self, message: str = "", *, code: ErrorCode | int | None = None, next_sequence: int = -1
    ) -> None:
        super().__init__(message, code=code)
        #: the sequence the stream expects next from this producer
        self.next_sequence = next_sequence


class UnknownProducerError(ProtocolError):
    """No state for this producer on the stream (never seen, or expired)
    and a sequence that is not 0 (SPEC §10)."""

    code = ErrorCode.UNKNOWN_PRODUCER


class GroupNotFoundError(ProtocolError):
    """No such consumer group (SPEC §11)."""

    code = ErrorCode.GROUP_NOT_FOUND


class FencedMemberEpochError(ProtocolError):
    """The group member's epoch is not its current one, or it does not hold
    the stream: it joins again (SPEC §15)."""

    code = ErrorCode.FENCED_MEMBER_EPOCH


class UnknownMemberIdError(ProtocolError):
    """The group has no such member (it left, or its session expired): it
    joins again with epoch 0 (SPEC §15)."""

    code = ErrorCode.UNKNOWN_MEMBER_ID


class ObjectStoreUnavailableError(ProtocolError):
    """The records are in the object store only, and it did not answer in
    time (SPEC §14); retriable."""

    code = ErrorCode.OBJECT_STORE_UNAVAILABLE


class AuthenticationFailedError(ProtocolError):
    code = ErrorCode.AUTHENTICATION_FAILED


class AuthorizationFailedError(ProtocolError):
    code = ErrorCode.AUTHORIZATION_FAILED


class NoAvailableDataNodeError(ProtocolError):
    code = ErrorCode.NO_AVAILABLE_DATA_NODE


class DataNodeNotFoundError(ProtocolError):
    code = ErrorCode.DATA_NODE_NOT_FOUND


class HeaderDecodeError(InvalidRequestError):
    """A FlatBuffers header that does not decode as its opcode's table, or
    lacks a required field. Every decode failure becomes this one error."""


class ConnectionClosed(SBPError):
    """The connection is gone; every request still pending on it fails with this."""


class RecordsUnreachableError(SBPError):
    """A reader found records the stream holds that no replica it could
    reach would serve: it stops with this rather than end the read early.
    ``unreachable``: no replica could be connected to at all."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


_BY_CODE: dict[int, type[ProtocolError]] = {
    cls.code: cls
    for cls in (
        UnknownServerError,
        InvalidRequestError,
        UnsupportedVersionError,
        ChecksumMismatchError,
        NotLeaderError,
        RequestTimeoutError,
        ThrottledError,
        UnsupportedOperationError,
        ShuttingDownError,
        FrameTooLargeError,
        AuthenticationFailedError,
        AuthorizationFailedError,
        StreamNotFoundError,
        RangeNotFoundError,
        RangeSealedError,
        OffsetOutOfRangeError,
        StreamDeletedError,
        InvalidRecordBatchError,
        StorageFullError,
        NotPrimaryError,
        EpochFencedError,
        NotEnoughReplicasError,
        OutOfOrderError,
        ProducerFencedError,
        OutOfOrderSequenceError,
        UnknownProducerError,
        GroupNotFoundError,
        FencedMemberEpochError,
        UnknownMemberIdError,
        ObjectStoreUnavailableError,
        NoAvailableDataNodeError,
        DataNodeNotFoundError,
    )
}


def for_code(code: ErrorCode | int) -> type[ProtocolError]:
    """The exception class for a wire error code (``ProtocolError`` if unknown)."""
    return _BY_CODE.get(int(code), ProtocolError)


def error_for(code: ErrorCode | int, message: str = "") -> ProtocolError:
    """An exception instance for a wire error code and message."""
    cls = for_code(code)
    if cls is ProtocolError:
        return ProtocolError(message, code=code)
    return cls(message)


def raise_for_code(code: ErrorCode | int, message: str) -> None:
    """Raise the exception for a per-item error code; nothing for NONE."""
    if code != ErrorCode.NONE:
        raise error_for(code, message)


def code_name(code: ErrorCode | int) -> str:
    """An error code's name, or its number when this version does not know it."""
    return code.name if isinstance(code, ErrorCode) else str(code)


def wire_code(code: ErrorCode | int) -> ErrorCode:
    """The code to answer with: a code this version does not know is UNKNOWN."""
    return code if isinstance(code, ErrorCode) else ErrorCode.UNKNOWN
