"""ChangelogKeyedStateBackend: logging per state kind, checkpoints, materialization, truncation,
failures and bad input (Flink's ChangelogXxxStateTest, ChangelogStateDiscardTest,
ChangelogKeyedStateBackendTest re-expressed)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest
from support.fakes import DelegatingStore, ScriptedStore

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for
from dstl.errors import (
    BackendFailedError,
    KeyGroupError,
    ThrottledError,
    TransientStorageError,
    UsageError,
)
from dstl.handle import ChangelogHandle
from dstl.stores import MemoryBlobStore
from dstl.timer import ManualTimer
from materializer.backend import ChangelogKeyedStateBackend
from materializer.changes import (
    ADD,
    ADD_ELEMENT,
    ADD_OR_UPDATE_ELEMENT,
    CLEAR,
    METADATA,
    REMOVE_ELEMENT,
    SET,
    SET_INTERNAL,
    decode_change,
    decode_metadata,
)
from materializer.codecs import PickleCodec
from materializer.handles import ChangelogStateBackendHandle
from materializer.options import BackendOptions
from materializer.states import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from restore import ChangelogReader

MP = 128
ALL = KeyGroupRange(0, MP - 1)
WAIT = 10.0
NO_TIMER = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)


class Avg:
    def create_accumulator(self) -> tuple[int, int]:
        return (0, 0)

    def add(self, v: int, acc: tuple[int, int]) -> tuple[int, int]:
        return (acc[0] + v, acc[1] + 1)

    def get_result(self, acc: tuple[int, int]) -> float:
        return acc[0] / acc[1]

    def merge(self, a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
        return (a[0] + b[0], a[1] + b[1])


@pytest.fixture(params=["heap", "lmdb"])
def table(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def storage() -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(store=MemoryBlobStore(), options=DstlOptions(persist_delay_s=0.0))
    yield s
    s.close()


def _backend(storage: ChangelogStorage, table: str, op: str = "op/0",
             kgs: KeyGroupRange = ALL, options: BackendOptions = NO_TIMER,
             **kw: Any) -> ChangelogKeyedStateBackend:
    return ChangelogKeyedStateBackend(storage, op, kgs, MP, table=table, options=options, **kw)


def _changes(storage: ChangelogStorage, h: ChangelogStateBackendHandle
             ) -> list[tuple[int, int, int]]:
    """(key group, op, state id) of every logged change of the handle's last log part."""
    out = []
    for part in h.non_materialized:
        for kg, payload in ChangelogReader(storage).read(part):
            if kg == -1:
                sid, _ = decode_metadata(payload)
                out.append((kg, METADATA, sid))
            else:
                c = decode_change(payload)
                out.append((kg, c.op, c.state_id))
    return out


_cp = iter(range(1, 10**6))


def _log_of(storage: ChangelogStorage, b: ChangelogKeyedStateBackend) -> list[tuple[int, int, int]]:
    """Checkpoint, and return the changes logged since the previous call for this backend."""
    cp = next(_cp)
    h = b.snapshot(cp).result(WAIT)
    b.notify_checkpoint_complete(cp)
    last = h.non_materialized[-1] if h.non_materialized else None
    if last is None:
        return []
    start = getattr(b, "_test_seen", last.from_sqn)  # on the object: ids are reused after GC
    b._test_seen = last.to_sqn  # type: ignore[attr-defined]
    part = ChangelogHandle(last.log_id, last.key_groups, start, last.to_sqn,
                           last.change_sets[start - last.from_sqn:])
    return _changes(storage, dataclasses.replace(h, non_materialized=(part,)))


# ----------------------------------------------------------------- logging per state kind


