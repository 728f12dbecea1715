"""A checkpoint is in flight from the moment it reads its ``from`` sqn.

``snapshot()`` reads the materialized base's ``up_to`` and then calls ``persist()``, which may
wait for upload capacity (back-pressure). A materialization that finishes during that wait must
not truncate the range the checkpoint is about to name. Deterministic: the upload scheduler and
the snapshot upload are held back by gates (no sleeps), so the materialization ends exactly while
``snapshot()`` waits inside ``persist()``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from support.fakes import DelegatingStore

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import ClosedError
from dstl.scheduler import UploadScheduler, UploadTask
from materializer.backend import ChangelogKeyedStateBackend
from materializer.options import BackendOptions
from materializer.states import ListStateDescriptor
from restore.restore import restore_backend

MP = 16
ALL = KeyGroupRange(0, MP - 1)
WAIT = 10.0
OPTS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)


class HeldScheduler:
    """An :class:`~dstl.scheduler.UploadScheduler` that, once armed, holds the next upload
    (as back-pressure would) until released."""

    def __init__(self, inner: UploadScheduler) -> None:
        self.inner = inner
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def upload(self, task: UploadTask) -> None:
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.release.wait(WAIT), "the test never released the upload"
        self.inner.upload(task)

    def available(self) -> bool:
        return self.inner.available()

    def wait_available(self, timeout_s: float | None = None) -> bool:
        return self.inner.wait_available(timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        self.release.set()
        self.inner.close(timeout_s)


class HeldSnapshotStore(DelegatingStore):
    """Holds the upload of a snapshot object until released."""

    def __init__(self) -> None:
        super().__init__("memory://held")
        self.entered = threading.Event()
        self.release = threading.Event()

    def put(self, key: str, data: bytes) -> None:
        if "/snapshots/" in f"/{key}" or key.endswith(".snap"):
            self.entered.set()
            assert self.release.wait(WAIT), "the test never released the snapshot upload"
        super().put(key, data)


def _append(b: ChangelogKeyedStateBackend, model: dict[str, list[int]], n: int) -> None:
    lst: Any = b.get_state(ListStateDescriptor("l"))
    for i in range(n):
        k = f"k{i % 5}"
        b.set_current_key(k)
        lst.add(i)
        model.setdefault(k, []).append(i)


def test_materialization_finishing_inside_persist_never_truncates_the_checkpoint() -> None:
    store = HeldSnapshotStore()
    storage = ChangelogStorage(store=store, options=DstlOptions(persist_delay_s=0.0))
    held = HeldScheduler(storage.scheduler)
    storage.scheduler = held  # writers created from now on upload through it
    model: dict[str, list[int]] = {}
    b = ChangelogKeyedStateBackend(storage, "op", ALL, MP, options=OPTS)
    try:
        _append(b, model, 10)
        b.snapshot(1).result(WAIT)
        b.notify_checkpoint_complete(1)
        b.notify_checkpoint_subsumed(1)  # its log may go once materialized
        _append(b, model, 10)
        # a materialization starts; its snapshot upload is held back
        running = b.materialization.start()
        assert running is not None
        assert store.entered.wait(WAIT)
        assert b.materialization.base.up_to == 0  # checkpoint 2 will read from_sqn 0
        _append(b, model, 10)
        held.armed = True
        outcome: list[BaseException | None] = []

        def finish_materialization_inside_persist() -> None:
            try:
                assert held.entered.wait(WAIT)      # snapshot(2) waits inside persist()
                store.release.set()                 # the materialization ends now ...
                running.result(WAIT)                # ... and truncates what it may
                outcome.append(None)
            except BaseException as exc:  # reported to the test thread below
                outcome.append(exc)
            finally:
                held.release.set()

        t = threading.Thread(target=finish_materialization_inside_persist)
        t.start()
        f2 = b.snapshot(2)
        t.join(WAIT)
        assert outcome == [None]
        h2 = f2.result(WAIT)  # not "range [0, n) was truncated"
        assert b.materialization.base.materialization_id == 1
        b.notify_checkpoint_complete(2)
        b.close()
        r = restore_backend([h2], storage, ALL, options=OPTS)
        lst: Any = r.get_state(ListStateDescriptor("l"))
        for k, items in model.items():
            r.set_current_key(k)
            assert lst.get() == items
        r.close()
    finally:
        store.release.set()
        held.release.set()
        b.close()
        storage.close()


def test_a_failed_persist_does_not_block_truncation_for_ever() -> None:
    """The registration made before ``persist()`` is dropped when persist raises."""
    storage = ChangelogStorage(store=DelegatingStore(), options=DstlOptions(persist_delay_s=0.0))
    model: dict[str, list[int]] = {}
    b = ChangelogKeyedStateBackend(storage, "op", ALL, MP, options=OPTS)
    try:
        _append(b, model, 5)
        b.snapshot(1).result(WAIT)
        b.notify_checkpoint_complete(1)
        _append(b, model, 5)
        assert b.materialize_now(WAIT) is not None
        b.writer.close()  # persist raises ClosedError from now on
        with pytest.raises(ClosedError):
            b.snapshot(2)
        assert 2 not in b.checkpoints.in_flight()
    finally:
        b.close()
        storage.close()
