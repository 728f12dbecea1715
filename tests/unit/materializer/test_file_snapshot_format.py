"""Snapshot format v2 (file level): round trip, and every damage is a typed error naming the object
before any byte of the data file is trusted."""

from __future__ import annotations

import io
import os
import stat
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

from dstl.errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    TruncatedObjectError,
    UnsupportedFormatError,
    UsageError,
)
from dstl.keygroups import KeyGroupRange
from materializer.file_snapshot import (
    FILE_FOOTER_SIZE,
    FileSnapshotLayout,
    FileSnapshotMeta,
    decompress_file_snapshot,
    decompress_file_snapshot_into,
    read_file_snapshot_layout,
    snapshot_version,
    spool_file_snapshot,
    verify_file_snapshot,
    write_file_snapshot,
)
from materializer.snapshot_format import decode_snapshot
from restore.reader import verify_snapshot

KEY = "snapshots/op/obj.snap"
META = FileSnapshotMeta(KeyGroupRange(0, 7), 8, {"0": {"name": "v", "kind": "value"}}, "op", 3,
                        extra={"up_to": 9})


def _env_copy(tmp: Path, n: int = 3000) -> Callable[[int], object]:
    env = lmdb.open(str(tmp / "src"), map_size=1 << 26)
    with env.begin(write=True) as t:
        for i in range(n):
            t.put(struct.pack(">HHI", i % 8, 0, 4) + b"k%03d" % (i % 1000) + b"%d" % i,
                  os.urandom(8) + b"v" * 40)
    txn = env.begin()

    def copy(fd: int) -> None:
        env.copyfd(fd, compact=True, txn=txn)
    return copy


def _object(tmp: Path) -> bytes:
    out = io.BytesIO()
    size = write_file_snapshot(_env_copy(tmp), META, out, tmp_dir=str(tmp))
    assert size == len(out.getvalue())
    return out.getvalue()


def _reader(data: bytes) -> Callable[[int, int], bytes]:
    return lambda off, n: data[off:off + n]


def test_round_trip_gives_back_the_file_and_metadata(tmp_path: Path) -> None:
    data = _object(tmp_path)
    assert snapshot_version(data) == 2
    layout = verify_file_snapshot(_reader(data), len(data), key=KEY)
    assert layout.meta == META
    out = tmp_path / "out.mdb"
    decompress_file_snapshot(_reader(data), layout, str(out), key=KEY)
    assert out.stat().st_size == layout.raw_size
    os.makedirs(tmp_path / "env")
    os.rename(out, tmp_path / "env" / "data.mdb")
    with lmdb.open(str(tmp_path / "env"), readonly=True, lock=False) as env:
        assert env.stat()["entries"] == 3000
    # nothing left in tmp_dir but what the test made
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".dstl-copy-")]


def _decompress(how: str, data: bytes, layout: FileSnapshotLayout, tmp_path: Path) -> bytes:
    """The raw file, decompressed into a new file (``how="file"``, a restore's way) or into a
    buffer (``"memory"``, the column-wise reader's)."""
    if how == "file":
        out = tmp_path / "out.mdb"
        try:
            decompress_file_snapshot(_reader(data), layout, str(out), key=KEY)
            return out.read_bytes()
        finally:
            out.unlink(missing_ok=True)
    buf = bytearray(layout.raw_size)
    decompress_file_snapshot_into(_reader(data), layout, buf, key=KEY)
    return bytes(buf)


def test_a_copy_of_known_size_streams_through_a_pipe_into_the_same_object(tmp_path: Path
                                                                         ) -> None:
    """With the copy's size known, the copy goes into a pipe (never a file) and the object is
    byte for byte the one the temporary-file path writes."""
    copy = _env_copy(tmp_path)
    kinds: list[bool] = []

    def spying(fd: int) -> None:
        kinds.append(stat.S_ISFIFO(os.fstat(fd).st_mode))
        copy(fd)

    through_file = io.BytesIO()
    write_file_snapshot(spying, META, through_file, tmp_dir=str(tmp_path))
    layout = verify_file_snapshot(_reader(through_file.getvalue()), through_file.tell(), key=KEY)
    before = sorted(os.listdir(tmp_path))
    streamed = io.BytesIO()
    size = write_file_snapshot(spying, META, streamed, tmp_dir=str(tmp_path),
                               raw_size=layout.raw_size)
    assert kinds == [False, True]
    assert size == len(streamed.getvalue())
    assert streamed.getvalue() == through_file.getvalue()
    assert sorted(os.listdir(tmp_path)) == before
    with spool_file_snapshot(copy, layout.raw_size, META, str(tmp_path)) as spool:
        assert spool.read() == through_file.getvalue()
        assert sorted(os.listdir(tmp_path)) == before   # the spool has no name


