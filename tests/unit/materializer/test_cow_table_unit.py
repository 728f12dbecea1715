"""CopyOnWriteStateTable and the heap facade: key-group checks, per-key-group release."""

from __future__ import annotations

import json

import pytest

from dstl.errors import ClosedError, KeyGroupError, UsageError
from dstl.keygroups import KeyGroupRange
from materializer import CopyOnWriteStateTable, HeapStateTables, SnapshotReader


def test_key_group_outside_range_names_the_range() -> None:
    t: CopyOnWriteStateTable[str, None, int] = CopyOnWriteStateTable(KeyGroupRange(2, 5))
    with pytest.raises(KeyGroupError, match=r"\[2, 5\]"):
        t.put("k", 6, None, 1)
    with pytest.raises(KeyGroupError):
        t.get("k", 1, None)
    t.put("k", 2, None, 1)
    assert t.get("k", 2, None) == 1 and len(t) == 1 and t.len() == 1


def test_table_snapshot_releases_key_group_by_key_group() -> None:
    t: CopyOnWriteStateTable[str, None, int] = CopyOnWriteStateTable(KeyGroupRange(0, 3))
    for kg in range(4):
        t.put(f"k{kg}", kg, None, kg)
    snap = t.snapshot()
    assert len(snap) == 4
    assert t.map_for(1).highest_required_snapshot_version == 1
    assert list(snap.entries(1)) == [("k1", None, 1)]
    snap.release_key_group(1)
    assert t.map_for(1).highest_required_snapshot_version == 0
    assert t.map_for(2).highest_required_snapshot_version == 1
    snap.release()
    with pytest.raises(ClosedError):
        snap.entries(2)


def test_heap_write_out_releases_each_key_group_after_encoding_it() -> None:
    tables = HeapStateTables(KeyGroupRange(0, 2))
    for kg in range(3):
        tables.put(7, kg, f"user{kg}", None, {"n": kg})
    snap = tables.snapshot()
    maps = [tables.table(7).map_for(kg) for kg in range(3)]
    released_when_encoding: list[list[int]] = []

    def encode(sid: int, key: str, ns: None, state: dict[str, int]) -> tuple[bytes, bytes, bytes]:
        released_when_encoding.append([m.highest_required_snapshot_version for m in maps])
        return key.encode(), b"", json.dumps(state).encode()

    data = snap.to_bytes(metadata=b"{}", encode=encode)
    assert released_when_encoding == [[1, 1, 1], [0, 1, 1], [0, 0, 1]]
    back = HeapStateTables(KeyGroupRange(0, 2))

    def decode(sid: int, k: bytes, ns: bytes, v: bytes) -> tuple[str, None, dict[str, int]]:
        return k.decode(), None, json.loads(v)

    assert back.load_snapshot(SnapshotReader(data), decode) == 3
    assert back.get(7, 1, "user1", None) == {"n": 1}
    with pytest.raises(ClosedError):
        snap.to_bytes()


def test_heap_write_out_without_encoder_needs_bytes() -> None:
    tables = HeapStateTables(KeyGroupRange(0, 0))
    tables.put(0, 0, "not-bytes", None, 1)
    with pytest.raises(UsageError, match="bytes"):
        tables.snapshot().to_bytes()
    assert tables.table(0).map_for(0).highest_required_snapshot_version == 0


def test_state_ids_are_validated() -> None:
    tables = HeapStateTables(KeyGroupRange(0, 0))
    with pytest.raises(UsageError, match="state id"):
        tables.put(-1, 0, b"k", b"", b"v")