@pytest.mark.parametrize("kind,mutate,ops", [
    ("value", lambda s: (s.update(1), s.update(2), s.clear()), [SET, SET, CLEAR]),
    ("list", lambda s: (s.add(1), s.add_all([2, 3]), s.update([4]), s.clear()),
     [ADD_ELEMENT, ADD, SET_INTERNAL, CLEAR]),
    ("map", lambda s: (s.put("a", 1), s.put_all({"b": 2}), s.remove("a"), s.clear()),
     [ADD_OR_UPDATE_ELEMENT, ADD, REMOVE_ELEMENT, CLEAR]),
    ("reducing", lambda s: (s.add(1), s.add(2), s.clear()), [SET_INTERNAL, SET_INTERNAL, CLEAR]),
    ("aggregating", lambda s: (s.add(1), s.add(5)), [SET_INTERNAL, SET_INTERNAL]),
])
def test_every_mutation_is_logged_with_its_op_and_key_group(
        storage: ChangelogStorage, table: str, kind: str, mutate: Any, ops: list[int]) -> None:
    b = _backend(storage, table)
    desc = {"value": ValueStateDescriptor("s"), "list": ListStateDescriptor("s"),
            "map": MapStateDescriptor("s"),
            "reducing": ReducingStateDescriptor("s", lambda a, c: a + c),
            "aggregating": AggregatingStateDescriptor("s", Avg())}[kind]
    state = b.get_state(desc)
    b.set_current_key("alice")
    mutate(state)
    kg = key_group_for(b"alice", MP)
    log = _log_of(storage, b)
    assert log[0] == (-1, METADATA, 0)  # metadata first
    assert log[1:] == [(kg, op, 0) for op in ops]
    b.close()


def test_reads_are_not_logged(storage: ChangelogStorage, table: str) -> None:
    b = _backend(storage, table)
    v = b.get_state(ValueStateDescriptor("v"))
    m = b.get_state(MapStateDescriptor("m"))
    lst = b.get_state(ListStateDescriptor("l"))
    b.set_current_key("k")
    v.update(1)
    _log_of(storage, b)
    v.value()
    m.get("x")
    m.contains("x")
    m.items()
    m.is_empty()
    lst.get()
    assert _log_of(storage, b) == []
    b.close()


def test_map_iterator_removals_and_set_value_are_logged(storage: ChangelogStorage,
                                                        table: str) -> None:
    b = _backend(storage, table)
    m = b.get_state(MapStateDescriptor("m"))
    b.set_current_key("k")
    m.put_all({"a": 1, "b": 2, "c": 3})
    _log_of(storage, b)
    it = m.iterator()
    for entry in it:
        if entry.key == "a":
            it.remove()
        elif entry.key == "b":
            entry.set_value(20)
    assert dict(m.items()) == {"b": 20, "c": 3}
    # (the log after a checkpoint first describes the state again: METADATA)
    assert [op for _, op, _ in _log_of(storage, b)] == [METADATA, REMOVE_ELEMENT,
                                                        ADD_OR_UPDATE_ELEMENT]
    b.close()


def test_state_semantics(storage: ChangelogStorage, table: str) -> None:
    b = _backend(storage, table)
    v = b.get_state(ValueStateDescriptor("v"))
    lst = b.get_state(ListStateDescriptor("l"))
    r = b.get_state(ReducingStateDescriptor("r", max))
    a = b.get_state(AggregatingStateDescriptor("a", Avg()))
    m = b.get_state(MapStateDescriptor("m"))
    b.set_current_key("k")
    assert v.value() is None and lst.get() == [] and r.get() is None and a.get() is None
    v.update({"n": [1]})
    got = v.value()
    got["n"].append(2)  # mutating a returned value does not change state
    assert v.value() == {"n": [1]}
    lst.add_all([1, 2])
    lst.add(3)
    for x in (3, 9, 4):
        r.add(x)
        a.add(x)
    m.put(("t", 1), b"bytes")
    assert lst.get() == [1, 2, 3] and r.get() == 9 and a.get() == pytest.approx(16 / 3)
    assert m.get(("t", 1)) == b"bytes" and list(m) == [("t", 1)]
    b.set_current_key("other")
    assert v.value() is None  # per key
    b.close()


def test_namespaces_and_merge(storage: ChangelogStorage, table: str) -> None:
    b = _backend(storage, table)
    lst = b.get_state(ListStateDescriptor("l"))
    r = b.get_state(ReducingStateDescriptor("r", lambda x, y: x + y))
    b.set_current_key("k")
    for ns, items in (("w1", [1, 2]), ("w2", [3]), ("w3", [])):
        b.set_current_namespace(ns)
        lst.add_all(items)
        for i in items:
            r.add(i)
    b.set_current_namespace("w1")
    lst.merge_namespaces("w0", ["w1", "w2", "w3"])
    r.merge_namespaces("w0", ["w1", "w2"])
    b.set_current_namespace("w0")
    assert sorted(lst.get()) == [1, 2, 3] and r.get() == 6
    b.set_current_namespace("w2")
    assert lst.get() == [] and r.get() is None
    ops = [op for _, op, _ in _log_of(storage, b)]
    assert ops.count(CLEAR) >= 4 and SET_INTERNAL in ops
    b.close()


