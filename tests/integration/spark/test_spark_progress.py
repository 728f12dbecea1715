"""On a real local SparkSession: per-batch progress records (bounded, with a listener
that raises), the bounded ``batch_stats``, the driver's Prometheus endpoint scraped and parsed,
and runtime ``spark.conf.set("spark.dstl.…")`` changes refused instead of ignored — also inside
a real streaming query, whose batches run on a clone of the user's session."""

from __future__ import annotations

import json
import logging
import re
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from spark_support import spark  # noqa: F401
from support.processors import Count

import dstl.spark.batch_base as batch_base_module
import dstl.spark.batch_record as batch_record_module
from dstl.errors import ConfigError, UsageError
from dstl.spark import DstlStatefulOperator, StatefulProcessor

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]


def _op(tmp: Path, table: str, processor: Any = Count, **kw: Any) -> DstlStatefulOperator:
    return DstlStatefulOperator(name="prog", processor=processor, key_column="key",
                                output_schema="key string, count long",
                                state_uri=str(tmp / "store"), partitions=2, max_parallelism=16,
                                table=table, local_dir=str(tmp / "local"),
                                materialization_interval_s=0.0, **kw)


def _scrape(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


@pytest.mark.parametrize("table", ["heap", "lmdb"])
def test_progress_listener_prometheus_and_bounded_stats(
        spark: Any, tmp_path: Path, table: str, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(batch_record_module, "RECENT_PROGRESS", 3)
    op = _op(tmp_path, table, metrics_port=0)
    seen: list[dict[str, Any]] = []

    def broken(progress: dict[str, Any]) -> None:
        raise RuntimeError("monitoring hook bug")

    op.add_listener(broken)
    op.add_listener(seen.append)
    batches = [[f"k{i % (3 + b)}" for i in range(10 + b)] for b in range(5)]
    try:
        with caplog.at_level(logging.INFO, logger="dstl.spark"):
            for batch_id, keys in enumerate(batches):
                op.foreach_batch(spark.createDataFrame([(k,) for k in keys], "key string"),
                                 batch_id)
        assert [p["batchId"] for p in seen] == [0, 1, 2, 3, 4]
        assert [p["numInputRows"] for p in seen] == [len(b) for b in batches]
        assert len(op.batch_stats) == 3 and [s["batch_id"] for s in op.batch_stats] == [2, 3, 4]
        assert [p["batchId"] for p in op.recent_progress] == [2, 3, 4]
        last = op.last_progress
        assert last is not None and last == seen[-1]
        distinct = len(set().union(*map(set, batches)))
        st = last["stateOperators"][0]
        assert st["numRowsUpdated"] == len(set(batches[-1]))
        # Spark's meaning: the state rows (one value state: one per key), on both tables
        assert st["numRowsTotal"] == distinct
        assert st["customMetrics"]["internalRows"] == 0
        if table == "heap":
            assert st["diskBytes"] == 0
            assert st["customMetrics"]["tableRecords"] == distinct
        else:  # LMDB's records include its layout and marker records; it has pages on disk
            assert distinct < st["customMetrics"]["tableRecords"] <= distinct + 16
            assert st["diskBytes"] > 0
        assert st["customMetrics"]["materializations"] >= 1
        assert last["durationMs"]["triggerExecution"] >= last["durationMs"]["tasks"] > 0
        # one progress line per batch, parseable JSON; the broken listener logged 5 times
        lines = [r.getMessage() for r in caplog.records if " progress {" in r.getMessage()]
        assert len(lines) == 5
        assert json.loads(lines[-1].split(" progress ", 1)[1]) == last
        assert sum("monitoring hook bug" in (r.exc_text or "") for r in caplog.records) == 5

        assert op.metrics_port is not None and op.metrics_port > 0
        fams = _scrape(op.metrics_port)
        assert fams["dstl_operator_numRecordsIn"].samples[0].value == sum(map(len, batches))
        assert fams["dstl_operator_numberOfCompletedBatches"].samples[0].value == 5
        assert fams["dstl_operator_lastBatchId"].samples[0].value == 4
        assert fams["dstl_CheckpointCoordinator_numberOfCompletedCheckpoints"].samples[0].value \
            == 5
        agents = {s.labels["agent"] for s in fams["dstl_Agent_requests"].samples}
        assert agents and all(a.isdigit() for a in agents)
        assert all(s.value > 0 for s in fams["dstl_Agent_requests"].samples)
        # an agent has storage metrics once a change set went through it: not when every task
        # of every batch materialized its partition in the checkpoint (0 segments; seen on a
        # loaded machine with the heap table, whose worker materializes)
        if sum(p["stateOperators"][0]["customMetrics"]["segments"] for p in seen):
            uploads = fams["dstl_ChangelogStorage_numberOfUploadRequests"].samples
            assert uploads and {s.labels["agent"] for s in uploads} <= agents
            assert fams["dstl_ChangelogStorage_uploadSizes"].type == "summary"
    finally:
        op.close()
    with pytest.raises(OSError):  # the endpoint is gone with the operator
        _scrape(op.metrics_port)


def test_runtime_conf_changes_are_read_at_start_and_refused_after(
        spark: Any, tmp_path: Path) -> None:  # noqa: F811
    df = spark.createDataFrame([("a",), ("b",)], "key string")
    try:
        # set on the session before the first batch: read (it used to be ignored)
        spark.conf.set("spark.dstl.zstd_level", "5")
        spark.conf.set("spark.dstl.upload_threads", "0")
        with pytest.raises(ConfigError, match="upload_threads"):
            _op(tmp_path / "bad", "heap").validate(spark)
        spark.conf.unset("spark.dstl.upload_threads")
        op = _op(tmp_path / "ok", "heap")
        op.foreach_batch(df, 0)
        assert op.coordinator is not None
        ready = op._ready
        assert ready is not None and ready.task_config.dstl_options.zstd_level == 5
        # changed at runtime: the next batch is refused, naming the key and both values
        spark.conf.set("spark.dstl.backend.max_failures", "9")
        with pytest.raises(ConfigError, match=r"spark\.dstl\.backend\.max_failures") as e:
            op.foreach_batch(df, 1)
        assert "'9'" in str(e.value) and "<unset>" in str(e.value)
        spark.conf.set("spark.dstl.zstd_level", "6")
        spark.conf.unset("spark.dstl.backend.max_failures")
        with pytest.raises(ConfigError, match=r"zstd_level.*'5'"):
            op.foreach_batch(df, 1)
        spark.conf.set("spark.dstl.zstd_level", "5")  # set back: runs, state intact
        out: list[Any] = []
        op.sink = lambda d, b: out.extend(d.collect())
        op.foreach_batch(df, 1)
        assert sorted((r["key"], r["count"]) for r in out) == [("a", 2), ("b", 2)]
        op.close()
    finally:
        for k in ("spark.dstl.zstd_level", "spark.dstl.upload_threads",
                  "spark.dstl.backend.max_failures"):
            spark.conf.unset(k)


def test_the_per_batch_conf_read_equals_the_full_read(spark: Any) -> None:  # noqa: F811
    """The batch's spark.dstl.* read (key names in one py4j call) equals spark.conf.getAll's,
    values with ", ", "=" and brackets included."""
    from dstl.spark.session_conf import dstl_keys as _dstl_keys
    from dstl.spark.session_conf import dstl_runtime_conf as _dstl_runtime_conf
    from dstl.spark.session_conf import runtime_conf as _runtime_conf

    keys = {"spark.dstl.zstd_level": "4", "spark.dstl.x_odd": "a, b=c, [d]",
            "spark.dstlnot.y": "1"}
    try:
        for k, v in keys.items():
            spark.conf.set(k, v)
        read = _dstl_runtime_conf(spark)
        assert read == _dstl_keys(_runtime_conf(spark))
        assert read["spark.dstl.x_odd"] == "a, b=c, [d]" and "spark.dstlnot.y" not in read
    finally:
        for k in keys:
            spark.conf.unset(k)


def test_streaming_query_refuses_a_runtime_change(spark: Any, tmp_path: Path) -> None:  # noqa: F811
    src = tmp_path / "in"
    src.mkdir()
    (src / "0.json").write_text("\n".join(json.dumps({"key": k}) for k in "abca"))
    totals: Counter[str] = Counter()
    op = _op(tmp_path, "heap")
    op.sink = lambda d, b: totals.update({r["key"]: 0 for r in d.collect()})

    def run() -> Any:
        return (spark.readStream.schema("key string").json(str(src)).writeStream
                .foreachBatch(op.foreach_batch).trigger(availableNow=True)
                .option("checkpointLocation", str(tmp_path / "ck")).start())

    try:
        q = run()
        q.awaitTermination(120)
        assert q.exception() is None and op.last_progress is not None
        assert op.last_progress["numInputRows"] == 4
        # the query's batches run on a clone of this session; the change is seen there too
        spark.conf.set("spark.dstl.persist_delay_s", "0.5")
        (src / "1.json").write_text(json.dumps({"key": "z"}))
        q = run()
        with pytest.raises(Exception, match=r"spark\.dstl\.persist_delay_s"):
            q.awaitTermination(120)
        assert op.last_progress["batchId"] == 0
    finally:
        spark.conf.unset("spark.dstl.persist_delay_s")
        op.close()


def test_first_batch_fails_clearly_when_executors_run_another_dstl(
        spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The driver claims another version than the executors import: every task refuses, and
    the batch fails with a message naming both versions and the fix; nothing is committed."""
    import dstl

    df = spark.createDataFrame([("a",), ("b",)], "key string")
    op = _op(tmp_path, "heap")
    monkeypatch.setattr(batch_base_module, "driver_version", lambda: "0.0.0-driver")
    try:
        with pytest.raises(UsageError) as e:
            op.foreach_batch(df, 0)
        text = str(e.value)
        assert "DSTL version mismatch" in text and "0.0.0-driver" in text
        assert f"DSTL {dstl.__version__}" in text and "deploy.md" in text
        assert op.coordinator is not None and op.coordinator.latest() is None
        monkeypatch.undo()
        op.foreach_batch(df, 0)  # the same version: runs
        assert op.last_progress is not None and op.last_progress["numInputRows"] == 2
    finally:
        op.close()


def _jobs(spark: Any) -> list[dict[str, Any]]:  # noqa: F811
    """Every job the status store knows (what the Spark UI and REST API show): id, group and
    description."""
    jobs = spark.sparkContext._jsc.sc().statusStore().jobsList(None)
    out = []
    for i in range(jobs.size()):
        j = jobs.apply(i)
        desc, group = j.description(), j.jobGroup()
        out.append({"id": j.jobId(), "group": group.get() if group.isDefined() else None,
                    "description": desc.get() if desc.isDefined() else None})
    return out


def _wait_for_jobs(spark: Any, pred: Any,  # noqa: F811
                   timeout_s: float = 60.0) -> list[dict[str, Any]]:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        jobs = [j for j in _jobs(spark) if pred(j)]
        if jobs or time.monotonic() > deadline:
            return jobs
        time.sleep(0.1)  # the status store is fed asynchronously by the listener bus


def test_a_batchs_jobs_are_described_and_keep_the_querys_job_group(
        spark: Any, tmp_path: Path) -> None:  # noqa: F811
    src = tmp_path / "in"
    src.mkdir()
    for i in range(2):
        (src / f"{i}.json").write_text("\n".join(json.dumps({"key": k}) for k in "abcab"[i:]))
    op = _op(tmp_path, "heap")
    op.sink = lambda d, b: d.rdd.count()  # a Spark job (collecting a local relation is none)
    q = (spark.readStream.schema("key string").option("maxFilesPerTrigger", 1).json(str(src))
         .writeStream.foreachBatch(op.foreach_batch).trigger(availableNow=True)
         .option("checkpointLocation", str(tmp_path / "ck")).start())
    try:
        q.awaitTermination(180)
        assert q.exception() is None and [s["batch_id"] for s in op.batch_stats] == [0, 1]
        mine = _wait_for_jobs(spark, lambda j: j["group"] == str(q.runId)
                              and "DSTL operator 'prog', batch 1: sink" in (j["description"] or ""))
        assert mine, _jobs(spark)
        ours = [j for j in _jobs(spark) if j["group"] == str(q.runId)
                and (j["description"] or "").startswith("DSTL operator 'prog'")]
        heads = [j["description"].splitlines()[0] for j in ours]
        assert "DSTL operator 'prog', batch 0: state tasks (2 partitions from no checkpoint)" \
            in heads
        assert "DSTL operator 'prog', batch 1: state tasks (2 partitions from checkpoint 0)" \
            in heads
        sink = [h for h in heads if h.startswith("DSTL operator 'prog', batch 0: sink")]
        assert len(sink) == 1 and re.fullmatch(
            r"DSTL operator 'prog', batch 0: sink \([45] rows in; 0 restores, \d+ "
            r"materializations, \d+ segments; checkpoint 0 written\)", sink[0]), sink
        # the streaming engine's own description follows ours (its batch line included)
        for j in ours:
            batch = j["description"].splitlines()[0].split(", batch ")[1].split(":")[0]
            assert f"runId = {q.runId}" in j["description"]
            assert f"batch = {batch}" in j["description"]
    finally:
        op.close()
    # the driver thread's own jobs are not labelled by the operator
    before = {j["id"] for j in _jobs(spark)}
    spark.sparkContext.setJobGroup("after", "user job")
    try:
        spark.range(3).count()
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
        spark.sparkContext.setLocalProperty("spark.job.description", None)
    later = _wait_for_jobs(spark, lambda j: j["id"] not in before and j["group"] == "after")
    assert later and all(j["description"] == "user job" for j in later), later


@pytest.mark.parametrize("table", ["heap", "lmdb"])
def test_memory_used_bytes_is_measured_and_grows_with_the_state(
        spark: Any, tmp_path: Path, table: str) -> None:  # noqa: F811
    op = _op(tmp_path, table)
    figures = []
    try:
        for batch_id in range(3):
            keys = [f"key-{batch_id}-{i:05d}-{'x' * 40}" for i in range(400)]
            op.foreach_batch(spark.createDataFrame([(k,) for k in keys], "key string"),
                             batch_id)
            st = op.last_progress["stateOperators"][0]
            figures.append((st["numRowsTotal"], st["memoryUsedBytes"]))
    finally:
        op.close()
    mem = [m for _, m in figures]
    assert mem[0] > 0 and mem[0] < mem[1] < mem[2], figures
    # 400 keys of ~58 characters per batch: at least their strings, at most a few KB each
    for rows, m in figures:
        assert rows * 60 <= m <= rows * 4096, figures


class RememberWithTimers(StatefulProcessor):
    """Per key one value state and two processing-time timers far in the future: state rows
    one per key; DSTL's own rows (the timers and their index) per timer."""

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.last = handle.get_value_state("last")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]], timer_values: Any
                          ) -> Iterator[dict[str, Any]]:
        n = sum(1 for _ in rows)
        self.last.update(n)
        for at in (10**13, 10**13 + 1):
            self.handle.register_timer(at)
        yield {"key": key, "count": n}


@pytest.mark.parametrize("table", ["heap", "lmdb"])
def test_num_rows_total_counts_the_users_state_rows_not_dstls_timers(
        spark: Any, tmp_path: Path, table: str) -> None:  # noqa: F811
    op = _op(tmp_path, table, processor=RememberWithTimers, time_mode="processing_time")
    keys = ["a", "b", "c", "d", "e", "f", "a"]
    try:
        op.foreach_batch(spark.createDataFrame([(k,) for k in keys], "key string"), 0)
        st = op.last_progress["stateOperators"][0] if op.last_progress else {}
        assert st["numRowsTotal"] == 6, st  # one value per key: Spark's meaning
        internal = st["customMetrics"]["internalRows"]
        assert internal >= 12, st  # two timers per key, besides their index
        assert st["customMetrics"]["tableRecords"] >= 6 + internal
    finally:
        op.close()
