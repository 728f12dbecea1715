"""Key groups of many keys at once, with numpy (for validating stored files: every key's key
group recomputed from its bytes). A module of its own so that ``import dstl`` does not import
numpy: :func:`dstl.keygroups.key_group_for` is the one-key form, and the definition."""

from __future__ import annotations

import numpy as np

from dstl.checks import check_int
from dstl.keygroups import MAX_PARALLELISM_LIMIT, SEED

__all__ = ["key_groups_for"]

_P1, _P2, _P3, _P4, _P5 = (np.uint64(p) for p in (
    0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
    0x27D4EB2F165667C5))


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _round(acc: np.ndarray, lane: np.ndarray) -> np.ndarray:
    return _rotl(acc + lane * _P2, 31) * _P1


def _xxh64_rows(rows: np.ndarray, seed: int) -> np.ndarray:
    """XXH64 of each row of ``rows`` (contiguous ``uint8``, one key of ``rows.shape[1]`` bytes
    a row), the reference algorithm's steps applied to all rows at once (numpy's uint64 array
    arithmetic wraps, as XXH64's does)."""
    n, size = rows.shape

    def word(at: int, width: int) -> np.ndarray:   # a strided view of the rows, then one copy
        return np.ndarray((n,), dtype=f"<u{width}", buffer=rows, offset=at,
                          strides=(size,)).astype(np.uint64)

    at = 0
    if size >= 32:
        v = [np.full(n, (seed + p) % (1 << 64), dtype=np.uint64)
             for p in (int(_P1) + int(_P2), int(_P2), 0, -int(_P1))]
        while at + 32 <= size:
            for i in range(4):
                v[i] = _round(v[i], word(at + 8 * i, 8))
            at += 32
        h = _rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)
        for lane in v:
            h = (h ^ _round(np.zeros(n, np.uint64), lane)) * _P1 + _P4
    else:
        h = np.full(n, (seed + int(_P5)) % (1 << 64), dtype=np.uint64)
    h += np.uint64(size)
    while at + 8 <= size:
        h = _rotl(h ^ _round(np.zeros(n, np.uint64), word(at, 8)), 27) * _P1 + _P4
        at += 8
    if at + 4 <= size:
        h = _rotl(h ^ (word(at, 4) * _P1), 23) * _P2 + _P3
        at += 4
    while at < size:
        h = _rotl(h ^ (rows[:, at].astype(np.uint64) * _P5), 11) * _P1
        at += 1
    h ^= h >> np.uint64(33)
    h *= _P2
    h ^= h >> np.uint64(29)
    h *= _P3
    h ^= h >> np.uint64(32)
    return np.asarray(h)


def key_groups_for(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                   max_parallelism: int) -> np.ndarray:
    """:func:`~dstl.keygroups.key_group_for` of many keys at once: the keys ``data[starts[i]:starts[i] +
    lengths[i]]`` of a ``uint8`` array, hashed with numpy one key length at a time (keys of one
    length are one matrix); equal to ``key_group_for`` of each (tested)."""
    check_int(max_parallelism, "max_parallelism", "key_groups_for", lo=1,
              hi=MAX_PARALLELISM_LIMIT)
    out = np.empty(len(starts), dtype=np.int64)
    one = len(lengths) and int(lengths.min()) == int(lengths.max())   # keys of one length
    for size in [int(lengths[0])] if one else np.unique(lengths).tolist():
        at = np.arange(len(lengths)) if one else np.flatnonzero(lengths == size)
        if size:   # the keys of this length gathered as one item each: an (n, size) matrix
            items = np.ndarray((len(data) - size + 1,), dtype=np.dtype((np.void, size)),
                               buffer=data, strides=(1,))
            rows = items[starts[at]].view(np.uint8).reshape(len(at), size)
        else:
            rows = np.zeros((len(at), 0), dtype=np.uint8)
        signed = _xxh64_rows(rows, SEED).view(np.int64)
        out[at] = signed % max_parallelism   # numpy's % is Spark's pmod for a positive divisor
    return out
