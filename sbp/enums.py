"""Wire enumerations (SPEC §2, §1 flags, §3 ClientRole, §6 error codes)."""

from __future__ import annotations

from enum import IntEnum, IntFlag


class Opcode(IntEnum):
    PING = 0x0001
    GOAWAY = 0x0002
    HEARTBEAT = 0x0003
    APPEND = 0x1001
    FETCH = 0x1002
    REPLICATE = 0x1003
    FIND_OFFSETS = 0x1004
    LIST_RANGES = 0x2001
    SEAL_RANGES = 0x2002
    SYNC_RANGES = 0x2003
    DESCRIBE_RANGES = 0x2004
    CREATE_STREAMS = 0x3001
    DELETE_STREAMS = 0x3002
    UPDATE_STREAMS = 0x3003
    GET_STREAMS = 0x3004
    TRIM_STREAMS = 0x3005
    REPORT_METRICS = 0x4001
    DESCRIBE_CLUSTER = 0x4002
    DRAIN_DATA_NODES = 0x4003
    INIT_PRODUCER = 0x5001
    COMMIT_OFFSETS = 0x5002
    FETCH_OFFSETS = 0x5003
    LIST_GROUPS = 0x5004
    DELETE_GROUPS = 0x5005
    GROUP_HEARTBEAT = 0x5006
    #: implementation-private (data node to data node): not in SPEC §2
    PRODUCER_STATE = 0x7001
    #: implementation-private (PM to data node): not in SPEC §2
    RANGE_HOLDINGS = 0x7002
    #: implementation-private (client to PM): not in SPEC §2
    REMOVE_DATA_NODES = 0x7003
    #: implementation-private (client to PM): not in SPEC §2
    REBALANCE = 0x7004
    #: implementation-private (PM to data node): not in SPEC §2
    COMPACTION_KEYS = 0x7005
    #: implementation-private (PM to data node): not in SPEC §2
    COMPACT_RANGES = 0x7006
    #: implementation-private (client to PM): not in SPEC §2
    DESCRIBE_MEMBERS = 0x7007
    #: implementation-private (PM to data node): not in SPEC §2
    UPLOAD_RANGE = 0x7008


#: every opcode value a receiver knows; anything else is an unknown opcode
KNOWN_OPCODES: frozenset[int] = frozenset(int(op) for op in Opcode)


class Flags(IntFlag):
    NONE = 0
    RESPONSE = 0x01
    RESPONSE_END = 0x02
    SYSTEM_ERROR = 0x04


#: the bits that mean something; others are sent as 0 and ignored on receipt
KNOWN_FLAGS = Flags.RESPONSE | Flags.RESPONSE_END | Flags.SYSTEM_ERROR


class ClientRole(IntEnum):
    UNKNOWN = 0
    PM = 1
    DATA_NODE = 2
    CLIENT = 3


class DataNodeState(IntEnum):
    """A data node's state in DESCRIBE_CLUSTER and DRAIN_DATA_NODES (SPEC §12)."""

    ACTIVE = 0
    #: nothing new is placed on it; its ranges are being moved off
    DRAINING = 1
    #: draining and holding no range: it can be stopped and removed
    DRAINED = 2


class ObjectState(IntEnum):
    """Where a range's records are: ``Range.object_state`` (SPEC §14)."""

    #: on the data nodes only
    ON_NODES = 0
    #: also in the object store (copied and checked)
    IN_STORE_TOO = 1
    #: in the object store only; live data nodes read it from there
    IN_STORE_ONLY = 2


class ErrorCode(IntEnum):
    NONE = 0
    UNKNOWN = 1
    INVALID_REQUEST = 2
    UNSUPPORTED_VERSION = 3
    CHECKSUM_MISMATCH = 4
    NOT_LEADER = 5
    TIMEOUT = 6
    THROTTLED = 7
    UNSUPPORTED_OPERATION = 8
    SHUTTING_DOWN = 9
    FRAME_TOO_LARGE = 10
    AUTHENTICATION_FAILED = 11
    AUTHORIZATION_FAILED = 12
    STREAM_NOT_FOUND = 100
    RANGE_NOT_FOUND = 101
    RANGE_SEALED = 102
    OFFSET_OUT_OF_RANGE = 103
    STREAM_DELETED = 104
    INVALID_RECORD_BATCH = 105
    STORAGE_FULL = 106
    NOT_PRIMARY = 107
    EPOCH_FENCED = 108
    NOT_ENOUGH_REPLICAS = 109
    OUT_OF_ORDER = 110
    PRODUCER_FENCED = 111
    OUT_OF_ORDER_SEQUENCE = 112
    UNKNOWN_PRODUCER = 113
    GROUP_NOT_FOUND = 114
    FENCED_MEMBER_EPOCH = 115
    UNKNOWN_MEMBER_ID = 116
    OBJECT_STORE_UNAVAILABLE = 117
    NO_AVAILABLE_DATA_NODE = 200
    DATA_NODE_NOT_FOUND = 201

    @property
    def retriable(self) -> bool:
        """Whether the same request may succeed when sent again (SPEC §6)."""
        return self in _RETRIABLE

    @classmethod
    def coerce(cls, value: int) -> ErrorCode | int:
        """The enum member for a wire value, or the bare int when it is unknown."""
        try:
            return cls(value)
        except ValueError:
            return value


_RETRIABLE = frozenset(
    {
        ErrorCode.CHECKSUM_MISMATCH,
        ErrorCode.NOT_LEADER,
        ErrorCode.TIMEOUT,
        ErrorCode.THROTTLED,
        ErrorCode.SHUTTING_DOWN,
        ErrorCode.RANGE_NOT_FOUND,
        ErrorCode.RANGE_SEALED,
        ErrorCode.STORAGE_FULL,
        ErrorCode.NOT_PRIMARY,
        ErrorCode.NOT_ENOUGH_REPLICAS,
        ErrorCode.OUT_OF_ORDER,
        ErrorCode.NO_AVAILABLE_DATA_NODE,
        ErrorCode.OBJECT_STORE_UNAVAILABLE,
    }
)
