"""An LMDB data file's entries located by parsing its pages with numpy (no cursor, no Python
object per entry): for column-wise readers of a staged v2 snapshot.

Theory of operation
-------------------
A v2 snapshot is an LMDB data file (LMDB 0.9's on-disk format, ``MDB_DATA_VERSION`` 1, the
little-endian 64-bit layout py-lmdb writes on this platform). Listing it with cursors costs a
Python ``bytes`` per key and per value, about 0.3 µs per entry. This module reads the file's
bytes instead:

- **Meta.** Pages 0 and 1 are meta pages; the one with the larger transaction id is current
  (LMDB's own rule). It gives the page size, the main database's flags, root page and entry
  count.
- **Tree.** From the root, the tree is walked a level at a time with numpy, children in key
  order (a branch node's child page number is its 48-bit ``lo | hi | flags`` field); the last
  level is the leaf pages in key order. LMDB's B+tree is balanced: a level that mixes branch and
  leaf pages is a layout this module does not read. A page is visited at most once and must be
  in the file.
- **Leaves.** Every leaf page's node pointers (``u16`` after the 16-byte page header, read
  from the bytes seen as aligned ``u16``) and node headers (``u16 lo, hi, flags, key size``: 8
  bytes, read as one little-endian ``u64``) are gathered for all leaves at once with numpy, each
  header with the 8 bytes after it (one 16-byte item: the key's first bytes come with the same
  cache miss). A node's key follows its header; its value follows the key, or, with
  ``F_BIGDATA``, lies on the overflow pages its 8-byte page number names. The result is four
  arrays — key start, key size, value start, value size (offsets in the file's bytes) — and each
  key's first 8 bytes as a big-endian word.

Checks: magic, version, page size, the main database's flags (a plain key/value database: no
duplicates, no integer keys), page kinds, every pointer, node and value inside its page or the
file, and the number of entries found equal to the count the meta page records. Anything this
module does not read — another version or byte order, sub-databases, duplicate data, an entry
count that disagrees — makes :func:`entry_spans` return ``None``: the caller then lists the file
with LMDB's cursors (:func:`materializer.lmdb_files.iter_raw_chunks`), which is the authority on
what an LMDB file holds. The file itself was verified before (the zstd content checksum of the
snapshot object), so ``None`` means "another layout", not damage that would go unnoticed.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Final

import numpy as np

__all__ = ["EntrySpans", "entry_spans", "entry_spans_in"]

_MAGIC: Final = 0xBEEFC0DE
_VERSION: Final = 1
_HEADER: Final = 16            # page header: pgno u64, pad u16, flags u16, lower u16, upper u16
#: MDB_meta after a meta page's header: magic, version, address, map size, two MDB_db (pad,
#: flags, depth, branch/leaf/overflow page counts, entries, root), last page, txn id.
_META: Final = struct.Struct("<IIQQ" + "IHHQQQQQ" * 2 + "QQ")
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META, _P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
_KINDS: Final = _P_BRANCH | _P_LEAF | _P_OVERFLOW | _P_META | _P_LEAF2
_F_BIGDATA: Final = 0x01
_NO_ROOT: Final = (1 << 64) - 1
#: the k high bytes of a u64 set (k = 0..8)
_HIGH_BYTES: Final = np.array([((1 << (8 * k)) - 1) << (64 - 8 * k) for k in range(9)],
                              dtype=np.uint64)


@dataclass(frozen=True)
class EntrySpans:
    """Where an LMDB file's entries are, in key order (int64 offsets into ``data``), and each
    key's first 8 bytes as a big-endian ``u64`` (``key_head``: read with the node headers, in
    the same pass over the file; only the key's own bytes count where it is shorter)."""

    data: np.ndarray
    key_start: np.ndarray
    key_size: np.ndarray
    value_start: np.ndarray
    value_size: np.ndarray
    key_head: np.ndarray

    def __len__(self) -> int:
        return len(self.key_start)


class _Unread(Exception):
    """A file this module does not read (the caller uses cursors)."""


