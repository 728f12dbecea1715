"""The operator on a Spark standalone cluster as users run one: ``spark-class`` master and two
workers, separate processes on two loopback hosts (127.0.0.1 and 127.0.0.2, 1 core and 1 GiB
each), started from the installed pyspark by :mod:`support.standalone` (one cluster per module;
nothing of it may outlive the module).

- **The demo job** (``python -m dstl demo --master spark://...``, with ``DSTL_DEEP=1``) with its
  state on HDFS (the MiniDFSCluster) and on S3 (moto): two applications in turn (the second a
  new driver restoring from the store), each with an executor on both workers, results exact
  against the demo's own independent computation.
- **A worker's machine lost mid-batch**: the demo's processor inside the query
  (``op.transform`` -> Parquet file sink), one state task holding in batch 1 while its worker
  JVM, executor, Python workers and DSTL agent are SIGKILLed at once; Spark re-runs the batch's
  lost work on the other host, the worker is started again; the sink's rows and the state read
  back from the store equal a model computed here from the events (state on HDFS; with
  ``DSTL_DEEP=1`` also on S3).
- **A speculative copy** (``spark.speculation=true``): the first attempt of one state task of
  batch 1 is slowed, Spark launches a copy on the other host, the copy wins and the slow one is
  killed; the processor records every attempt in a side directory, so the test sees that both
  attempts ran at once on two hosts; output and state equal the model (state on S3).

The in-process tests share one application (its executors start once); the demo job runs its
own applications, before that one starts (a standalone application takes every free core).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import moto_server
from support.minidfs import hdfs_uri
from support.spark_cluster import drop_gateway
from support.standalone import StandaloneCluster, standalone_cluster  # noqa: F401

from dstl.reader import CheckpointCatalog, open_read_only, read_state
from dstl.spark import DstlStatefulOperator
from dstl.spark.demo import ClickStats, click_events

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.xdist_group("standalone")]

DEEP = os.environ.get("DSTL_DEEP") == "1"
ROOT = Path(__file__).resolve().parents[3]
moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket
#: the batch in which the worker is killed and the state task is slowed
BATCH = 1
OUTPUT_SCHEMA = "user string, clicks long, distinct_pages long, last_page string"
#: how long the held attempt sleeps at most (a copy is due within seconds; a slow machine's
#: other task sets the median it is compared with)
HOLD_S = 300.0
#: speculation within seconds: a copy once a task runs 3 s and 1.5x the median of the done ones
SPECULATION = {"spark.speculation": "true", "spark.speculation.multiplier": "1.5",
               "spark.speculation.quantile": "0.5", "spark.speculation.minTaskRuntime": "3s",
               "spark.speculation.interval": "200ms",
               "spark.speculation.efficiency.enabled": "false"}


def _store(request: pytest.FixtureRequest, kind: str, name: str) -> tuple[str, dict[str, Any]]:
    if kind == "hdfs":
        return hdfs_uri(request.getfixturevalue("hdfs_cluster"), name), {}
    endpoint = request.getfixturevalue("moto_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/{name}", moto_server.s3_storage_options(endpoint)


# --------------------------------------------------------------------------- the demo job


@pytest.mark.timeout(1200)
@pytest.mark.skipif(not DEEP, reason="the demo job's two applications run with DSTL_DEEP=1")
@pytest.mark.parametrize("kind", [pytest.param("hdfs", marks=pytest.mark.hdfs),
                                  pytest.param("s3", marks=pytest.mark.s3)])
def test_the_demo_job_on_the_standalone_cluster(standalone_cluster: StandaloneCluster,  # noqa: F811
                                                request: pytest.FixtureRequest, tmp_path: Path,
                                                kind: str) -> None:
    """``python -m dstl demo --master spark://...`` as docs/deploy.md runs it: both of its
    applications (the second restores from the store) get an executor on each worker."""
    uri, options = _store(request, kind, "demo")
    before = {i: _apps(standalone_cluster, i) for i in range(2)}
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    cmd = [sys.executable, "-m", "dstl", "demo", "--master", standalone_cluster.master_url,
           "--state-uri", uri, "--work-dir", str(tmp_path), "--files", "4",
           "--restart-after", "2", "--events", "300", "--users", "60"]
    if options:
        cmd += ["--storage-options", json.dumps(options)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "check against an independent computation: OK" in done.stdout, done.stdout[-3000:]
    for i in range(2):  # each application had an executor on each worker
        assert len(_apps(standalone_cluster, i) - before[i]) == 2, \
            (i, sorted(_apps(standalone_cluster, i)))


def _apps(cluster: StandaloneCluster, index: int) -> set[str]:
    """The applications worker ``index`` ran an executor of (its work directory)."""
    return {p.name for p in cluster.workers[index].directory.glob("app-*")}


# --------------------------------------------------------------------------- in one driver


@pytest.fixture(scope="module")
def cluster_spark(standalone_cluster: StandaloneCluster) -> Iterator[Any]:  # noqa: F811
    """One application on the module's cluster for the in-process tests, with speculation on;
    stopped (and its driver JVM ended) before the cluster is."""
    spark = standalone_cluster.session("dstl-standalone-tests", SPECULATION)
    try:
        standalone_cluster.wait_for_executors(spark, 2)
        yield spark
    finally:
        try:
            spark.stop()
        finally:
            drop_gateway()  # also when the stop failed: the cluster's stop must not find it


class HeldClickStats(ClickStats):
    """The demo's processor. Every call records its attempt in ``<side>/`` (batch, partition,
    attempt, host, pid; one file each); in batch ``BATCH``, the first attempt of task 0 writes
    its pid into ``<side>/held`` (once) and sleeps (up to ``hold_s``) before it counts: long
    enough for the test to kill its machine, or for Spark to launch a speculative copy and
    kill it."""

    side = ""
    hold_s = 0.0

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]],
                          timer_values: Any = None) -> Iterator[dict[str, Any]]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        assert ctx is not None
        batch = ctx.getLocalProperty("streaming.sql.batchId")
        mark = (f"b{batch}-p{ctx.partitionId()}-a{ctx.attemptNumber()}-"
                f"{os.environ.get('SPARK_LOCAL_IP', '?')}-{os.getpid()}")
        side = Path(self.side)
        if not (side / f"start-{mark}").exists():
            (side / f"start-{mark}").write_text(str(time.time()))
        if batch == str(BATCH) and ctx.partitionId() == 0 and ctx.attemptNumber() == 0:
            try:  # once per test: a stage Spark submits again numbers its attempts from 0
                with open(side / "held", "x") as f:
                    f.write(str(os.getpid()))
            except FileExistsError:
                pass
            else:
                time.sleep(self.hold_s)  # ended by the test's SIGKILL or Spark's task kill
                (side / "held-done").write_text(mark)
        yield from super().handle_input_rows(key, rows, timer_values)


def _held_class(side: Path, hold_s: float) -> type:
    return type("HeldClickStats", (HeldClickStats,), {"side": str(side), "hold_s": hold_s,
                                                      "__module__": __name__})


def _write_files(src: Path, files: list[list[dict[str, Any]]], lo: int, hi: int) -> None:
    src.mkdir(parents=True, exist_ok=True)
    for i in range(lo, hi):
        tmp = src.parent / f".f{i:03d}.tmp"
        tmp.write_text("".join(json.dumps(e) + "\n" for e in files[i]))
        os.utime(tmp, (1_700_000_000 + i, 1_700_000_000 + i))  # file i is batch i
        tmp.rename(src / f"f{i:03d}.json")


def _model(files: list[list[dict[str, Any]]]) -> tuple[Counter[tuple[Any, ...]],
                                                       dict[str, Any]]:
    """What the demo's processor emits (one row per user per batch: clicks so far, distinct
    pages so far, the last page) and its final state per user, from the events alone."""
    clicks: Counter[str] = Counter()
    pages: dict[str, Counter[str]] = defaultdict(Counter)
    last: dict[str, str] = {}
    rows: Counter[tuple[Any, ...]] = Counter()
    for batch in files:
        users = []
        for e in batch:
            clicks[e["user"]] += 1
            pages[e["user"]][e["page"]] += 1
            last[e["user"]] = e["page"]
            users.append(e["user"])
        for u in set(users):
            rows[(u, clicks[u], len(pages[u]), last[u])] += 1
    state = {u: (clicks[u], dict(pages[u]), last[u]) for u in clicks}
    return rows, state


def _state(uri: str, options: dict[str, Any]) -> dict[str, Any]:
    """The newest checkpoint's state per user, read from the store without Spark."""
    store = open_read_only(uri, options or None)
    try:
        got: dict[str, dict[str, Any]] = defaultdict(dict)
        for r in read_state(CheckpointCatalog(store, "clicks")):
            if r.state == "pages":
                got[r.key].setdefault("pages", {})[r.user_key] = r.value
            else:
                got[r.key][r.state] = r.value
    finally:
        store.close()
    return {u: (v.get("clicks"), v.get("pages"), v.get("last_page")) for u, v in got.items()}


