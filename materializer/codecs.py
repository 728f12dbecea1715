"""Key and value codecs: how keys, namespaces and state values become bytes.

A checkpoint directory is untrusted input, so the default value codec must never execute code
when it decodes. :class:`SafeCodec` (name ``"safe"``) encodes with pickle protocol 5 but only values
built from ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, ``list``, ``tuple`` and
``dict`` (checked before encoding; anything else is a typed error naming the state and the type),
and decodes with an unpickler that refuses every global lookup — the only way a pickle can reach a
callable — so a crafted payload fails with :class:`~dstl.errors.CorruptObjectError` instead of
running code. Decoding is also bounded and checked like encoding: before unpickling, the memory
the value would take is estimated from the pickle (:func:`decoded_size_bound`: a count of
container opcodes, at C speed; for the rare pickle where that exceeds the limit, a walk over its
opcodes) and a value above ``max_decoded_bytes`` is refused — a pickle of a million ``{}`` is
3 MB but takes 70 MB decoded; after unpickling, the value must again be built only from the
types above and nest at most 64 levels (a crafted pickle can build sets, bytearrays or lists
100,000 deep, which the encoder never writes). The encoder refuses a value the decoder would
refuse, so a job never writes a value it cannot restore with the same limit. It was picked over JSON-with-tags and a hand-written tagged encoder by
``bench/backend.py`` (see docs/benchmarks.md): the C pickler does the work, the checks are a type
lookup for scalars.

:class:`PickleCodec` (``"pickle"``) handles any picklable value and **executes code on load from a
malicious store**; it is used only when a state asks for it by name.

:class:`TtlCodec` (``"ttl:<inner>"``) wraps the codec of a state with a time to live
(:mod:`materializer.ttl`): each value (each list element, each map value) is stored as
``u8 format (1) | i64 expiry_ms (big-endian) | the inner codec's bytes`` and decodes to the pair
``(expiry_ms, value)``. The name in the state's metadata says a state's values carry expiries,
so a restore, the reader and the agent decode them without knowing the descriptor.

Keys: the default key codec maps ``str`` to UTF-8 and ``bytes`` to itself (so the key group of a
key is computable in Spark SQL from the column); other key types need a codec.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
from typing import Any, Final, Protocol, runtime_checkable

from dstl.checks import check_protocol
from dstl.errors import ConfigTypeError, CorruptObjectError, UsageError

__all__ = [
    "DEFAULT_MAX_DECODED_VALUE_BYTES",
    "BytesCodec",
    "Codec",
    "KeyCodec",
    "PickleCodec",
    "SafeCodec",
    "StrOrBytesKeyCodec",
    "TTL_CODEC_PREFIX",
    "TtlCodec",
    "codec_by_name",
    "decode_hashable",
    "decoded_size_bound",
    "expiry_of",
]

_SCALARS: Final = frozenset({type(None), bool, int, float, str, bytes})
_CONTAINERS: Final = frozenset({list, tuple, dict})
_MAX_DEPTH: Final = 64
#: Largest estimated in-memory size of one decoded value (see :func:`decoded_size_bound`): a
#: crafted pickle cannot make a reader allocate more for one value, and the encoder refuses a
#: value above it. Set per backend by ``BackendOptions.max_value_decoded_bytes``.
DEFAULT_MAX_DECODED_VALUE_BYTES: Final = 64 * 1024 * 1024

# Cheap bound: every opcode byte costs at most _PER_BYTE (a scalar, a pointer, a memo slot),
# every byte that could be a container opcode at most _PER_CONTAINER (an empty set is 216 bytes).
_PER_BYTE: Final = 16
_PER_CONTAINER: Final = 224
_CONTAINER_OPCODES: Final = tuple(bytes([c]) for c in b"}]\x8f\x91\x85\x86\x87(")
# The walk's costs per opcode: the object it builds (an estimate of its CPython size), plus
# _PER_PUSH for each value it leaves on the stack (its slot in a container, dict entries too).
_PER_PUSH: Final = 16  # a pointer in its container, with the container's over-allocation
_OPCODE_COST: Final = {  # CPython 3.11 sizes; BININT1's values (0..255) are cached ints
    "EMPTY_DICT": 64, "DICT": 64, "EMPTY_LIST": 56, "LIST": 56, "EMPTY_SET": 216,
    "FROZENSET": 216, "TUPLE": 64, "TUPLE1": 48, "TUPLE2": 56, "TUPLE3": 64, "BININT": 28,
    "BININT2": 28, "INT": 28, "LONG": 28, "LONG1": 28, "LONG4": 28, "BINFLOAT": 24, "FLOAT": 24,
    "MEMOIZE": 16, "PUT": 16, "BINPUT": 16, "LONG_BINPUT": 16, "SETITEM": 32, "BYTEARRAY8": 57,
}
_TEXT_OBJECT: Final = 49  # a str/bytes object's header; its length comes on top
#: SafeCodec.decode's memo: encodings up to this long, at most this many, immutable scalars only.
_MEMO_MAX_BYTES: Final = 32
_MEMO_MAX_ENTRIES: Final = 4096
_MEMO_TYPES: Final = frozenset({type(None), bool, int, float, str, bytes})
_MISS: Final = object()


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
    """Raise TypeError unless ``value`` is built from the allowed types, nested at most 64
    levels. Flat containers are checked at C speed (the set of their element types)."""
    t = type(value)
    if t in _SCALARS:
        return
    if t not in _CONTAINERS or depth > _MAX_DEPTH:
        raise TypeError(t.__name__ if depth <= _MAX_DEPTH else "nesting deeper than 64")
    if t is dict:
        if _SCALARS.issuperset(map(type, value)) and _SCALARS.issuperset(
                map(type, value.values())):
            return
        for k, v in value.items():
            _check(k, depth + 1)
            _check(v, depth + 1)
    elif not _SCALARS.issuperset(map(type, value)):
        for v in value:
            if type(v) not in _SCALARS:
                _check(v, depth + 1)


def decoded_size_bound(data: bytes | bytearray | memoryview, limit: int) -> int:
    """An estimate (from above) of the memory unpickling ``data`` takes, exact enough to decide
    against ``limit``: a cheap count first (C speed), the walk over the opcodes only when the
    count exceeds ``limit``.

    Raises:
        ValueError: the walk found a malformed pickle.
    """
    view = data if isinstance(data, bytes) else bytes(data)
    cheap = _PER_BYTE * len(view) + _PER_CONTAINER * sum(view.count(op)
                                                         for op in _CONTAINER_OPCODES)
    if cheap <= limit:
        return cheap
    return _walk_bound(view, limit)


def _opcode_table() -> dict[int, tuple[str, int, int]]:
    """Opcode byte -> (name, argument size code as in pickletools, fixed cost)."""
    table = {}
    for op in pickletools.opcodes:
        n = op.arg.n if op.arg is not None else 0
        pushes = op.name not in _NO_PUSH and any(
            s is not pickletools.markobject for s in op.stack_after)
        table[ord(op.code)] = (op.name, n, _OPCODE_COST.get(op.name, 0) + _PER_PUSH * pushes)
    return table


# Opcodes that change a value in place or only steer the machine: nothing new is pushed.
_NO_PUSH: Final = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD",
                             "PROTO", "STOP", "FRAME", "MARK", "POP", "POP_MARK"})
_OPCODES: Final = _opcode_table()


def _walk_bound(data: bytes, limit: int) -> int:
    """The cost of ``data`` opcode by opcode (arguments are skipped, never copied); stops as
    soon as ``limit`` is exceeded or at STOP."""
    n = len(data)
    pos = total = 0
    while pos < n:
        info = _OPCODES.get(data[pos])
        if info is None:
            raise ValueError(f"unknown pickle opcode {data[pos]:#04x} at byte {pos}")
        name, argn, cost = info
        pos += 1
        length = -1
        if argn > 0:
            pos += argn
        elif argn == -1:  # up to a newline (two lines for GLOBAL and INST)
            for _ in range(2 if name in ("GLOBAL", "INST") else 1):
                nl = data.find(b"\n", pos)
                if nl < 0:
                    raise ValueError(f"{name} at byte {pos - 1} has no newline")
                length, pos = nl - pos, nl + 1
        elif argn < -1:
            width = {-2: 1, -3: 4, -4: 4, -5: 8}[argn]
            length = int.from_bytes(data[pos:pos + width], "little", signed=argn == -3)
            pos += width + max(length, 0)
        if pos > n or (argn < -1 and length < 0):
            raise ValueError(f"{name} at byte {pos} runs past the end of the pickle")
        total += cost + (_TEXT_OBJECT + length if length >= 0 else 0)
        if name == "STOP" or total > limit:
            break
    return total


class SafeCodec:
    """The default value codec: plain data only, never executes code on load, bounded memory on
    decode (see the module docstring).

    Args:
        max_decoded_bytes: the largest estimated in-memory size of one value (encode and
            decode; see :func:`decoded_size_bound`).
    """

    name = "safe"

    def __init__(self, max_decoded_bytes: int = DEFAULT_MAX_DECODED_VALUE_BYTES) -> None:
        if isinstance(max_decoded_bytes, bool) or not isinstance(max_decoded_bytes, int) \
                or max_decoded_bytes < 1:
            raise UsageError(f"SafeCodec(max_decoded_bytes={max_decoded_bytes!r}): expected an "
                             "int >= 1")
        self.max_decoded_bytes = max_decoded_bytes
        # short encodings already decoded -> their (immutable) value; see decode()
        self._memo: dict[bytes, Any] = {}
        self._fast = max_decoded_bytes >= _MEMO_MAX_BYTES * _PER_BYTE

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
        data = pickle.dumps(value, protocol=5)
        if len(data) * _PER_BYTE > self.max_decoded_bytes:  # else the bound holds anyway
            bound = decoded_size_bound(data, self.max_decoded_bytes)
            if bound > self.max_decoded_bytes:
                raise UsageError(f"value of type {t.__name__} would take about {bound} bytes "
                                 f"when decoded, more than max_decoded_bytes="
                                 f"{self.max_decoded_bytes} (a restore would refuse it); split "
                                 "it, or raise BackendOptions.max_value_decoded_bytes")
        return data

    def decode(self, data: bytes) -> Any:
        """Decode a value (untrusted bytes).

        Raises:
            CorruptObjectError: not a pickle of the allowed types, nested deeper than 64, or
                above ``max_decoded_bytes`` decoded (named ``<state value>``: the caller knows
                the object and re-raises it with the object's key and offset).
        """
        # Fast paths (a restore decodes millions of small values; an unpickler per value costs
        # ~2-5 µs): a protocol-5 small int (``80 05 4B n 2E``) is read directly, and a short
        # encoding decoded before returns its value from a bounded memo. Only immutable scalar
        # results are memoized, so sharing one object between entries is invisible; the memo
        # maps exact bytes to what the unpickler made of them, so it never changes a result.
        # Both only when the size bound cannot refuse a value that short (_fast).
        n = len(data)
        if self._fast:
            if n == 5 and data[2] == 0x4B and data[4] == 0x2E and data[0] == 0x80 \
                    and data[1] == 5:
                return data[3]
            if n > 15 and data[2] == 0x95 and data[-2] == 0x94 and type(data) is bytes:
                short = _short_bytes_or_str(data, n)
                if short is not None and n * _PER_BYTE <= self.max_decoded_bytes:
                    return short
            if n <= _MEMO_MAX_BYTES and type(data) is bytes:
                hit = self._memo.get(data, _MISS)
                if hit is not _MISS:
                    return hit
                value = self._unpickle(data)
                if type(value) in _MEMO_TYPES:
                    memo = self._memo
                    if len(memo) >= _MEMO_MAX_ENTRIES:
                        memo.clear()
                    memo[data] = value
                return value
        return self._unpickle(data)

    def _unpickle(self, data: bytes) -> Any:
        try:
            if len(data) * _PER_BYTE > self.max_decoded_bytes:
                bound = decoded_size_bound(data, self.max_decoded_bytes)
                if bound > self.max_decoded_bytes:
                    raise _Refused(f"it would take about {bound} bytes decoded, more than "
                                   f"max_decoded_bytes={self.max_decoded_bytes} (raise "
                                   "BackendOptions.max_value_decoded_bytes if a trusted job "
                                   "wrote it)")
            value = _NoGlobalsUnpickler(io.BytesIO(data)).load()
            if type(value) not in _SCALARS:
                _check(value)
        except Exception as exc:  # anything a crafted pickle can raise, typed below
            raise CorruptObjectError("<state value>", 0, f"safe codec cannot decode "
                                                         f"{len(data)} bytes: "
                                                         f"{type(exc).__name__}: {exc}") from exc
        return value


def _short_bytes_or_str(data: bytes, n: int) -> bytes | str | None:
    """The value of a protocol-5 pickle of ONE short bytes or str object, exactly as
    ``pickle.dumps`` writes it (``80 05 95 <u64 frame length> 43|8C <u8 length> <payload> 94
    2E``: PROTO, FRAME, SHORT_BINBYTES or SHORT_BINUNICODE, MEMOIZE, STOP), or ``None`` for
    anything else (the unpickler decides). The decode of a str is the unpickler's
    (UTF-8, ``surrogatepass``); a payload that is not such UTF-8 falls back too."""
    op = data[11]
    length = data[12]
    if (op != 0x43 and op != 0x8C) or n != length + 15 or data[0] != 0x80 or data[1] != 5 \
            or data[-1] != 0x2E or int.from_bytes(data[3:11], "little") != length + 4:
        return None
    payload = data[13:13 + length]
    if op == 0x43:
        return payload
    try:
        return payload.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None


class _Refused(Exception):
    """A value the safe codec refuses before unpickling it."""


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


#: The name of a TTL state's codec is this prefix and the inner codec's name.
TTL_CODEC_PREFIX: Final = "ttl:"
_TTL_FORMAT: Final = 1
_TTL_HEADER: Final = struct.Struct(">Bq")


class TtlCodec:
    """A TTL state's values: ``(expiry_ms, value)`` pairs, the value by ``inner`` (see the
    module docstring). Decoding is strict: a short value or another format byte is a
    :class:`~dstl.errors.CorruptObjectError` named ``<state value>``."""

    __slots__ = ("inner", "name")

    def __init__(self, inner: Codec) -> None:
        if isinstance(inner, TtlCodec):
            raise UsageError("a TTL codec cannot wrap another TTL codec")
        self.inner = inner
        self.name = TTL_CODEC_PREFIX + inner.name

    def encode(self, pair: Any) -> bytes:
        expiry_ms, value = pair
        return _TTL_HEADER.pack(_TTL_FORMAT, expiry_ms) + self.inner.encode(value)

    def decode(self, data: bytes) -> Any:
        return (expiry_of(data), self.inner.decode(data[_TTL_HEADER.size:]))


def expiry_of(data: bytes | memoryview) -> int:
    """The expiry (epoch ms) of one :class:`TtlCodec` value, without decoding the value.

    Raises:
        CorruptObjectError: too short, or not format 1.
    """
    if len(data) < _TTL_HEADER.size:
        raise CorruptObjectError("<state value>", 0, f"a TTL state's value has {len(data)} "
                                                     f"bytes, fewer than its "
                                                     f"{_TTL_HEADER.size}-byte header")
    fmt, expiry = _TTL_HEADER.unpack_from(data)
    if fmt != _TTL_FORMAT:
        raise CorruptObjectError("<state value>", 0, f"a TTL state's value has format {fmt}; "
                                                     f"this DSTL reads format {_TTL_FORMAT}")
    return int(expiry)


def codec_by_name(name: str, *, allow_pickle: bool = False,
                  max_decoded_bytes: int = DEFAULT_MAX_DECODED_VALUE_BYTES) -> Any:
    """The built-in codec called ``name`` (names are recorded in state metadata).

    Args:
        name: the codec's name.
        allow_pickle: whether ``"pickle"`` may be returned.
        max_decoded_bytes: the safe codec's limit (see :class:`SafeCodec`).

    Raises:
        UsageError: unknown name, or ``"pickle"`` without ``allow_pickle`` (a restore must not
            start unpickling because a stored metadata record says so).
    """
    if not isinstance(name, str):
        raise UsageError(f"codec name {name!r:.80} is not a string")
    if name.startswith(TTL_CODEC_PREFIX):
        return TtlCodec(codec_by_name(name[len(TTL_CODEC_PREFIX):], allow_pickle=allow_pickle,
                                      max_decoded_bytes=max_decoded_bytes))
    if name == "safe":
        return SafeCodec(max_decoded_bytes)
    if name == "pickle" and not allow_pickle:
        raise UsageError("state metadata asks for the pickle codec; restoring it would execute "
                         "code from the store — pass the state's descriptor with "
                         "serializer=PickleCodec() to allow it")
    cls = _BY_NAME.get(name)
    if cls is None:
        raise UsageError(f"unknown codec {name!r}; built-in codecs: {sorted(_BY_NAME)} "
                         "(custom codecs must be passed in the state descriptor)")
    return cls()


def decode_hashable(codec: Codec, data: bytes, what: str) -> Any:
    """``codec.decode(data)``, which must be hashable (a namespace or map key: a table key).

    Raises:
        CorruptObjectError: it does not decode, or decodes to something unhashable (a list, or
            a tuple holding one), named ``<state value>``.
    """
    value = codec.decode(data)
    try:
        hash(value)
    except TypeError as exc:
        raise CorruptObjectError("<state value>", 0, f"{what} decodes to an unhashable "
                                                     f"{type(value).__name__}: {exc}") from exc
    return value
