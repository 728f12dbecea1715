"""A streaming query stops and restarts in a fresh SparkSession: state comes back from the
store (snapshot + log), the query resumes, and the counts are exact."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from spark_support import new_session
from support import moto_server
from support.moto_server import s3_storage_options

from dstl.spark import DstlStatefulOperator

pytestmark = [pytest.mark.spark, pytest.mark.s3, pytest.mark.xdist_group("spark")]
moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket


def _run(src: Path, ck: Path, uri: str, opts: dict[str, Any], latest: dict[str, int],
         tmp: Path, warm: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    from support.processors import Count

    spark = new_session("dstl-restart")
    op = DstlStatefulOperator(name="count", processor=Count, key_column="key",
                              output_schema="key string, count long", state_uri=uri,
                              storage_options=opts, partitions=2, max_parallelism=16,
                              sink=lambda df, b: latest.update(
                                  {r["key"]: r["count"] for r in df.collect()}),
                              local_dir=str(tmp / "local"), materialization_interval_s=0.0)
    try:
        if warm is not None:
            tracker = spark.sparkContext.statusTracker()
            before = set(tracker.getJobIdsForGroup())
            warm.update(op.warm_up(spark))
            warm["job_stages"] = [len(tracker.getJobInfo(j).stageIds)
                                  for j in sorted(set(tracker.getJobIdsForGroup()) - before)]
        q = (spark.readStream.schema("key string").option("maxFilesPerTrigger", 1)
             .json(str(src)).writeStream.foreachBatch(op.foreach_batch)
             .option("checkpointLocation", str(ck)).trigger(availableNow=True).start())
        q.awaitTermination()
        assert q.exception() is None
        return op.batch_stats
    finally:
        op.close()
        spark.stop()


def test_restart_in_a_new_session_restores_state(moto_endpoint: str, s3_bucket: str,
                                                 tmp_path: Path) -> None:
    src, ck = tmp_path / "src", tmp_path / "ck"
    src.mkdir()
    uri, opts = f"s3://{s3_bucket}/app", s3_storage_options(moto_endpoint)
    expected: Counter[str] = Counter()
    latest: dict[str, int] = {}

    def write(i: int) -> None:
        keys = [f"k{(i * 7 + j) % 11}" for j in range(30)]
        expected.update(keys)
        (src / f"part-{i:03d}.json").write_text("".join(json.dumps({"key": k}) + "\n"
                                                        for k in keys))

    for i in range(3):
        write(i)
    first = _run(src, ck, uri, opts, latest, tmp_path / "run1")
    assert latest == dict(expected) and len(first) == 3
    for i in range(3, 5):
        write(i)
    second = _run(src, ck, uri, opts, latest, tmp_path / "run2")
    assert [s["batch_id"] for s in second] == [3, 4]
    assert second[0]["restores"] == 2  # both partitions restored from the store
    assert latest == dict(expected)


def test_warm_up_restores_ahead_and_the_first_batch_adopts(moto_endpoint: str, s3_bucket: str,
                                                           tmp_path: Path) -> None:
    """op.warm_up before the restarted query: every partition is restored in the warm-up job
    (through the executor's agent), the first batch restores nothing and the counts are exact;
    on a fresh state the warm-up only starts the workers."""
    src, ck = tmp_path / "src", tmp_path / "ck"
    src.mkdir()
    uri, opts = f"s3://{s3_bucket}/warm", s3_storage_options(moto_endpoint)
    expected: Counter[str] = Counter()
    latest: dict[str, int] = {}

    def write(i: int) -> None:
        keys = [f"k{(i * 5 + j) % 13}" for j in range(20)]
        expected.update(keys)
        (src / f"part-{i:03d}.json").write_text("".join(json.dumps({"key": k}) + "\n"
                                                        for k in keys))

    for i in range(2):
        write(i)
    fresh: dict[str, Any] = {}
    _run(src, ck, uri, opts, latest, tmp_path / "run1", fresh)
    assert fresh["base_checkpoint"] == -1 and "error" not in fresh
    assert {p["access"] for p in fresh["partitions"].values()} == {"new"}
    for i in range(2, 4):
        write(i)
    warm: dict[str, Any] = {}
    second = _run(src, ck, uri, opts, latest, tmp_path / "run2", warm)
    assert warm["base_checkpoint"] == 1 and "error" not in warm, warm
    assert sorted(warm["partitions"]) == [0, 1]
    # one job shaped like a batch's: the routing shuffle, then the partitions' tasks
    assert warm["job_stages"] == [2], warm
    assert all(p["access"] == "restore" and p["marked"] for p in warm["partitions"].values())
    assert [s["batch_id"] for s in second] == [2, 3]
    assert second[0]["restores"] == 0, second[0]  # adopted or hit: nothing read again
    assert latest == dict(expected)
