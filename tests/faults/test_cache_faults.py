"""LocalFileCache under faults: failed and corrupt downloads leave nothing and poison nothing,
waiters of a failed flight get its typed error, a damaged local file is detected, and a full
local disk (a real EFBIG from RLIMIT_FSIZE in a subprocess) gives CacheFullError or direct reads
(G4, G7, G8; R8, R9)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import fsspec
import pytest
from support.faulty_fs import FaultyFileSystem, permanent_error, retryable_error
from support.segments import make_change_set

from dstl import KeyGroupRange
from dstl.errors import (
    AccessDeniedError,
    CacheFullError,
    CorruptObjectError,
    LocalDiskFullError,
    TransientStorageError,
)
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.retry import RetryPolicy
from dstl.segment import encode_segment
from dstl.stores import BlobStore, FsspecBlobStore, MemoryBlobStore, ObjectInfo
from dstl.timer import ManualTimer
from restore import ChangelogReader, LocalFileCache, verify_segment

WAIT = 10.0
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def ffs() -> Iterator[FaultyFileSystem]:
    fs = FaultyFileSystem(fsspec.filesystem("memory", skip_instance_cache=True))
    yield fs
    fs.clear_faults()


@pytest.fixture
def root() -> str:
    return f"/cache-faults-{uuid.uuid4().hex}"


@pytest.fixture
def store(ffs: FaultyFileSystem, root: str) -> Iterator[FsspecBlobStore]:
    s = FsspecBlobStore(ffs, root, retry=RetryPolicy(max_attempts=2, backoff_base_s=0.0))
    yield s
    s.close()
    with contextlib.suppress(FileNotFoundError):
        ffs.inner.rm(root, recursive=True)


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[LocalFileCache]:
    c = LocalFileCache(tmp_path / "cache", timer=ManualTimer())
    yield c
    c.close()
    assert not (tmp_path / "cache").exists()


def _files(c: LocalFileCache) -> list[str]:
    return sorted(n for n in os.listdir(c.directory) if n != ".dstl-cache.lock")


def _segment() -> tuple[bytes, list[ChangeSetRef]]:
    data, entries = encode_segment([make_change_set("w", i, [(i, b"v%d" % i)]) for i in range(4)])
    refs = [ChangeSetRef(e.sqn, "dstl/seg", e.offset, e.length, e.change_count, e.payload_bytes)
            for e in entries]
    return data, refs


class GatedStore:
    """Delegates to ``inner``; ``get`` blocks until ``gate`` is set (holds a flight open)."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.location = inner.location
        self.entered = threading.Event()
        self.gate = threading.Event()

    def get(self, key: str) -> bytes:
        self.entered.set()
        assert self.gate.wait(WAIT)
        return self.inner.get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self.inner.get_range(key, offset, length)

    def head(self, key: str) -> ObjectInfo | None:
        return self.inner.head(key)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, keys: Iterable[str]) -> None:
        self.inner.delete(keys)

    def close(self) -> None:
        self.gate.set()


# ----------------------------------------------------------------------------- failed downloads


def test_a_failed_download_leaves_nothing_and_the_next_lease_succeeds(
        cache: LocalFileCache, store: FsspecBlobStore, ffs: FaultyFileSystem, root: str) -> None:
    data, _ = _segment()
    store.put("dstl/seg", data)
    ffs.fail_reads([f"{root}/dstl/seg"], count=2, ops=("cat_file",))  # both attempts fail
    with pytest.raises(TransientStorageError, match="dstl/seg"):
        cache.lease(store, "dstl/seg", verify=verify_segment)
    assert _files(cache) == []
    st = cache.stats()
    assert (st["download_failures"], st["files"], st["leases_open"], st["downloads"]) == \
        (1, 0, 0, 0)
    with cache.lease(store, "dstl/seg", verify=verify_segment) as lease:
        assert lease.read(0, lease.size) == data
    assert cache.stats()["downloads"] == 1


