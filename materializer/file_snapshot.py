"""Snapshot object format v2: a whole LMDB environment file, streamed through zstd (file level).

Theory of operation
-------------------
A v1 snapshot (:mod:`materializer.snapshot_format`) stores entries, so loading it is per-entry
Python work (``bench/recovery.py``: ~0.3 M entries/s). A v2 snapshot stores the LMDB table's
data file itself, copied from a read transaction (LMDB's compacting copy; writers go on), so a
restore of the same key groups is download + streamed decompress + rename + open, with no
per-entry work (:mod:`restore.file_restore`). The object is::

    header      "DSTL" | u8 kind 2 (snapshot) | u8 version 2 | u16 flags 0            8 bytes
    metadata    u32 frame_len | u32 crc32(frame) | zstd frame of the metadata JSON
    data        zstd frame(s) of the data file (content size, content checksum)
    footer      u64 data offset | u64 data length | u64 raw size
                | u8 kind | u8 version | u16 flags                                   28 bytes
    trailer     u32 crc32(every byte before it) | "LTSD"                               8 bytes

* Header, metadata record and trailer are the shared envelope (:mod:`dstl.envelope`); a v1
  reader meets version 2 in the header and raises :class:`~dstl.errors.UnsupportedFormatError`,
  and :func:`snapshot_version` lets the restore choose the decoder before parsing anything else.
* The metadata JSON (:class:`FileSnapshotMeta`) says what the file holds: ``"table": "lmdb"``,
  the LMDB key layout version, the key-group range, the max parallelism, the state registry
  (state id -> name, kind, codecs), the operator id, the materialization id, the table marker's
  boundary when the copy was taken outside the writer, and the file's entry count if known.
* The data is one zstd frame that declares its content size (= the footer's raw size) and
  carries zstd's content checksum (XXH64 of the decompressed file). The file is checked twice
  before anything uses it: the object crc over every stored byte, then zstd's content checksum
  and the raw size while decompressing (a frame without checksum or of another size is refused
  before decompression; the raw size also caps how much a forged frame may make the reader
  write). A crc32 of the raw file would check the same bytes a third time at the cost of the
  decompression itself, so there is none.

Writing (:func:`write_file_snapshot`) streams: the environment's copy
(``copy`` = :meth:`~materializer.lmdb_table.LmdbTableSnapshot.copy_to`) goes through a pipe into
the compressor when its size is known in advance
(:meth:`~materializer.lmdb_table.LmdbTableSnapshot.copy_size`), so no uncompressed copy ever
lands on disk or in memory; a copy of unknown size goes to a temporary file first. Only
compression chunks are held in memory. :func:`spool_file_snapshot` writes the object itself
into an unnamed temporary file on the table's disk, so a materialization holds no more than
chunks of it until it is uploaded. Reading (:func:`verify_file_snapshot`,
:func:`decompress_file_snapshot`) works from any ranged reader (a cache lease, the store's
``get_range``, bytes in memory), in chunks. Errors are :class:`~dstl.errors.CorruptObjectError`
subclasses naming the object key and the byte offset.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import struct
import tempfile
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, Final, cast

import zstandard

from dstl.envelope import (
    HEADER_SIZE,
    KIND_SNAPSHOT,
    RECORD_HEADER_SIZE,
    TRAILER_SIZE,
    ObjectFormat,
    check_end_magic,
    check_header,
    check_kind,
    check_min_size,
    encode_header,
    encode_record,
    encode_trailer,
    open_record,
)
from dstl.errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    TruncatedObjectError,
    UsageError,
)
from dstl.keygroups import MAX_PARALLELISM_LIMIT, KeyGroupRange
from dstl.untrusted import load_json
from materializer.changes import check_state_meta

__all__ = [
    "FILE_FOOTER_SIZE",
    "FILE_SNAPSHOT_FORMAT",
    "FILE_SNAPSHOT_VERSION",
    "FileSnapshotLayout",
    "FileSnapshotMeta",
    "ReadAt",
    "check_data_frame",
    "decompress_file_snapshot",
    "decompress_file_snapshot_into",
    "read_file_snapshot_layout",
    "snapshot_version",
    "spool_file_snapshot",
    "verify_file_snapshot",
    "write_file_snapshot",
]

FILE_SNAPSHOT_VERSION: Final = 2
#: Largest metadata JSON (the state registry of up to 65536 states fits easily).
_MAX_METADATA_BYTES: Final = 64 * 1024 * 1024
FILE_SNAPSHOT_FORMAT: Final = ObjectFormat(KIND_SNAPSHOT, "file snapshot", _MAX_METADATA_BYTES,
                                           "register fewer states", version=FILE_SNAPSHOT_VERSION)
_FOOTER_HEAD: Final = struct.Struct(">QQQBBH")   # data off, data len, raw size, kind, version,
#                                                  flags; then the envelope's trailer
FILE_FOOTER_SIZE: Final = _FOOTER_HEAD.size + TRAILER_SIZE   # 36
#: Chunk size of the streamed copy, compression and decompression.
_CHUNK: Final = 4 * 1024 * 1024
_VERSION_OFFSET: Final = 5   # u8 version in the envelope header
_MAX_FRAME_HEADER: Final = 18   # zstd's largest frame header
_MAX_BLOCK: Final = 128 * 1024  # zstd's largest block content (Block_Maximum_Size)

#: ``read(offset, length)`` -> exactly those bytes of the object (a lease's ``read``).
ReadAt = Callable[[int, int], bytes]


def snapshot_version(head: bytes | memoryview) -> int:
    """The format version in a snapshot object's header (0 when there is no full header)."""
    return head[_VERSION_OFFSET] if len(head) >= HEADER_SIZE else 0


