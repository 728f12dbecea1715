"""The executor agent's materializer: periodic snapshots of the executor's LMDB partitions, taken
in the agent process while workers keep writing.

Theory of operation
-------------------
*Registration.* After each task commits its partition's table (state + table marker in one LMDB
transaction, see :mod:`materializer.table_marker`), the worker registers the partition with the
agent: where its table lives, its store, its options, and the new marker's boundary and sizes.
Partitions not registered again within ``stale_after_s`` (they moved to another executor) are
dropped.

*Schedule* (per partition, Flink's, plus DSTL's size trigger): the first materialization is due
a random delay in ``[0, interval)`` after the partition is first seen, then a fixed delay after
each run; it is due at once when the log since the snapshot outgrows ``log_ratio`` times the
snapshot (stored bytes on both sides, at least ``min_log_bytes``). A partition whose boundary has
not moved since its last materialization is skipped (nothing new).

*Run.* One thread (``dstl-agent-materializer``) materializes due partitions one at a time with
:func:`~materializer.external.materialize_table_directory` — a read-only LMDB open and one read
transaction, so the worker writing that table never waits — and keeps the newest result per
partition. :meth:`run_due` is the loop's body, callable on its own.

*Hand-over.* Before a task checkpoints, it asks for its partition's newest materialization
(:meth:`latest`) and installs it into its backend if its own log contains the snapshot's boundary
(``install_materialization``); the checkpoint then references the snapshot and only the log after
it. Nothing here deletes anything: the driver's coordinator deletes what no retained checkpoint
references (a snapshot no checkpoint ever used is collected as an orphan).

*Failures.* A failed materialization is retried at the next due time; after ``max_failures``
consecutive failures of a partition, :meth:`latest` reports the failure and the task fails with
:class:`~dstl.errors.BackendFailedError` (Flink's rule: too many failed materializations fail the
backend). A table that is not there (a worker is restoring it right now) is not a failure.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dstl.errors import DstlError
from dstl.keygroups import KeyGroupRange
from dstl.stores.base import BlobStore
from materializer.external import ExternalMaterialization, materialize_table_directory

__all__ = ["AgentMaterializer", "LatestMaterialization", "PartitionSpec"]

logger = logging.getLogger(__name__)

#: A partition the agent has not heard of for this long (and at least a minute) moved away.
_STALE_INTERVALS = 3.0
_MIN_STALE_S = 60.0


@dataclass(frozen=True, slots=True)
class PartitionSpec:
    """What a worker registers after committing a partition's table.

    Attributes:
        log_id: the partition's backend (operator id).
        env_path: its LMDB environment directory (executor-local).
        key_groups: its key-group range.
        interval_s: materialization interval (``None``: time trigger off).
        log_ratio: size trigger ratio (``None``: off); ``min_log_bytes`` its floor.
        zstd_level: snapshot compression level.
        max_failures: consecutive failures tolerated.
        boundary: the committed marker's boundary (``None``: no log since the snapshot).
        log_bytes, snapshot_bytes: stored sizes of the committed checkpoint's log and snapshot.
    """

    log_id: str
    env_path: str
    key_groups: KeyGroupRange
    interval_s: float | None
    log_ratio: float | None
    min_log_bytes: int
    zstd_level: int
    max_failures: int
    boundary: tuple[str, int] | None
    log_bytes: int
    snapshot_bytes: int

    @classmethod
    def from_json_obj(cls, obj: dict[str, Any]) -> PartitionSpec:
        b = obj.get("boundary")
        return cls(str(obj["log_id"]), str(obj["env_path"]),
                   KeyGroupRange.from_json_obj(obj["key_groups"]),
                   None if obj.get("interval_s") is None else float(obj["interval_s"]),
                   None if obj.get("log_ratio") is None else float(obj["log_ratio"]),
                   int(obj["min_log_bytes"]), int(obj["zstd_level"]), int(obj["max_failures"]),
                   (str(b[0]), int(b[1])) if b else None, int(obj["log_bytes"]),
                   int(obj["snapshot_bytes"]))

    def to_json_obj(self) -> dict[str, Any]:
        return {"log_id": self.log_id, "env_path": self.env_path,
                "key_groups": self.key_groups.to_json_obj(), "interval_s": self.interval_s,
                "log_ratio": self.log_ratio, "min_log_bytes": self.min_log_bytes,
                "zstd_level": self.zstd_level, "max_failures": self.max_failures,
                "boundary": list(self.boundary) if self.boundary else None,
                "log_bytes": self.log_bytes, "snapshot_bytes": self.snapshot_bytes}

    def size_triggered(self) -> bool:
        return self.log_ratio is not None and self.log_bytes > max(
            self.min_log_bytes, self.log_ratio * self.snapshot_bytes)


@dataclass(frozen=True, slots=True)
class LatestMaterialization:
    """What :meth:`AgentMaterializer.latest` reports of a partition.

    Attributes:
        materialization: its newest snapshot (``None``: none yet).
        failed: the last error, once more than ``max_failures`` materializations of the
            partition failed in a row; else ``None``.
    """

    materialization: ExternalMaterialization | None
    failed: str | None


@dataclass
class _Partition:
    spec: PartitionSpec
    store: BlobStore
    next_due: float
    last_seen: float
    done_boundary: tuple[str, int] | None = None
    latest: ExternalMaterialization | None = None
    failures: int = 0
    error: str | None = None
    counts: dict[str, int] = field(default_factory=dict)


class AgentMaterializer:
    """Materializes the registered partitions of one executor (see the module docstring).

    Args:
        clock: monotonic seconds (tests pass their own).
        start: start the background thread (tests drive :meth:`run_due` themselves).
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, start: bool = True) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._parts: dict[tuple[str, str], _Partition] = {}
        self._stop = False
        self._m = {"started": 0, "completed": 0, "skipped": 0, "failed": 0, "bytes": 0,
                   "entries": 0}
        self._last_duration_ms = -1.0
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="dstl-agent-materializer",
                                            daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ worker-facing

    def register(self, store_key: str, store: BlobStore, spec: PartitionSpec) -> None:
        """A task committed ``spec.log_id``'s table: remember it and (re)schedule."""
        now = self._clock()
        with self._cond:
            ident = (store_key, spec.log_id)
            p = self._parts.get(ident)
            if p is None or p.spec.env_path != spec.env_path:
                interval = spec.interval_s
                first = now + random.uniform(0, interval) if interval is not None else float("inf")
                p = self._parts[ident] = _Partition(spec, store, first, now)
                logger.info("materializer: partition %s registered (%s; first due in %.1fs)",
                            spec.log_id, spec.env_path, max(0.0, first - now))
            else:
                p.spec, p.store, p.last_seen = spec, store, now
            if spec.size_triggered() and spec.boundary != p.done_boundary:
                p.next_due = now
            self._cond.notify_all()

    def latest(self, store_key: str, log_id: str) -> LatestMaterialization:
        """The newest materialization of a partition, for the task to install, and the last
        failure once ``max_failures`` consecutive materializations of the partition failed."""
        with self._cond:
            p = self._parts.get((store_key, log_id))
            if p is None:
                return LatestMaterialization(None, None)
            failed = p.error if p.failures > p.spec.max_failures else None
            return LatestMaterialization(p.latest, failed)

    def request(self, store_key: str, log_id: str) -> None:
        """Make a registered partition due now (the timer's ``run_once`` for one partition)."""
        with self._cond:
            p = self._parts.get((store_key, log_id))
            if p is not None:
                p.next_due = self._clock()
                self._cond.notify_all()

    def metrics(self) -> dict[str, float]:
        with self._cond:
            out = {f"materializer.{k}": float(v) for k, v in self._m.items()}
            out["materializer.partitions"] = float(len(self._parts))
            out["materializer.lastDurationMs"] = self._last_duration_ms
            return out

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the loop

    def _due_locked(self, now: float) -> list[_Partition]:
        stale = [k for k, p in self._parts.items() if now - p.last_seen > max(
            _MIN_STALE_S, _STALE_INTERVALS * (p.spec.interval_s or 0.0))]
        for k in stale:
            logger.info("materializer: partition %s not seen for a while; dropped", k[1])
            del self._parts[k]
        return sorted((p for p in self._parts.values() if p.next_due <= now and _eligible(p)),
                      key=lambda p: p.next_due)

    def run_due(self) -> int:
        """Materialize every partition that is due now, one at a time; returns how many were
        written."""
        written = 0
        while True:
            with self._cond:
                due = self._due_locked(self._clock())
                if not due or self._stop:
                    return written
                p = due[0]
                spec, store, skip = p.spec, p.store, p.done_boundary
                self._m["started"] += 1
            result: ExternalMaterialization | None = None
            error: BaseException | None = None
            try:
                if os.path.isdir(spec.env_path):
                    result = materialize_table_directory(spec.env_path, spec.key_groups, store,
                                                         zstd_level=spec.zstd_level,
                                                         skip_boundary=skip)
            except DstlError as exc:
                error = exc
            except OSError as exc:  # local file system trouble: count it, keep the agent up
                error = exc
            with self._cond:
                now = self._clock()
                p.next_due = now + (spec.interval_s if spec.interval_s is not None
                                    else float("inf"))
                if error is not None:
                    p.failures += 1
                    p.error = f"{type(error).__name__}: {error}"
                    self._m["failed"] += 1
                    logger.warning("materializer: partition %s failed (%d in a row): %s",
                                   spec.log_id, p.failures, p.error)
                elif result is None:
                    self._m["skipped"] += 1
                else:
                    p.latest, p.done_boundary = result, result.boundary
                    p.failures, p.error = 0, None
                    self._m["completed"] += 1
                    self._m["bytes"] += result.ref.size
                    self._m["entries"] += result.entries
                    self._last_duration_ms = result.duration_s * 1e3
                    written += 1
                self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._stop:
                    return
                now = self._clock()
                pending = [p.next_due for p in self._parts.values() if _eligible(p)]
                wait = min(pending, default=now + 5.0) - now
                if wait > 0:
                    self._cond.wait(min(wait, 5.0))
                    continue
            self.run_due()


def _eligible(p: _Partition) -> bool:
    """Something new to materialize, and not failed for good."""
    return (p.spec.boundary is not None and p.spec.boundary != p.done_boundary
            and p.failures <= p.spec.max_failures)
