"""A verified FlatBuffers codec for frozen dataclasses, driven by field declarations.

Each header dataclass in ``sbp.messages`` declares its wire fields with the
helpers below (``int64(0)``, ``string(5)``, ``vector(1, AppendInfo)`` ...) and
is compiled by the ``@table`` decorator into a ``TableCodec``: precompiled
``struct`` layouts that write and read exactly the FlatBuffers binary format
of the schemas in ``fbs/``.

Why not the generated Python: it has no verifier (corrupt input raises any of
half a dozen exception types or decodes silently to garbage) and costs tens of
microseconds per table. The reader here checks every offset, vtable and
vector length against the buffer before touching it, caps the total work a
buffer can cause (shared sub-objects cannot multiply it), and turns every
failure into ``HeaderDecodeError``. Tests cross-check both directions against
the generated code in ``sbp/_fbs``.

Writer layout (any FlatBuffers reader accepts it; it is deterministic, so a
decoded header re-encodes to the same bytes):

- the buffer is written front to back: root offset, then each table followed
  by its strings, vectors and sub-tables, so every uoffset points forward;
- a table is ``[soffset][8-byte scalars][4-byte][2-byte][1-byte][pad][uoffsets]``
  and keeps every scalar field, defaults included, so one type has one layout;
- a string is written when non-empty, a sub-table when not ``None``, a vector
  always (an empty vector is how a required item list says "no items");
- identical vtables are written once per buffer and shared;
- scalars are aligned to their size relative to the buffer start.
"""

from __future__ import annotations

import dataclasses
import operator
import struct
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar, cast

from .errors import HeaderDecodeError

_U32: Final = struct.Struct("<I")
_I32: Final = struct.Struct("<i")
_VTABLE_HEAD: Final = struct.Struct("<HH")
_UOFFSET_SIZE: Final = 4
_METADATA_KEY: Final = "flatbuffers"
_CODEC_ATTRIBUTE: Final = "_fb_codec"
#: distinct vtable layouts remembered per table type; honest writers produce a
#: handful, so a peer sending endless variants only loses the cache, not memory
_MAX_CACHED_PLANS: Final = 64
#: decode work allowed per byte of buffer: every table, string and vector is
#: charged its size, so offsets that point many times at one sub-object
#: cannot turn a small buffer into unbounded work
_WORK_PER_BYTE: Final = 4
_WORK_SLACK: Final = 256
_PADDING: Final = tuple(bytes(n) for n in range(8))

_DECODE_FAILURES = (
    struct.error,
    ValueError,  # includes UnicodeDecodeError
    TypeError,
    IndexError,
    OverflowError,
)


T = TypeVar("T")
C = TypeVar("C", bound=type)


# --------------------------------------------------------------------------- fields


@dataclasses.dataclass(frozen=True, slots=True)
class _Scalar:
    id: int
    code: str  # struct format character
    convert: Callable[[Any], Any] | None = None  # applied to the decoded value

    @property
    def size(self) -> int:
        return struct.calcsize("<" + self.code)


@dataclasses.dataclass(frozen=True, slots=True)
class _String:
    id: int
    required: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class _SubTable:
    id: int
    cls: type
    required: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class _TableVector:
    id: int
    cls: type
    required: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class _ScalarVector:
    id: int
    code: str
    required: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class _StringVector:
    id: int
    required: bool = False


_Reference = _String | _SubTable | _TableVector | _ScalarVector | _StringVector
_VECTORS: Final = (_TableVector, _ScalarVector, _StringVector)
#: the element kind of a string vector
_STRING: Final = _String(-1)
_Kind = _Scalar | _Reference


# Like dataclasses.field(), each helper is typed as the value the field holds
# while it returns the field specifier that carries the wire declaration.
def _declare(kind: _Kind, default: T) -> T:
    return dataclasses.field(default=default, metadata={_METADATA_KEY: kind})


def int8(id: int, *, default: int = 0) -> int:
    """An int8 (``byte``) field with wire id ``id``."""
    return _declare(_Scalar(id, "b"), default)


def int16(id: int, *, default: int = 0) -> int:
    return _declare(_Scalar(id, "h"), default)


