"""restore_backend round trips: every state kind, heap/LMDB both ways, rescaling 1->2, 2->1,
4->3, 8->2, and strict typed errors for missing or corrupt objects (issues #4 and #5)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for
from dstl.errors import CorruptObjectError, ObjectNotFoundError
from dstl.stores import MemoryBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle
from materializer.options import BackendOptions
from materializer.states import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from restore.restore import RestoreStats, restore_backend

MP = 64
WAIT = 10.0
OPTS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)


class Avg:
    def create_accumulator(self) -> list[int]:
        return [0, 0]

    def add(self, v: int, acc: list[int]) -> list[int]:
        return [acc[0] + v, acc[1] + 1]

    def get_result(self, acc: list[int]) -> float:
        return acc[0] / acc[1]

    def merge(self, a: list[int], b: list[int]) -> list[int]:
        return [a[0] + b[0], a[1] + b[1]]


def _descs() -> dict[str, Any]:
    return {"v": ValueStateDescriptor("v"), "l": ListStateDescriptor("l"),
            "m": MapStateDescriptor("m"), "r": ReducingStateDescriptor("r", lambda a, b: a + b),
            "a": AggregatingStateDescriptor("a", Avg())}


@pytest.fixture
def storage() -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(store=MemoryBlobStore(), options=DstlOptions(persist_delay_s=0.0))
    yield s
    s.close()


KEYS = [f"user-{i}" for i in range(300)]


def _workload(b: ChangelogKeyedStateBackend, rng: random.Random, steps: int,
              keys: list[str], model: dict[tuple[str, str, Any], Any]) -> None:
    """Random mutations of every state kind, mirrored into ``model``."""
    st = {n: b.get_state(d) for n, d in _descs().items()}
    for _ in range(steps):
        k = rng.choice(keys)
        ns = rng.choice([None, "w1"])
        b.set_current_key(k)
        b.set_current_namespace(ns)
        op = rng.randrange(9)
        if op == 0:
            x = rng.randrange(100)
            st["v"].update(x)
            model[("v", k, ns)] = x
        elif op == 1:
            st["l"].add(op)
            model.setdefault(("l", k, ns), []).append(op)
        elif op == 2:
            st["m"].put(f"f{rng.randrange(3)}", [rng.randrange(5)])
            model[("m", k, ns)] = st["m"].items()
        elif op == 3:
            st["m"].remove("f0")
            items = st["m"].items()
            if items:
                model[("m", k, ns)] = items
            else:
                model.pop(("m", k, ns), None)
        elif op == 4:
            x = rng.randrange(10)
            st["r"].add(x)
            model[("r", k, ns)] = model.get(("r", k, ns), 0) + x
        elif op == 5:
            st["a"].add(rng.randrange(10))
            model[("a", k, ns)] = st["a"].get()
        elif op == 6:
            st["v"].clear()
            model.pop(("v", k, ns), None)
        elif op == 7:
            st["l"].update([1, 2])
            model[("l", k, ns)] = [1, 2]
        else:
            st["l"].clear()
            model.pop(("l", k, ns), None)
    b.set_current_namespace(None)


def _read_all(b: ChangelogKeyedStateBackend, keys: list[str]) -> dict[tuple[str, str, Any], Any]:
    st = {n: b.get_state(d) for n, d in _descs().items()}
    out: dict[tuple[str, str, Any], Any] = {}
    for k in keys:
        if key_group_for(k.encode(), MP) not in b.key_groups:
            continue
        b.set_current_key(k)
        for ns in (None, "w1"):
            b.set_current_namespace(ns)
            for name, s in st.items():
                if name == "v":
                    v = s.value()
                elif name == "l":
                    v = s.get() or None
                elif name == "m":
                    v = s.items() or None
                else:
                    v = s.get()
                if v is not None:
                    out[(name, k, ns)] = v
    b.set_current_namespace(None)
    return out


def _in(model: dict[tuple[str, str, Any], Any], kgs: KeyGroupRange) -> dict[Any, Any]:
    return {k: v for k, v in model.items() if key_group_for(k[1].encode(), MP) in kgs}


def _checkpoint(b: ChangelogKeyedStateBackend, cp: int) -> ChangelogStateBackendHandle:
    h = b.snapshot(cp).result(WAIT)
    b.notify_checkpoint_complete(cp)
    return h


@pytest.mark.parametrize("src,dst", [("heap", "heap"), ("lmdb", "lmdb"), ("heap", "lmdb"),
                                     ("lmdb", "heap")])
def test_round_trip_every_state_kind(storage: ChangelogStorage, src: str, dst: str) -> None:
    rng = random.Random(7)
    print(f"seed=7 src={src} dst={dst}")
    model: dict[tuple[str, str, Any], Any] = {}
    b = ChangelogKeyedStateBackend(storage, "op", KeyGroupRange(0, MP - 1), MP, table=src,
                                   options=OPTS)
    _workload(b, rng, 600, KEYS, model)
    _checkpoint(b, 1)
    assert b.materialize_now(WAIT) is not None  # snapshot + a log tail after it
    _workload(b, rng, 400, KEYS, model)
    h = _checkpoint(b, 2)
    assert h.materialized and h.non_materialized
    assert _read_all(b, KEYS) == model
    b.close()
    stats = RestoreStats()
    r = restore_backend([h.to_json()], storage, KeyGroupRange(0, MP - 1), table=dst, stats=stats)
    assert _read_all(r, KEYS) == model
    assert stats["entries"] > 0 and stats["changes"] > 0
    # the restored backend continues: its next checkpoint still names the restored parts
    _workload(r, rng, 100, KEYS, model)
    h2 = _checkpoint(r, 3)
    assert h2.materialized == h.materialized
    assert h2.non_materialized[:len(h.non_materialized)] == h.non_materialized
    r.close()
    again = restore_backend([h2], storage, KeyGroupRange(0, MP - 1), table=src)
    assert _read_all(again, KEYS) == model
    again.close()


@pytest.mark.parametrize("old,new", [(1, 2), (2, 1), (4, 3), (8, 2)])
def test_rescale(storage: ChangelogStorage, old: int, new: int) -> None:
    rng = random.Random(old * 10 + new)
    print(f"seed={old * 10 + new}")
    model: dict[tuple[str, str, Any], Any] = {}
    olds = [ChangelogKeyedStateBackend(storage, f"op/{i}", KeyGroupRange.of_operator(MP, old, i),
                                       MP, table="heap" if i % 2 else "lmdb", options=OPTS)
            for i in range(old)]
    for i, b in enumerate(olds):
        mine = [k for k in KEYS if key_group_for(k.encode(), MP) in b.key_groups]
        # register states in a different order per backend: ids differ, restore maps by name
        if i % 2:
            b.get_state(_descs()["m"])
        _workload(b, rng, 300, mine, model)
        _checkpoint(b, 1)
        b.materialize_now(WAIT)
        _workload(b, rng, 200, mine, model)
    handles = [_checkpoint(b, 2) for b in olds]
    for b in olds:
        b.close()
    for j in range(new):
        kgs = KeyGroupRange.of_operator(MP, new, j)
        r = restore_backend(handles, storage, kgs, table="heap" if j % 2 else "lmdb",
                            operator_id=f"op/{j}")
        assert _read_all(r, KEYS) == _in(model, kgs), f"new backend {j} of {new}"
        r.close()


def test_missing_object_names_object_and_checkpoint(storage: ChangelogStorage) -> None:
    b = ChangelogKeyedStateBackend(storage, "op", KeyGroupRange(0, MP - 1), MP, options=OPTS)
    _workload(b, random.Random(1), 50, KEYS, {})
    h = _checkpoint(b, 41)
    b.close()
    seg = h.non_materialized[0].segment_keys()[0]
    storage.store.delete([seg])
    with pytest.raises(ObjectNotFoundError, match=rf"{seg}.*checkpoint 41"):
        restore_backend([h], storage, KeyGroupRange(0, MP - 1))


@pytest.mark.parametrize("what", ["segment", "snapshot"])
def test_corrupt_object_names_object_offset_and_checkpoint(storage: ChangelogStorage,
                                                           what: str) -> None:
    b = ChangelogKeyedStateBackend(storage, "op", KeyGroupRange(0, MP - 1), MP, options=OPTS)
    _workload(b, random.Random(2), 200, KEYS, {})
    _checkpoint(b, 1)
    b.materialize_now(WAIT)
    _workload(b, random.Random(3), 50, KEYS, {})
    h = _checkpoint(b, 42)
    b.close()
    key = h.materialized[0].key if what == "snapshot" else h.non_materialized[0].segment_keys()[0]
    store = storage.store
    data = bytearray(store.get(key))
    data[len(data) // 3] ^= 0x40
    store.delete([key])
    store.put(key, bytes(data))
    with pytest.raises(CorruptObjectError, match=r"checkpoint 42") as info:
        restore_backend([h], storage, KeyGroupRange(0, MP - 1))
    assert info.value.key == key and info.value.offset >= 0
