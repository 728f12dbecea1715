"""ChangelogWriter: Flink's writer, sqn and discard test lists, re-expressed (reference §7)."""

from __future__ import annotations

import array
from collections.abc import Iterator

import pytest
from support.fakes import ScriptedStore

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import (
    ClosedError,
    ConfigTypeError,
    KeyGroupError,
    UploadFailedError,
    UsageError,
    WriterFailedError,
)
from dstl.handle import ChangelogHandle
from dstl.segment import BLOCK_HEAD_BYTES, BODY_HEAD_BYTES
from dstl.timer import ManualTimer
from restore import ChangelogReader

KGS = KeyGroupRange(0, 15)
WAIT = 10.0


def _options(**kw: object) -> DstlOptions:
    base: dict[str, object] = dict(persist_delay_s=0.0, upload_retry_delay_s=0.0,
                                   upload_timeout_s=5.0, upload_threads=2)
    base.update(kw)
    return DstlOptions(**base)  # type: ignore[arg-type]


@pytest.fixture
def store() -> ScriptedStore:
    return ScriptedStore()


@pytest.fixture
def timer() -> ManualTimer:
    return ManualTimer()


@pytest.fixture
def storage(store: ScriptedStore, timer: ManualTimer) -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(store=store, options=_options(), timer=timer)
    yield s
    s.close()


def _settle(storage: ChangelogStorage) -> None:
    """Wait until queued deletes ran (the discard executor is FIFO with one thread)."""
    storage._discard.submit(lambda: None).result(WAIT)


def _read(storage: ChangelogStorage, handle: ChangelogHandle) -> list[tuple[int, bytes]]:
    return list(ChangelogReader(storage).read(handle))


# ----------------------------------------------------------------- FsStateChangelogWriterTest


def test_append_does_not_upload(storage: ChangelogStorage, store: ScriptedStore) -> None:
    w = storage.create_writer("w", KGS)
    w.append(1, b"a")
    assert store.puts == []


def test_persisted_bytes_equal_input(storage: ChangelogStorage) -> None:
    w = storage.create_writer("w", KGS)
    changes = [(kg % 16, bytes([kg]) * kg) for kg in range(40)]
    for kg, p in changes:
        w.append(kg, p)
    h = w.persist(0, 1).result(WAIT)
    assert sorted(_read(storage, h)) == sorted(changes)
    assert h.from_sqn == 0 and h.to_sqn == 1 and h.size == sum(len(p) for _, p in changes)


def test_preemptive_persist_uploads_and_later_persist_reuses(store: ScriptedStore) -> None:
    with ChangelogStorage(store=store, options=_options(preemptive_persist_threshold_bytes=100),
                          timer=ManualTimer()) as s:
        w = s.create_writer("w", KGS)
        for _ in range(30):
            w.append(1, b"0123456789")  # 14 framed bytes each: fires at the 8th append
        assert s.metrics()["ChangelogStorage.numberOfPreemptivePersists"] >= 1
        h = w.persist(0, 1).result(WAIT)
        assert [p for _, p in _read(s, h)] == [b"0123456789"] * 30
        uploaded_sqns = len(store.puts)
        # the pre-emptively uploaded change sets were not uploaded a second time
        assert uploaded_sqns == len({r.key for r in h.change_sets})
        assert h.incremental_size < h.size


def test_confirmed_changes_are_not_uploaded_again(storage: ChangelogStorage,
                                                  store: ScriptedStore) -> None:
    w = storage.create_writer("w", KGS)
    w.append(1, b"a")
    h1 = w.persist(0, 1).result(WAIT)
    w.confirm(0, h1.to_sqn, 1)
    h2 = w.persist(0, 2).result(WAIT)
    assert len(store.puts) == 1 and h2.change_sets == h1.change_sets
    assert h2.incremental_size == 0


def test_no_second_upload_while_the_first_is_in_flight(store: ScriptedStore,
                                                       timer: ManualTimer) -> None:
    store.script = ["hang"]
    with ChangelogStorage(store=store, options=_options(), timer=timer) as s:
        w = s.create_writer("w", KGS)
        w.append(1, b"a")
        f1 = w.persist(0, 1)
        assert store.hanging.acquire(timeout=WAIT)
        f2 = w.persist(0, 2)  # same range, still uploading: only waits
        store.release_hangs()
        assert f1.result(WAIT).change_sets == f2.result(WAIT).change_sets
        assert len(store.puts) == 1


