"""A streaming query stopped in the middle of batches, run in its own process so that its whole
JVM log (stdout and stderr, where an uncaught ``StackOverflowError`` lands) and every process it
starts can be inspected by ``test_spark_stop.py``.

``python stop_scenario.py TMP TABLE AGENT`` (AGENT: 1 or 0) writes ``TMP/result.json``:

1. session 1: a file-source query (one file per batch) whose processor sleeps; once batch 0 is
   committed and batch 1's tasks are running, ``query.stop()``;
2. session 2 (fresh): the query restarts; its sink waits for the stop to be requested and then
   starts a Spark job, so the stop interrupts the batch inside the sink, after DSTL committed
   its checkpoint;
3. session 3 (fresh): ``availableNow`` over every file; the sink's last counts must equal a model.

Every session uses ``SPARK_LOCAL_DIRS`` under TMP, so every process it starts (JVM, Python
workers, executor agent) has TMP in its environment, which is how the test finds strays.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]  # and tests/

FILES = 6
ROWS = 40


def _write_input(src: Path) -> Counter[str]:
    expected: Counter[str] = Counter()
    src.mkdir(parents=True, exist_ok=True)
    for i in range(FILES):
        keys = [f"k{(i * 7 + j) % 13}" for j in range(ROWS)]
        expected.update(keys)
        (src / f"part-{i:03d}.json").write_text("".join(json.dumps({"key": k}) + "\n"
                                                        for k in keys))
    return expected


def _wait(cond: Any, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s}s for {what}")
        time.sleep(0.05)  # polling the query's progress from another thread; no event to wait on


class _Run:
    """One scenario: the operator, the sink's view, the flags."""

    def __init__(self, tmp: Path, table: str, agent: bool) -> None:
        self.tmp, self.table, self.agent = tmp, table, agent
        self.flags = tmp / "flags"
        self.flags.mkdir(exist_ok=True)
        os.environ["DSTL_TEST_SLOW_DIR"] = str(self.flags)
        os.environ["SPARK_LOCAL_DIRS"] = str(tmp / "spark-local")
        self.latest: dict[str, int] = {}
        self.block_sink = False
        self.stops: list[dict[str, Any]] = []

    def sink(self, df: Any, batch_id: int) -> None:
        if self.block_sink:
            (self.flags / "in-sink").write_text(str(batch_id))
            _wait(lambda: (self.flags / "stop-requested").exists(), "the stop request")
            time.sleep(0.5)  # stop() has cancelled the job group and is interrupting the thread
            df.count()  # a job on the interrupted query thread
        self.latest.update({r["key"]: r["count"] for r in df.collect()})

    def operator(self) -> Any:
        from support.processors import SlowCount

        from dstl.spark import DstlStatefulOperator

        return DstlStatefulOperator(
            name="stop", processor=SlowCount, key_column="key",
            output_schema="key string, count long", state_uri=str(self.tmp / "store"),
            partitions=2, max_parallelism=16, table=self.table, agent=self.agent,
            sink=self.sink, local_dir=str(self.tmp / "local"), materialization_interval_s=0.0)

    def start(self, spark: Any, op: Any, available_now: bool = False) -> Any:
        w = (spark.readStream.schema("key string").option("maxFilesPerTrigger", 1)
             .json(str(self.tmp / "src")).writeStream.foreachBatch(op.foreach_batch)
             .option("checkpointLocation", str(self.tmp / "ck")))
        return (w.trigger(availableNow=True) if available_now else w).start()

    def stop(self, q: Any, op: Any, where: str) -> None:
        (self.flags / "stop-requested").write_text(where)
        t0 = time.monotonic()
        q.stop()
        exc = q.exception()
        stopped = time.monotonic() - t0
        running = sorted(int(p.name.split("-")[1]) for p in self.flags.glob("running-*"))
        # the workers that ran the interrupted tasks: how long they outlive the stop
        gone_after = _gone_after(running) if where == "tasks" else None
        self.stops.append({"where": where, "seconds": stopped, "workers_gone_after": gone_after,
                           "exception": None if exc is None else str(exc)[:2000],
                           "active": q.isActive,
                           "batches_done": [s["batch_id"] for s in op.batch_stats],
                           "running_pids": running})
        for p in self.flags.iterdir():
            p.unlink()


def _gone_after(pids: list[int], timeout_s: float = 60.0) -> float | None:
    """Seconds until none of ``pids`` runs any more (``None``: still running at the timeout)."""
    t0 = time.monotonic()
    while any(_alive(p) for p in pids):
        if time.monotonic() - t0 > timeout_s:
            return None
        time.sleep(0.1)  # polling other processes' exit; there is no event to wait on
    return time.monotonic() - t0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def _stop_session(spark: Any, timeout_s: float = 60.0) -> None:
    """Stop the session once its killed tasks are accounted for: a task killed by
    ``query.stop()`` reports back to the scheduler asynchronously, and a ``SparkContext.stop()``
    that shuts the scheduler's result threads down before that report arrives makes Spark log
    ``ERROR TaskSchedulerImpl: Exception in statusUpdate`` (its own shutdown race, seen once in
    a clean-clone run), which this scenario's log check cannot tell from a real error. A
    cancelled stage leaves the active stages before its killed tasks report (seen in a second
    clean-clone run), so the wait is for the executors' running tasks, which the scheduler
    counts down as each report arrives."""
    tracker = spark.sparkContext.statusTracker()
    executors = spark.sparkContext._jsc.sc().statusTracker()

    def idle() -> bool:
        return not tracker.getActiveStageIds() and all(
            e.numRunningTasks() == 0 for e in executors.getExecutorInfos())

    _wait(idle, "the killed tasks to report", timeout_s)
    spark.stop()


def _session(name: str) -> Any:
    from spark_support import new_session

    spark = new_session(name)
    spark.sparkContext.setLogLevel("WARN")  # warnings too: Arrow reports leaks as warnings
    return spark


def main(tmp: Path, table: str, agent: bool) -> None:
    run = _Run(tmp, table, agent)
    expected = _write_input(tmp / "src")
    result: dict[str, Any] = {}
    os.environ["DSTL_TEST_SLOW_S"] = "0.3"  # ~2 s per task: the stop lands inside the tasks
    spark = _session("dstl-stop-1")
    result["jvm_pid"] = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
    op = run.operator()
    q = run.start(spark, op)
    _wait(lambda: len(op.batch_stats) >= 1, "batch 0")
    for p in run.flags.glob("running-*"):
        p.unlink()
    _wait(lambda: any(run.flags.glob("running-*")), "batch 1's tasks")
    run.stop(q, op, "tasks")
    op.close()
    _stop_session(spark)

    os.environ["DSTL_TEST_SLOW_S"] = "0"
    run.block_sink = True
    spark = _session("dstl-stop-2")
    op = run.operator()
    q = run.start(spark, op)
    _wait(lambda: (run.flags / "in-sink").exists(), "the sink")
    run.stop(q, op, "sink")
    op.close()
    _stop_session(spark)

    run.block_sink = False
    spark = _session("dstl-stop-3")
    op = run.operator()
    q = run.start(spark, op, available_now=True)
    q.awaitTermination()
    result.update(stops=run.stops, final_exception=None if q.exception() is None
                  else str(q.exception())[:2000],
                  final_batches=[s["batch_id"] for s in op.batch_stats],
                  final_accesses=[s["accesses"] for s in op.batch_stats],
                  latest=run.latest, expected=dict(expected))
    op.close()
    _stop_session(spark)
    (tmp / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1")
