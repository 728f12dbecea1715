"""The shared object envelope (header, records, trailer) and the checks both formats get from it.

The golden files and the corruption tests of each format live in test_segment.py and
test_snapshot_format_v1.py; this file covers the envelope on its own, and the checks the two
decoders used to apply differently (they now run the same code).
"""

from __future__ import annotations

import struct
import zlib

import pytest
import zstandard
from support.segments import make_change_set

from dstl.envelope import (
    HEADER_SIZE,
    KIND_SEGMENT,
    KIND_SNAPSHOT,
    RECORD_HEADER_SIZE,
    ObjectFormat,
    check_end_magic,
    check_header,
    check_object_crc,
    encode_header,
    encode_record,
    encode_trailer,
    open_record,
)
from dstl.errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    TruncatedObjectError,
    UnsupportedFormatError,
    UsageError,
)
from dstl.keygroups import KeyGroupRange
from dstl.segment import SEGMENT_FORMAT, decode_record, decode_segment, encode_segment
from materializer.snapshot_format import (
    SNAPSHOT_FORMAT,
    decode_block,
    decode_footer,
    decode_index,
    decode_snapshot,
    encode_snapshot,
)

SMALL = ObjectFormat(KIND_SEGMENT, "test object", 100, "write less")


def _record_of(frame: bytes) -> bytes:
    """A record around ``frame`` with a correct CRC (what a buggy or foreign writer can make)."""
    return struct.pack(">II", len(frame), zlib.crc32(frame)) + frame


def test_record_round_trips_and_every_bit_flip_is_detected() -> None:
    content = b"some content " * 5
    record = encode_record(content, SMALL, zstd_level=3, what="r")
    assert open_record(record, key="k", offset=40, fmt=SMALL, what="r") == content
    for bit in range(len(record) * 8):
        damaged = bytearray(record)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptObjectError) as info:
            open_record(bytes(damaged), key="k", offset=40, fmt=SMALL, what="r")
        assert info.value.key == "k" and info.value.offset >= 40


def test_record_lengths_are_checked_both_ways() -> None:
    record = encode_record(b"x" * 50, SMALL, zstd_level=1, what="r")
    with pytest.raises(TruncatedObjectError):
        open_record(record[:-1], key="k", offset=0, fmt=SMALL, what="r")
    with pytest.raises(TruncatedObjectError):
        open_record(record[:5], key="k", offset=0, fmt=SMALL, what="r")
    # more bytes than the frame length says: damaged, but not short
    with pytest.raises(CorruptObjectError, match="holds a frame of") as info:
        open_record(record + b"\0", key="k", offset=0, fmt=SMALL, what="r")
    assert not isinstance(info.value, TruncatedObjectError)
    with pytest.raises(TruncatedObjectError, match="needed 99 bytes"):
        open_record(record, key="k", offset=0, fmt=SMALL, what="r", expected_length=99)


def test_crc_is_checked_before_the_frame_is_parsed() -> None:
    record = bytearray(encode_record(b"y" * 60, SMALL, zstd_level=1, what="r"))
    record[RECORD_HEADER_SIZE + 5] ^= 0x40  # inside the zstd frame header (content size)
    with pytest.raises(ChecksumMismatchError) as info:
        open_record(bytes(record), key="k", offset=8, fmt=SMALL, what="block of key group 3")
    assert info.value.offset == 8 and "block of key group 3" in str(info.value)


def test_content_above_the_limit_is_refused_before_decompressing() -> None:
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(b"z" * 101)
    with pytest.raises(CorruptObjectError, match="declares content size 101") as info:
        open_record(_record_of(frame), key="k", offset=8, fmt=SMALL, what="r")
    assert info.value.offset == 8 + RECORD_HEADER_SIZE
    with pytest.raises(UsageError, match="write less"):
        encode_record(b"z" * 101, SMALL, zstd_level=1, what="r")


@pytest.mark.parametrize(("frame", "reason"), [
    (zstandard.ZstdCompressor(write_checksum=False).compress(b"data" * 8), "no content checksum"),
    (zstandard.ZstdCompressor(write_checksum=True, write_content_size=False)
     .compress(b"data" * 8), "does not declare its content size"),
    (zstandard.ZstdCompressor(write_checksum=True).compress(b"data" * 8) + b"\0\0",
     "bytes after the frame"),
], ids=["no-checksum", "no-content-size", "bytes-after-frame"])
def test_frames_without_the_required_fields_are_refused(frame: bytes, reason: str) -> None:
    with pytest.raises(CorruptObjectError, match=reason):
        open_record(_record_of(frame), key="k", offset=0, fmt=SMALL, what="r")


