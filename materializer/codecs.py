"""Key and value codecs: how keys, namespaces and state values become bytes.

A checkpoint directory is untrusted input, so the default value codec must never execute code
when it decodes. :class:`SafeCodec` (name ``"safe"``) encodes with pickle protocol 5 but only values
built from ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, ``list``, ``tuple`` and
``dict`` (checked before encoding; anything else is a typed error naming the state and the type),
and decodes with an unpickler that refuses every global lookup — the only way a pickle can reach a
callable — so a crafted payload fails with :class:`~dstl.errors.CorruptObjectError` instead of
running code. It was picked over JSON-with-tags and a hand-written tagged encoder by
``bench/backend.py`` (see docs/benchmarks.md): the C pickler does the work, the checks are a type
lookup for scalars.

:class:`PickleCodec` (``"pickle"``) handles any picklable value and **executes code on load from a
malicious store**; it is used only when a state asks for it by name.

Keys: the default key codec maps ``str`` to UTF-8 and ``bytes`` to itself (so the key group of a
key is computable in Spark SQL from the column); other key types need a codec.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Final, Protocol, runtime_checkable

from dstl.checks import check_protocol
from dstl.errors import ConfigTypeError, CorruptObjectError, UsageError

__all__ = [
    "BytesCodec",
    "Codec",
    "KeyCodec",
    "PickleCodec",
    "SafeCodec",
    "StrOrBytesKeyCodec",
    "codec_by_name",
]

_SCALARS: Final = frozenset({type(None), bool, int, float, str, bytes})
_CONTAINERS: Final = frozenset({list, tuple, dict})
_MAX_DEPTH: Final = 64


@runtime_checkable
class Codec(Protocol):
    """Turns values into bytes and back. ``name`` is recorded in state metadata."""

    name: str

    def encode(self, value: Any) -> bytes: ...

    def decode(self, data: bytes) -> Any: ...


class KeyCodec(Protocol):
    name: str

    def encode(self, key: Any) -> bytes: ...

    def decode(self, data: bytes) -> Any: ...


def check_codec(value: object, field: str, owner: str) -> None:
    """``value`` is ``None`` or a :class:`Codec` (a ``str`` name, ``encode`` and ``decode``).

    Raises:
        ConfigTypeError: it is not.
    """
    if value is None:
        return
    expected = "None or a codec with a str name, encode and decode (e.g. SafeCodec())"
    if isinstance(value, type):
        raise ConfigTypeError(field, value, expected, owner=owner,
                              fix="pass an instance, not the class")
    check_protocol(value, field, owner, ("encode", "decode"), expected)
    if not isinstance(getattr(value, "name", None), str):
        raise ConfigTypeError(field, value, expected + " (the name is missing)", owner=owner)


class StrOrBytesKeyCodec:
    """Default key codec: ``str`` -> UTF-8, ``bytes`` -> as is (decodes to ``str`` when the
    metadata says the key was a string)."""

    name = "str-or-bytes"

    def encode(self, key: Any) -> bytes:
        if type(key) is str:
            return key.encode("utf-8")
        if type(key) is bytes:
            return key
        raise UsageError(f"key {key!r} of type {type(key).__name__} cannot be encoded by the "
                         "default key codec (str or bytes); convert the key or pass key_codec=")

    def decode(self, data: bytes) -> Any:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return data


class _NoGlobalsUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing a persistent id")


def _check(value: Any, depth: int = 0) -> None:
    t = type(value)
    if t in _SCALARS:
        return
    if t not in _CONTAINERS or depth > _MAX_DEPTH:
        raise TypeError(t.__name__ if depth <= _MAX_DEPTH else "nesting deeper than 64")
    if t is dict:
        for k, v in value.items():
            _check(k, depth + 1)
            _check(v, depth + 1)
    else:
        for v in value:
            _check(v, depth + 1)


class SafeCodec:
    """The default value codec: plain data only, never executes code on load (see module doc)."""

    name = "safe"

    def encode(self, value: Any) -> bytes:
        t = type(value)
        if t not in _SCALARS:
            try:
                _check(value)
            except TypeError as exc:
                raise UsageError(f"value of type {type(value).__name__} (contains {exc}) cannot "
                                 "be encoded by the safe codec, which takes None, bool, int, "
                                 "float, str, bytes, list, tuple, dict; pass serializer= to the "
                                 "descriptor (e.g. PickleCodec(), only for trusted stores)") from exc
        return pickle.dumps(value, protocol=5)

    def decode(self, data: bytes) -> Any:
        try:
            return _NoGlobalsUnpickler(io.BytesIO(data)).load()
        except Exception as exc:
            raise CorruptObjectError("<state value>", 0, f"safe codec cannot decode "
                                                         f"{len(data)} bytes: {exc}") from exc


class PickleCodec:
    """Any picklable value. WARNING: decoding executes code from the store; trusted stores only."""

    name = "pickle"

    def encode(self, value: Any) -> bytes:
        try:
            return pickle.dumps(value, protocol=5)
        except Exception as exc:
            raise UsageError(f"value of type {type(value).__name__} cannot be pickled: "
                             f"{exc}") from exc

    def decode(self, data: bytes) -> Any:
        return pickle.loads(data)


class BytesCodec:
    """Values that are already bytes (no copy, no framing)."""

    name = "bytes"

    def encode(self, value: Any) -> bytes:
        if type(value) is not bytes:
            raise UsageError(f"the bytes codec takes bytes, got {type(value).__name__}")
        return value

    def decode(self, data: bytes) -> Any:
        return bytes(data)


_BY_NAME: dict[str, type] = {"safe": SafeCodec, "pickle": PickleCodec, "bytes": BytesCodec,
                             "str-or-bytes": StrOrBytesKeyCodec}


def codec_by_name(name: str, *, allow_pickle: bool = False) -> Any:
    """The built-in codec called ``name`` (names are recorded in state metadata).

    Raises:
        UsageError: unknown name, or ``"pickle"`` without ``allow_pickle`` (a restore must not
            start unpickling because a stored metadata record says so).
    """
    if name == "pickle" and not allow_pickle:
        raise UsageError("state metadata asks for the pickle codec; restoring it would execute "
                         "code from the store — pass the state's descriptor with "
                         "serializer=PickleCodec() to allow it")
    cls = _BY_NAME.get(name)
    if cls is None:
        raise UsageError(f"unknown codec {name!r}; built-in codecs: {sorted(_BY_NAME)} "
                         "(custom codecs must be passed in the state descriptor)")
    return cls()