def test_waiters_of_a_failed_flight_get_its_typed_error(cache: LocalFileCache,
                                                        store: FsspecBlobStore,
                                                        ffs: FaultyFileSystem,
                                                        root: str) -> None:
    data, _ = _segment()
    store.put("dstl/seg", data)
    ffs.fail_reads([f"{root}/dstl/seg"], count=1, ops=("cat_file",), error=permanent_error)
    gated = GatedStore(store)
    errors: list[BaseException] = []

    def take() -> None:
        try:
            cache.lease(gated, "dstl/seg").release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=take, name=f"test-lease-{i}") for i in range(5)]
    for t in threads:
        t.start()
    assert gated.entered.wait(WAIT)
    cache.wait_for_stats(lambda s: s["waits"] == 4)
    gated.gate.set()
    for t in threads:
        t.join(WAIT)
    assert len(errors) == 5
    assert {type(e) for e in errors} == {AccessDeniedError}
    assert all(e.key == "dstl/seg" for e in errors)  # type: ignore[attr-defined]
    assert cache.stats()["download_failures"] == 1
    assert _files(cache) == []
    # not poisoned: the fault is used up, the next lease downloads
    with cache.lease(store, "dstl/seg") as lease:
        assert lease.size == len(data)


def test_waiters_of_a_corrupt_flight_get_corrupt_object_error_naming_the_key(
        cache: LocalFileCache, store: FsspecBlobStore) -> None:
    data, _ = _segment()
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    store.put("dstl/seg", bytes(bad))
    gated = GatedStore(store)
    errors: list[BaseException] = []

    def take() -> None:
        try:
            cache.lease(gated, "dstl/seg", verify=verify_segment).release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=take, name=f"test-lease-{i}") for i in range(4)]
    for t in threads:
        t.start()
    assert gated.entered.wait(WAIT)
    cache.wait_for_stats(lambda s: s["waits"] == 3)
    gated.gate.set()
    for t in threads:
        t.join(WAIT)
    assert len(errors) == 4
    assert all(isinstance(e, CorruptObjectError) and e.key == "dstl/seg" for e in errors)
    assert _files(cache) == []
    assert cache.stats()["leases_open"] == 0


def test_concurrent_leases_with_store_latency_download_once(cache: LocalFileCache,
                                                            root: str) -> None:
    slow = FaultyFileSystem(fsspec.filesystem("memory", skip_instance_cache=True),
                            latency_s=0.05)
    store = FsspecBlobStore(slow, root + "-slow")
    data, _ = _segment()
    store.put("dstl/seg", data)
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def take() -> None:
        barrier.wait()
        try:
            with cache.lease(store, "dstl/seg", verify=verify_segment) as lease:
                assert lease.read(0, lease.size) == data
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=take, name=f"test-lease-{i}") for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert errors == []
    assert slow.calls("cat_file", f"{root}-slow/dstl/seg") == 1
    st = cache.stats()
    assert (st["downloads"], st["hits"], st["leases_open"]) == (1, 7, 0)
    slow.inner.rm(root + "-slow", recursive=True)


def test_a_local_file_damaged_after_download_is_detected_by_the_reader(
        cache: LocalFileCache, store: FsspecBlobStore) -> None:
    data, refs = _segment()
    store.put("dstl/seg", data)
    handle = ChangelogHandle("w", KeyGroupRange(0, 3), 0, 4, tuple(refs))
    reader = ChangelogReader(store, cache=cache)
    assert list(reader.read(handle)) == [(i, b"v%d" % i) for i in range(4)]
    (path,) = _files(cache)
    with open(os.path.join(cache.directory, path), "r+b") as f:  # bit rot on the local disk
        f.seek(refs[2].offset + 12)
        byte = f.read(1)
        f.seek(refs[2].offset + 12)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CorruptObjectError, match="dstl/seg") as ei:
        list(reader.read(handle))
    assert ei.value.offset == refs[2].offset
    assert cache.stats()["leases_open"] == 0


# ----------------------------------------------------------------------------- full local disk

