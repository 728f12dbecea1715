"""``BaseInstaller``: what a keyed backend's next checkpoints build on when it did not
materialize that itself — restored parts, and snapshots made elsewhere — and the table marker
that lets another process make them.

Theory of operation
-------------------
- **Restored.** The restored snapshot pieces and log stay the base of the next checkpoints
  (until the first materialization), as in Flink — restricted to the key groups this backend
  owns, so its handles never claim another backend's share of an older log or snapshot.
- **Materialized elsewhere.** An on-disk (LMDB) table can be materialized by another process
  (the executor agent) from a read transaction. Each checkpoint writes a
  :class:`~materializer.table_marker.TableMarker` into the table in the same transaction as its
  state; the snapshot carries the marker's *boundary* (the last change set the table reflects),
  and :meth:`BaseInstaller.install_materialization` makes such a snapshot the base when the
  backend's log contains that boundary. Because metadata records are logged again after every
  checkpoint, the log after any checkpoint boundary describes its states.
- Either way the base is no longer this backend's own chain: its next materialization is full.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from dstl.errors import UsageError
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.keygroups import KeyGroupRange
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from materializer.manager import MaterializedBase
from materializer.state_registry import StateRegistry
from materializer.table_marker import TableMarker, boundary_of

__all__ = ["BaseInstaller", "BaseSlot"]

logger = logging.getLogger(__name__)


class BaseSlot(Protocol):
    """What the installer needs of the materialization manager: replace its base."""

    def restored(self, base: MaterializedBase) -> None: ...

    def install(self, cut: Callable[[MaterializedBase], MaterializedBase | None]
                ) -> MaterializedBase | None: ...


class BaseInstaller:
    """Installs restored and external bases of one backend (see the module docstring).

    Args:
        operator_id, key_groups, max_parallelism: the backend's.
        registry: the backend's states (recorded in the marker).
        table_id: the table's incarnation (:mod:`materializer.table_marker`).
        last_delta: the log part of the backend's newest checkpoint, if any.
        forget_chain: the next materialization must be full.
    """

    def __init__(self, operator_id: str, key_groups: KeyGroupRange, max_parallelism: int,
                 registry: StateRegistry, table_id: str,
                 last_delta: Callable[[], ChangelogHandle | None],
                 forget_chain: Callable[[], None]) -> None:
        self._operator_id = operator_id
        self._key_groups = key_groups
        self._max_parallelism = max_parallelism
        self._registry = registry
        self.table_id = table_id
        self._last_delta = last_delta
        self._forget_chain = forget_chain
        self._slot: BaseSlot | None = None

    def attach(self, slot: BaseSlot) -> None:
        """Connect the materialization manager (built after this installer)."""
        self._slot = slot

    def _manager(self) -> BaseSlot:
        assert self._slot is not None, "attach() the manager first"
        return self._slot

    def install_restored(self, materialized: Iterable[SnapshotRef],
                         non_materialized: Iterable[ChangelogHandle],
                         materialization_id: int) -> None:
        """Make the restored parts the base of the next checkpoints (until the first
        materialization), restricted to this backend's key groups (a part that names none of
        them is dropped)."""
        self._forget_chain()  # restored pieces: the next materialization is a full one
        snapshots = (r.restricted(self._key_groups) for r in materialized)
        logs = (h.restricted(self._key_groups) for h in non_materialized)
        self._manager().restored(MaterializedBase(tuple(r for r in snapshots if r is not None),
                                                  0, tuple(h for h in logs if h is not None),
                                                  materialization_id))

    def table_marker(self, handle: ChangelogStateBackendHandle) -> TableMarker:
        """The marker of this backend's table at checkpoint ``handle`` (this backend's)."""
        return TableMarker(self._operator_id, self._key_groups, self._max_parallelism,
                           handle.checkpoint_id, handle.materialization_id,
                           boundary_of(handle.non_materialized),
                           handle.non_materialized_size, handle.materialized_size,
                           self._registry.metas(),
                           tuple((p.key, p.materialization_id) for p in handle.materialized),
                           self.table_id)

    def write_table_marker(self, tables: Any, handle: ChangelogStateBackendHandle) -> None:
        """Write the marker of checkpoint ``handle`` into the LMDB table ``tables``.

        Raises:
            UsageError: ``tables`` is None (a heap table: nothing outside the process can
                read it).
        """
        if tables is None:
            raise UsageError(f"backend {self._operator_id!r}: a heap table has no marker")
        tables.write_marker(self.table_marker(handle).to_bytes())

    def install_materialization(self, ref: SnapshotRef, boundary: tuple[str, int],
                                chain: tuple[SnapshotRef, ...] = ()) -> SnapshotRef | None:
        """Make a snapshot taken elsewhere (the executor agent, from a read transaction of this
        table) the base of the next checkpoints, if this backend's log reaches it.

        The snapshot holds the table as of the change set at ``boundary`` = ``(segment key,
        offset)``. If that change set is in this backend's log (its restored handles or its
        writer's own change sets since the last materialization), the log up to it is replaced by
        the snapshot; otherwise the lineage differs (a re-run batch, a restore elsewhere, a newer
        snapshot already installed) and nothing changes.

        A delta (``ref.delta``) holds only the entries changed since the pieces ``chain`` (a
        full snapshot and the deltas after it): it is installed, with the pieces of ``chain``
        this backend's base lacks, only when the base is a prefix of ``chain`` (same objects,
        same materialization ids: the agent may have written a delta the backend did not install
        before the next one; a base of no snapshot is a prefix of every chain: the agent's full
        snapshot was written after this backend last asked for one), or when ``chain`` starts
        with the base's full snapshot and the delta is newer than the base (a merged delta,
        which replaces the deltas of the base: it holds every entry changed since the full
        snapshot), and the delta's id follows ``chain``'s — else its lineage differs and
        nothing changes. Either way the base's log must reach the delta's boundary.

        Returns:
            The installed reference (a full snapshot's materialization id raised above this
            backend's current one if needed), or ``None`` when it was not installed.
        """
        delta = self._last_delta()
        own = delta.change_sets if delta is not None else ()

        def cut(base: MaterializedBase) -> MaterializedBase | None:
            if any(m.key == ref.key for m in base.snapshots):
                return None
            rest = log_after(base, own, boundary)
            if rest is None:
                return None
            if ref.delta:
                pieces = tuple((p.key, p.materialization_id) for p in base.snapshots)
                named = tuple((p.key, p.materialization_id) for p in chain)
                if (not named
                        or (pieces and named[:len(pieces)] != pieces
                            and not (named[0] == pieces[0]
                                     and ref.materialization_id > base.materialization_id))
                        or ref.materialization_id != named[-1][1] + 1
                        or chain[0].delta or not all(p.delta for p in chain[1:])
                        or any(p.key_groups != ref.key_groups for p in (*base.snapshots,
                                                                        *chain))):
                    return None
                return MaterializedBase((*chain, ref), rest[1], rest[0], ref.materialization_id)
            mat_id = max(ref.materialization_id, base.materialization_id + 1)
            return MaterializedBase((SnapshotRef(ref.key, ref.size, ref.key_groups, mat_id),),
                                    rest[1], rest[0], mat_id)

        new = self._manager().install(cut)
        if new is None:
            return None
        self._forget_chain()  # a snapshot made elsewhere: the next own one is full
        installed = new.snapshots[-1]
        logger.info("backend %s: installed materialization %d (%s %s, %d bytes) at %s@%d",
                    self._operator_id, installed.materialization_id,
                    "delta" if installed.delta else "snapshot", installed.key,
                    installed.size, boundary[0], boundary[1])
        return installed


def log_after(base: MaterializedBase, own: tuple[ChangeSetRef, ...],
              boundary: tuple[str, int]) -> tuple[tuple[ChangelogHandle, ...], int] | None:
    """What is left of a backend's log after the change set at ``boundary`` = ``(segment key,
    offset)``: the restored handles after it and the sqn its own log is then materialized to —
    or ``None`` when neither the restored handles nor its own change sets since ``base``
    (``own``) contain that change set."""
    key, offset = boundary
    restored = base.restored_log
    # from the end: a restored change set may appear in several handles (one per contiguous
    # range of key groups it applies to); the table reflects all of them up to the last one
    for i in range(len(restored) - 1, -1, -1):
        h = restored[i]
        j = next((j for j, r in enumerate(h.change_sets) if r.key == key and r.offset == offset),
                 None)
        if j is not None:
            rest = h.change_sets[j + 1:]
            head = (ChangelogHandle(h.log_id, h.key_groups, rest[0].sqn, h.to_sqn, rest, 0,
                                    h.restrict),) if rest else ()
            return head + restored[i + 1:], base.up_to
    mine = next((r for r in own
                 if r.key == key and r.offset == offset and r.sqn >= base.up_to), None)
    return None if mine is None else ((), mine.sqn + 1)
