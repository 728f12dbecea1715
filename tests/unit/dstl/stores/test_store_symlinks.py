"""A checkpoint directory is untrusted input: no store operation follows a symbolic link inside the
root.

Every ``LocalBlobStore`` operation is tried twice for each of two links planted inside the root: a
link to a file outside the root at the key itself, and a link to a directory outside the root at a
parent of the key. Each must fail with :class:`~dstl.errors.UnsafePathError` naming the key (or,
for ``list``, not report the link), and the outside file must be neither read, changed nor deleted.
The restore cache must not follow links in its own directory either.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from dstl.errors import CacheError, ObjectNotFoundError, UnsafePathError
from dstl.stores import LocalBlobStore
from restore.cache import LocalFileCache

SECRET = b"outside the root: must never be read, changed or deleted"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the store root holding one file."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "victim").write_bytes(SECRET)
    return d


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


def untouched(outside: Path) -> None:
    assert (outside / "victim").read_bytes() == SECRET
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


def plant_file_link(root: Path, outside: Path) -> str:
    """``snapshots/x`` is a link to the outside file; returns the key."""
    (root / "snapshots").mkdir()
    os.symlink(outside / "victim", root / "snapshots" / "x")
    return "snapshots/x"


def plant_dir_link(root: Path, outside: Path) -> str:
    """``dstl`` is a link to the outside directory; returns a key below it."""
    os.symlink(outside, root / "dstl")
    return "dstl/victim"


PLANTS = {"file-link": plant_file_link, "dir-link": plant_dir_link}
READS: dict[str, Callable[[LocalBlobStore, str], object]] = {
    "get": lambda s, k: s.get(k),
    "get_range": lambda s, k: s.get_range(k, 0, 10),
    "head": lambda s, k: s.head(k),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
@pytest.mark.parametrize("op", sorted(READS))
def test_reads_never_follow_a_link(root: Path, outside: Path, plant: str, op: str) -> None:
    key = PLANTS[plant](root, outside)
    store = LocalBlobStore(root)
    with pytest.raises(UnsafePathError, match="symbolic link") as info:
        READS[op](store, key)
    assert info.value.key == key and key in str(info.value)
    untouched(outside)


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_delete_never_follows_a_link(root: Path, outside: Path, plant: str) -> None:
    key = PLANTS[plant](root, outside)
    store = LocalBlobStore(root)
    with pytest.raises(UnsafePathError, match="symbolic link") as info:
        store.delete([key])
    assert info.value.key == key
    untouched(outside)


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_put_never_writes_through_a_link(root: Path, outside: Path, plant: str) -> None:
    key = PLANTS[plant](root, outside)
    store = LocalBlobStore(root)
    with pytest.raises(UnsafePathError, match="symbolic link") as info:
        store.put(key, b"new")
    assert info.value.key == key
    untouched(outside)


def test_put_below_a_linked_directory_writes_nothing_outside(root: Path, outside: Path) -> None:
    os.symlink(outside, root / "dstl")
    store = LocalBlobStore(root)
    with pytest.raises(UnsafePathError, match="symbolic link") as info:
        store.put("dstl/sub/new.seg", b"segment")
    assert info.value.key == "dstl/sub/new.seg"
    untouched(outside)


def test_put_onto_a_dangling_link_creates_nothing_outside(root: Path, outside: Path) -> None:
    (root / "dstl").mkdir()
    os.symlink(outside / "created", root / "dstl" / "new.seg")
    store = LocalBlobStore(root)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        store.put("dstl/new.seg", b"segment")
    assert not (outside / "created").exists()
    untouched(outside)


def test_list_reports_no_link_and_does_not_descend(root: Path, outside: Path) -> None:
    plant_file_link(root, outside)
    plant_dir_link(root, outside)
    (root / "snapshots" / "real").write_bytes(b"r")
    os.symlink(outside, root / "snapshots" / "linkdir")
    store = LocalBlobStore(root)
    assert [i.key for i in store.list()] == ["snapshots/real"]
    assert [i.key for i in store.list("snapshots/")] == ["snapshots/real"]
    assert list(store.list("dstl/")) == []
    assert list(store.list("snapshots/linkdir/")) == []
    untouched(outside)


def test_delete_of_other_keys_still_works_and_keeps_the_link(root: Path, outside: Path) -> None:
    key = plant_file_link(root, outside)
    store = LocalBlobStore(root)
    store.put("snapshots/y", b"y")
    store.delete(["snapshots/y"])
    assert store.head("snapshots/y") is None
    assert os.path.islink(root / key)
    untouched(outside)


def test_a_fifo_at_a_key_is_refused_without_blocking(root: Path) -> None:
    os.mkfifo(root / "fifo")
    store = LocalBlobStore(root)
    with pytest.raises(UnsafePathError, match="not a regular file"):
        store.get("fifo")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        store.get_range("fifo", 0, 1)
    assert stat.S_ISFIFO(os.lstat(root / "fifo").st_mode)


def test_a_file_as_a_parent_directory_is_not_found(root: Path) -> None:
    (root / "dstl").write_bytes(b"a file, not a directory")
    store = LocalBlobStore(root)
    with pytest.raises(ObjectNotFoundError):
        store.get("dstl/x")
    assert store.head("dstl/x") is None
    store.delete(["dstl/x"])  # idempotent: nothing there
    assert list(store.list("dstl/")) == []


def test_the_root_itself_may_be_a_link(tmp_path: Path) -> None:
    real = tmp_path / "real-root"
    real.mkdir()
    os.symlink(real, tmp_path / "root-link")
    store = LocalBlobStore(tmp_path / "root-link")
    store.put("dstl/a", b"a")
    assert store.get("dstl/a") == b"a"
    assert (real / "dstl" / "a").read_bytes() == b"a"


# --------------------------------------------------------------------------- restore cache


def test_cache_refuses_a_linked_lock_file(tmp_path: Path, outside: Path) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    os.symlink(outside / "created-lock", cache_dir / ".dstl-cache.lock")
    with pytest.raises(CacheError, match="symbolic link"):
        LocalFileCache(cache_dir)
    assert not (outside / "created-lock").exists()
    untouched(outside)


def test_cache_never_reads_a_cached_file_replaced_by_a_link(tmp_path: Path, root: Path,
                                                            outside: Path) -> None:
    store = LocalBlobStore(root)
    store.put("dstl/seg", b"cached object")
    with LocalFileCache(tmp_path / "cache") as cache:
        with cache.lease(store, "dstl/seg") as lease:
            assert lease.read(0, 6) == b"cached"
        (cached,) = [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".obj")]
        cached.unlink()
        os.symlink(outside / "victim", cached)
        with pytest.raises(CacheError, match="symbolic link"):
            cache.lease(store, "dstl/seg")
    untouched(outside)


# --------------------------------------------------------------------------- end to end


def test_a_writer_never_writes_through_a_linked_log_directory(root: Path,
                                                              outside: Path) -> None:
    from dstl import ChangelogStorage, DstlOptions
    from dstl.errors import DstlError
    from dstl.keygroups import KeyGroupRange

    os.symlink(outside, root / "dstl")
    options = DstlOptions(upload_max_attempts=2, upload_retry_delay_s=0.0)
    with ChangelogStorage(str(root), options=options) as storage:
        writer = storage.create_writer("op", KeyGroupRange(0, 3))
        writer.append(1, b"change")
        future = writer.persist(0, 1)
        with pytest.raises(DstlError) as info:
            future.result(timeout=30)
    chain = [info.value, info.value.__cause__]
    assert any(isinstance(e, UnsafePathError) for e in chain), chain
    untouched(outside)
