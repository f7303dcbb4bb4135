"""Hypothesis strategies for every header dataclass of sbp.messages, derived
from the wire declarations of its fields, and a list of those classes."""

from __future__ import annotations

import dataclasses
import inspect
from functools import cache
from typing import Any

from hypothesis import strategies as st

from sbp import _flatbuf, messages
from sbp.enums import ClientRole, ErrorCode

#: every table of the protocol, in definition order
MESSAGE_TYPES: list[type[messages.Message]] = [
    cls
    for _, cls in inspect.getmembers(messages, inspect.isclass)
    if issubclass(cls, messages.Message)
    and cls is not messages.Message
    and cls.__module__ == messages.__name__
]

_INT_BITS = {"b": 8, "h": 16, "i": 32, "q": 64}
_MAX_ITEMS = 3  # small vectors keep nested tables (ranges of results) fast


def _int(bits: int) -> st.SearchStrategy[int]:
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    # The extremes often, so the edges of every wire type are exercised.
    return st.one_of(st.sampled_from([low, -1, 0, 1, high]), st.integers(low, high))


def _error_codes() -> st.SearchStrategy[ErrorCode | int]:
    known = set(ErrorCode)
    unknown = st.integers(-(1 << 15), (1 << 15) - 1).filter(lambda v: v not in known)
    return st.one_of(st.sampled_from(list(ErrorCode)), unknown)


def _field(field: dataclasses.Field[Any]) -> st.SearchStrategy[Any]:
    kind = field.metadata["flatbuffers"]
    if isinstance(kind, _flatbuf._Scalar):
        if kind.code == "?":
            return st.booleans()
        if isinstance(field.default, ErrorCode):
            return _error_codes()
        if isinstance(field.default, ClientRole):
            return st.sampled_from(list(ClientRole))
        return _int(_INT_BITS[kind.code])
    if isinstance(kind, _flatbuf._String):
        return st.text(st.characters(codec="utf-8"), max_size=20)
    if isinstance(kind, _flatbuf._StringVector):
        return st.lists(st.text(st.characters(codec="utf-8"), max_size=20), max_size=5).map(tuple)
    if isinstance(kind, _flatbuf._ScalarVector):
        return st.lists(_int(_INT_BITS[kind.code]), max_size=5).map(tuple)
    if isinstance(kind, _flatbuf._TableVector):
        return st.lists(messages_of(kind.cls), max_size=_MAX_ITEMS).map(tuple)
    assert isinstance(kind, _flatbuf._SubTable)
    table = messages_of(kind.cls)
    return table if kind.required else st.none() | table


@cache
def messages_of(cls: type[Any]) -> st.SearchStrategy[Any]:
    """Instances of ``cls`` with any value every field can carry on the wire."""
    return st.builds(cls, **{f.name: _field(f) for f in dataclasses.fields(cls)})