@dataclass(frozen=True, slots=True)
class FileSnapshotMeta:
    """What a v2 snapshot's file holds (the metadata JSON).

    Attributes:
        key_groups: the key-group range of the table the file was copied from.
        max_parallelism: the job's number of key groups.
        states: state id (a string) -> the state's metadata (name, kind, codecs).
        operator_id: the backend whose table it is.
        materialization_id: the materialization this snapshot is.
        layout: the LMDB key layout version of the file.
        boundary: the table marker's boundary when the copy was taken outside the writer.
        extra: any other fields, kept as written.
    """

    key_groups: KeyGroupRange
    max_parallelism: int
    states: dict[str, Any]
    operator_id: str
    materialization_id: int
    layout: str = "1"
    boundary: tuple[str, int] | None = None
    extra: dict[str, Any] | None = None

    def to_bytes(self) -> bytes:
        obj: dict[str, Any] = dict(self.extra or {})
        obj.update({"table": "lmdb", "layout": self.layout,
                    "key_groups": self.key_groups.to_json_obj(),
                    "max_parallelism": self.max_parallelism, "states": self.states,
                    "operator_id": self.operator_id,
                    "materialization_id": self.materialization_id,
                    "boundary": list(self.boundary) if self.boundary is not None else None})
        return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, *, key: str, offset: int) -> FileSnapshotMeta:
        """Parse and check the metadata JSON (untrusted: every field is checked).

        Raises:
            CorruptObjectError: not DSTL's metadata of an LMDB file snapshot.
        """
        obj = load_json(data, key=key, what="file snapshot metadata", max_bytes=len(data),
                        offset=offset)
        try:
            if not isinstance(obj, dict) or obj.get("table") != "lmdb":
                raise ValueError("not the metadata of an LMDB file snapshot")
            kgs = KeyGroupRange.from_json_obj(obj["key_groups"])
            mp, mat = obj["max_parallelism"], obj["materialization_id"]
            if not all(type(v) is int for v in (mp, mat)) or not 0 < mp <= MAX_PARALLELISM_LIMIT \
                    or kgs.end >= mp or mat < 0:
                raise ValueError(f"max_parallelism={mp!r} materialization_id={mat!r} key groups "
                                 f"{kgs} do not fit")
            states, op, layout = obj["states"], obj["operator_id"], obj["layout"]
            if not isinstance(states, dict) or not all(
                    s.isdigit() and len(s) <= 5 and int(s) <= 0xFFFF for s in states):
                raise ValueError("states is not an object of state id -> metadata")
            for sid, m in states.items():
                check_state_meta(m, key=key, offset=offset, what=f"state {sid} of the metadata")
            if not isinstance(op, str) or not isinstance(layout, str):
                raise ValueError("operator_id and layout must be strings")
            b = obj.get("boundary")
            boundary = (str(b[0]), int(b[1])) if b is not None else None
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise CorruptObjectError(key, offset, f"file snapshot metadata is not DSTL's: "
                                                  f"{exc}") from exc
        known = {"table", "layout", "key_groups", "max_parallelism", "states", "operator_id",
                 "materialization_id", "boundary"}
        return cls(kgs, mp, states, op, mat, layout, boundary,
                   {k: v for k, v in obj.items() if k not in known})


