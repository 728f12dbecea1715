"""dstl.spark.daemon under real Spark: ``spark.python.daemon.module=dstl.spark.daemon`` forks
Python workers that start with DSTL imported, and the operator's counts stay exact with it
(LMDB and heap, agent on and off, a restart from the store, the warm-up), in ``local[2]`` and
(``DSTL_DEEP=1``) in a ``local-cluster`` of two executor JVMs; a preload that cannot be imported, or an executor
Python that cannot import the daemon itself, fails the task with the module named."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from spark_support import new_session
from support import moto_server
from support.moto_server import s3_storage_options
from support.spark_cluster import drop_gateway, kill, new_cluster_session, processes_under

from dstl.spark import DstlStatefulOperator, StatefulProcessor

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark-daemon")]
moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket

DAEMON_CONF = {"spark.python.daemon.module": "dstl.spark.daemon"}


class RecordingCount(StatefulProcessor):
    """Counts rows per key, and writes one line per worker process into ``out`` (a class
    attribute set per test): its pid, its parent's command line and what its daemon preloaded."""

    out = ""

    def init(self, handle: Any) -> None:
        self.count = handle.get_value_state("count")
        import gc

        import pyspark

        from dstl.spark import daemon

        with open(os.path.join(self.out, f"{os.getpid()}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "preloaded": daemon.PRELOADED,
                       "pyspark": pyspark.__file__, "frozen": gc.get_freeze_count(),
                       "daemon_pid": os.getppid(), "parent": _cmdline(os.getppid())}, f)

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        c = (self.count.get() or 0) + sum(1 for _ in rows)
        self.count.update(c)
        yield {"key": key, "count": c}


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


@pytest.fixture(scope="module")
def daemon_spark() -> Iterator[Any]:
    """A local[2] session whose executor runs dstl.spark.daemon (a static conf: a new
    SparkContext)."""
    from pyspark import SparkContext

    active = SparkContext._active_spark_context
    if active is not None:
        active.stop()
    spark = new_session("dstl-daemon", conf=DAEMON_CONF)
    assert spark.sparkContext.getConf().get("spark.python.daemon.module") == "dstl.spark.daemon"
    yield spark
    if SparkContext._active_spark_context is spark.sparkContext:  # the cluster test stops it
        spark.stop()


def _op(tmp: Path, uri: str, opts: dict[str, Any], table: str, agent: bool,
        latest: dict[str, int]) -> DstlStatefulOperator:
    processor = type("RecordingCountHere", (RecordingCount,), {"out": str(tmp / "workers")})
    return DstlStatefulOperator(
        name="count", processor=processor, key_column="key",
        output_schema="key string, count long", state_uri=uri, storage_options=opts,
        partitions=3, max_parallelism=32, table=table, agent=agent, local_dir=str(tmp / "local"),
        sink=lambda df, b: latest.update({r["key"]: r["count"] for r in df.collect()}),
        materialization_interval_s=0.0)


def _keys(batch: int) -> list[str]:
    return [f"k{(batch * 5 + i) % 23}" for i in range(40)]


@pytest.mark.s3
@pytest.mark.parametrize(("table", "agent"), [("lmdb", True), ("lmdb", False), ("heap", True),
                                              ("heap", False)])
def test_workers_start_with_dstl_imported_and_counts_stay_exact(
        daemon_spark: Any, moto_endpoint: str, s3_bucket: str, tmp_path: Path, table: str,
        agent: bool) -> None:
    (tmp_path / "workers").mkdir()
    uri, opts = f"s3://{s3_bucket}/app", s3_storage_options(moto_endpoint)
    latest: dict[str, int] = {}
    expected: Counter[str] = Counter()
    op = _op(tmp_path, uri, opts, table, agent, latest)
    for b in range(2):
        op.foreach_batch(daemon_spark.createDataFrame([(k,) for k in _keys(b)], "key string"), b)
        expected.update(_keys(b))
        assert latest == {k: expected[k] for k in set(_keys(b))}
    op.close()
    # a restart from the store: the executor-local tables are gone, a new operator warms up
    shutil.rmtree(tmp_path / "local")
    op = _op(tmp_path, uri, opts, table, agent, latest)
    warm = op.warm_up(daemon_spark)
    assert "error" not in warm, warm
    assert all(p["daemon_preloaded"] for p in warm["partitions"].values()), warm
    op.foreach_batch(daemon_spark.createDataFrame([(k,) for k in _keys(2)], "key string"), 2)
    expected.update(_keys(2))
    assert latest == {k: expected[k] for k in set(_keys(2))}
    assert [t["access"] for t in op.batch_stats[-1]["tasks"]] != []
    op.close()
    records = _records(tmp_path / "workers")
    assert records, "no worker ran the processor"
    for r in records:
        assert "dstl.spark.daemon" in r["parent"], r
        for name in ("dstl.spark.task", "pyarrow", "lmdb", "pyspark.worker"):
            assert name in r["preloaded"], (name, r)
        # the pip-installed pyspark, whose bytecode is cached, not Spark's pyspark.zip
        assert ".zip" not in r["pyspark"], r
        # the daemon's imports frozen for the collector: a worker's collections skip them
        assert r["frozen"] > 10_000, r
    if agent:
        # the agent the tasks used was started ahead by a daemon (a child of the executor JVM;
        # an agent started by a worker is a grandchild, and a forked worker shows the daemon's
        # command line too). Spark may start more than one daemon per executor (one per set of
        # worker environment variables): the later ones find the agent answering.
        agent_pids = {t["agent_pid"] for s in op.batch_stats for t in s["tasks"]}
        assert len(agent_pids) == 1, agent_pids
        starter = _parent_of(agent_pids.pop())
        assert "dstl.spark.daemon" in _cmdline(starter)
        jvms = {_parent_of(r["daemon_pid"]) for r in records}
        assert _parent_of(starter) in jvms, (starter, jvms)


