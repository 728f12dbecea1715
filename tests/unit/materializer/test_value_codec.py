"""The framing of an LMDB table's values (:mod:`materializer.value_codec`): round trips (fixed
and Hypothesis), when tag 1 is chosen, dictionaries trained deterministically, and every forged
stored value or dictionary record refused with a :class:`~dstl.errors.CorruptValueError` that
names the entry."""

from __future__ import annotations

import hashlib
import threading

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from dstl.errors import CorruptObjectError, CorruptValueError, UsageError
from materializer.value_codec import (
    DICT_BYTES,
    MIN_COMPRESSED_VALUE_BYTES,
    TAG_DICT,
    TAG_RAW,
    TRAIN_MIN_VALUES,
    ValueCodec,
    dictionary_key,
    dictionary_number,
    load_dictionary,
    train_dictionary,
)


def value(i: int, n: int = 274) -> bytes:
    """A value like ``bench/table_codec.py``'s ``scale`` values: two hex digests and filler."""
    text = (hashlib.sha256(f"{i}a".encode()).hexdigest()
            + hashlib.sha256(f"{i}b".encode()).hexdigest() + "x" * 200)
    return text.encode()[:n]


VALUES = [value(i) for i in range(TRAIN_MIN_VALUES)]
DICT = train_dictionary(VALUES)
assert DICT is not None


def codec() -> ValueCodec:
    assert DICT is not None
    return ValueCodec({0: DICT})


def test_training_is_deterministic_and_needs_enough_large_values() -> None:
    assert DICT is not None and len(DICT) == DICT_BYTES
    assert train_dictionary(VALUES) == DICT
    assert train_dictionary(VALUES[:TRAIN_MIN_VALUES - 1]) is None
    small = [v[:MIN_COMPRESSED_VALUE_BYTES - 1] for v in VALUES]
    assert train_dictionary(small) is None


def test_large_values_take_the_dictionary_and_shrink() -> None:
    c = codec()
    stored = [c.encode(v) for v in (value(i) for i in range(5000, 5200))]
    assert all(s[0] == TAG_DICT and s[1] == 0 for s in stored)
    assert sum(map(len, stored)) < 0.5 * 200 * 274
    assert [c.decode(s) for s in stored] == [value(i) for i in range(5000, 5200)]


def test_small_incompressible_and_dictionaryless_values_stay_raw() -> None:
    c = codec()
    small = value(1, MIN_COMPRESSED_VALUE_BYTES - 1)
    noise = hashlib.sha256(b"n").digest() * 4    # 128 bytes zstd cannot shrink
    noise = bytes(b ^ i for i, b in enumerate(noise))
    for v in (b"", small, noise):
        assert c.encode(v) == bytes([TAG_RAW]) + v
        assert c.decode(c.encode(v)) == v
    assert ValueCodec().encode(value(3)) == bytes([TAG_RAW]) + value(3)


def test_encode_uses_the_highest_dictionary_and_renumbering_keeps_values() -> None:
    assert DICT is not None
    other = train_dictionary(value(i + 9000) for i in range(TRAIN_MIN_VALUES))
    assert other is not None
    src = ValueCodec({3: DICT})
    stored = src.encode(value(7))
    assert stored[1] == 3
    dst = ValueCodec({0: other, 5: DICT})
    assert dst.encode_number == 5 and dst.numbers == [0, 5]
    moved = ValueCodec.renumbered(stored, {3: 5})
    assert moved[1] == 5 and dst.decode(moved) == value(7)
    assert ValueCodec.renumbered(b"\x00abc", {3: 5}) == b"\x00abc"


def test_a_dictionary_number_is_taken_once_and_bounded() -> None:
    assert DICT is not None
    c = codec()
    with pytest.raises(UsageError, match="never changes"):
        c.add(0, DICT)
    with pytest.raises(UsageError):
        c.add(256, DICT)
    assert dictionary_number(dictionary_key(7)) == 7
    assert dictionary_number(b"\xff\xffdstl-layout") is None
    with pytest.raises(UsageError):
        dictionary_key(256)