def test_metadata_is_logged_again_after_each_checkpoint_and_materialization(
        storage: ChangelogStorage, table: str) -> None:
    b = _backend(storage, table)
    v = b.get_state(ValueStateDescriptor("v"))
    b.set_current_key("k")
    v.update(1)
    v.update(2)
    assert [op for _, op, _ in _log_of(storage, b)] == [METADATA, SET, SET]  # once per state
    v.update(3)
    # again after a checkpoint: the log after any checkpoint boundary describes its states, so
    # a snapshot taken at that boundary elsewhere leaves a replayable log (materializer.external)
    assert [op for _, op, _ in _log_of(storage, b)] == [METADATA, SET]
    assert b.materialize_now(WAIT) is not None
    v.update(3)
    h = b.snapshot(next(_cp)).result(WAIT)
    log = _changes(storage, h)
    assert log[0] == (-1, METADATA, 0) and log[1][1] == SET
    b.close()


# ----------------------------------------------------------------- checkpoints and handles


def test_checkpoint_handle_round_trips_and_names_its_objects(storage: ChangelogStorage,
                                                             table: str) -> None:
    b = _backend(storage, table)
    v = b.get_state(ValueStateDescriptor("v"))
    for i in range(50):
        b.set_current_key(f"k{i}")
        v.update(i)
    h1 = b.snapshot(1).result(WAIT)
    b.notify_checkpoint_complete(1)
    assert h1.materialized == () and len(h1.non_materialized) == 1
    ref = b.materialize_now(WAIT)
    assert ref is not None
    b.set_current_key("k1")
    v.update(100)
    h2 = b.snapshot(2).result(WAIT)
    assert h2.materialized == (ref,) and h2.non_materialized[0].from_sqn == ref_up_to(b)
    assert ChangelogStateBackendHandle.from_json(h2.to_json()) == h2
    keys = h2.referenced_keys()
    assert ref.key in keys and all(storage.store.head(k) for k in keys)
    b.close()


def ref_up_to(b: ChangelogKeyedStateBackend) -> int:
    return b.materialization.base.up_to


def test_materialization_waits_for_confirmation_of_the_previous_one(
        storage: ChangelogStorage, table: str) -> None:
    b = _backend(storage, table)
    v = b.get_state(ValueStateDescriptor("v"))
    b.set_current_key("k")
    v.update(1)
    assert b.materialize_now(WAIT) is not None
    v.update(2)
    assert b.materialize_now(WAIT) is None  # not confirmed by a checkpoint yet
    b.snapshot(5).result(WAIT)
    b.notify_checkpoint_complete(5)
    assert b.materialize_now(WAIT) is not None
    v.update(3)
    b.snapshot(6).result(WAIT)
    b.notify_checkpoint_complete(6)
    b.materialize_now(WAIT)
    assert b.materialize_now(WAIT) is None  # nothing new
    b.close()


# ----------------------------------------------------------------- truncation and the registry


def _segment_refs(storage: ChangelogStorage) -> dict[str, tuple[int, int]]:
    storage._discard.submit(lambda: None).result(WAIT)
    return storage.registry.tracked()


def test_preemptive_uploads_are_released_once_materialized_and_subsumed(table: str) -> None:
    store = ScriptedStore()
    with ChangelogStorage(store=store, options=DstlOptions(
            persist_delay_s=0.0, preemptive_persist_threshold_bytes=512)) as s:
        b = _backend(s, table)
        v = b.get_state(ValueStateDescriptor("v"))
        for i in range(200):  # pre-emptive uploads that no checkpoint ever names
            b.set_current_key(f"k{i}")
            v.update("x" * 20)
        pre = set(store.stored())
        assert pre and all(k in _segment_refs(s) for k in pre)
        ref = b.materialize_now(WAIT)      # materialized ...
        assert ref is not None
        b.set_current_key("k1")
        v.update("after")
        h = b.snapshot(1).result(WAIT)     # ... and the checkpoint starts after them
        assert not set(h.referenced_keys()) & pre
        b.notify_checkpoint_complete(1)
        assert pre <= set(store.stored())  # retained without a subsumption
        b.notify_checkpoint_subsumed(1)    # materialized and subsumed: released and deleted
        _segment_refs(s)
        assert not pre & set(store.stored())
        assert not pre & set(_segment_refs(s))
        b.close()


