"""The restore fast paths against their slow paths (differential, Hypothesis):
SafeCodec's scalar fast path and memo, CopyOnWriteStateMap.put_all, LmdbBulkLoad (raw runs,
commits as it goes, map growth), and the collector pause of restore.gcpause."""

from __future__ import annotations

import gc
import pickle
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dstl.errors import CorruptObjectError, KeyGroupError, UsageError
from dstl.keygroups import KeyGroupRange
from materializer.codecs import SafeCodec
from materializer.cow_map import CopyOnWriteStateMap
from materializer.lmdb_table import LmdbBulkLoad, LmdbStateTable
from restore import gcpause

_scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
            | st.text(max_size=12) | st.binary(max_size=12) | st.text(max_size=300)
            | st.binary(max_size=300))
_values = st.recursive(_scalars, lambda c: st.lists(c, max_size=3)
                       | st.tuples(c, c) | st.dictionaries(st.text(max_size=3), c, max_size=3),
                       max_leaves=6)


def _slow(data: bytes) -> tuple[str, Any]:
    try:
        return "ok", SafeCodec()._unpickle(data)
    except CorruptObjectError:
        return "corrupt", None


def _fast(codec: SafeCodec, data: bytes) -> tuple[str, Any]:
    try:
        return "ok", codec.decode(data)
    except CorruptObjectError:
        return "corrupt", None


@given(values=st.lists(_values, min_size=1, max_size=20))
def test_safe_codec_fast_path_and_memo_equal_the_unpickler(values: list[Any]) -> None:
    codec = SafeCodec()
    for v in values * 2:  # the second round is served by the memo where it applies
        data = codec.encode(v)
        got = codec.decode(data)
        assert got == v and type(got) is type(v)
        assert _fast(codec, data) == _slow(data)


def _near_miss(value: Any, pos: int, byte: int) -> bytes:
    """A valid short bytes/str pickle with one byte replaced: the fast path's structural checks
    must fall back (or agree with the unpickler) for every such variant."""
    data = bytearray(pickle.dumps(value, protocol=5))
    data[pos % len(data)] = byte
    return bytes(data)


@given(data=st.binary(max_size=40)
       | st.builds(lambda b, n: b"\x80\x05K" + bytes([n]) + b, st.binary(max_size=2),
                   st.integers(0, 255))
       | st.builds(_near_miss, st.binary(min_size=1, max_size=255) | st.text(min_size=1,
                                                                             max_size=80),
                   st.integers(0, 400), st.integers(0, 255)))
def test_safe_codec_fast_path_on_any_bytes_decodes_or_refuses_as_the_unpickler(
        data: bytes) -> None:
    codec = SafeCodec()
    assert _fast(codec, data) == _slow(data)
    assert _fast(codec, data) == _slow(data)  # memoized or not, the same


def test_safe_codec_small_int_fast_path_and_memo_bound() -> None:
    codec = SafeCodec()
    for i in range(256):
        assert codec.decode(pickle.dumps(i, protocol=5)) == i
    assert not codec._memo  # protocol-5 small ints never reach the memo
    for i in range(256, 256 + 5000):
        assert codec.decode(pickle.dumps(i, protocol=5)) == i
    assert 0 < len(codec._memo) <= 4096
    # mutable results are never shared through the memo
    data = pickle.dumps([1], protocol=5)
    a, b = codec.decode(data), codec.decode(data)
    assert a == b == [1] and a is not b
    with pytest.raises(CorruptObjectError):
        codec.decode(b"\x80\x05c__builtin__\nprint\n.")


_items = st.lists(st.tuples(st.integers(0, 40), st.sampled_from([None, "w"]),
                            st.integers()), max_size=200)


@settings(max_examples=60, deadline=None)
@given(before=_items, items=_items, snapshot=st.booleans(), capacity=st.sampled_from([4, 128]),
       distinct=st.booleans())
