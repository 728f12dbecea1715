"""The heap tables' ``memory_bytes`` (the progress record's ``memoryUsedBytes``): a sampled
estimate that tracks what the entries really allocate, grows with the state, ignores objects
shared by every entry, and costs the same whatever the state's size."""

from __future__ import annotations

import gc
import os
import tracemalloc
from dataclasses import dataclass
from typing import Any

import pytest

import materializer.state_tables as state_tables
from dstl.keygroups import KeyGroupRange
from materializer import HeapStateTables

_SHARED_NAMESPACE = ("window", "shared")


def _fill(tables: HeapStateTables, n: int, value: Any, start: int = 0) -> None:
    for i in range(start, start + n):
        key = f"user-{i:08d}"
        tables.put(1, i % 32, key, _SHARED_NAMESPACE, value(i))


@pytest.mark.parametrize("kind", ["bytes", "list", "object"])
def test_the_estimate_is_close_to_what_tracemalloc_sees(kind: str) -> None:
    @dataclass
    class Row:
        name: str
        score: float
        tags: list[str]

    values = {
        "bytes": lambda i: os.urandom(300),
        "list": lambda i: [float(i), f"v{i}" * 20, (i, i + 1.5)],
        "object": lambda i: Row(f"n{i}" * 10, i * 0.5, [f"t{i}", f"u{i}"]),
    }
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tables = HeapStateTables(KeyGroupRange(0, 31))
        _fill(tables, 5000, values[kind])
        gc.collect()
        measured = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    estimate = tables.stats()["memory_bytes"]
    # a sample of 32 entries out of 5000 similar ones: within a third of the allocations
    assert 0.67 * measured <= estimate <= 1.5 * measured, (kind, estimate, measured)


def test_it_grows_with_the_state_and_shared_objects_count_once() -> None:
    tables = HeapStateTables(KeyGroupRange(0, 31))
    assert tables.stats()["memory_bytes"] == 0
    figures = []
    for step in range(3):
        _fill(tables, 1000, lambda i: b"x" * 200 + i.to_bytes(4, "big"), start=step * 1000)
        figures.append(tables.stats()["memory_bytes"])
    assert figures[0] < figures[1] < figures[2]
    per_entry = (figures[2] - figures[1]) / 1000
    # a 204-byte value and a 13-character key, plus the entry and its bucket; the namespace
    # tuple (shared by every entry) is not counted per entry
    assert 204 + 13 < per_entry < 600, per_entry
    shared_big = tuple(range(1000))  # one object every entry points to
    other = HeapStateTables(KeyGroupRange(0, 31))
    _fill(other, 1000, lambda i: shared_big)
    assert other.stats()["memory_bytes"] < 1000 * 300  # not 1000 x its ~8 KB


def test_its_cost_does_not_grow_with_the_state(monkeypatch: pytest.MonkeyPatch) -> None:
    visited = 0
    reachable = state_tables._reachable

    def counting(entry: Any) -> Any:
        nonlocal visited
        visited += 1
        return reachable(entry)

    monkeypatch.setattr(state_tables, "_reachable", counting)
    tables = HeapStateTables(KeyGroupRange(0, 31))
    for n in (100, 20_000):
        _fill(tables, n, lambda i: i * 1.5)
        visited = 0
        assert tables.stats()["memory_bytes"] > 0
        assert visited == state_tables.MEMORY_SAMPLE  # one state: one sample, whatever n


def test_a_huge_state_is_measured_in_part_and_cycles_end() -> None:
    tables = HeapStateTables(KeyGroupRange(0, 31))
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    tables.put(1, 0, "a", None, cyclic)
    tables.put(1, 1, "b", None, list(range(100_000)))
    est = tables.stats()["memory_bytes"]
    assert est > 0