@dataclass(frozen=True, slots=True)
class FileSnapshotLayout:
    """Where a v2 object's parts are, and what its footer promises."""

    meta: FileSnapshotMeta
    size: int
    data_offset: int
    data_length: int
    raw_size: int
    object_crc: int


# --------------------------------------------------------------------------- writing


def write_file_snapshot(copy: Callable[[int], object], meta: FileSnapshotMeta, out: BinaryIO, *,
                        zstd_level: int = 1, tmp_dir: str | None = None,
                        threads: int = 0, raw_size: int | None = None) -> int:
    """Write a v2 snapshot object to ``out``: the environment copied by ``copy(fd)``, compressed
    in chunks.

    Args:
        copy: writes the environment's data file to the given file descriptor (from a read
            transaction: :meth:`~materializer.lmdb_table.LmdbTableSnapshot.copy_to`).
        meta: the metadata.
        out: receives the object (a file or ``io.BytesIO``), from its current position.
        zstd_level: compression level.
        tmp_dir: where a copy of unknown size goes first (default: the system's temp directory;
            pass the table's parent directory to stay on its disk).
        threads: zstd worker threads (0: compress on the calling thread).
        raw_size: the size of what ``copy`` writes, when known before it runs
            (:meth:`~materializer.lmdb_table.LmdbTableSnapshot.copy_size`): the copy runs on a
            helper thread into a pipe that the calling thread compresses from, and nothing
            touches the disk; ``None``: the copy goes to a temporary file in ``tmp_dir``
            (removed afterwards), then is compressed.

    Returns:
        the object's size in bytes.

    Raises:
        UsageError: the copy wrote another number of bytes than ``raw_size``.
        Exception: what ``copy`` raised (the object in ``out`` is then incomplete).
    """
    if raw_size is not None:
        return _write_piped(copy, raw_size, meta, out, zstd_level, threads)
    fd, tmp = tempfile.mkstemp(prefix=".dstl-copy-", suffix=".mdb", dir=tmp_dir)
    try:
        copy(fd)
        os.lseek(fd, 0, os.SEEK_SET)
        with os.fdopen(fd, "rb", closefd=False) as raw:
            return _write_object(raw, os.fstat(fd).st_size, meta, out, zstd_level, threads)
    finally:
        os.close(fd)
        os.unlink(tmp)


def spool_file_snapshot(copy: Callable[[int], object], raw_size: int, meta: FileSnapshotMeta,
                        directory: str, *, zstd_level: int = 1) -> BinaryIO:
    """Write a v2 snapshot object into an unnamed temporary file in ``directory`` (it has no
    name, so it disappears when closed, or with the process): the copy streamed as
    :func:`write_file_snapshot` with ``raw_size`` does. Returns the file, open for reading at
    its start; its size is the object's. The caller closes it once the object is uploaded.

    Raises:
        what :func:`write_file_snapshot` raises, and ``OSError`` of the temporary file.
    """
    # the caller closes it
    spool = tempfile.TemporaryFile(prefix=".dstl-spool-", dir=directory)  # noqa: SIM115
    try:
        write_file_snapshot(copy, meta, spool, zstd_level=zstd_level, raw_size=raw_size)
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    return cast(BinaryIO, spool)


