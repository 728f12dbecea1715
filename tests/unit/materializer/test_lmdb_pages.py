"""materializer.lmdb_pages: an LMDB file's entries located by parsing its pages equal what LMDB's
cursors list, for every shape of tree and value a compacting copy writes; every other file is an
LmdbFileError, never a wrong list."""

from __future__ import annotations

import os
import random
from pathlib import Path

import lmdb
import numpy as np
import pytest

from materializer.lmdb_pages import EntrySpans, LmdbFileError, entry_spans, parse_data_file


def _env(path: Path, items: list[tuple[bytes, bytes]], *, deletes: int = 0, compact: bool = True
         ) -> str:
    """An LMDB data file holding ``items`` (after ``deletes`` of them were put and deleted), as
    a compacting copy (what a v2 snapshot holds) or the live file itself."""
    live = path / "live"
    live.mkdir(parents=True)
    env = lmdb.open(str(live), map_size=1 << 30)
    with env.begin(write=True) as txn:
        for k, v in items:
            txn.put(k, v)
    with env.begin(write=True) as txn:
        for k, _ in items[:deletes]:
            txn.delete(k)
    if not compact:
        env.close()
        return str(live / "data.mdb")
    out = path / "copy"
    out.mkdir()
    env.copy(str(out), compact=True)
    env.close()
    return str(out / "data.mdb")


def _cursor(path: str) -> list[tuple[bytes, bytes]]:
    env = lmdb.open(os.path.dirname(path), readonly=True, lock=False, max_dbs=1)
    with env.begin() as txn:
        got = list(txn.cursor().iternext())
    env.close()
    return got


def _spans(path: str) -> EntrySpans | None:
    """:func:`entry_spans` of the file, checked equal to :func:`parse_data_file` of its bytes in
    memory (what the column-wise reader parses); None when both refuse it."""
    try:
        mapped = entry_spans(path)
    except LmdbFileError:
        mapped = None
    try:
        in_memory = parse_data_file(np.fromfile(path, dtype=np.uint8))
    except LmdbFileError:
        in_memory = None
    assert (mapped is None) == (in_memory is None)
    if mapped is not None and in_memory is not None:
        for field in ("key_start", "key_size", "value_start", "value_size", "key_head"):
            assert np.array_equal(getattr(mapped, field), getattr(in_memory, field)), field
    if mapped is not None:  # a key's first (up to) 8 bytes, big-endian, zeros after a short one
        raw = mapped.data.tobytes()
        assert mapped.key_head.tolist() == [
            int.from_bytes(raw[k:k + min(n, 8)].ljust(8, b"\0"), "big")
            for k, n in zip(mapped.key_start.tolist(), mapped.key_size.tolist(), strict=True)]
    return mapped


def _parsed(path: str) -> list[tuple[bytes, bytes]] | None:
    spans = _spans(path)
    if spans is None:
        return None
    raw = spans.data.tobytes()
    return [(raw[k:k + ks], raw[v:v + vs]) for k, ks, v, vs in zip(
        spans.key_start.tolist(), spans.key_size.tolist(), spans.value_start.tolist(),
        spans.value_size.tolist(), strict=True)]


def _items(rnd: random.Random, n: int, *, big: float = 0.0) -> list[tuple[bytes, bytes]]:
    keys = {bytes(rnd.getrandbits(8) for _ in range(rnd.choice([1, 4, 9, 17, 60, 511])))
            for _ in range(n)}
    return [(k, bytes(rnd.getrandbits(8) for _ in range(
        rnd.choice([0, 1, 5, 100]) if rnd.random() >= big else rnd.choice([2000, 5000, 70000]))))
        for k in sorted(keys)]


@pytest.mark.parametrize(("n", "big", "deletes"), [
    (1, 0.0, 0), (3, 0.0, 0), (5000, 0.0, 0), (3000, 0.05, 0), (40, 1.0, 0),
    (5000, 0.01, 2500), (4000, 0.02, 1500), (1, 1.0, 0)])