def test_put_all_equals_puts_one_by_one(before: list[Any], items: list[Any], snapshot: bool,
                                        capacity: int, distinct: bool) -> None:
    if distinct:  # the caller's promise: no key twice in items
        items = list({(k, n): (k, n, s) for k, n, s in items}.values())
    slow: CopyOnWriteStateMap[Any, Any, Any] = CopyOnWriteStateMap(initial_capacity=capacity)
    fast: CopyOnWriteStateMap[Any, Any, Any] = CopyOnWriteStateMap(initial_capacity=capacity)
    for k, n, s in before:
        slow.put(k, n, s)
        fast.put(k, n, s)
    snaps = (slow.snapshot(), fast.snapshot()) if snapshot else None
    frozen = sorted(snaps[1], key=repr) if snaps else None
    for k, n, s in items:
        slow.put(k, n, s)
    fast.put_all(items, distinct=distinct)
    assert sorted(fast.entries(), key=repr) == sorted(slow.entries(), key=repr)
    assert len(fast) == len(slow)
    fast.check_invariants()
    if snaps:
        assert sorted(snaps[1], key=repr) == frozen  # a running snapshot never sees the bulk
        for s in snaps:
            s.release()
    for k, n, _s in items[:5]:  # the map keeps working after a bulk insert
        assert fast.get(k, n) == slow.get(k, n)
        assert fast.remove(k, n) == slow.remove(k, n)
    fast.check_invariants()


RANGE = KeyGroupRange(0, 7)


def _raw(table: LmdbStateTable, kg: int, sid: int, key: bytes, ns: bytes, bulk: LmdbBulkLoad
         ) -> bytes:
    return bulk.prefix(kg, sid) + len(key).to_bytes(4, "big") + key + ns


def test_bulk_load_runs_commit_as_they_go_grow_the_map_and_equal_puts(tmp_path: Path) -> None:
    slow = LmdbStateTable(tmp_path / "slow", RANGE, map_size_bytes=1 << 20)
    fast = LmdbStateTable(tmp_path / "fast", RANGE, map_size_bytes=1 << 20)
    try:
        records = [(i % 8, i % 3, f"key-{i % 5000}".encode(), b"" if i % 2 else b"ns",
                    i.to_bytes(8, "big") * 4) for i in range(30_000)]
        with slow.write_batch():
            for kg, sid, k, ns, v in records:
                slow.put(sid, kg, k, ns, v)
        with fast.bulk_load() as bulk:
            for start in range(0, len(records), 1000):  # steps of 1000 records (~50 KB)
                bulk.step(1000 * 50)
                bulk.put_raw([(_raw(fast, kg, sid, k, ns, bulk), v)
                              for kg, sid, k, ns, v in records[start:start + 1000]])
                fast.remove(0, 0, b"key-0", b"ns")  # per-op writes join the same batch
                slow.remove(0, 0, b"key-0", b"ns")
        assert fast.map_size_bytes > 1 << 20  # grown ahead (the data is larger than 1 MiB)
        for sid in range(3):
            for kg in RANGE:
                assert list(fast.entries(sid, kg)) == list(slow.entries(sid, kg))
        assert len(fast) == len(slow)
    finally:
        slow.close()
        fast.close()


def test_bulk_load_map_full_inside_a_step_replays_the_step(tmp_path: Path) -> None:
    t = LmdbStateTable(tmp_path / "t", RANGE, map_size_bytes=1 << 20)
    try:
        with t.bulk_load() as bulk:
            # no step sized the map for this: LMDB's map-full, then grow and replay the journal
            recs = [(_raw(t, 1, 0, f"k{i}".encode(), b"", bulk), b"x" * 200) for i in range(20_000)]
            bulk.put_raw(recs)
        assert len(t) == 20_000
        assert t.get(0, 1, b"k19999", b"") == b"x" * 200
        assert (1 << 20) < t.map_size_bytes <= 16 << 20  # doubled on map-full, not sized ahead
    finally:
        t.close()


