"""The framing of an LMDB table's values (key layout ``"2"``): one codec, a zstd dictionary per table.

Theory of operation
-------------------
A stored value is a tag byte and a body::

    tag 0   the value's bytes as they are
    tag 1   u8 dictionary number, then one zstd frame made with that dictionary: level
            :data:`LEVEL`, content size declared, no checksum, no dictionary id

:meth:`ValueCodec.encode` writes tag 1 only when the table has a dictionary, the value has at
least :data:`MIN_COMPRESSED_VALUE_BYTES` bytes and at most ``max_decoded_bytes`` (what a reader
accepts a frame to declare) and the frame is smaller than the value; else tag 0.

Dictionaries are the table's reserved records ``ff ff 'dstl-dict' u8 n`` (key group ``0xFFFF``,
after every key group, like the layout and marker records). Rules:

1. A dictionary is trained once per table by :func:`train_dictionary`, with fixed parameters
   (:data:`DICT_BYTES` bytes, ``k`` = :data:`DICT_K`, ``d`` = :data:`DICT_D`: the same samples
   give the same dictionary), from the first write batch (a restore's bulk load included) that
   holds at least :data:`TRAIN_MIN_VALUES` values of :data:`MIN_COMPRESSED_VALUE_BYTES` to
   :data:`MAX_SAMPLE_BYTES` bytes (at most :data:`TRAIN_MAX_SAMPLES` of them are used). The
   values the batch wrote before it trained are rewritten with the dictionary in the same
   batch; values written before the table had a dictionary stay tag 0 until written again.
2. A written dictionary never changes: values that name it decode for the table's lifetime.
3. Numbers are ``0..255`` (:data:`MAX_DICTIONARIES`). A table that trains writes number 0; a
   table restored from several source tables (rescaling) holds their dictionaries under new
   numbers, and :meth:`ValueCodec.encode` uses the highest one.

Untrusted input (the bytes may come from a store): :meth:`ValueCodec.decode` refuses an unknown
tag, a dictionary number the table does not hold, a frame that does not declare its content
size or declares more than ``max_decoded_bytes``, and a frame that does not decode to exactly
the declared size with no byte left over — it never writes more than the declared size (zstd
allocates the declared size and fails past it). :func:`load_dictionary` refuses a dictionary
record of the wrong size or that zstd cannot load. Every refusal is a
:class:`~dstl.errors.CorruptValueError` naming the entry's key; the caller that knows the object
re-raises it there (:func:`dstl.errors.located`).

Threads: zstd contexts are not safe for use by two threads at once, so each thread that encodes
or decodes keeps its own compressor and decompressors (a context with a dictionary costs
microseconds to create, so they are cached, never made per call).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any, Final

import zstandard

from dstl.errors import CorruptValueError, UsageError
from materializer.codecs import DEFAULT_MAX_DECODED_VALUE_BYTES

__all__ = [
    "DICT_BYTES",
    "DICT_D",
    "DICT_K",
    "DICT_KEY_PREFIX",
    "LEVEL",
    "MAX_DICTIONARIES",
    "MAX_DICTIONARY_RECORD_BYTES",
    "MAX_SAMPLE_BYTES",
    "MIN_COMPRESSED_VALUE_BYTES",
    "TAG_DICT",
    "TAG_RAW",
    "TRAIN_MAX_SAMPLES",
    "TRAIN_MIN_VALUES",
    "ValueCodec",
    "dictionary_key",
    "dictionary_number",
    "load_dictionary",
    "train_dictionary",
]

TAG_RAW: Final = 0
TAG_DICT: Final = 1
#: The reserved record of dictionary ``n`` is this prefix and the byte ``n``.
DICT_KEY_PREFIX: Final = b"\xff\xff" + b"dstl-dict"
#: Values below this many bytes stay tag 0. With an 8 KiB dictionary trained on
#: ``bench/table_codec.py``'s 274-byte values, prefixes of 1,000 of them stored (tag and number
#: included) 32 B -> 28.8 B, 48 B -> 37.2 B, 64 B -> 45.6 B, 128 B -> 79.0 B: below 64 bytes a
#: frame saves under a quarter, for a compress call per put and a decompress per get.
MIN_COMPRESSED_VALUE_BYTES: Final = 64
#: zstd level of the frames: level 1 is the cheapest; higher levels gained little on small
#: values with a dictionary (``bench/table_codec.py``).
LEVEL: Final = 1
#: Dictionary size and the fixed training parameters (fast cover, no parameter search, so
#: training is deterministic and takes ~30 ms on 2,000 values of 274 bytes).
DICT_BYTES: Final = 8192
DICT_K: Final = 1024
DICT_D: Final = 8
#: A write batch trains a dictionary when it holds at least this many values of at least
#: :data:`MIN_COMPRESSED_VALUE_BYTES`, and trains on at most :data:`TRAIN_MAX_SAMPLES` of them.
TRAIN_MIN_VALUES: Final = 1000
TRAIN_MAX_SAMPLES: Final = 2000
#: Values above this many bytes are not samples (a batch keeps its samples in memory until it
#: trains: at most :data:`TRAIN_MAX_SAMPLES` x this); they are still compressed once trained.
MAX_SAMPLE_BYTES: Final = 4096
#: Dictionary numbers are one byte.
MAX_DICTIONARIES: Final = 256
#: The largest dictionary record a table accepts (the trained ones are :data:`DICT_BYTES`).
MAX_DICTIONARY_RECORD_BYTES: Final = 1 << 20

_RAW: Final = bytes([TAG_RAW])
_UNKNOWN_SIZE: Final = zstandard.CONTENTSIZE_UNKNOWN
_ERROR_SIZE: Final = zstandard.CONTENTSIZE_ERROR


def dictionary_key(number: int) -> bytes:
    """The reserved record key of dictionary ``number``."""
    if not 0 <= number < MAX_DICTIONARIES:
        raise UsageError(f"dictionary number {number} is outside 0..{MAX_DICTIONARIES - 1}")
    return DICT_KEY_PREFIX + bytes([number])


def dictionary_number(key: bytes) -> int | None:
    """The dictionary number of a reserved record key, or None when ``key`` is not one."""
    if len(key) == len(DICT_KEY_PREFIX) + 1 and key.startswith(DICT_KEY_PREFIX):
        return key[-1]
    return None


def train_dictionary(values: Iterable[bytes]) -> bytes | None:
    """A dictionary trained by rule 1 of the module docstring from ``values``, or None when
    fewer than :data:`TRAIN_MIN_VALUES` of them are large enough (or zstd finds nothing to
    train on)."""
    samples: list[bytes | bytearray | memoryview] = []
    for v in values:
        if MIN_COMPRESSED_VALUE_BYTES <= len(v) <= MAX_SAMPLE_BYTES:
            samples.append(v)
            if len(samples) == TRAIN_MAX_SAMPLES:
                break
    if len(samples) < TRAIN_MIN_VALUES:
        return None
    try:
        trained = zstandard.train_dictionary(DICT_BYTES, samples, k=DICT_K, d=DICT_D)
    except zstandard.ZstdError:
        return None     # e.g. samples too uniform to train on: the table stays tag 0
    return trained.as_bytes()


def load_dictionary(number: int, data: bytes, *, key: str = "<table value>", offset: int = 0
                    ) -> zstandard.ZstdCompressionDict:
    """Dictionary record ``number`` loaded for zstd, checked as untrusted input.

    Raises:
        CorruptValueError: the record is empty or larger than
            :data:`MAX_DICTIONARY_RECORD_BYTES`, or zstd cannot load it as a full dictionary.
    """
    entry = DICT_KEY_PREFIX + bytes([number & 0xFF])
    if not 0 < len(data) <= MAX_DICTIONARY_RECORD_BYTES:
        raise CorruptValueError(key, offset, entry,
                                f"dictionary record of {len(data)} bytes, expected 1.."
                                f"{MAX_DICTIONARY_RECORD_BYTES}")
    try:
        loaded = zstandard.ZstdCompressionDict(bytes(data),
                                               dict_type=zstandard.DICT_TYPE_FULLDICT)
        # Loading builds zstd's tables from the record: a damaged one fails here, not later.
        loaded.precompute_compress(level=LEVEL)
        zstandard.ZstdDecompressor(dict_data=loaded).decompress(_EMPTY_FRAME)
    except zstandard.ZstdError as exc:
        raise CorruptValueError(key, offset, entry,
                                f"zstd cannot load the dictionary record: {exc}") from exc
    return loaded


_EMPTY_FRAME: Final = zstandard.ZstdCompressor(write_content_size=True).compress(b"")


class _Contexts(threading.local):
    """One thread's zstd contexts of a :class:`ValueCodec`."""

    def __init__(self) -> None:
        self.compressor: zstandard.ZstdCompressor | None = None
        self.decompressors: dict[int, zstandard.ZstdDecompressor] = {}