def _write_piped(copy: Callable[[int], object], raw_size: int, meta: FileSnapshotMeta,
                 out: BinaryIO, zstd_level: int, threads: int) -> int:
    """:func:`write_file_snapshot` through a pipe: ``copy`` writes it on a helper thread (LMDB's
    copy runs without the GIL), the calling thread compresses what it reads."""
    r, w = os.pipe()
    _widen_pipe(w)
    copy_error: list[BaseException] = []

    def run_copy() -> None:
        try:
            copy(w)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            copy_error.append(exc)
        finally:
            os.close(w)

    thread = threading.Thread(target=run_copy, name="dstl-snapshot-copy", daemon=True)
    thread.start()
    try:
        with os.fdopen(r, "rb", closefd=False) as raw:
            size = _write_object(raw, raw_size, meta, out, zstd_level, threads)
    except BaseException as exc:
        _drain(r, thread)
        if copy_error:   # the copy's own failure explains a short stream
            raise copy_error[0] from exc
        raise
    _drain(r, thread)
    if copy_error:
        raise copy_error[0]
    return size


def _widen_pipe(fd: int) -> None:
    """A 1 MiB pipe buffer where the platform allows it (Linux): fewer switches between the copy
    and the compressor. The default works too."""
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, set_size, 1 << 20)


def _drain(r: int, thread: threading.Thread) -> None:
    """Read the pipe to its end, so the copy never blocks on it (nor meets a closed reader:
    no ``SIGPIPE`` in a process that does not ignore it), then wait for the copy and close."""
    try:
        while os.read(r, _CHUNK):
            pass
    finally:
        thread.join()
        os.close(r)


