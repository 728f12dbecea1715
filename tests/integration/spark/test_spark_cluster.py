"""The operator on a real multi-executor cluster: two executor JVMs on one machine, S3 on moto.

Every other Spark test runs in one JVM (``local[2]``), where "one agent per executor", "a
partition moves to another executor" and "an executor dies" cannot happen. Here they do, against
an exact model of the counts (a Counter of every key sent):

- two executors, two Python daemons, two DSTL executor agents (one per executor, each watching
  its own executor JVM, in that executor's own local directory), both serving tasks; what each
  batch writes to the store is exactly what the operator reports (objects per batch);
- partitions move between executors from batch to batch (``spark.locality.wait=0``, 4
  partitions on 2 single-core executors), and one is made to move (its executor slowed down):
  a moved partition is restored through its new executor's agent cache; with a ``local_dir``
  shared by both executors it is adopted instead;
- an executor JVM SIGKILLed in the middle of a batch: Spark re-runs its tasks, the standalone
  worker starts a replacement executor, the dead executor's agent exits;
- an executor agent SIGKILLed during a batch and between batches: the tasks fail or the next
  task notices, a new agent starts, state is restored;
- a clean stop of a streaming query and of the session leaves no process behind (driver JVM,
  executor JVMs, Python daemons and workers, agents), found by scanning every process that runs
  under the cluster's directories.

*Why ``local-cluster`` and not a standalone master and two worker processes.* Both give each
executor its own JVM process, daemon, workers and block-manager directory, and both replace a
killed executor through a standalone worker; the separate master and worker processes would only
add three JVMs (about 15 s more on 2 cores) and a machine-level failure DSTL does not see
differently from an executor's. How the cluster is set up from a pip-installed pyspark:
:mod:`support.spark_cluster`.

One cluster serves the whole module (starting it and the executors' Python workers costs
20-60 s); the last test stops it and checks that nothing is left.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from support import moto_server
from support.moto_server import (
    boto3_client,
    create_bucket,
    delete_bucket,
    s3_storage_options,
    unique_bucket_name,
)
from support.processors import Count
from support.spark_cluster import (
    Proc,
    drop_gateway,
    kill,
    new_cluster_session,
    processes_under,
    wait_gone,
)

from dstl.spark import DstlStatefulOperator

pytestmark = [pytest.mark.spark, pytest.mark.s3, pytest.mark.xdist_group("spark-cluster")]
moto_endpoint = moto_server.moto_endpoint

#: partitions of every operator here: more than the cluster's 2 cores, so they move
PARTITIONS = 4


@dataclass
class Cluster:
    """The module's cluster and every process seen running under its directory."""

    spark: Any
    root: Path
    seen: dict[int, Proc] = field(default_factory=dict)

    def processes(self) -> list[Proc]:
        procs = processes_under([self.root])
        self.seen.update({p.pid: p for p in procs})
        return procs

    def executors(self) -> list[Proc]:
        return [p for p in self.processes() if p.kind == "executor"]

    def agents(self) -> list[Proc]:
        return [p for p in self.processes() if p.kind == "agent"]

    def wait_executors(self, n: int = 2, timeout_s: float = 180.0) -> list[Proc]:
        """Wait until ``n`` executors are registered with the driver and running."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ids = self.spark.sparkContext._jsc.sc().getExecutorIds()
            procs = self.executors()
            if ids.size() == n and len(procs) == n:
                return procs
            time.sleep(0.5)  # executors register asynchronously; nothing to wait on
        raise AssertionError(f"{n} executors did not register within {timeout_s}s")


@pytest.fixture(scope="module")
def module_bucket(moto_endpoint: str) -> Iterator[str]:
    """One bucket for the module, removed after the cluster stopped: the agents keep
    materializing a closed operator's partitions for a while (they drop a partition not
    registered again within a minute), so a test's own bucket could not be emptied at its end."""
    name = create_bucket(moto_endpoint, unique_bucket_name())
    yield name
    delete_bucket(moto_endpoint, name)


@pytest.fixture
def s3_bucket(module_bucket: str, cluster: Cluster) -> str:
    """The module's bucket (each test's store has its own prefix: the operator's name)."""
    return module_bucket


