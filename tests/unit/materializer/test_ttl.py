"""State TTL (capability 4) against a dict model, heap and LMDB.

Random writes in Spark's and PyFlink's names to value, list and map states with a TTL run in
"batches" whose clock moves forward (and sometimes backwards); each batch first purges, as the
Spark task does. After every call each read answers like the model (an expired value is
invisible at once), and after every purge the table holds exactly the model's live values (the
purge is complete: nothing expired is left). The backend is then restored from its log only,
from a snapshot plus log, and rescaled into two backends, and each equals the model — table
included — so the purge is logged. Also: list elements and map entries expire one by one, an
update refreshes, ``ttl_s`` is checked (typed errors), a state cannot switch its TTL on or off
across a restore, and a changed ``ttl_s`` applies to later writes only."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import ConfigError, ConfigTypeError, KeyGroupError, StateError, UsageError
from dstl.spark.processor import StatefulProcessorHandle
from dstl.stores import MemoryBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.options import BackendOptions
from materializer.states import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from materializer.ttl import TTL_INDEX_STATE
from restore import restore_backend

MP = 16
ALL = KeyGroupRange(0, MP - 1)
NO_TIMER = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
WAIT = 10.0
KEYS = ["a", "b", "c", "d", "e", "f"]
TTL_S = 1.0  # 1000 ms


@pytest.fixture(params=["heap", "lmdb"])
def table(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def storage() -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(store=MemoryBlobStore(), options=DstlOptions(persist_delay_s=0.0))
    yield s
    s.close()


def _backend(storage: ChangelogStorage, table: str, op: str, tmp: Path,
             key_groups: KeyGroupRange = ALL, options: BackendOptions = NO_TIMER
             ) -> ChangelogKeyedStateBackend:
    return ChangelogKeyedStateBackend(storage, op, key_groups, MP, table=table, options=options,
                                      local_directory=str(tmp / op.replace("/", "_")))


def _states(b: ChangelogKeyedStateBackend, ttl_s: float = TTL_S) -> tuple[Any, Any, Any]:
    return (b.get_state(ValueStateDescriptor("v", ttl_s=ttl_s)),
            b.get_state(ListStateDescriptor("l", ttl_s=ttl_s)),
            b.get_state(MapStateDescriptor("m", ttl_s=ttl_s)))


class Model:
    """Per key: the value with its expiry, the list of (element, expiry), the map of
    key -> (value, expiry)."""

    def __init__(self) -> None:
        self.v: dict[str, tuple[Any, int]] = {}
        self.l: dict[str, list[tuple[Any, int]]] = {}
        self.m: dict[str, dict[Any, tuple[Any, int]]] = {}

    def purge(self, now: int) -> None:
        self.v = {k: p for k, p in self.v.items() if p[1] > now}
        self.l = {k: kept for k, lst in self.l.items() if (kept := [p for p in lst if p[1] > now])}
        self.m = {k: kept for k, d in self.m.items()
                  if (kept := {mk: p for mk, p in d.items() if p[1] > now})}

    def live(self, key: str, now: int) -> tuple[Any, list[Any], dict[Any, Any]]:
        v = self.v.get(key)
        return (v[0] if v is not None and v[1] > now else None,
                [x for x, e in self.l.get(key, []) if e > now],
                {mk: x for mk, (x, e) in self.m.get(key, {}).items() if e > now})

    def stored(self) -> dict[str, int]:
        """How many table entries each state holds (purged: only live ones)."""
        return {"v": len(self.v), "l": len(self.l), "m": len(self.m)}


def _value(rng: random.Random) -> Any:
    return rng.choice([rng.randrange(100), f"s{rng.randrange(9)}", [rng.randrange(5)],
                       {"n": rng.randrange(5)}, 0, ""])


def _step(rng: random.Random, key: str, now: int, model: Model, states: tuple[Any, Any, Any],
          b: ChangelogKeyedStateBackend) -> str:
    """One random mutation (Spark's or PyFlink's name, at random) at time ``now``."""
    v, lst, m = states
    exp = now + int(TTL_S * 1000)
    op = rng.randrange(10)
    x = _value(rng)
    mk = rng.choice(["k1", "k2", "k3", 4])
    spark = rng.random() < 0.5
    if op == 0:
        v.update(x)
        model.v[key] = (x, exp)
    elif op == 1:
        v.clear()
        model.v.pop(key, None)
    elif op == 2:
        new = [_value(rng) for _ in range(rng.randrange(3))]
        (lst.put if spark else lst.update)(new)
        if new:
            model.l[key] = [(e, exp) for e in new]
        else:
            model.l.pop(key, None)
    elif op == 3:
        (lst.append_value if spark else lst.add)(x)
        model.l.setdefault(key, []).append((x, exp))
    elif op == 4:
        more = [_value(rng) for _ in range(rng.randrange(3))]
        (lst.append_list if spark else lst.add_all)(more)
        if more:
            model.l.setdefault(key, []).extend((e, exp) for e in more)
    elif op == 5:
        (m.update_value if spark else m.put)(mk, x)
        model.m.setdefault(key, {})[mk] = (x, exp)
    elif op == 6:
        (m.remove_key if spark else m.remove)(mk)
        d = model.m.get(key, {})
        d.pop(mk, None)
        if not d:
            model.m.pop(key, None)
    elif op == 7:
        more = {rng.choice(["k1", "k2", "k5"]): _value(rng) for _ in range(rng.randrange(1, 3))}
        m.put_all(more)
        model.m.setdefault(key, {}).update((k, (val, exp)) for k, val in more.items())
    elif op == 8:  # set_value through the iterator (a live entry is refreshed)
        for entry in m.iterator():
            k, _ = entry
            entry.set_value(x)
            model.m[key][k] = (x, exp)
            break
    else:
        m.clear()
        model.m.pop(key, None)
    return f"op {op} ({'spark' if spark else 'pyflink'} names)"


def _check_key(key: str, now: int, model: Model, states: tuple[Any, Any, Any],
               where: str) -> None:
    v, lst, m = states
    want_v, want_l, want_m = model.live(key, now)
    assert v.get() == want_v and v.value() == want_v, where
    assert v.exists() is (want_v is not None), where
    assert list(lst.get()) == want_l, where
    assert lst.exists() is bool(want_l), where
    assert dict(m.items()) == want_m, where
    assert sorted(map(repr, m.keys())) == sorted(map(repr, want_m)), where
    assert sorted(map(repr, m.values())) == sorted(map(repr, want_m.values())), where
    assert sorted(map(repr, [tuple(e) for e in m.iterator()])) == \
        sorted(map(repr, want_m.items())), where
    assert m.exists() is bool(want_m) and m.is_empty() is not bool(want_m), where
    for mk in ("k1", "k2", "k3", 4, "k5"):
        assert m.get_value(mk) == want_m.get(mk) == m.get(mk), where
        assert m.contains_key(mk) is (mk in want_m) is m.contains(mk), where


def _sid(b: ChangelogKeyedStateBackend, name: str) -> int:
    """The id of state ``name`` in ``b`` (its recorded metadata)."""
    return next(sid for sid, m in b.state_metadata().items() if m["name"] == name)


def _stored(b: ChangelogKeyedStateBackend) -> dict[str, int]:
    """Table entries per state (all key groups)."""
    out = {}
    for name in ("v", "l", "m"):
        sid = _sid(b, name)
        out[name] = sum(1 for kg in range(b.key_groups.start, b.key_groups.end + 1)
                        for _ in b.tables.entries(sid, kg))
    return out


def _check_all(backends: list[ChangelogKeyedStateBackend], now: int, model: Model,
               where: str, *, purged: bool) -> None:
    """Every key reads like the model in the backend that owns it; with ``purged``, the tables
    hold exactly the model's entries."""
    for b in backends:
        b.set_ttl_time(now)
    states = [_states(b) for b in backends]
    for key in KEYS:
        owner = [i for i, b in enumerate(backends) if _owns(b, key)]
        assert len(owner) == 1
        b = backends[owner[0]]
        b.set_current_key(key)
        _check_key(key, now, model, states[owner[0]], f"{where}, key {key}")
    if purged:
        total = {"v": 0, "l": 0, "m": 0}
        for b in backends:
            for name, n in _stored(b).items():
                total[name] += n
        assert total == model.stored(), where


