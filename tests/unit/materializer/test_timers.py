"""The timer service (materializer/timers.py) against a model: a set of (timestamp, key).

Ordering (negative and huge timestamps, ties broken by key bytes), duplicates, deletes, lazy
deletion in the heap index, restore from snapshot + log and from the log only, rescale (split and
merge of key-group ranges), LMDB adopt (a second backend on the same table), bad input; heap and
LMDB."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import KeyGroupError, UsageError
from dstl.stores import MemoryBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.codecs import StrOrBytesKeyCodec
from materializer.options import BackendOptions
from materializer.states import ValueStateDescriptor
from materializer.timers import (
    MAX_TIMESTAMP_MS,
    MIN_TIMESTAMP_MS,
    TIMER_INDEX_STATE,
    TIMERS_STATE,
    TimerService,
    decode_timestamp,
    encode_timestamp,
)
from restore import restore_backend

MP = 32
ALL = KeyGroupRange(0, MP - 1)
NO_TIMER = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
WAIT = 10.0
Model = set[tuple[int, Any]]  # (timestamp, user key)


@pytest.fixture(params=["heap", "lmdb"])
def table(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def storage() -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(store=MemoryBlobStore(), options=DstlOptions(persist_delay_s=0.0))
    yield s
    s.close()


def _backend(storage: ChangelogStorage, table: str, kgs: KeyGroupRange = ALL,
             op: str = "op/0", **kw: Any) -> ChangelogKeyedStateBackend:
    return ChangelogKeyedStateBackend(storage, op, kgs, MP, table=table, options=NO_TIMER, **kw)


def _bkey(key: Any) -> Any:
    return key if isinstance(key, (str, bytes)) else str(key)


def _register(b: ChangelogKeyedStateBackend, ts: TimerService, key: Any, t: int) -> bool:
    b.set_current_key(_bkey(key))
    return ts.register(t, key)


def _key_bytes(key: Any) -> bytes:
    return StrOrBytesKeyCodec().encode(_bkey(key))


def _expected(model: Model, up_to: int) -> list[tuple[int, Any]]:
    return sorted(((t, k) for t, k in model if t <= up_to),
                  key=lambda x: (x[0], _key_bytes(x[1])))


def _fire(b: ChangelogKeyedStateBackend, ts: TimerService, up_to: int, model: Model
          ) -> list[tuple[int, Any]]:
    fired = []
    for d in ts.due(up_to):
        b.set_current_key(_bkey(d.key))
        if ts.consume(d):
            fired.append((d.timestamp_ms, d.key))
            model.discard((d.timestamp_ms, d.key))
    return fired


def test_timestamp_encoding_keeps_numeric_order() -> None:
    values = [MIN_TIMESTAMP_MS, -(10 ** 15), -1, 0, 1, 1_700_000_000_000, MAX_TIMESTAMP_MS]
    enc = [encode_timestamp(v) for v in values]
    assert enc == sorted(enc)
    assert [decode_timestamp(e) for e in enc] == values


def test_due_timers_in_time_order_with_duplicates_and_deletes(storage: ChangelogStorage,
                                                              table: str) -> None:
    rng = random.Random(7)
    b = _backend(storage, table)
    ts = TimerService(b)
    model: Model = set()
    keys: list[Any] = [f"k{i}" for i in range(40)] + [7, 123456, b"\x00\xffbin"]
    with b.write_batch():
        for _ in range(600):
            key, t = rng.choice(keys), rng.randrange(-50, 400)
            if rng.random() < 0.75:
                assert _register(b, ts, key, t) == ((t, key) not in model)
                model.add((t, key))
            else:
                b.set_current_key(_bkey(key))
                assert ts.delete(t) == ((t, key) in model)
                model.discard((t, key))
    for key in keys:  # list_timers: the key's timers, ascending
        b.set_current_key(_bkey(key))
        assert ts.list_timers() == sorted(t for t, k in model if k == key)
    for up_to in (-60, 0, 100, 250, 1000):
        want = _expected(model, up_to)
        assert _fire(b, ts, up_to, model) == want, f"up to {up_to}"
    assert not model
    assert ts.due(MAX_TIMESTAMP_MS) == []
    b.close()


def test_a_handler_may_delete_a_later_due_timer_and_new_due_timers_wait(
        storage: ChangelogStorage, table: str) -> None:
    b = _backend(storage, table)
    ts = TimerService(b)
    _register(b, ts, "a", 5)
    _register(b, ts, "a", 6)
    _register(b, ts, "b", 5)
    due = ts.due(10)
    assert [(d.timestamp_ms, d.key) for d in due] == [(5, "a"), (5, "b"), (6, "a")]
    b.set_current_key("a")
    assert ts.consume(due[0])
    assert ts.delete(6)            # the handler of (5, a) deletes a's later timer
    assert ts.register(1, "a")     # ... and registers one that is already due
    b.set_current_key("b")
    assert ts.consume(due[1])
    b.set_current_key("a")
    assert not ts.consume(due[2])  # gone: not fired
    with pytest.raises(UsageError, match="another current key"):
        ts.consume(due[1])
    assert [(d.timestamp_ms, d.key) for d in ts.due(10)] == [(1, "a")]  # next round
    b.close()


def _checkpoint(b: ChangelogKeyedStateBackend, cp: int) -> Any:
    h = b.snapshot(cp).result(WAIT)
    b.notify_checkpoint_complete(cp)
    return h


@pytest.mark.parametrize("materialize", [False, True], ids=["log", "snapshot+log"])
def test_timers_survive_restore_and_move_with_their_keys_on_rescale(
        storage: ChangelogStorage, table: str, materialize: bool, tmp_path: Path) -> None:
    rng = random.Random(11)
    halves = [KeyGroupRange(0, MP // 2 - 1), KeyGroupRange(MP // 2, MP - 1)]
    backends = [_backend(storage, table, kgs, op=f"op/{i}") for i, kgs in enumerate(halves)]
    services = [TimerService(b) for b in backends]
    model: Model = set()
    from dstl import key_group_for
    for i in range(300):
        key = f"user{i % 97}"
        j = 0 if key_group_for(_key_bytes(key), MP) < MP // 2 else 1
        t = rng.randrange(0, 1000)
        _register(backends[j], services[j], key, t)
        model.add((t, key))
        if materialize and i == 150:
            for k, b in enumerate(backends):
                _checkpoint(b, 1)
                assert b.materialize_now(WAIT) is not None, f"backend {k} materialized"
    handles = [_checkpoint(b, 2) for b in backends]
    for b in backends:
        b.close()
    # merge: one backend restores both halves (scale in)
    merged = restore_backend(handles, storage, ALL, table=table, operator_id="op/m",
                             local_directory=str(tmp_path / "m"))
    ms = TimerService(merged)
    for key in {k for _, k in model}:
        merged.set_current_key(key)
        assert ms.list_timers() == sorted(t for t, k in model if k == key)
    assert [(d.timestamp_ms, d.key) for d in ms.due(10 ** 6)] == _expected(model, 10 ** 6)
    # fire half of them, checkpoint, then split into quarters (scale out)
    fired = _fire(merged, ms, 500, model)
    assert fired and all(t <= 500 for t, _ in fired)
    h = _checkpoint(merged, 3)
    merged.close()
    quarters = [KeyGroupRange(q * MP // 4, (q + 1) * MP // 4 - 1) for q in range(4)]
    got: list[tuple[int, Any]] = []
    for q, kgs in enumerate(quarters):
        r = restore_backend([h], storage, kgs, table=table, operator_id=f"op/q{q}",
                            local_directory=str(tmp_path / f"q{q}"))
        rs = TimerService(r)
        got += [(d.timestamp_ms, d.key) for d in rs.due(10 ** 6)]
        r.close()
    assert sorted(got) == sorted(model)  # every remaining timer in exactly one quarter


def test_lmdb_adopting_backend_sees_the_index_without_a_rebuild(storage: ChangelogStorage,
                                                                tmp_path: Path) -> None:
    b = _backend(storage, "lmdb", local_directory=str(tmp_path))
    ts = TimerService(b)
    with b.write_batch():
        for i in range(50):
            _register(b, ts, f"k{i}", 1000 - i)
    h = _checkpoint(b, 1)
    states = {str(sid): m for sid, m in b.table_marker(h).states.items()}
    b.close()
    # another worker opens the same on-disk table (the Spark adopt path): no restore
    a = _backend(storage, "lmdb", local_directory=str(tmp_path), adopt_local=True)
    for sid, meta in states.items():
        a.register_restored_state(meta, int(sid))
    at = TimerService(a)
    assert [d.timestamp_ms for d in at.due(975)] == list(range(951, 976))
    a.close()


def test_heap_index_compacts_after_many_deletes(storage: ChangelogStorage) -> None:
    b = _backend(storage, "heap")
    ts = TimerService(b)
    assert ts.due(0) == []  # builds the in-memory index
    for i in range(3000):
        _register(b, ts, f"k{i % 10}", i)
    for i in range(2900):
        b.set_current_key(f"k{i % 10}")
        assert ts.delete(i)
    assert ts.due(0) == []
    assert len(ts._heap or []) == 100  # rebuilt from the 100 live timers (was 3000 entries)
    assert [d.timestamp_ms for d in ts.due(10 ** 6)] == list(range(2900, 3000))
    b.close()


def test_bad_input_is_a_typed_error(storage: ChangelogStorage, table: str) -> None:
    b = _backend(storage, table, KeyGroupRange(0, 7))
    ts = TimerService(b)
    with pytest.raises(UsageError, match="set_current_key"):
        ts.register(5, "x")
    key = next(f"k{i}" for i in range(100)
               if __import__("dstl").key_group_for(_key_bytes(f"k{i}"), MP) <= 7)
    b.set_current_key(key)
    for bad in (1.5, True, "5", None, 1 << 63, MIN_TIMESTAMP_MS - 1):
        with pytest.raises(UsageError, match="timer timestamp"):
            ts.register(bad, key)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="internal index"):
        b.get_state(ValueStateDescriptor(TIMER_INDEX_STATE))
    with pytest.raises(UsageError, match="not an internal index"):
        b.register_raw_state(TIMERS_STATE)
    with pytest.raises(KeyGroupError):
        b.raw_put(b.register_raw_state(TIMER_INDEX_STATE), 20, b"k", b"", b"")
    b.close()