def test_both_formats_refuse_a_frame_without_checksum_or_with_trailing_bytes() -> None:
    """The segment decoder used to accept both (the snapshot decoder refused trailing bytes)."""
    cs = make_change_set("w", 0, [(1, b"a")])
    for frame in (zstandard.ZstdCompressor(write_checksum=False).compress(cs.body),
                  zstandard.ZstdCompressor(write_checksum=True).compress(cs.body) + b"\0"):
        with pytest.raises(CorruptObjectError):
            decode_record(_record_of(frame), key="seg", offset=8, log_id="w", sqn=0)
    data = encode_snapshot(KeyGroupRange(0, 3), b"m", [(2, [(0, b"k", b"", b"v")])])
    contents = decode_snapshot(data)
    assert contents.blocks == {2: [(0, b"k", b"", b"v")]}


def test_header_checks_name_the_format() -> None:
    assert encode_header(SEGMENT_FORMAT) == b"DSTL\x01\x01\x00\x00"
    assert encode_header(SNAPSHOT_FORMAT) == b"DSTL\x02\x01\x00\x00"
    with pytest.raises(UnsupportedFormatError, match=r"kind 2 \(snapshot\)") as info:
        check_header(encode_header(SEGMENT_FORMAT), "k", SNAPSHOT_FORMAT)
    assert info.value.offset == 4
    with pytest.raises(UnsupportedFormatError, match="segment format version 2") as info:
        check_header(b"DSTL\x01\x02\x00\x00", "k", SEGMENT_FORMAT)
    assert info.value.offset == 5
    with pytest.raises(UnsupportedFormatError, match="flags 0x0100") as info:
        check_header(b"DSTL\x02\x01\x01\x00", "k", SNAPSHOT_FORMAT)
    assert info.value.offset == 6
    with pytest.raises(TruncatedObjectError, match="snapshot header"):
        check_header(b"DST", "k", SNAPSHOT_FORMAT)
    assert (SEGMENT_FORMAT.kind, SNAPSHOT_FORMAT.kind) == (KIND_SEGMENT, KIND_SNAPSHOT)


def test_trailer_checks() -> None:
    body = encode_header(SMALL) + b"payload"
    data = body + encode_trailer(zlib.crc32(body))
    check_end_magic(data, len(data), "k", SMALL)
    check_object_crc(data, "k", SMALL)
    with pytest.raises(TruncatedObjectError, match="end magic") as info:
        check_end_magic(data[:-1], len(data) - 1, "k", SMALL)
    assert info.value.offset == len(data) - 5
    damaged = bytearray(data)
    damaged[HEADER_SIZE] ^= 1
    with pytest.raises(ChecksumMismatchError) as crc_info:
        check_object_crc(bytes(damaged), "k", SMALL)
    assert crc_info.value.offset == len(data) - 8


def test_snapshot_object_crc_is_checked_before_the_footer_is_parsed() -> None:
    """A flipped footer field of a whole snapshot is a checksum error (the segment's order),
    not an unsupported-format or structure error from parsing unverified bytes."""
    data = bytearray(encode_snapshot(KeyGroupRange(0, 3), b"m", [(1, [(0, b"k", b"", b"v")])]))
    data[-11] ^= 0x01  # the footer's copy of the version
    with pytest.raises(ChecksumMismatchError):
        decode_snapshot(bytes(data), key="snap")


def test_segment_and_snapshot_records_share_one_framing() -> None:
    """A segment record and a snapshot block are the same envelope: same framing, same errors."""
    seg, entries = encode_segment([make_change_set("w", 0, [(1, b"a")])])
    e = entries[0]
    record = seg[e.offset:e.offset + e.length]
    frame_len, crc = struct.unpack(">II", record[:8])
    assert frame_len == len(record) - 8 and crc == zlib.crc32(record[8:])
    assert decode_segment(seg).entries[0].length == e.length
    snap = encode_snapshot(KeyGroupRange(0, 3), b"", [(1, [(0, b"k", b"", b"v")])])
    footer = decode_footer(snap[-28:], len(snap))
    index = decode_index(snap[footer.index_offset:footer.index_offset + footer.index_length],
                         footer)
    (b1,) = index.blocks
    block = snap[b1.offset:b1.offset + b1.length]
    frame_len, crc = struct.unpack(">II", block[:8])
    assert frame_len == len(block) - 8 and crc == zlib.crc32(block[8:])
    assert decode_block(block, b1) == [(0, b"k", b"", b"v")]
