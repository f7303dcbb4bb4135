"""Golden frame vectors (tests/vectors/frames/): each committed frame decodes,
through the frame decoder and sbp.messages, to exactly the fields stored
beside it, and re-encodes to exactly the same bytes. Regenerate them with
tests/vectors/make_frame_vectors.py only for a deliberate format change."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from sbp import messages
from sbp.enums import Flags, Opcode
from sbp.frames import Frame, decode_frame, encode_frame

VECTOR_DIR = Path(__file__).resolve().parents[1] / "vectors" / "frames"
VECTOR_FILES = sorted(VECTOR_DIR.glob("*.json"))
#: the smallest frame there is (SPEC §1), byte for byte
EMPTY_PING = "00000010 17 0001 00 00000000 01 000000 00000000"


def _load(path: Path) -> dict[str, Any]:
    vector: dict[str, Any] = json.loads(path.read_text())
    return vector


def _as_json(message: messages.Message) -> Any:
    return json.loads(json.dumps(dataclasses.asdict(message)))  # type: ignore[call-overload]


@pytest.mark.parametrize("path", VECTOR_FILES, ids=lambda p: p.stem)
def test_vector_decodes_to_its_fields_and_reencodes_to_its_bytes(path: Path) -> None:
    vector = _load(path)
    wire = bytes.fromhex(vector["frame_hex"])

    frame = decode_frame(wire)
    assert isinstance(frame, Frame)
    assert frame.opcode == vector["opcode"] == Opcode[vector["opcode_name"]]
    assert frame.flags == vector["flags"]
    assert frame.stream_id == vector["stream_id"]
    assert frame.header.hex() == vector["header_hex"]
    assert bytes(frame.payload).hex() == vector["payload_hex"]

    cls = messages.header_type(frame.opcode, frame.flags)
    if vector["header_type"] is None:
        assert cls is None
        header = frame.header  # PING: opaque bytes, echoed as they are
    else:
        assert cls is not None
        assert cls.__name__ == vector["header_type"]
        decoded = cls.decode(frame.header)
        assert _as_json(decoded) == vector["header"]
        header = decoded.encode()

    assert encode_frame(frame.opcode, frame.flags, frame.stream_id, header, frame.payload) == wire


def test_vectors_cover_every_opcode_both_ways() -> None:
    requests, responses = set(), set()
    for path in VECTOR_FILES:
        vector = _load(path)
        flags = Flags(vector["flags"])
        opcode = Opcode(vector["opcode"])
        if flags & Flags.SYSTEM_ERROR:
            continue
        (responses if flags & Flags.RESPONSE else requests).add(opcode)
    assert requests == set(Opcode)
    assert responses == set(Opcode) - {Opcode.GOAWAY}  # GOAWAY is never answered


def test_vectors_include_system_error_and_goaway() -> None:
    types = {_load(path)["header_type"] for path in VECTOR_FILES}
    assert {"SystemErrorHeader", "GoAway"} <= types


def test_the_empty_ping_is_the_smallest_frame() -> None:
    vector = _load(VECTOR_DIR / "ping_request.json")
    expected = EMPTY_PING.replace(" ", "")
    assert vector["frame_hex"] == expected
    assert len(bytes.fromhex(expected)) == 20
    assert encode_frame(Opcode.PING, Flags.NONE, 0) == bytes.fromhex(expected)
