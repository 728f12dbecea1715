"""Injected storage faults: the FaultyFileSystem seam through FsspecBlobStore, read retries, and
a real disk-full (RLIMIT_FSIZE) for LocalBlobStore.

Write faults surface once, typed, and are never retried by the store (the upload scheduler owns
write retries); read faults are retried up to ``RetryPolicy.max_attempts`` and then surface
typed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest
import s3fs
from support import moto_server
from support.faulty_fs import FaultyFileSystem, permanent_error
from support.moto_server import s3_storage_options

from dstl.errors import (
    AccessDeniedError,
    LocalDiskFullError,
    ObjectExistsError,
    TransientStorageError,
)
from dstl.retry import RetryPolicy
from dstl.stores import FsspecBlobStore, LocalBlobStore, is_retryable, open_store

# Fixtures of support.moto_server (one server per xdist worker), bound by assignment so that test
# parameters of the same name do not shadow an import.
moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket

REPO = Path(__file__).resolve().parents[2]
#: Keep retry tests fast; the default backoff is tested once below.
FAST = RetryPolicy(max_attempts=3, backoff_base_s=0.001, backoff_max_s=0.001)


@dataclass
class Env:
    faulty: FaultyFileSystem
    root: str

    def store(self, **kwargs: Any) -> FsspecBlobStore:
        kwargs.setdefault("retry", FAST)
        return FsspecBlobStore(self.faulty, self.root, **kwargs)

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"


@pytest.fixture
def env() -> Iterator[Env]:
    inner = fsspec.filesystem("memory")
    e = Env(FaultyFileSystem(inner), f"/faults-{uuid.uuid4().hex}")  # memory fs is process-wide
    yield e
    e.faulty.clear_faults()
    if inner.exists(e.root):
        inner.rm(e.root, recursive=True)


# --------------------------------------------------------------------------- write faults


def test_first_k_writes_fail_retryable_then_succeed(env: Env) -> None:
    store = env.store()
    env.faulty.fail_writes(2)
    for _ in range(2):
        with pytest.raises(TransientStorageError, match="seg-1") as info:
            store.put("dstl/seg-1", b"data")
        assert is_retryable(info.value)
        assert store.head("dstl/seg-1") is None  # failed before writing
    store.put("dstl/seg-1", b"data")  # the caller's third attempt
    assert store.get("dstl/seg-1") == b"data"
    assert env.faulty.calls("pipe_file") == 3  # the store itself never retried a write


def test_permanent_write_failure_is_not_retryable(env: Env) -> None:
    store = env.store()
    env.faulty.fail_writes(1, permanent_error)
    with pytest.raises(AccessDeniedError) as info:
        store.put("k", b"v")
    assert not is_retryable(info.value)
    assert env.faulty.calls("pipe_file") == 1


def test_fail_after_write_leaves_the_object(env: Env) -> None:
    store = env.store()
    env.faulty.fail_writes_after_landing(1)
    with pytest.raises(TransientStorageError):
        store.put("dstl/ghost", b"landed")
    assert store.get("dstl/ghost") == b"landed"  # the client saw an error, the write landed
    store.put("dstl/ghost", b"landed")           # the same bytes again: its own landing
    with pytest.raises(ObjectExistsError):       # other bytes under the name are refused
        store.put("dstl/ghost", b"other")
    assert store.get("dstl/ghost") == b"landed"


def test_disk_full_is_typed_and_not_retryable(env: Env) -> None:
    store = env.store()
    env.faulty.fill_disk()
    for _ in range(2):
        with pytest.raises(LocalDiskFullError, match="no space left") as info:
            store.put("k", b"v")
        assert not is_retryable(info.value)
    env.faulty.clear_faults()
    store.put("k", b"v")


def test_hang_until_released(env: Env) -> None:
    store = env.store()
    hang = env.faulty.hang_writes({1})
    done = threading.Event()
    errors: list[BaseException] = []

    def put() -> None:
        try:
            store.put("slow", b"v")
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=put, name="test-hung-put")
    t.start()
    assert hang.entered.wait(5)
    assert not done.is_set()           # still hanging
    store.put("fast", b"w")            # attempt 2 is not affected
    hang.release()
    t.join(5)
    assert done.is_set() and not errors
    assert store.get("slow") == b"v" and hang.hung == [1]


def test_hang_for_a_duration_then_fail(env: Env) -> None:
    store = env.store()
    env.faulty.hang_writes({1}, duration_s=0.05, then_fail=lambda: TimeoutError("injected"))
    t0 = time.monotonic()
    with pytest.raises(TransientStorageError):
        store.put("k", b"v")
    assert time.monotonic() - t0 >= 0.05
    assert store.head("k") is None


def test_latency_is_added_to_every_operation(env: Env) -> None:
    store = env.store()
    env.faulty.latency_s = 0.02
    t0 = time.monotonic()
    store.put("k", b"v")
    store.get("k")
    store.head("k")
    assert time.monotonic() - t0 >= 0.06


def test_counts_each_object_read_once(env: Env) -> None:
    store = open_store(env.root, filesystem=env.faulty)
    keys = [f"dstl/seg-{i}" for i in range(3)]
    for key in keys:
        store.put(key, key.encode())
    for key in keys:
        assert store.get(key) == key.encode()
    for key in keys:
        assert env.faulty.calls("cat_file", env.path(key)) == 1
    assert env.faulty.calls("cat_file") == 3


# --------------------------------------------------------------------------- read retries


@pytest.mark.parametrize("failures", [1, 2])
def test_read_retries_recover(env: Env, failures: int) -> None:
    store = env.store()
    store.put("k", b"value")
    path = env.path("k")
    env.faulty.fail_reads([path], count=failures)
    assert store.get("k") == b"value"
    assert env.faulty.calls("cat_file", path) == failures + 1
    env.faulty.fail_reads([path], count=failures)
    assert store.get_range("k", 1, 3) == b"alu"
    env.faulty.fail_reads([path], count=failures)
    assert store.head("k") is not None
    env.faulty.fail_reads(None, count=failures, ops=["find"])
    assert [i.key for i in store.list()] == ["k"]


def test_read_retries_give_up_typed(env: Env) -> None:
    store = env.store()
    store.put("k", b"value")
    path = env.path("k")
    env.faulty.fail_reads([path], count=3)
    with pytest.raises(TransientStorageError, match="k") as info:
        store.get("k")
    assert env.faulty.calls("cat_file", path) == 3
    assert isinstance(info.value.__cause__, ConnectionResetError)
    assert store.get("k") == b"value"  # the schedule is used up


def test_permanent_read_failure_is_not_retried(env: Env) -> None:
    store = env.store()
    store.put("k", b"value")
    path = env.path("k")
    env.faulty.fail_reads([path], error=permanent_error)
    with pytest.raises(AccessDeniedError):
        store.get("k")
    assert env.faulty.calls("cat_file", path) == 1


def test_default_backoff_is_jittered_exponential(env: Env) -> None:
    waits: list[float] = []
    store = FsspecBlobStore(env.faulty, env.root, sleep=waits.append, draw=lambda: 0.5)
    store.put("k", b"v")
    env.faulty.fail_reads(count=2)
    assert store.get("k") == b"v"
    assert waits == [0.05, 0.1]  # half (the draw) of 0.1 s, then of 0.2 s


# --------------------------------------------------------------------------- LocalBlobStore

_FSIZE_CHILD = """
import json, resource, signal, sys
from dstl.errors import LocalDiskFullError
from dstl.stores import LocalBlobStore
store = LocalBlobStore(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
try:
    store.put("dstl/big", b"x" * (256 * 1024))
except LocalDiskFullError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc),
                      "retryable": False}))