def test_nothing_named_by_a_pending_checkpoint_is_released(table: str) -> None:
    store = ScriptedStore()
    with ChangelogStorage(store=store, options=DstlOptions(
            persist_delay_s=0.0, preemptive_persist_threshold_bytes=256)) as s:
        b = _backend(s, table)
        v = b.get_state(ValueStateDescriptor("v"))
        for i in range(100):
            b.set_current_key(f"k{i}")
            v.update(i)
        b.snapshot(1).result(WAIT)
        b.notify_checkpoint_complete(1)
        b.materialize_now(WAIT)
        b.set_current_key("k1")
        v.update(-1)
        pending = b.snapshot(2).result(WAIT)  # in flight: neither complete nor aborted
        b.notify_checkpoint_subsumed(1)        # triggers truncation up to the materialization
        for key in pending.referenced_keys():
            assert store.inner.head(key) is not None, key
        b.close()


def test_segment_shared_by_two_backends_is_released_only_after_both_truncate() -> None:
    store = ScriptedStore()
    timer = ManualTimer()
    with ChangelogStorage(store=store, options=DstlOptions(persist_delay_s=1.0),
                          timer=timer) as s:
        b1 = _backend(s, "heap", "op/1", KeyGroupRange(0, 63))
        b2 = _backend(s, "heap", "op/2", KeyGroupRange(64, 127))
        keys1 = [k for k in (f"k{i}" for i in range(400)) if key_group_for(k.encode(), MP) < 64]
        keys2 = [k for k in (f"k{i}" for i in range(400)) if key_group_for(k.encode(), MP) >= 64]
        for b, keys in ((b1, keys1), (b2, keys2)):
            v = b.get_state(ValueStateDescriptor("v"))
            for k in keys[:5]:
                b.set_current_key(k)
                v.update(1)
        f1, f2 = b1.snapshot(1), b2.snapshot(1)
        timer.advance(1.0)
        h1, h2 = f1.result(WAIT), f2.result(WAIT)
        shared = h1.non_materialized[0].segment_keys()
        assert shared == h2.non_materialized[0].segment_keys()
        # aborted checkpoint: the TM keeps ownership; materialize + subsume on b1 only
        b1.notify_checkpoint_aborted(1)
        b2.notify_checkpoint_aborted(1)
        for b in (b1, b2):
            b.materialization.confirm(10**9)  # no coordinator here: treat materializations as done
        b1.materialize_now(WAIT)
        b1.notify_checkpoint_subsumed(1)
        assert shared[0] in _segment_refs(s)
        b2.materialize_now(WAIT)
        b2.notify_checkpoint_subsumed(1)
        assert shared[0] not in _segment_refs(s)
        assert shared[0] not in store.stored()
        b1.close()
        b2.close()


# ----------------------------------------------------------------- materialization failures


class SnapshotFailingStore(DelegatingStore):
    """A BlobStore (seam) whose snapshot puts fail ``fail`` times, then succeed."""

    def __init__(self, fail: int) -> None:
        super().__init__("memory://snapfail")
        self.fail = fail

    def put(self, key: str, data: bytes) -> None:
        if key.startswith("snapshots/") and self.fail > 0:
            self.fail -= 1
            raise ConnectionResetError(f"injected failure writing {key}")
        self.inner.put(key, data)


#: One upload attempt per materialization: each failed put fails the materialization.
ONE_ATTEMPT = DstlOptions(persist_delay_s=0.0, upload_max_attempts=1)


def test_failures_up_to_max_are_retried_then_the_backend_fails(table: str) -> None:
    with ChangelogStorage(store=SnapshotFailingStore(fail=10), options=ONE_ATTEMPT) as s:
        b = _backend(s, table, options=NO_TIMER.replace(max_failures=2))
        v = b.get_state(ValueStateDescriptor("v"))
        b.set_current_key("k")
        for attempt in range(3):
            v.update(attempt)
            with pytest.raises(TransientStorageError) as failed:
                b.materialize_now(WAIT)
            assert isinstance(failed.value.__cause__, ConnectionResetError)
        assert b.metrics()["ChangelogBackend.op/0.failedMaterialization"] == 3
        with pytest.raises(BackendFailedError, match="max_failures=2") as info:
            v.update(99)
        assert isinstance(info.value.__cause__, TransientStorageError)
        with pytest.raises(BackendFailedError):
            b.snapshot(1)
        b.close()


