"""LocalFileCache.prefetch: downloads a restore's objects before their leases, through
the cache's single flight, and is only ever a hint.

Objects live in an fsspec memory filesystem wrapped by ``FaultyFileSystem`` and reached through
``FsspecBlobStore`` (the production seam), so "downloaded once" is counted at the filesystem
(``cat_file`` calls per path). A prefetch thread is held inside its download by a ``verify``
function that waits on an event (the same seam a lease uses), so every race here is forced, not
slept into. Checked: each object fetched once and the lease joins the prefetch; a failed, corrupt
or missing object gives the lease exactly the error it gives without a prefetch; a transient
failure of the prefetch is forgotten; the budget (never evicts, never takes more than its share,
never makes a lease fail that fits without it); cancel and close leave no thread and no file;
restore_backend with and without prefetch.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import test_cache
from support.faulty_fs import FaultyFileSystem, permanent_error

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import (
    CacheFullError,
    ClosedError,
    CorruptObjectError,
    DstlError,
    ObjectNotFoundError,
    StorageError,
    UsageError,
)
from dstl.stores import FsspecBlobStore
from dstl.timer import ManualTimer
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle
from materializer.options import BackendOptions
from materializer.states import ValueStateDescriptor
from restore import LocalFileCache, RestoreStats, restore_backend
from restore.cache import PREFETCH_BUDGET_SHARE
from restore.leasing import PrefetchItem

TTL = 60.0
WAIT = 10.0
MP = 32
OPTS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)


# test_cache's fixtures: a memory filesystem behind the fault wrapper, a store on a fresh root,
# a manual timer (bound by assignment, so that test parameters do not shadow an import)
ffs = test_cache.ffs
root = test_cache.root
store = test_cache.store
timer = test_cache.timer


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dstl-prefetch"]


def _leftovers(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.exists() else []


def _put(store: FsspecBlobStore, n: int, size: int = 100) -> dict[str, bytes]:
    objects = {f"obj/{i:02d}": bytes([i]) * size for i in range(n)}
    for k, v in objects.items():
        store.put(k, v)
    return objects


def _gets(ffs: FaultyFileSystem, root: str, keys: list[str]) -> list[int]:
    return [ffs.calls("cat_file", f"{root}/{k}") for k in keys]


class Gate:
    """A verify function that holds the download it runs in until ``open()``; ``fail`` makes
    every call after the gate raise what a corrupt object raises."""

    def __init__(self, *, fail: bool = False) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.fail = fail
        self.calls = 0

    def __call__(self, data: bytes | memoryview, key: str) -> None:
        self.calls += 1
        self.entered.set()
        assert self.go.wait(WAIT)
        if self.fail:
            raise CorruptObjectError(key, 3, "gate: bad bytes")

    def open(self) -> None:
        self.go.set()


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=run, name="test-lease")
    t.start()
    return t, out


# --------------------------------------------------------------------------- downloads once


def test_prefetched_objects_are_fetched_once_and_leases_take_them(
        ffs: FaultyFileSystem, root: str, store: FsspecBlobStore, timer: ManualTimer,
        tmp_path: Path) -> None:
    objects = _put(store, 6)
    keys = list(objects)
    with LocalFileCache(tmp_path / "c", TTL, timer=timer) as cache:
        # each object once however often it is named
        ticket = cache.prefetch(store, [PrefetchItem(k) for k in keys + keys[:3]])
        st = cache.wait_for_stats(lambda s: s["files"] == 6 and not s["prefetch_queued"])
        assert (st["prefetch_started"], st["downloads"], st["leases_open"]) == (6, 6, 0)
        assert st["bytes_prefetched"] == 600
        for k in keys:
            with cache.lease(store, k) as lease:
                assert lease.read(0, lease.size) == objects[k]
        st = cache.stats()
        assert (st["downloads"], st["hits"], st["prefetch_joined"], st["bytes_prefetched"]) == \
            (6, 6, 6, 0)
        assert _gets(ffs, root, keys) == [1] * 6
        # a second prefetch of cached objects does nothing
        again = cache.prefetch(store, [PrefetchItem(k) for k in keys])
        cache.wait_for_stats(lambda s: s["prefetch_present"] == 6)
        again.cancel()
        ticket.cancel()
        assert _prefetch_threads() == []
        assert _gets(ffs, root, keys) == [1] * 6


def test_a_lease_joins_the_prefetch_in_flight(ffs: FaultyFileSystem, root: str,
                                              store: FsspecBlobStore, timer: ManualTimer,
                                              tmp_path: Path) -> None:
    objects = _put(store, 1)
    key = next(iter(objects))
    gate = Gate()
    with LocalFileCache(tmp_path / "c", TTL, timer=timer) as cache:
        ticket = cache.prefetch(store, [PrefetchItem(key, gate)])
        assert gate.entered.wait(WAIT)  # the prefetch holds the flight, inside verify
        t, out = _in_thread(lambda: cache.lease(store, key, verify=gate).read(0, 100))
        cache.wait_for_stats(lambda s: s["waits"] == 1)
        gate.open()
        t.join(WAIT)
        assert out == [objects[key]]
        st = cache.stats()
        assert (st["downloads"], st["prefetch_joined"], st["waits"]) == (1, 1, 1)
        assert gate.calls == 1  # verified once, by the prefetch
        assert _gets(ffs, root, [key]) == [1]
        ticket.cancel()


# --------------------------------------------------------------------------- failures


def _missing(store: FsspecBlobStore, ffs: FaultyFileSystem, root: str, key: str) -> None:
    store.delete([key])


def _broken_store(store: FsspecBlobStore, ffs: FaultyFileSystem, root: str, key: str) -> None:
    ffs.fail_reads([f"{root}/{key}"], error=permanent_error)


@pytest.mark.parametrize("fault", ["missing", "store error", "corrupt"])
@pytest.mark.parametrize("when", ["after", "joined"])
def test_a_failed_prefetch_gives_the_lease_the_error_it_gives_without_one(
        ffs: FaultyFileSystem, root: str, store: FsspecBlobStore, timer: ManualTimer,
        tmp_path: Path, fault: str, when: str) -> None:
    """``after``: the prefetch failed before the lease came; ``joined``: the lease waited on the
    prefetch's flight, which then failed. Either way the lease downloads again and raises its
    own error, the same (type, object, message) as a lease of a cache that never prefetched."""
    key = next(iter(_put(store, 1)))
    corrupt = Gate(fail=True)  # rejects every download (open: it does not hold them)
    corrupt.open()
    verify: Gate | None = corrupt if fault == "corrupt" else None
    if fault == "missing":
        _missing(store, ffs, root, key)
    elif fault == "store error":
        _broken_store(store, ffs, root, key)
    expected_type = {"missing": ObjectNotFoundError, "store error": StorageError,
                     "corrupt": CorruptObjectError}[fault]
    with LocalFileCache(tmp_path / "plain", TTL, timer=timer) as plain, \
            pytest.raises(DstlError) as without:
        plain.lease(store, key, verify=verify)
    assert isinstance(without.value, expected_type)
    with LocalFileCache(tmp_path / "c", TTL, timer=timer) as cache:
        gate = Gate(fail=fault == "corrupt")
        if when == "after":
            ticket = cache.prefetch(store, [PrefetchItem(key, verify)])
            cache.wait_for_stats(lambda s: s["prefetch_failed"] == 1)
            out: list[object] = []
            try:
                cache.lease(store, key, verify=verify)
            except DstlError as exc:
                out.append(exc)
        else:
            if fault == "corrupt":
                verify = gate
            else:  # hold the flight before its download: the fault hits after the lease joins
                gate_get = _hold_gets(ffs, gate)
                gate_get.__enter__()
            ticket = cache.prefetch(store, [PrefetchItem(key, verify)])
            assert gate.entered.wait(WAIT)
            t, out = _in_thread(lambda: cache.lease(store, key, verify=verify))
            cache.wait_for_stats(lambda s: s["waits"] == 1)
            gate.open()
            t.join(WAIT)
            if fault != "corrupt":
                gate_get.__exit__(None, None, None)
        assert len(out) == 1 and isinstance(out[0], DstlError), out
        err = out[0]
        assert type(err) is type(without.value)
        assert getattr(err, "key", None) == getattr(without.value, "key", None)
        assert str(err) == str(without.value)
        st = cache.stats()
        assert (st["prefetch_failed"], st["files"], st["leases_open"]) == (1, 0, 0)
        assert st["download_failures"] == 1  # the lease's own
        ticket.cancel()
    assert _leftovers(tmp_path / "c") == []


@contextlib.contextmanager
def _hold_gets(ffs: FaultyFileSystem, gate: Gate) -> Iterator[None]:
    """Make the first ``cat_file`` wait at ``gate`` (the prefetch's GET), then go on."""
    real = ffs.cat_file
    held = threading.Event()

    def cat_file(path: str, start: int | None = None, end: int | None = None,
                 **kwargs: object) -> bytes:
        if not held.is_set():
            held.set()
            gate.entered.set()
            assert gate.go.wait(WAIT)
        return real(path, start=start, end=end, **kwargs)

    ffs.cat_file = cat_file  # type: ignore[method-assign]
    try:
        yield
    finally:
        ffs.cat_file = real  # type: ignore[method-assign]


def test_a_transient_prefetch_failure_is_forgotten_and_the_lease_succeeds(
        ffs: FaultyFileSystem, root: str, store: FsspecBlobStore, timer: ManualTimer,
        tmp_path: Path) -> None:
    objects = _put(store, 3)
    keys = list(objects)
    ffs.fail_reads([f"{root}/{keys[1]}"], count=1, ops=("cat_file",))
    with LocalFileCache(tmp_path / "c", TTL, timer=timer) as cache:
        ticket = cache.prefetch(store, [PrefetchItem(k) for k in keys])
        cache.wait_for_stats(lambda s: s["prefetch_failed"] + s["files"] == 3)
        for k in keys:
            with cache.lease(store, k) as lease:
                assert lease.read(0, lease.size) == objects[k]
        st = cache.stats()
        assert (st["prefetch_failed"], st["prefetch_joined"], st["download_failures"]) == \
            (1, 2, 0)
        assert _gets(ffs, root, keys) == [1, 2, 1]  # the failed one once more, by its lease
        ticket.cancel()


def test_bad_items_are_left_to_the_lease(store: FsspecBlobStore, timer: ManualTimer,
                                         tmp_path: Path) -> None:
    key = next(iter(_put(store, 1)))
    with LocalFileCache(tmp_path / "c", TTL, timer=timer) as cache:
        with pytest.raises(UsageError):
            cache.prefetch(store, [key])  # type: ignore[list-item]
        ticket = cache.prefetch(store, [PrefetchItem("../escape"), PrefetchItem(key, None, -1)])
        ticket.cancel()
        st = cache.stats()
        assert (st["prefetch_started"], st["files"]) == (0, 0)
        with pytest.raises(DstlError):
            cache.lease(store, "../escape")
        with pytest.raises(UsageError):
            cache.lease(store, key, size_hint=-1)


# --------------------------------------------------------------------------- the budget


def test_a_prefetch_never_evicts_and_stays_within_its_share(
        ffs: FaultyFileSystem, root: str, store: FsspecBlobStore, timer: ManualTimer,
        tmp_path: Path) -> None:
    objects = _put(store, 6, size=300)
    keys = list(objects)
    with LocalFileCache(tmp_path / "c", TTL, max_bytes=1000, timer=timer) as cache:
        held = cache.lease(store, keys[0])
        ticket = cache.prefetch(store, [PrefetchItem(k, None, 300) for k in keys])
        st = cache.wait_for_stats(lambda s: not s["prefetch_queued"]
                                  and not s["downloads_in_flight"])
        # 300 B leased; the share is 500 B: one prefetch of 300 B fits, the rest is skipped
        assert 1000 * PREFETCH_BUDGET_SHARE == 500
        assert (st["prefetch_present"], st["prefetch_started"], st["prefetch_skipped"]) == \
            (1, 1, 4)
        assert st["bytes_prefetched"] == 300 and st["evictions"] == 0
        assert held.read(0, 300) == objects[keys[0]]  # never evicted
        # every later lease fits, as it would without the prefetch (each evicts idle files)
        for k in keys[1:]:
            with cache.lease(store, k) as lease:
                assert lease.read(0, 300) == objects[k]
        held.release()
        ticket.cancel()
        assert _gets(ffs, root, keys) == [1] * 6


def test_a_lease_waits_for_a_prefetch_holding_the_room_instead_of_failing(
        store: FsspecBlobStore, timer: ManualTimer, tmp_path: Path) -> None:
    objects = _put(store, 3, size=400)
    x, y, z = objects
    gate = Gate()
    with LocalFileCache(tmp_path / "c", TTL, max_bytes=1000, timer=timer) as cache:
        held = cache.lease(store, x)
        ticket = cache.prefetch(store, [PrefetchItem(y, gate, 400)])
        assert gate.entered.wait(WAIT)  # 400 B leased + 400 B reserved by the prefetch
        t, out = _in_thread(lambda: cache.lease(store, z))
        # the lease of z waits for the prefetch rather than raising CacheFullError
        assert not t.join(0.2) and t.is_alive()
        gate.open()
        t.join(WAIT)
        assert len(out) == 1 and not isinstance(out[0], BaseException), out
        lease_z = out[0]
        st = cache.stats()
        assert (st["prefetch_started"], st["prefetch_evicted"], st["evictions_budget"]) == \
            (1, 1, 1)
        assert held.read(0, 400) == objects[x]
        lease_z.release()  # type: ignore[attr-defined]
        held.release()
        ticket.cancel()


def test_a_lease_that_cannot_fit_raises_as_without_prefetch(store: FsspecBlobStore,
                                                            timer: ManualTimer,
                                                            tmp_path: Path) -> None:
    a, b = _put(store, 2, size=700)
    with LocalFileCache(tmp_path / "c", TTL, max_bytes=1000, timer=timer) as cache:
        held = cache.lease(store, a)
        ticket = cache.prefetch(store, [PrefetchItem(b)])  # no size hint: a head first
        cache.wait_for_stats(lambda s: s["prefetch_skipped"] == 1)
        with pytest.raises(CacheFullError, match="does not fit"):
            cache.lease(store, b)
        held.release()
        ticket.cancel()
    small = {f"small/{i}": b"s" * 400 for i in range(2)}
    for k, v in small.items():
        store.put(k, v)
    with LocalFileCache(tmp_path / "d", TTL, max_bytes=1000, timer=timer,
                        on_full="direct") as direct:
        # the first fits the prefetch share (500 B), the second not: skipped, not direct
        ticket = direct.prefetch(store, [PrefetchItem(k) for k in small])
        direct.wait_for_stats(lambda s: s["files"] == 1 and s["prefetch_skipped"] == 1)
        assert direct.stats()["direct_leases"] == 0  # a prefetch never serves direct reads
        ticket.cancel()


def test_an_unleased_prefetch_expires_like_an_idle_file(store: FsspecBlobStore,
                                                        timer: ManualTimer,
                                                        tmp_path: Path) -> None:
    key = next(iter(_put(store, 1)))
    with LocalFileCache(tmp_path / "c", TTL, timer=timer) as cache:
        ticket = cache.prefetch(store, [PrefetchItem(key)])
        cache.wait_for_stats(lambda s: s["files"] == 1)
        ticket.cancel()
        timer.advance(TTL)
        st = cache.stats()
        assert (st["files"], st["evictions_ttl"], st["prefetch_evicted"]) == (0, 1, 1)
        assert _leftovers(tmp_path / "c") == [".dstl-cache.lock"]


# --------------------------------------------------------------------------- cancel and close


def test_cancel_drops_what_has_not_started_and_waits_for_the_rest(
        store: FsspecBlobStore, timer: ManualTimer, tmp_path: Path) -> None:
    objects = _put(store, 10)
    gate = Gate()
    with LocalFileCache(tmp_path / "c", TTL, timer=timer, prefetch_threads=1) as cache:
        ticket = cache.prefetch(store, [PrefetchItem(k, gate) for k in objects])
        assert gate.entered.wait(WAIT)
        threading.Timer(0.1, gate.open).start()  # cancel() must wait for this download
        ticket.cancel()
        st = cache.stats()
        assert (st["prefetch_started"], st["prefetch_cancelled"], st["files"]) == (1, 9, 1)
        assert (st["prefetch_queued"], st["downloads_in_flight"]) == (0, 0)
        assert _prefetch_threads() == []
        ticket.cancel()  # idempotent


def test_closing_during_prefetch_leaves_no_thread_and_no_file(
        ffs: FaultyFileSystem, store: FsspecBlobStore, tmp_path: Path) -> None:
    objects = _put(store, 12, size=4096)
    ffs.latency_s = 0.05
    cache_dir = tmp_path / "c"
    cache = LocalFileCache(cache_dir, TTL)
    try:
        cache.prefetch(store, [PrefetchItem(k) for k in objects])
        cache.wait_for_stats(lambda s: s["files"] >= 1 and s["downloads_in_flight"] >= 1)
    finally:
        cache.close()
    assert _prefetch_threads() == []
    assert not cache_dir.exists()  # no published file, no temp file, no lock
    st = cache.stats()
    assert st["prefetch_cancelled"] >= 1 and st["downloads_in_flight"] == 0
    with pytest.raises(ClosedError):
        cache.prefetch(store, [PrefetchItem(next(iter(objects)))])


# --------------------------------------------------------------------------- restore_backend


def _handle(storage: ChangelogStorage, table: str) -> tuple[ChangelogStateBackendHandle,
                                                            dict[str, int]]:
    """A snapshot (v1 from heap, v2 from LMDB) and three checkpoints of log after it."""
    kgs = KeyGroupRange(0, MP - 1)
    b = ChangelogKeyedStateBackend(storage, "op", kgs, MP, table=table, options=OPTS)
    st = b.get_state(ValueStateDescriptor("v"))
    model: dict[str, int] = {}
    for i in range(200):
        b.set_current_key(f"k{i}")
        st.update(i)
        model[f"k{i}"] = i
    b.snapshot(1).result(WAIT)
    b.notify_checkpoint_complete(1)
    assert b.materialize_now(WAIT) is not None
    handle = None
    for cp in range(2, 5):
        for i in range(0, 200, cp):
            b.set_current_key(f"k{i}")
            st.update(i * cp)
            model[f"k{i}"] = i * cp
        handle = b.snapshot(cp).result(WAIT)
        b.notify_checkpoint_complete(cp)
    b.close()
    assert handle is not None and handle.materialized and len(handle.non_materialized) >= 1
    return handle, model


def _values(b: ChangelogKeyedStateBackend, keys: list[str]) -> dict[str, int]:
    st = b.get_state(ValueStateDescriptor("v"))
    out = {}
    for k in keys:
        b.set_current_key(k)
        out[k] = st.value()
    return out


@pytest.mark.parametrize("made_by", ["heap", "lmdb"])
def test_restore_backend_prefetches_each_object_once_and_ends_its_threads(
        ffs: FaultyFileSystem, root: str, tmp_path: Path, made_by: str) -> None:
    with ChangelogStorage(root, options=DstlOptions(persist_delay_s=0.0),
                          filesystem=ffs) as storage:
        handle, model = _handle(storage, made_by)
        objects = list(handle.referenced_keys())
        kgs = KeyGroupRange(0, MP - 1)
        before = _gets(ffs, root, objects)
        with LocalFileCache(tmp_path / "c", TTL, timer=ManualTimer()) as cache:
            stats = RestoreStats()
            r = restore_backend([handle], storage, kgs, table="lmdb", cache=cache, options=OPTS,
                                stats=stats)
            try:
                assert _values(r, list(model)) == model
            finally:
                r.close()
            assert _prefetch_threads() == []  # the restore's prefetch ended with it
            st = cache.stats()
            assert stats["prefetched_objects"] == len(objects)
            # a job still queued when the restore ended was dropped (cancelled)
            assert st["prefetch_started"] + st["prefetch_present"] \
                + st["prefetch_cancelled"] == len(objects)
            assert st["downloads"] == len(objects)
            assert st["prefetch_failed"] == st["prefetch_skipped"] == 0
            assert [a - b for a, b in zip(_gets(ffs, root, objects), before)] == \
                [1] * len(objects)
        # a restore that fails midway: the same error as without prefetch, no thread left
        seg = handle.non_materialized[-1].change_sets[-1].key
        storage.store.delete([seg])
        errors = []
        for prefetch in (False, True):
            with LocalFileCache(tmp_path / f"f{prefetch}", TTL, timer=ManualTimer()) as cache, \
                    pytest.raises(ObjectNotFoundError) as exc:
                restore_backend([handle], storage, kgs, cache=cache, options=OPTS,
                                prefetch=prefetch)
            errors.append((type(exc.value), exc.value.key, str(exc.value)))
            assert _prefetch_threads() == []
        assert errors[0] == errors[1] and errors[0][1] == seg
