"""The validator's batch check of layout-2 values (:mod:`materializer.lmdb_check`): the content
sizes it reads from many zstd frame headers at once equal zstd's own reading of each header, and
the frames of one dictionary decoded in one call agree with decoding each on its own."""

from __future__ import annotations

import numpy as np
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from materializer.lmdb_check import _declared_sizes, _frames_decode
from materializer.value_codec import ValueCodec, train_dictionary

#: content sizes at the edges of zstd's size field widths (1, 2, 4 and 8 bytes)
SIZES = [0, 1, 255, 256, 257, 65_791, 65_792, 65_793, 1 << 20]


def _frame(size: int, single_segment: bool, dict_id: bool, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 4, size, dtype=np.uint8).tobytes()
    if single_segment:
        return zstandard.ZstdCompressor(level=1, write_content_size=True,
                                        write_dict_id=dict_id).compress(data)
    c = zstandard.ZstdCompressor(level=1, write_content_size=True)
    w = c.compressobj(size=size)   # a streamed frame: window descriptor, not single segment
    return w.compress(data) + w.flush()


def _columns(frames: list[bytes], pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    data = b"".join(b"\x00" * pad + f for f in frames)
    lengths = np.array([len(f) for f in frames], dtype=np.int64)
    starts = np.cumsum(lengths + pad) - lengths
    return np.frombuffer(data, dtype=np.uint8), starts, lengths


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(SIZES), st.booleans(), st.booleans()),
                min_size=1, max_size=8), st.integers(0, 3))
def test_declared_sizes_equal_zstds_reading_of_each_header(
        shapes: list[tuple[int, bool, bool]], pad: int) -> None:
    frames = [_frame(size, single, did, i) for i, (size, single, did) in enumerate(shapes)]
    data, starts, lengths = _columns(frames, pad)
    declared, ok = _declared_sizes(data, starts, lengths, 1 << 30)
    assert ok.all()
    assert declared.tolist() == [zstandard.frame_content_size(f) for f in frames]


def test_headers_that_are_not_a_bounded_declared_size_are_flagged() -> None:
    good = _frame(300, True, False, 1)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(b"a" * 300)
    frames = [good, b"not a zstd frame", good[:5], unsized, _frame(1 << 20, True, False, 2),
              good[:4] + bytes([good[4] | 0x08]) + good[5:]]   # the reserved bit
    data, starts, lengths = _columns(frames, 2)
    declared, ok = _declared_sizes(data, starts, lengths, 1 << 16)
    assert ok.tolist() == [True, False, False, False, False, False]
    assert int(declared[0]) == 300


def test_one_call_per_dictionary_agrees_with_each_frame_decoded_alone() -> None:
    values = [(f"{i:08d}" * 40).encode() for i in range(1_200)]
    d = train_dictionary(values)
    assert d is not None
    codec = ValueCodec({0: d})
    frames = [codec.encode(v)[2:] for v in values[:50]]
    data, starts, lengths = _columns(frames, 2)
    declared, ok = _declared_sizes(data, starts, lengths, 1 << 20)
    assert ok.all() and _frames_decode(codec, 0, data, starts, lengths, declared)
    short = declared.copy()
    short[7] -= 1   # one frame declared a byte less than it holds
    assert not _frames_decode(codec, 0, data, starts, lengths, short)
    cut = lengths.copy()
    cut[3] -= 3     # one frame cut short
    assert not _frames_decode(codec, 0, data, starts, cut, declared)
