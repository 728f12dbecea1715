"""The restore cache against S3 (a moto server reached through s3fs, no mocked calls): ten readers
of handles sharing segments read each segment object exactly once, counted at the filesystem."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import s3fs
from support import moto_server
from support.faulty_fs import FaultyFileSystem
from support.moto_server import s3_storage_options

from dstl import ChangelogHandle, ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.timer import ManualTimer
from restore import ChangelogReader, LocalFileCache

pytestmark = pytest.mark.s3
moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket

N = 10
MP = 128
WAIT = 30.0


def test_ten_readers_read_each_shared_segment_once_from_s3(moto_endpoint: str, s3_bucket: str,
                                                           tmp_path: Path) -> None:
    inner = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                              **s3_storage_options(moto_endpoint))
    ffs = FaultyFileSystem(inner)
    timer = ManualTimer()
    root = f"{s3_bucket}/app"
    with ChangelogStorage(f"s3://{root}", options=DstlOptions(persist_delay_s=1.0),
                          filesystem=ffs, timer=timer) as storage:
        writers = [storage.create_writer(f"op/{i}", KeyGroupRange.of_operator(MP, N, i))
                   for i in range(N)]
        handles: dict[str, ChangelogHandle] = {}
        for r in range(2):  # two flush windows: two segments shared by all ten writers
            for w in writers:
                for kg in w.key_groups:
                    w.append(kg, b"%s:%d:%d" % (w.log_id.encode(), r, kg))
            futures = {w.log_id: w.persist(0, r + 1) for w in writers}
            timer.advance(1.0)
            handles = {k: f.result(WAIT) for k, f in futures.items()}
        segments = sorted(o.key for o in storage.store.list("dstl/"))
        assert len(segments) == 2
        expected = {k: list(ChangelogReader(storage).read(h)) for k, h in handles.items()}
        before = {s: ffs.calls("cat_file", f"{root}/{s}") for s in segments}

        with LocalFileCache(tmp_path / "cache", timer=timer) as cache:
            got: dict[str, list[tuple[int, bytes]]] = {}
            errors: list[BaseException] = []
            barrier = threading.Barrier(N)

            def restore(log_id: str) -> None:
                barrier.wait()
                try:
                    got[log_id] = list(ChangelogReader(storage, cache=cache)
                                       .read(handles[log_id]))
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=restore, args=(k,), name=f"test-s3-reader-{k}")
                       for k in handles]
            for t in threads:
                t.start()
            for t in threads:
                t.join(WAIT)
            assert errors == []
            assert got == expected
            assert {s: ffs.calls("cat_file", f"{root}/{s}") - before[s] for s in segments} == \
                dict.fromkeys(segments, 1)
            st = cache.stats()
            assert (st["downloads"], st["hits"], st["leases_open"]) == (2, 2 * N - 2, 0)
            assert st["bytes_downloaded"] == sum(o.size for o in storage.store.list("dstl/"))
        assert not (tmp_path / "cache").exists()