def test_only_newly_appended_changes_are_uploaded(storage: ChangelogStorage,
                                                  store: ScriptedStore) -> None:
    w = storage.create_writer("w", KGS)
    w.append(1, b"a")
    w.persist(0, 1).result(WAIT)
    w.append(2, b"b")
    h = w.persist(0, 2).result(WAIT)
    assert len(store.puts) == 2 and len(h) == 2
    assert _read(storage, h) == [(1, b"a"), (2, b"b")]


def test_persist_after_reset_reuses_uploads(storage: ChangelogStorage,
                                            store: ScriptedStore) -> None:
    w = storage.create_writer("w", KGS)
    w.append(1, b"a")
    h1 = w.persist(0, 1).result(WAIT)
    w.reset(0, h1.to_sqn, 1)
    w.append(1, b"b")
    h2 = w.persist(0, 2).result(WAIT)
    assert h2.change_sets[0] == h1.change_sets[0] and len(store.puts) == 2


def test_upload_failure_fails_the_future_and_poisons_the_range(store: ScriptedStore) -> None:
    store.script = ["fatal"]
    with ChangelogStorage(store=store, options=_options(), timer=ManualTimer()) as s:
        w = s.create_writer("w", KGS)
        w.append(1, b"a")
        with pytest.raises(UploadFailedError) as info:
            w.persist(0, 1).result(WAIT)
        assert isinstance(info.value.__cause__, PermissionError)
        assert info.value.attempts == 1  # non-retryable: no retry
        # a range containing the failed sqn fails at once, chained to the cause
        with pytest.raises(WriterFailedError) as again:
            w.persist(0, 2)
        assert again.value.__cause__ is info.value
        # a later range that does not reach back to the failure still succeeds
        w.append(1, b"b")
        h = w.persist(1, 3).result(WAIT)
        assert _read(s, h) == [(1, b"b")]


def test_persist_below_truncation_point_is_rejected(storage: ChangelogStorage) -> None:
    w = storage.create_writer("w", KGS)
    w.append(1, b"a")
    w.persist(0, 1).result(WAIT)
    w.truncate(1)
    with pytest.raises(UsageError, match="below the truncation point 1"):
        w.persist(0, 2)
    with pytest.raises(UsageError, match="beyond the active sqn"):
        w.persist(5, 2)


# ----------------------------------------------------------------- FsStateChangelogWriterSqnTest


@pytest.mark.parametrize("append_first", [False, True])
@pytest.mark.parametrize("op", ["next_sqn", "persist", "append", "truncate"])
def test_sqn_increments_only_on_rollover_of_a_non_empty_set(
        storage: ChangelogStorage, op: str, append_first: bool) -> None:
    w = storage.create_writer("w", KGS)
    if append_first:
        w.append(1, b"a")
    before = w._active_sqn
    if op == "next_sqn":
        w.next_sqn()
    elif op == "persist":
        w.persist(0, 1).result(WAIT)
    elif op == "append":
        w.append(2, b"b")
    else:
        w.truncate(before)
    expected = before + (1 if append_first and op in ("next_sqn", "persist") else 0)
    assert w._active_sqn == expected


def test_next_sqn_is_stable_without_appends(storage: ChangelogStorage) -> None:
    w = storage.create_writer("w", KGS)
    assert w.next_sqn() == w.next_sqn() == 0
    w.append(1, b"a")
    assert w.next_sqn() == 1 and w.next_sqn() == 1


def test_empty_persist_uploads_nothing(storage: ChangelogStorage, store: ScriptedStore) -> None:
    w = storage.create_writer("w", KGS)
    h = w.persist(0, 1).result(WAIT)
    assert len(h) == 0 and store.puts == []


# ----------------------------------------------------------------- bad input


def test_bad_input_gives_typed_errors(storage: ChangelogStorage) -> None:
    w = storage.create_writer("w", KGS)
    with pytest.raises(KeyGroupError, match=r"key group 16 is outside .*\[0, 15\]"):
        w.append(16, b"x")
    with pytest.raises(KeyGroupError):
        w.append(True, b"x")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="payload must be bytes, got str"):
        w.append(1, "text")  # type: ignore[arg-type]
    w.append(-1, b"metadata is always allowed")
    w.append(1, bytearray(b"bytes-like is fine"))
    with pytest.raises(UsageError, match="already open"):
        storage.create_writer("w", KGS)
    w.close()
    with pytest.raises(ClosedError, match="append after close"):
        w.append(1, b"x")
    with pytest.raises(ClosedError):
        w.persist(0, 1)


