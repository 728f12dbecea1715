"""The object envelope v1 every DSTL object shares: header, records, trailer. Pure bytes <-> values.

Theory of operation
-------------------
Segments (:mod:`dstl.segment`) and snapshots (:mod:`materializer.snapshot_format`) are different
objects with the same frame around their contents::

    header   "DSTL" | u8 kind | u8 version | u16 flags                              8 bytes
    record*  u32 frame_len | u32 crc32(frame) | frame                        8 + frame_len
             frame = one zstd frame with its content size and zstd's content checksum
    ...      index and footer: the format's own
    trailer  u32 crc32(bytes[0:-8]) | "LTSD"                          the last 8 bytes

This module owns those shared parts and nothing else: it knows no index, footer or record body.
An :class:`ObjectFormat` value says what a decoder expects (kind, version, a name for messages and
the limit on a record's decompressed size); every check raises a
:class:`~dstl.errors.CorruptObjectError` subclass naming the object key and the byte offset.

A record is opened in one order, so that no byte is trusted before it is verified: the record's
length fields, then its CRC over the frame, then the zstd frame header (content size declared and
within the format's limit, content checksum present), and only then decompression (which checks
zstd's content checksum, and refuses bytes after the frame). A damaged size field therefore never
causes an allocation: the CRC catches it first, and a frame that passes the CRC (a buggy or
foreign writer) still cannot declare more than ``max_content_bytes``.

Encoding is the mirror image and refuses a record the decoder would refuse (content above the
limit), so a writer never produces an object that cannot be read back.

Where later limits go: a cap on a record's compressed size and streamed decompression with an
output cap belong in :func:`open_record` (one place for both formats); new limits are fields of
:class:`ObjectFormat`.
"""

from __future__ import annotations

import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Final

import zstandard

from dstl.errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    TruncatedObjectError,
    UnsupportedFormatError,
    UsageError,
)

__all__ = [
    "END_MAGIC",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "KIND_SEGMENT",
    "KIND_SNAPSHOT",
    "MAGIC",
    "RECORD_HEADER_SIZE",
    "TRAILER_SIZE",
    "ObjectFormat",
    "check_end_magic",
    "check_header",
    "check_kind",
    "check_min_size",
    "check_object_crc",
    "encode_header",
    "encode_record",
    "encode_trailer",
    "open_record",
]

MAGIC: Final = b"DSTL"
END_MAGIC: Final = b"LTSD"
#: Object kinds (the u8 after the magic).
KIND_SEGMENT: Final = 1
KIND_SNAPSHOT: Final = 2
FORMAT_VERSION: Final = 1
HEADER_SIZE: Final = 8
RECORD_HEADER_SIZE: Final = 8
#: The object CRC and the end magic.
TRAILER_SIZE: Final = 8

_HEADER: Final = struct.Struct(">4sBBH")   # magic, kind, version, flags
_RECORD: Final = struct.Struct(">II")      # frame length, crc32(frame)
_U32: Final = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class ObjectFormat:
    """What one object type expects of the envelope.

    Attributes:
        kind: the object kind in the header (:data:`KIND_SEGMENT`, :data:`KIND_SNAPSHOT`).
        name: what messages call the object (``"segment"``, ``"snapshot"``).
        max_content_bytes: the largest decompressed record content the decoder accepts and the
            encoder writes.
        too_large_hint: how a caller avoids content above ``max_content_bytes`` (in the
            encoder's error).
        version: the format version in the header.
    """

    kind: int
    name: str
    max_content_bytes: int
    too_large_hint: str
    version: int = FORMAT_VERSION


# --------------------------------------------------------------------------- header


def encode_header(fmt: ObjectFormat) -> bytes:
    """The 8-byte header of an object of ``fmt`` (flags 0: no flag is defined in v1)."""
    return _HEADER.pack(MAGIC, fmt.kind, fmt.version, 0)


def check_header(data: bytes | bytearray | memoryview, key: str, fmt: ObjectFormat) -> None:
    """Check the header at offset 0: length, magic, kind, version, flags.

    Raises:
        TruncatedObjectError: fewer than 8 bytes.
        UnsupportedFormatError: another magic, kind, version or any flag (offset 0, 4, 5, 6).
    """
    if len(data) < HEADER_SIZE:
        raise TruncatedObjectError(key, 0, HEADER_SIZE, len(data), f"{fmt.name} header")
    magic, kind, version, flags = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise UnsupportedFormatError(key, 0, f"magic {bytes(magic)!r}", f"magic {MAGIC!r}")
    check_kind(key, 4, fmt, kind, version, flags)


def check_kind(key: str, offset: int, fmt: ObjectFormat, kind: int, version: int,
               flags: int) -> None:
    """Check a ``u8 kind | u8 version | u16 flags`` triple found at ``offset`` (the header's, or
    a footer's copy of it).

    Raises:
        UnsupportedFormatError: naming the offset of the first field that is not ``fmt``'s.
    """
    if kind != fmt.kind:
        raise UnsupportedFormatError(key, offset, f"object kind {kind}",
                                     f"kind {fmt.kind} ({fmt.name})")
    if version != fmt.version:
        raise UnsupportedFormatError(key, offset + 1, f"{fmt.name} format version {version}",
                                     f"version {fmt.version}")
    if flags != 0:
        raise UnsupportedFormatError(key, offset + 2, f"flags {flags:#06x}", "flags 0")


