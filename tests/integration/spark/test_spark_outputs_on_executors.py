"""A batch's output rows never travel to the driver: in a session whose
``spark.driver.maxResultSize`` is 1 MiB, batches that emit many times that reach the sink (a
Parquet file sink) complete and equal the model; a sink that drops the persisted rows before
reading them makes Spark compute the state tasks again, and state stays exact."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from spark_support import new_session

from dstl.spark import DstlStatefulOperator, StatefulProcessor

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]

#: rows per batch and bytes of padding per output row: each batch emits ~7 MiB of rows,
#: seven times the driver's result limit
ROWS = 30_000
PAD = 240
#: batch 1 is the one whose persisted rows are dropped before the sink reads them
BATCHES = 2


@pytest.fixture(scope="module")
def small_driver() -> Iterator[Any]:
    """A session of its own whose driver accepts at most 1 MiB of task results per job (a
    static conf: the module's first session in this process)."""
    spark = new_session("dstl-outputs", conf={"spark.driver.maxResultSize": "1m"})
    assert spark.sparkContext.getConf().get("spark.driver.maxResultSize") == "1m", \
        "another session was active: the result limit did not apply"
    yield spark
    spark.stop()


class PaddedCount(StatefulProcessor):
    def init(self, handle: Any) -> None:
        self.count = handle.get_value_state("count")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        c = (self.count.get() or 0) + sum(1 for _ in rows)
        self.count.update(c)
        yield {"key": key, "count": c, "pad": _pad(key)}


def _pad(key: str) -> str:
    """``PAD`` hex digits that depend on the key (hash output: Spark's result compression
    cannot shrink them)."""
    import hashlib

    digest = hashlib.sha512(key.encode()).hexdigest() + hashlib.sha512(key.encode()[::-1]
                                                                        ).hexdigest()
    return digest[:PAD]


def _batch(spark: Any, batch: int) -> Any:
    """``ROWS`` distinct keys; consecutive batches share half of theirs."""
    lo = batch * ROWS // 2
    return spark.range(lo, lo + ROWS, numPartitions=4).selectExpr(
        "concat('key-', cast(id as string)) as key")


def test_outputs_larger_than_the_driver_limit_reach_the_sink_exactly(small_driver: Any,
                                                                    tmp_path: Any) -> None:
    from pyspark.sql import functions as F

    spark = small_driver
    # the limit is in force: the same rows collected to the driver fail
    with pytest.raises(Exception, match="maxResultSize"):
        _batch(spark, 0).selectExpr(
            "key", "concat(sha2(key, 512), sha2(reverse(key), 512)) as pad").collect()

    out = str(tmp_path / "out")
    dropped = []

    def sink(df: Any, batch_id: int) -> None:
        if batch_id == 1:
            # the persisted rows are gone before the sink reads them (as when their executor
            # died): Spark computes the state tasks of this batch again
            spark.catalog.clearCache()
            dropped.append(batch_id)
        df.withColumn("batch", F.lit(batch_id)).write.mode("append").parquet(out)

    op = DstlStatefulOperator(name="big", processor=PaddedCount, key_column="key",
                              output_schema="key string, count bigint, pad string",
                              state_uri=str(tmp_path / "state"), partitions=4,
                              materialization_interval_s=None, sink=sink)
    try:
        for b in range(BATCHES):
            op.foreach_batch(_batch(spark, b), b)
        assert dropped == [1]
        assert [s["rows_out"] for s in op.batch_stats] == [ROWS] * BATCHES
    finally:
        op.close()

    # the model: each batch's keys, counted cumulatively
    seen: Counter[str] = Counter()
    expected = []
    for b in range(BATCHES):
        lo = b * ROWS // 2
        for i in range(lo, lo + ROWS):
            k = f"key-{i}"
            seen[k] += 1
            expected.append((b, k, seen[k]))
    got = spark.read.parquet(out)
    assert got.count() == len(expected)
    assert all(r["pad"] == _pad(r["key"]) for r in got.limit(100).collect())
    # compared on the executors (the rows cannot come to this driver)
    got = got.select("batch", "key", "count")
    want = spark.createDataFrame(expected, "batch int, key string, count bigint")
    assert got.exceptAll(want).count() == 0
    assert want.exceptAll(got).count() == 0
