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
within the format's limit, content checksum present), then the frame's block headers (the frame
must end exactly where the record does: no bytes after it, none missing), and only then
decompression. A damaged size field therefore never causes an allocation: the CRC catches it
first, and a frame that passes the CRC (a buggy, foreign or crafted writer) still cannot declare
more than ``max_content_bytes``.

Decompression is streamed (:func:`_read_frame`) into one output buffer of the declared content
size, allowed only once that size is known to be within the limit: the declared size is never
trusted for an allocation beyond the limit, zstd fills the buffer as it decodes (memory is
touched only for bytes the frame really produces, and it cannot produce more than the buffer), a
frame that produces less than it declared is refused at its end, one more read proves it
produced no more, and zstd's content checksum is verified when the frame ends. Peak memory of
opening a record is therefore the content it really holds, at most the limit, whatever the
record claims.

The limit of each format is a field of :class:`ObjectFormat`; :meth:`ObjectFormat.with_limit`
makes the same format with another limit (the options ``DstlOptions.max_change_set_bytes`` and
``BackendOptions.max_snapshot_block_bytes`` set it for segments and snapshots). Encoding is the
mirror image and refuses a record the decoder would refuse (content above the limit), so a writer
never produces an object that cannot be read back with the same options.
"""

from __future__ import annotations

import dataclasses
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
        limit_option: the option that sets ``max_content_bytes`` (named in the decoder's error,
            for a reader whose limit is below the writer's).
    """

    kind: int
    name: str
    max_content_bytes: int
    too_large_hint: str
    version: int = FORMAT_VERSION
    limit_option: str = ""

    def with_limit(self, max_content_bytes: int | None) -> ObjectFormat:
        """This format with another content limit (``None``: this one)."""
        if max_content_bytes is None or max_content_bytes == self.max_content_bytes:
            return self
        if isinstance(max_content_bytes, bool) or not isinstance(max_content_bytes, int) \
                or max_content_bytes < 1:
            raise UsageError(f"{self.name} content limit {max_content_bytes!r} is not an int "
                             ">= 1")
        return dataclasses.replace(self, max_content_bytes=max_content_bytes)


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
    # One per thread, and never shared by two readers at once (a stream reader holds it).
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
    """Check the frame header against the limit and the frame's length against the record,
    then decompress in chunks, counting the output (after the CRC matched)."""
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise CorruptObjectError(key, at, f"zstd frame of {what} has no valid frame header: "
                                          f"{exc}") from exc
    size = params.content_size
    if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        raise CorruptObjectError(key, at, f"zstd frame of {what} does not declare its "
                                          "content size")
    if size > fmt.max_content_bytes:
        hint = f"; raise {fmt.limit_option} if it was written with a higher one" \
            if fmt.limit_option else ""
        raise CorruptObjectError(key, at, f"zstd frame of {what} declares content size "
                                          f"{size}, above the limit {fmt.max_content_bytes}"
                                          f"{hint}")
    if not params.has_checksum:
        raise CorruptObjectError(key, at, f"zstd frame of {what} has no content checksum")
    end = _frame_end(frame, key, at, what)
    if end != len(frame):
        raise CorruptObjectError(key, at + min(end, len(frame)),
                                 f"zstd frame of {what} ends at byte {end} of the "
                                 f"{len(frame)}-byte record frame (bytes after the frame, or "
                                 "a frame cut short)")
    return _read_frame(frame, key, at, what, size)


def _frame_end(frame: memoryview, key: str, at: int, what: str) -> int:
    """Where the zstd frame in ``frame`` ends, from its block headers (``len(frame) + 1`` or
    more when it would end past the record: cut short)."""
    try:
        pos: int = zstandard.frame_header_size(frame)
    except zstandard.ZstdError as exc:
        raise CorruptObjectError(key, at, f"zstd frame of {what} has no valid frame header: "
                                          f"{exc}") from exc
    n = len(frame)
    while True:
        if pos + 3 > n:
            return n + 1
        header = frame[pos] | frame[pos + 1] << 8 | frame[pos + 2] << 16
        block_type = (header >> 1) & 3
        if block_type == 3:
            raise CorruptObjectError(key, at + pos, f"zstd frame of {what} has a block of the "
                                                    "reserved type")
        pos += 3 + (1 if block_type == 1 else header >> 3)  # an RLE block holds one byte
        if header & 1:  # the last block
            return pos + 4  # the content checksum (required above)


def _read_frame(frame: memoryview, key: str, at: int, what: str, size: int) -> bytes:
    """Decompress into one buffer of the declared size (checked against the limit before): zstd
    fills it as it decodes, so memory is only touched for bytes the frame really produces, and
    it can never produce more than the buffer; one more read then proves the frame ended."""
    try:
        with _decompressor().stream_reader(frame, read_across_frames=False,
                                           closefd=False) as reader:
            content: bytes = reader.read(size) if size else b""
            overrun = reader.read(1) if len(content) == size else b""
    except zstandard.ZstdError as exc:
        raise CorruptObjectError(key, at, f"zstd frame of {what} does not decode: {exc}") from exc
    if overrun:
        raise CorruptObjectError(key, at, f"zstd frame of {what} decompresses to more than its "
                                          f"declared {size} bytes")
    if len(content) != size:
        raise CorruptObjectError(key, at, f"zstd frame of {what} decompresses to "
                                          f"{len(content)} bytes, not its declared {size}")
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