def int32(id: int, *, default: int = 0) -> int:
    return _declare(_Scalar(id, "i"), default)


def int64(id: int, *, default: int = 0) -> int:
    return _declare(_Scalar(id, "q"), default)


def boolean(id: int, *, default: bool = False) -> bool:
    return _declare(_Scalar(id, "?"), default)


def enum8(id: int, convert: Callable[[int], T], default: T) -> T:
    """An 8-bit enum field; ``convert`` maps a wire value to the Python value."""
    return _declare(_Scalar(id, "b", convert), default)


def enum16(id: int, convert: Callable[[int], T], default: T) -> T:
    """A 16-bit enum field; ``convert`` maps a wire value to the Python value."""
    return _declare(_Scalar(id, "h", convert), default)


def string(id: int) -> str:
    """A UTF-8 string field; absent reads as ``""``, ``""`` is not written."""
    return _declare(_String(id), "")


def subtable(id: int, cls: type[T]) -> T | None:
    """An optional sub-table field; absent reads as ``None``."""
    return _declare(_SubTable(id, cls), None)


def required_subtable(id: int, cls: type[T]) -> T:
    """A sub-table that must be present: a buffer without it does not decode."""
    # No default: the constructor requires it too.
    return cast(T, dataclasses.field(metadata={_METADATA_KEY: _SubTable(id, cls, required=True)}))


def vector(id: int, cls: type[T], *, required: bool = False) -> tuple[T, ...]:
    """A vector of tables; ``required``: a buffer without it does not decode."""
    empty: tuple[T, ...] = ()
    return _declare(_TableVector(id, cls, required), empty)


def int32_vector(id: int) -> tuple[int, ...]:
    """A vector of int32; absent reads as ``()``."""
    empty: tuple[int, ...] = ()
    return _declare(_ScalarVector(id, "i"), empty)


def int64_vector(id: int) -> tuple[int, ...]:
    """A vector of int64; absent reads as ``()``."""
    empty: tuple[int, ...] = ()
    return _declare(_ScalarVector(id, "q"), empty)


def string_vector(id: int) -> tuple[str, ...]:
    """A vector of UTF-8 strings; absent reads as ``()``."""
    empty: tuple[str, ...] = ()
    return _declare(_StringVector(id), empty)


def table(cls: C) -> C:
    """Class decorator: compile the wire codec of a dataclass declared with the
    field helpers above. Sub-table classes must be compiled first."""
    setattr(cls, _CODEC_ATTRIBUTE, TableCodec(cls))
    return cls


# --------------------------------------------------------------------------- codec


@dataclasses.dataclass(frozen=True, slots=True)
class _Slot:
    """One field of a table as the codec sees it."""

    index: int  # position among the dataclass fields (constructor order)
    name: str
    kind: _Kind
    offset: int = 0  # where the writer puts it, from the table start


@dataclasses.dataclass(frozen=True, slots=True)
class _ReadPlan:
    """How to read the tables whose vtable has one particular content.

    Decoding builds a row: the scalars as unpacked, then every field's default;
    converted values and references overwrite their places in it, and ``pick``
    takes the constructor arguments from it in dataclass order."""

    #: (struct, offset from the table start): the scalars, usually in one read
    reads: tuple[tuple[struct.Struct, int], ...]
    #: (row position, converter)
    converts: tuple[tuple[int, Callable[[Any], Any]], ...]
    #: (offset of the uoffset from the table start, row position, kind)
    references: tuple[tuple[int, int, _Reference], ...]
    pick: Callable[[list[Any]], tuple[Any, ...]]
    missing_required: str | None


class _Reader:
    __slots__ = ("buf", "size", "work_left")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.size = len(buf)
        self.work_left = _WORK_PER_BYTE * self.size + _WORK_SLACK

    def charge(self, amount: int) -> None:
        self.work_left -= amount
        if self.work_left < 0:
            raise HeaderDecodeError("header refers to the same data too many times")


class _Writer:
    __slots__ = ("out", "vtables")

    def __init__(self) -> None:
        self.out = bytearray(_UOFFSET_SIZE)  # the root offset, patched at the end
        self.vtables: dict[bytes, int] = {}


