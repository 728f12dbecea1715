"""State TTL on reducing and aggregating states against a dict model, heap and LMDB.

Random ``add`` calls to a reducing state (a sum) and an aggregating state (an average whose
accumulator the function mutates in place) with a TTL run in "batches" whose clock moves forward
and sometimes back; most batches purge first, as the Spark task does (the others let adds meet
expired, unpurged values). After every call each read
answers like the model: an expired folded value is invisible at once, and an ``add`` to it folds
from nothing. After every purge the table holds exactly the model's live values; a restore from
the log, from a snapshot plus log and a rescale into two backends equal the model, table
included, so the purge is logged. Also: typed errors for a bad TTL, Spark's
``ttl_duration_ms``, a state cannot switch its TTL on or off across a restore, namespace merges
of TTL states are refused."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import test_ttl
from test_ttl import ALL, MP, NO_TIMER, _backend

from dstl import ChangelogStorage, KeyGroupRange
from dstl.errors import ConfigError, ConfigTypeError, KeyGroupError, StateError, UsageError
from dstl.spark.processor import StatefulProcessorHandle
from materializer.backend import ChangelogKeyedStateBackend
from materializer.options import BackendOptions
from materializer.states import AggregatingStateDescriptor, ReducingStateDescriptor
from restore import restore_backend

# the fixtures of test_ttl (bound by assignment, so that test parameters do not shadow an import)
storage = test_ttl.storage
table = test_ttl.table

WAIT = 10.0
KEYS = ["a", "b", "c", "d", "e", "f", "g"]
TTL_MS = 1000


class Mean:
    """An average; ``add`` mutates the accumulator it is given (a heap table must hand it a
    copy, never its own object)."""

    def create_accumulator(self) -> list[int]:
        return [0, 0]

    def add(self, value: int, acc: list[int]) -> list[int]:
        acc[0] += value
        acc[1] += 1
        return acc

    def get_result(self, acc: list[int]) -> float:
        return acc[0] / acc[1]

    def merge(self, a: list[int], b: list[int]) -> list[int]:
        return [a[0] + b[0], a[1] + b[1]]


def _add(a: int, b: int) -> int:
    return a + b


def _states(b: ChangelogKeyedStateBackend, ttl_s: float = TTL_MS / 1000) -> tuple[Any, Any]:
    return (b.get_state(ReducingStateDescriptor("r", _add, ttl_s=ttl_s)),
            b.get_state(AggregatingStateDescriptor("g", Mean(), ttl_s=ttl_s)))


class Model:
    """Per state and key: the folded value (sum; [sum, count]) and its expiry."""

    def __init__(self) -> None:
        self.r: dict[Any, tuple[int, int]] = {}
        self.g: dict[Any, tuple[list[int], int]] = {}

    def add(self, key: Any, x: int, now: int) -> None:
        r, g = self.r.get(key), self.g.get(key)
        self.r[key] = (x if r is None or r[1] <= now else r[0] + x, now + TTL_MS)
        acc = [0, 0] if g is None or g[1] <= now else list(g[0])
        self.g[key] = ([acc[0] + x, acc[1] + 1], now + TTL_MS)

    def purge(self, now: int) -> None:
        self.r = {k: p for k, p in self.r.items() if p[1] > now}
        self.g = {k: p for k, p in self.g.items() if p[1] > now}

    def live(self, key: Any, now: int) -> tuple[int | None, float | None]:
        r, g = self.r.get(key), self.g.get(key)
        return (r[0] if r is not None and r[1] > now else None,
                g[0][0] / g[0][1] if g is not None and g[1] > now else None)

    def copy(self) -> Model:
        m = Model()
        m.r, m.g = dict(self.r), {k: (list(a), e) for k, (a, e) in self.g.items()}
        return m


def _owns(b: ChangelogKeyedStateBackend, key: Any) -> bool:
    try:
        b.set_current_key(key)
    except KeyGroupError:  # another backend's key
        return False
    return True


def _sid(b: ChangelogKeyedStateBackend, name: str) -> int:
    """The id of state ``name`` in ``b`` (its recorded metadata)."""
    return next(sid for sid, m in b.state_metadata().items() if m["name"] == name)


def _stored(b: ChangelogKeyedStateBackend) -> dict[str, int]:
    return {name: sum(1 for kg in range(b.key_groups.start, b.key_groups.end + 1)
                      for _ in b.tables.entries(_sid(b, name), kg))
            for name in ("r", "g")}


def _check(backends: list[ChangelogKeyedStateBackend], now: int, model: Model, where: str,
           *, purged: bool) -> None:
    for b in backends:
        b.set_ttl_time(now)
    states = [_states(b) for b in backends]
    for key in KEYS:
        owners = [i for i, b in enumerate(backends) if _owns(b, key)]
        assert len(owners) == 1
        backends[owners[0]].set_current_key(key)
        r, g = states[owners[0]]
        want_r, want_g = model.live(key, now)
        assert r.get() == want_r and g.get() == want_g, f"{where}, key {key}"
        assert r.exists() is (want_r is not None), f"{where}, key {key}"
        assert g.exists() is (want_g is not None), f"{where}, key {key}"
    if purged:
        total = {"r": 0, "g": 0}
        for b in backends:
            for name, n in _stored(b).items():
                total[name] += n
        assert total == {"r": len(model.r), "g": len(model.g)}, where


@pytest.mark.parametrize("materialize", [None, "file", "entries"],
                         ids=["log", "snapshot+log", "v1-snapshot+log"])
def test_folded_values_expire_like_the_model_across_restores_and_a_rescale(
        storage: ChangelogStorage, table: str, materialize: str | None, tmp_path: Path) -> None:
    rng = random.Random(1516)
    opts = NO_TIMER if materialize is None else BackendOptions(
        materialization_interval_s=None, materialize_log_ratio=None,
        lmdb_snapshot_format=materialize)
    b = _backend(storage, table, "op/fold", tmp_path, options=opts)
    b.set_ttl_time(0)
    r, g = _states(b)
    model = Model()
    now, purged = 10_000, 0
    for batch in range(60):
        now += rng.randrange(-600, 1_500) if batch % 7 else -rng.randrange(0, 900)
        b.set_ttl_time(now)
        if batch % 4 != 3:  # every 4th batch without a purge: adds meet expired values
            purged += b.purge_expired()
            model.purge(now)
        _check([b], now, model, f"batch {batch}", purged=batch % 4 != 3)
        for i in range(rng.randrange(0, 10)):
            key, x = rng.choice(KEYS), rng.randrange(-5, 50)
            b.set_current_key(key)
            if rng.random() < 0.1:
                r.clear()
                g.clear()
                model.r.pop(key, None)
                model.g.pop(key, None)
            else:
                r.add(x)
                g.add(x)
                model.add(key, x, now)
            assert (r.get(), g.get()) == model.live(key, now), f"batch {batch} step {i}"
        if materialize is not None and batch == 30:
            b.snapshot(1).result(WAIT)
            b.notify_checkpoint_complete(1)
            assert b.materialize_now(WAIT) is not None
    assert purged > 40, "the scenario purges"
    later = now + 700
    _check([b], later, model, "expired, not yet purged", purged=False)
    handle = b.snapshot(2).result(WAIT)
    b.close()
    model_later = model.copy()
    model_later.purge(later)
    rb = restore_backend([handle], storage, ALL, table=table, operator_id="op/r",
                         local_directory=str(tmp_path / "r"))
    _check([rb], now, model, "restored", purged=True)
    assert rb.purge_expired(later) > 0
    _check([rb], later, model_later, "restored, then purged", purged=True)
    rb.close()
    parts = [restore_backend([handle], storage, kg, table=table, operator_id=f"op/p{i}",
                             local_directory=str(tmp_path / f"p{i}"))
             for i, kg in enumerate([KeyGroupRange(0, 6), KeyGroupRange(7, MP - 1)])]
    _check(parts, now, model, "rescaled", purged=True)
    for p in parts:
        p.purge_expired(later)
    _check(parts, later, model_later, "rescaled, then purged", purged=True)
    for p in parts:
        p.close()


def test_an_add_refreshes_and_an_add_after_expiry_starts_over(
        storage: ChangelogStorage, table: str, tmp_path: Path) -> None:
    b = _backend(storage, table, "op/one", tmp_path)
    r, g = _states(b, ttl_s=10.0)
    b.set_current_key("k")
    b.set_ttl_time(1_000)
    r.add(5)
    g.add(4)
    b.set_ttl_time(9_000)
    r.add(1)  # refreshed: expires at 19,000
    assert r.get() == 6 and g.get() == 4.0
    b.set_ttl_time(11_000)  # g expired at once (unpurged), r alive
    assert g.get() is None and not g.exists() and r.get() == 6 and r.exists()
    g.add(10)  # starts from a new accumulator, not [4, 1]
    assert g.get() == 10.0
    b.set_ttl_time(19_000)
    assert r.get() is None and not r.exists()
    r.add(2)
    assert r.get() == 2
    b.set_ttl_time(29_000)
    assert b.purge_expired() == 2 and _stored(b) == {"r": 0, "g": 0}
    b.close()


def test_folded_ttl_through_the_handle_and_bad_ttls(storage: ChangelogStorage, table: str,
                                                    tmp_path: Path) -> None:
    for bad, error in ((0, ConfigError), (-1.0, ConfigError), (float("nan"), ConfigError),
                       ("60", ConfigTypeError), (True, ConfigTypeError)):
        with pytest.raises(error, match="ttl_s"):
            ReducingStateDescriptor("r", _add, ttl_s=bad)
        with pytest.raises(error, match="ttl_s"):
            AggregatingStateDescriptor("g", Mean(), ttl_s=bad)
    b = _backend(storage, table, "op/h", tmp_path)
    h = StatefulProcessorHandle(b)
    with pytest.raises(UsageError, match="both"):
        h.get_reducing_state("r", _add, ttl_s=1, ttl_duration_ms=1000)
    with pytest.raises(ConfigError, match="ttl_duration_ms"):
        h.get_aggregating_state("g", Mean(), ttl_duration_ms=0)
    r = h.get_reducing_state("r", _add, ttl_duration_ms=1500)
    g = h.get_aggregating_state("g", Mean(), ttl_s=1.5)
    b.set_ttl_time(0)
    b.set_current_key("k")
    r.add(3)
    g.add(3)
    b.set_ttl_time(1_499)
    assert r.get() == 3 and g.get() == 3.0
    b.set_ttl_time(1_500)
    assert r.get() is None and g.get() is None
    b.set_current_namespace("w1")
    r.add(1)
    with pytest.raises(UsageError, match="namespace merges"):
        r.merge_namespaces("w2", ["w1"])
    with pytest.raises(UsageError, match="namespace merges"):
        g.merge_namespaces("w2", ["w1"])
    b.close()


def test_a_folding_state_cannot_switch_its_ttl_on_or_off(
        storage: ChangelogStorage, table: str, tmp_path: Path) -> None:
    b = _backend(storage, table, "op/sw", tmp_path)
    b.set_ttl_time(0)
    b.set_current_key("k")
    b.get_state(ReducingStateDescriptor("r", _add)).add(1)  # no TTL
    b.get_state(AggregatingStateDescriptor("g", Mean(), ttl_s=5)).add(2)
    h = b.snapshot(1).result(WAIT)
    b.close()
    rb = restore_backend([h], storage, ALL, table=table, operator_id="op/sw2",
                         local_directory=str(tmp_path / "sw2"))
    with pytest.raises(StateError, match="'r' was written without a TTL"):
        rb.get_state(ReducingStateDescriptor("r", _add, ttl_s=5))
    with pytest.raises(StateError, match="'g' was written with a TTL"):
        rb.get_state(AggregatingStateDescriptor("g", Mean()))
    rb.set_current_key("k")
    assert rb.get_state(ReducingStateDescriptor("r", _add)).get() == 1
    g = rb.get_state(AggregatingStateDescriptor("g", Mean(), ttl_s=5))
    rb.set_ttl_time(4_999)
    assert g.get() == 2.0
    rb.set_ttl_time(5_000)
    assert g.get() is None
    rb.close()
