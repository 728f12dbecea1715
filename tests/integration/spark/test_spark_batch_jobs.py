"""The Spark jobs of one operator batch, counted in the driver's status store: the routing shuffle
and the state tasks are one job of two stages, also in a session with adaptive query execution
(AQE) on, which would run the shuffle's map stage as a job of its own and plan again before the
state tasks; and the session's AQE setting is given back after the job (set, unset, already off;
after a failed job too), so the sink and the user's own jobs plan as before."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from spark_support import spark  # noqa: F401
from support.processors import Count, Poison

from dstl.spark import DstlStatefulOperator
from dstl.spark.batch_job import ADAPTIVE

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]


def _op(tmp: Path, table: str, agent: bool, sink: Any, processor: type = Count
        ) -> DstlStatefulOperator:
    return DstlStatefulOperator(name="jobs", processor=processor, key_column="key",
                                output_schema="key string, count long",
                                state_uri=str(tmp / "state"), partitions=3, max_parallelism=32,
                                table=table, agent=agent, sink=sink,
                                local_dir=str(tmp / "local"), materialization_interval_s=None)


def _jobs(spark: Any) -> list[dict[str, Any]]:  # noqa: F811
    """Every job the status store knows: id, group, description and stage count."""
    jobs = spark.sparkContext._jsc.sc().statusStore().jobsList(None)
    out = []
    for i in range(jobs.size()):
        j = jobs.apply(i)
        desc, group = j.description(), j.jobGroup()
        out.append({"id": j.jobId(), "group": group.get() if group.isDefined() else None,
                    "description": desc.get() if desc.isDefined() else "",
                    "stages": j.stageIds().size(), "status": str(j.status())})
    return out


def _state_jobs(spark: Any, group: str, batch_id: int) -> list[dict[str, Any]]:  # noqa: F811
    """The jobs of ``group`` labelled as batch ``batch_id``'s state tasks. The status store is
    fed by the listener bus, asynchronously but in order: once a marker job submitted after the
    batch shows up there, every job of the batch does."""
    sc = spark.sparkContext
    marker = f"marker-{time.monotonic_ns()}"
    sc.setJobGroup(marker, "marker")
    try:
        spark.range(1).rdd.count()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
    deadline = time.monotonic() + 60
    while not any(j["group"] == marker and j["status"] == "SUCCEEDED" for j in _jobs(spark)):
        assert time.monotonic() < deadline, "the marker job never reached the status store"
        time.sleep(0.1)
    head = f"DSTL operator 'jobs', batch {batch_id}: state tasks"
    return [j for j in _jobs(spark)
            if j["group"] == group and j["description"].startswith(head)]


def _aqe(spark: Any) -> str | None:  # noqa: F811
    value = spark.conf.get(ADAPTIVE, None)
    return None if value is None else str(value)


def _set_aqe(spark: Any, value: str | None) -> None:  # noqa: F811
    if value is None:
        spark.conf.unset(ADAPTIVE)
    else:
        spark.conf.set(ADAPTIVE, value)


@pytest.mark.parametrize("table,agent,aqe", [("lmdb", True, "true"), ("heap", False, None),
                                             ("lmdb", False, "false")])
def test_a_batch_is_one_job_and_the_sessions_aqe_setting_is_given_back(
        spark: Any, tmp_path: Path, table: str, agent: bool, aqe: str | None  # noqa: F811
) -> None:
    """AQE on (explicitly, or by Spark's default when unset) or off: each batch runs exactly one
    job of two stages (the shuffle's map stage and the state tasks); the sink sees the
    session's own setting, and the session has it back after the batch."""
    before = _aqe(spark)
    _set_aqe(spark, aqe)
    group = f"batch-jobs-{table}-{agent}-{aqe}"
    seen: list[tuple[int, str | None, dict[str, int]]] = []
    op = _op(tmp_path, table, agent, lambda d, b: seen.append(
        (b, _aqe(d.sparkSession), {r["key"]: r["count"] for r in d.collect()})))
    sc = spark.sparkContext
    try:
        sc.setJobGroup(group, "the operator's batches")
        for batch_id, keys in enumerate(["abcab", "cdd"]):
            op.foreach_batch(spark.createDataFrame([(k,) for k in keys], "key string"),
                             batch_id)
            assert _aqe(spark) == aqe
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
        op.close()
        _set_aqe(spark, before)
    assert seen == [(0, aqe, {"a": 2, "b": 2, "c": 1}), (1, aqe, {"c": 2, "d": 2})]
    for batch_id in (0, 1):
        jobs = _state_jobs(spark, group, batch_id)
        assert len(jobs) == 1 and jobs[0]["stages"] == 2, jobs
        assert jobs[0]["status"] == "SUCCEEDED", jobs


@pytest.mark.parametrize("aqe", ["true", None])
def test_a_failed_batch_gives_the_aqe_setting_back(
        spark: Any, tmp_path: Path, aqe: str | None) -> None:  # noqa: F811
    before = _aqe(spark)
    _set_aqe(spark, aqe)
    op = _op(tmp_path, "heap", False, None, processor=Poison)
    try:
        with pytest.raises(Exception, match="processor refused the poison key"):
            op.foreach_batch(spark.createDataFrame([("a",), ("poison",)], "key string"), 0)
        assert _aqe(spark) == aqe
        assert op.coordinator is not None and op.coordinator.latest() is None
        op.foreach_batch(spark.createDataFrame([("a",), ("b",)], "key string"), 0)
        assert _aqe(spark) == aqe
        assert op.batch_stats[-1]["rows_out"] == 2
    finally:
        op.close()
        _set_aqe(spark, before)


def test_a_streaming_batch_is_one_job_and_the_users_session_keeps_aqe(
        spark: Any, tmp_path: Path) -> None:  # noqa: F811
    """Under Structured Streaming (the batch runs on the query's clone of the session): one
    state job per batch; the sink's session and the user's session keep AQE on."""
    before = _aqe(spark)
    spark.conf.set(ADAPTIVE, "true")
    src = tmp_path / "in"
    src.mkdir()
    for i, keys in enumerate(["abcab", "cdd"]):
        (src / f"{i}.json").write_text("\n".join(json.dumps({"key": k}) for k in keys))
        os.utime(src / f"{i}.json", (1_700_000_000 + i, 1_700_000_000 + i))  # the file order
    sink_aqe: list[str | None] = []
    op = _op(tmp_path, "lmdb", True, lambda d, b: sink_aqe.append(_aqe(d.sparkSession)))
    q = (spark.readStream.schema("key string").option("maxFilesPerTrigger", 1).json(str(src))
         .writeStream.foreachBatch(op.foreach_batch).trigger(availableNow=True)
         .option("checkpointLocation", str(tmp_path / "ck")).start())
    try:
        q.awaitTermination(180)
        assert q.exception() is None and [s["batch_id"] for s in op.batch_stats] == [0, 1]
        assert [s["rows_out"] for s in op.batch_stats] == [3, 2]
        assert sink_aqe == ["true", "true"]
        assert _aqe(spark) == "true"
        for batch_id in (0, 1):
            jobs = _state_jobs(spark, str(q.runId), batch_id)
            assert len(jobs) == 1 and jobs[0]["stages"] == 2, jobs
    finally:
        q.stop()
        op.close()
        _set_aqe(spark, before)