class ValueCodec:
    """Encodes and decodes one table's values by the module docstring's framing.

    Args:
        dictionaries: the table's dictionary records by number (checked by
            :func:`load_dictionary`).
        max_decoded_bytes: the largest content size a frame may declare.
        where: the object the values come from, for errors (a placeholder such as
            ``<table value>`` when the caller re-raises them placed).
    """

    __slots__ = ("_dicts", "_head", "_local", "_max", "_where", "encode_number")

    def __init__(self, dictionaries: Mapping[int, bytes] | None = None, *,
                 max_decoded_bytes: int = DEFAULT_MAX_DECODED_VALUE_BYTES,
                 where: str = "<table value>") -> None:
        self._dicts: dict[int, zstandard.ZstdCompressionDict] = {}
        self._local = _Contexts()
        self._max = max_decoded_bytes
        self._where = where
        #: The dictionary :meth:`encode` uses (the highest number), None without one.
        self.encode_number: int | None = None
        self._head = b""   # tag 1 and encode_number
        for number, data in sorted((dictionaries or {}).items()):
            self.add(number, data)

    @property
    def numbers(self) -> list[int]:
        """The dictionary numbers this codec holds, ascending."""
        return sorted(self._dicts)

    def add(self, number: int, data: bytes) -> None:
        """Take dictionary record ``number`` (loaded and checked by :func:`load_dictionary`).

        Raises:
            UsageError: the number is outside ``0..255`` or already held (rule 2).
            CorruptValueError: the record does not load.
        """
        if not 0 <= number < MAX_DICTIONARIES:
            raise UsageError(f"dictionary number {number} is outside 0..{MAX_DICTIONARIES - 1}")
        if number in self._dicts:
            raise UsageError(f"dictionary {number} is already in the table; a written "
                             "dictionary never changes")
        self._dicts[number] = load_dictionary(number, data, key=self._where)
        self._numbered()

    def holds(self, number: int) -> bool:
        """Whether dictionary ``number`` is in the codec."""
        return number in self._dicts

    def discard(self, number: int) -> None:
        """Forget dictionary ``number`` that the transaction which added it did not commit
        (the table's write batch was aborted): no stored value names it."""
        del self._dicts[number]
        self._numbered()

    def _numbered(self) -> None:
        self.encode_number = max(self._dicts) if self._dicts else None
        self._head = b"" if self.encode_number is None else bytes((TAG_DICT, self.encode_number))
        self._local = _Contexts()

    def _compressor(self) -> zstandard.ZstdCompressor | None:
        local = self._local
        c = local.compressor
        if c is None and self.encode_number is not None:
            c = local.compressor = zstandard.ZstdCompressor(
                level=LEVEL, dict_data=self._dicts[self.encode_number], write_content_size=True,
                write_checksum=False, write_dict_id=False)
        return c

    def _decompressor(self, number: int, entry_key: bytes) -> zstandard.ZstdDecompressor:
        local = self._local
        d = local.decompressors.get(number)
        if d is None:
            data = self._dicts.get(number)
            if data is None:
                raise CorruptValueError(self._where, 0, entry_key,
                                        f"names dictionary {number}, which the table does not "
                                        f"hold (it holds {self.numbers})")
            d = local.decompressors[number] = zstandard.ZstdDecompressor(dict_data=data)
        return d

    def encode(self, value: bytes) -> bytes:
        """The stored bytes of ``value``: tag 1 when a dictionary makes it smaller, else tag 0."""
        if MIN_COMPRESSED_VALUE_BYTES <= len(value) <= self._max \
                and self.encode_number is not None:
            c = self._local.compressor or self._compressor()
            assert c is not None
            frame = c.compress(value)
            if len(frame) + 1 < len(value):
                return self._head + frame
        return _RAW + value

    def declared_size(self, stored: bytes, entry_key: bytes = b"") -> int:
        """Check ``stored``'s framing without decoding the frame: the tag, the dictionary
        number (held), the frame header and its declared content size (bounded). Returns the
        value's size.

        Raises:
            CorruptValueError: the first check that fails.
        """
        if not stored:
            raise CorruptValueError(self._where, 0, entry_key, "empty stored value (no tag byte)")
        tag = stored[0]
        if tag == TAG_RAW:
            return len(stored) - 1
        if tag != TAG_DICT:
            raise CorruptValueError(self._where, 0, entry_key,
                                    f"unknown value tag {tag}, expected {TAG_RAW} or {TAG_DICT}")
        if len(stored) < 2:
            raise CorruptValueError(self._where, 1, entry_key,
                                    "tag 1 without a dictionary number")
        number = stored[1]
        if number not in self._dicts:
            raise CorruptValueError(self._where, 1, entry_key,
                                    f"names dictionary {number}, which the table does not hold "
                                    f"(it holds {self.numbers})")
        frame = stored[2:]
        try:
            size = zstandard.frame_content_size(frame)
        except zstandard.ZstdError as exc:
            raise CorruptValueError(self._where, 2, entry_key,
                                    f"the zstd frame header does not parse: {exc}") from exc
        if size in (_UNKNOWN_SIZE, _ERROR_SIZE) or size < 0:
            raise CorruptValueError(self._where, 2, entry_key,
                                    "the zstd frame does not declare its content size")
        if size > self._max:
            raise CorruptValueError(self._where, 2, entry_key,
                                    f"the zstd frame declares {size} bytes, more than the "
                                    f"{self._max} a value may decode to "
                                    "(max_value_decoded_bytes)")
        return int(size)

    def frames_decode(self, number: int, data: Any, segments: bytes, declared: bytes) -> bool:
        """Whether the zstd frames of dictionary ``number`` in ``data`` (a buffer: bytes, a
        numpy ``uint8`` array) each decode to exactly their declared size, decoded in one call
        in C (zstd's ``multi_decompress_to_buffer``; bytes after a frame are ignored, as
        :meth:`decode` ignores them). ``segments``: little-endian ``u64`` pairs (offset in
        ``data``, length), one per frame; ``declared``: a little-endian ``u64`` per frame, the
        content size its header declares, which the caller read and bounded by
        ``max_decoded_bytes`` (zstd allocates it). ``False``: at least one frame does not
        decode to its size; :meth:`decode_strict` of each says which and why."""
        if not segments:
            return True
        frames = zstandard.BufferWithSegments(data, segments)
        try:
            self._decompressor(number, b"").multi_decompress_to_buffer(
                frames, decompressed_sizes=declared)
        except zstandard.ZstdError:
            return False
        return True

    def decode(self, stored: bytes, entry_key: bytes = b"") -> bytes:
        """The value of ``stored`` (the module docstring's untrusted-input rules).

        Raises:
            CorruptValueError: the framing, the dictionary number or the frame is wrong.
        """
        if stored[:1] == _RAW:
            return stored[1:]
        # the common case in few calls (zstd allocates the declared size, checked first, and
        # fails a frame that decodes to another); anything unusual takes the checked path
        if len(stored) > 2 and stored[0] == TAG_DICT:
            d = self._local.decompressors.get(stored[1])
            if d is not None:
                frame = stored[2:]
                try:
                    size = zstandard.frame_content_size(frame)
                    if 0 <= size <= self._max:
                        out: bytes = d.decompress(frame)
                        if len(out) == size:
                            return out
                except zstandard.ZstdError:
                    pass
        return self.decode_strict(stored, entry_key)

    def decode_strict(self, stored: bytes, entry_key: bytes = b"") -> bytes:
        """:meth:`decode`, one check at a time, each failure its own error, and also refusing
        bytes after the frame (which :meth:`decode` and :meth:`frames_decode` ignore): what
        a validator calls to say which value is wrong and why."""
        size = self.declared_size(stored, entry_key)
        d = self._decompressor(stored[1], entry_key)
        try:
            out = d.decompress(stored[2:], max_output_size=size, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise CorruptValueError(self._where, 2, entry_key,
                                    f"the zstd frame does not decode: {exc}") from exc
        if len(out) != size:
            raise CorruptValueError(self._where, 2, entry_key,
                                    f"the zstd frame decodes to {len(out)} bytes, it declares "
                                    f"{size}")
        return out

    @staticmethod
    def renumbered(stored: bytes, numbers: Mapping[int, int]) -> bytes:
        """``stored`` with its dictionary number rewritten by ``numbers`` (a tag-0 value as it
        is): a value copied into a table that holds its dictionary under another number."""
        if stored[:1] == bytes((TAG_DICT,)) and len(stored) >= 2:
            return bytes((TAG_DICT, numbers[stored[1]])) + stored[2:]
        return stored