class TableCodec:
    """Writes and reads one table type; built by ``@table``."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.name = cls.__name__
        slots: list[_Slot] = []
        for index, field in enumerate(dataclasses.fields(cls)):
            kind = field.metadata.get(_METADATA_KEY)
            if kind is None:
                raise TypeError(f"{self.name}.{field.name} declares no wire field")
            slots.append(_Slot(index, field.name, kind))
        ids = sorted(slot.kind.id for slot in slots)
        if len(set(ids)) != len(ids):
            raise TypeError(f"{self.name} declares a field id twice")
        self.field_count = ids[-1] + 1 if ids else 0
        self.defaults = tuple(
            None if f.default is dataclasses.MISSING else f.default for f in dataclasses.fields(cls)
        )
        self._layout(slots)
        self._plans: dict[bytes, _ReadPlan] = {}
        self._vtables: dict[int, bytes] = {}

    # The inline part: 8-byte scalars first (the table start is placed at 4
    # mod 8, so after the 4-byte soffset they are 8-aligned), then smaller
    # ones in decreasing size, then the uoffsets of references, 4-aligned.
    def _layout(self, slots: list[_Slot]) -> None:
        scalars = sorted(
            (s for s in slots if isinstance(s.kind, _Scalar)),
            key=lambda s: (-s.kind.size, s.kind.id),  # type: ignore[union-attr]
        )
        references = sorted(
            (s for s in slots if not isinstance(s.kind, _Scalar)), key=lambda s: s.kind.id
        )
        offset = _UOFFSET_SIZE
        placed: list[_Slot] = []
        fmt = "<i"
        for slot in scalars:
            assert isinstance(slot.kind, _Scalar)
            placed.append(dataclasses.replace(slot, offset=offset))
            fmt += slot.kind.code
            offset += slot.kind.size
        pad = -offset % _UOFFSET_SIZE
        offset += pad
        fmt += "x" * pad
        for slot in references:
            placed.append(dataclasses.replace(slot, offset=offset))
            fmt += "x" * _UOFFSET_SIZE  # written as 0, patched once the target is placed
            offset += _UOFFSET_SIZE
        self.slots = placed
        self.inline = struct.Struct(fmt)
        self.object_size = offset
        eight_byte = any(isinstance(s.kind, _Scalar) and s.kind.size == 8 for s in placed)
        self.align = 8 if eight_byte else 4
        self.phase = 4 if eight_byte else 0
        self.references = tuple(s for s in placed if not isinstance(s.kind, _Scalar))
        self._scalar_slots = [s for s in placed if isinstance(s.kind, _Scalar)]
        self._scalars_of = _getter([s.name for s in self._scalar_slots])
        # Vectors are always written; strings when non-empty; tables when set.
        self._writes: tuple[tuple[int, str, int, _Reference, bool], ...] = tuple(
            (1 << bit, s.name, s.offset, s.kind, isinstance(s.kind, _VECTORS))
            for bit, s in enumerate(self.references)
            if not isinstance(s.kind, _Scalar)
        )

    # ------------------------------------------------------------------ write

    def _vtable(self, present: int) -> bytes:
        """The vtable for a table whose references in bitmask ``present`` are set."""
        vtable = self._vtables.get(present)
        if vtable is None:
            entries = [0] * self.field_count
            for slot in self.slots:
                if isinstance(slot.kind, _Scalar):
                    entries[slot.kind.id] = slot.offset
            for bit, slot in enumerate(self.references):
                if present >> bit & 1:
                    entries[slot.kind.id] = slot.offset
            vtable = struct.pack(
                f"<HH{self.field_count}H",
                4 + 2 * self.field_count,
                self.object_size,
                *entries,
            )
            self._vtables[present] = vtable
        return vtable

    def write(self, writer: _Writer, obj: Any) -> int:
        """Append ``obj`` and everything it refers to; return the table's position."""
        out = writer.out
        present = 0
        children: list[tuple[int, _Reference, Any]] = []
        for bit, name, offset, kind, always in self._writes:
            value = getattr(obj, name)
            if always or value:
                present |= bit
                children.append((offset, kind, value))
        vtable = self._vtable(present)
        vtable_pos = writer.vtables.get(vtable)
        if vtable_pos is None:
            if len(out) & 1:
                out.append(0)
            vtable_pos = len(out)
            out += vtable
            writer.vtables[vtable] = vtable_pos
        out += _PADDING[(self.phase - len(out)) % self.align]
        pos = len(out)
        scalars = self._scalars_of(obj)
        try:
            out += self.inline.pack(pos - vtable_pos, *scalars)
        except struct.error:
            raise ValueError(self._out_of_range(scalars)) from None
        for offset, kind, value in children:
            target = _write_reference(writer, kind, value)
            _U32.pack_into(out, pos + offset, target - pos - offset)
        return pos

    def _out_of_range(self, scalars: tuple[Any, ...]) -> str:
        """Name the field that ``self.inline.pack`` refused (struct does not)."""
        for slot, value in zip(self._scalar_slots, scalars, strict=True):
            try:
                struct.pack("<" + slot.kind.code, value)  # type: ignore[union-attr]
            except struct.error as exc:
                return f"{self.name}.{slot.name} = {value!r} does not fit its wire type: {exc}"
        return f"{self.name} has a field that does not fit its wire type"

    # ------------------------------------------------------------------ read

    def _plan(self, vtable: bytes) -> _ReadPlan:
        plan = self._plans.get(vtable)
        if plan is not None:
            return plan
        object_size, *entries = struct.unpack_from(f"<{len(vtable) // 2 - 1}H", vtable, 2)
        scalars: list[tuple[int, _Slot]] = []
        references: list[tuple[int, _Slot]] = []
        missing: list[str] = []
        for slot in self.slots:
            kind = slot.kind
            offset = entries[kind.id] if kind.id < len(entries) else 0
            if offset == 0:
                if not isinstance(kind, _Scalar) and kind.required:
                    missing.append(slot.name)
                continue
            size = kind.size if isinstance(kind, _Scalar) else _UOFFSET_SIZE
            if offset < _UOFFSET_SIZE or offset + size > object_size:
                raise HeaderDecodeError(f"{self.name}.{slot.name} lies outside its table")
            (scalars if isinstance(kind, _Scalar) else references).append((offset, slot))
        reads, read_order = _scalar_reads(scalars)
        # Row positions: the unpacked scalars first, then one default per field.
        position = {slot.index: at for at, slot in enumerate(read_order)}
        for index in range(len(self.defaults)):
            position.setdefault(index, len(read_order) + index)
        plan = _ReadPlan(
            reads=reads,
            converts=tuple(
                (position[slot.index], slot.kind.convert)
                for slot in read_order
                if isinstance(slot.kind, _Scalar) and slot.kind.convert is not None
            ),
            references=tuple(
                (offset, position[slot.index], slot.kind)  # type: ignore[misc]
                for offset, slot in references
            ),
            pick=_picker([position[index] for index in range(len(self.defaults))]),
            missing_required=f"{self.name} lacks required {', '.join(missing)}"
            if missing
            else None,
        )
        if len(self._plans) < _MAX_CACHED_PLANS:
            self._plans[vtable] = plan
        return plan

    def read(self, reader: _Reader, pos: int) -> Any:
        """The dataclass for the table at ``pos``, every access bounds-checked."""
        return self.read_all(reader, (pos,))[0]

    def read_all(self, reader: _Reader, positions: Sequence[int]) -> list[Any]:
        """The dataclasses for the tables at ``positions`` (a vector's elements).

        One loop for a whole vector: on the hot path (a FETCH response with
        many results) per-element calls would cost as much as the decoding."""
        reader.charge(_UOFFSET_SIZE * len(positions))
        buf = reader.buf
        size = reader.size
        cls = self.cls
        defaults = self.defaults
        unpack_u32 = _U32.unpack_from
        # Elements of a vector normally share one vtable: its checks and plan
        # lookup are done once.
        last_vtable_pos = -1
        object_size = 0
        plan: _ReadPlan | None = None
        results = []
        for pos in positions:
            if pos + _UOFFSET_SIZE > size:
                raise HeaderDecodeError(f"{self.name} table at {pos} lies outside the buffer")
            vtable_pos = pos - _I32.unpack_from(buf, pos)[0]
            if vtable_pos != last_vtable_pos or plan is None:
                if vtable_pos < 0 or vtable_pos + 4 > size:
                    raise HeaderDecodeError(f"{self.name} vtable lies outside the buffer")
                vtable_size, object_size = _VTABLE_HEAD.unpack_from(buf, vtable_pos)
                if vtable_size < 4 or vtable_size & 1 or vtable_pos + vtable_size > size:
                    raise HeaderDecodeError(f"{self.name} vtable is malformed")
                plan = self._plan(buf[vtable_pos : vtable_pos + vtable_size])
                if plan.missing_required is not None:
                    raise HeaderDecodeError(plan.missing_required)
                last_vtable_pos = vtable_pos
            if pos + object_size > size:
                raise HeaderDecodeError(f"{self.name} table overruns the buffer")
            row: list[Any] = []
            for layout, offset in plan.reads:
                row += layout.unpack_from(buf, pos + offset)
            row += defaults
            for at, convert in plan.converts:
                row[at] = convert(row[at])
            for offset, at, kind in plan.references:
                field_pos = pos + offset
                row[at] = _read_reference(reader, kind, field_pos + unpack_u32(buf, field_pos)[0])
            results.append(cls(*plan.pick(row)))
        return results