def _owns(b: ChangelogKeyedStateBackend, key: str) -> bool:
    try:
        b.set_current_key(key)
    except KeyGroupError:  # another backend's key
        return False
    return True


def _batch(b: ChangelogKeyedStateBackend, model: Model, now: int) -> int:
    b.set_ttl_time(now)
    n = b.purge_expired()
    model.purge(now)
    return n


@pytest.mark.parametrize("materialize", [None, "file", "entries"],
                         ids=["log", "snapshot+log", "v1-snapshot+log"])
def test_ttl_matches_the_model_across_restores_and_a_rescale(
        storage: ChangelogStorage, table: str, materialize: str | None, tmp_path: Path) -> None:
    """``file``: LMDB's file-level (v2) snapshots; ``entries``: v1 (the heap writes v1 in
    both)."""
    rng = random.Random(1515)
    opts = NO_TIMER if materialize is None else BackendOptions(
        materialization_interval_s=None, materialize_log_ratio=None,
        lmdb_snapshot_format=materialize)
    b = _backend(storage, table, "op/ttl", tmp_path, options=opts)
    b.set_ttl_time(0)
    states = _states(b)
    model = Model()
    now = 10_000
    purged = 0
    for batch in range(60):
        # mostly forward by up to 1.5 TTLs; sometimes backwards (a clock that jumps back)
        now += rng.randrange(-600, 1_500) if batch % 7 else -rng.randrange(0, 900)
        purged += _batch(b, model, now)
        _check_all([b], now, model, f"batch {batch} after the purge", purged=True)
        for i in range(rng.randrange(0, 12)):
            key = rng.choice(KEYS)
            b.set_current_key(key)
            what = _step(rng, key, now, model, states, b)
            _check_key(key, now, model, states, f"batch {batch} step {i} ({what})")
        if materialize is not None and batch == 30:
            b.snapshot(1).result(WAIT)
            b.notify_checkpoint_complete(1)
            assert b.materialize_now(WAIT) is not None
    assert purged > 50, "the scenario purges"
    # later clock: some values are expired but not purged yet (invisible, still stored)
    later = now + 700
    _check_all([b], later, model, "expired, not yet purged", purged=False)
    handle = b.snapshot(2).result(WAIT)
    b.close()
    r = restore_backend([handle], storage, ALL, table=table, operator_id="op/r",
                        local_directory=str(tmp_path / "r"))
    _check_all([r], now, model, "restored", purged=True)
    assert r.purge_expired(later) > 0
    model_later = Model()
    model_later.v, model_later.l, model_later.m = dict(model.v), dict(model.l), dict(model.m)
    model_later.purge(later)
    _check_all([r], later, model_later, "restored, then purged", purged=True)
    r.close()
    halves = [KeyGroupRange(0, 6), KeyGroupRange(7, MP - 1)]
    parts = [restore_backend([handle], storage, kg, table=table, operator_id=f"op/p{i}",
                             local_directory=str(tmp_path / f"p{i}"))
             for i, kg in enumerate(halves)]
    _check_all(parts, now, model, "rescaled", purged=True)
    for p in parts:
        p.purge_expired(later)
    _check_all(parts, later, model_later, "rescaled, then purged", purged=True)
    for p in parts:
        p.close()