@pytest.fixture(scope="module")
def cluster(module_bucket: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    c = Cluster(new_cluster_session("dstl-cluster", root), root)
    try:
        c.wait_executors()
        yield c
    finally:
        from pyspark import SparkContext

        try:
            if SparkContext._active_spark_context is not None:  # the last test stopped it
                c.spark.stop()
            drop_gateway()
        finally:
            kill(processes_under([root]))  # a failed test must not leave a cluster running


def _op(name: str, latest: dict[str, int], uri: str, opts: dict[str, Any],
        processor: type = Count, **kw: Any) -> DstlStatefulOperator:
    return DstlStatefulOperator(
        name=name, processor=processor, key_column="key", output_schema="key string, count long",
        state_uri=uri, storage_options=opts, partitions=PARTITIONS, max_parallelism=32,
        sink=lambda df, b: latest.update({r["key"]: r["count"] for r in df.collect()}),
        materialization_interval_s=kw.pop("mat_s", 10_000.0), **kw)


def _keys(batch: int, n: int = 120) -> list[str]:
    return [f"k{(batch * 7 + i) % 37}" for i in range(n)]


class Model:
    """The exact expected counts, and one batch run against them."""

    def __init__(self, spark: Any, op: DstlStatefulOperator, latest: dict[str, int]) -> None:
        self.spark, self.op, self.latest = spark, op, latest
        self.expected: Counter[str] = Counter()
        self.batch = 0

    def run(self) -> dict[str, Any]:
        keys = _keys(self.batch)
        self.op.foreach_batch(self.spark.createDataFrame([(k,) for k in keys], "key string"),
                              self.batch)
        self.expected.update(keys)
        assert self.latest == dict(self.expected), f"counts after batch {self.batch}"
        self.batch += 1
        stats: dict[str, Any] = self.op.batch_stats[-1]
        print(f"{self.op.name} batch {stats['batch_id']}: {stats['batch_seconds']:.1f} s, "
              f"{stats['objects_written']} objects, {stats['segments']} segments, "
              f"{[(t['partition'], t['access'], t['agent_pid']) for t in stats['tasks']]}")
        return stats


def _argv(proc: Proc) -> list[str]:
    return [a for a in proc.cmdline.split(" ") if a]


def _agent_args(proc: Proc) -> tuple[str, int]:
    """An agent's directory and the executor pid it watches (from its command line)."""
    argv = _argv(proc)
    return argv[argv.index("--dir") + 1], int(argv[argv.index("--watch-pid") + 1])


def _prefix(name: str) -> str:
    """A test's own store prefix in the module's bucket."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _bucket_keys(endpoint: str, bucket: str, prefix: str) -> set[str]:
    pages = boto3_client(endpoint).get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{prefix}/")
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


def test_two_executor_agents_serve_tasks_and_objects_per_batch(
        cluster: Cluster, moto_endpoint: str, s3_bucket: str) -> None:
    latest: dict[str, int] = {}
    prefix = _prefix("two-agents")
    # no timer (a partition's first materialization is due at a random time within the
    # interval: even 10,000 s is sometimes within the test), size trigger far away (8 MiB)
    op = _op("two-agents", latest, f"s3://{s3_bucket}/{prefix}",
             s3_storage_options(moto_endpoint), mat_s=None)
    model = Model(cluster.spark, op, latest)
    try:
        per_batch = []
        for _ in range(4):
            before = _bucket_keys(moto_endpoint, s3_bucket, prefix)
            stats = model.run()
            new = _bucket_keys(moto_endpoint, s3_bucket, prefix) - before
            # what the operator reports is what the store got: one segment per agent flush
            # window, one manifest (no materialization)
            assert stats["materializations"] == 0
            assert len(new) == stats["objects_written"] == stats["segments"] + 1, (new, stats)
            agents_here = {t["agent_pid"] for t in stats["tasks"]}
            # each agent writes its own segments: at least one per agent that served a task,
            # at most one per task (one core per executor: tasks of an executor run one by one)
            assert len(agents_here) <= stats["segments"] <= PARTITIONS, stats
            per_batch.append((stats["segments"], stats["objects_written"], agents_here))
        served = set().union(*(a for _, _, a in per_batch))
        agents = {p.pid: p for p in cluster.agents()}
        executors = {p.pid for p in cluster.executors()}
        assert len(served) == 2 and served <= set(agents), (served, agents)
        # one agent per executor: each watches a different executor JVM and lives in that
        # executor's own block-manager directory
        args = [_agent_args(agents[pid]) for pid in served]
        assert {watch for _, watch in args} == executors, (args, executors)
        # and a task's agent is its own executor's: the worker that ran it is a child of that
        # executor's Python daemon (worker -> daemon -> executor JVM)
        for t in op.batch_stats[-1]["tasks"]:
            daemon = _parent(t["pid"])
            assert _parent(daemon) == _agent_args(agents[t["agent_pid"]])[1], t
        dirs = [Path(d) for d, _ in args]
        assert len({d.parent for d in dirs}) == 2
        assert all(d.parent.name.startswith("blockmgr-") and d.is_relative_to(cluster.root)
                   for d in dirs), dirs
        print("objects per batch (segments, objects):", [(s, o) for s, o, _ in per_batch])
    finally:
        op.close()


def _moves(batch_stats: list[dict[str, Any]]) -> list[tuple[int, int, int, str]]:
    """(batch, partition, agent, access) of every task whose partition another agent served in
    the previous batch."""
    out = []
    for prev, cur in pairwise(batch_stats):
        was = {t["partition"]: t["agent_pid"] for t in prev["tasks"]}
        out += [(cur["batch_id"], t["partition"], t["agent_pid"], t["access"])
                for t in cur["tasks"] if was.get(t["partition"]) not in (None, t["agent_pid"])]
    return out


class SlowOnExecutor(Count):
    """While ``slow`` names this task's executor JVM, each task sleeps 3 s before its rows: that
    executor finishes only its first task of the batch while the other runs the rest."""

    slow = ""
    slept: set[tuple[int, int, int]] = set()  # per worker process: the tasks that slept

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        from pyspark import TaskContext

        from dstl.spark.agent import executor_pid

        ctx = TaskContext.get()
        task = (ctx.stageId(), ctx.partitionId(), ctx.attemptNumber()) if ctx else (0, 0, 0)
        if task not in self.slept and os.path.exists(self.slow) \
                and Path(self.slow).read_text() == str(executor_pid()):
            self.slept.add(task)
            time.sleep(3)
        yield from super().handle_input_rows(key, rows)


@pytest.mark.parametrize("shared_local_dir", [False, True], ids=["executor-dirs", "shared-dir"])
def test_partitions_move_between_executors(cluster: Cluster, moto_endpoint: str,
                                           s3_bucket: str, tmp_path: Path,
                                           shared_local_dir: bool) -> None:
    """Partitions move by themselves (4 partitions in 4 tasks, ``tasks=PARTITIONS``, on 2
    single-core executors, no locality wait: a task runs where a core frees first), and in
    batches 2 and 4 partition 2 is made to move: its previous executor is slowed down, so it
    runs only its first-wave task (partition 0 or 1; Spark launches tasks in partition order)
    while the other executor runs 2 and 3."""
    slow = tmp_path / "slow-executor"
    latest: dict[str, int] = {}
    kw: dict[str, Any] = {"tasks": PARTITIONS}
    if shared_local_dir:
        kw["local_dir"] = str(tmp_path / "shared")
    op = _op("moves", latest, f"s3://{s3_bucket}/{_prefix('moves')}",
             s3_storage_options(moto_endpoint),
             processor=type("Slow", (SlowOnExecutor,), {"slow": str(slow)}), mat_s=1.0, **kw)
    model = Model(cluster.spark, op, latest)
    try:
        fetched: list[dict[int, float]] = []  # per batch, per agent: its cache's reads so far
        forced = []
        for b in range(5):
            slow.unlink(missing_ok=True)
            if b in (2, 4):
                was = _agent_of(op.batch_stats[-1], 2)
                slow.write_text(str(_agent_args(_proc(cluster.agents(), was))[1]))
            stats = model.run()
            if b in (2, 4):
                forced.append((b, 2, _agent_of(stats, 2)))
                assert forced[-1][2] != was, "partition 2 did not move off the slowed executor"
            fetched.append({pid: m["agent.cache.downloads"] + m["agent.cache.hits"]
                            for pid, m in stats["agents"].items()})
        moves = _moves(op.batch_stats)
        assert {(b, p, a) for b, p, a, _ in moves} >= set(forced), (moves, forced)
        accesses = {a for _, _, _, a in moves}
        if shared_local_dir:
            # the other executor finds the table at the base checkpoint on the shared disk
            assert accesses == {"adopt"}, moves
        else:
            # a moved partition is never a hit: its new executor restores it from the store,
            # through that executor's agent cache
            assert accesses == {"restore"}, moves
            for batch, agent in {(b, a) for b, _, a, _ in moves}:
                was = max((f[agent] for f in fetched[:batch] if agent in f), default=0.0)
                assert fetched[batch][agent] > was, (batch, agent, fetched)
        assert sum(s["materializations"] for s in op.batch_stats) > 0
    finally:
        op.close()


def test_partitions_move_without_the_agent(cluster: Cluster, moto_endpoint: str,
                                           s3_bucket: str, tmp_path: Path) -> None:
    """``agent=False``: each task writes its own segment and restores through its worker's own
    cache; partition 2 (one task per partition) is made to move in batch 2 (as above) and
    restores on its new executor.
    Without agents, the executor of a task is found from its worker (worker -> daemon ->
    executor JVM)."""
    slow = tmp_path / "slow-executor"
    latest: dict[str, int] = {}
    op = _op("moves-no-agent", latest, f"s3://{s3_bucket}/{_prefix('moves-no-agent')}",
             s3_storage_options(moto_endpoint), agent=False, tasks=PARTITIONS,
             processor=type("Slow", (SlowOnExecutor,), {"slow": str(slow)}), mat_s=1.0)
    model = Model(cluster.spark, op, latest)
    try:
        executors: list[dict[int, int]] = []  # per batch: partition -> executor JVM pid
        for b in range(4):
            slow.unlink(missing_ok=True)
            if b == 2:
                slow.write_text(str(executors[-1][2]))
            stats = model.run()
            executors.append({t["partition"]: _parent(_parent(t["pid"]))
                              for t in stats["tasks"]})
            assert {t["agent_pid"] for t in stats["tasks"]} == {0} and not stats["agents"]
            # at most one segment per task, and every task (each partition gets keys in every
            # batch) writes one or materializes its partition in the checkpoint (due every 1 s
            # here), which then needs no log segment for its changes: 0 segments is possible
            assert stats["segments"] <= PARTITIONS, stats
            assert stats["segments"] + stats["materializations"] >= PARTITIONS, stats
        assert set(executors[0].values()) <= {p.pid for p in cluster.executors()}
        assert executors[2][2] != executors[1][2], executors
        for b in range(1, len(executors)):
            for t in op.batch_stats[b]["tasks"]:
                if executors[b][t["partition"]] != executors[b - 1][t["partition"]]:
                    assert t["access"] == "restore", (b, t)
    finally:
        op.close()


def _agent_of(stats: dict[str, Any], partition: int) -> int:
    """The pid of the agent that served ``partition`` in a batch."""
    return int(next(t["agent_pid"] for t in stats["tasks"] if t["partition"] == partition))


def _proc(procs: list[Proc], pid: int) -> Proc:
    found = [p for p in procs if p.pid == pid]
    assert found, f"process {pid} is not running"
    return found[0]


class KillExecutorOnce(Count):
    """When ``<flag>.armed`` exists (and ``flag`` does not), the first attempt of partition 0
    writes its executor JVM's pid to ``flag`` and SIGKILLs it, mid-batch."""

    flag = ""

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        from pyspark import TaskContext

        from dstl.spark.agent import executor_pid

        ctx = TaskContext.get()
        if ctx is not None and ctx.partitionId() == 0 and ctx.attemptNumber() == 0 \
                and os.path.exists(self.flag + ".armed") and not os.path.exists(self.flag):
            pid = executor_pid()
            assert pid is not None
            Path(self.flag).write_text(str(pid))
            os.kill(pid, signal.SIGKILL)  # this worker goes on until it notices: a zombie
        yield from super().handle_input_rows(key, rows)


def test_executor_killed_mid_batch(cluster: Cluster, moto_endpoint: str, s3_bucket: str,
                                   tmp_path: Path) -> None:
    flag = tmp_path / "killed"
    killer = type("KillExecutorHere", (KillExecutorOnce,), {"flag": str(flag)})
    latest: dict[str, int] = {}
    op = _op("executor-kill", latest, f"s3://{s3_bucket}/{_prefix('executor-kill')}",
             s3_storage_options(moto_endpoint),
             processor=killer, mat_s=1.0)
    model = Model(cluster.spark, op, latest)
    try:
        model.run()
        before = {p.pid: p for p in cluster.executors()}
        agents_before = {p.pid: p for p in cluster.agents()}
        Path(str(flag) + ".armed").touch()
        stats = model.run()  # the executor dies in it; Spark re-runs its tasks: counts exact
        killed = int(flag.read_text())
        assert killed in before
        assert not wait_gone([before[killed]]), "the killed executor still runs"
        orphans = [a for a in agents_before.values() if f"--watch-pid {killed} " in
                   a.cmdline + " "]
        assert len(orphans) == 1 and not wait_gone(orphans), \
            "the dead executor's agent did not exit"
        assert stats["restores"] >= 1
        # the standalone worker starts a replacement executor; the next batches use both
        now = cluster.wait_executors()
        assert killed not in {p.pid for p in now}
        for _ in range(2):
            stats = model.run()
        watched = {_agent_args(a)[1] for a in cluster.agents() if a.pid in stats["agents"]}
        assert watched <= {p.pid for p in now}, (watched, now)
    finally:
        op.close()


class KillAgentOnce(Count):
    """When ``<flag>.armed`` exists (and ``flag`` does not), the first attempt of partition 1
    SIGKILLs its executor's agent while the task runs."""

    flag = ""
    operator = ""

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        from pyspark import TaskContext

        from dstl.spark.runtime import runtimes

        ctx = TaskContext.get()
        if ctx is not None and ctx.partitionId() == 1 and ctx.attemptNumber() == 0 \
                and os.path.exists(self.flag + ".armed") and not os.path.exists(self.flag):
            for rt in runtimes():  # this worker may also hold runtimes of earlier operators
                if rt.agent is not None and rt.cfg.name == self.operator:
                    pid = int(rt.agent.metrics()["agent.pid"])
                    Path(self.flag).write_text(str(pid))
                    os.kill(pid, signal.SIGKILL)
        yield from super().handle_input_rows(key, rows)


@pytest.mark.parametrize("table", ["lmdb", "heap"])
def test_agent_killed_during_and_between_batches(cluster: Cluster, moto_endpoint: str,
                                                 s3_bucket: str, tmp_path: Path,
                                                 table: str) -> None:
    flag = tmp_path / "killed"
    killer = type("KillAgentHere", (KillAgentOnce,),
                  {"flag": str(flag), "operator": f"agent-kill-{table}"})
    latest: dict[str, int] = {}
    op = _op(f"agent-kill-{table}", latest, f"s3://{s3_bucket}/{_prefix('agent-kill')}",
             s3_storage_options(moto_endpoint), processor=killer, table=table, mat_s=1.0)
    model = Model(cluster.spark, op, latest)
    try:
        model.run()
        Path(str(flag) + ".armed").touch()
        during = model.run()  # the task fails, Spark retries it, a new agent starts
        killed = int(flag.read_text())
        assert killed not in during["agents"]
        # between batches: SIGKILL every agent; the next tasks notice and start new ones
        victims = [a for a in cluster.agents() if a.pid in during["agents"]]
        assert victims
        for a in victims:
            os.kill(a.pid, signal.SIGKILL)
        assert not wait_gone(victims)
        after = model.run()
        assert not set(after["agents"]) & ({killed} | {a.pid for a in victims})
        # every worker's runtime was reset with its agent: no task reuses its in-process backend
        # (LMDB tables are adopted from disk or restored, heap tables restored)
        accesses = {t["access"] for t in after["tasks"]}
        assert "hit" not in accesses, after["tasks"]
        if table == "heap":
            assert accesses == {"restore"}, after["tasks"]
    finally:
        op.close()


def test_clean_stop_leaves_no_process_behind(cluster: Cluster, moto_endpoint: str,
                                             s3_bucket: str, tmp_path: Path) -> None:
    """Last in the module: it stops the cluster."""
    src = tmp_path / "src"
    src.mkdir()
    expected: Counter[str] = Counter()
    for i in range(3):
        keys = _keys(i, 60)
        expected.update(keys)
        (src / f"part-{i:03d}.json").write_text("".join(json.dumps({"key": k}) + "\n"
                                                        for k in keys))
    latest: dict[str, int] = {}
    op = _op("clean-stop", latest, f"s3://{s3_bucket}/{_prefix('clean-stop')}",
             s3_storage_options(moto_endpoint),
             mat_s=1.0)
    spark = cluster.spark
    q = (spark.readStream.schema("key string").option("maxFilesPerTrigger", 1).json(str(src))
         .writeStream.foreachBatch(op.foreach_batch)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(processingTime="1 second")
         .start())
    try:
        deadline = time.monotonic() + 300
        while len(op.batch_stats) < 3 and q.exception() is None and time.monotonic() < deadline:
            time.sleep(0.5)  # the query runs on its own thread; poll its progress
        assert q.exception() is None
        assert latest == dict(expected)
        running = cluster.processes()
        assert {p.kind for p in running} >= {"executor", "agent", "python"}, running
    finally:
        q.stop()
        op.close()
    spark.stop()
    drop_gateway()
    left = wait_gone(cluster.seen.values())
    assert not left, f"still running after the stop: {left}"
    assert not processes_under([cluster.root]), "a process of the cluster is still running"
