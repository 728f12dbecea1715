"""The state reader (dstl.reader) against a dict model of a job: every state kind, heap and
LMDB, before and after materializations, across rescales (out and in); the change feed's rows
replay to the model and, where the log holds every change, equal the model's changes exactly,
in log order per key; typed errors for missing, deleted and damaged objects.

The job is tests/support/state_job.py's MiniJob (backends + a coordinator writing manifests the
way the Spark operator does); Spark is not involved here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.state_job import MiniJob, replay, state_of

from dstl.errors import CorruptObjectError, ObjectNotFoundError, UsageError
from dstl.keygroups import key_group_for
from dstl.reader import (
    ChangesLostError,
    CheckpointCatalog,
    CheckpointDeletedError,
    CheckpointNotFoundError,
    ReadOnlyBlobStore,
    plan_change_range,
    plan_state_splits,
    read_change_split,
    read_changes,
    read_state,
    read_state_split,
    task_states,
    verify_checkpoint,
)
from dstl.stores import open_store
from dstl.stores.base import BlobStore

SEEDS = (11, 12)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BlobStore]:
    s = open_store(str(tmp_path / "state"))
    yield s
    s.close()


def _catalog(store: BlobStore) -> CheckpointCatalog:
    return CheckpointCatalog(ReadOnlyBlobStore(store), job_id="job")


def _per_key(rows: Any) -> dict[str, list[tuple[Any, ...]]]:
    """The changes of each key in order: (checkpoint, state, namespace, op, user key, value)."""
    out: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for r in rows:
        out[r.key].append((r.checkpoint, r.state, r.namespace, r.op, r.user_key, r.value))
    return dict(out)


def _feed_rows(catalog: CheckpointCatalog, a: int | None, b: int) -> list[Any]:
    rows = list(read_changes(catalog, a, b))
    return sorted(rows, key=lambda r: (r.checkpoint, r.partition, r.seq))


def _check_every_checkpoint_and_range(job: MiniJob, catalog: CheckpointCatalog,
                                      exact: bool) -> None:
    ids = catalog.ids()
    assert ids, "no checkpoint retained"
    for c in ids:
        assert state_of(read_state(catalog, c)) == job.checkpoint_models[c], f"state of {c}"
    # the reader's other table: a read-only restore into a temporary LMDB directory
    last = ids[-1]
    assert state_of(read_state(catalog, last, table="lmdb")) == job.checkpoint_models[last]
    for a in [None, *ids]:
        for b in ids:
            if a is not None and b <= a:
                continue
            rows = _feed_rows(catalog, a, b)
            base = job.checkpoint_models[a] if a is not None else None
            assert replay(rows, base) == job.checkpoint_models[b], f"feed ({a}, {b}]"
            if exact and a is not None:
                assert {r.source for r in rows} <= {"log"}
                want = [c for c in job.changes if a < c.checkpoint <= b]
                assert _per_key(rows) == _per_key(want), f"feed ({a}, {b}] is not the log"


@pytest.mark.parametrize("table", ["heap", "lmdb"])
@pytest.mark.parametrize("seed", SEEDS)
def test_log_only_feed_is_exactly_the_jobs_changes_across_rescales(
        store: BlobStore, table: str, seed: int) -> None:
    print(f"seed={seed}")
    job = MiniJob(store, partitions=2, table=table, seed=seed, retained=10)
    try:
        for partitions in (2, 3, 1, 2):
            if partitions != job.partitions:
                job.rescale(partitions)
            job.run(120)
            job.checkpoint()
            job.run(60)
            job.checkpoint()
        _check_every_checkpoint_and_range(job, _catalog(store), exact=True)
    finally:
        job.close()


@pytest.mark.parametrize("table", ["heap", "lmdb"])
@pytest.mark.parametrize("seed", SEEDS)
def test_state_and_feed_equal_the_model_before_and_after_materializations(
        store: BlobStore, table: str, seed: int) -> None:
    print(f"seed={seed}")
    job = MiniJob(store, partitions=2, table=table, seed=seed, retained=8)
    try:
        job.run(150)
        job.checkpoint()
        job.run(60)
        job.materialize()  # cut between checkpoints: changes in no checkpoint's log
        job.run(80)
        job.checkpoint()
        job.run(50)
        job.checkpoint()
        job.rescale(3)  # p1, p2 keep naming the old snapshots and logs
        job.run(60)
        job.checkpoint()
        job.run(30)
        job.materialize(0)
        job.run(60)
        job.checkpoint()
        job.rescale(1)  # owners must not be mixed up: p0 is newer than the old snapshots
        job.run(60)
        job.checkpoint()
        catalog = _catalog(store)
        _check_every_checkpoint_and_range(job, catalog, exact=False)
        # a cut between checkpoints comes back as differences, and only there
        sources = {r.checkpoint: set() for r in read_changes(catalog, 0, 5)}
        for r in read_changes(catalog, 0, 5):
            sources[r.checkpoint].add(r.source)
        assert "snapshot" in sources[1] and "snapshot" in sources[4]
        assert sources[2] == {"log"} and sources[3] == {"log"} and sources[5] == {"log"}
    finally:
        job.close()


@pytest.mark.parametrize("table", ["heap", "lmdb"])
def test_a_materialization_at_a_checkpoint_keeps_the_feed_exact(store: BlobStore,
                                                                table: str) -> None:
    job = MiniJob(store, partitions=2, table=table, seed=5, retained=6)
    try:
        job.run(150)
        job.checkpoint()
        job.materialize()  # at the checkpoint: the snapshot records that checkpoint's boundary
        job.run(100)
        job.checkpoint()
        job.run(100)
        job.checkpoint()
        catalog = _catalog(store)
        handles = [t.handle for t in task_states(catalog.manifest(1))]
        assert all(h.materialization_id == 1 for h in handles)
        _check_every_checkpoint_and_range(job, catalog, exact=True)
    finally:
        job.close()


def test_a_key_filter_reads_only_the_key_groups_that_can_hold_the_keys(store: BlobStore) -> None:
    job = MiniJob(store, partitions=2, max_parallelism=16, seed=7)
    try:
        job.run(200)
        cid = job.checkpoint()
        catalog = _catalog(store)
        manifest = catalog.manifest()
        kg = key_group_for(b"k3", 16)
        splits = plan_state_splits(cid, task_states(manifest), key_groups={kg})
        assert [s.key_groups for s in splits] == [(kg, kg)]
        rows = list(read_state(catalog, keys=["k3"]))
        assert rows and {r.key for r in rows} == {"k3"}
        assert state_of(rows) == {i: v for i, v in job.model.items() if i[1] == "k3"}
        only = list(read_state(catalog, states=["attrs"]))
        assert {r.state for r in only} == {"attrs"} and all(r.user_key is not None for r in only)
        # slices of at most 3 key groups read the same rows as one split per handle
        sliced = plan_state_splits(cid, task_states(manifest), max_key_groups=3)
        assert len(sliced) == 6 and sum(len(range(s.key_groups[0], s.key_groups[1] + 1))
                                        for s in sliced) == 16
        rows_sliced = [r for s in sliced for r in read_state_split(catalog.store, s)]
        assert state_of(rows_sliced) == job.model
    finally:
        job.close()


def test_feed_from_a_checkpoint_no_longer_retained_names_what_was_lost(
        store: BlobStore) -> None:
    job = MiniJob(store, partitions=1, seed=3, retained=2)
    try:
        for _ in range(4):
            job.run(30)
            job.checkpoint()
        catalog = _catalog(store)
        assert catalog.ids() == [2, 3]
        with pytest.raises(ChangesLostError) as err:
            plan_change_range(catalog, 0, 3)
        assert err.value.lost == (0, 2) and "checkpoints 1..2" in str(err.value)
        plan = plan_change_range(catalog, 0, 3, on_lost="oldest")
        assert (plan.start, plan.end, plan.lost) == (2, 3, (0, 2))
        assert plan_change_range(catalog, 3).splits == ()
        with pytest.raises(CheckpointNotFoundError, match="checkpoints there: 2, 3"):
            plan_change_range(catalog, 2, 7)
        with pytest.raises(CheckpointNotFoundError):
            list(read_state(catalog, 1))
    finally:
        job.close()


def test_missing_deleted_and_damaged_objects_are_typed_errors_naming_them(
        store: BlobStore) -> None:
    job = MiniJob(store, partitions=1, seed=4, retained=5)
    try:
        job.run(60)
        job.checkpoint()
        job.materialize()
        job.run(60)
        job.checkpoint()
    finally:
        job.close()
    catalog = _catalog(store)
    manifest = catalog.manifest(1)
    handle = task_states(manifest)[0].handle
    segment = handle.non_materialized[-1].change_sets[-1].key
    snapshot = handle.materialized[0].key
    splits = plan_change_range(catalog, 0, 1).splits
    assert splits

    # damaged: a flipped byte in the segment
    data = bytearray(store.get(segment))
    data[20] ^= 0x40
    store.delete([segment])
    store.put(segment, bytes(data))
    with pytest.raises(CorruptObjectError) as corrupt:
        list(read_state(catalog, 1))
    assert segment in str(corrupt.value)
    report = verify_checkpoint(catalog, 1)
    assert not report.ok and [p.key for p in report.problems] == [segment]

    # missing while its checkpoint still exists: the store is damaged
    store.delete([snapshot])
    with pytest.raises(ObjectNotFoundError) as missing:
        list(read_state(catalog, 1))
    assert not isinstance(missing.value, CheckpointDeletedError)
    assert snapshot in str(missing.value) and "checkpoint 1 still exists" in str(missing.value)
    assert {p.key for p in verify_checkpoint(catalog, 1).problems} == {segment, snapshot}

    # deleted under the reader: planned, then retention removed the manifest and its objects
    store.delete([manifest.key, segment])
    with pytest.raises(CheckpointDeletedError) as deleted:
        list(read_change_split(catalog.store, splits[0]))
    assert deleted.value.checkpoint_id == 1 and "retained=" in str(deleted.value)


def test_the_reader_never_writes(store: BlobStore) -> None:
    job = MiniJob(store, partitions=2, seed=8)
    try:
        job.run(100)
        job.checkpoint()
    finally:
        job.close()
    before = sorted((i.key, i.size) for i in store.list())
    catalog = _catalog(store)
    assert list(read_state(catalog)) and list(read_changes(catalog, None))
    assert verify_checkpoint(catalog).ok
    assert sorted((i.key, i.size) for i in store.list()) == before
    with pytest.raises(UsageError, match="read-only"):
        catalog.store.put("dstl/x.seg", b"x")
    with pytest.raises(UsageError, match="read-only"):
        catalog.store.delete(["dstl/x.seg"])


def test_a_manifest_of_another_job_is_refused(store: BlobStore) -> None:
    job = MiniJob(store, partitions=1, seed=9)
    try:
        job.run(10)
        job.checkpoint()
    finally:
        job.close()
    with pytest.raises(UsageError, match="belongs to job 'job', not 'other'"):
        CheckpointCatalog(store, job_id="other").manifest()
