"""Spark's state method names (``transformWithState``) on DSTL's states, against a model and
against the PyFlink names, heap and LMDB.

A random sequence of Spark-named calls over a few keys runs on one backend and the same
sequence in PyFlink names on another; after every call both answer every read (in both
names) like a plain-dict model. Both are then restored from their checkpoint (log only, and
snapshot + log) and compared with the model again, so every Spark-named mutation is logged.
Also: ``exists`` per kind, the map iterator's entries as ``(key, value)`` pairs,
``delete_if_exists`` (every key and namespace, logged, reserved and bad names)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import UsageError
from dstl.spark.processor import StatefulProcessorHandle
from dstl.stores import MemoryBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.options import BackendOptions
from materializer.states import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapEntry,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from materializer.timers import TIMER_INDEX_STATE
from restore import restore_backend

MP = 16
ALL = KeyGroupRange(0, MP - 1)
NO_TIMER = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
WAIT = 10.0
KEYS = ["a", "b", "c", "d"]


@pytest.fixture(params=["heap", "lmdb"])
def table(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def storage() -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(store=MemoryBlobStore(), options=DstlOptions(persist_delay_s=0.0))
    yield s
    s.close()


def _backend(storage: ChangelogStorage, table: str, op: str, tmp: Path
             ) -> ChangelogKeyedStateBackend:
    return ChangelogKeyedStateBackend(storage, op, ALL, MP, table=table, options=NO_TIMER,
                                      local_directory=str(tmp / op.replace("/", "_")))


def _states(b: ChangelogKeyedStateBackend) -> tuple[Any, Any, Any]:
    return (b.get_state(ValueStateDescriptor("v")), b.get_state(ListStateDescriptor("l")),
            b.get_state(MapStateDescriptor("m")))


class Model:
    """The expected state: per key a value (absent: missing), a list, a dict."""

    def __init__(self) -> None:
        self.v: dict[str, Any] = {}
        self.l: dict[str, list[Any]] = {}
        self.m: dict[str, dict[Any, Any]] = {}


def _value_for(rng: random.Random) -> Any:
    return rng.choice([rng.randrange(100), f"s{rng.randrange(9)}", [rng.randrange(5)],
                       {"n": rng.randrange(5)}, 0, ""])


def _step(rng: random.Random, key: str, model: Model, spark: tuple[Any, Any, Any],
          flink: tuple[Any, Any, Any], spark_b: ChangelogKeyedStateBackend,
          flink_b: ChangelogKeyedStateBackend) -> str:
    """One random mutation, in Spark's names on ``spark`` and PyFlink's on ``flink``."""
    (sv, sl, sm), (fv, fl, fm) = spark, flink
    op = rng.randrange(11)
    x = _value_for(rng)
    mk = rng.choice(["k1", "k2", 3])
    if op == 0:
        sv.update(x), fv.update(x)
        model.v[key] = x
    elif op == 1:
        sv.clear(), fv.clear()
        model.v.pop(key, None)
    elif op == 2:
        new = [_value_for(rng) for _ in range(rng.randrange(3))]  # [] clears, as in Spark
        sl.put(new), fl.update(new)
        model.l[key] = list(new)
    elif op == 3:
        sl.append_value(x), fl.add(x)
        model.l.setdefault(key, []).append(x)
    elif op == 4:
        more = [_value_for(rng) for _ in range(rng.randrange(3))]
        sl.append_list(more), fl.add_all(more)
        model.l.setdefault(key, []).extend(more)
    elif op == 5:
        sl.clear(), fl.clear()
        model.l.pop(key, None)
    elif op == 6:
        sm.update_value(mk, x), fm.put(mk, x)
        model.m.setdefault(key, {})[mk] = x
    elif op == 7:
        sm.remove_key(mk), fm.remove(mk)
        model.m.get(key, {}).pop(mk, None)
    elif op == 8:
        sm.clear(), fm.clear()
        model.m.pop(key, None)
    elif op == 9:  # set_value/remove through the iterator (logged), unpacking as Spark does
        for (s_entry, f_entry) in zip(sm.iterator(), fm.iterator()):
            k, _v = s_entry
            assert k == f_entry.key
            s_entry.set_value(x), f_entry.set_value(x)
            model.m[key][k] = x
            break
    else:  # delete one state for every key of the backend
        name = rng.choice(["v", "l", "m"])
        spark_b.delete_state_entries(name), flink_b.delete_state_entries(name)
        getattr(model, name).clear()
    return f"op {op}"


def _check_key(key: str, model: Model, states: tuple[Any, Any, Any], where: str) -> None:
    v, lst, m = states
    want_v = model.v.get(key)
    assert v.get() == want_v and v.value() == want_v, where
    assert v.exists() is (key in model.v), where
    want_l = model.l.get(key, [])
    assert list(lst.get()) == want_l, where
    assert lst.exists() is bool(want_l), where
    want_m = model.m.get(key, {})
    assert dict(m.items()) == want_m, where
    assert sorted(map(repr, m.keys())) == sorted(map(repr, want_m)), where
    assert sorted(map(repr, m.values())) == sorted(map(repr, want_m.values())), where
    assert sorted(map(repr, [tuple(e) for e in m.iterator()])) == \
        sorted(map(repr, want_m.items())), where
    assert m.exists() is bool(want_m) and m.is_empty() is not bool(want_m), where
    for mk in ("k1", "k2", 3, "never"):
        assert m.get_value(mk) == want_m.get(mk) == m.get(mk), where
        assert m.contains_key(mk) is (mk in want_m) is m.contains(mk), where


def _check_all(b: ChangelogKeyedStateBackend, model: Model, where: str) -> None:
    states = _states(b)
    for key in KEYS:
        b.set_current_key(key)
        _check_key(key, model, states, f"{where}, key {key}")


@pytest.mark.parametrize("materialize", [False, True], ids=["log", "snapshot+log"])
def test_spark_names_match_the_model_and_the_pyflink_names_and_restore(
        storage: ChangelogStorage, table: str, materialize: bool, tmp_path: Path) -> None:
    rng = random.Random(2026)
    sb, fb = (_backend(storage, table, op, tmp_path) for op in ("op/spark", "op/flink"))
    spark, flink = _states(sb), _states(fb)
    model = Model()
    for i in range(400):
        key = rng.choice(KEYS)
        sb.set_current_key(key)
        fb.set_current_key(key)
        what = _step(rng, key, model, spark, flink, sb, fb)
        _check_key(key, model, spark, f"spark names, step {i} ({what})")
        _check_key(key, model, flink, f"pyflink names, step {i} ({what})")
        if materialize and i == 200:
            for b in (sb, fb):
                b.snapshot(1).result(WAIT)
                b.notify_checkpoint_complete(1)
                assert b.materialize_now(WAIT) is not None
    _check_all(sb, model, "spark backend")
    handles = []
    for b in (sb, fb):
        handles.append(b.snapshot(2).result(WAIT))
        b.close()
    for h, name in zip(handles, ("spark", "flink")):
        r = restore_backend([h], storage, ALL, table=table, operator_id=f"op/r{name}",
                            local_directory=str(tmp_path / f"r{name}"))
        _check_all(r, model, f"restored {name}")
        r.close()


def test_exists_per_kind(storage: ChangelogStorage, table: str, tmp_path: Path) -> None:
    b = _backend(storage, table, "op/e", tmp_path)
    v, lst, m = _states(b)
    red = b.get_state(ReducingStateDescriptor("r", lambda a, c: a + c))

    class Sum:
        def create_accumulator(self) -> int:
            return 0

        def add(self, value: int, acc: int) -> int:
            return acc + value

        def get_result(self, acc: int) -> int:
            return acc

        def merge(self, a: int, c: int) -> int:
            return a + c

    agg = b.get_state(AggregatingStateDescriptor("g", Sum()))
    b.set_current_key("k")
    assert not any(s.exists() for s in (v, lst, m, red, agg))
    v.update(0), lst.append_value(None), m.update_value("x", None), red.add(0), agg.add(0)
    assert all(s.exists() for s in (v, lst, m, red, agg))  # falsy contents still exist
    assert v.get() == 0 and lst.get() == [None] and m.get_value("x") is None
    v.update(None)  # None clears (Flink); Spark's get then returns None too
    lst.put([])
    m.remove_key("x")
    m.remove_key("absent")  # nothing happens
    assert not v.exists() and not lst.exists() and not m.exists()
    assert v.get() is None and lst.get() == [] and m.get_value("x") is None
    b.set_current_key("other")
    assert not red.exists() and red.get() is None
    b.close()


def test_map_entries_are_spark_pairs(storage: ChangelogStorage, table: str,
                                     tmp_path: Path) -> None:
    b = _backend(storage, table, "op/p", tmp_path)
    _, _, m = _states(b)
    b.set_current_key("k")
    m.update_value("a", 1)
    m.update_value("b", [2])
    entries = sorted(m.iterator(), key=lambda e: e[0])
    assert entries == [("a", 1), ("b", [2])] and entries[0] != ("a", 2)
    assert [len(e) for e in entries] == [2, 2] and entries[1][1] == [2]
    assert dict(m.iterator()) == {"a": 1, "b": [2]}  # dict() of pairs, as with Spark's
    assert isinstance(entries[0], MapEntry) and repr(entries[0]) == "MapEntry('a', 1)"
    with pytest.raises(TypeError):
        hash(entries[0])
    it = m.iterator()
    first = next(it)
    it.remove()
    assert not m.contains_key(first.key) and len(m.keys()) == 1
    b.close()


def test_delete_if_exists_removes_every_key_and_namespace_and_is_logged(
        storage: ChangelogStorage, table: str, tmp_path: Path) -> None:
    b = _backend(storage, table, "op/d", tmp_path)
    handle = StatefulProcessorHandle(b)
    v = handle.get_value_state("v")
    lst = handle.get_list_state("l")
    keys = [f"k{i}" for i in range(40)]  # spread over the key groups
    for k in keys:
        b.set_current_key(k)
        for ns in (None, "w1"):
            b.set_current_namespace(ns)
            v.update(k)
            lst.append_value(k)
    b.set_current_namespace(None)
    handle.delete_if_exists("v")
    handle.delete_if_exists("never-used")  # no such state: nothing happens
    handle.delete_if_exists("v")  # twice: nothing left to delete
    for k in keys:
        b.set_current_key(k)
        for ns in (None, "w1"):
            b.set_current_namespace(ns)
            assert not v.exists() and lst.get() == [k], (k, ns)
    b.set_current_key(keys[0])
    b.set_current_namespace(None)
    v.update("again")  # the state object stays usable
    h = b.snapshot(1).result(WAIT)
    b.close()
    r = restore_backend([h], storage, ALL, table=table, operator_id="op/dr",
                        local_directory=str(tmp_path / "dr"))
    rv, rl = r.get_state(ValueStateDescriptor("v")), r.get_state(ListStateDescriptor("l"))
    for k in keys:
        r.set_current_key(k)
        for ns in (None, "w1"):
            r.set_current_namespace(ns)
            want = "again" if (k, ns) == (keys[0], None) else None
            assert rv.get() == want and rl.get() == [k], (k, ns)
    r.close()


def test_delete_if_exists_bad_names(storage: ChangelogStorage, tmp_path: Path) -> None:
    b = _backend(storage, "heap", "op/bad", tmp_path)
    handle = StatefulProcessorHandle(b, time_mode="processing_time")
    with pytest.raises(UsageError, match="reserved"):
        handle.delete_if_exists("$timers")
    with pytest.raises(UsageError, match="must be a str"):
        handle.delete_if_exists(3)  # type: ignore[arg-type]
    b.register_raw_state(TIMER_INDEX_STATE)
    with pytest.raises(UsageError, match="internal index"):
        b.delete_state_entries(TIMER_INDEX_STATE)
    b.close()
