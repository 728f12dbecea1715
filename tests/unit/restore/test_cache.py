"""LocalFileCache: single flight, leases, idle TTL, size budget, start-up, close, fork (G4, G7, G8).

Objects live in an fsspec memory filesystem wrapped by ``FaultyFileSystem`` and reached through
``FsspecBlobStore`` (the production seam), so "downloaded once" is counted at the filesystem.
Time moves only through ``ManualTimer``; threads synchronise on events, never on sleeps.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from support.faulty_fs import FaultyFileSystem
from support.segments import make_change_set

from dstl.errors import (
    CacheError,
    CacheFullError,
    ClosedError,
    ConfigError,
    CorruptObjectError,
    LeaseError,
    ObjectNotFoundError,
    TruncatedObjectError,
    UsageError,
)
from dstl.retry import RetryPolicy
from dstl.segment import decode_segment, encode_segment
from dstl.stores import FsspecBlobStore
from dstl.timer import ManualTimer
from restore import CacheLease, LocalFileCache, verify_segment

TTL = 60.0
WAIT = 10.0


@pytest.fixture
def ffs() -> Iterator[FaultyFileSystem]:
    fs = FaultyFileSystem(fsspec.filesystem("memory", skip_instance_cache=True))
    yield fs
    fs.clear_faults()


@pytest.fixture
def root() -> str:
    return f"/cache-test-{uuid.uuid4().hex}"


@pytest.fixture
def store(ffs: FaultyFileSystem, root: str) -> Iterator[FsspecBlobStore]:
    s = FsspecBlobStore(ffs, root, retry=RetryPolicy(max_attempts=1))
    yield s
    s.close()
    with contextlib.suppress(FileNotFoundError):
        ffs.inner.rm(root, recursive=True)


@pytest.fixture
def timer() -> ManualTimer:
    return ManualTimer()


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def cache(cache_dir: Path, timer: ManualTimer) -> Iterator[LocalFileCache]:
    c = LocalFileCache(cache_dir, idle_ttl_s=TTL, timer=timer)
    yield c
    c.close()
    assert not cache_dir.exists(), list(cache_dir.iterdir())


def segment(tag: str, n: int = 3) -> bytes:
    data, _ = encode_segment([make_change_set(f"op/{tag}", i, [(i, b"%s-%d" % (tag.encode(), i))
                                                              * 1]) for i in range(n)])
    return data


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != ".dstl-cache.lock") \
        if directory.exists() else []


def cat_calls(ffs: FaultyFileSystem, root: str, key: str) -> int:
    return int(ffs.calls("cat_file", f"{root}/{key}"))


# ----------------------------------------------------------------------------- single flight


def test_eight_concurrent_leases_of_one_object_download_it_once(
        cache: LocalFileCache, store: FsspecBlobStore, ffs: FaultyFileSystem, root: str) -> None:
    key = "dstl/seg-0001"
    data = segment("a")
    store.put(key, data)
    entered, gate = threading.Event(), threading.Event()

    def verify(d: bytes | memoryview, k: str) -> None:
        entered.set()
        assert gate.wait(WAIT)  # hold the flight open until all the others wait for it
        decode_segment(d, k)

    barrier = threading.Barrier(8)
    leases: list[CacheLease | None] = [None] * 8
    errors: list[BaseException] = []

    def open_lease(i: int) -> None:
        barrier.wait()
        try:
            leases[i] = cache.lease(store, key, verify=verify)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_lease, args=(i,), name=f"test-lease-{i}")
               for i in range(8)]
    for t in threads:
        t.start()
    assert entered.wait(WAIT)
    st = cache.wait_for_stats(lambda s: s["waits"] == 7)
    assert st["downloads_in_flight"] == 1 and st["files"] == 0
    gate.set()
    for t in threads:
        t.join(WAIT)
    assert errors == []
    st = cache.stats()
    assert (st["downloads"], st["hits"], st["waits"], st["leases_open"], st["files"]) == \
        (1, 7, 7, 8, 1)
    assert st["bytes_downloaded"] == st["bytes_cached"] == len(data)
    assert cat_calls(ffs, root, key) == 1
    assert ffs.calls("info") == 0  # no budget: no head request
    assert {lease.path for lease in leases if lease} == {leases[0].path if leases[0] else None}
    for lease in leases:
        assert lease is not None
        assert lease.read(0, len(data)) == data
        lease.release()
    assert cache.stats()["leases_open"] == 0
    assert cat_calls(ffs, root, key) == 1


def test_no_lock_is_held_while_a_download_runs(cache: LocalFileCache,
                                               store: FsspecBlobStore) -> None:
    store.put("slow", b"s" * 100)
    store.put("fast", b"f" * 10)
    entered, gate = threading.Event(), threading.Event()

    def hold(d: bytes | memoryview, k: str) -> None:
        entered.set()
        assert gate.wait(WAIT)

    done: list[bytes] = []
    t = threading.Thread(target=lambda: done.append(
        _read_all(cache.lease(store, "slow", verify=hold))), name="test-slow")
    t.start()
    try:
        assert entered.wait(WAIT)
        with cache.lease(store, "fast") as lease:  # completes while "slow" is mid-flight
            assert lease.read(0, 10) == b"f" * 10
        assert cache.stats()["downloads_in_flight"] == 1
    finally:
        gate.set()
        t.join(WAIT)
    assert done == [b"s" * 100]


def _read_all(lease: CacheLease) -> bytes:
    with lease:
        return lease.read(0, lease.size)


def test_objects_of_different_stores_with_the_same_key_are_different_entries(
        cache: LocalFileCache, ffs: FaultyFileSystem, root: str) -> None:
    a = FsspecBlobStore(ffs, root + "/a")
    b = FsspecBlobStore(ffs, root + "/b")
    a.put("k", b"from a")
    b.put("k", b"from b")
    with cache.lease(a, "k") as la, cache.lease(b, "k") as lb:
        assert (la.read(0, 6), lb.read(0, 6)) == (b"from a", b"from b")
    assert cache.stats()["downloads"] == 2


# ----------------------------------------------------------------------------- leases


def test_lease_reads_ranges_and_names_its_object(cache: LocalFileCache,
                                                 store: FsspecBlobStore,
                                                 cache_dir: Path) -> None:
    data = bytes(range(256)) * 4
    store.put("dstl/obj", data)
    with cache.lease(store, "dstl/obj") as lease:
        assert (lease.key, lease.size, lease.direct) == ("dstl/obj", len(data), False)
        assert lease.path is not None and Path(lease.path).parent == cache_dir
        assert Path(lease.path).read_bytes() == data
        assert lease.read(10, 20) == data[10:30]
        assert lease.read(len(data), 0) == b""
        with pytest.raises(TruncatedObjectError, match="dstl/obj") as ei:
            lease.read(1000, 100)
        assert (ei.value.key, ei.value.offset, ei.value.got_len) == ("dstl/obj", 1000, 24)
        with pytest.raises(TruncatedObjectError):
            lease.read(len(data) + 1, 0)  # past the end, even for nothing
        with pytest.raises(UsageError):
            lease.read(-1, 2)


def test_double_release_is_a_typed_error(cache: LocalFileCache, store: FsspecBlobStore) -> None:
    store.put("k", b"x")
    lease = cache.lease(store, "k")
    lease.release()
    with pytest.raises(LeaseError, match="released twice"):
        lease.release()
    assert cache.stats()["leases_open"] == 0


def test_use_after_release_is_a_typed_error(cache: LocalFileCache,
                                            store: FsspecBlobStore) -> None:
    store.put("k", b"xyz")
    with cache.lease(store, "k") as lease:
        pass
    assert lease.released
    with pytest.raises(LeaseError, match="after its lease was released"):
        lease.read(0, 1)
    with pytest.raises(LeaseError):  # explicit release after the with block: a second release
        lease.release()


def test_context_manager_after_explicit_release_does_not_release_again(
        cache: LocalFileCache, store: FsspecBlobStore) -> None:
    store.put("k", b"xyz")
    with cache.lease(store, "k") as lease, cache.lease(store, "k"):
        lease.release()
        assert cache.stats()["leases_open"] == 1  # the other lease is not touched
    assert cache.stats()["leases_open"] == 0


def test_missing_object_is_not_found_and_not_poisoned(cache: LocalFileCache,
                                                      store: FsspecBlobStore,
                                                      cache_dir: Path) -> None:
    with pytest.raises(ObjectNotFoundError, match="late"):
        cache.lease(store, "late")
    assert files(cache_dir) == []
    store.put("late", b"now")
    with cache.lease(store, "late") as lease:
        assert lease.read(0, 3) == b"now"
    assert cache.stats()["download_failures"] == 1


def test_corrupt_segment_names_the_key_and_leaves_nothing(
        cache: LocalFileCache, store: FsspecBlobStore, ffs: FaultyFileSystem, root: str,
        cache_dir: Path) -> None:
    data = bytearray(segment("c"))
    data[20] ^= 0x01
    store.put("dstl/bad", bytes(data))
    with pytest.raises(CorruptObjectError, match="dstl/bad") as ei:
        cache.lease(store, "dstl/bad", verify=verify_segment)
    assert ei.value.key == "dstl/bad"
    assert files(cache_dir) == []
    st = cache.stats()
    assert (st["files"], st["leases_open"], st["bytes_cached"]) == (0, 0, 0)
    # repaired in place (tests only: the store is write-once) -> the next lease downloads again
    ffs.inner.pipe_file(f"{root}/dstl/bad", segment("c"))
    with cache.lease(store, "dstl/bad", verify=verify_segment) as lease:
        assert lease.size == len(data)


def test_a_verify_that_raises_a_foreign_error_becomes_corrupt_object_error(
        cache: LocalFileCache, store: FsspecBlobStore) -> None:
    store.put("k", b"not json")

    def bad(d: bytes | memoryview, k: str) -> None:
        raise ValueError("expected JSON")

    with pytest.raises(CorruptObjectError, match="k at offset 0: verification failed") as ei:
        cache.lease(store, "k", verify=bad)
    assert isinstance(ei.value.__cause__, ValueError)


def test_unsafe_keys_and_bad_hints_are_rejected(cache: LocalFileCache,
                                                store: FsspecBlobStore) -> None:
    with pytest.raises(UsageError):
        cache.lease(store, "../etc/passwd")
    with pytest.raises(UsageError):
        cache.lease(store, "k", size_hint=-1)


# ----------------------------------------------------------------------------- idle TTL


def test_idle_file_is_evicted_after_the_ttl(cache: LocalFileCache, store: FsspecBlobStore,
                                            timer: ManualTimer, cache_dir: Path) -> None:
    store.put("k", b"data")
    with cache.lease(store, "k"):
        assert timer.pending() == []  # a leased file has no eviction scheduled
    assert timer.pending() == [TTL]
    timer.advance(TTL - 0.001)
    assert cache.stats()["files"] == 1 and len(files(cache_dir)) == 1
    timer.advance(0.001)
    st = cache.stats()
    assert (st["files"], st["evictions_ttl"], st["evictions"], st["bytes_cached"]) == (0, 1, 1, 0)
    assert files(cache_dir) == []


def test_reuse_cancels_the_eviction_and_earlier_timers_never_fire(
        cache: LocalFileCache, store: FsspecBlobStore, timer: ManualTimer,
        ffs: FaultyFileSystem, root: str) -> None:
    """Flink's quirk: a cleanup scheduled by an earlier close was not cancelled, so the file went
    ``idle-timeout`` after that earlier close. Here it goes ``idle_ttl_s`` after the last one."""
    store.put("k", b"data")
    cache.lease(store, "k").release()  # t=0: eviction due at 60
    timer.advance(30)
    lease = cache.lease(store, "k")  # t=30: a hit cancels it
    assert timer.pending() == []
    lease.release()  # due at 90
    timer.advance(30)  # t=60: the first timer would have fired here
    assert cache.stats()["files"] == 1
    timer.advance(29.9)
    assert cache.stats()["files"] == 1
    timer.advance(0.1)
    assert cache.stats()["files"] == 0
    assert cat_calls(ffs, root, "k") == 1


def test_a_leased_file_outlives_any_ttl(cache: LocalFileCache, store: FsspecBlobStore,
                                        timer: ManualTimer) -> None:
    store.put("k", b"data")
    cache.lease(store, "k").release()
    with cache.lease(store, "k") as lease:
        timer.advance(10 * TTL)
        assert lease.read(0, 4) == b"data"
        assert cache.stats()["files"] == 1
    timer.advance(TTL)
    assert cache.stats()["files"] == 0


def test_reuse_after_eviction_downloads_again(cache: LocalFileCache, store: FsspecBlobStore,
                                              timer: ManualTimer, ffs: FaultyFileSystem,
                                              root: str) -> None:
    store.put("k", b"data")
    cache.lease(store, "k").release()
    timer.advance(TTL)
    with cache.lease(store, "k") as lease:
        assert lease.read(0, 4) == b"data"
    st = cache.stats()
    assert (st["downloads"], st["hits"]) == (2, 0)
    assert cat_calls(ffs, root, "k") == 2


def test_zero_ttl_evicts_at_the_next_timer_turn(cache_dir: Path, store: FsspecBlobStore) -> None:
    timer = ManualTimer()
    with LocalFileCache(cache_dir, idle_ttl_s=0, timer=timer) as c:
        store.put("k", b"x")
        c.lease(store, "k").release()
        timer.advance(0)
        assert c.stats()["files"] == 0


# ----------------------------------------------------------------------------- size budget


def _budget_cache(cache_dir: Path, timer: ManualTimer, max_bytes: int,
                  **kw: object) -> LocalFileCache:
    return LocalFileCache(cache_dir, idle_ttl_s=TTL, max_bytes=max_bytes, timer=timer,
                          **kw)  # type: ignore[arg-type]


def test_lru_eviction_keeps_the_budget(cache_dir: Path, timer: ManualTimer,
                                       store: FsspecBlobStore) -> None:
    for k in "abcd":
        store.put(k, k.encode() * 100)
    with _budget_cache(cache_dir, timer, 250) as c:
        for k in "ab":
            c.lease(store, k).release()
        c.lease(store, "c").release()  # evicts a (least recently used)
        assert _cached_keys(c, store) == {"b", "c"}
        c.lease(store, "b").release()  # b is now more recent than c
        c.lease(store, "d").release()  # evicts c
        assert _cached_keys(c, store) == {"b", "d"}
        st = c.stats()
        assert (st["evictions_budget"], st["files"], st["bytes_cached"]) == (2, 2, 200)
        assert st["bytes_cached"] <= 250
        assert len(files(cache_dir)) == 2


def _cached_keys(c: LocalFileCache, store: FsspecBlobStore) -> set[str]:
    book = c._book  # the cache's entries (restore.cache_book)
    with book.cond:
        return {key for (loc, key), e in book.lru.items() if loc == store.location}


def test_eviction_never_removes_a_leased_file(cache_dir: Path, timer: ManualTimer,
                                              store: FsspecBlobStore) -> None:
    for k in "abc":
        store.put(k, k.encode() * 100)
    with _budget_cache(cache_dir, timer, 250) as c:
        held = c.lease(store, "a")  # the oldest, but leased
        c.lease(store, "b").release()
        with c.lease(store, "c") as lc:  # needs room: b goes, a stays
            assert _cached_keys(c, store) == {"a", "c"}
            assert held.read(0, 100) == b"a" * 100
            assert lc.read(0, 3) == b"ccc"
        held.release()


def test_everything_leased_gives_cache_full_naming_sizes_and_setting(
        cache_dir: Path, timer: ManualTimer, store: FsspecBlobStore) -> None:
    for k in "ab":
        store.put(k, k.encode() * 100)
    with _budget_cache(cache_dir, timer, 150) as c, c.lease(store, "a"):
        with pytest.raises(CacheFullError, match=r"b \(100 bytes\).*max_bytes=150.*100 bytes "
                                                 r"are held by open leases.*on_full='direct'"):
            c.lease(store, "b")
        st = c.stats()
        assert (st["files"], st["leases_open"], st["bytes_reserved"]) == (1, 1, 0)
        assert st["downloads"] == 1  # the refused object was never downloaded
        assert len(files(cache_dir)) == 1


def test_an_object_bigger_than_the_budget_gives_cache_full(cache_dir: Path, timer: ManualTimer,
                                                           store: FsspecBlobStore) -> None:
    store.put("big", b"x" * 1000)
    with _budget_cache(cache_dir, timer, 999) as c, \
            pytest.raises(CacheFullError, match="larger than the restore cache budget"):
        c.lease(store, "big")


def test_direct_mode_serves_ranged_reads_without_a_local_file(
        cache_dir: Path, timer: ManualTimer, store: FsspecBlobStore, ffs: FaultyFileSystem,
        root: str) -> None:
    data = bytes(range(200)) * 5
    store.put("big", data)
    with _budget_cache(cache_dir, timer, 100, on_full="direct") as c:
        with c.lease(store, "big", size_hint=1000) as lease:
            assert lease.direct and lease.path is None and lease.size == 1000
            assert lease.read(5, 10) == data[5:15]
            with pytest.raises(TruncatedObjectError):
                lease.read(995, 10)  # known to be out of range: no store request
        st = c.stats()
        assert (st["direct_leases"], st["direct_reads"], st["files"], st["downloads"]) == \
            (1, 1, 0, 0)
        assert files(cache_dir) == []
        assert cat_calls(ffs, root, "big") == 1  # one ranged read, no whole-object read
        with pytest.raises(LeaseError):
            lease.read(0, 1)


def test_budget_uses_the_size_hint_instead_of_a_head_request(
        cache_dir: Path, timer: ManualTimer, store: FsspecBlobStore,
        ffs: FaultyFileSystem) -> None:
    store.put("k", b"x" * 10)
    with _budget_cache(cache_dir, timer, 100) as c:
        before = ffs.calls("info")
        c.lease(store, "k", size_hint=10).release()
        assert ffs.calls("info") == before
        c.lease(store, "k").release()  # a hit: no head either
        assert ffs.calls("info") == before


# ----------------------------------------------------------------------------- start-up


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid is free
    return proc.pid


def test_start_removes_crash_leftovers_and_distrusts_previous_files(cache_dir: Path,
                                                                    timer: ManualTimer) -> None:
    cache_dir.mkdir()
    dead = _dead_pid()
    stale_tmp = cache_dir / f".seg.0123456789abcdef.01234567.obj.{dead}.00112233445566ff.tmp"
    previous = cache_dir / "seg.0123456789abcdef.89abcdef.obj"
    mine = cache_dir / "notes.txt"  # not the cache's: left alone
    for p in (stale_tmp, previous, mine):
        p.write_bytes(b"old")
    c = LocalFileCache(cache_dir, timer=timer)
    try:
        assert files(cache_dir) == ["notes.txt"]
        assert c.stats()["files"] == 0
    finally:
        c.close()
    assert files(cache_dir) == ["notes.txt"]  # the directory was not ours to remove


def test_a_directory_serves_one_cache_at_a_time(cache_dir: Path, timer: ManualTimer) -> None:
    first = LocalFileCache(cache_dir, timer=timer)
    try:
        with pytest.raises(CacheError, match="in use by another LocalFileCache"):
            LocalFileCache(cache_dir, timer=timer)
    finally:
        first.close()
    LocalFileCache(cache_dir, timer=timer).close()


@pytest.mark.parametrize(("kw", "field"), [
    ({"idle_ttl_s": -1.0}, "idle_ttl_s"), ({"idle_ttl_s": float("nan")}, "idle_ttl_s"),
    ({"max_bytes": 0}, "max_bytes"), ({"max_bytes": 1.5}, "max_bytes"),
    ({"on_full": "evict"}, "on_full"),
])
def test_bad_settings_are_config_errors(cache_dir: Path, kw: dict[str, object],
                                        field: str) -> None:
    with pytest.raises(ConfigError, match=f"LocalFileCache.{field}") as ei:
        LocalFileCache(cache_dir, **kw)  # type: ignore[arg-type]
    assert ei.value.field == field
    assert not cache_dir.exists()


# ----------------------------------------------------------------------------- close, fork


def test_close_invalidates_leases_and_leaves_nothing_behind(
        cache_dir: Path, store: FsspecBlobStore) -> None:
    store.put("a", b"aaaa")
    store.put("b", b"bbbb")
    c = LocalFileCache(cache_dir, idle_ttl_s=TTL)  # owns a ThreadTimer, started on first need
    held = c.lease(store, "a")
    c.lease(store, "b").release()  # schedules an eviction: the timer thread runs now
    assert any(t.name == "dstl-timer-cache" for t in threading.enumerate())
    c.close()
    c.close()  # idempotent
    assert not cache_dir.exists()
    assert not any(t.name == "dstl-timer-cache" for t in threading.enumerate())
    with pytest.raises(LeaseError, match="was closed"):
        held.read(0, 1)
    held.release()  # releasing an invalidated lease is fine (finally blocks run after close)
    with pytest.raises(ClosedError):
        c.lease(store, "a")
    assert c.stats()["leases_open"] == 0


def test_close_waits_for_a_download_in_flight_and_it_cleans_up(
        cache_dir: Path, store: FsspecBlobStore, timer: ManualTimer) -> None:
    store.put("k", b"data")
    c = LocalFileCache(cache_dir, timer=timer)
    entered, gate = threading.Event(), threading.Event()

    def hold(d: bytes | memoryview, k: str) -> None:
        entered.set()
        assert gate.wait(WAIT)

    errors: list[BaseException] = []

    def lease() -> None:
        try:
            c.lease(store, "k", verify=hold)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=lease, name="test-flight")
    t.start()
    assert entered.wait(WAIT)
    closer = threading.Thread(target=c.close, name="test-close")
    closer.start()
    c.wait_for_stats(lambda s: c.closed)  # close() has begun and waits for the flight
    gate.set()
    closer.join(WAIT)
    t.join(WAIT)
    assert [type(e) for e in errors] == [ClosedError]
    assert not cache_dir.exists()


def test_a_forked_child_cannot_use_the_cache(cache: LocalFileCache, store: FsspecBlobStore,
                                             cache_dir: Path) -> None:
    store.put("k", b"data")
    lease = cache.lease(store, "k")
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only
        code = 0
        for fn in (lambda: cache.lease(store, "k"), lambda: lease.read(0, 1), cache.stats):
            try:
                fn()
                code = 1
            except CacheError as exc:
                if "forked process" not in str(exc):
                    code = 2
            except BaseException:
                code = 3
        cache.close()  # a no-op in the child: the parent's files stay
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert lease.read(0, 4) == b"data"
    assert len(files(cache_dir)) == 1
    lease.release()


def test_wait_for_stats_times_out_with_the_current_numbers(cache: LocalFileCache) -> None:
    with pytest.raises(TimeoutError, match="leases_open"):
        cache.wait_for_stats(lambda s: s["leases_open"] == 1, timeout_s=0.01)