def test_extra_modules_from_the_executor_environment_are_preloaded(daemon_spark: Any) -> None:
    sc = daemon_spark.sparkContext
    # another environment -> Spark starts another daemon for the tasks of this job
    sc.environment["DSTL_DAEMON_PRELOAD"] = "spark_support,colorsys"
    try:
        def task(batches: Any) -> Any:
            import pyarrow as pa

            from dstl.spark import daemon
            for _ in batches:
                pass
            yield pa.RecordBatch.from_pydict({"m": [json.dumps(sorted(daemon.PRELOADED))]})

        rows = daemon_spark.range(2, numPartitions=2).mapInArrow(task, "m string").collect()
    finally:
        del sc.environment["DSTL_DAEMON_PRELOAD"]
    for r in rows:
        mods = json.loads(r["m"])
        assert "spark_support" in mods and "colorsys" in mods and "dstl.spark.task" in mods


def test_a_preload_that_cannot_be_imported_fails_the_task_naming_it_and_the_fix(
        daemon_spark: Any) -> None:
    sc = daemon_spark.sparkContext
    sc.environment["DSTL_DAEMON_PRELOAD"] = "r2_no_such_processors"
    try:
        with pytest.raises(Exception) as e:
            daemon_spark.range(1, numPartitions=1).mapInArrow(lambda it: it, "id long").collect()
    finally:
        del sc.environment["DSTL_DAEMON_PRELOAD"]
    msg = str(e.value)
    assert "dstl.spark.daemon" in msg and "r2_no_such_processors" in msg
    assert "ModuleNotFoundError" in msg and "unset spark.python.daemon.module" in msg


def test_an_executor_python_that_cannot_import_the_daemon_names_the_missing_module(
        daemon_spark: Any, tmp_path: Path) -> None:
    # an executor Python without the project's packages: no site-packages (-S), outside the
    # source tree (no cwd on sys.path that holds dstl)
    exe = tmp_path / "python-without-dstl"
    exe.write_text(f"#!/bin/sh\ncd {tmp_path}\nexec {sys.executable} -S \"$@\"\n")
    exe.chmod(0o755)
    sc = daemon_spark.sparkContext
    old_exec, old_path = sc.pythonExec, sc.environment.get("PYTHONPATH")
    sc.pythonExec = str(exe)
    sc.environment["PYTHONPATH"] = ""
    try:
        with pytest.raises(Exception) as e:
            daemon_spark.range(1, numPartitions=1).mapInArrow(lambda it: it, "id long").collect()
    finally:
        sc.pythonExec = old_exec
        if old_path is None:
            sc.environment.pop("PYTHONPATH", None)
        else:
            sc.environment["PYTHONPATH"] = old_path
    msg = str(e.value)
    assert "dstl.spark.daemon" in msg and "No module named" in msg, msg[:3000]


@pytest.mark.s3
@pytest.mark.skipif(os.environ.get("DSTL_DEEP") != "1",
                    reason="DSTL_DEEP=1: a local-cluster of its own (1.5-3 min); CI runs the "
                           "daemon in local[2], and the cluster tests without it")
def test_local_cluster_executors_run_the_daemon_and_counts_stay_exact(
        daemon_spark: Any, moto_endpoint: str, s3_bucket: str, tmp_path: Path) -> None:
    daemon_spark.stop()  # the module's last test: a cluster needs its own driver JVM
    drop_gateway()
    root = tmp_path / "cluster"
    spark = new_cluster_session("dstl-daemon-cluster", root, conf=DAEMON_CONF)
    try:
        (tmp_path / "workers").mkdir()
        latest: dict[str, int] = {}
        op = _op(tmp_path, f"s3://{s3_bucket}/app", s3_storage_options(moto_endpoint), "lmdb",
                 True, latest)
        expected: Counter[str] = Counter()
        for b in range(2):
            op.foreach_batch(spark.createDataFrame([(k,) for k in _keys(b)], "key string"), b)
            expected.update(_keys(b))
            assert latest == {k: expected[k] for k in set(_keys(b))}
        op.close()
        records = _records(tmp_path / "workers")
        assert records
        for r in records:
            assert "dstl.spark.daemon" in r["parent"] and "dstl.spark.task" in r["preloaded"], r
    finally:
        spark.stop()
        drop_gateway()
        kill(processes_under([root]))