def test_spans_list_what_the_cursors_list(tmp_path: Path, n: int, big: float, deletes: int
                                          ) -> None:
    rnd = random.Random(n * 7 + deletes)
    items = _items(rnd, n, big=big)
    rnd.shuffle(items)
    path = _env(tmp_path, items, deletes=deletes)
    want = _cursor(path)
    assert len(want) == len(items) - min(deletes, len(items))
    assert _parsed(path) == want


@pytest.mark.parametrize("seed", range(4))
def test_copies_of_tables_that_lived_are_read_whole(tmp_path: Path, seed: int) -> None:
    # many transactions of puts, overwrites and deletes (pages split, merged, rebalanced,
    # values moved to and from overflow pages), then a compacting copy: the strict rules
    # (packed nodes, empty first branch keys, LMDB's overflow rule) hold for what LMDB wrote
    rnd = random.Random(seed)
    live = tmp_path / "live"
    live.mkdir()
    env = lmdb.open(str(live), map_size=1 << 30)
    keys: list[bytes] = []
    for _ in range(12):
        with env.begin(write=True) as txn:
            for _ in range(rnd.randrange(1, 3000)):
                if rnd.random() < 0.6 or not keys:
                    k = rnd.randbytes(rnd.choice([1, 8, 16, 40, 511]))
                    txn.put(k, rnd.randbytes(rnd.choice([0, 8, 300, 2030, 2040, 5000])))
                    keys.append(k)
                else:
                    txn.delete(keys.pop(rnd.randrange(len(keys))))
    out = tmp_path / "copy"
    out.mkdir()
    env.copy(str(out), compact=True)
    env.close()
    path = str(out / "data.mdb")
    assert _parsed(path) == _cursor(path)


@pytest.mark.parametrize(("n", "deletes"), [(0, 0), (300, 0), (2000, 1000)])
def test_files_other_than_a_compacting_copy_are_refused(tmp_path: Path, n: int, deletes: int
                                                        ) -> None:
    # a live environment after deletes holds a free list; an empty one has no tree
    items = _items(random.Random(n), n)
    path = _env(tmp_path, items, deletes=deletes, compact=n == 0)
    if n and not deletes:   # one transaction: a live file LMDB wrote whole may pass, if exact
        assert _parsed(path) in (None, _cursor(path))
    else:
        assert _parsed(path) is None


def test_the_reader_snapshot_layout_with_a_million_entries_scale(tmp_path: Path) -> None:
    # fixed-width keys as DSTL's table writes them (prefix, key, no namespace), small values:
    # a three-level tree
    items = [(b"\x00\x05\x00\x00\x00\x00\x00\x09" + b"k%08d" % i, b"\x80\x05K\x01.")
             for i in range(60000)]
    path = _env(tmp_path, items)
    assert _parsed(path) == _cursor(path)


