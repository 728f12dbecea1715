"""One contract suite for every state table behind the ``StateTables`` facade (heap and LMDB).

Keys, namespaces and values are bytes here, which both tables accept as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dstl.errors import KeyGroupError
from dstl.keygroups import KeyGroupRange
from materializer import HeapStateTables, LmdbStateTable, SnapshotReader, StateTables
from materializer.state_tables import BytesSource

RANGE = KeyGroupRange(8, 15)


def _make(kind: str, path: Path, key_groups: KeyGroupRange = RANGE) -> StateTables:
    if kind == "heap":
        return HeapStateTables(key_groups, initial_capacity=4)
    return LmdbStateTable(path, key_groups, map_size_bytes=1 << 20,
                          max_map_size_bytes=1 << 26)


@pytest.fixture(params=["heap", "lmdb"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def tables(kind: str, tmp_path: Path) -> Iterator[StateTables]:
    t = _make(kind, tmp_path / "t")
    yield t
    t.close()


def _fill(t: StateTables, n: int = 40) -> dict[tuple[int, int, bytes, bytes], bytes]:
    model = {}
    with t.write_batch():
        for i in range(n):
            sid, kg = i % 3, RANGE.start + i % len(RANGE)
            k, ns, v = b"key-%d" % i, (b"ns" if i % 2 else b""), b"value-%d" % i
            t.put(sid, kg, k, ns, v)
            model[(sid, kg, k, ns)] = v
    return model


def _contents(t: StateTables, key_groups: KeyGroupRange = RANGE
              ) -> dict[tuple[int, int, bytes, bytes], bytes]:
    out = {}
    for sid in range(3):
        for kg in key_groups:
            for k, ns, v in t.entries(sid, kg):
                out[(sid, kg, bytes(k), bytes(ns))] = bytes(v)
    return out


def test_satisfies_the_protocol(tables: StateTables) -> None:
    assert isinstance(tables, StateTables)
    assert tables.key_groups == RANGE


def test_put_get_remove_contains(tables: StateTables) -> None:
    assert tables.get(1, 8, b"k", b"") is None and not tables.contains(1, 8, b"k", b"")
    tables.put(1, 8, b"k", b"", b"v1")
    tables.put(1, 8, b"k", b"n", b"v2")
    tables.put(2, 8, b"k", b"", b"other state")
    assert tables.get(1, 8, b"k", b"") == b"v1" and tables.get(1, 8, b"k", b"n") == b"v2"
    assert tables.get(2, 8, b"k", b"") == b"other state"
    tables.put(1, 8, b"k", b"", b"v3")
    assert tables.get(1, 8, b"k", b"") == b"v3"
    assert tables.remove(1, 8, b"k", b"") is True
    assert tables.remove(1, 8, b"k", b"") is False
    assert not tables.contains(1, 8, b"k", b"") and tables.contains(1, 8, b"k", b"n")


def test_entries_per_key_group(tables: StateTables) -> None:
    model = _fill(tables)
    assert _contents(tables) == model
    only = {(k, ns): v for (sid, kg, k, ns), v in model.items() if sid == 1 and kg == 9}
    assert {(bytes(k), bytes(ns)): bytes(v) for k, ns, v in tables.entries(1, 9)} == only


def test_writes_while_iterating_entries_are_allowed(tables: StateTables) -> None:
    _fill(tables)
    seen = 0
    for k, ns, _v in tables.entries(0, 8):
        tables.put(0, 8, bytes(k) + b"-new", bytes(ns), b"x")
        seen += 1
    assert seen > 0
    assert len(list(tables.entries(0, 8))) == 2 * seen


@pytest.mark.parametrize("kg", [7, 16, -1, 40000])
def test_key_group_outside_range_names_the_range(tables: StateTables, kg: int) -> None:
    for op in (lambda: tables.get(0, kg, b"k", b""),
               lambda: tables.put(0, kg, b"k", b"", b"v"),
               lambda: tables.remove(0, kg, b"k", b""),
               lambda: tables.contains(0, kg, b"k", b""),
               lambda: list(tables.entries(0, kg))):
        with pytest.raises(KeyGroupError, match=r"\[8, 15\]") as info:
            op()
        assert info.value.key_group == kg


def test_snapshot_isolation(tables: StateTables) -> None:
    model = _fill(tables)
    snap = tables.snapshot()
    tables.put(0, 8, b"after", b"", b"x")
    tables.put(0, 8, b"key-0", b"", b"changed")
    tables.remove(1, 9, b"key-1", b"ns")
    data = snap.to_bytes(metadata=b"meta")
    reader = SnapshotReader(data)
    got = {(sid, kg, k, ns): v for kg, es in reader.read() for sid, k, ns, v in es}
    assert got == model
    assert reader.metadata == b"meta" and reader.key_groups == RANGE


def test_write_out_and_load_round_trip(tables: StateTables, kind: str, tmp_path: Path) -> None:
    model = _fill(tables, 200)
    data = tables.snapshot().to_bytes(metadata=b"m")
    for target_kind in ("heap", "lmdb"):
        target = _make(target_kind, tmp_path / f"load-{target_kind}")
        try:
            assert target.load_snapshot(SnapshotReader(data)) == len(model)
            assert _contents(target) == model
        finally:
            target.close()


def test_load_only_a_sub_range_with_ranged_reads(tables: StateTables, kind: str,
                                                 tmp_path: Path) -> None:
    model = _fill(tables, 200)
    data = tables.snapshot().to_bytes()
    reads: list[tuple[int, int]] = []

    class CountingSource(BytesSource):
        def read(self, offset: int, length: int) -> bytes:
            reads.append((offset, length))
            return super().read(offset, length)

    sub = KeyGroupRange(10, 11)
    target = _make(kind, tmp_path / "sub", sub)
    try:
        n = target.load_snapshot(SnapshotReader(CountingSource(data)))
        want = {key: v for key, v in model.items() if key[1] in sub}
        assert n == len(want) and _contents(target, sub) == want
    finally:
        target.close()
    assert len(reads) == 1 + 2  # the tail (footer + index), then one block per key group
    assert sum(length for _, length in reads[1:]) < len(data) // 2  # 2 of 8 key groups


def test_load_respects_an_explicit_key_group_restriction(tables: StateTables) -> None:
    source = HeapStateTables(RANGE)
    model = _fill(source, 100)
    data = source.snapshot().to_bytes()
    n = tables.load_snapshot(SnapshotReader(data), key_groups=KeyGroupRange(12, 12))
    assert n == sum(1 for key in model if key[1] == 12)
    assert all(kg == 12 for (_sid, kg, _k, _ns) in _contents(tables))


def test_clear_state(tables: StateTables) -> None:
    model = _fill(tables)
    snap = tables.snapshot()
    tables.clear_state(1)
    assert all(sid != 1 for (sid, *_rest) in _contents(tables))
    assert _contents(tables) == {k: v for k, v in model.items() if k[0] != 1}
    got = {(sid, kg, k, ns): v for kg, es in SnapshotReader(snap.to_bytes()).read()
           for sid, k, ns, v in es}
    assert got == model  # a running snapshot keeps the cleared state


def test_write_batch_groups_writes(tables: StateTables) -> None:
    with tables.write_batch():
        tables.put(0, 8, b"a", b"", b"1")
        assert tables.get(0, 8, b"a", b"") == b"1"  # visible inside the batch
        with tables.write_batch():
            tables.put(0, 8, b"b", b"", b"2")
    assert tables.get(0, 8, b"b", b"") == b"2"


def test_snapshot_release_is_idempotent(tables: StateTables) -> None:
    _fill(tables)
    snap = tables.snapshot()
    snap.release()
    snap.release()