@pytest.mark.parametrize("delta", [-4096, 4096])
def test_a_copy_of_another_size_than_announced_is_a_usage_error(tmp_path: Path,
                                                                delta: int) -> None:
    copy = _env_copy(tmp_path)
    out = io.BytesIO()
    write_file_snapshot(copy, META, out, tmp_dir=str(tmp_path))
    raw = verify_file_snapshot(_reader(out.getvalue()), len(out.getvalue()), key=KEY).raw_size
    with pytest.raises(UsageError, match="changed size"):
        write_file_snapshot(copy, META, io.BytesIO(), raw_size=raw + delta)


def test_a_failing_copy_raises_its_own_error_and_leaves_nothing(tmp_path: Path) -> None:
    """The copy fails after writing part of the file: its error comes out (not the short
    stream's), no thread is left blocked on the pipe, and the spool is gone."""
    def failing(fd: int) -> None:
        os.write(fd, b"\0" * (3 << 20))
        raise OSError(5, "disk gone")

    threads = threading.active_count()
    with pytest.raises(OSError, match="disk gone"):
        spool_file_snapshot(failing, 8 << 20, META, str(tmp_path))
    assert threading.active_count() == threads
    assert os.listdir(tmp_path) == []


def test_both_ways_to_decompress_give_the_same_file(tmp_path: Path) -> None:
    data = _object(tmp_path)
    layout = verify_file_snapshot(_reader(data), len(data), key=KEY)
    assert _decompress("memory", data, layout, tmp_path) == _decompress("file", data, layout,
                                                                        tmp_path)


def test_a_buffer_of_another_size_is_a_usage_error(tmp_path: Path) -> None:
    data = _object(tmp_path)
    layout = verify_file_snapshot(_reader(data), len(data), key=KEY)
    for buf in (bytearray(layout.raw_size - 1), bytearray(layout.raw_size + 1),
                bytes(layout.raw_size)):
        with pytest.raises(UsageError, match=KEY):
            decompress_file_snapshot_into(_reader(data), layout, buf, key=KEY)


def test_v1_reader_refuses_v2_with_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedFormatError, match="version 2"):
        decode_snapshot(_object(tmp_path), key=KEY)


@pytest.mark.parametrize("where", ["header", "metadata", "data-start", "data-middle", "data-end",
                                   "footer", "trailer"])
def test_any_flipped_byte_is_a_typed_error_naming_the_object(tmp_path: Path, where: str) -> None:
    data = bytearray(_object(tmp_path))
    layout = read_file_snapshot_layout(_reader(bytes(data)), len(data), key=KEY)
    pos = {"header": 2, "metadata": 12, "data-start": layout.data_offset + 1,
           "data-middle": layout.data_offset + layout.data_length // 2,
           "data-end": layout.data_offset + layout.data_length - 1,
           "footer": len(data) - FILE_FOOTER_SIZE + 3, "trailer": len(data) - 6}[where]
    data[pos] ^= 0x20
    with pytest.raises(CorruptObjectError) as info:
        verify_file_snapshot(_reader(bytes(data)), len(data), key=KEY)
    assert info.value.key == KEY
    with pytest.raises(CorruptObjectError):   # the cache's verify, by name
        verify_snapshot(bytes(data), KEY)