@pytest.mark.parametrize(("call", "shown"), [
    (lambda w: w.truncate("a"), "ChangelogWriter.truncate.to_sqn='a'"),
    (lambda w: w.truncate(None), "ChangelogWriter.truncate.to_sqn=None"),
    (lambda w: w.truncate(1.0), "ChangelogWriter.truncate.to_sqn=1.0"),
    (lambda w: w.reset("a", None, 1), "ChangelogWriter.reset.from_sqn='a'"),
    (lambda w: w.reset(0, None, 1), "ChangelogWriter.reset.to_sqn=None"),
    (lambda w: w.reset(0, 0, "1"), "ChangelogWriter.reset.checkpoint_id='1'"),
    (lambda w: w.confirm(0, True, 1), "ChangelogWriter.confirm.to_sqn=True"),
    (lambda w: w.truncate_and_close("0"), "ChangelogWriter.truncate_and_close.from_sqn='0'"),
])
def test_sqn_arguments_of_the_wrong_type_are_named(storage: ChangelogStorage, call: object,
                                                   shown: str) -> None:
    w = storage.create_writer("w", KGS)
    w.append(1, b"a")
    with pytest.raises(ConfigTypeError) as info:
        call(w)  # type: ignore[operator]
    assert str(info.value) == (f"{shown} is invalid: expected an int; sequence numbers "
                               "and checkpoint ids are ints")
    assert not w.closed  # a refused call changes nothing
    w.close()


class _IntSubclass(int):
    pass


def test_bad_input_is_refused_also_for_a_key_group_with_changes(
        storage: ChangelogStorage) -> None:
    # The checks must hold once a key group has a block in the active change set, not only for
    # its first change: a bool, float or int subclass equal to a valid key group still names no
    # key group, and a payload still has to be bytes-like.
    w = storage.create_writer("w", KGS)
    w.append(1, b"a")
    w.append(-1, b"m")
    for bad in (True, 1.0, _IntSubclass(1), [1], "1", None):
        with pytest.raises(KeyGroupError, match="is outside changelog writer 'w'"):
            w.append(bad, b"x")  # type: ignore[arg-type]
    with pytest.raises(KeyGroupError, match=r"key group 16 is outside .*\[0, 15\]"):
        w.append(16, b"x")
    for bad_payload in ("text", 7, None, [1, 2]):
        with pytest.raises(UsageError, match="payload must be bytes, got"):
            w.append(1, bad_payload)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="payload must be bytes, got"):
            w.append(-1, bad_payload)  # type: ignore[arg-type]
    h = w.persist(0, 1).result(WAIT)
    assert sorted(_read(storage, h)) == [(-1, b"m"), (1, b"a")]
    w.append(1, b"b")
    w.close()
    with pytest.raises(ClosedError, match="append after close"):
        w.append(1, b"x")
    with pytest.raises(ClosedError, match="append after close"):
        w.append(-1, b"x")


def test_bytes_like_payloads_are_framed_as_their_bytes(storage: ChangelogStorage) -> None:
    # A memoryview's len() counts items, not bytes: framing it as is would write a wrong
    # length prefix, so it is copied to bytes first, also for a key group with changes.
    w = storage.create_writer("w", KGS)
    ints = array.array("i", [1, 2, 3])
    changes: list[tuple[int, bytes | bytearray | memoryview]] = [
        (1, b"a"), (1, bytearray(b"bytearray")), (1, memoryview(ints)),
        (1, memoryview(b"xxsliced")[2:]), (2, memoryview(ints)), (1, b"z")]
    for kg, p in changes:
        w.append(kg, p)
    h = w.persist(0, 1).result(WAIT)
    assert _read(storage, h) == [(1, b"a"), (1, b"bytearray"), (1, ints.tobytes()),
                                 (1, b"sliced"), (1, b"z"), (2, ints.tobytes())]


def _model_change_sets(log_id: str, changes: list[tuple[int, bytes]], limit: int) -> list[int]:
    """The rollover rule written out: a change starts a new change set when the body (head,
    one header per block, a 4-byte prefix per change) would pass ``limit`` with it. Returns
    the change count of each change set."""
    counts = [0]
    key_groups: set[int] = set()
    body = BODY_HEAD_BYTES + len(log_id)
    for kg, p in changes:
        grown = body + 4 + len(p) + BLOCK_HEAD_BYTES * (kg not in key_groups)
        if grown > limit:
            counts.append(0)
            key_groups.clear()
            grown = BODY_HEAD_BYTES + len(log_id) + BLOCK_HEAD_BYTES + 4 + len(p)
        key_groups.add(kg)
        counts[-1] += 1
        body = grown
    return counts


