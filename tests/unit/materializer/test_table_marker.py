"""The table marker's identity check: which attempt of a checkpoint an on-disk table holds."""

from __future__ import annotations

from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.keygroups import KeyGroupRange
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from materializer.table_marker import TableMarker, boundary_of

KG = KeyGroupRange(0, 7)


def _handle(snapshots: tuple[str, ...], log: tuple[tuple[str, int], ...] = ()
            ) -> ChangelogStateBackendHandle:
    refs = tuple(SnapshotRef(key, 100, KG, i + 1, delta=i > 0) for i, key in enumerate(snapshots))
    sets = tuple(ChangeSetRef(i + 1, key, offset, 10, 1, 8) for i, (key, offset) in enumerate(log))
    logs = (ChangelogHandle("op/p0", KG, 1, len(sets) + 1, sets),) if sets else ()
    return ChangelogStateBackendHandle("op/p0", KG, 3, len(snapshots), refs, logs, 0, 8)


def _marker(h: ChangelogStateBackendHandle) -> TableMarker:
    return TableMarker("op/p0", KG, 8, h.checkpoint_id, h.materialization_id,
                       boundary_of(h.non_materialized),
                       snapshots=tuple((p.key, p.materialization_id) for p in h.materialized))


def test_two_attempts_that_materialized_all_their_log_are_told_apart_by_their_pieces() -> None:
    """Both attempts of checkpoint 3 end on a snapshot (no change set after it): the same batch
    id, no boundary. Only the snapshot pieces (names unique per upload) tell them apart."""
    first = _handle(("snapshots/op_p0/a-1", "snapshots/op_p0/a-2"))
    rerun = _handle(("snapshots/op_p0/a-1", "snapshots/op_p0/b-2"))
    assert _marker(first).holds(first) and _marker(rerun).holds(rerun)
    assert not _marker(first).holds(rerun) and not _marker(rerun).holds(first)


def test_two_attempts_with_a_log_are_told_apart_by_their_last_change_set() -> None:
    first = _handle(("snapshots/op_p0/a-1",), (("dstl/seg-1", 0),))
    rerun = _handle(("snapshots/op_p0/a-1",), (("dstl/seg-2", 0),))
    assert _marker(first).holds(first)
    assert not _marker(first).holds(rerun)
    # the same log after another snapshot chain is another state too
    other_chain = _handle(("snapshots/op_p0/c-1",), (("dstl/seg-1", 0),))
    assert not _marker(first).holds(other_chain)