class _CrcWriter:
    """Counts and checksums what goes through to ``out``."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.crc = 0
        self.size = 0

    def write(self, data: bytes) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        self.out.write(data)
        return len(data)


def _write_object(raw: BinaryIO, raw_size: int, meta: FileSnapshotMeta, out: BinaryIO,
                  zstd_level: int, threads: int) -> int:
    w = _CrcWriter(out)
    w.write(encode_header(FILE_SNAPSHOT_FORMAT))
    w.write(encode_record(meta.to_bytes(), FILE_SNAPSHOT_FORMAT, zstd_level=zstd_level,
                          what="the metadata"))
    data_offset = w.size
    cctx = zstandard.ZstdCompressor(level=zstd_level, write_checksum=True,
                                    write_content_size=True, threads=threads)
    z = cctx.stream_writer(w, size=raw_size, closefd=False)  # type: ignore[arg-type]
    done = 0
    while done <= raw_size:
        chunk = raw.read(_CHUNK)
        if not chunk:
            break
        done += len(chunk)
        if done <= raw_size:
            z.write(chunk)
    if done != raw_size:   # checked before zstd ends the frame (it would refuse it less clearly)
        raise UsageError(f"the LMDB copy changed size while being compressed: {raw_size} bytes "
                         f"expected, {'more' if done > raw_size else done} written")
    z.close()  # type: ignore[no-untyped-call]  # ends the frame; closefd=False keeps ``w`` open
    data_length = w.size - data_offset
    w.write(_FOOTER_HEAD.pack(data_offset, data_length, raw_size,
                              FILE_SNAPSHOT_FORMAT.kind, FILE_SNAPSHOT_FORMAT.version, 0))
    out.write(encode_trailer(w.crc))
    return w.size + TRAILER_SIZE


# --------------------------------------------------------------------------- reading


def read_file_snapshot_layout(read: ReadAt, size: int, *, key: str) -> FileSnapshotLayout:
    """Header, footer and metadata of a v2 object (not the object crc: :func:`verify_file_snapshot`
    checks every byte).

    Raises:
        TruncatedObjectError, ChecksumMismatchError, UnsupportedFormatError, CorruptObjectError.
    """
    fmt = FILE_SNAPSHOT_FORMAT
    check_header(read(0, min(size, HEADER_SIZE)), key, fmt)
    check_min_size(size, HEADER_SIZE + RECORD_HEADER_SIZE + FILE_FOOTER_SIZE, key, fmt)
    tail = read(size - FILE_FOOTER_SIZE, FILE_FOOTER_SIZE)
    check_end_magic(tail, size, key, fmt)
    at = size - FILE_FOOTER_SIZE
    data_offset, data_length, raw_size, kind, version, flags = _FOOTER_HEAD.unpack_from(tail, 0)
    check_kind(key, at + 24, fmt, kind, version, flags)
    (object_crc,) = struct.unpack_from(">I", tail, _FOOTER_HEAD.size)
    if data_offset <= HEADER_SIZE + RECORD_HEADER_SIZE or data_offset + data_length != at:
        raise CorruptObjectError(key, at, f"footer places the data at [{data_offset}, "
                                          f"{data_offset + data_length}), but it must follow the "
                                          f"metadata and end at the footer ({at})")
    record = read(HEADER_SIZE, data_offset - HEADER_SIZE)
    content = open_record(record, key=key, offset=HEADER_SIZE, fmt=fmt, what="metadata record")
    meta = FileSnapshotMeta.from_bytes(content, key=key, offset=HEADER_SIZE)
    return FileSnapshotLayout(meta, size, data_offset, data_length, raw_size, object_crc)


def verify_file_snapshot(read: ReadAt, size: int, *, key: str) -> FileSnapshotLayout:
    """Check every byte of a v2 object against its object crc (in chunks), and its structure.

    The data is not decompressed here (:func:`decompress_file_snapshot` checks zstd's content
    checksum and the raw file's size and crc32 while it writes the file).

    Raises:
        TruncatedObjectError, ChecksumMismatchError, UnsupportedFormatError, CorruptObjectError.
    """
    layout = read_file_snapshot_layout(read, size, key=key)
    end = size - TRAILER_SIZE
    crc = 0
    pos = 0
    while pos < end:
        n = min(_CHUNK, end - pos)
        crc = zlib.crc32(read(pos, n), crc)
        pos += n
    if crc != layout.object_crc:
        raise ChecksumMismatchError(key, end, "file snapshot object", layout.object_crc, crc)
    return layout


def decompress_file_snapshot(read: ReadAt, layout: FileSnapshotLayout, path: str, *,
                             key: str) -> None:
    """Decompress the data of a verified v2 object into the new file ``path``: the frame must
    declare the footer's raw size and a content checksum, which zstd verifies at the end (the
    file is complete and checked when this returns; on error it may hold garbage: the caller
    removes it).

    Raises:
        CorruptObjectError, TruncatedObjectError: naming the object and the data's offset.
        OSError: the local disk is full, or the file exists (raised as is).
    """
    with open(path, "xb") as f:
        _decompress(read, layout, key, f)


def decompress_file_snapshot_into(read: ReadAt, layout: FileSnapshotLayout, out: Any, *,
                                  key: str) -> None:
    """Decompress the data of a verified v2 object into ``out``, a writable buffer of exactly
    the footer's raw size (a reader that parses the file in memory): zstd writes straight into
    it, with the checks of :func:`decompress_file_snapshot`. On error ``out`` may hold garbage.

    Raises:
        CorruptObjectError, TruncatedObjectError: naming the object and the data's offset.
        UsageError: ``out`` is not of the raw size.
    """
    view = memoryview(out).cast("B")
    if view.readonly or len(view) != layout.raw_size:
        raise UsageError(f"decompress_file_snapshot_into: a writable buffer of {layout.raw_size} "
                         f"bytes is needed for {key}, got {len(view)} bytes"
                         f"{' (read-only)' if view.readonly else ''}")
    _decompress(read, layout, key, view)


def _decompress(read: ReadAt, layout: FileSnapshotLayout, key: str,
                target: memoryview | BinaryIO) -> None:
    """The data's one zstd frame (:func:`check_data_frame`) decompressed straight into ``target``,
    a buffer of the raw size, or through a chunk-sized buffer into ``target``, a file: never
    more than the raw size, then the frame's end read (zstd checks the content checksum there)."""
    at, raw = layout.data_offset, layout.raw_size
    check_data_frame(read, layout, key=key)
    src = _RangeReader(read, layout.data_offset, layout.data_length)
    if isinstance(target, memoryview):
        buf, sink = target, None
    else:
        buf, sink = memoryview(bytearray(min(_CHUNK, raw))), target.write
    written = 0
    try:
        with _decompressor().stream_reader(cast(BinaryIO, src), read_size=_CHUNK,
                                           closefd=False) as reader:
            while written < raw:
                n = reader.readinto(buf[written:] if sink is None else buf[:raw - written])
                if not n:
                    break
                if sink is not None:
                    sink(buf[:n])
                written += n
            # the frame's end (its content checksum, checked by zstd) may be read only now
            if written == raw and reader.readinto(bytearray(1)):
                raise CorruptObjectError(key, at, f"data decompresses to more than the {raw} "
                                                  "bytes the footer says")
    except zstandard.ZstdError as exc:
        raise CorruptObjectError(key, at, f"zstd data of the file snapshot does not decode: "
                                          f"{exc}") from exc
    if src.remaining:
        raise CorruptObjectError(key, at + layout.data_length - src.remaining,
                                 f"{src.remaining} bytes after the zstd data")
    if written != raw:
        raise TruncatedObjectError(key, at, raw, written, "decompressed LMDB data file")