def test_a_success_resets_the_failure_count(table: str) -> None:
    with ChangelogStorage(store=SnapshotFailingStore(fail=2), options=ONE_ATTEMPT) as s:
        b = _backend(s, table, options=NO_TIMER.replace(max_failures=2))
        v = b.get_state(ValueStateDescriptor("v"))
        b.set_current_key("k")
        for _ in range(2):
            v.update(1)
            with pytest.raises(TransientStorageError):
                b.materialize_now(WAIT)
        v.update(2)
        assert b.materialize_now(WAIT) is not None
        assert b.materialization.consecutive_failures == 0
        b.close()


class LandingThenFailingStore(DelegatingStore):
    """Snapshot puts: the first lands and then reports a reset (a lost response), the second is
    throttled (503 SlowDown), the rest succeed."""

    def __init__(self) -> None:
        super().__init__("memory://snapflaky")
        self.snapshot_puts: list[str] = []

    def put(self, key: str, data: bytes) -> None:
        if key.startswith("snapshots/"):
            self.snapshot_puts.append(key)
            if len(self.snapshot_puts) == 1:
                self.inner.put(key, data)
                raise ConnectionResetError(f"injected: response to {key} lost")
            if len(self.snapshot_puts) == 2:
                raise ThrottledError(f"put {key}: injected SlowDown", key=key)
        self.inner.put(key, data)


def test_snapshot_uploads_are_retried_under_new_names_and_failed_names_deleted(
        table: str) -> None:
    # regression: one 503 or one lost response used to fail the materialization,
    # and an object whose response was lost stayed in the store
    store = LandingThenFailingStore()
    with ChangelogStorage(store=store, options=DstlOptions(persist_delay_s=0.0,
                                                           upload_retry_delay_s=0.0,
                                                           retry_backoff_base_s=0.001)) as s:
        b = _backend(s, table, options=NO_TIMER)
        b.set_current_key("k")
        b.get_state(ValueStateDescriptor("v")).update(1)
        ref = b.materialize_now(WAIT)
        assert ref is not None and ref.key == store.snapshot_puts[-1]
        assert len(set(store.snapshot_puts)) == 3  # a fresh name per attempt
        stored = [o.key for o in store.inner.list("snapshots/")]
        assert stored == [ref.key]  # the landed attempt was deleted
        assert b.metrics()["ChangelogBackend.op/0.failedMaterialization"] == 0
        b.close()


# ----------------------------------------------------------------- triggers


def test_periodic_timer_first_delay_is_random_then_fixed(storage: ChangelogStorage) -> None:
    timer = ManualTimer()
    b = _backend(storage, "heap", options=BackendOptions(materialization_interval_s=60.0,
                                                         materialize_log_ratio=None),
                 timer=timer)
    (first,) = timer.pending()
    assert 0 <= first < 60.0
    v = b.get_state(ValueStateDescriptor("v"))
    b.set_current_key("k")
    v.update(1)
    timer.advance(first)
    assert timer.pending() == []  # fired: the owner thread runs it at its next access
    v.update(2)                   # ... here
    b.materialization.current.result(WAIT)  # type: ignore[union-attr]
    assert b.metrics()["ChangelogBackend.op/0.completedMaterialization"] == 1
    assert timer.pending() == [pytest.approx(60.0)]
    b.close()
    assert timer.pending() == []


def test_size_trigger_materializes_when_the_log_outgrows_the_table(
        storage: ChangelogStorage) -> None:
    b = _backend(storage, "heap", options=BackendOptions(
        materialization_interval_s=None, materialize_log_ratio=2.0, materialize_min_log_bytes=2000))
    v = b.get_state(ValueStateDescriptor("v"))
    b.set_current_key("k")
    for i in range(200):  # one key rewritten: the table stays tiny, the log grows
        v.update(i)
    assert b.materialization.current is not None
    b.materialization.current.result(WAIT)
    assert b.metrics()["ChangelogBackend.op/0.completedMaterialization"] >= 1
    b.close()


# ----------------------------------------------------------------- bad input


