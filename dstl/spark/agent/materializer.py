"""The executor agent's materializer: periodic snapshots of the executor's LMDB partitions, taken
in the agent process while workers keep writing.

Theory of operation
-------------------
*Registration.* After each task commits its partition's table (state + table marker in one LMDB
transaction, see :mod:`materializer.table_marker`), the worker registers the partition with the
agent: where its table lives, its store, its options, and the new marker's boundary and sizes.
Partitions not registered again within ``stale_after_s`` (they moved to another executor) are
dropped.

*Schedule.* One :class:`~materializer.policy.MaterializationPolicy` per partition decides, with
the rules every materializing runtime uses: the first materialization is due a random delay in
``[0, interval)`` after the partition is first seen, then ``interval`` after each attempt (one
that found its table missing or unchanged included); it is due at once when the log since the
checkpoint's snapshot outgrows ``log_ratio`` times that snapshot (here stored bytes on both
sides — the marker's sizes — at least ``min_log_bytes``). A partition whose boundary has not
moved since its last materialization is not attempted, and stays due until it moves.

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
import math
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dstl.errors import DstlError
from dstl.keygroups import KeyGroupRange
from dstl.stores.base import BlobStore
from materializer.external import ExternalMaterialization, materialize_table_directory
from materializer.policy import MaterializationPolicy, MaterializationRules, Uniform
from materializer.snapshot_format import DEFAULT_MAX_SNAPSHOT_BLOCK_BYTES

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
        max_block_bytes: the limit on a snapshot block (the worker's
            ``BackendOptions.max_snapshot_block_bytes``; absent in JSON: the default).
        snapshot_format: the worker's ``BackendOptions.lmdb_snapshot_format`` (``"file"``:
            format v2, the environment file; ``"entries"``: v1; absent in JSON: ``"file"``).
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
    max_block_bytes: int = DEFAULT_MAX_SNAPSHOT_BLOCK_BYTES
    snapshot_format: str = "file"

    @classmethod
    def from_json_obj(cls, obj: dict[str, Any]) -> PartitionSpec:
        b = obj.get("boundary")
        return cls(str(obj["log_id"]), str(obj["env_path"]),
                   KeyGroupRange.from_json_obj(obj["key_groups"]),
                   None if obj.get("interval_s") is None else float(obj["interval_s"]),
                   None if obj.get("log_ratio") is None else float(obj["log_ratio"]),
                   int(obj["min_log_bytes"]), int(obj["zstd_level"]), int(obj["max_failures"]),
                   (str(b[0]), int(b[1])) if b else None, int(obj["log_bytes"]),
                   int(obj["snapshot_bytes"]),
                   int(obj.get("max_block_bytes", DEFAULT_MAX_SNAPSHOT_BLOCK_BYTES)),
                   str(obj.get("snapshot_format", "file")))

    def to_json_obj(self) -> dict[str, Any]:
        return {"log_id": self.log_id, "env_path": self.env_path,
                "key_groups": self.key_groups.to_json_obj(), "interval_s": self.interval_s,
                "log_ratio": self.log_ratio, "min_log_bytes": self.min_log_bytes,
                "zstd_level": self.zstd_level, "max_failures": self.max_failures,
                "boundary": list(self.boundary) if self.boundary else None,
                "log_bytes": self.log_bytes, "snapshot_bytes": self.snapshot_bytes,
                "max_block_bytes": self.max_block_bytes,
                "snapshot_format": self.snapshot_format}

    @property
    def rules(self) -> MaterializationRules:
        """The partition's materialization rules (the worker's ``BackendOptions``)."""
        return MaterializationRules(self.interval_s, self.log_ratio, self.min_log_bytes,
                                    self.max_failures)


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
    policy: MaterializationPolicy  # its boundary: that of ``latest``
    last_seen: float
    latest: ExternalMaterialization | None = None
    error: str | None = None

    def due_at(self) -> float:
        """When it is due (``inf``: never: nothing new since ``latest``, or failed for good)."""
        if not self.policy.has_new(self.spec.boundary):
            return math.inf
        return self.policy.due_at(self.spec.log_bytes, self.spec.snapshot_bytes)


class AgentMaterializer:
    """Materializes the registered partitions of one executor (see the module docstring).

    Args:
        clock: monotonic seconds (tests pass their own).
        start: start the background thread (tests drive :meth:`run_due` themselves).
        uniform: random source of the partitions' first delays.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, start: bool = True,
                 uniform: Uniform = random.uniform) -> None:
        self._clock = clock
        self._uniform = uniform
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
                policy = MaterializationPolicy(spec.rules, uniform=self._uniform)
                first = policy.start(now)
                p = self._parts[ident] = _Partition(spec, store, policy, now)
                logger.info("materializer: partition %s registered (%s; first due in %.1fs)",
                            spec.log_id, spec.env_path, max(0.0, first - now))
            else:
                p.spec, p.store, p.last_seen = spec, store, now
                p.policy.rules = spec.rules
            self._cond.notify_all()

    def latest(self, store_key: str, log_id: str) -> LatestMaterialization:
        """The newest materialization of a partition, for the task to install, and the last
        failure once ``max_failures`` consecutive materializations of the partition failed."""
        with self._cond:
            p = self._parts.get((store_key, log_id))
            if p is None:
                return LatestMaterialization(None, None)
            failed = p.error if p.policy.has_failed else None
            return LatestMaterialization(p.latest, failed)

    def request(self, store_key: str, log_id: str) -> None:
        """Make a registered partition due now (the timer's ``run_once`` for one partition)."""
        with self._cond:
            p = self._parts.get((store_key, log_id))
            if p is not None:
                p.policy.request(self._clock())
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

    def _next_due_locked(self, now: float) -> _Partition | None:
        stale = [k for k, p in self._parts.items() if now - p.last_seen > max(
            _MIN_STALE_S, _STALE_INTERVALS * (p.spec.interval_s or 0.0))]
        for k in stale:
            logger.info("materializer: partition %s not seen for a while; dropped", k[1])
            del self._parts[k]
        return min((p for p in self._parts.values() if p.due_at() <= now),
                   key=_Partition.due_at, default=None)

    def run_due(self) -> int:
        """Materialize every partition that is due now, one at a time; returns how many were
        written."""
        written = 0
        while True:
            with self._cond:
                p = self._next_due_locked(self._clock())
                if p is None or self._stop:
                    return written
                spec, store = p.spec, p.store
                skip = None if p.latest is None else p.latest.boundary
                self._m["started"] += 1
            result, error = _attempt(spec, store, skip)
            with self._cond:
                written += self._record_locked(p, result, error)
                self._cond.notify_all()

    def _record_locked(self, p: _Partition, result: ExternalMaterialization | None,
                       error: BaseException | None) -> int:
        """Record an attempt's outcome in the partition's policy; returns 1 if it wrote one."""
        now = self._clock()
        if error is not None:
            p.policy.record_failure(now)
            p.error = f"{type(error).__name__}: {error}"
            self._m["failed"] += 1
            logger.warning("materializer: partition %s failed (%d in a row): %s",
                           p.spec.log_id, p.policy.consecutive_failures, p.error)
            return 0
        if result is None:
            p.policy.record_empty(now)
            self._m["skipped"] += 1
            return 0
        p.policy.record_success(now, result.boundary, result.ref.size)
        p.latest, p.error = result, None
        self._m["completed"] += 1
        self._m["bytes"] += result.ref.size
        self._m["entries"] += result.entries
        self._last_duration_ms = result.duration_s * 1e3
        return 1

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._stop:
                    return
                now = self._clock()
                due = min((p.due_at() for p in self._parts.values()), default=math.inf)
                wait = min(due, now + 5.0) - now
                if wait > 0:
                    self._cond.wait(min(wait, 5.0))
                    continue
            self.run_due()


def _attempt(spec: PartitionSpec, store: BlobStore, skip: tuple[str, int] | None
             ) -> tuple[ExternalMaterialization | None, BaseException | None]:
    """One materialization of a partition's table: ``(result or None, error or None)``; a
    table that is not there (being restored right now) gives neither."""
    try:
        if os.path.isdir(spec.env_path):
            return materialize_table_directory(spec.env_path, spec.key_groups, store,
                                               zstd_level=spec.zstd_level,
                                               skip_boundary=skip,
                                               max_block_bytes=spec.max_block_bytes,
                                               snapshot_format=spec.snapshot_format), None
    except DstlError as exc:
        return None, exc
    except OSError as exc:  # local file system trouble: count it, keep the agent up
        return None, exc
    return None, None
