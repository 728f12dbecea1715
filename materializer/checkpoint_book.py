"""``CheckpointBook``: a keyed backend's checkpoints — their handles, their notifications, and
the truncation of the log they allow.

Theory of operation
-------------------
- **Checkpoint** (:meth:`CheckpointBook.snapshot`): ``from`` = the sqn up to which the table is
  materialized (the manager's base), ``persist(from, cp)``; the handle = the base's snapshot
  objects + its restored log + the change sets after it. Only the last flush window is waited
  for. The checkpoint is *in flight* from the moment it reads its base until it completes or
  aborts: its range of the log stays.
- **Boundary.** The newest durable checkpoint's last change set and the sqn its log ends at
  (:meth:`CheckpointBook.boundary_at`): a snapshot cut exactly there reflects exactly that
  checkpoint. The log after every checkpoint describes its states again (the registry's logged
  metadata records are cleared), so it can be replayed from that boundary.
- **Truncation** (:meth:`CheckpointBook.maybe_truncate`): ``writer.truncate(min(materialized
  up_to, subsumed checkpoint's up_to, in-flight checkpoints' from))`` — Flink's rule, bounded
  also by the checkpoints in flight. It runs when a checkpoint is subsumed and when a new base is
  in place.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from dstl.handle import ChangelogHandle
from dstl.keygroups import KeyGroupRange
from dstl.metrics import MetricsRegistry
from dstl.writer import ChangelogWriter
from materializer.handles import ChangelogStateBackendHandle
from materializer.manager import MaterializedBase
from materializer.state_registry import StateRegistry
from materializer.table_marker import boundary_of

__all__ = ["CheckpointBook"]


@dataclass
class _Checkpoint:
    checkpoint_id: int
    from_sqn: int
    to_sqn: int
    materialization_id: int


class CheckpointBook:
    """The checkpoints of one backend (see the module docstring).

    Args:
        operator_id, key_groups, max_parallelism: the backend's.
        writer: the backend's changelog writer.
        registry: the backend's states (their metadata records are logged again after each
            checkpoint).
        metrics: the backend's registry (Flink's sizes of the non-materialized part go there).
    """

    def __init__(self, operator_id: str, key_groups: KeyGroupRange, max_parallelism: int,
                 writer: ChangelogWriter, registry: StateRegistry,
                 metrics: MetricsRegistry) -> None:
        self._operator_id = operator_id
        self._key_groups = key_groups
        self._max_parallelism = max_parallelism
        self._writer = writer
        self._registry = registry
        self._base: Callable[[], MaterializedBase] = MaterializedBase
        self._confirm: Callable[[int], None] = lambda _id: None
        self._lock = threading.Lock()  # checkpoint bookkeeping shared with the materializer
        self._last: _Checkpoint | None = None
        self._up_to: dict[int, tuple[int, int]] = {}  # cp -> (to_sqn, mat id)
        self._pending_from: dict[int, int] = {}  # in-flight checkpoint -> its from_sqn
        self._subsumed_up_to: int | None = None
        #: the log part of the newest checkpoint that this backend's writer produced
        self.last_delta: ChangelogHandle | None = None
        #: (to_sqn, boundary) of the newest durable checkpoint (see boundary_at)
        self._boundary: tuple[int, tuple[str, int] | None] | None = None
        self._non_mat_sizes = {"lastFullSizeOfNonMaterialization": 0.0,
                               "lastIncSizeOfNonMaterialization": 0.0}
        for name in self._non_mat_sizes:
            metrics.gauge(name, lambda n=name: self._non_mat_sizes[n])  # type: ignore[misc]

    def attach(self, base: Callable[[], MaterializedBase],
               confirm: Callable[[int], None]) -> None:
        """Connect the materialization manager (built after this book): its current base, and
        the confirmation of a materialization by a completed checkpoint."""
        self._base = base
        self._confirm = confirm

    def in_flight(self) -> list[int]:
        """The checkpoints taken and neither completed nor aborted yet."""
        with self._lock:
            return sorted(self._pending_from)

    def ids(self) -> list[int]:
        """Checkpoints taken that are not yet subsumed."""
        return sorted(self._up_to)

    def snapshot(self, checkpoint_id: int) -> Future[ChangelogStateBackendHandle]:
        """Persist the log since the base; the future gives the backend's handle once that log
        is durable."""
        # In flight from the moment it reads its base: a materialization ending while persist()
        # waits (back-pressure) must not truncate [from_sqn, ..). maybe_truncate reads the base
        # and the registrations under the same lock, so it sees this one or a base at least as
        # new as the one read here.
        with self._lock:
            base = self._base()
            from_sqn, mat_id = base.up_to, base.materialization_id
            self._pending_from[checkpoint_id] = from_sqn
        try:
            persist = self._writer.persist(from_sqn, checkpoint_id)
        except BaseException:
            with self._lock:
                self._pending_from.pop(checkpoint_id, None)
            raise
        to_sqn = self._writer.next_sqn()
        # the log after this checkpoint describes its states again, so a snapshot taken at this
        # checkpoint's boundary (install_materialization) leaves a self-describing log to replay
        self._registry.forget_logged()
        self._last = _Checkpoint(checkpoint_id, from_sqn, to_sqn, mat_id)
        self._up_to[checkpoint_id] = (to_sqn, mat_id)
        out: Future[ChangelogStateBackendHandle] = Future()
        out.set_running_or_notify_cancel()

        def done(f: Future[ChangelogHandle]) -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            delta = f.result()
            self.last_delta = delta
            non_mat = base.restored_log + ((delta,) if len(delta) else ())
            self._boundary = (to_sqn, boundary_of(non_mat))
            h = ChangelogStateBackendHandle(self._operator_id, self._key_groups, checkpoint_id,
                                            mat_id, base.snapshots, non_mat,
                                            delta.incremental_size, self._max_parallelism)
            self._non_mat_sizes["lastFullSizeOfNonMaterialization"] = float(
                h.non_materialized_size)
            self._non_mat_sizes["lastIncSizeOfNonMaterialization"] = float(
                delta.incremental_size)
            out.set_result(h)

        persist.add_done_callback(done)
        return out

    def boundary_at(self, up_to: int) -> tuple[str, int] | None:
        """The last change set of the newest durable checkpoint if its log ends exactly at
        ``up_to`` (a snapshot cut there reflects exactly that checkpoint), else ``None``."""
        cb = self._boundary
        return cb[1] if cb is not None and cb[0] == up_to else None

    def complete(self, checkpoint_id: int) -> None:
        """The checkpoint completed: hand its log over, unblock the next materialization."""
        cp = self._last
        entry = self._up_to.get(checkpoint_id)
        with self._lock:
            for c in [c for c in self._pending_from if c <= checkpoint_id]:
                del self._pending_from[c]
        if entry is not None:
            self._confirm(entry[1])
        if cp is not None and cp.checkpoint_id == checkpoint_id:
            self._writer.confirm(cp.from_sqn, cp.to_sqn, checkpoint_id)

    def abort(self, checkpoint_id: int) -> None:
        """The checkpoint was aborted: keep uploads for reuse, drop its pins."""
        cp = self._last
        with self._lock:
            self._pending_from.pop(checkpoint_id, None)
        if cp is not None and cp.checkpoint_id == checkpoint_id:
            self._writer.reset(cp.from_sqn, cp.to_sqn, checkpoint_id)

    def subsume(self, checkpoint_id: int) -> None:
        """The checkpoint is no longer retained: its log may be truncated once materialized."""
        entry = self._up_to.get(checkpoint_id)
        if entry is None:
            return
        for cp in [c for c in self._up_to if c <= checkpoint_id]:
            del self._up_to[cp]
        self._subsumed_up_to = max(self._subsumed_up_to or 0, entry[0])
        self.maybe_truncate()

    def maybe_truncate(self) -> None:
        with self._lock:
            base = self._base()  # under the lock: see snapshot()
            if self._subsumed_up_to is None or base.materialization_id == 0:
                return
            # Flink's rule, bounded also by checkpoints still in flight: their range must stay
            # until they complete or abort.
            to = min(base.up_to, self._subsumed_up_to,
                     min(self._pending_from.values(), default=base.up_to))
        if to > self._writer.lowest_sqn():
            self._writer.truncate(to)

    def close_log(self) -> None:
        """Release the log after the last checkpoint and close the writer."""
        cp = self._last
        self._writer.truncate_and_close(cp.to_sqn if cp is not None else 0)
