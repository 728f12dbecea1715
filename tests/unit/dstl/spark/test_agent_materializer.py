"""The executor agent's materializer without the agent process: schedule (random first delay,
fixed delay, size trigger), nothing new -> skipped, failures -> reported after max_failures, a
table being restored is not a failure, stale partitions dropped. Real LMDB tables and a local
store; the clock is the test's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.spark.agent import AgentMaterializer, LatestMaterialization, PartitionSpec
from materializer import BackendOptions, ChangelogKeyedStateBackend, ValueStateDescriptor
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from materializer.lmdb_table import LmdbStateTable

MP = 8
KGS = KeyGroupRange(0, MP - 1)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _table_with_checkpoints(tmp: Path, n: int) -> tuple[ChangelogStorage, str, PartitionSpec]:
    storage = ChangelogStorage(str(tmp / "store"), options=DstlOptions(persist_delay_s=0.0))
    b = ChangelogKeyedStateBackend(storage, "op/p0", KGS, MP, table="lmdb",
                                   options=BackendOptions(materialization_interval_s=None,
                                                          materialize_log_ratio=None),
                                   local_directory=str(tmp / "local"))
    state = b.get_state(ValueStateDescriptor("v"))
    for cp in range(1, n + 1):
        with b.write_batch():
            b.set_current_key(f"k{cp}")
            state.update(cp)
            h = b.snapshot(cp).result(10)
            b.write_table_marker(h)
        b.notify_checkpoint_complete(cp)
    marker = b.table_marker(h)
    env = b.tables.path
    b.close()  # the test process opens the table read-only next (one open per process)
    spec = PartitionSpec("op/p0", env, KGS, 10.0, None, 0, 1, 1, marker.boundary,
                         marker.log_bytes, marker.snapshot_bytes)
    return storage, env, spec


def test_schedule_skip_and_hand_over(tmp_path: Path) -> None:
    storage, _env, spec = _table_with_checkpoints(tmp_path, 3)
    clock = Clock()
    m = AgentMaterializer(clock=clock, start=False)
    m.register("s", storage.store, spec)
    assert m.latest("s", "op/p0") == LatestMaterialization(None, None)
    clock.now += 10.0  # past the random first delay (< interval)
    assert m.run_due() == 1
    got = m.latest("s", "op/p0").materialization
    assert got is not None and tuple(got.boundary) == spec.boundary
    assert storage.store.head(got.ref.key) is not None
    clock.now += 10.0
    assert m.run_due() == 0  # the boundary has not moved: nothing new
    # the size trigger makes it due at once, but still only with something new
    m.register("s", storage.store, dataclasses.replace(spec, log_ratio=1.0, log_bytes=10 ** 6))
    assert m.run_due() == 0
    metrics = m.metrics()
    assert metrics["materializer.completed"] == 1 and metrics["materializer.partitions"] == 1
    m.close()
    storage.close()


def test_size_trigger_failures_and_stale(tmp_path: Path) -> None:
    storage, env, spec = _table_with_checkpoints(tmp_path, 2)
    clock = Clock()
    m = AgentMaterializer(clock=clock, start=False)
    big = PartitionSpec(spec.log_id, env, KGS, 1000.0, 1.0, 0, 1, 1, spec.boundary,
                        spec.snapshot_bytes + 10, 1)
    m.register("s", storage.store, big)
    assert m.run_due() == 1  # the log outgrew the snapshot: due now, not in up to 1000 s
    # a table that is being restored (its directory is gone for a moment) is not a failure
    missing = PartitionSpec("op/p1", str(tmp_path / "gone"), KGS, 1.0, None, 0, 1, 1,
                            ("dstl/x", 0), 1, 1)
    m.register("s", storage.store, missing)
    clock.now += 1.0
    assert m.run_due() == 0
    assert m.metrics()["materializer.failed"] == 0
    # a damaged marker: a failure, retried at the next due time, reported after max_failures
    t = LmdbStateTable(env, KGS)
    t.write_marker(b"garbage")
    t.close()
    moved = PartitionSpec(spec.log_id, env, KGS, 1.0, None, 0, 1, 1, ("dstl/other", 1), 1, 1)
    m.register("s", storage.store, moved)
    m.request("s", "op/p0")  # due now (the interval of 1000 s still applied)
    m.run_due()
    clock.now += 1.0  # retried at the next due time (the new interval)
    m.run_due()
    report = m.latest("s", "op/p0")
    assert report.failed is not None and "marker" in report.failed
    assert m.metrics()["materializer.failed"] == 2
    # partitions not heard of for long moved to another executor: dropped
    clock.now += 120.0
    m.run_due()
    assert m.metrics()["materializer.partitions"] == 0
    m.close()
    storage.close()


def test_spec_round_trip() -> None:
    spec = PartitionSpec("op/p3", "/x", KGS, None, 2.0, 5, 3, 2, ("dstl/a", 7), 1, 2)
    assert PartitionSpec.from_json_obj(spec.to_json_obj()) == spec
    log = ChangelogHandle("op/p3", KGS, 4, 5, (ChangeSetRef(4, "dstl/a", 7, 30, 2, 20),))
    piece = SnapshotRef("snapshots/op_p3/s", 100, KGS, 3)
    seeded = dataclasses.replace(spec, incremental=True, table_id="t1", checkpoint=(
        ChangelogStateBackendHandle("op/p3", KGS, 9, 3, (piece,), (log,), 0, MP)))
    assert PartitionSpec.from_json_obj(seeded.to_json_obj()) == seeded
    with pytest.raises(KeyError):
        PartitionSpec.from_json_obj({"log_id": "x"})


def test_schedule_is_the_policys_first_delay_then_nothing_new_stays_due(tmp_path: Path) -> None:
    """The agent's partitions follow materializer.policy: first due at the drawn delay, then
    the interval after an attempt; an unchanged boundary is not attempted and does not move the
    schedule, so the partition runs as soon as its next commit registers a new boundary."""
    storage, _env, spec = _table_with_checkpoints(tmp_path, 2)
    clock = Clock()
    draws: list[tuple[float, float]] = []

    def uniform(a: float, b: float) -> float:
        draws.append((a, b))
        return 4.0

    m = AgentMaterializer(clock=clock, start=False, uniform=uniform)
    m.register("s", storage.store, spec)
    assert draws == [(0.0, 10.0)]
    clock.now += 3.9
    assert m.run_due() == 0
    clock.now += 0.1
    assert m.run_due() == 1
    clock.now += 50.0  # past the interval (not stale yet), but nothing new: no attempt
    assert m.run_due() == 0 and m.metrics()["materializer.started"] == 1
    # the boundary moves (here: a marker the table does not hold, so the attempt writes
    # nothing): due at once, then again only an interval after that attempt
    m.register("s", storage.store, dataclasses.replace(spec, boundary=("dstl/next", 0)))
    m.run_due()
    assert m.metrics()["materializer.started"] == 2
    clock.now += 9.9
    m.run_due()
    assert m.metrics()["materializer.started"] == 2
    clock.now += 0.1
    m.run_due()
    assert m.metrics()["materializer.started"] == 3
    m.close()
    storage.close()