def test_bad_input_gives_typed_errors(storage: ChangelogStorage, table: str) -> None:
    kgs = KeyGroupRange(0, 63)
    b = _backend(storage, table, kgs=kgs)
    v = b.get_state(ValueStateDescriptor("count"))
    with pytest.raises(UsageError, match="is a value state"):
        b.get_state(ListStateDescriptor("count"))
    with pytest.raises(UsageError, match=r"ValueStateDescriptor\.name=''"):
        b.get_state(ValueStateDescriptor(""))  # refused when the descriptor is made
    outside = next(k for k in (f"u{i}" for i in range(1000))
                   if key_group_for(k.encode(), MP) > 63)
    with pytest.raises(KeyGroupError, match=r"outside .*\[0, 63\]"):
        b.set_current_key(outside)
    with pytest.raises(UsageError, match="set_current_key"):
        v.value()
    inside = next(k for k in (f"u{i}" for i in range(1000))
                  if key_group_for(k.encode(), MP) <= 63)
    b.set_current_key(inside)
    with pytest.raises(UsageError, match=r"state 'count'.*type object"):
        v.update(object())
    with pytest.raises(UsageError, match="cannot be encoded by the default key codec"):
        b.set_current_key(3.5)
    b.close()


def test_pickle_only_when_asked_for(storage: ChangelogStorage) -> None:
    b = _backend(storage, "heap")
    v = b.get_state(ValueStateDescriptor("v", serializer=PickleCodec()))
    b.set_current_key("k")
    v.update(KeyGroupRange(1, 2))  # arbitrary objects need the pickle codec
    assert v.value() == KeyGroupRange(1, 2)
    meta = json.loads(json.dumps(b.state_metadata()[0]))
    assert meta["value_codec"] == "pickle"
    b.close()


def test_truncation_never_cuts_the_range_of_a_checkpoint_in_flight() -> None:
    """A materialization finishing while a checkpoint is in flight must not truncate its log
    (found by bench/backend.py: 1 of 2 checkpoints failed under the size trigger)."""
    store = ScriptedStore()
    with ChangelogStorage(store=store, options=DstlOptions(persist_delay_s=0.0)) as s:
        b = _backend(s, "heap")
        v = b.get_state(ValueStateDescriptor("v"))

        def write(n: int) -> None:
            for i in range(n):
                b.set_current_key(f"k{i}")
                v.update(i)

        write(10)
        b.snapshot(1).result(WAIT)
        b.notify_checkpoint_complete(1)
        b.materialize_now(WAIT)
        write(10)
        b.snapshot(2).result(WAIT)
        b.notify_checkpoint_complete(2)      # confirms the materialization
        write(10)
        store.script = ["hang"]
        f3 = b.snapshot(3)                   # in flight: its upload hangs
        assert store.hanging.acquire(timeout=WAIT)
        assert b.materialize_now(WAIT) is not None
        b.notify_checkpoint_subsumed(2)      # would truncate into checkpoint 3's range
        store.release_hangs()
        h3 = f3.result(WAIT)                 # still completes
        assert h3.checkpoint_id == 3
        b.close()


def test_lmdb_materialization_never_snapshots_inside_an_open_write_batch(
        storage: ChangelogStorage) -> None:
    """A read transaction cannot see the batch's uncommitted writes while the log already has
    them: the materialization waits for the batch (found by review: 5 of 10 keys lost)."""
    from restore.restore import restore_backend

    b = _backend(storage, "lmdb")
    v = b.get_state(ValueStateDescriptor("v"))
    with b.write_batch():
        for i in range(10):
            b.set_current_key(f"k{i}")
            v.update(i)
            if i == 4:
                b.materialization.timer_fired()            # the periodic timer fires mid-batch
        assert b.materialize_now(WAIT) is None  # deferred, not a torn snapshot
        assert b.materialization.current is None
    b.set_current_key("k0")               # first access after the batch: it runs now
    v.value()
    assert b.materialization.current is not None
    b.materialization.current.result(WAIT)
    h = b.snapshot(1).result(WAIT)
    assert h.materialized
    b.notify_checkpoint_complete(1)
    b.close()
    r = restore_backend([h], storage, ALL, table="lmdb")
    rv = r.get_state(ValueStateDescriptor("v"))
    for i in range(10):
        r.set_current_key(f"k{i}")
        assert rv.value() == i, f"k{i} lost"
    r.close()
