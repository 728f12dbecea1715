"""ChangelogReader through the LocalFileCache: the same changes as direct ranged reads, and ten
readers of handles sharing segments read each segment object exactly once (the analogue of
Flink's ChangelogRecoveryCachingITCase), counted at the filesystem (FaultyFileSystem)."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pytest
from support.faulty_fs import FaultyFileSystem

from dstl import ChangelogHandle, ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import (
    CorruptObjectError,
    ObjectNotFoundError,
    TruncatedObjectError,
    UsageError,
)
from dstl.timer import ManualTimer
from restore import ChangelogReader, LocalFileCache, SegmentCache

WRITERS = 10
ROUNDS = 3
MP = 128
WAIT = 10.0


@dataclass
class Written:
    storage: ChangelogStorage
    ffs: FaultyFileSystem
    root: str
    handles: dict[str, ChangelogHandle]
    segments: list[str]

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"


@pytest.fixture
def written() -> Iterator[Written]:
    """Ten writers, three flush windows: three segments, each shared by all ten writers."""
    ffs = FaultyFileSystem(fsspec.filesystem("memory", skip_instance_cache=True))
    root = f"/reader-cache-{uuid.uuid4().hex}"
    timer = ManualTimer()
    storage = ChangelogStorage(root, options=DstlOptions(persist_delay_s=1.0), filesystem=ffs,
                               timer=timer)
    try:
        writers = [storage.create_writer(f"op/{i}", KeyGroupRange.of_operator(MP, WRITERS, i))
                   for i in range(WRITERS)]
        handles: dict[str, ChangelogHandle] = {}
        for r in range(ROUNDS):
            for w in writers:
                w.append(-1, b"meta")
                for kg in w.key_groups:
                    w.append(kg, b"%s:r%d:kg%d" % (w.log_id.encode(), r, kg))
            futures = {w.log_id: w.persist(0, r + 1) for w in writers}
            timer.advance(1.0)
            handles = {k: f.result(WAIT) for k, f in futures.items()}
        segments = sorted(o.key for o in storage.store.list("dstl/"))
        assert len(segments) == ROUNDS
        for h in handles.values():
            assert h.segment_keys() == segments  # every handle spans every (shared) segment
        yield Written(storage, ffs, root, handles, segments)
    finally:
        storage.close()
        ffs.clear_faults()
        with contextlib.suppress(FileNotFoundError):
            ffs.inner.rm(root, recursive=True)


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[LocalFileCache]:
    c = LocalFileCache(tmp_path / "cache", timer=ManualTimer())
    yield c
    c.close()


def test_cached_reads_equal_direct_reads(written: Written, cache: LocalFileCache) -> None:
    direct = ChangelogReader(written.storage)
    cached = ChangelogReader(written.storage, cache=cache)
    for h in written.handles.values():
        expected = list(direct.read(h))
        kg_range = KeyGroupRange.of_operator(MP, WRITERS, int(h.log_id.split("/")[1]))
        assert len(expected) == ROUNDS * (1 + len(kg_range))
        assert list(cached.read(h)) == expected
        kgs = KeyGroupRange(0, 5)
        assert list(cached.read(h, key_groups=kgs)) == list(direct.read(h, key_groups=kgs))
    assert cache.stats()["downloads"] == ROUNDS
    assert cache.stats()["leases_open"] == 0


def test_ten_readers_sharing_segments_read_each_segment_once(written: Written,
                                                             cache: LocalFileCache) -> None:
    expected = {k: list(ChangelogReader(written.storage).read(h))
                for k, h in written.handles.items()}
    before = {s: written.ffs.calls("cat_file", written.path(s)) for s in written.segments}
    barrier = threading.Barrier(WRITERS)
    got: dict[str, list[tuple[int, bytes]]] = {}
    errors: list[BaseException] = []

    def restore(log_id: str) -> None:
        reader = ChangelogReader(written.storage, cache=cache)  # one reader per "backend"
        barrier.wait()
        try:
            got[log_id] = list(reader.read(written.handles[log_id]))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=restore, args=(k,), name=f"test-reader-{k}")
               for k in written.handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert errors == []
    assert got == expected
    reads = {s: written.ffs.calls("cat_file", written.path(s)) - before[s]
             for s in written.segments}
    assert reads == dict.fromkeys(written.segments, 1)
    st = cache.stats()
    assert (st["downloads"], st["hits"], st["leases_open"], st["files"]) == \
        (ROUNDS, WRITERS * ROUNDS - ROUNDS, 0, ROUNDS)


def test_without_a_cache_each_reader_fetches_its_own_ranges(written: Written) -> None:
    """The problem the cache solves: ten readers without it touch every segment ten times."""
    before = {s: written.ffs.calls("cat_file", written.path(s)) for s in written.segments}
    for h in written.handles.values():
        list(ChangelogReader(written.storage).read(h))
    reads = {s: written.ffs.calls("cat_file", written.path(s)) - before[s]
             for s in written.segments}
    assert reads == dict.fromkeys(written.segments, WRITERS)


def test_a_missing_segment_names_the_writer_and_nothing_is_cached(
        written: Written, cache: LocalFileCache, tmp_path: Path) -> None:
    written.ffs.inner.rm_file(written.path(written.segments[1]))
    reader = ChangelogReader(written.storage, cache=cache)
    with pytest.raises(ObjectNotFoundError, match=f"{written.segments[1]}.*'op/3'") as ei:
        list(reader.read(written.handles["op/3"]))
    assert ei.value.key == written.segments[1]
    st = cache.stats()
    assert (st["leases_open"], st["files"]) == (0, 1)  # the first segment, released


def test_a_corrupt_segment_is_detected_whole_and_never_cached(written: Written,
                                                              cache: LocalFileCache) -> None:
    key = written.segments[0]
    data = bytearray(written.ffs.inner.cat_file(written.path(key)))
    data[-30] ^= 0x40  # in the index: a ranged read of one record would not notice
    written.ffs.inner.pipe_file(written.path(key), bytes(data))
    direct = list(ChangelogReader(written.storage).read(written.handles["op/0"]))
    assert direct  # ranged reads verify records only
    with pytest.raises(CorruptObjectError, match=key) as ei:
        list(ChangelogReader(written.storage, cache=cache).read(written.handles["op/0"]))
    assert ei.value.key == key
    st = cache.stats()
    assert (st["files"], st["leases_open"], st["download_failures"]) == (0, 0, 1)


def test_a_truncated_segment_says_what_is_short_and_what_to_do(written: Written) -> None:
    """A segment cut short (an interrupted copy): the ranged read of a writer's change sets
    comes back short, and the message names the object, where it ends, what was needed and
    how to get out of it."""
    key = written.segments[0]
    data = written.ffs.inner.cat_file(written.path(key))
    written.ffs.inner.pipe_file(written.path(key), data[:40])
    refs = [r for r in written.handles["op/0"].change_sets if r.key == key]
    start, end = refs[0].offset, max(r.offset + r.length for r in refs)
    with pytest.raises(TruncatedObjectError) as ei:
        list(ChangelogReader(written.storage).read(written.handles["op/0"]))
    err = ei.value
    assert (err.key, err.offset, err.expected_len, err.got_len) == (key, 40, end - start,
                                                                    40 - start)
    assert str(err) == (
        f"{key} at offset 40: the object ends early: its change-set records at bytes "
        f"[{start}, {end}) needed {end - start} bytes, {40 - start} were there (it is shorter "
        "than when it was written: an interrupted copy or upload, or a damaged store. Copy it "
        "again from where it came from, or restore from an earlier checkpoint that does not "
        "use it (`dstl verify <state_uri> --checkpoint N` says whether one restores))")


def test_reader_accepts_a_record_source_and_rejects_anything_else(written: Written,
                                                                  cache: LocalFileCache) -> None:
    src = SegmentCache(cache, written.storage.store)
    h = written.handles["op/9"]
    assert list(ChangelogReader(written.storage, cache=src).read(h)) == \
        list(ChangelogReader(written.storage).read(h))
    with pytest.raises(UsageError, match="LocalFileCache"):
        ChangelogReader(written.storage, cache=object())  # type: ignore[arg-type]