@pytest.mark.parametrize("cut", [1, 7, 9, 40, 41, 200, -1, -8, -39, -41])
def test_truncated_object_is_a_typed_error(tmp_path: Path, cut: int) -> None:
    data = _object(tmp_path)
    short = data[:cut] if cut > 0 else data[:len(data) + cut]
    with pytest.raises(CorruptObjectError) as info:
        verify_file_snapshot(_reader(short), len(short), key=KEY)
    assert info.value.key == KEY
    assert isinstance(info.value, (TruncatedObjectError, ChecksumMismatchError,
                                   UnsupportedFormatError)) or "footer" in str(info.value)


def _forge(data: bytes, **footer: int) -> bytes:
    """The object with footer fields replaced and its object crc recomputed (a buggy writer)."""
    head = struct.Struct(">QQQBBH")
    at = len(data) - FILE_FOOTER_SIZE
    fields = dict(zip(("off", "length", "raw_size", "kind", "version", "flags"),
                      head.unpack_from(data, at), strict=True))
    fields.update(footer)
    body = data[:at] + head.pack(*fields.values())
    return body + struct.pack(">I", zlib.crc32(body)) + b"LTSD"


@pytest.mark.parametrize("way", ["file", "memory"])
@pytest.mark.parametrize("field,delta,error", [("raw_size", 4096, CorruptObjectError),
                                               ("raw_size", -4096, CorruptObjectError),
                                               ("raw_size", -1, CorruptObjectError)])
def test_forged_footer_is_caught_while_decompressing(tmp_path: Path, field: str, delta: int,
                                                     error: type[Exception], way: str) -> None:
    good = _object(tmp_path)
    layout = read_file_snapshot_layout(_reader(good), len(good), key=KEY)
    bad = _forge(good, **{field: getattr(layout, field) + delta})
    forged = verify_file_snapshot(_reader(bad), len(bad), key=KEY)   # crc matches: a forgery
    with pytest.raises(error) as info:
        _decompress(way, bad, forged, tmp_path)
    assert isinstance(info.value, CorruptObjectError) and info.value.key == KEY


def test_forged_footer_placing_data_elsewhere_is_refused(tmp_path: Path) -> None:
    good = _object(tmp_path)
    layout = read_file_snapshot_layout(_reader(good), len(good), key=KEY)
    bad = _forge(good, off=layout.data_offset + 1)
    with pytest.raises(CorruptObjectError, match="footer places the data"):
        verify_file_snapshot(_reader(bad), len(bad), key=KEY)


_OK = (b'{"table":"lmdb","layout":"1","key_groups":[0,7],"max_parallelism":8,'
       b'"states":{"0":{"name":"v","kind":"value"}},"operator_id":"o","materialization_id":1}')


def test_good_metadata_parses() -> None:
    meta = FileSnapshotMeta.from_bytes(_OK, key=KEY, offset=8)
    assert meta.key_groups == KeyGroupRange(0, 7) and meta.states["0"]["name"] == "v"


@pytest.mark.parametrize("meta", [b"[]", b'{"table": "heap"}', b"not json", b"\xff\xfe",
                                  _OK.replace(b"[0,7]", b"[0,9]"),
                                  _OK.replace(b'"max_parallelism":8', b'"max_parallelism":true'),
                                  _OK.replace(b'"0":{', b'"x":{'),
                                  _OK.replace(b'"0":{', b'"70000":{'),
                                  _OK.replace(b'"kind":"value"', b'"kind":"nope"'),
                                  _OK.replace(b'"materialization_id":1', b'"materialization_id":-1'),
                                  _OK.replace(b'"operator_id":"o"', b'"operator_id":7'),
                                  b"[" * 5000 + b"]" * 5000])
def test_metadata_that_is_not_dstls_is_refused(meta: bytes) -> None:
    with pytest.raises(CorruptObjectError, match=r"metadata|state 0|nested"):
        FileSnapshotMeta.from_bytes(meta, key=KEY, offset=8)


def _with_data(good: bytes, data: bytes, raw_size: int) -> bytes:
    """``good`` with its data region replaced (footer and object crc recomputed)."""
    layout = read_file_snapshot_layout(_reader(good), len(good), key=KEY)
    head = good[:layout.data_offset] + data
    footer = struct.pack(">QQQBBH", layout.data_offset, len(data), raw_size, 2, 2, 0)
    body = head + footer
    return body + struct.pack(">I", zlib.crc32(body)) + b"LTSD"


