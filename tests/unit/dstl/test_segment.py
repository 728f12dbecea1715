"""Segment format v1: golden file, round trips, and corruption detection (G4)."""

from __future__ import annotations

import contextlib
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.segments import GOLDEN_EXPECTED, golden_change_sets, make_change_set

from dstl.errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    TruncatedObjectError,
    UnsupportedFormatError,
    UsageError,
)
from dstl.segment import (
    FOOTER_SIZE,
    HEADER_SIZE,
    decode_record,
    decode_segment,
    encode_segment,
    iter_body_changes,
)

GOLDEN = Path(__file__).resolve().parents[2] / "data" / "format" / "v1" / "segment-golden.seg"


def _changes(data: bytes, entry_key: str = "golden") -> dict[tuple[str, int], list[tuple[int, bytes]]]:
    seg = decode_segment(data, entry_key)
    out = {}
    for e in seg.entries:
        body = decode_record(data[e.offset:e.offset + e.length], key=entry_key, offset=e.offset,
                             log_id=e.log_id, sqn=e.sqn)
        out[(e.log_id, e.sqn)] = list(iter_body_changes(body))
    return out


def test_golden_segment_decodes_to_the_pinned_changes() -> None:
    data = GOLDEN.read_bytes()
    assert _changes(data) == GOLDEN_EXPECTED
    entries = decode_segment(data, "golden").entries
    assert [(e.log_id, e.sqn, e.kg_min, e.kg_max, e.change_count, e.payload_bytes)
            for e in entries] == [("op-a/0", 0, -1, 7, 4, 22), ("op-b/1", 5, 64, 65, 2, 20),
                                  ("op-a/0", 1, 7, 7, 1, 4)]


def test_golden_layout_matches_the_byte_tables_in_docs() -> None:
    """Parse the golden file by hand, independently of the decoder (docs/format.md tables)."""
    data = GOLDEN.read_bytes()
    assert data[:4] == b"DSTL" and data[4] == 1 and data[5] == 1 and data[6:8] == b"\0\0"
    assert data[-4:] == b"LTSD"
    index_offset, index_len, count, crc = struct.unpack(">QIII", data[-FOOTER_SIZE:-4])
    assert crc == zlib.crc32(data[:-8])
    assert count == 3 and index_offset + index_len == len(data) - FOOTER_SIZE
    # first record starts right after the header, its CRC covers its frame
    frame_len, frame_crc = struct.unpack(">II", data[HEADER_SIZE:HEADER_SIZE + 8])
    assert frame_crc == zlib.crc32(data[HEADER_SIZE + 8:HEADER_SIZE + 8 + frame_len])
    # index: u32 n, then u16 len + log id + fixed fields
    (n,) = struct.unpack(">I", data[index_offset:index_offset + 4])
    lid_len = struct.unpack(">H", data[index_offset + 4:index_offset + 6])[0]
    assert n == 3 and data[index_offset + 6:index_offset + 6 + lid_len] == b"op-a/0"


def test_reencoding_the_golden_content_round_trips() -> None:
    data, entries = encode_segment(golden_change_sets(), 1)
    assert _changes(data) == GOLDEN_EXPECTED
    assert [e.offset for e in entries] == [e.offset for e in decode_segment(data).entries]