def _view(data: np.ndarray, dtype: str, width: int) -> np.ndarray:
    """``view[i]`` = the little-endian integer of ``width`` bytes starting at byte ``i``."""
    return np.ndarray((max(len(data) - width + 1, 0),), dtype=dtype, buffer=data, strides=(1,))


def _meta(data: np.ndarray) -> tuple[int, int, int, int]:
    """(page size, main database flags, root page, entry count) of the current meta page."""
    if len(data) < _HEADER + _META.size:
        raise _Unread
    head = _META.unpack_from(data.data, _HEADER)
    psize = head[4]  # the free database's pad field holds the page size
    if psize < 512 or psize > 1 << 16 or psize & (psize - 1) or len(data) < 2 * psize:
        raise _Unread
    best = None
    for page in (0, 1):
        f = _META.unpack_from(data.data, page * psize + _HEADER)
        flags = int(data[page * psize + 10]) | int(data[page * psize + 11]) << 8
        if f[0] != _MAGIC or f[1] != _VERSION or f[4] != psize or not flags & _P_META:
            raise _Unread
        if best is None or f[21] > best[21]:
            best = f
    assert best is not None
    return psize, best[13], best[19], best[18]


def _leaf_pages(data: np.ndarray, u16: np.ndarray, u64: np.ndarray, psize: int, root: int
                ) -> np.ndarray:
    """The leaf pages under ``root``, in key order: the tree walked a level at a time (every
    level's pages checked and their children gathered with numpy; LMDB's tree is balanced, so
    a level holds branch pages only or leaf pages only)."""
    pages = len(data) // psize
    seen = np.zeros(pages, dtype=bool)
    level = np.array([root], dtype=np.int64)
    while True:
        if ((level < 2) | (level >= pages)).any() or seen[level].any():
            raise _Unread
        if len(np.unique(level)) != len(level):  # a page twice on one level
            raise _Unread
        seen[level] = True
        base = level * psize
        kind = u16[base + 10] & _KINDS
        if (kind == _P_LEAF).all():
            return level
        lower = u16[base + 12].astype(np.int64)
        if ((kind != _P_BRANCH) | (lower <= _HEADER) | (lower > psize) | (lower % 2)).any():
            raise _Unread
        node, _ = _nodes(data, base, lower, psize)
        level = (u64[node] & 0xFFFFFFFFFFFF).astype(np.int64)


