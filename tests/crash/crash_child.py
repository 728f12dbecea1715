"""The crash suite's child process: runs the mini job until it is killed (or finishes).

Run by ``tests/crash/test_crash.py``; by hand::

    python tests/crash/crash_child.py --store /tmp/x --work /tmp/w --seed 7 --table lmdb \\
        --checkpoints 20 --pause-at manifest-put:2

Every run first recovers: the coordinator from the store's manifests, each backend through
``restore_backend`` from the newest checkpoint, and the model of that checkpoint from the journal
(``tests/support/job_model.py``). Then per checkpoint: random writes, a checkpoint (intent
journaled first, ACK journaled only after the commit returned), sometimes a materialization.

Named kill points (``--pause-at NAME:N``) pause the N-th time the point is reached, write the
marker file ``<work>/paused`` and wait to be SIGKILLed by the parent. They sit in a
:class:`PausingStore`, a wrapper around the real store passed to ``ChangelogStorage(store=)`` and
the coordinator — the same seam every store goes through — except ``before-ack``, which is the
job's own step between commit and journal:

==================  ==========================================================================
``segment-put``     inside the put of a segment (``dstl/``), before it reaches the store
``segment-landed``  a segment put returned from the store, before DSTL hears of it
``snapshot-put``    inside the put of a materialized snapshot (``snapshots/``)
``manifest-put``    inside the manifest put (``checkpoints/``): the commit in flight
``manifest-landed`` the manifest is stored, the coordinator has not returned
``delete``          inside a delete (retention or segment release), after half of its keys
``before-ack``      the commit returned; the ACK is not yet journaled
==================  ==========================================================================

``--bug ack-before-durable`` journals the ACK before anything is durable, ``--bug drop-write``
applies one write to the model only, and ``--bug async-put`` makes every put return before the
write is stored (a store that acknowledges early): all must be reported by the oracle
(self-tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support.job_model import (
    FULL,
    INCREMENTAL,
    JobConfig,
    Journal,
    JournalView,
    MiniJob,
    journal_path,
)

from dstl.layout import MANIFEST_PREFIX, SEGMENT_PREFIX, SNAPSHOT_PREFIX
from dstl.stores import open_store
from materializer import BackendOptions

POINTS = ("segment-put", "segment-landed", "snapshot-put", "manifest-put", "manifest-landed",
          "delete", "before-ack")
_PREFIX = {"segment": SEGMENT_PREFIX, "snapshot": SNAPSHOT_PREFIX, "manifest": MANIFEST_PREFIX}


class PausingStore:
    """A BlobStore wrapper that pauses forever at the N-th hit of one named point."""

    def __init__(self, inner: Any, point: str | None, nth: int, marker: str, *,
                 async_put: bool = False) -> None:
        self.inner = inner
        self._async_put = async_put
        self.location = inner.location
        self._point = point
        self._nth = nth
        self._marker = marker
        self._hits = 0
        self._lock = threading.Lock()

    def hit(self, point: str) -> None:
        """Count a hit of ``point``; at the N-th, tell the parent and wait to be killed."""
        if point != self._point:
            return
        with self._lock:
            self._hits += 1
            if self._hits != self._nth:
                return
        tmp = f"{self._marker}.tmp"
        with open(tmp, "w") as f:
            f.write(point)
        os.rename(tmp, self._marker)  # the parent never sees a marker without its point
        parent = os.getppid()
        while os.getppid() == parent:  # the parent SIGKILLs us now; never continue past here
            time.sleep(0.2)
        os._exit(3)  # the parent died first (the test run was stopped): do not linger

    def put(self, key: str, data: bytes) -> None:
        if self._async_put:  # the bug under test: return before the write is stored
            threading.Thread(target=self._put, args=(key, data), daemon=True).start()
            return
        self._put(key, data)

    def _put(self, key: str, data: bytes) -> None:
        kind = next((k for k, p in _PREFIX.items() if key.startswith(p)), None)
        if kind is not None:
            self.hit(f"{kind}-put")
        self.inner.put(key, data)
        if kind in ("segment", "manifest"):
            self.hit(f"{kind}-landed")

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if self._point == "delete" and keys:
            half = len(keys) // 2
            self.inner.delete(keys[:half])
            self.hit("delete")
            self.inner.delete(keys[half:])
            return
        self.inner.delete(keys)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)  # type: ignore[no-any-return]

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self.inner.get_range(key, offset, length)  # type: ignore[no-any-return]

    def head(self, key: str) -> Any:
        return self.inner.head(key)

    def list(self, prefix: str = "") -> Iterator[Any]:
        return self.inner.list(prefix)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.inner.close()


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--store", required=True, help="local path or s3:// URI")
    p.add_argument("--storage-options", default="{}", help="JSON (S3 endpoint, credentials)")
    p.add_argument("--work", required=True, help="journal, marker and LMDB directory")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--table", choices=("heap", "lmdb"), default="heap")
    p.add_argument("--incremental", action="store_true",
                   help="incremental materialization (deltas after a full snapshot)")
    p.add_argument("--checkpoints", type=int, default=30)
    p.add_argument("--pause-at", default="", help="NAME:N (see the module docstring)")
    p.add_argument("--mat-interval", type=float, default=0.0,
                   help="materialization timer in seconds (0: explicit materializations only)")
    p.add_argument("--materialize-probability", type=float, default=None,
                   help="per backend and checkpoint (default: JobConfig's)")
    p.add_argument("--bug", choices=("", "ack-before-durable", "drop-write", "async-put"),
                   default="")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    print(f"crash child pid={os.getpid()} seed={a.seed} table={a.table} "
          f"pause-at={a.pause_at or '-'} bug={a.bug or '-'}", flush=True)
    rng = random.Random(a.seed)
    point, _, nth = a.pause_at.partition(":")
    if point and point not in POINTS:
        raise SystemExit(f"unknown kill point {point!r}; one of {POINTS}")
    store = PausingStore(open_store(a.store, json.loads(a.storage_options)), point or None,
                         int(nth or 1), os.path.join(a.work, "paused"),
                         async_put=a.bug == "async-put")
    config = JobConfig(table=a.table, backend_options=BackendOptions(
        materialization_interval_s=a.mat_interval or None, materialize_log_ratio=None,
        **(INCREMENTAL if a.incremental else FULL)))
    if a.materialize_probability is not None:
        config = dataclasses.replace(config, materialize_probability=a.materialize_probability)
    journal = Journal(journal_path(a.work))
    local_dir = os.path.join(a.work, f"lmdb-{os.getpid()}")
    job = MiniJob.open(store, config, intents=JournalView.read(journal.path).intents,
                       local_dir=local_dir, journal=journal)
    with open(os.path.join(a.work, "ready"), "w") as f:
        f.write(str(os.getpid()))
    try:
        for i in range(a.checkpoints):
            job.write(rng)
            if a.bug == "drop-write" and i == 0:
                # a write the job believes it made but the backend never saw (-1 is never
                # written otherwise, so no later write can hide it)
                job.model["op-0"].setdefault("k0", [None, [], {}])[0] = -1
            job.checkpoint(ack_early=a.bug == "ack-before-durable",
                           before_ack=lambda cid: store.hit("before-ack"))
            before = job.deltas
            job.materialize(rng)
            if job.deltas != before:
                print(f"deltas written: {job.deltas}", flush=True)
    finally:
        job.close()
        journal.close()
    print(f"crash child finished {a.checkpoints} checkpoints: {job.completed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
