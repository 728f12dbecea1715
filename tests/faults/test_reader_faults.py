"""The state reader's reads retry like a job's restore reads: the reader opens its store through
open_store with RetryPolicy.for_store (open_read_only), and the store classifies failures. Faults
are injected with the fault-injecting fsspec wrapper (tests/support/faulty_fs.py) under a reader
opened by open_read_only(filesystem=...): every object the reader needs (manifest, snapshot,
segments) fails twice and the reads still equal the model — the row path (heap and LMDB tables),
the column-wise path of the Spark source, and the change feed; a fault that outlasts the attempts
is a TransientStorageError naming the object; a permanent one is not retried."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pytest
from support.columnar import read_state_columns
from support.faulty_fs import FaultyFileSystem, permanent_error
from support.state_job import MiniJob, replay, state_of

from dstl.errors import AccessDeniedError, TransientStorageError, UsageError
from dstl.options import DstlOptions
from dstl.reader import (
    CheckpointCatalog,
    ReadOnlyBlobStore,
    open_read_only,
    plan_state_splits,
    read_changes,
    read_state,
    task_states,
)
from dstl.retry import RetryPolicy
from dstl.stores import FsspecBlobStore
from restore.cache import LocalFileCache

#: three attempts as the default read policy, without its backoff (keeps the test fast)
FAST = RetryPolicy(max_attempts=DstlOptions().read_max_attempts, backoff_base_s=0.001,
                   backoff_max_s=0.001)


@dataclass
class Env:
    inner: fsspec.AbstractFileSystem
    faulty: FaultyFileSystem
    root: str
    job: MiniJob
    table: str

    def reader(self, retry: RetryPolicy | None = FAST) -> CheckpointCatalog:
        store = open_read_only(self.root, filesystem=self.faulty, retry=retry)
        return CheckpointCatalog(store, job_id="job")

    def objects(self, prefix: str) -> list[str]:
        return [p for p in self.inner.find(f"{self.root}/{prefix}")]


@pytest.fixture(params=["heap", "lmdb"])
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    inner = fsspec.filesystem("memory")
    root = f"/reader-faults-{uuid.uuid4().hex}"  # the memory filesystem is process-wide
    store = FsspecBlobStore(inner, root)
    job = MiniJob(store, partitions=2, seed=41, table=request.param, retained=5)
    try:
        job.run(120)
        job.checkpoint()
        job.materialize()
        job.run(60)
        job.checkpoint()  # 1: snapshots and a log after them
    finally:
        job.close()
    faulty = FaultyFileSystem(inner)
    yield Env(inner, faulty, root, job, request.param)
    faulty.clear_faults()
    store.close()
    inner.rm(root, recursive=True)


def test_open_read_only_reads_with_the_restore_policy() -> None:
    store = open_read_only(f"memory://reader-policy-{uuid.uuid4().hex}")
    try:
        assert store.inner.retry == RetryPolicy.for_store(DstlOptions())  # type: ignore[attr-defined]
    finally:
        store.close()


def test_every_object_failing_twice_still_reads_the_model(env: Env) -> None:
    want = env.job.checkpoint_models[1]
    objects = env.objects("")
    assert any("/snapshots/" in p for p in objects) and any(p.endswith(".seg") for p in objects)
    reads: list[tuple[str, object]] = [
        ("heap", lambda c: state_of(read_state(c, 1))),
        ("lmdb", lambda c: state_of(read_state(c, 1, table="lmdb"))),
        ("columns", lambda c: state_of(read_state_columns(c, 1))),
        ("feed", lambda c: replay(read_changes(c, None, 1))),
    ]
    for name, read in reads:
        for p in objects:
            env.faulty.fail_reads([p], count=2, ops=["cat_file"])
        before = env.faulty.injected
        assert read(env.reader()) == want, name  # type: ignore[operator]
        assert env.faulty.injected > before, f"{name}: no fault was met"
        env.faulty.clear_faults()


def test_a_fault_that_outlasts_the_attempts_is_transient_and_names_the_object(env: Env) -> None:
    snapshot = next(p for p in env.objects("snapshots"))
    for read in (lambda c: list(read_state(c, 1)),
                 lambda c: list(read_state_columns(c, 1))):
        env.faulty.fail_reads([snapshot], count=None, ops=["cat_file"])
        calls = env.faulty.calls("cat_file", snapshot)
        with pytest.raises(TransientStorageError) as exc:
            read(env.reader())
        assert snapshot.rsplit("/", 1)[1] in str(exc.value)
        assert env.faulty.calls("cat_file", snapshot) - calls == FAST.max_attempts
        env.faulty.clear_faults()


def test_a_permanent_fault_is_not_retried(env: Env) -> None:
    snapshot = next(p for p in env.objects("snapshots"))
    env.faulty.fail_reads([snapshot], count=None, ops=["cat_file"], error=permanent_error)
    calls = env.faulty.calls("cat_file", snapshot)
    with pytest.raises(AccessDeniedError):
        list(read_state_columns(env.reader(), 1))
    assert env.faulty.calls("cat_file", snapshot) - calls == 1


def test_the_reader_store_refuses_writes_on_a_faulty_filesystem_too(env: Env) -> None:
    store = env.reader().store
    assert isinstance(store, ReadOnlyBlobStore)
    writes = env.faulty.write_attempts
    with pytest.raises(UsageError, match=r"refused"):
        store.put("x", b"y")
    assert env.faulty.write_attempts == writes


def test_slices_of_a_partition_fetch_its_snapshot_once_through_the_cache(
        env: Env, tmp_path: Path) -> None:
    """The Spark source reads the slices of a partition (keyGroupsPerSplit) through a process
    cache: a snapshot — v1, or a v2 file that only a whole GET can read — is downloaded once for
    all of them, not once per slice (each slice reads only its header range besides)."""
    catalog = env.reader()
    want = env.job.checkpoint_models[1]
    snapshots = env.objects("snapshots")
    per_task = len(plan_state_splits(1, task_states(catalog.manifest(1)), max_key_groups=2)) // 2
    assert per_task == 4 and len(snapshots) == 2

    def gets() -> list[int]:
        return [env.faulty.calls("cat_file", p) for p in snapshots]

    before = gets()
    assert state_of(read_state_columns(catalog, 1, max_key_groups=2)) == want
    direct = [b - a for a, b in zip(before, gets(), strict=True)]
    cache = LocalFileCache(str(tmp_path / "cache"))
    try:
        before = gets()
        assert state_of(read_state_columns(catalog, 1, max_key_groups=2, cache=cache)) == want
        cached = [b - a for a, b in zip(before, gets(), strict=True)]
        before = gets()
        assert state_of(read_state(catalog, 1, max_key_groups=2, cache=cache)) == want
        again = [b - a for a, b in zip(before, gets(), strict=True)]
    finally:
        cache.close()
    if env.table == "lmdb":  # v2: a header range, then the whole object, per slice
        assert direct == [2 * per_task] * 2
        assert cached == [per_task + 1] * 2  # headers, and one download
    assert all(c <= per_task + 1 for c in cached), cached
    assert again == [per_task] * 2  # the cache holds them: headers only
