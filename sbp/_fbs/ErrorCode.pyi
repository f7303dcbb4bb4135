from __future__ import annotations

import flatbuffers
import numpy as np

import typing
from typing import cast

uoffset: typing.TypeAlias = flatbuffers.number_types.UOffsetTFlags.py_type

class ErrorCode(object):
  NONE = cast(int, ...)
  UNKNOWN = cast(int, ...)
  INVALID_REQUEST = cast(int, ...)
  UNSUPPORTED_VERSION = cast(int, ...)
  CHECKSUM_MISMATCH = cast(int, ...)
  NOT_LEADER = cast(int, ...)
  TIMEOUT = cast(int, ...)
  THROTTLED = cast(int, ...)
  UNSUPPORTED_OPERATION = cast(int, ...)
  SHUTTING_DOWN = cast(int, ...)
  FRAME_TOO_LARGE = cast(int, ...)
  AUTHENTICATION_FAILED = cast(int, ...)
  AUTHORIZATION_FAILED = cast(int, ...)
  STREAM_NOT_FOUND = cast(int, ...)
  RANGE_NOT_FOUND = cast(int, ...)
  RANGE_SEALED = cast(int, ...)
  OFFSET_OUT_OF_RANGE = cast(int, ...)
  STREAM_DELETED = cast(int, ...)
  INVALID_RECORD_BATCH = cast(int, ...)
  STORAGE_FULL = cast(int, ...)
  NOT_PRIMARY = cast(int, ...)
  EPOCH_FENCED = cast(int, ...)
  NOT_ENOUGH_REPLICAS = cast(int, ...)
  OUT_OF_ORDER = cast(int, ...)
  PRODUCER_FENCED = cast(int, ...)
  OUT_OF_ORDER_SEQUENCE = cast(int, ...)
  UNKNOWN_PRODUCER = cast(int, ...)
  GROUP_NOT_FOUND = cast(int, ...)
  FENCED_MEMBER_EPOCH = cast(int, ...)
  UNKNOWN_MEMBER_ID = cast(int, ...)
  OBJECT_STORE_UNAVAILABLE = cast(int, ...)
  NO_AVAILABLE_DATA_NODE = cast(int, ...)
  DATA_NODE_NOT_FOUND = cast(int, ...)