def test_change_set_rolls_over_exactly_at_max_change_set_bytes(store: ScriptedStore) -> None:
    limit = 1 << 20
    opts = _options(max_change_set_bytes=limit, preemptive_persist_threshold_bytes=limit - 1)
    head = BODY_HEAD_BYTES + len("w")
    kb = b"k" * 1000
    changes: list[tuple[int, bytes]] = []
    # set 0: one block filled to the last byte; the change that makes the body exactly the
    # limit stays in it
    n = (limit - head - BLOCK_HEAD_BYTES) // (4 + len(kb))
    changes += [(0, kb)] * n
    changes.append((0, b"a" * (limit - head - BLOCK_HEAD_BYTES - n * (4 + len(kb)) - 4)))
    # set 1: sixteen blocks, then filled to the last byte through key group 0 (every block
    # header counts)
    changes.append((0, b"b"))
    changes += [(kg, b"c" * 100) for kg in range(1, 16)]
    used = head + 16 * BLOCK_HEAD_BYTES + 4 + 1 + 15 * 104
    n = (limit - used) // (4 + len(kb))
    changes += [(0, kb)] * n
    changes.append((0, b"d" * (limit - used - n * (4 + len(kb)) - 4)))
    # set 2: 10 bytes left, so a 6-byte change fits in key group 0 but not in a new block
    changes.append((0, b"e"))
    used = head + BLOCK_HEAD_BYTES + 5
    n = (limit - used) // (4 + len(kb))
    changes += [(0, kb)] * n
    changes.append((0, b"f" * (limit - used - n * (4 + len(kb)) - 4 - 10)))
    changes.append((5, b"g" * 6))
    # then mixed sizes (below and above the prefix table) over every key group
    changes += [(i % 16, b"h" * (i * 37 % 3000)) for i in range(2000)]
    model = _model_change_sets("w", changes, limit)
    with ChangelogStorage(store=store, options=opts, timer=ManualTimer()) as s:
        w = s.create_writer("w", KGS)
        for kg, p in changes:
            w.append(kg, p)
        assert w.next_sqn() == len(model)
        sets = [w._not_uploaded[sqn] for sqn in sorted(w._not_uploaded)]
        assert [cs.change_count for cs in sets] == model
        assert [len(cs.body) for cs in sets[:3]] == [limit, limit, limit - 10]
        assert all(len(cs.body) <= limit for cs in sets)
        h = w.persist(0, 1).result(WAIT)
        assert sorted(_read(s, h)) == sorted(changes)


def test_change_larger_than_a_change_set_is_refused(store: ScriptedStore) -> None:
    limit = 1 << 20
    opts = _options(max_change_set_bytes=limit, preemptive_persist_threshold_bytes=limit - 1)
    with ChangelogStorage(store=store, options=opts, timer=ManualTimer()) as s:
        w = s.create_writer("w", KGS)
        w.append(1, b"a")
        w.append(2, b"b")
        for kg in (1, 2, 3, -1):  # a key group with a block, and ones without
            with pytest.raises(UsageError, match=r"a 1048576-byte change does not fit in one "
                                                 r"change set of at most 1048576 bytes"):
                w.append(kg, b"x" * limit)
        fits = limit - BODY_HEAD_BYTES - 1 - BLOCK_HEAD_BYTES - 4
        w.append(1, b"y" * fits)  # fits alone: rolls the first set over
        with pytest.raises(UsageError, match="does not fit"):
            w.append(1, b"y" * (fits + 1))
        assert w.next_sqn() == 2
        h = w.persist(0, 1).result(WAIT)
        assert _read(s, h) == [(1, b"a"), (2, b"b"), (1, b"y" * fits)]


@pytest.mark.parametrize("threshold, fires_at", [(97, 7), (98, 7), (99, 8)])
def test_preemptive_persist_fires_at_the_threshold(store: ScriptedStore, threshold: int,
                                                   fires_at: int) -> None:
    # 14 framed bytes per change: the active set reaches 98 bytes with the 7th change
    with ChangelogStorage(store=store, options=_options(
            preemptive_persist_threshold_bytes=threshold), timer=ManualTimer()) as s:
        w = s.create_writer("w", KGS)
        for i in range(1, fires_at + 3):
            w.append(1, b"0123456789")
            fired = s.metrics()["ChangelogStorage.numberOfPreemptivePersists"]
            assert fired == (1 if i >= fires_at else 0), f"after change {i}"


def test_close_fails_pending_futures(store: ScriptedStore) -> None:
    store.script = ["hang"]
    with ChangelogStorage(store=store, options=_options(), timer=ManualTimer()) as s:
        w = s.create_writer("w", KGS)
        w.append(1, b"a")
        f = w.persist(0, 1)
        assert store.hanging.acquire(timeout=WAIT)
        w.close()
        with pytest.raises(ClosedError):
            f.result(WAIT)
        store.release_hangs()
        _settle(s)


