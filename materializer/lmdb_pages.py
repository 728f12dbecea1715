"""An LMDB data file validated completely and its entries located by parsing its pages with numpy
(no cursor, no Python object per entry).

Theory of operation
-------------------
A v2 snapshot holds an LMDB data file (LMDB 0.9's on-disk format, ``MDB_DATA_VERSION`` 1, the
little-endian 64-bit layout py-lmdb writes on this platform), made by LMDB's compacting copy.
The file comes from a store, so it is untrusted input; LMDB itself does not validate what it maps
(a page number past the end of the file is a SIGBUS, a cycle an assertion's SIGABRT, a key out
of order a lookup that misses). :func:`parse_data_file` therefore accepts exactly the files a
compacting copy writes and refuses everything else with :class:`LmdbFileError`, naming the page
and byte — so a file it accepts is one that LMDB reads and writes safely, and whose entries are
the ones it returns:

- **Meta.** Pages 0 and 1 are meta pages (page number, kind, magic, version, page size); the one
  with the larger transaction id is current (LMDB's rule, ties to page 0). It must describe a
  plain key/value database (no flags: no duplicates, integer or reversed keys), an empty free
  list, a last page that is the file's last page (the file is whole pages, at least three), a
  root inside the file, and counts (depth, branch, leaf and overflow pages, entries) that the
  walk below must find exactly.
- **Tree.** From the root, a level at a time, children in key order: each page is visited once
  (no cycles, no sharing), carries its own page number, and is a branch page on every level but
  the last, a leaf page on the last (LMDB's tree is balanced). A page's node pointers lie
  between its header and ``upper``; its nodes, at even offsets, tile ``[upper, page size)``
  exactly (LMDB keeps them packed, and its page edits move bytes by that rule); a branch page
  has at least two nodes, the first with an empty key; a leaf page at least one.
- **Leaves.** A node is a key (1 to 511 bytes) and its value inline (a node of at most
  ``nodemax`` bytes, LMDB's rule), or the value's first page number: that overflow run is inside
  the file, starts with an overflow page of its own number, has room for the value (at least
  ``OVPAGES(size)`` pages: LMDB rewrites a smaller value into the pages it has) and shares no
  page with anything else.
- **Order.** Keys are strictly increasing across all leaves, and every branch key ``k`` lies
  between the subtrees it separates (``last key on the left < k <= first key on the right``),
  so a lookup through the tree finds exactly what a scan lists. Keys are compared 8 bytes at a
  time as big-endian words, only the pairs still tied going on to the next word.
- **Coverage.** Every page of the file is a meta page, a tree page or part of one overflow run.

Everything is gathered with numpy for all pages of a level at once (node pointers from the bytes
seen as aligned ``u16``, each node header read with the key's first 24 bytes as one 32-byte
item: the words the key order compares first come with the same cache miss). The result, :class:`EntrySpans`, is four arrays — key start, key size, value start, value
size (offsets in the file's bytes) — and each key's first 8 bytes as a big-endian word.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Final, NamedTuple

import numpy as np

__all__ = ["MAX_KEY_SIZE", "EntrySpans", "LmdbFileError", "entry_spans", "parse_data_file"]

_MAGIC: Final = 0xBEEFC0DE
_VERSION: Final = 1
_HEADER: Final = 16            # page header: pgno u64, pad u16, flags u16, lower u16, upper u16
#: MDB_meta after a meta page's header: magic, version, address, map size, two MDB_db (pad,
#: flags, depth, branch/leaf/overflow page counts, entries, root), last page, txn id.
_META: Final = struct.Struct("<IIQQ" + "IHHQQQQQ" * 2 + "QQ")
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META = 0x01, 0x02, 0x04, 0x08
_F_BIGDATA: Final = 0x01
_INTEGERKEY: Final = 0x08      # the free database's flags (LMDB sets it; env flags may join)
_NOSUBDIR: Final = 0x4000
_NO_ROOT: Final = (1 << 64) - 1
#: LMDB's compiled-in key size limit (``MDB_MAXKEYSIZE``).
MAX_KEY_SIZE: Final = 511
_MAX_DEPTH: Final = 32
_MAX_TXNID: Final = 1 << 48
_WORDS: Final = 3              # a key's first words gathered with its node's header
_ITEM: Final = 8 + 8 * _WORDS
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


class LmdbFileError(ValueError):
    """The bytes are not an LMDB data file as LMDB's compacting copy writes it.

    Attributes:
        reason: what is wrong, naming the page.
        offset: the byte of the data file where it was found.
    """

    def __init__(self, reason: str, offset: int) -> None:
        self.reason = reason
        self.offset = int(offset)
        super().__init__(f"{reason} (data file byte {self.offset})")


class _Meta(NamedTuple):
    psize: int
    pages: int
    depth: int
    branch: int
    leaf: int
    overflow: int
    entries: int
    root: int


def _view(data: np.ndarray, dtype: str, width: int) -> np.ndarray:
    """``view[i]`` = the integer of ``width`` bytes starting at byte ``i``."""
    return np.ndarray((max(len(data) - width + 1, 0),), dtype=dtype, buffer=data, strides=(1,))


def _bad(what: str, page: int, psize: int, at: int = 0) -> LmdbFileError:
    return LmdbFileError(f"page {page}: {what}", page * psize + at)


def _first_bad(mask: np.ndarray, pages: np.ndarray, psize: int, what: str) -> None:
    """Raise naming the first page of ``pages`` where ``mask`` holds."""
    if mask.any():
        raise _bad(what, int(pages[int(np.argmax(mask))]), psize)


def _meta(data: np.ndarray) -> _Meta:
    """The current meta page, checked (module docstring)."""
    if len(data) < _HEADER + _META.size:
        raise LmdbFileError(f"{len(data)} bytes: shorter than a meta page", 0)
    psize = _META.unpack_from(data.data, _HEADER)[4]  # the free database's pad is the page size
    if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
        raise LmdbFileError(f"page size {psize} is not a power of two in [512, 65536]", _HEADER)
    if len(data) % psize or len(data) < 3 * psize:
        raise LmdbFileError(f"{len(data)} bytes: not a whole number (>= 3) of {psize}-byte "
                            "pages (a truncated file?)", len(data) - len(data) % psize)
    metas = []
    for page in (0, 1):
        base = page * psize
        pgno, flags = struct.unpack_from("<Q2xH", data.data, base)
        m = _META.unpack_from(data.data, base + _HEADER)
        if pgno != page or flags != _P_META or m[0] != _MAGIC or m[1] != _VERSION \
                or m[4] != psize or m[2] != 0 or m[21] >= _MAX_TXNID:
            raise _bad("not an LMDB meta page of this version, page size and address",
                       page, psize)
        metas.append(m)
    m = metas[1] if metas[1][21] > metas[0][21] else metas[0]
    current = 1 if m is metas[1] else 0
    pages = len(data) // psize
    if m[5] & ~_NOSUBDIR != _INTEGERKEY or m[6:12] != (0, 0, 0, 0, 0, _NO_ROOT):
        raise _bad("the free list is not empty (not a compacting copy)", current, psize)
    if m[13] or m[12]:
        raise _bad(f"main database flags {m[13]:#x} (a plain key/value database has none)",
                   current, psize)
    if m[20] != pages - 1:
        raise _bad(f"last page {m[20]}, but the file has {pages} pages", current, psize)
    depth, branch, leaf, overflow, entries, root = m[14:20]
    if not 2 <= root < pages or not 1 <= depth <= _MAX_DEPTH or entries < 1:
        raise _bad(f"root page {root}, depth {depth}, {entries} entries: no tree in the file",
                   current, psize)
    return _Meta(psize, pages, depth, branch, leaf, overflow, entries, root)


class _Level(NamedTuple):
    """One level of the tree: its pages and their nodes (page order, then pointer order)."""

    pages: np.ndarray
    upper: np.ndarray       # each page's upper
    first: np.ndarray       # each page's first node index; one more entry than pages
    node: np.ndarray        # node offsets in the file
    head: np.ndarray        # node header words (u64 little-endian)
    key_head: np.ndarray    # the 8 bytes after each header, big-endian
    key_words: np.ndarray   # the (n, _WORDS) big-endian words from there on


def _level(data: np.ndarray, pages: np.ndarray, psize: int, *, leaf: bool) -> _Level:
    """The nodes of ``pages``, their pointer arrays checked: each page's pointers end at
    ``lower`` before its nodes begin at ``upper``, and every pointer is even and in
    ``[upper, page size - 8]``; a branch page has at least two nodes, a leaf page one."""
    base = pages * psize
    u16 = _u16(data)
    lower = u16[(base + 12) >> 1].astype(np.int64)
    upper = u16[(base + 14) >> 1].astype(np.int64)
    kind = "leaf" if leaf else "branch"
    _first_bad((lower < _HEADER + (2 if leaf else 4)) | (lower % 2 != 0) | (upper < lower)
               | (upper > psize) | (upper % 2 != 0), pages, psize,
               f"its pointer array (lower) and nodes (upper) are out of order, odd or too few "
               f"for a {kind} page")
    counts = (lower - _HEADER) // 2
    first = np.zeros(len(base) + 1, dtype=np.int64)
    np.cumsum(counts, out=first[1:])
    # pointer i of the run is at base + header + 2 * (i - first): one repeat, one arange
    ptr = np.repeat(base + _HEADER - 2 * first[:-1], counts)
    ptr += np.arange(0, 2 * int(first[-1]), 2, dtype=np.int64)
    off = u16[ptr >> 1].astype(np.int64)
    bad = (off < np.repeat(upper, counts)) | (off > psize - 8) | (off % 2 != 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise LmdbFileError(f"page {int(ptr[i]) // psize}: node pointer {int(off[i])} is odd or "
                            "outside [upper, page size - 8]", int(ptr[i]))
    node = np.repeat(base, counts) + off
    # each header with the key's first words as one item (one cache miss, not one per word); a
    # node near the very end of the file gets zeros past it
    items = np.ndarray((len(data) - _ITEM + 1,), dtype=np.dtype((np.void, _ITEM)), buffer=data,
                       strides=(1,))
    end = node + _ITEM > len(data)
    raw = items[np.where(end, 0, node)].view(np.uint8).reshape(-1, _ITEM)
    for i in np.flatnonzero(end).tolist():
        at = int(node[i])
        raw[i] = np.frombuffer(bytes(data[at:at + _ITEM]).ljust(_ITEM, b"\0"), dtype=np.uint8)
    flat = raw.reshape(-1)
    head = np.ndarray((len(node),), dtype="<u8", buffer=flat, strides=(_ITEM,))
    key_words = np.ndarray((len(node), _WORDS), dtype=">u8", buffer=flat, offset=8,
                           strides=(_ITEM, 8))
    key_head = key_words[:, 0]
    return _Level(pages, upper, first, node, head, key_head, key_words)


def _check_tiled(lvl: _Level, size: np.ndarray, psize: int) -> None:
    """The nodes of each page (``size`` bytes each, even) tile ``[upper, page size)`` exactly:
    their sizes add up to the space, and none overlaps the next one up."""
    total = np.add.reduceat(size, lvl.first[:-1])
    _first_bad(total != psize - lvl.upper, lvl.pages, psize,
               "its nodes do not fill the space from upper to the page's end exactly")
    # sorted by offset with each node's size in the low 16 bits (np.sort, not argsort: sizes
    # are < 2**16 and offsets < 2**47, and a plain sort is several times cheaper)
    packed = np.sort((lvl.node << 16) | size)
    start = packed >> 16
    end = start + (packed & 0xFFFF)
    page = start // psize
    over = end > (page + 1) * psize
    over[:-1] |= (page[1:] == page[:-1]) & (end[:-1] > start[1:])
    if over.any():
        i = int(np.argmax(over))
        raise LmdbFileError(f"page {int(page[i])}: the node at {int(start[i] % psize)} "
                            f"({int(end[i] - start[i])} bytes) overlaps the next one or the "
                            "page's end", int(start[i]))


def _claim(pages: np.ndarray, seen: np.ndarray, psize: int, what: str) -> None:
    """Mark ``pages`` seen, refusing one seen before or listed twice (``what`` names it by
    ``{}``)."""
    again = seen[pages]
    if not again.any() and len(np.unique(pages)) != len(pages):
        values, counts = np.unique(pages, return_counts=True)
        again = pages == values[int(np.argmax(counts > 1))]
    if again.any():
        p = int(pages[int(np.argmax(again))])
        raise LmdbFileError(what.format(p), p * psize)
    seen[pages] = True


def _u16(data: np.ndarray) -> np.ndarray:
    """The file's bytes as aligned little-endian ``u16`` (pages and their headers are even)."""
    return data[:len(data) // 2 * 2].view("<u2")


def _mark(level: np.ndarray, seen: np.ndarray, psize: int, u64: np.ndarray, what: str) -> None:
    """Mark pages seen: each inside the file, reached once, carrying its own page number."""
    outside = (level < 2) | (level >= len(seen))
    if outside.any():
        raise LmdbFileError(f"{what} names page {int(level[int(np.argmax(outside))])}, a meta "
                            f"page or past the file's {len(seen)} pages", 0)
    _claim(level, seen, psize, f"{what}: page {{}} is reached twice (a cycle or a shared page)")
    _first_bad(u64[level * psize].astype(np.int64) != level, level, psize,
               "its header names another page number")


def _words(data: np.ndarray, at: np.ndarray, left: np.ndarray) -> np.ndarray:
    """The big-endian word of the (up to) 8 bytes at each ``at`` that belong to a key with
    ``left`` bytes from there on: bytes past the key (all, where ``left <= 0``) are zero."""
    last = len(data) - 8
    view = _view(data, "<u8", 8)
    if len(at) and int(at.max()) > last:  # a key at the very end of the file
        clipped = np.minimum(at, last)
        words = view[clipped].byteswap()
        words <<= ((at - clipped) * 8).astype(np.uint64)
    else:
        words = view[at].byteswap()   # gathered native, swapped in place
    short = left < 8
    if short.any():
        words[short] &= _HIGH_BYTES[np.maximum(left[short], 0)]
    return np.asarray(words)


def _compare(data: np.ndarray, a: np.ndarray, a_len: np.ndarray, b: np.ndarray,
             b_len: np.ndarray) -> np.ndarray:
    """-1, 0 or 1 as the bytes ``data[a:a + a_len]`` sort before, equal or after
    ``data[b:b + b_len]`` (bytewise, a prefix first), pair by pair: 8 bytes at a time as
    big-endian words, only the pairs still tied reading on."""
    out = np.zeros(len(a), dtype=np.int8)
    todo = np.arange(len(a))
    j = 0
    while len(todo):
        ra, rb = a_len[todo] - j, b_len[todo] - j
        wa, wb = _words(data, a[todo] + j, ra), _words(data, b[todo] + j, rb)
        differ = wa != wb
        if differ.any():
            out[todo[differ]] = np.where(wa[differ] < wb[differ], -1, 1)
        tied = ~differ
        ended = tied & ((ra <= 8) | (rb <= 8))
        if ended.any():
            out[todo[ended]] = np.sign(ra[ended] - rb[ended])
            tied &= ~ended
        todo = todo[tied]
        j += 8
    return out


def _overflow(data: np.ndarray, u64: np.ndarray, seen: np.ndarray, psize: int,
              vstart: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, int]:
    """The values stored on overflow pages (``vstart`` = where their page numbers are): each
    run inside the file, of at least ``OVPAGES(size)`` pages, starting with an overflow page of
    its own number, sharing no page; returns where the values start and the pages they take."""
    pages = u64[vstart].astype(np.int64)
    outside = (pages < 2) | (pages >= len(seen))
    if outside.any():
        i = int(np.argmax(outside))
        raise LmdbFileError(f"a value of {int(size[i])} bytes on overflow page {int(pages[i])}, "
                            f"a meta page or past the file's {len(seen)} pages", int(vstart[i]))
    base = pages * psize
    u16 = _u16(data)
    flags = u16[(base + 10) >> 1]
    count = u16[(base + 12) >> 1].astype(np.int64) | u16[(base + 14) >> 1].astype(np.int64) << 16
    # LMDB rewrites a smaller value into the pages it has, so a run may be longer than needed
    _first_bad((u64[base].astype(np.int64) != pages) | (flags != _P_OVERFLOW)
               | (count < (_HEADER - 1 + size) // psize + 1) | (pages + count > len(seen)),
               pages, psize, "not an overflow page of its own number whose run holds the value "
                             "inside the file")
    if int(count.sum()) > len(seen):  # runs that overlap: refused before listing their pages
        raise LmdbFileError(f"overflow runs of {int(count.sum())} pages in a file of "
                            f"{len(seen)}", 0)
    starts = np.zeros(len(count), dtype=np.int64)
    np.cumsum(count[:-1], out=starts[1:])
    every = np.repeat(pages - starts, count) + np.arange(int(count.sum()), dtype=np.int64)
    _claim(every, seen, psize, "overflow page {} is reached twice (a shared page)")
    return base + _HEADER, len(every)


def _leaves(data: np.ndarray, lvl: _Level, seen: np.ndarray, psize: int, u64: np.ndarray
            ) -> tuple[EntrySpans, int]:
    """The leaf level's entries (nodes checked as the module docstring says) and the overflow
    pages their values take."""
    head = lvl.head
    size = (head & np.uint64(0xFFFFFFFF)).astype(np.int64)
    flags = ((head >> np.uint64(32)) & np.uint64(0xFFFF)).astype(np.int64)
    ksize = (head >> np.uint64(48)).astype(np.int64)
    big = flags == _F_BIGDATA
    nodemax = ((psize - _HEADER) // 2 & ~1) - 2
    bad = ((flags & ~_F_BIGDATA) != 0) | (ksize < 1) | (ksize > MAX_KEY_SIZE) \
        | (~big & (8 + ksize + size > nodemax))
    if bad.any():
        i = int(np.argmax(bad))
        raise LmdbFileError(f"page {int(lvl.node[i]) // psize}: a leaf node of flags "
                            f"{int(flags[i]):#x}, a {int(ksize[i])}-byte key and a "
                            f"{int(size[i])}-byte value {'on' if big[i] else 'not on'} overflow "
                            "pages is not one LMDB writes", int(lvl.node[i]))
    _check_tiled(lvl, (8 + ksize + np.where(big, 8, size) + 1) & ~1, psize)
    kstart = lvl.node + 8
    vstart = kstart + ksize
    overflow = 0
    if big.any():
        vstart[big], overflow = _overflow(data, u64, seen, psize, vstart[big], size[big])
    key_head = np.ascontiguousarray(lvl.key_head)  # the spans keep it, not the gathered items
    short = ksize < 8
    if short.any():  # keep only a short key's own bytes (its first, the word's high ones)
        key_head = key_head.astype(np.uint64)
        key_head[short] &= _HIGH_BYTES[ksize[short]]
        key_head = key_head.astype(">u8")
    return EntrySpans(data, kstart, ksize, vstart, size, key_head), overflow


def _first_unordered(data: np.ndarray, ks: np.ndarray, kn: np.ndarray, words: np.ndarray
                     ) -> int:
    """The first ``i`` whose key ``i + 1`` is not greater than key ``i`` (-1: none), keys
    ``data[ks:ks + kn]``: :func:`_compare` of neighbours, word by word (big-endian), the first
    :data:`_WORDS` from ``words`` (gathered with the node headers), each later one read once
    per key while most pairs are still tied (one gather, not two per pair)."""
    tied = np.arange(len(ks) - 1)
    first = len(ks)
    j = 0
    while len(tied):
        left = kn - j
        if j // 8 < _WORDS:
            w = _masked(words[:, j // 8], left)
            wa, wb = w[tied], w[tied + 1]
        elif 2 * len(tied) > len(ks):
            w = _words(data, ks + j, left)
            wa, wb = w[tied], w[tied + 1]
        else:
            wa = _words(data, ks[tied] + j, left[tied])
            wb = _words(data, ks[tied + 1] + j, left[tied + 1])
        ra, rb = left[tied], left[tied + 1]
        # decided against: a greater word, or equal words where the first key ends no sooner
        bad = (wa > wb) | ((wa == wb) & ((ra <= 8) | (rb <= 8)) & (ra >= rb))
        if bad.any():
            first = min(first, int(tied[int(np.argmax(bad))]))
        tied = tied[(wa == wb) & (ra > 8) & (rb > 8)]
        j += 8
    return first if first < len(ks) else -1


def _masked(words: np.ndarray, left: np.ndarray) -> np.ndarray:
    """Big-endian ``words`` as ``u64`` with only the first ``left`` (clipped to 0..8) bytes."""
    return np.asarray(words.astype(np.uint64) & _HIGH_BYTES[np.clip(left, 0, 8)])


def _check_order(data: np.ndarray, spans: EntrySpans, leaf_words: np.ndarray,
                 branches: list[tuple[_Level, np.ndarray]], leaf_first: np.ndarray,
                 psize: int) -> None:
    """Keys strictly increasing across the leaves, and every branch key between the subtrees
    it separates (``last key on its left < key <= first key on its right``).

    ``branches`` are the branch levels from the root down with their nodes' key sizes;
    ``leaf_first`` is each leaf page's first entry index."""
    ks, kn = spans.key_start, spans.key_size
    if len(ks) > 1:
        i = _first_unordered(data, ks, kn, leaf_words)
        if i >= 0:
            raise LmdbFileError(f"page {int(ks[i + 1]) // psize}: a leaf key is not greater than "
                                "the key before it (keys out of order or twice)", int(ks[i + 1]))
    below = leaf_first[:-1]   # the first entry under each page of the level below
    for lvl, ksize in reversed(branches):
        inner = np.ones(len(lvl.node), dtype=bool)
        inner[lvl.first[:-1]] = False   # a page's first node has no key
        sep, sep_n, at = lvl.node[inner] + 8, ksize[inner], below[inner]
        left = _compare(data, ks[at - 1], kn[at - 1], sep, sep_n)
        right = _compare(data, sep, sep_n, ks[at], kn[at])
        bad = (left >= 0) | (right > 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise LmdbFileError(f"page {int(sep[i]) // psize}: a branch key does not separate "
                                "its subtrees (lookups would miss keys)", int(sep[i]))
        below = below[lvl.first[:-1]]


def parse_data_file(data: np.ndarray) -> EntrySpans:
    """The entries of an LMDB data file's bytes (``uint8``: mapped or in memory; the spans
    index ``data``, which they keep), every page validated (module docstring).

    Raises:
        LmdbFileError: the bytes are not a file LMDB's compacting copy writes; names the page
            and the byte.
    """
    meta = _meta(data)
    psize = meta.psize
    u64 = _view(data, "<u8", 8)
    u16 = _u16(data)
    seen = np.zeros(meta.pages, dtype=bool)
    seen[:2] = True
    level = np.array([meta.root], dtype=np.int64)
    branches: list[tuple[_Level, np.ndarray]] = []
    for depth in range(1, meta.depth + 1):
        leaf = depth == meta.depth
        _mark(level, seen, psize, u64, f"level {depth} of the tree")
        _first_bad(u16[(level * psize + 10) >> 1] != (_P_LEAF if leaf else _P_BRANCH), level,
                   psize, f"not a {'leaf' if leaf else 'branch'} page, at depth {depth} of "
                          f"{meta.depth}")
        lvl = _level(data, level, psize, leaf=leaf)
        if leaf:
            break
        ksize = (lvl.head >> np.uint64(48)).astype(np.int64)
        inner = np.ones(len(lvl.node), dtype=bool)
        inner[lvl.first[:-1]] = False
        bad = np.where(inner, (ksize < 1) | (ksize > MAX_KEY_SIZE), ksize != 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise LmdbFileError(f"page {int(lvl.node[i]) // psize}: a branch node of a "
                                f"{int(ksize[i])}-byte key (a page's first node has none, the "
                                f"others 1 to {MAX_KEY_SIZE} bytes)", int(lvl.node[i]))
        _check_tiled(lvl, (8 + ksize + 1) & ~1, psize)
        branches.append((lvl, ksize))
        level = (lvl.head & np.uint64(0xFFFFFFFFFFFF)).astype(np.int64)
    spans, overflow = _leaves(data, lvl, seen, psize, u64)
    found = (sum(len(b.pages) for b, _ in branches), len(lvl.pages), overflow, len(spans))
    if found != (meta.branch, meta.leaf, meta.overflow, meta.entries):
        raise LmdbFileError(f"the tree holds {found[0]} branch, {found[1]} leaf and {found[2]} "
                            f"overflow pages and {found[3]} entries; the meta page says "
                            f"{meta.branch}, {meta.leaf}, {meta.overflow} and {meta.entries}", 0)
    if not seen.all():
        p = int(np.argmin(seen))
        raise LmdbFileError(f"page {p} belongs to no tree page or overflow value", p * psize)
    _check_order(data, spans, lvl.key_words, branches, lvl.first, psize)
    return spans


def entry_spans(path: str) -> EntrySpans:
    """:func:`parse_data_file` of the LMDB data file ``path`` (mapped read-only, so a file
    larger than memory is paged, as LMDB's own map would be)."""
    if os.path.getsize(path) < 3 * 512:
        raise LmdbFileError(f"{os.path.getsize(path)} bytes: shorter than three pages", 0)
    return parse_data_file(np.memmap(path, dtype=np.uint8, mode="r"))