def check_data_frame(read: ReadAt, layout: FileSnapshotLayout, *, key: str) -> None:
    """The data is exactly one zstd frame (its blocks walked by their 3-byte headers, so bytes or
    a second frame after it are refused) that promises the footer's raw size and a content
    checksum, and whose blocks can produce that many bytes (a frame that declares more is
    refused before anything is decompressed or staged).

    Raises:
        CorruptObjectError, TruncatedObjectError: naming the object and the offset.
    """
    at, length = layout.data_offset, layout.data_length
    head = read(at, min(length, _MAX_FRAME_HEADER))
    try:
        params = zstandard.get_frame_parameters(head)
        pos = zstandard.frame_header_size(head)
    except zstandard.ZstdError as exc:
        raise CorruptObjectError(key, at, f"the data is no zstd frame: {exc}") from exc
    if params.content_size != layout.raw_size or not params.has_checksum:
        raise CorruptObjectError(key, at, f"the zstd frame declares {params.content_size} bytes "
                                          f"(footer: {layout.raw_size}) and "
                                          f"{'a' if params.has_checksum else 'no'} content "
                                          "checksum")
    last = 0
    most = 0   # the most the blocks can produce: raw and RLE blocks say, others <= 128 KiB
    while not last:
        if pos + 3 > length:
            raise TruncatedObjectError(key, at + pos, 3, max(length - pos, 0), "zstd block header")
        header = int.from_bytes(read(at + pos, 3), "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        if kind == 3:
            raise CorruptObjectError(key, at + pos, "reserved zstd block type")
        pos += 3 + (1 if kind == 1 else size)   # an RLE block stores one byte
        most += size if kind < 2 else _MAX_BLOCK
    if pos + 4 != length:   # the frame ends with its 4-byte content checksum
        raise CorruptObjectError(key, at + min(pos, length),
                                 f"the zstd frame is {pos + 4} bytes, the data {length}: bytes "
                                 "after the frame")
    if most < layout.raw_size:   # refused before a byte is written, whatever the disk holds
        raise CorruptObjectError(key, at, f"the zstd frame's blocks can produce at most {most} "
                                          f"bytes, not the {layout.raw_size} it declares")


def _decompressor() -> zstandard.ZstdDecompressor:
    return zstandard.ZstdDecompressor()


class _RangeReader(io.RawIOBase):
    """``read(n)`` over ``[offset, offset + length)`` of an object, for the zstd reader."""

    def __init__(self, read: ReadAt, offset: int, length: int) -> None:
        super().__init__()
        self._read = read
        self._pos = offset
        self.remaining = length

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = self.remaining if n is None or n < 0 else min(n, self.remaining)
        if n <= 0:
            return b""
        data = self._read(self._pos, n)
        self._pos += n
        self.remaining -= n
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)