@pytest.mark.parametrize("way", ["file", "memory"])
@pytest.mark.parametrize("how", ["no-checksum", "no-size", "trailing-bytes", "two-frames",
                                 "not-zstd", "wrong-checksum", "damaged-block"])
def test_forged_data_frames_are_refused(tmp_path: Path, how: str, way: str) -> None:
    import zstandard
    good = _object(tmp_path)
    raw = os.urandom(5000)
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    data = {"no-checksum": zstandard.ZstdCompressor(write_checksum=False).compress(raw),
            "no-size": zstandard.ZstdCompressor(write_checksum=True, write_content_size=False)
            .compress(raw),
            "trailing-bytes": frame + b"junk",
            "two-frames": frame + frame,
            "not-zstd": b"\x00" * 64,
            # a frame whose content checksum (its last 4 bytes) or whose data does not hold
            "wrong-checksum": frame[:-4] + bytes(b ^ 0xFF for b in frame[-4:]),
            "damaged-block": frame[:-9] + bytes([frame[-9] ^ 0x10]) + frame[-8:]}[how]
    bad = _with_data(good, data, len(raw))
    layout = verify_file_snapshot(_reader(bad), len(bad), key=KEY)
    with pytest.raises(CorruptObjectError) as info:
        _decompress(way, bad, layout, tmp_path)
    assert info.value.key == KEY


def test_a_frame_declaring_more_than_its_blocks_can_hold_is_refused_before_staging(
        tmp_path: Path) -> None:
    # a frame that declares 8 GiB but holds one raw block of 4 bytes: refused by the block
    # walk, before a staging directory is made or the disk is asked (no LocalDiskFullError)
    from materializer.file_snapshot import check_data_frame
    from materializer.handles import SnapshotRef
    from restore.file_restore import stage_file_snapshot

    declared = 8 << 30
    frame = (b"\x28\xb5\x2f\xfd" + bytes([0b1100_0100, 0]) + struct.pack("<Q", declared)
             + struct.pack("<I", (4 << 3) | 1)[:3] + b"tiny" + struct.pack("<I", 0))
    bad = _with_data(_object(tmp_path), frame, declared)
    layout = verify_file_snapshot(_reader(bad), len(bad), key=KEY)
    with pytest.raises(CorruptObjectError, match="can produce at most 4 bytes"):
        check_data_frame(_reader(bad), layout, key=KEY)
    ref = SnapshotRef(KEY, len(bad), layout.meta.key_groups, layout.meta.materialization_id)
    parent = tmp_path / "stage"
    with pytest.raises(CorruptObjectError, match="can produce at most") as info:
        stage_file_snapshot(ref, _reader(bad), len(bad), str(parent), verified=False)
    assert info.value.key == KEY and not parent.exists()


@pytest.mark.parametrize("way", ["file", "memory"])
def test_a_content_checksum_read_apart_from_its_frame_is_still_checked(tmp_path: Path,
                                                                       way: str) -> None:
    """The data is read in chunks: a frame whose content checksum begins exactly where a
    chunk ends is checked too (the decompressor has written every byte before it sees it)."""
    import zstandard

    from materializer.file_snapshot import _CHUNK

    good = _object(tmp_path)
    compressor = zstandard.ZstdCompressor(write_checksum=True)
    size = _CHUNK - 200
    for _ in range(3):  # random data: the frame is the data plus fixed overheads
        raw = os.urandom(size)
        frame = compressor.compress(raw)
        size += _CHUNK - (len(frame) - 4)
    assert len(frame) - 4 == _CHUNK
    ok = _with_data(good, frame, len(raw))
    assert _decompress(way, ok, verify_file_snapshot(_reader(ok), len(ok), key=KEY),
                       tmp_path) == raw
    bad = _with_data(good, frame[:-4] + bytes(b ^ 0xFF for b in frame[-4:]), len(raw))
    layout = verify_file_snapshot(_reader(bad), len(bad), key=KEY)
    with pytest.raises(CorruptObjectError) as info:
        _decompress(way, bad, layout, tmp_path)
    assert info.value.key == KEY
