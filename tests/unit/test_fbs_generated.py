"""The generated FlatBuffers code is current, and sbp.messages speaks exactly
the schemas' format: the generated accessors read what sbp.messages writes,
and sbp.messages decodes what the generated builders write."""

from __future__ import annotations

import dataclasses
import filecmp
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import flatbuffers
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbp import messages
from tests.unit.message_strategies import MESSAGE_TYPES, messages_of

REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATED_DIR = REPO_ROOT / "sbp" / "_fbs"
#: messages whose schema table has another name (see fbs/common.fbs)
SCHEMA_NAMES = {"Range": "RangeDescriptor", "SystemErrorHeader": "SystemError"}


def _schema_name(cls: type[Any]) -> str:
    return SCHEMA_NAMES.get(cls.__name__, cls.__name__)


def _generated_files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file()}


def test_generated_code_is_current(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "fbs" / "generate.py"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    committed = _generated_files(GENERATED_DIR)
    fresh = _generated_files(tmp_path)
    assert fresh == committed, "run `make fbs`"
    _, mismatch, errors = filecmp.cmpfiles(GENERATED_DIR, tmp_path, sorted(fresh), shallow=False)
    assert (mismatch, errors) == ([], []), "run `make fbs`"


def test_every_schema_table_has_a_message_and_back() -> None:
    enums = {"ErrorCode", "ClientRole"}
    tables = {p.stem for p in GENERATED_DIR.glob("*.py") if p.stem != "__init__"} - enums
    assert tables == {_schema_name(cls) for cls in MESSAGE_TYPES}


def test_schema_enums_match_sbp_enums() -> None:
    from sbp._fbs.ClientRole import ClientRole as GeneratedClientRole
    from sbp._fbs.ErrorCode import ErrorCode as GeneratedErrorCode
    from sbp.enums import ClientRole, ErrorCode

    for generated, ours in ((GeneratedErrorCode, ErrorCode), (GeneratedClientRole, ClientRole)):
        values = {k: v for k, v in vars(generated).items() if not k.startswith("_")}
        assert values == {member.name: member.value for member in ours}


# --------------------------------------------------------------------------- object API bridge


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _object_api_class(cls: type[Any]) -> Any:
    name = _schema_name(cls)
    return getattr(importlib.import_module(f"sbp._fbs.{name}"), f"{name}T")


def _to_object_api(message: Any) -> Any:
    """The generated object-API twin of a message (``AppendRequestT`` ...)."""
    twin = _object_api_class(type(message))()
    for field in dataclasses.fields(message):
        value = getattr(message, field.name)
        if isinstance(value, tuple):
            value = [_to_object_api(v) if dataclasses.is_dataclass(v) else v for v in value]
        elif dataclasses.is_dataclass(value):
            value = _to_object_api(value)
        setattr(twin, _camel(field.name), value)
    return twin


def _from_object_api(twin: Any, cls: type[Any]) -> dict[str, Any]:
    """The fields of a generated object as plain values, to compare with a message."""
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        value = getattr(twin, _camel(field.name))
        kind = field.metadata["flatbuffers"]
        nested = getattr(kind, "cls", None)
        if isinstance(value, bytes):
            value = value.decode()
        elif value is None and field.default == "":
            value = ""
        elif value is None and field.default == ():
            value = ()
        elif isinstance(value, np.ndarray):
            value = tuple(int(v) for v in value)
        elif isinstance(value, list) and nested is None:  # strings
            value = tuple(v.decode() if isinstance(v, bytes) else v for v in value)
        elif isinstance(value, list):
            value = tuple(_from_object_api(v, nested) for v in value)
        elif value is not None and nested is not None:
            value = _from_object_api(value, nested)
        fields[field.name] = value
    return fields


def _fields_of(message: Any) -> dict[str, Any]:
    return {f.name: _nested_fields(getattr(message, f.name)) for f in dataclasses.fields(message)}


def _nested_fields(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(_nested_fields(v) for v in value)
    if dataclasses.is_dataclass(value):
        return _fields_of(value)
    return value


_CROSS_CHECK = settings(max_examples=15, deadline=None)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.__name__)
@_CROSS_CHECK
@given(data=st.data())
def test_generated_code_reads_what_messages_write(cls: type[Any], data: st.DataObject) -> None:
    message = data.draw(messages_of(cls))
    twin = _object_api_class(cls).InitFromPackedBuf(message.encode(), 0)
    assert _from_object_api(twin, cls) == _fields_of(message)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.__name__)
@_CROSS_CHECK
@given(data=st.data())
def test_messages_read_what_generated_code_writes(cls: type[Any], data: st.DataObject) -> None:
    message = data.draw(messages_of(cls))
    builder = flatbuffers.Builder(256)
    builder.Finish(_to_object_api(message).Pack(builder))
    assert cls.decode(bytes(builder.Output())) == message


def test_schema_default_of_end_offset_is_open() -> None:
    from sbp._fbs import RangeDescriptor as GeneratedRange

    builder = flatbuffers.Builder(64)
    GeneratedRange.Start(builder)
    GeneratedRange.AddStreamId(builder, 7)
    builder.Finish(GeneratedRange.End(builder))
    decoded = messages.Range.decode(bytes(builder.Output()))
    assert decoded == messages.Range(stream_id=7)
    assert decoded.end_offset == -1
    assert decoded.is_open


def test_a_required_vector_left_out_by_another_writer_does_not_decode() -> None:
    from sbp._fbs import AppendRequest as GeneratedAppendRequest
    from sbp.errors import HeaderDecodeError

    builder = flatbuffers.Builder(64)
    GeneratedAppendRequest.Start(builder)
    GeneratedAppendRequest.AddTimeoutMs(builder, 100)
    builder.Finish(GeneratedAppendRequest.End(builder))
    with pytest.raises(HeaderDecodeError, match="append_requests"):
        messages.AppendRequest.decode(bytes(builder.Output()))