def test_elements_and_entries_expire_one_by_one_and_updates_refresh(
        storage: ChangelogStorage, table: str, tmp_path: Path) -> None:
    b = _backend(storage, table, "op/one", tmp_path)
    v, lst, m = _states(b, ttl_s=10.0)
    b.set_current_key("k")
    b.set_ttl_time(1_000)
    v.update("x")
    lst.append_value("e1")
    m.update_value("a", 1)
    b.set_ttl_time(5_000)
    lst.append_value("e2")
    m.update_value("b", 2)
    b.set_ttl_time(9_000)
    v.update("y")  # refreshed: expires at 19,000
    m.update_value("a", 11)  # refreshed: expires at 19,000
    b.set_ttl_time(11_000)  # e1 (11,000) expired at once, unpurged
    assert lst.get() == ["e2"] and v.get() == "y" and dict(m.items()) == {"a": 11, "b": 2}
    assert b.purge_expired() == 1
    b.set_ttl_time(15_000)  # e2 and b expired
    assert lst.get() == [] and not lst.exists() and m.keys() == ["a"]
    assert b.purge_expired() == 2
    b.set_ttl_time(19_000)
    assert v.get() is None and not v.exists() and not m.exists() and m.get_value("a") is None
    assert b.purge_expired() == 2
    assert b.tables.stats()["entries"] == 0 or all(
        not list(b.tables.entries(_sid(b, n), kg))
        for n in ("v", "l", "m") for kg in range(MP))
    b.close()


