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

*Deltas* (``incremental``, the worker's ``BackendOptions.incremental_snapshots``). Every change
set of the executor's writers passes through the agent on its way to the store, so the agent
knows which entries changed without the writers remembering anything: :meth:`note_persisted`
keeps each registered partition's change-set bodies, in the order they became durable, with their
``(segment key, offset)`` (``materializer.pendingBytes`` in the metrics); while the next
materialization is full anyway (none yet, or the bodies since the last one are not all known),
a registration at boundary ``R`` drops the bodies up to ``R``, which no delta will need (a full
cut is at ``R`` or later). A materialization at the marker's boundary ``B`` takes the bodies up to
and including ``B``'s change set, reads the ``(key group, state, key, namespace)`` of their changes
(:func:`~materializer.external.changed_entries`) and writes a delta of those entries' values from
the same read transaction as the marker (:func:`~materializer.external.materialize_table_directory`
with a :class:`~materializer.external.DeltaBase`, which also checks that the table is the same
incarnation and the checkpoint names the chain). Once written, the bodies up to ``B`` are dropped;
bodies after ``B`` (the next batch persisted while the cut was taken) stay for the next delta.

Why this is complete: a task holds its table's write batch from its first write until its
checkpoint's log is durable and the marker committed, so a table's change sets become durable in
the order their write batches commit; every change set an executor's writers log for a table of
this executor passes through this agent (agent mode has no other upload path); and a table that
was instead loaded from a snapshot (restored, or after the partition moved) has a new
``table_id``, so no delta follows the agent's own chain any more. Bodies of a batch that failed before its
commit stay in the list: their entries are written again with their current values, which is
correct. A full snapshot at ``B`` may be followed by deltas only if the bodies after ``B`` are known:
``B``'s change set is in the list, or ``B`` is the boundary the partition was registered with
(the list starts right after it). The list of a partition is bounded by
``_MAX_PENDING_BYTES``; beyond it the bodies are dropped and the next materialization is full.
While a materialization of the partition runs, registrations drop nothing: its cut is not known
until it is read, and the bodies after it are the next delta's (a batch committed during a long
full snapshot would otherwise make the next materialization full too).

*Seeds.* A partition the agent has no chain for (first seen: the executor restarted, the
partition was restored here or moved here; or its chain broke: a registration with another
``table_id``, change sets it did not see) would get a full snapshot, the cost of the whole table
for the change of one batch. Instead a registration offers its committed checkpoint's handle
(``PartitionSpec.checkpoint``): by the checkpoint's own definition the table at that checkpoint is
its snapshot pieces with its log after them replayed, so the entries changed since those pieces
are the entries that log changes. The agent reads that log's change sets back from the store (it
did not see them go by: they were logged by another writer or before it knew the partition), adds
the change sets it keeps since the registration, and writes a delta that follows the checkpoint's
pieces — under the same rules as any delta (the cut's ``table_id`` is the registered one, its
checkpoint names those pieces, the compaction rule). The seed is the newest registration's while
no delta may follow ``latest``, and unused when its checkpoint names no snapshot, a delta first,
pieces of other key groups, or a log larger than ``_MAX_PENDING_BYTES``. Its full snapshot must be
an environment file this partition wrote with exactly its key groups (its metadata, read from the
store, says so): after a rescale a partition keeps its name but restores another layout's
objects, restricted to its key groups, and no delta may follow those. A snapshot or log that
cannot be read back makes that materialization full.

*Compaction* (:mod:`materializer.compaction`). Once ``max_snapshot_deltas`` deltas follow the
full snapshot, the next delta is a merged one: it follows the full snapshot and holds every entry
changed since it, so a restore reads at most ``1 + max_snapshot_deltas`` pieces; the full
snapshot is rewritten only when the deltas after it add up to more than ``max_delta_ratio`` of
its bytes. The pieces a merge replaced stay this chain's (``_Partition.lineage``): checkpoints
taken before the task installs the merged delta still name them, and deltas may follow those
checkpoints.

