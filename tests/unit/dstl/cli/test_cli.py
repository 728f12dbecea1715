"""The operator commands through ``dstl.cli.main``, as ``python -m dstl`` runs them: ``dstl gc``
on a local store (what it deletes, what it prints, how it refuses another job's store) and the
log-only demo (a short run that reads every handle back and compares it). The Spark demo is run
by ``make demo``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dstl.checkpoint import CheckpointCoordinator
from dstl.cli import main
from dstl.layout import segment_key
from dstl.stores import BlobStore, open_store

HOUR_MS = 3_600_000


def _segment(store: BlobStore, created_ms: int, n: int) -> str:
    key = segment_key(created_ms, "a1b2c3d4e5f6", n, 0)
    store.put(key, b"payload %d" % n)
    return key


def _checkpoint(coord: CheckpointCoordinator, keys: list[str]) -> None:
    cid = coord.trigger(["op/0"])
    assert coord.acknowledge(cid, "op/0", {}, keys, 1, 1)


def test_gc_deletes_stale_manifests_then_old_orphans(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    store = open_store(str(tmp_path))
    old = int(time.time() * 1000) - 2 * HOUR_MS
    only_first, shared, orphan = (_segment(store, old, n) for n in range(3))
    young = _segment(store, int(time.time() * 1000), 3)
    coord = CheckpointCoordinator(store, job_id="clicks", retained=1)
    _checkpoint(coord, [only_first, shared])
    first = coord.latest()
    assert first is not None
    leftovers = {k: store.get(k) for k in (first.key, only_first)}
    _checkpoint(coord, [shared])
    coord.close()
    for key, data in leftovers.items():  # a crash before the job's deletion ran
        store.put(key, data)

    # The job retains 1 (recorded in its manifests): the first checkpoint's manifest is stale
    # and goes first, then the objects no retained checkpoint names and that are older than
    # --min-age.
    assert main(["gc", str(tmp_path), "--job", "clicks", "--min-age", "60"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["keeping the newest 1 checkpoints of job 'clicks' (the job retains 1): [2]",
                   f"deleted {first.key}", f"deleted {only_first}", f"deleted {orphan}",
                   f"3 objects deleted from {tmp_path}"]
    left = {i.key for i in store.list()}
    assert {shared, young} <= left and not {first.key, only_first, orphan} & left
    store.close()


def test_gc_refuses_another_jobs_store(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    store = open_store(str(tmp_path))
    orphan = _segment(store, int(time.time() * 1000) - 2 * HOUR_MS, 0)
    coord = CheckpointCoordinator(store, job_id="clicks")
    _checkpoint(coord, [])
    coord.close()
    assert main(["gc", str(tmp_path), "--job", "other", "--min-age", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dstl gc: UsageError: ") and "belongs to job 'clicks'" in err
    assert orphan in {i.key for i in store.list()}
    store.close()


def test_log_only_demo_reads_back_what_it_wrote(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--log-only", "--state-uri", str(tmp_path), "--writers", "3",
                 "--threads", "2", "--seconds", "0.6", "--checkpoint-interval", "0.1"]) == 0
    out = capsys.readouterr().out
    assert f"store {tmp_path}" in out
    assert "read back and compared" in out and out.rstrip().endswith("changes: OK")
    assert any(tmp_path.joinpath("dstl").iterdir())  # segments stay in a store it was given