@pytest.mark.parametrize("bad,error", [
    (0, ConfigError), (0.0, ConfigError), (-1, ConfigError), (math.nan, ConfigError),
    (math.inf, ConfigError), (1e11, ConfigError), (True, ConfigTypeError),
    ("60", ConfigTypeError), ([1], ConfigTypeError)])
def test_bad_ttl_s_is_a_typed_error(bad: Any, error: type) -> None:
    for make in (lambda: ValueStateDescriptor("v", ttl_s=bad),
                 lambda: ListStateDescriptor("l", ttl_s=bad),
                 lambda: MapStateDescriptor("m", ttl_s=bad)):
        with pytest.raises(error, match="ttl_s"):
            make()


def test_ttl_is_keyword_only_and_checked_through_the_handle(storage: ChangelogStorage,
                                                           tmp_path: Path) -> None:
    """(Reducing and aggregating states: tests/unit/materializer/test_ttl_folding.py.)"""
    assert ReducingStateDescriptor("r", lambda a, c: a + c).ttl_s is None
    assert ReducingStateDescriptor("r", lambda a, c: a + c, ttl_s=5).ttl_s == 5
    assert ValueStateDescriptor("v", ttl_s=1e10).ttl_s == 1e10  # the largest
    with pytest.raises(TypeError):
        ReducingStateDescriptor("r", lambda a, c: a + c, None, 5)  # type: ignore[misc]
    assert AggregatingStateDescriptor.__init__.__code__.co_varnames[:4] == \
        ("self", "name", "agg", "serializer")
    code = AggregatingStateDescriptor.__init__.__code__
    assert code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount] == \
        ("ttl_s", "schema")
    b = _backend(storage, "heap", "op/h", tmp_path)
    h = StatefulProcessorHandle(b)
    with pytest.raises(ConfigError, match="ttl_s"):
        h.get_value_state("v", ttl_s=0)
    with pytest.raises(ConfigError, match="ttl_duration_ms"):
        h.get_list_state("l", ttl_duration_ms=-5)
    with pytest.raises(UsageError, match="both"):
        h.get_map_state("m", ttl_s=1, ttl_duration_ms=1000)
    s = h.get_map_state("m", ttl_duration_ms=1500)
    b.set_ttl_time(0)
    b.set_current_key("k")
    s.update_value("x", 1)
    b.set_ttl_time(1_499)
    assert s.get_value("x") == 1
    b.set_ttl_time(1_500)
    assert s.get_value("x") is None
    b.close()


def _restart(storage: ChangelogStorage, table: str, b: ChangelogKeyedStateBackend, cp: int,
             tmp_path: Path, name: str) -> ChangelogKeyedStateBackend:
    h = b.snapshot(cp).result(WAIT)
    b.close()
    return restore_backend([h], storage, ALL, table=table, operator_id=f"op/{name}",
                           local_directory=str(tmp_path / name))


def test_a_state_cannot_switch_its_ttl_on_or_off(storage: ChangelogStorage, table: str,
                                                 tmp_path: Path) -> None:
    b = _backend(storage, table, "op/plain", tmp_path)
    b.set_ttl_time(0)
    b.set_current_key("k")
    b.get_state(ValueStateDescriptor("v")).update("written without TTL")
    b.get_state(MapStateDescriptor("m", ttl_s=5)).update_value("a", 1)
    with pytest.raises(UsageError, match="without a TTL"):
        b.get_state(ValueStateDescriptor("v", ttl_s=5))
    r = _restart(storage, table, b, 1, tmp_path, "r1")
    with pytest.raises(StateError, match=r"'v' was written without a TTL.*new state name"):
        r.get_state(ValueStateDescriptor("v", ttl_s=5))
    with pytest.raises(StateError, match="'m' was written with a TTL"):
        r.get_state(MapStateDescriptor("m"))
    # opened as written, the values are there
    r.set_current_key("k")
    assert r.get_state(ValueStateDescriptor("v")).get() == "written without TTL"
    m = r.get_state(MapStateDescriptor("m", ttl_s=5))
    r.set_ttl_time(4_999)
    assert m.get_value("a") == 1
    r.set_ttl_time(5_000)
    assert m.get_value("a") is None  # expired
    r.close()