def _run_query(spark: Any, op: DstlStatefulOperator, work: Path) -> list[str]:
    """The files through ``op.transform`` into a Parquet sink until none is left; a failed
    query is started again on its checkpoint (at most twice). Returns the failures."""
    from pyspark.errors import StreamingQueryException

    failures: list[str] = []
    for _ in range(3):
        src = (spark.readStream.schema("user string, page string, ts long")
               .option("maxFilesPerTrigger", 1).json(str(work / "in")))
        q = (op.transform(src).writeStream.format("parquet").option("path", str(work / "out"))
             .option("checkpointLocation", str(work / "cp")).trigger(availableNow=True).start())
        try:
            q.awaitTermination()
        except StreamingQueryException as exc:
            failures.append(str(exc).splitlines()[0][:300])
            continue
        assert op.wait_for_checkpoint(int(q.lastProgress["batchId"]))
        return failures
    raise AssertionError(f"the query failed three times: {failures}")


def _attempts(side: Path) -> list[dict[str, Any]]:
    out = []
    for p in side.glob("start-*"):
        b, part, a, host, pid = p.name[len("start-"):].split("-")
        out.append({"batch": int(b[1:]), "partition": int(part[1:]), "attempt": int(a[1:]),
                    "host": host, "pid": int(pid), "t": float(p.read_text())})
    return out