_DISK_FULL_SCRIPT = textwrap.dedent("""
    import json, os, resource, signal, sys
    from dstl.stores import MemoryBlobStore
    from dstl.errors import CacheFullError
    from dstl.timer import ManualTimer
    from restore import LocalFileCache

    base, limit = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    store = MemoryBlobStore()
    big = bytes(range(256)) * 1024  # 256 KiB: over the limit
    store.put("dstl/big", big)
    store.put("small", b"s" * 1000)
    out = {}
    cache = LocalFileCache(os.path.join(base, "raise"), timer=ManualTimer())
    try:
        cache.lease(store, "dstl/big")
        out["raise"] = None
    except CacheFullError as exc:
        out["raise"] = [str(exc), type(exc.__cause__).__name__, exc.__cause__.__cause__.errno]
    out["left_after_raise"] = sorted(os.listdir(cache.directory))
    with cache.lease(store, "small") as lease:  # the cache still works for what fits
        out["small"] = lease.read(0, 4).decode()
    resource.setrlimit(resource.RLIMIT_FSIZE,
                       (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # space freed
    with cache.lease(store, "dstl/big") as lease:
        out["after_freeing"] = [lease.direct, lease.read(1000, 8) == big[1000:1008]]
    out["stats"] = cache.stats()
    cache.close()
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    direct = LocalFileCache(os.path.join(base, "direct"), timer=ManualTimer(), on_full="direct")
    with direct.lease(store, "dstl/big") as lease:
        out["direct"] = [lease.direct, lease.path, lease.read(200000, 16) == big[200000:200016]]
        out["left_in_direct"] = sorted(os.listdir(direct.directory))
    out["direct_stats"] = direct.stats()
    direct.close()
    out["left"] = sorted(os.listdir(base))
    print(json.dumps(out))
""")


def test_disk_full_gives_cache_full_error_or_direct_reads(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", _DISK_FULL_SCRIPT, str(tmp_path), "65536"],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    msg, cause, errno_ = out["raise"]
    assert cause == "LocalDiskFullError" and errno_ == 27  # EFBIG
    assert "dstl/big" in msg and "262144 bytes" in msg and "EFBIG" in msg
    assert "on_full='direct'" in msg
    assert out["left_after_raise"] == [".dstl-cache.lock"]  # the temp file was removed
    assert out["small"] == "ssss"
    assert out["after_freeing"] == [False, True]
    assert out["stats"]["download_failures"] == 1 and out["stats"]["files"] == 2
    assert out["direct"] == [True, None, True]
    assert out["left_in_direct"] == [".dstl-cache.lock"]
    assert out["direct_stats"]["direct_leases"] == 1 and out["direct_stats"]["files"] == 0
    assert out["left"] == []  # both caches removed their directories


def test_transient_read_errors_are_retried_by_the_store_not_the_cache(
        cache: LocalFileCache, store: FsspecBlobStore, ffs: FaultyFileSystem, root: str) -> None:
    data, _ = _segment()
    store.put("dstl/seg", data)
    ffs.fail_reads([f"{root}/dstl/seg"], count=1, ops=("cat_file",), error=retryable_error)
    with cache.lease(store, "dstl/seg", verify=verify_segment) as lease:
        assert lease.size == len(data)
    assert ffs.calls("cat_file", f"{root}/dstl/seg") == 2
    assert cache.stats()["download_failures"] == 0


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (R8c): a real ENOSPC, which evicting idle files can cure."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({r.stderr.strip()}); the EFBIG "
                    "test above covers the disk-full path")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_enospc_evicts_idle_files_then_gives_cache_full(tiny_disk: Path) -> None:
    store = MemoryBlobStore()
    for k in "abcd":
        store.put(k, k.encode() * (120 * 1024))
    store.put("e", b"e" * (200 * 1024))
    with LocalFileCache(tiny_disk / "cache", timer=ManualTimer()) as c:
        c.lease(store, "a").release()
        c.lease(store, "b").release()  # 240 KiB of 256 KiB used by idle files
        with c.lease(store, "c") as lease:  # ENOSPC -> idle a and b evicted -> written
            assert lease.read(0, 3) == b"ccc"
            st = c.stats()
            assert (st["evictions_disk_full"], st["files"]) == (2, 1)
            with pytest.raises(CacheFullError, match=r"e \(204800 bytes\).*ENOSPC") as ei:
                c.lease(store, "e")  # nothing idle to evict
            assert isinstance(ei.value.__cause__, LocalDiskFullError)
            assert sorted(os.listdir(c.directory)) == [".dstl-cache.lock", os.path.basename(
                lease.path or "")]  # no temp file left
        with c.lease(store, "d") as lease:  # after the space is freed, caching works again
            assert not lease.direct
    assert os.listdir(tiny_disk) == []