def test_threads_decode_with_their_own_contexts() -> None:
    c = codec()
    stored = [c.encode(value(i)) for i in range(300)]
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(20):
                assert [c.decode(s) for s in stored] == [value(i) for i in range(300)]
        except BaseException as exc:   # reported to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=600),
                          st.builds(value, st.integers(0, 10**6), st.integers(0, 274))),
                max_size=30))
def test_round_trip(values: list[bytes]) -> None:
    c = codec()
    for v in values:
        stored = c.encode(v)
        assert len(stored) <= len(v) + 1
        assert c.decode(stored, b"k") == v
        assert c.declared_size(stored) == len(v)


# --------------------------------------------------------------------------- forged values


def _frame_declaring(size: int) -> bytes:
    """A tag-1 value whose frame declares ``size`` (256..65791) but holds 300 bytes."""
    stored = codec().encode(value(11, 274) + b"y" * 26)
    frame = bytearray(stored[2:])
    assert zstandard.frame_content_size(bytes(frame)) == 300
    frame[5:7] = (size - 256).to_bytes(2, "little")    # single-segment header: FCS at 5..6
    assert zstandard.frame_content_size(bytes(frame)) == size
    return stored[:2] + bytes(frame)


def _no_content_size() -> bytes:
    assert DICT is not None
    c = zstandard.ZstdCompressor(dict_data=zstandard.ZstdCompressionDict(DICT),
                                 write_content_size=False)
    return bytes([TAG_DICT, 0]) + c.compress(value(2))


FORGED = {
    "empty": (b"", "no tag byte"),
    "unknown tag": (b"\x07abc", "unknown value tag 7"),
    "tag without number": (b"\x01", "without a dictionary number"),
    "missing dictionary": (b"\x01\x09" + codec().encode(value(1))[2:], "dictionary 9"),
    "not a frame": (b"\x01\x00not a zstd frame", "frame header"),
    "no content size": (_no_content_size(), "does not declare its content size"),
    "truncated frame": (codec().encode(value(1))[:-4], "does not decode"),
    "trailing bytes": (codec().encode(value(1)) + b"zz", "does not decode"),
    "declares more": (_frame_declaring(400), "does not decode"),
    "declares less": (_frame_declaring(280), "does not decode"),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_forged_value_is_a_typed_error_naming_the_entry(case: str) -> None:
    """``decode_strict`` (the validator's) refuses every case; ``decode`` (a table's reads of
    validated values) every case but bytes after the frame, which it ignores: the frame's
    value is the one written."""
    stored, reason = FORGED[case]
    c = codec()
    with pytest.raises(CorruptValueError, match=reason) as info:
        c.decode_strict(stored, b"\x00\x01entry")
    assert isinstance(info.value, CorruptObjectError)
    assert info.value.entry_key == b"\x00\x01entry"
    assert info.value.key == "<table value>"
    if case == "trailing bytes":
        assert c.decode(stored) == value(1)
    else:
        with pytest.raises(CorruptValueError, match=reason):
            c.decode(stored, b"\x00\x01entry")


def test_declared_size_above_the_bound_is_refused_before_decoding() -> None:
    assert DICT is not None
    c = ValueCodec({0: DICT}, max_decoded_bytes=100)
    with pytest.raises(CorruptValueError, match="declares 274 bytes, more than the 100"):
        c.decode(codec().encode(value(1)), b"k")


@pytest.mark.parametrize("record", [b"", b"\x00" * 100, b"\x37\xa4\x30\xec" + b"\xff" * 200,
                                    b"x" * ((1 << 20) + 1)])
def test_forged_dictionary_record_is_refused(record: bytes) -> None:
    with pytest.raises(CorruptValueError) as info:
        load_dictionary(4, record, key="obj", offset=12)
    assert info.value.entry_key == dictionary_key(4)
    assert info.value.key == "obj" and info.value.offset == 12
    with pytest.raises(CorruptValueError):
        ValueCodec({4: record})


def test_a_value_above_the_decoded_bound_stays_raw() -> None:
    """What a reader would refuse to decode is never framed."""
    assert DICT is not None
    c = ValueCodec({0: DICT}, max_decoded_bytes=200)
    assert c.encode(value(1, 274))[0] == TAG_RAW
    assert c.encode(value(1, 200))[0] == TAG_DICT