def _sink_rows(spark: Any, out: Path) -> Counter[tuple[Any, ...]]:
    return Counter(tuple(r) for r in spark.read.parquet(str(out))
                   .select("user", "clicks", "distinct_pages", "last_page").collect())


@pytest.mark.timeout(1800)  # a cluster, an application and executors start first
@pytest.mark.parametrize("kind", [pytest.param("hdfs", marks=pytest.mark.hdfs),
                                  pytest.param("s3", marks=[
                                      pytest.mark.s3, pytest.mark.skipif(
                                          not DEEP, reason="the S3 variant runs with DSTL_DEEP=1")])])
def test_a_worker_machine_lost_mid_batch(standalone_cluster: StandaloneCluster,  # noqa: F811
                                        cluster_spark: Any, request: pytest.FixtureRequest,
                                        tmp_path: Path, kind: str) -> None:
    uri, options = _store(request, kind, "worker-loss")
    files = click_events(3, 200, 40, seed=3)
    side = tmp_path / "side"
    side.mkdir()
    _write_files(tmp_path / "in", files, 0, len(files))
    op = DstlStatefulOperator(name="clicks", processor=_held_class(side, HOLD_S),
                              key_column="user", output_schema=OUTPUT_SCHEMA, state_uri=uri,
                              storage_options=options or None, partitions=4,
                              materialization_interval_s=0)
    victim: list[int] = []

    def kill_the_held_machine() -> None:
        deadline = time.monotonic() + 600
        while not (side / "held").exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # polling the processor's marker file
        time.sleep(0.2)  # its pid is written right after the file is created
        pid = int((side / "held").read_text())
        index = next(i for i in range(2)
                     if pid in {p.pid for p in standalone_cluster.worker_processes(i)})
        killed = standalone_cluster.kill_worker(index)
        assert pid in {p.pid for p in killed}
        victim.append(index)

    import threading

    killer = threading.Thread(target=kill_the_held_machine)
    killer.start()
    try:
        failures = _run_query(cluster_spark, op, tmp_path)
    finally:
        killer.join(600)
        op.close()
        for i in victim:
            standalone_cluster.start_worker(i)
    assert victim, "the held task's machine was not killed"
    assert not (side / "held-done").exists(), "the held attempt outlived its machine"
    rows, state = _model(files)
    assert _sink_rows(cluster_spark, tmp_path / "out") == rows, failures
    assert _state(uri, options) == state
    # batch 1's task 0 ran again after the loss, on the surviving host (Spark resubmits the
    # stage after the lost shuffle output, so the new attempt may be numbered 0 again)
    held_pid = int((side / "held").read_text())
    task = [a for a in _attempts(side) if a["batch"] == BATCH and a["partition"] == 0]
    lost = {a["host"] for a in task if a["pid"] == held_pid}
    assert [a for a in task if a["pid"] != held_pid and a["host"] not in lost], task
    standalone_cluster.wait_for_executors(cluster_spark, 2)  # the restarted worker serves again


@pytest.mark.timeout(1800)  # a cluster, an application and executors start first
@pytest.mark.s3
def test_a_speculative_copy_of_a_state_task(standalone_cluster: StandaloneCluster,  # noqa: F811
                                            cluster_spark: Any, request: pytest.FixtureRequest,
                                            tmp_path: Path) -> None:
    uri, options = _store(request, "s3", "speculation")
    files = click_events(3, 200, 40, seed=5)
    side = tmp_path / "side"
    side.mkdir()
    _write_files(tmp_path / "in", files, 0, len(files))
    standalone_cluster.wait_for_executors(cluster_spark, 2)
    op = DstlStatefulOperator(name="clicks", processor=_held_class(side, HOLD_S),
                              key_column="user", output_schema=OUTPUT_SCHEMA, state_uri=uri,
                              storage_options=options or None, partitions=4, tasks=2,
                              materialization_interval_s=0)
    try:
        failures = _run_query(cluster_spark, op, tmp_path)
    finally:
        op.close()
    attempts = [a for a in _attempts(side) if a["batch"] == BATCH and a["partition"] == 0]
    first = [a for a in attempts if a["attempt"] == 0]
    copies = [a for a in attempts if a["attempt"] > 0]
    assert copies, f"Spark launched no speculative copy: {attempts}"
    assert not (side / "held-done").exists(), "the held attempt finished: no copy won"
    # the copy ran on the other host while the first attempt was still held, and won (on a
    # loaded machine Spark may speculate the first attempt, and kill it, before it reaches the
    # processor: then it left no record)
    if first:
        assert {a["host"] for a in copies} != {a["host"] for a in first}, attempts
        assert min(a["t"] for a in copies) < min(a["t"] for a in first) + HOLD_S, attempts
    assert not failures, failures
    rows, state = _model(files)
    assert _sink_rows(cluster_spark, tmp_path / "out") == rows
    assert _state(uri, options) == state
