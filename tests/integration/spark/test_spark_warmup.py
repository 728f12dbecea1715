"""The warm-up (dstl.spark.warmup): a partition restored ahead of the first batch is adopted or
hit, never trusted when interrupted or predicted wrong; driven without Spark (one Spark test at
the end runs DstlStatefulOperator.warm_up for real)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from support.processors import Count

from dstl import DstlOptions, key_group_for
from dstl.spark.config import OperatorConfig, TaskInput
from dstl.spark.report import REPORT_COLUMN, TaskReport
from dstl.spark.runtime import close_runtime, runtime_for
from dstl.spark.task import run_partition
from dstl.spark.warmup import pre_restore, warm_partition
from materializer.options import BackendOptions

SCHEMA = pa.schema([("key", pa.string()), ("count", pa.int64()), (REPORT_COLUMN, pa.string())])
MP = 8


def _cfg(tmp_path: Path, table: str, *, partitions: int = 1, local: str = "local",
         agent: bool = False, snapshots: bool = False) -> OperatorConfig:
    opts = (BackendOptions(materialization_interval_s=0.0, materialize_log_ratio=None)
            if snapshots else BackendOptions(materialization_interval_s=None,
                                             materialize_log_ratio=None))
    return OperatorConfig(
        name="w", processor=Count, key_column="key", output_columns=("key", "count"),
        arrow_schema=SCHEMA, state_uri=str(tmp_path / "store"), storage_options=None,
        partitions=partitions, max_parallelism=MP, table=table,
        dstl_options=DstlOptions(persist_delay_s=0.0), backend_options=opts,
        local_dir=str(tmp_path / local), agent=agent)


def _run(cfg: OperatorConfig, inp: TaskInput, keys: list[str], partition: int = 0
         ) -> tuple[dict[str, int], TaskReport]:
    out: dict[str, int] = {}
    reports: list[TaskReport] = []
    for rb in run_partition(cfg, inp, iter([pa.RecordBatch.from_pydict({"key": keys})]),
                            partition=partition):
        for row in rb.to_pylist():
            if row[REPORT_COLUMN] is None:
                out[row["key"]] = row["count"]
            else:
                reports.append(TaskReport.from_json(row[REPORT_COLUMN]))
    assert len(reports) == 1
    return out, reports[0]


def _build(cfg: OperatorConfig, batches: list[list[str]]) -> dict[int, str]:
    """Run ``batches`` on partition 0 (each based on the previous); the last base handles.
    Then the process "restarts": its runtime is closed and its local directory removed."""
    base: dict[int, str] = {}
    try:
        for b, keys in enumerate(batches):
            _, report = _run(cfg, TaskInput(b, b - 1, base, tuple(range(b))), keys)
            base = {0: report.handle.to_json()}
    finally:
        close_runtime(cfg)
    assert cfg.local_dir is not None
    shutil.rmtree(cfg.local_dir, ignore_errors=True)
    return base


def _next(base: dict[int, str], batch_id: int) -> TaskInput:
    return TaskInput(batch_id, batch_id - 1, base, tuple(range(batch_id)))


@pytest.mark.parametrize("snapshots", [False, True], ids=["log", "snapshot"])
def test_lmdb_pre_restored_table_is_adopted_by_another_worker_and_hit_by_its_own(
        tmp_path: Path, snapshots: bool) -> None:
    cfg = _cfg(tmp_path, "lmdb", snapshots=snapshots)
    base = _build(cfg, [["a", "b"], ["a", "c"]])
    try:
        outcome = pre_restore(runtime_for(cfg), 0, _next(base, 2))
        assert outcome["access"] == "restore" and outcome["marked"] is True
        close_runtime(cfg)  # the batch's task runs in another worker of the executor
        out, report = _run(cfg, _next(base, 2), ["a", "b", "c"])
        assert report.slot.access == "adopt"
        assert out == {"a": 3, "b": 2, "c": 2}
        # the same worker warmed again for batch 3 (already current: a hit), then runs it
        base3 = {0: report.handle.to_json()}
        assert pre_restore(runtime_for(cfg), 0, _next(base3, 3))["access"] == "hit"
        out, report = _run(cfg, _next(base3, 3), ["c"])
        assert report.slot.access == "hit" and out == {"c": 3}
    finally:
        close_runtime(cfg)


def test_heap_pre_restore_is_a_hit_in_its_worker_and_a_restore_in_another(
        tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "heap")
    base = _build(cfg, [["a", "b"], ["a"]])
    try:
        outcome = pre_restore(runtime_for(cfg), 0, _next(base, 2))
        assert outcome == {**outcome, "access": "restore", "marked": False}
        out, report = _run(cfg, _next(base, 2), ["a", "b"])
        assert report.slot.access == "hit" and out == {"a": 3, "b": 2}
        base3 = {0: report.handle.to_json()}
        pre_restore(runtime_for(cfg), 0, _next(base3, 3))
        close_runtime(cfg)  # another worker: nothing of the warm-up is visible to it
        out, report = _run(cfg, _next(base3, 3), ["a"])
        assert report.slot.access == "restore" and out == {"a": 4}
    finally:
        close_runtime(cfg)


def test_a_wrong_prediction_restores_the_batchs_real_base(tmp_path: Path) -> None:
    """The warm-up restored checkpoint 1 (the newest), but Spark re-runs batch 1 (its commit
    was lost), whose base is checkpoint 0: the task must not adopt the warmed table."""
    cfg = _cfg(tmp_path, "lmdb")
    base0: dict[int, str] = {}
    try:
        _, r0 = _run(cfg, TaskInput(0, -1), ["a", "b"])
        base0 = {0: r0.handle.to_json()}
        _, r1 = _run(cfg, _next(base0, 1), ["a"])
        base1 = {0: r1.handle.to_json()}
    finally:
        close_runtime(cfg)
    shutil.rmtree(tmp_path / "local")
    try:
        assert pre_restore(runtime_for(cfg), 0, _next(base1, 2))["marked"] is True
        close_runtime(cfg)
        out, report = _run(cfg, TaskInput(1, 0, base0, (0, 1)), ["a"])  # the re-run
        assert report.slot.access == "restore" and out == {"a": 2}
    finally:
        close_runtime(cfg)


def test_a_partition_placed_on_another_executor_restores_there(tmp_path: Path) -> None:
    """Warmed on executor A (its local dir), run on executor B: B restores; A's warmed table is
    not adopted later when A's next task has another base."""
    a, b = _cfg(tmp_path, "lmdb", local="exec-a"), _cfg(tmp_path, "lmdb", local="exec-b")
    base = _build(a, [["a"], ["a", "b"]])
    try:
        assert pre_restore(runtime_for(a), 0, _next(base, 2))["marked"] is True
        close_runtime(a)
        out, report = _run(b, _next(base, 2), ["a", "b"])  # B: nothing warmed there
        assert report.slot.access == "restore" and out == {"a": 3, "b": 2}
        base3 = {0: report.handle.to_json()}
        close_runtime(b)
        out, report = _run(a, _next(base3, 3), ["b"])  # back on A, base 2 -> not the warm table
        assert report.slot.access == "restore" and out == {"b": 3}
    finally:
        close_runtime(a)
        close_runtime(b)