def test_bulk_load_refuses_foreign_key_groups_long_keys_and_aborts_on_error(
        tmp_path: Path) -> None:
    t = LmdbStateTable(tmp_path / "t", RANGE, map_size_bytes=1 << 20)
    try:
        with pytest.raises(KeyGroupError), t.bulk_load() as bulk:
            bulk.prefix(8, 0)
        with pytest.raises(UsageError, match="key limit"), t.bulk_load() as bulk:
            bulk.step(100)
            bulk.put_raw([(_raw(t, 1, 0, b"a", b"", bulk), b"1"),
                          (_raw(t, 1, 0, b"k" * 600, b"", bulk), b"2")])
        assert len(t) == 0  # the failed batch's open transaction was aborted
    finally:
        t.close()


def _frozen(obj: object) -> bool:
    """Whether a tracked ``obj`` sits in the permanent generation (``gc.get_objects()`` lists
    generations 0-2 only)."""
    assert gc.is_tracked(obj)
    return all(o is not obj for o in gc.get_objects())


def test_collector_paused_nests_across_threads_and_freezes_only_on_success() -> None:
    was = gc.isenabled()
    gc.enable()
    try:
        inner_started, release = threading.Event(), threading.Event()

        def other() -> None:
            with gcpause.collector_paused():
                inner_started.set()
                release.wait(5)

        t = threading.Thread(target=other)
        with gcpause.collector_paused():
            assert not gc.isenabled()
            t.start()
            inner_started.wait(5)
        assert not gc.isenabled()  # the other restore still runs
        release.set()
        t.join(5)
        assert gc.isenabled()
        junk = [[i] for i in range(1000)]
        with pytest.raises(RuntimeError), gcpause.collector_paused(freeze=True):
            raise RuntimeError("restore failed")
        # the freeze count is no oracle (frozen objects of earlier tests that die leave the
        # permanent generation at any time); whether ``junk`` is frozen is
        assert gc.isenabled() and not _frozen(junk)
        with gcpause.collector_paused(freeze=True):
            pass
        assert gc.isenabled() and _frozen(junk) and all(_frozen(x) for x in junk[:10])
        gc.disable()
        with gcpause.collector_paused():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.unfreeze()
        (gc.enable if was else gc.disable)()


@given(value=_scalars, limit=st.integers(1, 600))
def test_safe_codec_fast_paths_keep_a_small_decoded_size_limit(value: Any, limit: int) -> None:
    """With a limit small enough to refuse short encodings, the fast paths stand aside."""
    data = SafeCodec().encode(value)
    codec = SafeCodec(max_decoded_bytes=limit)
    for _ in range(2):
        try:
            slow: tuple[str, Any] = ("ok", codec._unpickle(data))
        except CorruptObjectError:
            slow = ("corrupt", None)
        assert _fast(codec, data) == slow


# --------------------------------------------------------------------------- fused block loads

_SNAP_STATES = {0: {"name": "v", "kind": "value", "value_codec": "safe"},
                1: {"name": "l", "kind": "list", "value_codec": "safe"}}


@st.composite
def _block(draw: Any) -> tuple[bytes, int]:
    """A snapshot block's content (prefix included) and the entry count its index claims:
    mostly well formed, sometimes with damaged framing, a wrong count or an unknown state."""
    entries = []
    for i in draw(st.lists(st.integers(0, 30), max_size=12, unique=True)):
        sid = draw(st.sampled_from([0, 0, 1, 5]))
        value = SafeCodec().encode(draw(st.integers(-3, 1000)))
        if sid == 1:
            value = struct.pack(">II", 1, len(value)) + value
        ns = draw(st.sampled_from([b"", SafeCodec().encode("w")]))
        k = f"k{i}".encode()
        entries.append(struct.pack(">HI", sid, len(k)) + k + struct.pack(">I", len(ns)) + ns
                       + struct.pack(">I", len(value)) + value)
    body = b"".join(entries)
    count = len(entries)
    damage = draw(st.sampled_from(["none"] * 5 + ["cut", "flip", "count", "tail"]))
    if damage == "cut" and body:
        body = body[:draw(st.integers(0, len(body) - 1))]
    elif damage == "flip" and body:
        i = draw(st.integers(0, len(body) - 1))
        body = body[:i] + bytes([body[i] ^ draw(st.integers(1, 255))]) + body[i + 1:]
    elif damage == "count":
        count = draw(st.integers(0, count + 2))
    elif damage == "tail":
        body += b"\0" * draw(st.integers(1, 20))
    return struct.pack(">HI", 3, count) + body, count


