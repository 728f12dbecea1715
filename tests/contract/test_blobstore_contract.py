"""One BlobStore contract, run against every backend (Litestream/zarr style).

Backends: MemoryBlobStore (the reference), LocalBlobStore, FsspecBlobStore over fsspec's memory
and local filesystems, FsspecBlobStore over s3fs on a moto server (marker ``s3``), over gcsfs on
gcp-storage-emulator, over adlfs on Azurite (tests/support/store_emulators.py: what each
emulator can show; GCS's write-once is checked on the wire, since that emulator ignores
``ifGenerationMatch``), and HdfsBlobStore on a MiniDFSCluster (marker ``hdfs``,
tests/support/minidfs.py). The
semantics are those of the ``dstl.stores.base`` module docstring. LocalBlobStore-specific
durability rules (temp files, stale temp cleanup, atomic write-once) follow the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec
import pytest
from support import minidfs, moto_server, store_emulators
from support.moto_server import s3_storage_options
from support.store_emulators import RequestLog, azure_storage_options, gcs_storage_options

from dstl.errors import ObjectExistsError, ObjectNotFoundError, UnsafePathError
from dstl.stores import (
    BlobStore,
    FsspecBlobStore,
    LocalBlobStore,
    MemoryBlobStore,
    ObjectInfo,
    open_store,
)

# Fixtures of support.moto_server (one server per xdist worker), bound by assignment so that test
# parameters of the same name do not shadow an import.
moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket
gcs_endpoint = store_emulators.gcs_endpoint
gcs_bucket = store_emulators.gcs_bucket
azurite_connection = store_emulators.azurite_connection
azure_container = store_emulators.azure_container

BACKENDS = [
    "memory",
    "local",
    "fsspec-memory",
    "fsspec-local",
    pytest.param("fsspec-s3", marks=pytest.mark.s3),
    # one emulator per kind and xdist worker: the group keeps each kind's tests on one worker
    pytest.param("fsspec-gcs", marks=pytest.mark.xdist_group("gcs-emulator")),
    pytest.param("fsspec-azure", marks=pytest.mark.xdist_group("azurite")),
    # a MiniDFSCluster per xdist worker (tests/support/minidfs.py)
    pytest.param("hdfs", marks=pytest.mark.hdfs),
]
#: The backends of the tests that write many objects: HDFS closes a file in ~0.5 s (the NameNode
#: waits for the DataNode's block report; bench/hdfs_clients.py), so on HDFS they run with
#: DSTL_DEEP=1 only.
MANY_OBJECT_BACKENDS = [b for b in BACKENDS if os.environ.get("DSTL_DEEP") == "1"
                        or getattr(b, "values", (None,))[0] != "hdfs"]


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlobStore]:
    kind = request.param
    if kind == "memory":
        s: BlobStore = MemoryBlobStore()
    elif kind == "local":
        s = LocalBlobStore(tmp_path / "root")
    elif kind == "fsspec-memory":
        # fsspec's memory filesystem is process-wide: a fresh root per test, removed after it.
        s = open_store(f"memory://contract-{uuid.uuid4().hex}")
    elif kind == "fsspec-local":
        s = FsspecBlobStore(fsspec.filesystem("file"), str(tmp_path / "root"))
    elif kind == "fsspec-s3":
        bucket = request.getfixturevalue("s3_bucket")
        endpoint = request.getfixturevalue("moto_endpoint")
        s = open_store(f"s3://{bucket}/contract", s3_storage_options(endpoint))
    elif kind == "fsspec-gcs":
        bucket = request.getfixturevalue("gcs_bucket")
        endpoint = request.getfixturevalue("gcs_endpoint")
        s = open_store(f"gs://{bucket}/contract", gcs_storage_options(endpoint))
    elif kind == "fsspec-azure":
        container = request.getfixturevalue("azure_container")
        connection = request.getfixturevalue("azurite_connection")
        s = open_store(f"abfs://{container}/contract", azure_storage_options(connection))
    elif kind == "hdfs":
        s = open_store(minidfs.hdfs_uri(request.getfixturevalue("hdfs_cluster"), "contract"))
    else:
        raise AssertionError(kind)
    yield s
    if kind == "fsspec-memory":
        s.delete([info.key for info in s.list()])
    s.close()


def keys_of(infos: Iterator[ObjectInfo]) -> list[str]:
    return [info.key for info in infos]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("size", [0, 17, 5 * 1024 * 1024], ids=["empty", "small", "5MiB"])
def test_round_trip(store: BlobStore, size: int, request: pytest.FixtureRequest) -> None:
    data = os.urandom(size)
    if request.node.callspec.params["store"] == "fsspec-gcs" and data.endswith(b"\r"):
        # gcp-storage-emulator reads a multipart upload with Python's email parser, which drops
        # the part's last CR (1 random body in 256); GCS keeps every byte
        data = data[:-1] + b"\n"
    store.put("dstl/obj", data)
    assert store.get("dstl/obj") == data
    assert store.head("dstl/obj") == ObjectInfo("dstl/obj", size)
    assert list(store.list("dstl/")) == [ObjectInfo("dstl/obj", size)]


def test_write_once_keeps_first_content(store: BlobStore, request: pytest.FixtureRequest) -> None:
    if request.node.callspec.params["store"] == "fsspec-gcs":
        _gcs_emulator_ignores_the_precondition(store)
        return
    store.put("a/k", b"first")
    with pytest.raises(ObjectExistsError, match="a/k") as info:
        store.put("a/k", b"second")
    assert isinstance(info.value, FileExistsError)
    assert store.get("a/k") == b"first"


def _gcs_emulator_ignores_the_precondition(store: BlobStore) -> None:
    """gcp-storage-emulator accepts a second create (real GCS answers 412): asserted, so that an
    emulator that starts to enforce ``ifGenerationMatch`` fails here and this branch is dropped.
    What DSTL controls, the precondition on the wire, is ``test_gcs_put_sends_if_generation_match_0``."""
    store.put("a/k", b"first")
    store.put("a/k", b"second")
    assert store.get("a/k") == b"second", "the emulator now enforces ifGenerationMatch: " \
        "drop this special case from test_write_once_keeps_first_content"


def test_gcs_put_sends_if_generation_match_0(gcs_endpoint: str, gcs_bucket: str) -> None:
    """Every object DSTL uploads to GCS is a create-only upload (``ifGenerationMatch=0``, GCS's
    server-side write-once): small and large objects alike go as one ``pipe_file`` request."""
    log = RequestLog(gcs_endpoint)
    try:
        s = open_store(f"gs://{gcs_bucket}/wire", gcs_storage_options(log.endpoint))
        s.put("small", b"x" * 17)
        s.put("large", os.urandom(9 * 1024 * 1024))
        assert s.get("small") == b"x" * 17
        s.close()
    finally:
        log.close()
    uploads = [(m, p) for m, p in log.requests if m in ("POST", "PUT") and "/upload/" in p]
    starts = [p for m, p in uploads if "uploadType=" in p]
    assert len(starts) == 2, log.requests
    for path in starts:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
        assert query.get("ifGenerationMatch") == ["0"], path


def test_missing_object(store: BlobStore) -> None:
    with pytest.raises(ObjectNotFoundError, match="nope/x") as info:
        store.get("nope/x")
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.key == "nope/x"
    with pytest.raises(FileNotFoundError):
        store.get_range("nope/x", 0, 4)
    assert store.head("nope/x") is None


# --------------------------------------------------------------------------- ranged reads

DATA = bytes(range(256)) * 4  # 1024 bytes, every offset distinguishable


@pytest.mark.parametrize(("offset", "length", "expected"), [
    (10, 20, DATA[10:30]),          # inside
    (1000, 24, DATA[1000:]),        # exactly to the end
    (1000, 100, DATA[1000:]),       # past the end: short
    (0, 1024, DATA),                # the whole object
    (1024, 10, b""),                # starting at the end
    (5000, 10, b""),                # starting past the end
    (7, 0, b""),                    # zero length
], ids=["inside", "at-end", "past-end-short", "whole", "at-size", "beyond", "zero-length"])
def test_get_range(store: BlobStore, offset: int, length: int, expected: bytes) -> None:
    store.put("r/obj", DATA)
    assert store.get_range("r/obj", offset, length) == expected


def test_get_range_rejects_negative(store: BlobStore) -> None:
    store.put("r/obj", DATA)
    with pytest.raises(ValueError):
        store.get_range("r/obj", -1, 4)
    with pytest.raises(ValueError):
        store.get_range("r/obj", 0, -4)


# --------------------------------------------------------------------------- head / list

def test_head(store: BlobStore) -> None:
    store.put("h/a/b", b"12345")
    assert store.head("h/a/b") == ObjectInfo("h/a/b", 5)
    assert store.head("h/a/c") is None
    assert store.head("h/a") is None  # a "directory" is not an object


LIST_KEYS = ["a.b", "a/b/c", "a/b/d", "a/bc", "ab", "b", "dstl/abc", "dstl/abd", "dstl/x/y",
             "dstlz"]


@pytest.mark.parametrize(("prefix", "expected"), [
    ("", LIST_KEYS),
    ("dstl/ab", ["dstl/abc", "dstl/abd"]),            # partial-name prefix
    ("dstl/", ["dstl/abc", "dstl/abd", "dstl/x/y"]),
    ("dstl", ["dstl/abc", "dstl/abd", "dstl/x/y", "dstlz"]),
    ("a/b", ["a/b/c", "a/b/d", "a/bc"]),
    ("a/b/", ["a/b/c", "a/b/d"]),
    ("dstl/x/", ["dstl/x/y"]),
    ("dstl/x/y", ["dstl/x/y"]),                       # a whole key is its own prefix
    ("zzz", []),
    ("nothere/deeper/", []),
], ids=lambda v: repr(v) if isinstance(v, str) else None)
@pytest.mark.parametrize("store", MANY_OBJECT_BACKENDS, indirect=True)
def test_list_prefix_semantics(store: BlobStore, prefix: str, expected: list[str]) -> None:
    for i, key in enumerate(reversed(LIST_KEYS)):  # insertion order != key order
        store.put(key, b"x" * i)
    got = list(store.list(prefix))
    assert [info.key for info in got] == expected
    sizes = {key: len(LIST_KEYS) - 1 - i for i, key in enumerate(LIST_KEYS)}
    assert all(info.size == sizes[info.key] for info in got)


# --------------------------------------------------------------------------- delete

def test_delete_is_idempotent(store: BlobStore) -> None:
    store.put("d/k", b"v")
    store.delete(["d/k"])
    store.delete(["d/k"])
    store.delete(["never/existed"])
    store.delete([])
    assert store.head("d/k") is None
    with pytest.raises(ObjectNotFoundError):
        store.get("d/k")


@pytest.mark.parametrize("store", MANY_OBJECT_BACKENDS, indirect=True)
def test_delete_many_with_missing(store: BlobStore) -> None:
    keys = [f"m/{i % 5}/obj-{i:04d}" for i in range(60)]
    for key in keys:
        store.put(key, key.encode())
    doomed = keys[::2]
    store.delete([*doomed, "m/missing-1", "m/9/missing-2"])
    assert keys_of(store.list("m/")) == sorted(keys[1::2])
    for key in doomed:
        assert store.head(key) is None
    for key in keys[1::2]:
        assert store.get(key) == key.encode()


def test_deleted_keys_are_not_listed(store: BlobStore) -> None:
    store.put("l/a", b"1")
    store.put("l/b", b"2")
    store.delete(["l/a"])
    assert keys_of(store.list("l/")) == ["l/b"]
    store.put("l/c", b"3")
    assert keys_of(store.list("l")) == ["l/b", "l/c"]


# --------------------------------------------------------------------------- key safety

UNSAFE_KEYS = ["", "../x", "a/../../x", "/etc/passwd", "a//b", "a/./b", "a\\b", "s3://b/k",
               "a/", "a\x00b", ".."]


def test_unsafe_keys_rejected_on_put(store: BlobStore) -> None:
    for key in UNSAFE_KEYS:
        with pytest.raises(UnsafePathError):
            store.put(key, b"x")
    assert list(store.list()) == []


def test_unsafe_keys_rejected_on_get(store: BlobStore) -> None:
    for key in UNSAFE_KEYS:
        with pytest.raises(UnsafePathError):
            store.get(key)


# --------------------------------------------------------------------------- concurrency

def test_concurrent_puts_from_8_threads(store: BlobStore) -> None:
    start = threading.Barrier(8)

    def writer(t: int) -> list[str]:
        start.wait(timeout=10)
        keys = [f"c/t{t}/k{i:02d}" for i in range(6)] + [f"c/shared-{t}-{i}" for i in range(2)]
        for key in keys:
            store.put(key, key.encode() * 3)
        return keys

    with ThreadPoolExecutor(max_workers=8) as pool:
        written = [k for ks in pool.map(writer, range(8)) for k in ks]
    assert keys_of(store.list("c/")) == sorted(written)
    for key in written:
        assert store.get(key) == key.encode() * 3


# --------------------------------------------------------------------------- LocalBlobStore


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


class TestLocalBlobStore:
    def test_no_temp_files_after_successful_puts(self, tmp_path: Path) -> None:
        store = LocalBlobStore(tmp_path)
        store.put("a/b/c", b"1")
        store.put("a/d", b"")
        store.put("e", os.urandom(100_000))
        assert _files(tmp_path) == ["a/b/c", "a/d", "e"]

    def test_same_key_race_has_exactly_one_winner(self, tmp_path: Path) -> None:
        store = LocalBlobStore(tmp_path)
        start = threading.Barrier(8)

        def put(i: int) -> bool:
            start.wait(timeout=10)
            try:
                store.put("race/k", str(i).encode() * 1000)
            except ObjectExistsError:
                return False
            return True

        with ThreadPoolExecutor(max_workers=8) as pool:
            won = list(pool.map(put, range(8)))
        assert won.count(True) == 1
        winner = won.index(True)
        assert store.get("race/k") == str(winner).encode() * 1000
        assert _files(tmp_path) == ["race/k"]

    def test_stale_temp_files_of_dead_pids_removed_live_kept(self, tmp_path: Path) -> None:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
        dead_pid = int(dead.stdout)
        live_pid = os.getpid()
        (tmp_path / "dstl" / "sub").mkdir(parents=True)
        stale = [tmp_path / f".seg-1.{dead_pid}.0123456789abcdef.tmp",
                 tmp_path / "dstl" / "sub" / f".seg-2.{dead_pid}.fedcba9876543210.tmp"]
        live = tmp_path / "dstl" / f".seg-3.{live_pid}.00112233445566ff.tmp"
        for p in [*stale, live]:
            p.write_bytes(b"partial")
        (tmp_path / "dstl" / "real").write_bytes(b"object")

        store = LocalBlobStore(tmp_path)

        assert not any(p.exists() for p in stale)
        assert live.exists()
        assert keys_of(store.list()) == ["dstl/real"]  # temp files are never listed

    def test_temp_names_are_reserved(self, tmp_path: Path) -> None:
        store = LocalBlobStore(tmp_path)
        with pytest.raises(UnsafePathError, match="reserved"):
            store.put("a/.x.123.0123456789abcdef.tmp", b"x")

    def test_use_after_close(self, tmp_path: Path) -> None:
        store = LocalBlobStore(tmp_path)
        store.close()
        with pytest.raises(RuntimeError, match="closed"):
            store.put("k", b"v")
