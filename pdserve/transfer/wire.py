"""Field codecs for message bodies: the typed, bounded building blocks of every wire schema.

A message's body layout is a tuple of `(field name, field codec)` pairs declared once next to
the message class (see `messages.py`); `write_fields` and `read_fields` walk that one tuple in
the same order, so encoding and decoding can never drift apart.

Invariants:
- Every variable-length field has a bound, checked on write (a local bug: `ValueError`) and on
  read before anything is sliced out (a bad peer: `ProtocolError`).
- Integers are little-endian and range-checked; floats are finite IEEE-754 doubles.
- Decoding never trusts a length it has not compared against both its bound and the bytes left.

This module knows nothing about frames, sessions, sockets or KV caches.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Mapping
from enum import IntEnum
from typing import Any, Protocol

from pdserve.errors import ProtocolError

_INT_FORMATS = {8: "<B", 16: "<H", 32: "<I", 64: "<Q"}


class Reader:
    """A cursor over one body; every read names the field it was reading when it fails."""

    __slots__ = ("_buf", "_pos")

    def __init__(self, buf: bytes) -> None:
        self._buf = buf
        self._pos = 0

    def take(self, n: int, what: str) -> bytes:
        """Return the next `n` bytes, or raise ProtocolError if the body ends first."""
        end = self._pos + n
        if end > len(self._buf):
            raise ProtocolError(
                f"body ends inside field {what!r} (needs {n} bytes, {self.remaining} left)"
            )
        chunk = self._buf[self._pos : end]
        self._pos = end
        return chunk

    def unpack(self, fmt: str, what: str) -> Any:
        """Read one struct-packed scalar."""
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    @property
    def remaining(self) -> int:
        """Bytes not yet read."""
        return len(self._buf) - self._pos


class FieldCodec(Protocol):
    """How one field is written and read; `what` names the field in error messages."""

    def write(self, out: bytearray, value: Any, what: str) -> None: ...

    def read(self, reader: Reader, what: str) -> Any: ...


class UInt:
    """An unsigned integer of `bits` bits, optionally with a lower bound (e.g. >= 1)."""

    def __init__(self, bits: int, lo: int = 0) -> None:
        self._fmt = _INT_FORMATS[bits]
        self._lo = lo
        self._hi = (1 << bits) - 1

    def write(self, out: bytearray, value: Any, what: str) -> None:
        # bool is an int subclass; a True where a count belongs is a caller bug.
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{what}: expected int, got {type(value).__name__}")
        if not self._lo <= value <= self._hi:
            raise ValueError(f"{what}: {value} outside [{self._lo}, {self._hi}]")
        out += struct.pack(self._fmt, value)

    def read(self, reader: Reader, what: str) -> Any:
        value: int = reader.unpack(self._fmt, what)
        if value < self._lo:
            raise ProtocolError(f"{what}: {value} is below its minimum {self._lo}")
        return value


class PositiveFloat:
    """A finite, strictly positive double (durations in seconds)."""

    def write(self, out: bytearray, value: Any, what: str) -> None:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"{what}: expected float, got {type(value).__name__}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{what}: {value} is not a finite positive number")
        out += struct.pack("<d", float(value))

    def read(self, reader: Reader, what: str) -> Any:
        value: float = reader.unpack("<d", what)
        if not (math.isfinite(value) and value > 0):
            raise ProtocolError(f"{what}: {value} is not a finite positive number")
        return value


class Bool:
    """One byte, 0 or 1; any other value is a malformed body."""

    def write(self, out: bytearray, value: Any, what: str) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"{what}: expected bool, got {type(value).__name__}")
        out.append(1 if value else 0)

    def read(self, reader: Reader, what: str) -> Any:
        raw = reader.take(1, what)[0]
        if raw > 1:
            raise ProtocolError(f"{what}: {raw} is not a boolean")
        return raw == 1


class EnumU8:
    """An IntEnum member as one byte; unknown values are rejected on read."""

    def __init__(self, enum_type: type[IntEnum]) -> None:
        self._type = enum_type

    def write(self, out: bytearray, value: Any, what: str) -> None:
        if not isinstance(value, self._type):
            raise ValueError(f"{what}: expected {self._type.__name__}, got {value!r}")
        out.append(int(value))

    def read(self, reader: Reader, what: str) -> Any:
        raw = reader.take(1, what)[0]
        try:
            return self._type(raw)
        except ValueError:
            raise ProtocolError(f"{what}: {raw} is not a {self._type.__name__}") from None


class Str:
    """UTF-8 text behind a u16 byte length, at most `max_bytes` bytes."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes

    def write(self, out: bytearray, value: Any, what: str) -> None:
        if not isinstance(value, str):
            raise ValueError(f"{what}: expected str, got {type(value).__name__}")
        raw = value.encode("utf-8")
        if len(raw) > self._max:
            raise ValueError(f"{what}: {len(raw)} bytes exceeds the bound {self._max}")
        out += struct.pack("<H", len(raw)) + raw

    def read(self, reader: Reader, what: str) -> Any:
        n: int = reader.unpack("<H", what)
        if n > self._max:
            raise ProtocolError(f"{what}: length {n} exceeds the bound {self._max}")
        return _utf8(reader.take(n, what), what)