def _getter(names: list[str]) -> Callable[[Any], tuple[Any, ...]]:
    """A function returning the named attributes of an object as a tuple."""
    if not names:
        return lambda obj: ()
    if len(names) == 1:
        (only,) = names
        return lambda obj: (getattr(obj, only),)
    return operator.attrgetter(*names)


def _picker(positions: list[int]) -> Callable[[list[Any]], tuple[Any, ...]]:
    if len(positions) == 1:
        (only,) = positions
        return lambda row: (row[only],)
    return operator.itemgetter(*positions)


def _scalar_reads(
    scalars: list[tuple[int, _Slot]],
) -> tuple[tuple[tuple[struct.Struct, int], ...], list[_Slot]]:
    """The reads of a table's scalars and the fields they yield, in order: one
    struct for all of them when they do not overlap (any real writer), else
    one per field (a crafted buffer still decodes)."""
    if not scalars:
        return (), []
    scalars.sort(key=lambda item: item[0])
    order = [slot for _, slot in scalars]
    codes = [slot.kind.code for slot in order]  # type: ignore[union-attr]
    start = scalars[0][0]
    fmt = "<"
    cursor = start
    for (offset, _), code in zip(scalars, codes, strict=True):
        if offset < cursor:
            return tuple(
                (struct.Struct("<" + code), offset)
                for (offset, _), code in zip(scalars, codes, strict=True)
            ), order
        fmt += "x" * (offset - cursor) + code
        cursor = offset + struct.calcsize("<" + code)
    return ((struct.Struct(fmt), start),), order


