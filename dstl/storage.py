"""``ChangelogStorage``: the per-process (task manager) owner of the log's moving parts.

One storage per process holds the blob store, the batching upload scheduler (so the change sets
of *all* its writers share one segment per flush window), the segment registry, the timer thread,
the discard thread and the metrics. Writers are created from it, one per keyed backend.
``close()`` sends what is queued, waits (bounded) for running uploads, closes the writers and
stops every thread it started (G8).
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

from dstl.checks import check_callable, check_instance, check_mapping, check_protocol
from dstl.errors import ClosedError, ConfigError, UsageError
from dstl.keygroups import KeyGroupRange
from dstl.metrics import MetricsRegistry
from dstl.options import DstlOptions
from dstl.registry import SegmentRegistry
from dstl.retry import RetryPolicy
from dstl.scheduler import BatchingUploadScheduler, UploadScheduler
from dstl.stores.base import BlobStore, check_store
from dstl.timer import ThreadTimer, Timer, check_timer
from dstl.writer import ChangelogWriter

__all__ = ["ChangelogStorage"]

logger = logging.getLogger(__name__)


class ChangelogStorage:
    """The log of one process: writers, batching, uploads, registry, metrics.

    Args:
        base_uri: storage root: a local path, ``file://``, ``s3://bucket/prefix``,
            ``hdfs://...``, ``memory://...``; with ``filesystem``, a path that filesystem
            understands.
        options: :class:`~dstl.options.DstlOptions` (defaults: Flink's DSTL defaults).
        storage_options: passed to fsspec (e.g. S3 ``key``/``secret``/``client_kwargs``).
        filesystem: an fsspec filesystem instance to use instead of resolving ``base_uri``
            (wrappers that inject faults, count reads or add latency plug in here).
        store: a ready :class:`~dstl.stores.base.BlobStore` (overrides the three above).
        timer: timer for delays and timeouts (tests pass a ``ManualTimer``).
        draw: random numbers in ``[0, 1)`` for the jitter of upload retry backoffs (tests pass
            a fixed one).
        uploader: an upload scheduler to use instead of this process's batching scheduler (the
            executor agent's client); segments are then shared beyond this process, so this
            storage's registry tracks and deletes nothing.

    Raises:
        ConfigError: bad options or an unsupported URI scheme.
        AccessDeniedError: the bucket does not exist or the credentials do not work.
    """

    def __init__(self, base_uri: str | os.PathLike[str] = "", options: DstlOptions | None = None,
                 storage_options: Mapping[str, Any] | None = None, filesystem: Any = None, *,
                 store: BlobStore | None = None, timer: Timer | None = None,
                 uploader: UploadScheduler | None = None,
                 draw: Callable[[], float] = random.random) -> None:
        self.options = _check_arguments(base_uri, options, storage_options, filesystem, store,
                                        timer, uploader)
        check_callable(draw, "draw", "ChangelogStorage", args=0,
                       fix="a function returning a float in [0, 1), like random.random")
        if store is None:
            from dstl.stores import open_store
            store = open_store(base_uri, dict(storage_options or {}), filesystem,
                               retry=RetryPolicy.for_store(self.options))
        self.store = store
        self.storage_id = secrets.token_hex(6)
        self._metrics = MetricsRegistry("ChangelogStorage.")
        self._own_timer = timer is None
        self._timer: Timer = timer if timer is not None else ThreadTimer(self.storage_id)
        self._discard = ThreadPoolExecutor(self.options.discard_threads,
                                           thread_name_prefix="dstl-discard")
        self.registry = SegmentRegistry(store, self._discard, self._metrics)
        self.scheduler: UploadScheduler = (
            uploader if uploader is not None else BatchingUploadScheduler(
                store, self.registry, self.options, self._timer, self._metrics, self.storage_id,
                draw=draw))
        if uploader is not None:
            self.registry.deletes_enabled = False
        self._writers: dict[str, ChangelogWriter] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()
        self._metrics.gauge("writers", lambda: float(len(self._writers)))
        logger.info("changelog storage %s opened at %s", self.storage_id, store.location)

    def create_writer(self, log_id: str, key_groups: KeyGroupRange) -> ChangelogWriter:
        """Create the writer of one backend.

        Args:
            log_id: unique among the live writers of this storage, and stable across restarts of
                the same backend (it names the log in handles and segments).
            key_groups: the backend's key-group range.

        Raises:
            UsageError: ``log_id`` empty, too long, or already in use; bad ``key_groups``.
            ClosedError: the storage is closed.
        """
        self._check_usable()
        if not isinstance(log_id, str) or not log_id or len(log_id.encode("utf-8")) > 1024:
            raise UsageError(f"log_id must be a non-empty string of at most 1024 UTF-8 bytes, "
                             f"got {log_id!r}")
        if not isinstance(key_groups, KeyGroupRange):
            raise UsageError(f"key_groups must be a KeyGroupRange, got {type(key_groups).__name__}")
        with self._lock:
            if log_id in self._writers:
                raise UsageError(f"a writer with log_id {log_id!r} is already open on this "
                                 "storage (close it first, or use a distinct operator id)")
            w = ChangelogWriter(log_id, key_groups, scheduler=self.scheduler,
                                registry=self.registry,
                                preemptive_threshold_bytes=self.options
                                .preemptive_persist_threshold_bytes,
                                metrics=self._metrics, on_close=self._forget,
                                max_change_set_bytes=self.options.max_change_set_bytes)
            self._writers[log_id] = w
        return w

    def _forget(self, writer: ChangelogWriter) -> None:
        with self._lock:
            if self._writers.get(writer.log_id) is writer:
                del self._writers[writer.log_id]

    def available(self) -> bool:
        """False while writers are back-pressured (in-flight bytes at the limit)."""
        return self.scheduler.available()

    def wait_available(self, timeout_s: float | None = None) -> bool:
        """Block until uploads have capacity again (or the timeout); return availability."""
        return self.scheduler.wait_available(timeout_s)

    def metrics(self) -> dict[str, float]:
        """Counters, gauges and histogram summaries, with Flink-like ``ChangelogStorage.*`` names."""
        return self._metrics.snapshot()

    @property
    def metrics_registry(self) -> MetricsRegistry:
        return self._metrics

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedError("changelog storage")
        if os.getpid() != self._pid:
            raise UsageError("this ChangelogStorage was created in another process (before a "
                             "fork); create a new one in this process — threads do not survive "
                             "fork")

    def close(self) -> None:
        """Flush, wait (bounded) for uploads, close writers, stop threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            writers = list(self._writers.values())
        try:
            self.scheduler.close()
        finally:
            for w in writers:
                w.close()
            self._discard.shutdown(wait=True)
            if self._own_timer:
                self._timer.close()
            self.store.close()
        logger.info("changelog storage %s closed", self.storage_id)

    def __enter__(self) -> ChangelogStorage:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _check_arguments(base_uri: object, options: object, storage_options: object,
                     filesystem: object, store: object, timer: object,
                     uploader: object) -> DstlOptions:
    """The constructor's arguments, checked (one place); returns the options to use. The URI
    itself is checked by :func:`~dstl.stores.open_store`.

    Raises:
        ConfigError: a wrong type (ConfigTypeError) or a contradiction.
    """
    owner = "ChangelogStorage"
    if options is not None:
        check_instance(options, "options", owner, DstlOptions,
                       fix="pass dstl.DstlOptions(...) or None for the defaults")
    check_mapping(storage_options, "storage_options", owner)
    if store is not None:
        check_store(store, "store", owner)
        if base_uri or storage_options or filesystem is not None:
            raise ConfigError("store", "<given>", "no base_uri, storage_options or filesystem "
                              "together with store", owner=owner,
                              fix="store= replaces them: pass one way to reach the storage")
    check_timer(timer, "timer", owner)
    if uploader is not None:
        check_protocol(uploader, "uploader", owner,
                       ("upload", "available", "wait_available", "close"),
                       "None or a dstl.scheduler.UploadScheduler")
    return options if isinstance(options, DstlOptions) else DstlOptions()
