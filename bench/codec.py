"""Codec benchmarks: frames plus FlatBuffers headers on the data path.

    .venv/bin/python -m bench.codec

Each case is timed with timeit, best of several repeats, and reported in µs
per operation. Cases are plain (name, function) pairs: add a row by adding a
``Case`` to the list ``cases()`` returns.
"""

from __future__ import annotations

import os
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flatbuffers

from sbp import messages as m
from sbp._fbs import FetchResponse as GeneratedFetchResponse
from sbp._fbs import FetchResult as GeneratedFetchResult
from sbp.enums import Flags, Opcode
from sbp.frames import Frame, FrameDecoder, encode_frame

REPEATS = 7
#: the APPEND case of the target: one 64 KiB record batch in one frame
APPEND_PAYLOAD_SIZE = 64 * 1024
FETCH_RESULTS = 100


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[], object]
    number: int = 1000  # calls per repeat


def micros_per_call(case: Case) -> float:
    return min(timeit.repeat(case.run, number=case.number, repeat=REPEATS)) / case.number * 1e6


def append_cases() -> list[Case]:
    payload = os.urandom(APPEND_PAYLOAD_SIZE)
    header = m.AppendRequest(
        timeout_ms=5000, append_requests=(m.AppendInfo(42, 0, APPEND_PAYLOAD_SIZE),)
    )
    wire = encode_frame(Opcode.APPEND, Flags.NONE, 7, header.encode(), payload)

    def encode() -> bytes:
        return encode_frame(Opcode.APPEND, Flags.NONE, 7, header.encode(), payload)

    def decode(data: bytes = wire) -> m.AppendRequest:
        (frame,) = FrameDecoder().feed(data)
        assert isinstance(frame, Frame)
        return m.AppendRequest.decode(frame.header)

    def round_trip() -> m.AppendRequest:
        return decode(encode())

    encoded_header = header.encode()
    return [
        Case("APPEND 64 KiB: encode frame + header", encode),
        Case("APPEND 64 KiB: decode frame + header", decode),
        Case("APPEND 64 KiB: round trip (encode + decode)", round_trip),
        Case("APPEND header alone: encode", header.encode, 10_000),
        Case("APPEND header alone: decode", lambda: m.AppendRequest.decode(encoded_header), 10_000),
    ]


def _generated_fetch_response(results: list[m.FetchResult]) -> bytes:
    """The same header built with the generated builder functions."""
    builder = flatbuffers.Builder(4096)
    offsets = []
    for result in results:
        GeneratedFetchResult.FetchResultStart(builder)
        GeneratedFetchResult.FetchResultAddStreamId(builder, result.stream_id)
        GeneratedFetchResult.FetchResultAddRequestIndex(builder, result.request_index)
        GeneratedFetchResult.FetchResultAddErrorCode(builder, result.error_code)
        GeneratedFetchResult.FetchResultAddBatchLength(builder, result.batch_length)
        offsets.append(GeneratedFetchResult.FetchResultEnd(builder))
    GeneratedFetchResponse.FetchResponseStartFetchResponsesVector(builder, len(offsets))
    for offset in reversed(offsets):
        builder.PrependUOffsetTRelative(offset)
    vector = builder.EndVector()
    GeneratedFetchResponse.FetchResponseStart(builder)
    GeneratedFetchResponse.FetchResponseAddFetchResponses(builder, vector)
    builder.Finish(GeneratedFetchResponse.FetchResponseEnd(builder))
    return bytes(builder.Output())


def _generated_fetch_fields(buf: bytes) -> list[tuple[Any, ...]]:
    """Every field of every result read with the generated accessors."""
    response = GeneratedFetchResponse.FetchResponse.GetRootAs(buf, 0)
    fields = []
    for i in range(response.FetchResponsesLength()):
        result = response.FetchResponses(i)
        assert result is not None
        fields.append(
            (
                result.StreamId(),
                result.RequestIndex(),
                result.ErrorCode(),
                result.ErrorMessage(),
                result.BatchLength(),
            )
        )
    return fields


def fetch_cases() -> list[Case]:
    results = [
        m.FetchResult(stream_id=1000 + i, request_index=i, batch_length=65_536)
        for i in range(FETCH_RESULTS)
    ]
    header = m.FetchResponse(fetch_responses=tuple(results))
    encoded = header.encode()
    generated = _generated_fetch_response(results)
    assert m.FetchResponse.decode(generated) == header
    name = f"FETCH response header, {FETCH_RESULTS} results"
    return [
        Case(f"{name}: encode", header.encode, 200),
        Case(f"{name}: decode", lambda: m.FetchResponse.decode(encoded), 200),
        Case(f"{name}: encode, generated code", lambda: _generated_fetch_response(results), 50),
        Case(f"{name}: decode, generated code", lambda: _generated_fetch_fields(generated), 50),
    ]


def cases() -> list[Case]:
    return [*append_cases(), *fetch_cases()]


def main() -> None:
    rows = [(case.name, micros_per_call(case)) for case in cases()]
    width = max(len(name) for name, _ in rows)
    print(f"| {'case':<{width}} | µs per op |")
    print(f"|{'-' * (width + 2)}|----------:|")
    for name, micros in rows:
        print(f"| {name:<{width}} | {micros:9.1f} |")


if __name__ == "__main__":
    main()