# --------------------------------------------------------------------------- records

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # ZstdCompressor objects are not safe for concurrent use; one per thread and level.
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True,
                                                      write_content_size=True)
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def encode_record(content: bytes | bytearray | memoryview, fmt: ObjectFormat, *,
                  zstd_level: int, what: str) -> bytes:
    """One record: ``u32 frame_len | u32 crc32(frame) | frame``, the frame holding ``content``.

    Args:
        content: the bytes to store (at most ``fmt.max_content_bytes``).
        fmt: the object's format.
        zstd_level: compression level.
        what: names the record in the error (e.g. ``"change set ('op/0', sqn 3)"``).

    Raises:
        UsageError: ``content`` is larger than the decoder accepts.
    """
    if len(content) > fmt.max_content_bytes:
        raise UsageError(f"{fmt.name} record of {what} has {len(content)} bytes, more than "
                         f"{fmt.max_content_bytes} ({fmt.too_large_hint})")
    frame: bytes = _compressor(zstd_level).compress(content)
    return _RECORD.pack(len(frame), zlib.crc32(frame)) + frame


def open_record(record: bytes | bytearray | memoryview, *, key: str, offset: int,
                fmt: ObjectFormat, what: str, expected_length: int | None = None) -> bytes:
    """Verify one record and return its decompressed content.

    Args:
        record: the record's bytes, exactly (from a whole object or a ranged read).
        key, offset: where they came from (every error names both).
        fmt: the object's format (its content limit).
        what: names the record in messages (e.g. ``"block of key group 4"``).
        expected_length: the record length an index promised, if any.

    Raises:
        TruncatedObjectError: fewer bytes than the index or the frame length says.
        CorruptObjectError: more bytes than the frame length says; a zstd frame without content
            size or checksum, or declaring more than ``fmt.max_content_bytes``; a frame that does
            not decompress (zstd's content checksum included) or has bytes after it (offset
            ``offset + 8``).
        ChecksumMismatchError: the record CRC does not match its frame.
    """
    rec = memoryview(record)
    if expected_length is not None and len(rec) != expected_length:
        raise TruncatedObjectError(key, offset, expected_length, len(rec), what)
    if len(rec) < RECORD_HEADER_SIZE:
        raise TruncatedObjectError(key, offset, RECORD_HEADER_SIZE, len(rec), f"{what} header")
    frame_len, crc = _RECORD.unpack_from(rec, 0)
    held = len(rec) - RECORD_HEADER_SIZE
    if frame_len > held:
        raise TruncatedObjectError(key, offset, RECORD_HEADER_SIZE + frame_len, len(rec), what)
    if frame_len < held:
        raise CorruptObjectError(key, offset, f"{what} of {len(rec)} bytes holds a frame of "
                                              f"{frame_len} bytes")
    frame = rec[RECORD_HEADER_SIZE:]
    actual = zlib.crc32(frame)
    if actual != crc:
        raise ChecksumMismatchError(key, offset, what, crc, actual)
    return _decompress(frame, key, offset + RECORD_HEADER_SIZE, fmt, what)


def _decompress(frame: memoryview, key: str, at: int, fmt: ObjectFormat, what: str) -> bytes:
    """Check the frame header against the limit, then decompress (after the CRC matched)."""
    try:
        params = zstandard.get_frame_parameters(frame)
        size = params.content_size
        if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
            raise CorruptObjectError(key, at, f"zstd frame of {what} does not declare its "
                                              "content size")
        if size > fmt.max_content_bytes:
            raise CorruptObjectError(key, at, f"zstd frame of {what} declares content size "
                                              f"{size}, above the limit {fmt.max_content_bytes}")
        if not params.has_checksum:
            raise CorruptObjectError(key, at, f"zstd frame of {what} has no content checksum")
        content: bytes = _decompressor().decompress(frame, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptObjectError(key, at, f"zstd frame of {what} does not decode: {exc}") from exc
    return content


# --------------------------------------------------------------------------- trailer


def encode_trailer(crc: int) -> bytes:
    """The last 8 bytes: ``crc`` (a ``zlib.crc32`` over every byte before it) and the end magic."""
    return _U32.pack(crc) + END_MAGIC


def check_min_size(object_size: int, min_size: int, key: str, fmt: ObjectFormat) -> None:
    """An object shorter than header + footer is truncated (reported at its end).

    Raises:
        TruncatedObjectError: ``object_size < min_size``.
    """
    if object_size < min_size:
        raise TruncatedObjectError(key, object_size, min_size, object_size, fmt.name)


def check_end_magic(tail: bytes | bytearray | memoryview, object_size: int, key: str,
                    fmt: ObjectFormat) -> None:
    """Check that ``tail`` (the last bytes of an object of ``object_size`` bytes) ends with the
    end magic; an object without it was cut short (or is not a DSTL object).

    Raises:
        TruncatedObjectError: at offset ``object_size - 4``.
    """
    if len(tail) < len(END_MAGIC) or bytes(tail[-len(END_MAGIC):]) != END_MAGIC:
        raise TruncatedObjectError(key, max(object_size - len(END_MAGIC), 0),
                                   object_size + len(END_MAGIC), object_size,
                                   f"{fmt.name}: end magic {END_MAGIC!r} missing, so the object")


def check_object_crc(data: bytes | bytearray | memoryview, key: str, fmt: ObjectFormat) -> None:
    """Check the object CRC in the trailer against every byte before it (whole objects only;
    call :func:`check_min_size` first).

    Raises:
        ChecksumMismatchError: at offset ``size - 8``.
    """
    at = len(data) - TRAILER_SIZE
    (stored,) = _U32.unpack_from(data, at)
    actual = zlib.crc32(memoryview(data)[:at])
    if stored != actual:
        raise ChecksumMismatchError(key, at, f"{fmt.name} object", stored, actual)