class Bytes:
    """Raw bytes of `min_len..max_len` bytes; a u8 length prefix unless the length is fixed."""

    def __init__(self, min_len: int, max_len: int) -> None:
        if not 0 <= min_len <= max_len <= 255:
            raise ValueError(f"Bytes: bad bounds [{min_len}, {max_len}]")
        self._min = min_len
        self._max = max_len

    def write(self, out: bytearray, value: Any, what: str) -> None:
        if not isinstance(value, bytes):
            raise ValueError(f"{what}: expected bytes, got {type(value).__name__}")
        if not self._min <= len(value) <= self._max:
            raise ValueError(f"{what}: {len(value)} bytes outside [{self._min}, {self._max}]")
        if self._min != self._max:
            out.append(len(value))
        out += value

    def read(self, reader: Reader, what: str) -> Any:
        n = self._min if self._min == self._max else reader.take(1, what)[0]
        if not self._min <= n <= self._max:
            raise ProtocolError(f"{what}: length {n} outside [{self._min}, {self._max}]")
        return reader.take(n, what)


class U32Array:
    """A tuple of u32 values (token ids) behind a u16 count, `min_items..max_items` long."""

    def __init__(self, min_items: int, max_items: int) -> None:
        if not 0 <= min_items <= max_items <= 0xFFFF:
            raise ValueError(f"U32Array: bad bounds [{min_items}, {max_items}]")
        self._min = min_items
        self._max = max_items

    def write(self, out: bytearray, value: Any, what: str) -> None:
        if not isinstance(value, tuple):
            raise ValueError(f"{what}: expected a tuple, got {type(value).__name__}")
        if not self._min <= len(value) <= self._max:
            raise ValueError(f"{what}: {len(value)} items outside [{self._min}, {self._max}]")
        try:
            packed = struct.pack(f"<H{len(value)}I", len(value), *value)
        except struct.error:
            raise ValueError(f"{what}: items must be integers in [0, 2**32)") from None
        out += packed

    def read(self, reader: Reader, what: str) -> Any:
        n: int = reader.unpack("<H", what)
        if not self._min <= n <= self._max:
            raise ProtocolError(f"{what}: {n} items outside [{self._min}, {self._max}]")
        return struct.unpack(f"<{n}I", reader.take(4 * n, what))


Schema = tuple[tuple[str, FieldCodec], ...]


class Nested:
    """A frozen dataclass with its own `WIRE` schema, written inline."""

    def __init__(self, cls: Any) -> None:
        self._cls = cls

    def write(self, out: bytearray, value: Any, what: str) -> None:
        if not isinstance(value, self._cls):
            raise ValueError(f"{what}: expected {self._cls.__name__}, got {value!r}")
        write_fields(out, value, self._cls.WIRE, what)

    def read(self, reader: Reader, what: str) -> Any:
        return self._cls(**read_fields(reader, self._cls.WIRE, what))


def write_fields(out: bytearray, obj: object, schema: Schema, owner: str) -> None:
    """Append every field of `obj` named in `schema`, in schema order."""
    for name, codec in schema:
        codec.write(out, getattr(obj, name), f"{owner}.{name}")


def read_fields(reader: Reader, schema: Schema, owner: str) -> dict[str, Any]:
    """Read the fields of `schema` in order, returning constructor keyword arguments."""
    return {name: codec.read(reader, f"{owner}.{name}") for name, codec in schema}


def check_schema(cls: Any) -> None:
    """Fail at import if a class's `WIRE` schema and its dataclass fields disagree."""
    declared = tuple(name for name, _ in cls.WIRE)
    fields = tuple(f.name for f in dataclasses.fields(cls))
    if declared != fields:
        raise TypeError(f"{cls.__name__}.WIRE lists {declared}, dataclass has {fields}")


FingerprintValue = str | int | float | bool

# Bounds on a fingerprint: generous for digests and shapes, small enough for one body.
MAX_FINGERPRINT_FIELDS = 64
MAX_FINGERPRINT_KEY_BYTES = 64
MAX_FINGERPRINT_STR_BYTES = 256
_TAG_STR, _TAG_INT, _TAG_FLOAT, _TAG_BOOL = b"s", b"i", b"f", b"b"


