"""Every number of the wire format (SPEC §1), named once."""

from __future__ import annotations

import struct
from typing import Final

MAGIC: Final = 23
HEADER_FORMAT_FLATBUFFERS: Final = 0x01

#: frame_length(4) magic(1) opcode(2) flags(1) stream_id(4)
FIXED_HEADER: Final = struct.Struct(">IBHBI")
FIXED_HEADER_SIZE: Final = FIXED_HEADER.size  # 12
#: header_format(1) header_length(3), read as one big-endian uint32
HEADER_PRELUDE: Final = struct.Struct(">I")
HEADER_PRELUDE_SIZE: Final = HEADER_PRELUDE.size  # 4
CHECKSUM: Final = struct.Struct(">I")
CHECKSUM_SIZE: Final = CHECKSUM.size  # 4
#: the size of the frame_length field itself, which frame_length does not count
LENGTH_FIELD_SIZE: Final = 4

#: frame_length of a frame with no header and no payload
MIN_FRAME_LENGTH: Final = (
    FIXED_HEADER_SIZE - LENGTH_FIELD_SIZE + HEADER_PRELUDE_SIZE + CHECKSUM_SIZE
)
#: bytes on the wire around the header and payload
FRAME_OVERHEAD: Final = MIN_FRAME_LENGTH + LENGTH_FIELD_SIZE  # 20
DEFAULT_MAX_FRAME_LENGTH: Final = 16 * 1024 * 1024
MAX_HEADER_LENGTH: Final = (1 << 24) - 1

#: client stream ids are in [0, 2**31); frames a server starts set the top bit
MAX_CLIENT_STREAM_ID: Final = (1 << 31) - 1
#: the stream id of a connection's first request: its bytes are "\r\n\r\n",
#: so a peer that speaks HTTP (a metrics port given as the PM's) takes the
#: frame's first bytes for a whole request head and answers 400 at once,
#: which the client names, instead of waiting for a line end until the
#: request's deadline
FIRST_CLIENT_STREAM_ID: Final = 0x0D0A0D0A
SERVER_STREAM_ID_BIT: Final = 1 << 31
MAX_STREAM_ID: Final = (1 << 32) - 1

#: a stream's cleanup_policy values that compact it (SPEC §13): 1 compact, 2 compact and delete
COMPACTED_POLICIES: Final = (1, 2)

#: Range.end_offset while the range is open
OPEN_END_OFFSET: Final = -1
#: the largest offset a stream may reach (its next offset included): offsets
#: are int64 on the wire, so an append that would pass it is refused with
#: OFFSET_OUT_OF_RANGE
MAX_RECORD_OFFSET: Final = (1 << 63) - 1

#: a consumer group's name is 1 to this many bytes of UTF-8 (SPEC §11)
MAX_GROUP_NAME_BYTES: Final = 255
#: a group position's metadata is at most this many bytes of UTF-8 (SPEC §11)
MAX_GROUP_METADATA_BYTES: Final = 4096
#: positions in one COMMIT_OFFSETS this implementation takes: a commit is
#: one etcd transaction, whose operations etcd limits (128 by default)
MAX_GROUP_COMMIT_ITEMS: Final = 100
