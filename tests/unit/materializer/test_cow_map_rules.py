"""CopyOnWriteStateMap: copy-on-write rules, copier fast path, rehash invariants, release."""

from __future__ import annotations

import pytest

from dstl.errors import ClosedError, ConfigError
from materializer.cow_map import (
    MIN_TRANSFERRED_PER_INCREMENTAL_REHASH,
    CopyOnWriteStateMap,
    is_immutable,
)


class CountingCopier:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, state: list[int]) -> list[int]:
        self.calls += 1
        return list(state)


def colliding_keys(m: CopyOnWriteStateMap[object, object, object], n: int) -> list[int]:
    """``n`` int keys (namespace None) that land in the same primary bucket."""
    mask = m.capacity - 1
    target = hash((0, None)) & mask
    keys = [k for k in range(100_000) if hash((k, None)) & mask == target]
    return keys[:n]


def test_put_get_remove_contains_len() -> None:
    m: CopyOnWriteStateMap[str, str, int] = CopyOnWriteStateMap()
    assert m.get("a", "ns") is None and not m.contains_key("a", "ns")
    m.put("a", "ns", 1)
    m.put("a", "other", 2)
    assert m.get("a", "ns") == 1 and m.get("a", "other") == 2 and len(m) == 2
    m.put("a", "ns", 3)
    assert m.get("a", "ns") == 3 and len(m) == 2
    assert m.remove("a", "ns") and not m.remove("a", "ns")
    assert not m.contains_key("a", "ns") and len(m) == 1
    m.check_invariants()


def test_initial_capacity_is_validated() -> None:
    with pytest.raises(ConfigError, match="initial_capacity"):
        CopyOnWriteStateMap(initial_capacity=0)
    assert CopyOnWriteStateMap(initial_capacity=5).capacity == 8


@pytest.mark.parametrize("value", [1, 1.5, 2j, "s", b"b", True, None, (1, ("a", (None, b"x")))])
def test_immutables_are_recognised(value: object) -> None:
    assert is_immutable(value)


@pytest.mark.parametrize("value", [[1], {"a": 1}, {1}, (1, [2]), bytearray(b"x")])
def test_mutables_are_recognised(value: object) -> None:
    assert not is_immutable(value)


def test_int_subclass_is_not_treated_as_immutable() -> None:
    class Tagged(int):
        pass

    assert not is_immutable(Tagged(3))


def test_copier_fast_path_immutable_states_are_never_copied() -> None:
    copier = CountingCopier()
    m: CopyOnWriteStateMap[int, None, object] = CopyOnWriteStateMap(copier)  # type: ignore[arg-type]
    state = (1, "two", (b"3",))
    m.put(1, None, state)
    snap = m.snapshot()
    got = m.get(1, None)
    assert got is state and copier.calls == 0
    snap.release()


def test_get_of_a_mutable_state_under_a_snapshot_copies_once() -> None:
    copier = CountingCopier()
    m: CopyOnWriteStateMap[int, None, list[int]] = CopyOnWriteStateMap(copier)
    m.put(1, None, [1])
    snap = m.snapshot()
    got = m.get(1, None)
    assert got == [1] and copier.calls == 1
    assert got is not None
    got.append(2)
    assert m.get(1, None) == [1, 2] and copier.calls == 1  # exclusive now: no second copy
    assert list(snap) == [(1, None, [1])]
    snap.release()


def test_get_without_snapshot_never_copies() -> None:
    copier = CountingCopier()
    m: CopyOnWriteStateMap[int, None, list[int]] = CopyOnWriteStateMap(copier)
    m.put(1, None, [1])
    m.snapshot().release()
    assert m.get(1, None) == [1] and copier.calls == 0


def test_put_in_middle_of_chain_copies_predecessors_and_shares_successors() -> None:
    m: CopyOnWriteStateMap[int, None, str] = CopyOnWriteStateMap(initial_capacity=64)
    a, b, c = colliding_keys(m, 3)
    for k in (c, b, a):  # head insertion: chain is a -> b -> c
        m.put(k, None, f"v{k}")
    head_before = m._primary[hash((a, None)) & (m.capacity - 1)]
    assert head_before is not None and head_before.key == a
    snap = m.snapshot()
    m.put(b, None, "new")
    head_after = m._primary[hash((a, None)) & (m.capacity - 1)]
    assert head_after is not None and head_after is not head_before      # a copied
    assert head_after.next is not head_before.next                        # b copied
    assert head_after.next is not None
    assert head_after.next.next is head_before.next.next                  # c shared
    assert head_after.entry_version == m.state_map_version
    assert sorted(snap) == sorted([(k, None, f"v{k}") for k in (a, b, c)])
    assert m.get(b, None) == "new"
    snap.release()
    m.check_invariants()