# ----------------------------------------------------------------- registry lifecycle
# (ChangelogStateDiscardTest / testFileAvailableAfterPreUpload / testFileAvailableAfterClose)


def test_truncate_releases_and_deletes_unconfirmed_segments(storage: ChangelogStorage,
                                                            store: ScriptedStore) -> None:
    w = storage.create_writer("w", KGS)
    w.append(1, b"a")
    h = w.persist(0, -1).result(WAIT)  # pre-emptive style: no checkpoint
    w.append(1, b"b")
    w.persist(1, -1).result(WAIT)
    w.truncate(1)
    _settle(storage)
    assert h.change_sets[0].key not in store.stored()
    assert len(store.stored()) == 1


def test_confirmed_segments_are_never_deleted_by_the_process(storage: ChangelogStorage,
                                                             store: ScriptedStore) -> None:
    w = storage.create_writer("w", KGS)
    w.append(1, b"a")
    h = w.persist(0, 1).result(WAIT)
    w.confirm(0, h.to_sqn, 1)
    w.truncate(h.to_sqn)
    _settle(storage)
    assert h.change_sets[0].key in store.stored()
    assert storage.registry.tracked() == {}


def test_segment_shared_by_two_writers_is_deleted_only_after_both_truncate(
        store: ScriptedStore, timer: ManualTimer) -> None:
    with ChangelogStorage(store=store, options=_options(persist_delay_s=1.0), timer=timer) as s:
        a, b = s.create_writer("a", KGS), s.create_writer("b", KGS)
        a.append(1, b"a")
        b.append(2, b"b")
        fa, fb = a.persist(0, -1), b.persist(0, -1)
        timer.advance(1.0)  # one window -> one segment
        ha, hb = fa.result(WAIT), fb.result(WAIT)
        assert ha.change_sets[0].key == hb.change_sets[0].key
        key = ha.change_sets[0].key
        a.truncate(1)
        _settle(s)
        assert key in store.stored()
        b.truncate(1)
        _settle(s)
        assert key not in store.stored()


def test_in_flight_checkpoint_pins_its_segments(storage: ChangelogStorage,
                                                store: ScriptedStore) -> None:
    """apache/flink#27599: truncation racing with an in-flight checkpoint must not delete."""
    w = storage.create_writer("w", KGS)
    w.append(1, b"a")
    w.persist(0, -1).result(WAIT)            # uploaded pre-emptively, not confirmed
    h = w.persist(0, 7).result(WAIT)         # checkpoint 7 names it (in flight)
    key = h.change_sets[0].key
    w.truncate(1)                            # materialized + older checkpoint subsumed
    _settle(storage)
    assert key in store.stored()               # pinned by checkpoint 7
    w.confirm(0, 1, 7)                       # completes: handed over, still there
    _settle(storage)
    assert key in store.stored()


def test_aborted_checkpoint_unpins_and_the_segment_can_go(storage: ChangelogStorage,
                                                          store: ScriptedStore) -> None:
    w = storage.create_writer("w", KGS)
    w.append(1, b"a")
    h = w.persist(0, 7).result(WAIT)
    key = h.change_sets[0].key
    w.truncate(1)
    _settle(storage)
    assert key in store.stored()
    w.reset(0, 1, 7)
    _settle(storage)
    assert key not in store.stored()


def test_truncate_and_close_keeps_checkpointed_and_drops_the_rest(
        storage: ChangelogStorage, store: ScriptedStore) -> None:
    w = storage.create_writer("w", KGS)
    w.append(1, b"checkpointed")
    h = w.persist(0, 1).result(WAIT)
    w.append(1, b"after the checkpoint")
    later = w.persist(1, -1).result(WAIT)
    w.truncate_and_close(h.to_sqn)
    _settle(storage)
    assert h.change_sets[0].key in store.stored()
    assert later.change_sets[0].key not in store.stored()


def test_late_upload_result_after_truncation_is_released(store: ScriptedStore,
                                                         timer: ManualTimer) -> None:
    store.script = ["hang"]
    with ChangelogStorage(store=store, options=_options(), timer=timer) as s:
        w = s.create_writer("w", KGS)
        w.append(1, b"a")
        f = w.persist(0, -1)
        assert store.hanging.acquire(timeout=WAIT)
        w.truncate(1)
        with pytest.raises(UsageError, match="truncated"):
            f.result(WAIT)
        store.release_hangs()
        # the upload lands after the truncation: released on arrival, then deleted
        store.wait_deleted(store.puts[0])
        assert store.stored() == []