def _nodes(data: np.ndarray, base: np.ndarray, lower: np.ndarray, psize: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """(node offset, node offset within its page) of every node of the pages at ``base``
    (whose pointer arrays end at ``lower``), in page order then pointer order; every node's
    8-byte header inside its page, after the pointers."""
    counts = (lower - _HEADER) // 2
    first = np.zeros(len(base) + 1, dtype=np.int64)
    np.cumsum(counts, out=first[1:])
    # a page's pointers are u16s from its header on: pointer i of the run is at
    # base + header + 2 * (i - first), one repeat and one arange for all pages
    ptr = np.repeat(base + _HEADER - 2 * first[:-1], counts)
    ptr += np.arange(0, 2 * int(first[-1]), 2, dtype=np.int64)
    # pointers sit at even offsets (pages and their header do): gathered from the bytes seen as
    # aligned u16s, half the cost of the byte-strided view's gather
    off = data[:len(data) // 2 * 2].view("<u2")[ptr >> 1].astype(np.int64)
    if (off > psize - 8).any():
        raise _Unread
    nonempty = counts > 0  # each page's lowest node lies above its pointers
    if nonempty.any() and (np.minimum.reduceat(off, first[:-1][nonempty])
                           < lower[nonempty]).any():
        raise _Unread
    return np.repeat(base, counts) + off, off


def _leaf_nodes(data: np.ndarray, u16: np.ndarray, psize: int, leaves: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(node offset, node header word, the 8 bytes after the header as a big-endian word, node
    offset within its page) of every node of ``leaves``: header and key head gathered as one
    16-byte item per node (one cache miss each, where two gathers take two; a node at the very
    end of the file gets zero bytes past it, which the caller masks off with a short key's)."""
    base = leaves * psize
    lower = u16[base + 12].astype(np.int64)
    if (lower < _HEADER).any() or (lower > psize).any() or (lower % 2).any():
        raise _Unread
    node, off = _nodes(data, base, lower, psize)
    items = np.ndarray((max(len(data) - 15, 0),), dtype=np.dtype((np.void, 16)), buffer=data,
                       strides=(1,))
    end = node + 16 > len(data)
    raw = items[np.where(end, 0, node)].view(np.uint8).reshape(-1, 16)
    for i in np.flatnonzero(end).tolist():  # the file's last bytes, padded
        at = int(node[i])
        raw[i] = np.frombuffer(bytes(data[at:at + 16]).ljust(16, b"\0"), dtype=np.uint8)
    flat = raw.reshape(-1)
    head = np.ndarray((len(node),), dtype="<u8", buffer=flat, strides=(16,))
    key_head = np.ndarray((len(node),), dtype=">u8", buffer=flat, offset=8, strides=(16,))
    return node, head, key_head, off


def _spans(data: np.ndarray, psize: int, leaves: np.ndarray) -> EntrySpans:
    u16, u64 = _view(data, "<u2", 2), _view(data, "<u8", 8)
    if not len(leaves):
        empty = np.zeros(0, dtype=np.int64)
        return EntrySpans(data, empty, empty, empty, empty, empty.astype(">u8"))
    node, head, key_head, off = _leaf_nodes(data, u16, psize, leaves)
    size = (head & 0xFFFFFFFF).astype(np.int64)
    flags = ((head >> np.uint64(32)) & np.uint64(0xFFFF)).astype(np.int64)
    ksize = (head >> np.uint64(48)).astype(np.int64)
    if (flags & ~_F_BIGDATA).any():
        raise _Unread
    big = (flags & _F_BIGDATA) != 0
    # the value (or, on overflow pages, its 8-byte page number) ends inside the node's page
    if (off + 8 + ksize + np.where(big, 8, size) > psize).any():
        raise _Unread
    kstart = node + 8
    vstart = kstart + ksize
    if big.any():
        pages = u64[vstart[big]].astype(np.int64)
        first = pages * psize
        if ((pages < 2) | (first + psize > len(data))).any():
            raise _Unread
        if ((u16[first + 10] & _KINDS) != _P_OVERFLOW).any():
            raise _Unread
        count = u16[first + 12].astype(np.int64) | u16[first + 14].astype(np.int64) << 16
        if ((first + _HEADER + size[big] > first + count * psize)
                | (first + count * psize > len(data))).any():
            raise _Unread
        vstart[big] = first + _HEADER
    short = ksize < 8
    if short.any():  # keep only a short key's own bytes (its first, the word's high ones)
        key_head = key_head.astype(np.uint64)
        key_head[short] &= _HIGH_BYTES[ksize[short]]
        key_head = key_head.astype(">u8")
    return EntrySpans(data, kstart, ksize, vstart, size, key_head)


def entry_spans(path: str) -> EntrySpans | None:
    """The entries of the LMDB data file ``path`` (mapped read-only, so a file larger than
    memory is paged, as LMDB's own map would be), or ``None`` if it is not a file this module
    reads (see the module docstring)."""
    if os.path.getsize(path) < 2 * 512:
        return None  # not even two meta pages (an empty file cannot be mapped)
    return entry_spans_in(np.memmap(path, dtype=np.uint8, mode="r"))


def entry_spans_in(data: np.ndarray) -> EntrySpans | None:
    """:func:`entry_spans` of an LMDB data file's bytes (``uint8``, e.g. decompressed into
    memory); the spans index ``data``, which they keep."""
    try:
        psize, flags, root, entries = _meta(data)
        if flags:
            raise _Unread
        if root == _NO_ROOT:
            leaves = np.zeros(0, dtype=np.int64)
        else:
            leaves = _leaf_pages(data, _view(data, "<u2", 2), _view(data, "<u8", 8), psize,
                                 root)
        spans = _spans(data, psize, leaves)
    except _Unread:
        return None
    return spans if len(spans) == entries else None