def _codec_of(cls: type) -> TableCodec:
    codec: TableCodec = getattr(cls, _CODEC_ATTRIBUTE)
    return codec


def _write_reference(writer: _Writer, kind: _Reference, value: Any) -> int:
    out = writer.out
    if isinstance(kind, _SubTable):
        return _codec_of(kind.cls).write(writer, value)
    if isinstance(kind, _String):
        data = value.encode()
        out += _PADDING[-len(out) % 4]
        pos = len(out)
        out += _U32.pack(len(data))
        out += data
        out.append(0)  # FlatBuffers strings are NUL-terminated
        return pos
    if isinstance(kind, _TableVector | _StringVector):
        count = len(value)
        out += _PADDING[-len(out) % 4]
        pos = len(out)
        out += _U32.pack(count)
        out += bytes(_UOFFSET_SIZE * count)
        first = pos + _UOFFSET_SIZE
        if isinstance(kind, _StringVector):
            targets = [_write_reference(writer, _STRING, item) for item in value]
        else:
            codec = _codec_of(kind.cls)
            targets = [codec.write(writer, item) for item in value]
        if count:
            struct.pack_into(
                f"<{count}I",
                out,
                first,
                *[t - first - _UOFFSET_SIZE * i for i, t in enumerate(targets)],
            )
        return pos
    # Scalar vector: the elements, not the length, must be aligned to their size.
    element = struct.calcsize("<" + kind.code)
    out += bytes((-len(out) - _UOFFSET_SIZE) % max(element, _UOFFSET_SIZE))
    pos = len(out)
    try:
        out += struct.pack(f"<I{len(value)}{kind.code}", len(value), *value)
    except struct.error as exc:
        raise ValueError(f"a vector element does not fit its wire type: {exc}") from None
    return pos