@pytest.mark.parametrize("table", ["heap", "lmdb"])
@settings(max_examples=80, deadline=None)
@given(block=_block())
def test_fused_block_load_equals_the_entry_iterator(table: str, block: tuple[bytes, int],
                                                   tmp_path_factory: Any) -> None:
    """Loading a block by parsing its content (the fast path) and by iterating its entries (the
    generic path) leave the same table, or fail with the same error."""
    from dstl import ChangelogStorage
    from dstl.stores import MemoryBlobStore
    from materializer.backend import ChangelogKeyedStateBackend
    from materializer.options import BackendOptions
    from materializer.replay import load_block
    from materializer.snapshot_format import BlockEntries, IndexEntry

    content, count = block
    entry = IndexEntry(3, 100, 0, count)
    opts = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
    storage = ChangelogStorage(store=MemoryBlobStore())
    outcomes = []
    try:
        for name, wrap in (("fused", lambda b: b), ("generic", lambda b: (e for e in b))):
            b = ChangelogKeyedStateBackend(storage, name, KeyGroupRange(0, 7), 8, table=table,
                                           options=opts,
                                           local_directory=str(tmp_path_factory.mktemp(name)))
            try:
                remap = {sid: b.register_restored_state(m, sid) for sid, m in _SNAP_STATES.items()}
                try:
                    n = load_block(b, 3, wrap(BlockEntries(content, entry, "snap")), remap)
                    got: Any = ("ok", n, sorted(((sid, k, ns, repr(v)) for sid in (0, 1)
                                                 for k, ns, v in b.tables.entries(sid, 3)),
                                                key=repr))
                except CorruptObjectError as exc:
                    got = ("corrupt", str(exc))
                outcomes.append(got)
            finally:
                b.close()
    finally:
        storage.close()
    assert outcomes[0] == outcomes[1]


def test_a_closed_restored_heap_backend_frees_its_state_despite_the_freeze() -> None:
    """gc.freeze() after a heap restore means frozen reference cycles are never collected (the
    backend and its materialization manager are one); close() must drop the tables, so the
    restored state is freed by reference counting anyway."""
    import weakref

    from dstl import ChangelogStorage, DstlOptions
    from dstl.stores import MemoryBlobStore
    from materializer.backend import ChangelogKeyedStateBackend
    from materializer.options import BackendOptions
    from materializer.states import ValueStateDescriptor
    from restore.restore import restore_backend

    opts = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
    storage = ChangelogStorage(store=MemoryBlobStore(), options=DstlOptions(persist_delay_s=0.0))
    try:
        b = ChangelogKeyedStateBackend(storage, "op", KeyGroupRange(0, 7), 8, options=opts)
        st_ = b.get_state(ValueStateDescriptor("v"))
        for i in range(200):
            b.set_current_key(f"k{i}")
            st_.update(i)
        h = b.snapshot(1).result(10)
        b.notify_checkpoint_complete(1)
        b.close()
        r = restore_backend([h], storage, KeyGroupRange(0, 7), options=opts,
                            auto_materialize=False)
        tables = r.tables
        maps = [weakref.ref(tables.table(sid).map_for(kg)) for sid in tables.state_ids()
                for kg in range(8)]
        assert gc.get_freeze_count() > 0
        r.close()
        del r, tables
        assert all(m() is None for m in maps)  # freed without any collection
    finally:
        gc.unfreeze()
        storage.close()
