"""A driver process for the in-query tests: one run of a streaming query
``files -> op.transform -> Parquet`` over the input files present (``availableNow``), killed with
SIGKILL at a chosen step when asked.

    python in_query_driver.py WORK PARTITIONS [KILL_AT]

The state goes to ``WORK/state`` unless ``DSTL_TEST_STATE_URI`` names another store (with
``DSTL_TEST_STORAGE_OPTIONS``, JSON); ``DSTL_TEST_TABLE`` picks the table (default LMDB).

``KILL_AT``: ``task`` (the state task of batch 1 kills the driver while it runs), ``tasks-done``
(the operation after DSTL's in the same task kills it once DSTL's rows are all through: every
result of batch 1 is stored, Spark has not committed), ``committed``
(a listener added before DSTL's kills it when Spark reports batch 1: after Spark's commit, before
DSTL's manifest) or ``manifest`` (a listener added after DSTL's: after both).
``DSTL_TEST_KILL_BATCH`` names another batch than 1.

With ``DSTL_TEST_INITIAL=1`` the operator has an ``initial_state`` (:data:`SEEDS`, each row's
``start`` added to its key's count), and ``KILL_AT`` may also be ``staging`` (a task of the job
that stages the initial state kills the driver: before the marker).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

from pyspark.sql.streaming.listener import StreamingQueryListener

from dstl.spark import DstlStatefulOperator, StatefulProcessor

KILL_BATCH = int(os.environ.get("DSTL_TEST_KILL_BATCH", "1"))
#: the initial state of DSTL_TEST_INITIAL=1: (key, start); k21 twice, k25..k29 never in the input
SEEDS = [(f"k{i:02d}", 100 * i) for i in range(18, 30)] + [("k21", 7)]


class Count(StatefulProcessor):
    """Counts rows per key; with ``DSTL_TEST_KILL_DRIVER`` set, its first call in batch
    ``KILL_BATCH`` kills that process (the driver) and waits to be killed with it."""

    def init(self, handle: Any) -> None:
        self.count = handle.get_value_state("count")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        from pyspark import TaskContext

        victim = os.environ.get("DSTL_TEST_KILL_DRIVER")
        ctx = TaskContext.get()
        if victim and os.environ.get("DSTL_TEST_KILL_AT") == "task" and ctx is not None and \
                ctx.getLocalProperty("streaming.sql.batchId") == str(KILL_BATCH):
            os.kill(int(victim), signal.SIGKILL)
            signal.pause()
        c = (self.count.get() or 0) + sum(1 for _ in rows)
        self.count.update(c)
        yield {"key": key, "count": c}

    def handle_initial_state(self, key: Any, initial_state: dict[str, Any],
                             timer_values: Any) -> None:
        self.count.update((self.count.get() or 0) + initial_state["start"])


def kill_in_staging(batches: Iterator[Any]) -> Iterator[Any]:
    """Passes the initial state's rows on; with ``DSTL_TEST_KILL_AT=staging`` kills the driver
    (this runs in the staging job, before DSTL's staging tasks have written anything)."""
    if os.environ.get("DSTL_TEST_KILL_AT") == "staging":
        os.kill(int(os.environ["DSTL_TEST_KILL_DRIVER"]), signal.SIGKILL)
        signal.pause()
    yield from batches


def kill_when_done(batches: Iterator[Any]) -> Iterator[Any]:
    """Passes DSTL's rows on; in batch ``KILL_BATCH`` (with ``DSTL_TEST_KILL_AT=tasks-done``),
    once they are all through, kills the driver."""
    from pyspark import TaskContext

    yield from batches
    ctx = TaskContext.get()
    victim = os.environ.get("DSTL_TEST_KILL_DRIVER")
    if victim and os.environ.get("DSTL_TEST_KILL_AT") == "tasks-done" and ctx is not None \
            and ctx.getLocalProperty("streaming.sql.batchId") == str(KILL_BATCH):
        os.kill(int(victim), signal.SIGKILL)
        signal.pause()


class KillAt(StreamingQueryListener):
    """SIGKILLs this process when Spark reports batch ``KILL_BATCH``."""

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        if int(event.progress.batchId) == KILL_BATCH:
            os.kill(os.getpid(), signal.SIGKILL)

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        pass


def main() -> None:
    work, partitions = sys.argv[1], int(sys.argv[2])
    kill_at = sys.argv[3] if len(sys.argv) > 3 else ""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(os.path.dirname(here))]  # and tests/
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    if kill_at in ("task", "tasks-done", "staging"):
        os.environ["DSTL_TEST_KILL_DRIVER"] = str(os.getpid())
        os.environ["DSTL_TEST_KILL_AT"] = kill_at
    from spark_support import new_session

    spark = new_session("dstl-in-query-driver")
    # classes travel by reference: the workers import this module as ``in_query_driver``
    from in_query_driver import Count as Processor
    from in_query_driver import KillAt as Killer

    if kill_at == "committed":
        spark.streams.addListener(Killer())
    options = os.environ.get("DSTL_TEST_STORAGE_OPTIONS")
    initial = None
    if os.environ.get("DSTL_TEST_INITIAL") == "1":
        from in_query_driver import kill_in_staging

        initial = spark.createDataFrame(SEEDS, "key string, start long").mapInArrow(
            kill_in_staging, "key string, start long")
    op = DstlStatefulOperator(name="counts", processor=Processor, key_column="key",
                              output_schema="key string, count bigint",
                              state_uri=os.environ.get("DSTL_TEST_STATE_URI",
                                                       os.path.join(work, "state")),
                              storage_options=json.loads(options) if options else None,
                              table=os.environ.get("DSTL_TEST_TABLE", "lmdb"),
                              partitions=partitions,
                              local_dir=os.path.join(work, f"local-{os.getpid()}"),
                              materialization_interval_s=0, initial_state=initial)
    src = (spark.readStream.schema("key string").option("maxFilesPerTrigger", 1)
           .json(os.path.join(work, "in")))
    from in_query_driver import kill_when_done

    out = src.transform(op).mapInArrow(kill_when_done, "key string, count bigint")
    if kill_at == "manifest":
        spark.streams.addListener(Killer())
    q = (out.writeStream.format("parquet").option("path", os.path.join(work, "out"))
         .option("checkpointLocation", os.path.join(work, "cp"))
         .trigger(availableNow=True).start())
    q.awaitTermination()
    last = q.lastProgress
    if last is not None:
        assert op.wait_for_checkpoint(int(last["batchId"])), "checkpoint not written"
    op.close()
    spark.stop()


if __name__ == "__main__":
    main()
