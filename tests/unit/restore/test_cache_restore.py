"""restore_backend through one LocalFileCache: ten backends of one process restore in parallel
from segments they share, and every segment object is read once (Flink's
ChangelogRecoveryCachingITCase, with the count taken at the filesystem)."""

from __future__ import annotations

import contextlib
import threading
import uuid
from pathlib import Path

import fsspec
from support.faulty_fs import FaultyFileSystem

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for
from dstl.timer import ManualTimer
from materializer.backend import ChangelogKeyedStateBackend
from materializer.options import BackendOptions
from materializer.states import ValueStateDescriptor
from restore import LocalFileCache, restore_backend

MP = 64
N = 10
WAIT = 10.0
OPTS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
KEYS = [f"user-{i}" for i in range(200)]


def test_ten_backends_restore_in_parallel_and_read_each_segment_once(tmp_path: Path) -> None:
    ffs = FaultyFileSystem(fsspec.filesystem("memory", skip_instance_cache=True))
    root = f"/restore-cache-{uuid.uuid4().hex}"
    timer = ManualTimer()
    storage = ChangelogStorage(root, options=DstlOptions(persist_delay_s=1.0), filesystem=ffs,
                               timer=timer)
    cache = LocalFileCache(tmp_path / "cache", timer=timer)
    try:
        ranges = [KeyGroupRange.of_operator(MP, N, i) for i in range(N)]
        backends = [ChangelogKeyedStateBackend(storage, f"op/{i}", ranges[i], MP, options=OPTS)
                    for i in range(N)]
        model: dict[str, int] = {}
        for cp in (1, 2):  # two checkpoints: two shared segments
            for n, k in enumerate(KEYS):
                b = backends[next(i for i, r in enumerate(ranges)
                                  if key_group_for(k.encode(), MP) in r)]
                b.set_current_key(k)
                b.get_state(ValueStateDescriptor("v")).update(n * cp)
                model[k] = n * cp
            futures = [b.snapshot(cp) for b in backends]
            timer.advance(1.0)
            handles = [f.result(WAIT) for f in futures]
        for b in backends:
            b.close()
        segments = sorted({ref.key for h in handles for nm in h.non_materialized
                           for ref in nm.change_sets})
        assert len(segments) == 2
        before = {s: ffs.calls("cat_file", f"{root}/{s}") for s in segments}

        restored: dict[int, dict[str, int]] = {}
        errors: list[BaseException] = []
        barrier = threading.Barrier(N)

        def restore(i: int) -> None:
            barrier.wait()
            try:
                r = restore_backend([handles[i]], storage, ranges[i], cache=cache,
                                    operator_id=f"op/{i}")
                try:
                    state = r.get_state(ValueStateDescriptor("v"))
                    got = {}
                    for k in KEYS:
                        if key_group_for(k.encode(), MP) in ranges[i]:
                            r.set_current_key(k)
                            got[k] = state.value()
                    restored[i] = got
                finally:
                    r.close()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=restore, args=(i,), name=f"test-restore-{i}")
                   for i in range(N)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT * 3)
        assert errors == []
        assert {k: v for got in restored.values() for k, v in got.items()} == model
        assert {s: ffs.calls("cat_file", f"{root}/{s}") - before[s] for s in segments} == \
            dict.fromkeys(segments, 1)
        # every restore queued both segments for prefetch: each of the 2 N jobs started a
        # download, found the segment cached or in flight, or was dropped unstarted because
        # its restore had ended first (its leases found the files; seen in a clean-clone run)
        st = cache.wait_for_stats(lambda s: s["prefetch_started"] + s["prefetch_present"]
                                  + s["prefetch_cancelled"] == 2 * N)
        assert (st["downloads"], st["leases_open"]) == (2, 0)
        # each of the 2 N leases found its segment downloaded (a hit) unless it won the race
        # to download it itself
        lease_downloads = st["downloads"] - st["prefetch_started"]
        assert st["hits"] + lease_downloads == 2 * N
        assert st["prefetch_failed"] == st["prefetch_skipped"] == 0
    finally:
        cache.close()
        storage.close()
        with contextlib.suppress(FileNotFoundError):
            ffs.inner.rm(root, recursive=True)
    assert not (tmp_path / "cache").exists()