def test_files_it_does_not_read_are_refused(tmp_path: Path) -> None:
    rnd = random.Random(3)
    items = _items(rnd, 300)
    # a database with sub-databases: the main database's entries are other databases
    sub = tmp_path / "sub"
    sub.mkdir()
    env = lmdb.open(str(sub), max_dbs=2, map_size=1 << 24)
    db = env.open_db(b"inner", dupsort=True)
    with env.begin(write=True, db=db) as txn:
        txn.put(b"k", b"1")
        txn.put(b"k", b"2")
    env.close()
    assert _spans(str(sub / "data.mdb")) is None
    good = _env(tmp_path / "good", items)
    data = bytearray(Path(good).read_bytes())
    for offset in (16, 20, 10):  # magic, version, meta page flags
        bad = bytearray(data)
        bad[offset] ^= 0xFF
        p = tmp_path / f"bad{offset}.mdb"
        p.write_bytes(bytes(bad))
        assert _spans(str(p)) is None
    (tmp_path / "empty.mdb").write_bytes(b"")
    assert _spans(str(tmp_path / "empty.mdb")) is None
    (tmp_path / "short.mdb").write_bytes(data[:100])
    assert _spans(str(tmp_path / "short.mdb")) is None
    (tmp_path / "cut.mdb").write_bytes(data[:len(data) // 2])
    assert _spans(str(tmp_path / "cut.mdb")) is None


def test_damaged_pages_are_refused_or_what_was_there(tmp_path: Path) -> None:
    # a flipped byte in the tree either leaves the parse what it was, or is refused: never a
    # different list of entries that passes the checks, except in the bytes of keys and values
    # themselves, which the parse copies as they are
    rnd = random.Random(11)
    items = _items(rnd, 2000, big=0.02)
    path = _env(tmp_path, items)
    data = Path(path).read_bytes()
    want = _parsed(path)
    assert want is not None
    spans = _spans(path)
    assert spans is not None
    payload = np.zeros(len(data), dtype=bool)
    for s, n in ((spans.key_start, spans.key_size), (spans.value_start, spans.value_size)):
        for a, b in zip(s.tolist(), n.tolist(), strict=True):
            payload[a:a + b] = True
    for trial in range(300):
        at = rnd.randrange(len(data))
        if payload[at]:
            continue
        bad = bytearray(data)
        bad[at] ^= 1 << rnd.randrange(8)
        p = tmp_path / "bad.mdb"
        p.write_bytes(bytes(bad))
        got = _parsed(str(p))
        assert got is None or got == want, (trial, at)


def test_a_deep_tree_is_walked_level_by_level_and_a_bent_one_is_refused(tmp_path: Path) -> None:
    # three levels (root, branches, leaves): the level walk lists what the cursors list; a
    # root whose children repeat a page, loop back to the root, or mix a leaf into the level of
    # branches is refused, never a wrong list
    from materializer.lmdb_pages import _meta

    items = [(b"k%08d" % i, b"v%04d" % (i % 9999)) for i in range(60_000)]
    path = _env(tmp_path, items)
    env = lmdb.open(os.path.dirname(path), readonly=True, lock=False)
    depth = env.stat()["depth"]
    env.close()
    assert depth >= 3
    assert _parsed(path) == _cursor(path) == items
    data = Path(path).read_bytes()
    meta = _meta(np.frombuffer(data, dtype=np.uint8))
    psize, root = meta.psize, meta.root

    def child(raw: bytes | bytearray, page: int, i: int) -> tuple[int, int]:
        """(offset of the 48-bit child number of node i of branch ``page``, that number)."""
        node = page * psize + int.from_bytes(raw[page * psize + 16 + 2 * i:][:2], "little")
        return node, int.from_bytes(raw[node:node + 6], "little")

    _, first = child(data, root, 0)
    second_at, _ = child(data, root, 1)
    _, leaf = child(data, first, 0)  # a page of the level below the root's children
    for target in (first, root, leaf):
        bad = bytearray(data)
        bad[second_at:second_at + 6] = target.to_bytes(6, "little")
        p = tmp_path / f"bent{target}.mdb"
        p.write_bytes(bytes(bad))
        assert _spans(str(p)) is None, target


def test_a_leaf_listed_twice_in_place_of_one_as_full_is_refused(tmp_path: Path) -> None:
    # a branch whose second child names its first leaf again, both leaves holding the same
    # number of entries: the entry count still matches the meta page's, so only the check for a
    # page twice on one level stops a list with the first leaf's rows twice and the second's
    # missing
    from materializer.lmdb_pages import _meta

    items = [(b"k%08d" % i, b"v%04d" % (i % 9999)) for i in range(60_000)]
    path = _env(tmp_path, items)
    data = Path(path).read_bytes()
    meta = _meta(np.frombuffer(data, dtype=np.uint8))
    psize, root = meta.psize, meta.root

    def node(page: int, i: int) -> int:
        return page * psize + int.from_bytes(data[page * psize + 16 + 2 * i:][:2], "little")

    def entries(page: int) -> int:  # a page's node count: (lower - header) / 2
        return (int.from_bytes(data[page * psize + 12:][:2], "little") - 16) // 2

    def kid(page: int, i: int) -> int:
        return int.from_bytes(data[node(page, i):node(page, i) + 6], "little")

    branch = kid(root, 0)
    while int.from_bytes(data[kid(branch, 0) * psize + 10:][:2], "little") & 0x01:  # P_BRANCH
        branch = kid(branch, 0)
    pair = next(i for i in range(entries(branch) - 1)
                if entries(kid(branch, i)) == entries(kid(branch, i + 1)))
    bad = bytearray(data)
    at = node(branch, pair + 1)
    bad[at:at + 6] = kid(branch, pair).to_bytes(6, "little")
    p = tmp_path / "twice.mdb"
    p.write_bytes(bytes(bad))
    assert _spans(str(p)) is None


def test_a_node_at_the_very_end_of_the_file_reads_its_key_head_padded(tmp_path: Path) -> None:
    # one leaf page, the file's last: its first node, of a 1-byte key and an empty value, ends
    # where the file ends, 7 bytes after its header (the 16-byte gather would run past it)
    path = _env(tmp_path, [(b"a", b""), (b"b", b"x")])
    spans = _spans(path)
    assert spans is not None and len(spans) == 2
    assert int((spans.key_start - 8).max()) + 16 > os.path.getsize(path)
    assert spans.key_head.tolist() == [ord("a") << 56, ord("b") << 56]


def _dstl_file(tmp_path: Path, entries: list[tuple[int, int, bytes]]) -> str:
    """A compacting copy of an environment of DSTL's key layout holding ``(key group, state
    id, key)`` entries (value b"v", tag 0 of key layout "2") and the layout record."""
    from materializer.lmdb_table import KEY_PREFIX, LAYOUT_KEY, LAYOUT_VERSION

    items = [(KEY_PREFIX.pack(kg, sid, len(k)) + k, b"\x00v") for kg, sid, k in entries]
    return _env(tmp_path, sorted([*items, (LAYOUT_KEY, LAYOUT_VERSION)]))


def test_dstl_keys_are_checked_against_the_metadata_and_their_hash(tmp_path: Path) -> None:
    from dstl import KeyGroupRange, key_group_for
    from dstl.errors import CorruptObjectError
    from materializer.file_snapshot import FileSnapshotMeta
    from materializer.lmdb_check import check_data_file

    mp = 16
    keys = [f"user-{i}".encode() for i in range(200)]
    good = [(key_group_for(k, mp), 0, k) for k in keys]
    states = {"0": {"name": "v"}, "1": {"name": "$index", "raw": True}}
    meta = FileSnapshotMeta(KeyGroupRange(0, mp - 1), mp, states, "op", 1)
    ok = _dstl_file(tmp_path / "ok", [*good, (3, 1, b"any bytes")])   # a raw state's own kg
    assert check_data_file(ok, meta, key="snap", offset=9).entries == len(good) + 1
    moved = (good[0][0] + 1) % mp
    cases = {
        "hashes to key group": [*good[1:], (moved, 0, keys[0])],
        "outside key groups": [(kg, sid, k) for kg, sid, k in good],   # with a narrower range
        "state id 7": [*good, (good[0][0], 7, keys[0] + b"x")],
    }
    for why, entries in cases.items():
        m = meta if why != "outside key groups" else FileSnapshotMeta(
            KeyGroupRange(0, mp // 2), mp, states, "op", 1)
        path = _dstl_file(tmp_path / why.replace(" ", "-"), entries)
        with pytest.raises(CorruptObjectError, match=why) as info:
            check_data_file(path, m, key="snap", offset=9)
        assert info.value.key == "snap" and info.value.offset == 9
