"""Injected storage faults under the checkpoint coordinator (FaultyFileSystem -> FsspecBlobStore).

G3: a failed manifest put leaves the checkpoint incomplete (nothing deleted, a typed error) and a
retry of the same checkpoint id commits under the next attempt. G5: a failed delete loses track of
nothing — the keys stay doomed and are deleted at the next completion; manifests always go first,
so a crash in between leaves only orphans, which orphan collection removes.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import fsspec
import pytest
from support.faulty_fs import FaultyFileSystem, permanent_error, retryable_error

from dstl.checkpoint.coordinator import CheckpointCommitError, CheckpointCoordinator
from dstl.errors import AccessDeniedError, StorageError, TransientStorageError
from dstl.layout import manifest_key, segment_key
from dstl.stores import FsspecBlobStore

T0_MS = 1_700_000_000_000
_numbers = itertools.count()


class RmFaultyFileSystem(FaultyFileSystem):
    """Also fails removals: of every path while ``fail_rm`` is set, or of paths containing
    ``fail_rm_containing``."""

    def __init__(self, inner: fsspec.AbstractFileSystem, **kwargs: Any) -> None:
        super().__init__(inner, **kwargs)
        self.fail_rm = False
        self.fail_rm_containing: str | None = None
        self.removed: list[str] = []

    def _rm_fault(self, paths: list[str]) -> None:
        if self.fail_rm or (self.fail_rm_containing is not None
                            and any(self.fail_rm_containing in p for p in paths)):
            raise retryable_error()
        self.removed.extend(paths)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._rm_fault(path if isinstance(path, list) else [path])
        super().rm(path, recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path: str) -> None:
        self._rm_fault([path])
        super().rm_file(path)


@pytest.fixture
def fs() -> RmFaultyFileSystem:
    return RmFaultyFileSystem(fsspec.filesystem("file", skip_instance_cache=True))


@pytest.fixture
def store(fs: RmFaultyFileSystem, tmp_path: Path) -> FsspecBlobStore:
    return FsspecBlobStore(fs, str(tmp_path / "job"))


def keys(store: FsspecBlobStore, prefix: str = "") -> set[str]:
    return {i.key for i in store.list(prefix)}


def upload(store: FsspecBlobStore, created_ms: int = T0_MS) -> str:
    key = segment_key(created_ms, "0123456789ab", next(_numbers), 0)
    store.put(key, b"segment")
    return key


def coordinator(store: FsspecBlobStore, retained: int = 1) -> CheckpointCoordinator:
    return CheckpointCoordinator(store, job_id="job", retained=retained,
                                 wall_clock=lambda: T0_MS / 1000)


def checkpoint(coord: CheckpointCoordinator, refs: list[str],
               checkpoint_id: int | None = None) -> None:
    cid = coord.trigger(["t"], checkpoint_id)
    assert coord.acknowledge(cid, "t", {"n": len(refs)}, refs, len(refs), len(refs))


@pytest.mark.parametrize("fault,cause", [("fail_writes", TransientStorageError),
                                         ("permanent", AccessDeniedError)])
def test_g3_failed_manifest_put_leaves_the_checkpoint_incomplete_and_a_retry_commits(
        fs: RmFaultyFileSystem, store: FsspecBlobStore, fault: str,
        cause: type[Exception]) -> None:
    coord = coordinator(store)
    a = upload(store)
    checkpoint(coord, [a])
    b = upload(store)
    cid = coord.trigger(["t", "u"])
    coord.acknowledge(cid, "t", {}, [b], 1, 1)
    fs.fail_writes(1, error=permanent_error if fault == "permanent" else retryable_error)
    with pytest.raises(CheckpointCommitError) as info:
        coord.acknowledge(cid, "u", {}, [], 0, 0)
    err = info.value
    assert isinstance(err, StorageError) and isinstance(err.__cause__, cause)
    assert err.checkpoint_id == cid == 2 and err.key == manifest_key(2, 1)
    assert f"complete({cid})" in str(err)
    # Not complete, nothing deleted.
    assert coord.pending_checkpoint_id == cid
    latest = coord.latest()
    assert latest is not None and latest.checkpoint_id == 1
    assert keys(store, "checkpoints/") == {manifest_key(1, 1)}
    assert {a, b} <= keys(store) and fs.removed == []
    assert coord.stats()["CheckpointCoordinator.numberOfFailedCommits"] == 1

    done = coord.complete(cid)  # the retry of the same checkpoint id
    assert (done.manifest.checkpoint_id, done.manifest.attempt) == (2, 2)
    assert keys(store, "checkpoints/") == {manifest_key(2, 2)}
    assert a not in keys(store) and b in keys(store)
    again = CheckpointCoordinator.recover(store, "job", retained=1)
    recovered = again.latest()
    assert recovered is not None and recovered.key == manifest_key(2, 2)


def test_a_ghost_manifest_put_is_cleaned_up_by_the_retry(fs: RmFaultyFileSystem,
                                                          store: FsspecBlobStore) -> None:
    coord = coordinator(store)
    a = upload(store)
    checkpoint(coord, [a])  # (also creates the local checkpoints/ directory)
    cid = coord.trigger(["t"])
    fs.fail_writes_after_landing(1)  # the put lands, then the connection resets
    with pytest.raises(CheckpointCommitError):
        coord.acknowledge(cid, "t", {}, [a], 1, 1)
    assert manifest_key(2, 1) in keys(store)  # the ghost
    done = coord.complete(cid)
    assert done.manifest.attempt == 2
    assert set(done.deleted) == {manifest_key(1, 1), manifest_key(2, 1)}
    assert keys(store, "checkpoints/") == {manifest_key(2, 2)}
    assert a in keys(store)


def test_a_retry_by_re_triggering_the_same_id_commits(fs: RmFaultyFileSystem,
                                                      store: FsspecBlobStore) -> None:
    coord = coordinator(store, retained=2)
    a, b = upload(store), upload(store)
    checkpoint(coord, [a])
    cid = coord.trigger(["t"])
    fs.fail_writes_after_landing(1)
    with pytest.raises(CheckpointCommitError):
        coord.acknowledge(cid, "t", {}, [a, b], 2, 1)
    checkpoint(coord, [a, b], checkpoint_id=cid)  # Spark re-runs the batch
    latest = coord.latest()
    assert latest is not None and (latest.checkpoint_id, latest.attempt) == (2, 2)
    assert keys(store, "checkpoints/") == {manifest_key(1, 1), manifest_key(2, 2)}
    assert {a, b} <= keys(store)


def test_an_aborted_checkpoint_leaves_no_ghost_manifest(fs: RmFaultyFileSystem,
                                                        store: FsspecBlobStore) -> None:
    coord = coordinator(store)
    a = upload(store)
    checkpoint(coord, [a])
    cid = coord.trigger(["t"])
    fs.fail_writes_after_landing(1)
    with pytest.raises(CheckpointCommitError):
        coord.acknowledge(cid, "t", {}, [a], 1, 1)
    coord.abort(cid, "the batch failed")
    assert manifest_key(2, 1) in coord.doomed()[0]
    checkpoint(coord, [a])
    assert keys(store, "checkpoints/") == {manifest_key(3, 1)}


def test_g5_a_failed_delete_is_retried_at_the_next_completion(fs: RmFaultyFileSystem,
                                                              store: FsspecBlobStore) -> None:
    coord = coordinator(store)
    a, b, c = upload(store), upload(store), upload(store)
    checkpoint(coord, [a])
    fs.fail_rm = True
    checkpoint(coord, [b])  # completes; the deletion of checkpoint 1 fails
    latest = coord.latest()
    assert latest is not None and latest.checkpoint_id == 2
    assert {a, manifest_key(1, 1)} <= keys(store)
    assert coord.doomed() == (frozenset({manifest_key(1, 1)}), frozenset({a}))
    stats = coord.stats()
    assert stats["CheckpointCoordinator.numberOfDeleteFailures"] == 1
    assert stats["CheckpointCoordinator.pendingDeletions"] == 2
    assert fs.removed == []  # the manifest failed first, so the object was not even tried
    fs.fail_rm = False
    checkpoint(coord, [b, c])
    assert keys(store, "checkpoints/") == {manifest_key(3, 1)}
    assert keys(store, "dstl/") == {b, c}
    assert coord.doomed() == (frozenset(), frozenset())


def test_g5_a_crash_between_manifest_and_object_deletes_leaves_only_orphans(
        fs: RmFaultyFileSystem, store: FsspecBlobStore) -> None:
    coord = coordinator(store)
    a = upload(store, created_ms=T0_MS - 3_600_000)
    b = upload(store)
    checkpoint(coord, [a])
    fs.fail_rm_containing = "/dstl/"  # manifests delete fine, objects do not
    checkpoint(coord, [b])
    assert keys(store, "checkpoints/") == {manifest_key(2, 1)}  # no manifest names a any more
    assert a in keys(store) and a in coord.doomed()[1]
    del coord  # the driver dies before the retry
    fs.fail_rm_containing = None
    again = CheckpointCoordinator.recover(store, "job", retained=1)
    assert again.doomed() == (frozenset(), frozenset())  # the new driver never heard of a
    assert again.collect_orphans(min_age_s=60, now_ms=T0_MS) == [a]
    assert keys(store, "dstl/") == {b}


def test_failed_orphan_deletes_are_kept_for_the_next_completion(
        fs: RmFaultyFileSystem, store: FsspecBlobStore) -> None:
    coord = coordinator(store)
    orphan = upload(store, created_ms=0)
    fs.fail_rm = True
    assert coord.collect_orphans(min_age_s=1, now_ms=T0_MS) == []
    assert coord.doomed()[1] == {orphan}
    fs.fail_rm = False
    checkpoint(coord, [])
    assert orphan not in keys(store)