def test_a_changed_ttl_applies_to_later_writes(storage: ChangelogStorage, table: str,
                                               tmp_path: Path) -> None:
    b = _backend(storage, table, "op/change", tmp_path)
    b.set_ttl_time(0)
    b.set_current_key("k")
    b.get_state(ListStateDescriptor("l", ttl_s=100)).add("old")  # expires at 100,000
    r = _restart(storage, table, b, 1, tmp_path, "r2")
    r.set_ttl_time(1_000)
    lst = r.get_state(ListStateDescriptor("l", ttl_s=2))  # 2 s from now on
    r.set_current_key("k")
    lst.add("new")  # expires at 3,000 (earlier than "old": indexed on its own)
    r.set_ttl_time(3_000)
    assert r.purge_expired() == 1
    assert lst.get() == ["old"]
    r.set_ttl_time(100_000)
    assert r.purge_expired() == 1 and not lst.exists()
    r.close()


def test_the_expiry_index_is_internal_and_no_state_scan_happens(
        storage: ChangelogStorage, table: str, tmp_path: Path) -> None:
    b = _backend(storage, table, "op/idx", tmp_path)
    h = StatefulProcessorHandle(b)
    with pytest.raises(UsageError, match="reserved"):
        h.get_value_state(TTL_INDEX_STATE)
    v = h.get_value_state("v", ttl_s=1)
    b.set_ttl_time(0)
    for i in range(200):
        b.set_current_key(f"k{i}")
        v.update(i)
        v.update(i + 1)  # a refresh at the same time adds no index entry
    idx = _sid(b, TTL_INDEX_STATE)
    assert sum(1 for kg in range(MP) for _ in b.tables.entries(idx, kg)) == 200
    b.set_ttl_time(500)
    for i in range(100):  # refreshed: their entries come due at 1,000 and re-index at 1,500
        b.set_current_key(f"k{i}")
        v.update(i)
    assert b.purge_expired(999) == 0
    assert b.purge_expired(1_000) == 100
    assert sum(1 for kg in range(MP) for _ in b.tables.entries(idx, kg)) == 100
    assert b.purge_expired(1_500) == 100
    assert sum(1 for kg in range(MP) for _ in b.tables.entries(idx, kg)) == 0
    b.close()


def test_namespaces_expire_and_purge_on_their_own(storage: ChangelogStorage, table: str,
                                                  tmp_path: Path) -> None:
    b = _backend(storage, table, "op/ns", tmp_path)
    v = b.get_state(ValueStateDescriptor("v", ttl_s=1))
    lst = b.get_state(ListStateDescriptor("l", ttl_s=1))
    b.set_current_key("k")
    for ns, t in (("w1", 0), ("w2", 500)):
        b.set_ttl_time(t)
        b.set_current_namespace(ns)
        v.update(ns)
        lst.add(ns)
    with pytest.raises(UsageError, match="namespace merges"):
        lst.merge_namespaces("w1", ["w2"])
    b.set_current_namespace("w2")
    assert b.purge_expired(1_000) == 2  # w1's value and element
    assert b.get_current_key() == "k" and b.current_namespace == "w2"  # the cursor is kept
    assert v.get() == "w2" and lst.get() == ["w2"]
    r = _restart(storage, table, b, 1, tmp_path, "rns")
    v, lst = (r.get_state(ValueStateDescriptor("v", ttl_s=1)),
              r.get_state(ListStateDescriptor("l", ttl_s=1)))
    r.set_ttl_time(1_000)
    r.set_current_key("k")
    r.set_current_namespace("w1")
    assert v.get() is None and lst.get() == [] and not v.exists()
    r.set_current_namespace("w2")
    assert v.get() == "w2" and lst.get() == ["w2"]
    assert r.purge_expired(1_500) == 2 and not v.exists() and not lst.exists()
    r.close()
