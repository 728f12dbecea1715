"""One bad key in a manifest does not stop every later deletion pass (items 5 and 8).

A doomed object that the store refuses to delete for good (a symbolic link planted in the
checkpoint directory, or a permanent error of the filesystem) is logged and counted once and then
left alone; the other doomed objects of the same pass are deleted, and later passes delete what
they doom. A transient failure keeps the key doomed for the next pass, as before.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import Any

import fsspec
import pytest
from support.faulty_fs import FaultyFileSystem, permanent_error, retryable_error

from dstl.checkpoint.coordinator import CheckpointCoordinator
from dstl.layout import manifest_key, segment_key
from dstl.stores import FsspecBlobStore, LocalBlobStore

T0_MS = 1_700_000_000_000
_numbers = itertools.count()


def upload(store: Any) -> str:
    key = segment_key(T0_MS, "0123456789ab", next(_numbers), 0)
    store.put(key, b"segment")
    return key


def checkpoint(coord: CheckpointCoordinator, refs: list[str]) -> None:
    cid = coord.trigger(["t"])
    assert coord.acknowledge(cid, "t", {"n": len(refs)}, refs, len(refs), len(refs))


def coordinator(store: Any) -> CheckpointCoordinator:
    return CheckpointCoordinator(store, job_id="job", retained=1,
                                 wall_clock=lambda: T0_MS / 1000)


def stat(coord: CheckpointCoordinator, name: str) -> float:
    return coord.stats()[f"CheckpointCoordinator.{name}"]


def test_a_linked_snapshot_directory_is_skipped_and_later_passes_go_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    store = LocalBlobStore(root)
    snap = "snapshots/op/0018bcfe5680000-00000001-ab.snap"
    store.put(snap, b"snapshot")
    a = upload(store)
    coord = coordinator(store)
    checkpoint(coord, [a, snap])
    # An attacker swaps the operator's snapshot directory for a link to a directory outside
    # the root holding a file of the same name.
    os.rename(root / "snapshots" / "op", tmp_path / "moved")
    outside.mkdir()
    (outside / "0018bcfe5680000-00000001-ab.snap").write_bytes(b"outside")
    os.symlink(outside, root / "snapshots" / "op")

    b = upload(store)
    caplog.set_level(logging.WARNING)
    checkpoint(coord, [b])  # subsumes checkpoint 1: its manifest, a and snap are doomed
    assert store.head(a) is None  # deleted although snap could not be
    assert store.head(manifest_key(1, 1)) is None
    assert (outside / "0018bcfe5680000-00000001-ab.snap").read_bytes() == b"outside"
    assert coord.doomed() == (frozenset(), frozenset())  # snap is not retried forever
    assert stat(coord, "numberOfUndeletableObjects") == 1
    assert snap in caplog.text and "symbolic link" in caplog.text

    c = upload(store)
    checkpoint(coord, [c])  # a later pass is not stuck on snap
    assert store.head(b) is None and store.head(c) is not None
    assert coord.doomed() == (frozenset(), frozenset())
    assert stat(coord, "numberOfUndeletableObjects") == 1
    assert (outside / "0018bcfe5680000-00000001-ab.snap").read_bytes() == b"outside"


class OneKeyFaultyFileSystem(FaultyFileSystem):
    """Removing a path that contains ``bad`` fails with ``error()``."""

    def __init__(self, inner: fsspec.AbstractFileSystem) -> None:
        super().__init__(inner)
        self.bad: str | None = None
        self.error = permanent_error

    def _check(self, paths: list[str]) -> None:
        if self.bad is not None and any(self.bad in p for p in paths):
            raise self.error()

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._check(path if isinstance(path, list) else [path])
        super().rm(path, recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path: str) -> None:
        self._check([path])
        super().rm_file(path)


@pytest.fixture
def faulty(tmp_path: Path) -> tuple[OneKeyFaultyFileSystem, FsspecBlobStore]:
    fs = OneKeyFaultyFileSystem(fsspec.filesystem("file", skip_instance_cache=True))
    return fs, FsspecBlobStore(fs, str(tmp_path / "job"))


def keys(store: FsspecBlobStore) -> set[str]:
    return {i.key for i in store.list("dstl/")}


def test_a_permanently_failing_key_does_not_block_the_others(
        faulty: tuple[OneKeyFaultyFileSystem, FsspecBlobStore]) -> None:
    fs, store = faulty
    coord = coordinator(store)
    a1, a2, a3 = upload(store), upload(store), upload(store)
    checkpoint(coord, [a1, a2, a3])
    fs.bad = a2.rpartition("/")[2]
    b = upload(store)
    checkpoint(coord, [b])
    assert keys(store) == {a2, b}
    assert coord.doomed() == (frozenset(), frozenset())
    assert stat(coord, "numberOfUndeletableObjects") == 1
    c = upload(store)
    checkpoint(coord, [c])
    assert keys(store) == {a2, c}


def test_a_transient_failure_keeps_the_key_doomed(
        faulty: tuple[OneKeyFaultyFileSystem, FsspecBlobStore]) -> None:
    fs, store = faulty
    fs.error = retryable_error
    coord = coordinator(store)
    a = upload(store)
    checkpoint(coord, [a])
    fs.bad = a.rpartition("/")[2]
    b = upload(store)
    checkpoint(coord, [b])
    assert a in coord.doomed()[1]
    assert stat(coord, "numberOfUndeletableObjects") == 0
    fs.bad = None
    c = upload(store)
    checkpoint(coord, [c])
    assert keys(store) == {c}
    assert coord.doomed() == (frozenset(), frozenset())


def test_orphan_collection_skips_a_linked_object_and_deletes_the_rest(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"outside")
    store = LocalBlobStore(root)
    orphan = segment_key(0, "0123456789ab", 1, 0)
    store.put(orphan, b"orphan")
    link = segment_key(0, "0123456789ab", 2, 0)
    os.symlink(outside / "victim", root / link)  # looks like an old orphan segment
    coord = coordinator(store)
    assert coord.collect_orphans(min_age_s=1, now_ms=T0_MS) == [orphan]
    assert (outside / "victim").read_bytes() == b"outside"
    assert os.path.islink(root / link)
