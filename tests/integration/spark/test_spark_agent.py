"""The executor agent under a real local Spark: group commit across concurrent tasks, the agent
killed mid-window (Spark retries, counts exact), and the agent's lifecycle (exits with its
executor, no stray processes)."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from spark_support import new_session
from support.processors import Count

from dstl import DstlOptions
from dstl.spark import DstlStatefulOperator

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: not gone and not a zombie (a killed agent stays a zombie until the
    worker that spawned it reaps it, which a reused worker may do much later)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)  # polling another process's exit; there is no event to wait on
    return False


class KillAgentOnce(Count):
    """On the first attempt of partition 0, SIGKILLs the executor agent mid-window."""

    flag = ""

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        from pyspark import TaskContext

        from dstl.spark.runtime import runtimes

        ctx = TaskContext.get()
        if ctx is not None and ctx.partitionId() == 0 and ctx.attemptNumber() == 0 \
                and self.flag and not os.path.exists(self.flag):
            for rt in runtimes():
                if rt.agent is not None:
                    pid = int(rt.agent.metrics()["agent.pid"])
                    Path(self.flag).write_text(str(pid))
                    os.kill(pid, signal.SIGKILL)
        yield from super().handle_input_rows(key, rows)


def _op(processor: type, tmp: Path, latest: dict[str, int], **kw: Any) -> DstlStatefulOperator:
    return DstlStatefulOperator(
        name="agent-test", processor=processor, key_column="key",
        output_schema="key string, count long", state_uri=str(tmp / "store"),
        partitions=kw.pop("partitions", 2), max_parallelism=32,
        sink=lambda df, b: latest.update({r["key"]: r["count"] for r in df.collect()}),
        local_dir=str(tmp / "local"), materialization_interval_s=kw.pop("mat_s", 10_000.0), **kw)


def test_agent_group_commits_kills_and_lifecycle(tmp_path: Path) -> None:
    spark = new_session("dstl-agent")
    agent_pids: set[int] = set()
    try:
        # 1. concurrent tasks of one executor share one segment per flush window
        latest: dict[str, int] = {}
        op = _op(Count, tmp_path / "a", latest,
                 options=DstlOptions(persist_delay_s=3.0))  # a window both tasks fall into,
        # wide enough that a loaded CI machine cannot split two concurrent tasks across two
        expected: Counter[str] = Counter()
        for b in range(3):
            keys = [f"k{i % 9}" for i in range(b, b + 60)]
            op.foreach_batch(spark.createDataFrame([(k,) for k in keys], "key string"), b)
            expected.update(keys)
        assert latest == dict(expected)
        for s in op.batch_stats:
            assert s["segments"] == 1, s  # two partitions written concurrently, one object
            agent_pids.update(s["agents"])
        per_task = _op(Count, tmp_path / "b", {}, agent=False,
                       options=DstlOptions(persist_delay_s=1.0))
        per_task.foreach_batch(spark.createDataFrame([(f"k{i}",) for i in range(60)],
                                                     "key string"), 0)
        assert per_task.batch_stats[0]["segments"] == 2  # the per-task mode: one per partition
        op.close()
        per_task.close()

        # 2. the agent killed mid-window (and while it materializes the partitions: interval 0):
        # the task fails, Spark retries, a new agent starts, restores read through its cache
        latest2: dict[str, int] = {}
        killer = type("KillAgentHere", (KillAgentOnce,), {"flag": str(tmp_path / "killed")})
        op2 = _op(killer, tmp_path / "c", latest2, mat_s=0.0)
        expected2: Counter[str] = Counter()
        for b in range(3):
            keys = [f"u{i % 5}" for i in range(b, b + 30)]
            op2.foreach_batch(spark.createDataFrame([(k,) for k in keys], "key string"), b)
            expected2.update(keys)
            assert latest2 == dict(expected2), f"after batch {b}"
        killed = int((tmp_path / "killed").read_text())
        assert not _alive(killed)
        for s in op2.batch_stats:
            agent_pids.update(s["agents"])
        assert any(p != killed for p in agent_pids)  # a replacement agent served later batches
        assert sum(s["materializations"] for s in op2.batch_stats) > 0
        op2.close()
    finally:
        spark.stop()
    # 3. the agents exit with their executor: no stray processes after the session stops
    for pid in agent_pids:
        assert _wait_gone(pid), f"executor agent {pid} still running after the session stopped"
