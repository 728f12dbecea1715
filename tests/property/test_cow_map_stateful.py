"""CopyOnWriteStateMap against a dict model (Hypothesis state machine) and under a second thread.

Snapshots are taken, iterated and released at random moments, several at once, also in the middle
of incremental rehashes (tables start at 4 buckets so rehashes are frequent); a caller mutating a
list state returned by ``get`` must never change a running snapshot.
"""

from __future__ import annotations

import copy
import queue
import random
import sys
import threading
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from materializer.cow_map import CopyOnWriteStateMap

keys = st.integers(0, 60)
namespaces = st.sampled_from([None, "w1", "w2"])
values = st.one_of(st.integers(), st.lists(st.integers(0, 9), max_size=3))


def _frozen(items: Any) -> list[tuple[Any, Any, Any]]:
    out = [(k, ns, tuple(v) if isinstance(v, list) else v) for k, ns, v in items]
    return sorted(out, key=repr)


class CowMapMachine(RuleBasedStateMachine):
    snapshots = Bundle("snapshots")

    def __init__(self) -> None:
        super().__init__()
        self.map: CopyOnWriteStateMap[int, str | None, Any] = CopyOnWriteStateMap(
            initial_capacity=4)
        self.model: dict[tuple[int, str | None], Any] = {}
        self.alive = 0
        self.rehash_snapshots = 0

    @rule(k=keys, ns=namespaces, v=values)
    def put(self, k: int, ns: str | None, v: Any) -> None:
        self.map.put(k, ns, v)
        self.model[(k, ns)] = copy.deepcopy(v)

    @rule(k=keys, ns=namespaces, marker=st.integers(100, 200))
    def get_and_mutate(self, k: int, ns: str | None, marker: int) -> None:
        got = self.map.get(k, ns)
        assert got == self.model.get((k, ns))
        if isinstance(got, list):
            got.append(marker)  # the caller mutates the state it got (allowed)
            self.model[(k, ns)] = copy.deepcopy(got)

    @rule(k=keys, ns=namespaces)
    def remove(self, k: int, ns: str | None) -> None:
        assert self.map.remove(k, ns) == ((k, ns) in self.model)
        self.model.pop((k, ns), None)

    @rule(k=keys, ns=namespaces)
    def contains(self, k: int, ns: str | None) -> None:
        assert self.map.contains_key(k, ns) == ((k, ns) in self.model)

    @rule(target=snapshots)
    def take_snapshot(self) -> tuple[Any, list[Any]]:
        if self.map.is_rehashing:
            self.rehash_snapshots += 1
        self.alive += 1
        return self.map.snapshot(), _frozen((k, ns, v) for (k, ns), v in self.model.items())

    @rule(s=snapshots)
    def iterate_snapshot(self, s: tuple[Any, list[Any]]) -> None:
        snap, expected = s
        if not snap.released:
            assert len(snap) == len(expected)
            assert _frozen(snap) == expected

    @rule(s=consumes(snapshots))
    def release_snapshot(self, s: tuple[Any, list[Any]]) -> None:
        snap, expected = s
        if not snap.released:
            assert _frozen(snap) == expected
            self.alive -= 1
        snap.release()
        snap.release()  # idempotent

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data())
    def live_entries(self, data: st.DataObject) -> None:
        it = self.map.entries()
        assert _frozen(it) == _frozen((k, ns, v) for (k, ns), v in self.model.items())

    @invariant()
    def len_and_structure(self) -> None:
        assert len(self.map) == len(self.model)
        self.map.check_invariants()
        assert len(self.map.snapshot_versions) == self.alive


TestCowMapStateful = CowMapMachine.TestCase


def test_snapshots_iterated_and_released_on_another_thread_while_writer_writes() -> None:
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    m: CopyOnWriteStateMap[int, None, Any] = CopyOnWriteStateMap(initial_capacity=4)
    handoff: queue.Queue[tuple[Any, list[Any]] | None] = queue.Queue(maxsize=4)
    failures: list[BaseException] = []

    def writer() -> None:
        model: dict[int, Any] = {}
        try:
            for step in range(30_000):
                k = rng.randrange(3000)
                op = rng.random()
                if op < 0.55:
                    v: Any = [step] if rng.random() < 0.5 else step
                    m.put(k, None, v)
                    model[k] = copy.deepcopy(v)
                elif op < 0.75:
                    got = m.get(k, None)
                    if isinstance(got, list):
                        got.append(-1)
                        model[k] = list(got)
                else:
                    m.remove(k, None)
                    model.pop(k, None)
                if step % 3000 == 0:
                    frozen = _frozen((kk, None, vv) for kk, vv in model.items())
                    handoff.put((m.snapshot(), frozen))
        except BaseException as exc:  # surfaced to the test thread below
            failures.append(exc)
        finally:
            handoff.put(None)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often so iteration interleaves with writes
    t = threading.Thread(target=writer, name="dstl-test-cow-writer")
    t.start()
    try:
        checked = 0
        while (item := handoff.get()) is not None:
            snap, expected = item
            assert _frozen(snap) == expected
            snap.release()
            checked += 1
    finally:
        t.join()
        sys.setswitchinterval(old)
    assert not failures, failures
    assert checked == 10
    assert m.highest_required_snapshot_version == 0
    m.check_invariants()