class Fingerprint:
    """A str -> str|int|float|bool mapping in canonical form.

    Canonical encoding: u8 count, then per entry in ascending order of the key's UTF-8 bytes:
    u8 key length, key, one tag byte (s/i/f/b), value (str: u16 length + UTF-8; int: i64;
    float: f64, finite, -0.0 written as 0.0; bool: u8). Equal mappings encode to equal bytes,
    so the encoding can be hashed; a reader refuses any other order, so decoding is unique too.
    """

    def write(self, out: bytearray, value: Any, what: str) -> None:
        out += encode_fingerprint(value, what)

    def read(self, reader: Reader, what: str) -> Any:
        count = reader.take(1, what)[0]
        if count > MAX_FINGERPRINT_FIELDS:
            raise ProtocolError(f"{what}: {count} fields exceeds {MAX_FINGERPRINT_FIELDS}")
        entries: dict[str, FingerprintValue] = {}
        previous: bytes | None = None
        for _ in range(count):
            key_raw = reader.take(reader.take(1, what)[0], what)
            if previous is not None and key_raw <= previous:
                raise ProtocolError(f"{what}: keys not in canonical (ascending, unique) order")
            previous = key_raw
            key = _utf8(key_raw, what)
            if not key or len(key_raw) > MAX_FINGERPRINT_KEY_BYTES:
                raise ProtocolError(f"{what}: key length {len(key_raw)} out of bounds")
            entries[key] = _read_value(reader, f"{what}[{key!r}]")
        return entries


def encode_fingerprint(fingerprint: Mapping[str, FingerprintValue], what: str = "fp") -> bytes:
    """The canonical bytes of a fingerprint mapping (ValueError if it breaks a bound)."""
    if not isinstance(fingerprint, Mapping):
        raise ValueError(f"{what}: expected a mapping, got {type(fingerprint).__name__}")
    if len(fingerprint) > MAX_FINGERPRINT_FIELDS:
        raise ValueError(f"{what}: {len(fingerprint)} fields exceeds {MAX_FINGERPRINT_FIELDS}")
    items: list[tuple[bytes, FingerprintValue]] = []
    for key, value in fingerprint.items():
        if not isinstance(key, str):
            raise ValueError(f"{what}: key {key!r} is not a str")
        key_raw = key.encode("utf-8")
        if not 0 < len(key_raw) <= MAX_FINGERPRINT_KEY_BYTES:
            raise ValueError(f"{what}: key {key!r} must be 1..{MAX_FINGERPRINT_KEY_BYTES} bytes")
        items.append((key_raw, value))
    out = bytearray([len(items)])
    for key_raw, value in sorted(items, key=lambda item: item[0]):
        out.append(len(key_raw))
        out += key_raw
        _write_value(out, value, f"{what}[{key_raw.decode()!r}]")
    return bytes(out)


def _write_value(out: bytearray, value: object, what: str) -> None:
    # bool before int: True is an int, but a flag and a count must not compare equal here.
    if isinstance(value, bool):
        out += _TAG_BOOL + bytes([value])
    elif isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 63):
            raise ValueError(f"{what}: {value} does not fit in a signed 64-bit integer")
        out += _TAG_INT + struct.pack("<q", value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{what}: {value} is not finite (NaN never compares equal)")
        out += _TAG_FLOAT + struct.pack("<d", value + 0.0)  # + 0.0 turns -0.0 into 0.0
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        if len(raw) > MAX_FINGERPRINT_STR_BYTES:
            raise ValueError(f"{what}: {len(raw)} bytes exceeds {MAX_FINGERPRINT_STR_BYTES}")
        out += _TAG_STR + struct.pack("<H", len(raw)) + raw
    else:
        raise ValueError(f"{what}: {type(value).__name__} is not str, int, float or bool")


def _read_value(reader: Reader, what: str) -> FingerprintValue:
    tag = reader.take(1, what)
    if tag == _TAG_BOOL:
        raw = reader.take(1, what)[0]
        if raw > 1:
            raise ProtocolError(f"{what}: {raw} is not a boolean")
        return raw == 1
    if tag == _TAG_INT:
        number: int = reader.unpack("<q", what)
        return number
    if tag == _TAG_FLOAT:
        real: float = reader.unpack("<d", what)
        if not math.isfinite(real) or (real == 0 and math.copysign(1.0, real) < 0):
            raise ProtocolError(f"{what}: {real} is not a canonical finite float")
        return real
    if tag == _TAG_STR:
        n: int = reader.unpack("<H", what)
        if n > MAX_FINGERPRINT_STR_BYTES:
            raise ProtocolError(f"{what}: length {n} exceeds {MAX_FINGERPRINT_STR_BYTES}")
        return _utf8(reader.take(n, what), what)
    raise ProtocolError(f"{what}: unknown value tag {tag!r}")


def _utf8(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"{what}: not valid UTF-8 ({e.reason})") from None