Why here and not in the table: the alternative — the writers record changed keys in the table
(or in memory, as an in-process backend does) — costs every write a second record in the write
path, and a partition's backend does not stay in one worker process, so an in-memory set would be
lost between tasks. Finding the changed entries costs the agent one pass over the change sets'
bytes per materialization (each change's header read, no value decoded); bench/scale.py's CPU
per steady interval includes it.

*Hand-over.* Before a task checkpoints, it asks for its partition's newest materialization
(:meth:`latest`) and installs it into its backend if its own log contains the snapshot's boundary
(``install_materialization``); the checkpoint then references the snapshot and only the log after
it. Nothing here deletes anything: the driver's coordinator deletes what no retained checkpoint
references (a snapshot no checkpoint ever used is collected as an orphan).

*Memory.* The loop wakes at least every 5 s; each wake returns the heap freed since the last one
to the system (:mod:`materializer.heap`): the change sets of a large batch pass through the
agent on their way to the store, and the agent lives as long as its executor.

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
from dataclasses import dataclass, field
from typing import Any

from dstl.envelope import HEADER_SIZE
from dstl.errors import DstlError
from dstl.handle import ChangelogHandle
from dstl.keygroups import KeyGroupRange
from dstl.stores.base import BlobStore
from materializer.external import (
    ChangedEntries,
    DeltaBase,
    ExternalMaterialization,
    changed_entries,
    materialize_table_directory,
)
from materializer.file_snapshot import read_file_snapshot_layout
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from materializer.heap import release_free_memory
from materializer.policy import MaterializationPolicy, MaterializationRules, Uniform
from materializer.snapshot_format import DEFAULT_MAX_SNAPSHOT_BLOCK_BYTES
from restore.file_restore import is_file_snapshot
from restore.reader import ChangelogReader

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
        incremental, max_snapshot_deltas, max_delta_ratio, max_delta_entries: the worker's
            ``BackendOptions.incremental_snapshots`` and its compaction rule (absent in JSON:
            full snapshots only).
        table_id: the committed marker's ``table_id`` (``""``: not known).
        checkpoint: the committed checkpoint's handle (incremental only; ``None``: not sent): a
            partition without a chain of the agent's own starts one from its snapshot pieces.
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
    incremental: bool = False
    max_snapshot_deltas: int = 8
    max_delta_ratio: float = 0.5
    max_delta_entries: int = 250_000
    table_id: str = ""
    checkpoint: ChangelogStateBackendHandle | None = None

    @classmethod
    def from_json_obj(cls, obj: dict[str, Any]) -> PartitionSpec:
        b = obj.get("boundary")
        cp = obj.get("checkpoint")
        return cls(str(obj["log_id"]), str(obj["env_path"]),
                   KeyGroupRange.from_json_obj(obj["key_groups"]),
                   None if obj.get("interval_s") is None else float(obj["interval_s"]),
                   None if obj.get("log_ratio") is None else float(obj["log_ratio"]),
                   int(obj["min_log_bytes"]), int(obj["zstd_level"]), int(obj["max_failures"]),
                   (str(b[0]), int(b[1])) if b else None, int(obj["log_bytes"]),
                   int(obj["snapshot_bytes"]),
                   int(obj.get("max_block_bytes", DEFAULT_MAX_SNAPSHOT_BLOCK_BYTES)),
                   str(obj.get("snapshot_format", "file")), obj.get("incremental") is True,
                   max(1, int(obj.get("max_snapshot_deltas", 8))),
                   max(0.0, float(obj.get("max_delta_ratio", 0.5))),
                   max(1, int(obj.get("max_delta_entries", 250_000))),
                   str(obj.get("table_id", "")),
                   None if cp is None else ChangelogStateBackendHandle.from_json_obj(
                       cp, key=f"partition {obj['log_id']}: committed checkpoint"))

    def to_json_obj(self) -> dict[str, Any]:
        return {"log_id": self.log_id, "env_path": self.env_path,
                "key_groups": self.key_groups.to_json_obj(), "interval_s": self.interval_s,
                "log_ratio": self.log_ratio, "min_log_bytes": self.min_log_bytes,
                "zstd_level": self.zstd_level, "max_failures": self.max_failures,
                "boundary": list(self.boundary) if self.boundary else None,
                "log_bytes": self.log_bytes, "snapshot_bytes": self.snapshot_bytes,
                "max_block_bytes": self.max_block_bytes,
                "snapshot_format": self.snapshot_format, "incremental": self.incremental,
                "max_snapshot_deltas": self.max_snapshot_deltas,
                "max_delta_ratio": self.max_delta_ratio,
                "max_delta_entries": self.max_delta_entries, "table_id": self.table_id,
                "checkpoint": None if self.checkpoint is None else self.checkpoint.to_json_obj()}

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


#: Change-set bytes kept per partition for its next delta; beyond, they are dropped and the next
#: materialization is full (at 1 % updates of 256-byte values a million keys log ~0.7 MB per
#: interval: far below).
_MAX_PENDING_BYTES = 64 << 20


@dataclass
class _Pending:
    """A partition's change sets since its last materialization's cut (see the module
    docstring): ``(segment key, offset, sqn, body)`` in the order they became durable."""

    sets: list[tuple[str, int, int, bytes]] = field(default_factory=list)
    nbytes: int = 0
    #: the boundary the list starts after (registration), while nothing was dropped before it
    start: tuple[str, int] | None = None

    def index(self, boundary: tuple[str, int]) -> int | None:
        key, offset = boundary
        for i in range(len(self.sets) - 1, -1, -1):
            s = self.sets[i]
            if s[0] == key and s[1] == offset:
                return i
        return None

    def consume(self, boundary: tuple[str, int]) -> bool:
        """Drop the change sets up to ``boundary``'s; whether the rest is exactly what follows
        it (a delta may then follow a snapshot taken at ``boundary``)."""
        i = self.index(boundary)
        if i is None:
            return boundary == self.start
        del self.sets[:i + 1]
        self.nbytes = sum(len(s[3]) for s in self.sets)
        self.start = boundary
        return True


@dataclass(frozen=True, slots=True)
class _Seed:
    """A committed checkpoint that a partition without a chain of the agent's own starts one
    from (see the module docstring): its snapshot pieces, the table's ``table_id`` then, its log
    after them, and that log's boundary."""

    pieces: tuple[SnapshotRef, ...]
    table_id: str
    log: tuple[ChangelogHandle, ...]
    boundary: tuple[str, int]


def _seed(spec: PartitionSpec) -> _Seed | None:
    """The seed a registration offers, if a delta may follow its checkpoint's pieces: a full
    snapshot first, every piece of exactly the partition's key groups, a log after them that is
    not larger than the change sets the agent keeps (whether the full snapshot is the
    partition's own is read from the store when it is used: :func:`_seed_entries`)."""
    cp = spec.checkpoint
    if (not spec.incremental or cp is None or not spec.table_id or spec.boundary is None
            or not cp.materialized or cp.materialized[0].delta
            or any(p.key_groups != spec.key_groups for p in cp.materialized)
            or cp.non_materialized_size > _MAX_PENDING_BYTES):
        return None
    return _Seed(cp.materialized, spec.table_id, cp.non_materialized, spec.boundary)


def _seed_entries(store: BlobStore, seed: _Seed, log_id: str, key_groups: KeyGroupRange,
                  into: set[tuple[int, int, bytes, bytes]]) -> int | None:
    """Add the entries the seed's log changes to ``into``, read from the store (the agent did
    not see those change sets go by: they were logged before it knew the partition); returns the
    sqn after the log's last change set, or ``None`` when no delta may follow the seed (the next
    materialization is then full): its full snapshot is not an environment file this partition
    wrote with exactly its key groups (a restore after a rescale names another partition's
    object, restricted), or the log cannot be read."""
    full = seed.pieces[0]
    reader = ChangelogReader(store)
    after = 0
    found: set[tuple[int, int, bytes, bytes]] = set()
    try:
        head = store.get_range(full.key, 0, HEADER_SIZE)
        if not is_file_snapshot(head):
            return None
        meta = read_file_snapshot_layout(lambda offset, n: store.get_range(full.key, offset, n),
                                         full.size, key=full.key).meta
        if meta.key_groups != key_groups or meta.operator_id != log_id:
            return None
        for h in seed.log:
            for ref, body, _blocks in reader.read_blocks(h):
                changed_entries((body,), found)
                after = ref.sqn + 1
    except DstlError as exc:
        logger.warning("materializer: partition %s: reading its checkpoint's snapshot or log "
                       "for a delta failed (%s); the next materialization is full", log_id, exc)
        return None
    into.update(e for e in found if e[0] in key_groups)
    return after


@dataclass
class _Partition:
    spec: PartitionSpec
    store: BlobStore
    policy: MaterializationPolicy  # its boundary: that of ``latest``
    last_seen: float
    latest: ExternalMaterialization | None = None
    error: str | None = None
    pending: _Pending = field(default_factory=_Pending)
    #: ``latest`` may be followed by a delta (the change sets after it are known)
    chainable: bool = False
    table_id: str = ""  # the table's table_id at latest's cut
    #: pieces of latest's chain that a merge replaced (a checkpoint may still name them)
    lineage: frozenset[tuple[str, int]] = frozenset()
    #: a materialization of it is running: registrations keep the change sets (its cut is not
    #: known yet, and the change sets after it are the next delta's)
    in_flight: bool = False
    #: while ``latest`` may not be followed by a delta: the newest registered checkpoint a
    #: delta may follow instead (``pending`` then starts right after its boundary)
    seed: _Seed | None = None

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
                   "entries": 0, "full": 0, "deltas": 0, "merges": 0}
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
                p.pending.start = spec.boundary
                p.seed = _seed(spec)
                logger.info("materializer: partition %s registered (%s; first due in %.1fs)",
                            spec.log_id, spec.env_path, max(0.0, first - now))
            else:
                p.spec, p.store, p.last_seen = spec, store, now
                p.policy.rules = spec.rules
                if (p.chainable and not p.in_flight and spec.table_id
                        and spec.table_id != p.table_id):
                    # the table was loaded from a snapshot since latest's cut (restored by a
                    # worker): no delta can follow latest any more
                    p.chainable = False
                if not p.chainable and not p.in_flight and spec.boundary is not None:
                    # no delta follows latest: the next materialization cuts at this boundary
                    # or later and is full, or a delta on this checkpoint's pieces; no delta
                    # will ever need the change sets up to it
                    if not p.pending.consume(spec.boundary):
                        p.pending = _Pending(start=spec.boundary)  # none after it seen yet
                    p.seed = _seed(spec)
            self._cond.notify_all()

    def note_persisted(self, store_key: str, sets: list[tuple[str, str, int, int, bytes]]
                       ) -> None:
        """Change sets became durable: ``(log id, segment key, offset, sqn, body)`` each; keep
        those of registered incremental partitions for their next delta."""
        with self._cond:
            for log_id, key, offset, sqn, body in sets:
                p = self._parts.get((store_key, log_id))
                if p is None or not p.spec.incremental:
                    continue
                pend = p.pending
                pend.sets.append((key, offset, sqn, body))
                pend.nbytes += len(body)
                if pend.nbytes > _MAX_PENDING_BYTES:
                    logger.info("materializer: partition %s logged more than %d bytes since its "
                                "last materialization; the next one is full", log_id,
                                _MAX_PENDING_BYTES)
                    p.pending = _Pending()
                    p.chainable = False

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
            out["materializer.pendingBytes"] = float(sum(p.pending.nbytes
                                                         for p in self._parts.values()))
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
                previous = 0 if p.latest is None else p.latest.ref.materialization_id
                base = self._delta_base_locked(p)
                self._m["started"] += 1
                p.in_flight = True
            result, error = _attempt(spec, store, skip, base, previous)
            with self._cond:
                p.in_flight = False
                written += self._record_locked(p, result, error, base)
                self._cond.notify_all()

    def _delta_base_locked(self, p: _Partition) -> DeltaBase | None:
        """What the partition's next materialization may follow with a delta (``None``: it is
        full)."""
        if not p.spec.incremental:
            return None
        if p.latest is None or not p.chainable:
            return self._seed_base_locked(p)
        pending = p.pending

        def changed(boundary: tuple[str, int]) -> ChangedEntries | None:
            with self._cond:
                if p.pending is not pending:  # dropped meanwhile
                    return None
                i = pending.index(boundary)
                if i is None:
                    return None
                sets = pending.sets[:i + 1]
            entries: set[tuple[int, int, bytes, bytes]] = set()
            changed_entries((s[3] for s in sets), entries)
            return ChangedEntries(entries, sets[-1][2] + 1)

        spec = p.spec
        return DeltaBase(p.latest.pieces, p.table_id, changed, spec.max_snapshot_deltas,
                         spec.max_delta_ratio, spec.max_delta_entries, p.lineage)

    def _seed_base_locked(self, p: _Partition) -> DeltaBase | None:
        """A delta base from the partition's seed (``None``: none, the next one is full): the
        entries changed since the seed's pieces are those its checkpoint's log changes (read
        from the store) and those of the change sets the agent kept since."""
        seed, pending, store = p.seed, p.pending, p.store
        log_id, key_groups = p.spec.log_id, p.spec.key_groups
        if seed is None:
            return None

        def changed(boundary: tuple[str, int]) -> ChangedEntries | None:
            with self._cond:
                if p.pending is not pending or p.seed is not seed:  # replaced meanwhile
                    return None
                if boundary == seed.boundary:
                    sets = []
                elif pending.start == seed.boundary and (i := pending.index(boundary)) is not None:
                    sets = pending.sets[:i + 1]
                else:
                    return None
            entries: set[tuple[int, int, bytes, bytes]] = set()
            after = _seed_entries(store, seed, log_id, key_groups, entries)
            if after is None:
                return None
            changed_entries((s[3] for s in sets), entries)
            return ChangedEntries(entries, sets[-1][2] + 1 if sets else after)

        spec = p.spec
        return DeltaBase(seed.pieces, seed.table_id, changed, spec.max_snapshot_deltas,
                         spec.max_delta_ratio, spec.max_delta_entries)

    def _record_locked(self, p: _Partition, result: ExternalMaterialization | None,
                       error: BaseException | None, base: DeltaBase | None = None) -> int:
        """Record an attempt's outcome in the partition's policy; returns 1 if it wrote one
        (``base``: what the attempt's delta would follow)."""
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
        # a delta's chain: the pieces of the base it followed, and what they replaced
        p.lineage = base.known() if result.ref.delta and base is not None else frozenset()
        p.latest, p.error, p.seed = result, None, None
        p.table_id = result.marker.table_id
        p.chainable = p.spec.incremental and p.pending.consume(result.boundary)
        self._m["completed"] += 1
        self._m["deltas" if result.ref.delta else "full"] += 1
        self._m["merges"] += int(result.merged)
        self._m["bytes"] += result.ref.size
        self._m["entries"] += result.entries
        self._last_duration_ms = result.duration_s * 1e3
        return 1

    def _loop(self) -> None:
        while True:
            # the segments and snapshot objects that passed through since the last wake are
            # free: back to the system, or the agent keeps its busiest moment's memory
            release_free_memory()
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


def _attempt(spec: PartitionSpec, store: BlobStore, skip: tuple[str, int] | None,
             base: DeltaBase | None = None, previous_id: int = 0
             ) -> tuple[ExternalMaterialization | None, BaseException | None]:
    """One materialization of a partition's table: ``(result or None, error or None)``; a
    table that is not there (being restored right now) gives neither."""
    try:
        if os.path.isdir(spec.env_path):
            return materialize_table_directory(spec.env_path, spec.key_groups, store,
                                               zstd_level=spec.zstd_level,
                                               skip_boundary=skip,
                                               max_block_bytes=spec.max_block_bytes,
                                               snapshot_format=spec.snapshot_format,
                                               delta_base=base,
                                               previous_id=previous_id), None
    except DstlError as exc:
        return None, exc
    except OSError as exc:  # local file system trouble: count it, keep the agent up
        return None, exc
    return None, None