def _read_reference(reader: _Reader, kind: _Reference, pos: int) -> Any:
    buf = reader.buf
    if isinstance(kind, _SubTable):
        return _codec_of(kind.cls).read(reader, pos)
    if pos + _UOFFSET_SIZE > reader.size:
        raise HeaderDecodeError(f"offset {pos} lies outside the buffer")
    (count,) = _U32.unpack_from(buf, pos)
    first = pos + _UOFFSET_SIZE
    if isinstance(kind, _String):
        end = first + count
        if end > reader.size:
            raise HeaderDecodeError(f"string of {count} bytes overruns the buffer")
        reader.charge(_UOFFSET_SIZE + count)
        return buf[first:end].decode()
    if isinstance(kind, _TableVector):
        if first + _UOFFSET_SIZE * count > reader.size:
            raise HeaderDecodeError(f"vector of {count} tables overruns the buffer")
        reader.charge(_UOFFSET_SIZE * (1 + count))
        offsets = struct.unpack_from(f"<{count}I", buf, first)
        return tuple(
            _codec_of(kind.cls).read_all(
                reader,
                [first + _UOFFSET_SIZE * i + offset for i, offset in enumerate(offsets)],
            )
        )
    if isinstance(kind, _StringVector):
        if first + _UOFFSET_SIZE * count > reader.size:
            raise HeaderDecodeError(f"vector of {count} strings overruns the buffer")
        reader.charge(_UOFFSET_SIZE * (1 + count))
        offsets = struct.unpack_from(f"<{count}I", buf, first)
        return tuple(
            _read_reference(reader, _STRING, first + _UOFFSET_SIZE * i + offset)
            for i, offset in enumerate(offsets)
        )
    element = struct.calcsize("<" + kind.code)
    if first + element * count > reader.size:
        raise HeaderDecodeError(f"vector of {count} scalars overruns the buffer")
    reader.charge(_UOFFSET_SIZE + element * count)
    return struct.unpack_from(f"<{count}{kind.code}", buf, first)


# --------------------------------------------------------------------------- roots


def encode_root(obj: Any) -> bytes:
    """The FlatBuffers bytes of a compiled dataclass as a buffer's root table."""
    writer = _Writer()
    root = _codec_of(type(obj)).write(writer, obj)
    _U32.pack_into(writer.out, 0, root)
    return bytes(writer.out)


def decode_root(cls: type[T], buf: bytes | bytearray | memoryview) -> T:
    """Decode a buffer whose root table is ``cls``; any failure is HeaderDecodeError."""
    data = buf if isinstance(buf, bytes) else bytes(buf)
    codec = _codec_of(cls)
    if len(data) < 2 * _UOFFSET_SIZE:
        raise HeaderDecodeError(f"{codec.name} header of {len(data)} bytes is too short")
    try:
        result: T = codec.read(_Reader(data), _U32.unpack_from(data, 0)[0])
    except HeaderDecodeError:
        raise
    except _DECODE_FAILURES as exc:
        raise HeaderDecodeError(f"{codec.name} header does not decode: {exc!r}") from exc
    return result


__all__ = [
    "TableCodec",
    "boolean",
    "decode_root",
    "encode_root",
    "enum8",
    "enum16",
    "int8",
    "int16",
    "int32",
    "int64",
    "int64_vector",
    "required_subtable",
    "string",
    "string_vector",
    "subtable",
    "table",
    "vector",
]