def test_every_single_bit_flip_is_detected() -> None:
    data = bytearray(GOLDEN.read_bytes())
    for i in range(len(data) * 8):
        data[i // 8] ^= 1 << (i % 8)
        with pytest.raises(CorruptObjectError) as info:
            _changes(bytes(data))
        assert "golden" in str(info.value)
        data[i // 8] ^= 1 << (i % 8)


def test_every_truncation_is_detected() -> None:
    data = GOLDEN.read_bytes()
    for n in range(len(data)):
        with pytest.raises(CorruptObjectError):
            decode_segment(data[:n], "golden")


def test_ranged_record_bit_flips_are_detected() -> None:
    data = GOLDEN.read_bytes()
    for e in decode_segment(data).entries:
        record = bytearray(data[e.offset:e.offset + e.length])
        for i in range(len(record) * 8):
            record[i // 8] ^= 1 << (i % 8)
            with pytest.raises(CorruptObjectError) as info:
                decode_record(bytes(record), key="seg", offset=e.offset, log_id=e.log_id,
                              sqn=e.sqn)
            assert info.value.offset >= e.offset
            record[i // 8] ^= 1 << (i % 8)


def test_record_of_another_change_set_is_rejected() -> None:
    data = GOLDEN.read_bytes()
    e = decode_segment(data).entries[1]
    with pytest.raises(CorruptObjectError, match=r"expected \('op-a/0', sqn 0\)"):
        decode_record(data[e.offset:e.offset + e.length], key="seg", offset=e.offset,
                      log_id="op-a/0", sqn=0)


def test_truncated_ranged_record_is_typed() -> None:
    data = GOLDEN.read_bytes()
    e = decode_segment(data).entries[0]
    with pytest.raises(TruncatedObjectError):
        decode_record(data[e.offset:e.offset + e.length - 1], key="seg", offset=e.offset,
                      log_id=e.log_id, sqn=e.sqn)


def test_unknown_version_and_kind_are_unsupported() -> None:
    data = bytearray(GOLDEN.read_bytes())
    data[5] = 2
    with pytest.raises(UnsupportedFormatError, match="version 2"):
        decode_segment(bytes(data), "seg")
    data[5], data[4] = 1, 2
    with pytest.raises(UnsupportedFormatError, match="kind 2"):
        decode_segment(bytes(data), "seg")
    with pytest.raises(UnsupportedFormatError):
        decode_segment(b"PK\x03\x04" + bytes(40), "zip")


def test_crc_mismatch_names_expected_and_got() -> None:
    data = bytearray(GOLDEN.read_bytes())
    data[HEADER_SIZE + 20] ^= 0xFF
    with pytest.raises(ChecksumMismatchError) as info:
        decode_segment(bytes(data), "s3://b/dstl/x.seg")
    assert info.value.key == "s3://b/dstl/x.seg"
    assert len(info.value.expected) == 8 and info.value.expected != info.value.got


def test_empty_segment_is_refused() -> None:
    with pytest.raises(UsageError, match="empty segment"):
        encode_segment([])


def test_key_group_filter_keeps_metadata() -> None:
    cs = make_change_set("w", 0, [(-1, b"m"), (1, b"a"), (2, b"b"), (3, b"c")])
    assert list(iter_body_changes(cs.body, key_groups={2})) == [(-1, b"m"), (2, b"b")]


_changes_st = st.lists(st.tuples(st.integers(-1, 300), st.binary(max_size=64)), max_size=40)


@given(st.lists(st.tuples(st.text(min_size=1, max_size=12), _changes_st), min_size=1,
                max_size=6), st.sampled_from([-1, 1, 3]))
def test_round_trip_any_change_sets(sets: list[tuple[str, list[tuple[int, bytes]]]],
                                    level: int) -> None:
    css = [make_change_set(lid, i, ch) for i, (lid, ch) in enumerate(sets)]
    data, entries = encode_segment(css, level)
    got = _changes(data)
    for i, (lid, ch) in enumerate(sets):
        # order within a key group is kept; key groups come out ascending
        expected = sorted(ch, key=lambda c: c[0])
        assert got[(lid, i)] == expected
    assert [e.change_count for e in entries] == [len(ch) for _, ch in sets]


@given(st.binary(max_size=600))
def test_decoders_raise_only_typed_errors_on_garbage(blob: bytes) -> None:
    for fn in (lambda: decode_segment(blob, "g"),
               lambda: decode_record(blob, key="g", offset=0, log_id="w", sqn=0)):
        with contextlib.suppress(CorruptObjectError):  # any other exception fails the test
            fn()


@given(st.data())
def test_random_multi_byte_edits_are_detected(data: st.DataObject) -> None:
    blob = bytearray(GOLDEN.read_bytes())
    edits = data.draw(st.lists(st.tuples(st.integers(0, len(blob) - 1), st.integers(1, 255)),
                               min_size=1, max_size=8))
    for pos, xor in edits:
        blob[pos] ^= xor
    if bytes(blob) == GOLDEN.read_bytes():
        return  # the edits cancelled out
    with pytest.raises(CorruptObjectError):
        _changes(bytes(blob))
