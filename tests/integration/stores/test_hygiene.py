"""G8 hygiene: after close (also after errors) no threads, temp files or open files remain."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import fsspec
import pytest
from support.faulty_fs import FaultyFileSystem, permanent_error

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import UploadFailedError


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _dstl_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dstl-")]


def test_close_leaves_no_threads_temp_files_or_fds(tmp_path: Path) -> None:
    fds0, threads0 = _fds(), _dstl_threads()
    s = ChangelogStorage(str(tmp_path / "store"), options=DstlOptions(persist_delay_s=0.0))
    ws = [s.create_writer(f"w{i}", KeyGroupRange(0, 7)) for i in range(4)]
    for w in ws:
        for i in range(100):
            w.append(i % 8, b"x" * 100)
        w.persist(0, 1).result(10)
    assert _dstl_threads()  # the storage does run threads
    s.close()
    s.close()  # idempotent
    assert _dstl_threads() == threads0
    assert not list(tmp_path.rglob("*.tmp"))
    assert len(_fds()) <= len(fds0)


def test_close_after_failed_uploads_is_clean(tmp_path: Path) -> None:
    fs = FaultyFileSystem(fsspec.filesystem("file", skip_instance_cache=True))
    fs.fail_writes(count=None, error=permanent_error)
    s = ChangelogStorage(str(tmp_path / "store"), filesystem=fs,
                         options=DstlOptions(persist_delay_s=0.0, upload_max_attempts=2))
    w = s.create_writer("w", KeyGroupRange(0, 7))
    w.append(1, b"x")
    with pytest.raises(UploadFailedError):
        w.persist(0, 1).result(10)
    s.close()
    assert _dstl_threads() == []
    assert not list(tmp_path.rglob("*.tmp"))
