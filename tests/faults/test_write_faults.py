"""Fault injection through the fsspec wrapper production code really uses (FsspecBlobStore):
failed, hanging and ghost-successful attempts never duplicate or lose a change set (G1, G6, G7)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import fsspec
import pytest
from support.faulty_fs import FaultyFileSystem, permanent_error

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import UploadFailedError
from dstl.segment import decode_segment
from restore import ChangelogReader

KGS = KeyGroupRange(0, 31)


@pytest.fixture
def fs() -> Iterator[FaultyFileSystem]:
    inner = fsspec.filesystem("memory", skip_instance_cache=True)
    inner.store.clear()
    ffs = FaultyFileSystem(inner)
    yield ffs
    ffs.clear_faults()
    inner.store.clear()


def _storage(fs: FaultyFileSystem, **kw: object) -> ChangelogStorage:
    base: dict[str, object] = dict(persist_delay_s=0.0, upload_retry_delay_s=0.01,
                                   upload_timeout_s=0.3, upload_max_attempts=3)
    base.update(kw)
    return ChangelogStorage("/faulty-root", options=DstlOptions(**base),  # type: ignore[arg-type]
                            filesystem=fs)


def _write(storage: ChangelogStorage, n: int = 50) -> tuple[object, list[tuple[int, bytes]]]:
    w = storage.create_writer("w", KGS)
    changes = [(i % 32, b"change-%d" % i) for i in range(n)]
    for kg, p in changes:
        w.append(kg, p)
    return w.persist(0, 1), sorted(changes, key=lambda c: c[0])


def _segments(storage: ChangelogStorage) -> list[str]:
    return [o.key for o in storage.store.list("dstl/")]


def _settle(storage: ChangelogStorage) -> None:
    storage._discard.submit(lambda: None).result(10)


@pytest.mark.parametrize("k", [1, 2])
def test_first_k_attempts_fail_then_one_object(fs: FaultyFileSystem, k: int) -> None:
    fs.fail_writes(count=k)
    with _storage(fs) as s:
        fut, expected = _write(s)
        h = fut.result(10)  # type: ignore[attr-defined]
        _settle(s)
        assert list(ChangelogReader(s).read(h)) == expected
        assert _segments(s) == h.segment_keys()
        assert s.metrics()["ChangelogStorage.attemptsPerUpload.max"] == k + 1
        assert fs.write_attempts == k + 1


def test_exhausted_attempts_give_a_typed_error_with_attempts(fs: FaultyFileSystem) -> None:
    fs.fail_writes(count=None)
    with _storage(fs) as s:
        fut, _ = _write(s)
        with pytest.raises(UploadFailedError) as info:
            fut.result(10)  # type: ignore[attr-defined]
        assert info.value.attempts == 3 and info.value.__cause__ is not None
        _settle(s)
        assert _segments(s) == []


def test_non_retryable_error_fails_at_once(fs: FaultyFileSystem) -> None:
    fs.fail_writes(count=None, error=permanent_error)
    with _storage(fs) as s:
        fut, _ = _write(s)
        with pytest.raises(UploadFailedError, match="non-retryable"):
            fut.result(10)  # type: ignore[attr-defined]
        assert fs.write_attempts == 1


def test_hang_past_the_timeout_starts_a_concurrent_attempt(fs: FaultyFileSystem) -> None:
    release = threading.Event()
    fs.hang_writes([1], until=release)
    with _storage(fs, upload_timeout_s=0.2) as s:
        fut, expected = _write(s)
        h = fut.result(10)  # type: ignore[attr-defined]
        assert list(ChangelogReader(s).read(h)) == expected
        release.set()
        s.scheduler.close()  # waits for the slow attempt; its late object is discarded
        _settle(s)
        assert _segments(s) == h.segment_keys()  # exactly one object holds the change set


def test_fail_after_the_write_landed_leaves_no_duplicate(fs: FaultyFileSystem) -> None:
    fs.fail_writes_after_landing(count=1)
    with _storage(fs) as s:
        fut, expected = _write(s)
        h = fut.result(10)  # type: ignore[attr-defined]
        _settle(s)
        assert _segments(s) == h.segment_keys()
        seg = decode_segment(s.store.get(h.segment_keys()[0]))
        assert [(e.log_id, e.sqn) for e in seg.entries] == [("w", 0)]
        assert list(ChangelogReader(s).read(h)) == expected