def test_new_entry_goes_to_head_and_copies_nothing() -> None:
    m: CopyOnWriteStateMap[int, None, str] = CopyOnWriteStateMap(initial_capacity=64)
    a, b = colliding_keys(m, 2)
    m.put(a, None, "a")
    idx = hash((a, None)) & (m.capacity - 1)
    old_head = m._primary[idx]
    snap = m.snapshot()
    m.put(b, None, "b")
    new_head = m._primary[idx]
    assert new_head is not None and new_head.key == b and new_head.next is old_head
    assert list(snap) == [(a, None, "a")]
    snap.release()


def test_remove_copies_shared_predecessors() -> None:
    m: CopyOnWriteStateMap[int, None, str] = CopyOnWriteStateMap(initial_capacity=64)
    a, b, c = colliding_keys(m, 3)
    for k in (c, b, a):
        m.put(k, None, str(k))
    snap = m.snapshot()
    assert m.remove(b, None)
    assert sorted(snap) == sorted([(k, None, str(k)) for k in (a, b, c)])
    assert not m.contains_key(b, None) and m.contains_key(c, None) and len(m) == 2
    assert m.remove(a, None)  # head removal: live array only
    assert sorted(snap) == sorted([(k, None, str(k)) for k in (a, b, c)])
    snap.release()
    m.check_invariants()


def test_release_recomputes_highest_required_version() -> None:
    m: CopyOnWriteStateMap[int, None, int] = CopyOnWriteStateMap()
    s1 = m.snapshot()
    s2 = m.snapshot()
    assert m.highest_required_snapshot_version == s2.version == 2
    s2.release()
    assert m.highest_required_snapshot_version == s1.version
    s2.release()  # idempotent
    s1.release()
    assert m.highest_required_snapshot_version == 0 and m.snapshot_versions == frozenset()


def test_iterating_a_released_snapshot_is_a_typed_error() -> None:
    m: CopyOnWriteStateMap[int, None, int] = CopyOnWriteStateMap()
    m.put(1, None, 1)
    with m.snapshot() as snap:
        assert len(snap) == 1
    with pytest.raises(ClosedError, match="snapshot"):
        list(snap)


def test_release_in_the_middle_of_iteration_stops_it() -> None:
    m: CopyOnWriteStateMap[int, None, int] = CopyOnWriteStateMap()
    for i in range(50):
        m.put(i, None, i)
    snap = m.snapshot()
    it = iter(snap)
    next(it)
    snap.release()
    with pytest.raises(ClosedError):
        list(it)


def test_entries_is_a_released_on_exhaustion_snapshot_and_allows_writes() -> None:
    m: CopyOnWriteStateMap[int, None, int] = CopyOnWriteStateMap(initial_capacity=4)
    for i in range(20):
        m.put(i, None, i)
    seen = []
    for k, _ns, v in m.entries():
        seen.append((k, v))
        m.put(k + 1000, None, v)  # writes while iterating: allowed, not visible
    assert sorted(seen) == [(i, i) for i in range(20)]
    assert m.highest_required_snapshot_version == 0
    it = m.entries()
    it.close()
    assert m.highest_required_snapshot_version == 0
    m.check_invariants()


def test_incremental_rehash_moves_whole_buckets_and_keeps_invariants() -> None:
    m: CopyOnWriteStateMap[int, None, int] = CopyOnWriteStateMap(initial_capacity=4)
    n = 0
    while not m.is_rehashing:
        m.put(n, None, n)
        n += 1
    assert m.capacity == 4 and len(m._rehash_table) == 8
    m.check_invariants()
    before = m._primary_size
    m.contains_key(-1, None)  # any operation migrates
    moved = before - m._primary_size
    assert moved >= min(MIN_TRANSFERRED_PER_INCREMENTAL_REHASH, before) or not m.is_rehashing
    m.check_invariants()
    for i in range(n):
        assert m.get(i, None) == i
    assert not m.is_rehashing and m.capacity == 8
    m.check_invariants()


def test_snapshot_during_rehash_has_the_seed_layout_and_exact_contents() -> None:
    m: CopyOnWriteStateMap[int, None, int] = CopyOnWriteStateMap(initial_capacity=16)
    n = 0
    while not m.is_rehashing:
        m.put(n, None, n)
        n += 1
    m.get(0, None)
    rh = m._rehash_index
    assert 0 < rh < m.capacity
    snap = m.snapshot()
    data = snap._data
    assert data is not None
    cap = m.capacity
    assert len(data) == (cap - rh) + 2 * rh  # primary[rh:] + new[:rh] + new[cap:cap+rh]
    for i in range(n):
        m.put(i, None, -i)
    m.put(n + 1, None, 7)
    assert sorted(snap) == [(i, None, i) for i in range(n)]
    snap.release()
    m.check_invariants()