else:
    print(json.dumps({"error": None}))
store.put("dstl/small", b"y" * 1000)  # a put below the limit still works
"""


def test_local_file_size_limit_is_disk_full_and_leaves_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["error"] == "LocalDiskFullError"
    assert "EFBIG" in result["message"] and "dstl/big" in result["message"]
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["dstl/small"]  # no partial object, no temp file


def test_local_failed_put_leaves_no_temp_file(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    store.put("k", b"first")
    with pytest.raises(ObjectExistsError):
        store.put("k", b"second")  # fails after the temp file was written and fsynced
    assert [p.name for p in tmp_path.iterdir()] == ["k"]
    assert store.get("k") == b"first"


# --------------------------------------------------------------------------- over s3fs


@pytest.mark.s3
def test_faults_through_s3fs_on_moto(moto_endpoint: str, s3_bucket: str) -> None:
    inner = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                              **s3_storage_options(moto_endpoint))
    faulty = FaultyFileSystem(inner)
    store = open_store(f"s3://{s3_bucket}/app", filesystem=faulty)
    faulty.fail_writes(1)
    with pytest.raises(TransientStorageError):
        store.put("dstl/seg", b"payload")
    store.put("dstl/seg", b"payload")
    faulty.fail_reads([f"{s3_bucket}/app/dstl/seg"], count=1)
    assert store.get("dstl/seg") == b"payload"
    assert faulty.calls("cat_file", f"s3://{s3_bucket}/app/dstl/seg") == 2
    assert faulty.calls("pipe_file") == 2