def test_rescaled_state_is_not_pre_restored(tmp_path: Path) -> None:
    keys = [f"user-{i}" for i in range(20)]
    two = _cfg(tmp_path, "lmdb", partitions=2)
    base: dict[int, str] = {}
    try:
        for p in (0, 1):
            mine = [k for k in keys if key_group_for(k.encode(), MP) * 2 // MP == p]
            _, report = _run(two, TaskInput(0, -1), mine, p)
            base[p] = report.handle.to_json()
    finally:
        close_runtime(two)
    one = _cfg(tmp_path, "lmdb", partitions=1)
    try:
        outcome = pre_restore(runtime_for(one), 0, TaskInput(1, 0, base, (0,)))
        assert outcome["access"] == "skipped" and outcome["marked"] is False
        out, report = _run(one, TaskInput(1, 0, base, (0,)), keys)
        assert report.slot.access == "rescale" and out == {k: 2 for k in keys}
    finally:
        close_runtime(one)


def test_a_failed_pre_restore_leaves_nothing_adoptable(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker write fails after a complete restore: the error propagates, the slot and
    the batch-id file are gone, and the batch restores."""
    import materializer.backend as backend_mod

    cfg = _cfg(tmp_path, "lmdb")
    base = _build(cfg, [["a", "b"], ["b"]])
    rt = runtime_for(cfg)
    rt.write_table_batch_id(0, 2)  # a stale file claiming the base: must not survive

    def boom(self: Any, handle: Any) -> None:
        raise OSError("injected: marker write failed")
    try:
        with monkeypatch.context() as m:
            m.setattr(backend_mod.ChangelogKeyedStateBackend, "write_table_marker", boom)
            with pytest.raises(OSError, match="injected"):
                pre_restore(rt, 0, _next(base, 2))
        assert 0 not in rt.slots and rt.read_table_batch_id(0) is None
        close_runtime(cfg)
        out, report = _run(cfg, _next(base, 2), ["a", "b"])
        assert report.slot.access == "restore" and out == {"a": 2, "b": 3}
    finally:
        close_runtime(cfg)


def test_warm_partition_yields_one_row_per_task(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "lmdb")
    base = _build(cfg, [["a"]])
    try:
        rows = [r for rb in warm_partition(cfg, _next(base, 1), iter([]), partition=0)
                for r in rb.to_pylist()]
        assert len(rows) == 1 and rows[0]["partition"] == 0
        assert '"access": "restore"' in rows[0]["outcome"]
    finally:
        close_runtime(cfg)


# --------------------------------------------------------------------------- killed midway

_CHILD = r"""
import os, signal, sys
import pyarrow as pa
from dstl import DstlOptions
from dstl.spark import StatefulProcessor
from dstl.spark.config import OperatorConfig, TaskInput
from dstl.spark.report import REPORT_COLUMN
from dstl.spark.runtime import WorkerRuntime, runtime_for
import dstl.spark.warmup as warmup
from materializer.options import BackendOptions

class Count(StatefulProcessor):
    def init(self, handle): self.count = handle.get_value_state("count")
    def handle_input_rows(self, key, rows): yield {}

store, local, handle, mode = sys.argv[1:5]
cfg = OperatorConfig(
    name="w", processor=Count, key_column="key", output_columns=("key", "count"),
    arrow_schema=pa.schema([("key", pa.string()), ("count", pa.int64()),
                            (REPORT_COLUMN, pa.string())]),
    state_uri=store, storage_options=None, partitions=1, max_parallelism=8, table="lmdb",
    dstl_options=DstlOptions(persist_delay_s=0.0),
    backend_options=BackendOptions(materialization_interval_s=None, materialize_log_ratio=None),
    local_dir=local, agent=False)
real_mark, real_write = warmup._mark_at_base, WorkerRuntime.write_table_batch_id
def mark(rt, partition, task_input):
    if mode == "before-marker":
        os.kill(os.getpid(), signal.SIGKILL)
    return real_mark(rt, partition, task_input)
def write(self, partition, batch_id):
    if mode == "after-marker" and batch_id is not None:
        os.kill(os.getpid(), signal.SIGKILL)
    real_write(self, partition, batch_id)
warmup._mark_at_base, WorkerRuntime.write_table_batch_id = mark, write
rt = runtime_for(cfg)
print("warming", flush=True)
print(warmup.pre_restore(rt, 0, TaskInput(3, 2, {0: handle}, (0, 1, 2)))["access"], flush=True)
"""


@pytest.mark.parametrize("mode", ["before-marker", "after-marker", "random"])
def test_a_warm_up_killed_midway_is_never_adopted(tmp_path: Path, mode: str) -> None:
    cfg = _cfg(tmp_path, "lmdb")
    keys = [f"k{i:06d}" for i in range(6_000)]
    base = _build(cfg, [keys[:3_000], keys, keys[3_000:]])
    local = tmp_path / "local"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    delays = [0.0, 0.01, 0.03, 0.06, 0.1, 0.2] if mode == "random" else [None]
    try:
        for delay in delays:
            p = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "store"),
                                  str(local), base[0], "none" if delay is not None else mode],
                                 stdout=subprocess.PIPE, text=True, env=env)
            assert p.stdout is not None and p.stdout.readline().strip() == "warming"
            if delay is not None:
                time.sleep(delay)
                p.send_signal(signal.SIGKILL)
            finished = p.stdout.read().strip() == "restore"
            p.wait(60)
            if delay is None:
                assert p.returncode == -signal.SIGKILL
            out, report = _run(cfg, _next(base, 3), ["k000000", "k005999"])
            # adopted only when the child got to the end; the counts are right either way
            assert report.slot.access == ("adopt" if finished else "restore"), (delay, finished)
            assert out == {"k000000": 3, "k005999": 3}
            close_runtime(cfg)
            shutil.rmtree(local)
    finally:
        close_runtime(cfg)


# --------------------------------------------------------------------------- agent


def test_with_the_agent_each_object_is_downloaded_once_per_executor(tmp_path: Path) -> None:
    """Two partitions warmed through one agent's cache, then run in "other workers": the batch
    downloads nothing more, and every object was fetched once."""
    from dstl.spark.agent.protocol import ShutdownRequest

    cfg = _cfg(tmp_path, "lmdb", partitions=2, agent=True)
    keys = [f"user-{i}" for i in range(40)]
    mine = {p: [k for k in keys if key_group_for(k.encode(), MP) * 2 // MP == p] for p in (0, 1)}
    os.environ["SPARK_LOCAL_DIRS"] = str(tmp_path / "executor")
    base: dict[int, str] = {}
    try:
        for p in (0, 1):
            _, report = _run(cfg, TaskInput(0, -1), mine[p], p)
            base[p] = report.handle.to_json()
        close_runtime(cfg)
        shutil.rmtree(tmp_path / "local")
        rt = runtime_for(cfg)
        assert rt.agent is not None
        before = rt.agent.metrics()
        for p in (0, 1):
            assert pre_restore(rt, p, _next(base, 1))["marked"] is True
        after_warm = rt.agent.metrics()
        fetched = after_warm["agent.cache.downloads"] - before["agent.cache.downloads"]
        assert fetched >= 1
        close_runtime(cfg)
        for p in (0, 1):
            out, report = _run(cfg, _next(base, 1), mine[p], p)
            assert report.slot.access == "adopt" and out == {k: 2 for k in mine[p]}
        rt = runtime_for(cfg)
        assert rt.agent is not None
        assert rt.agent.metrics()["agent.cache.downloads"] == after_warm["agent.cache.downloads"]
        rt.agent.request(ShutdownRequest()).result(10)
    finally:
        close_runtime(cfg)
        os.environ.pop("SPARK_LOCAL_DIRS", None)


# --------------------------------------------------------------------------- operator


def test_a_warm_up_waits_for_a_running_batch_of_its_operator(tmp_path: Path) -> None:
    """warm_up and foreach_batch share one lock: a warm-up started while a batch runs (a user
    thread, the stream's thread) does not touch Spark until the batch is done, so their tasks
    never restore and write the same table at once."""
    import threading

    from dstl.spark import DstlStatefulOperator

    op = DstlStatefulOperator(name="w", processor=Count, key_column="key",
                              output_schema="key string, count long",
                              state_uri=str(tmp_path / "store"), partitions=1)
    touched = threading.Event()

    class Session:  # the first thing warm_up uses; stands for Spark
        @property
        def sparkContext(self) -> Any:
            touched.set()
            raise RuntimeError("stop here: the warm-up reached Spark")

    got: list[BaseException] = []

    def warm() -> None:
        try:
            op.warm_up(Session())
        except BaseException as exc:  # kept for the assertion below
            got.append(exc)

    with op._tasks_lock:  # a batch of this operator is running
        t = threading.Thread(target=warm)
        t.start()
        assert not touched.wait(0.5), "the warm-up ran while a batch held the operator"
    t.join(10)
    assert touched.is_set() and len(got) == 1 and "reached Spark" in str(got[0])
