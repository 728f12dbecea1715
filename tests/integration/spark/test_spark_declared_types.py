"""Declared state types under Spark: a query restarted with a compatible change of a state's
declared type continues from its converted state; one restarted with an incompatible change
fails at restore with a message naming the state, both types and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from spark_support import spark  # noqa: F401
from support.processors import TypedTotal, TypedTotalAsString, TypedTotalWider

from dstl.spark import DstlStatefulOperator

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]


def _run(spark: Any, processor: type, work: Path) -> tuple[list[dict[str, Any]], Any]:  # noqa: F811
    """One query over every file in ``work/in`` (availableNow): its output rows and its
    exception."""
    op = DstlStatefulOperator(name="total", processor=processor, key_column="key",
                              output_schema="key string, count long, last string",
                              state_uri=str(work / "state"), partitions=2, max_parallelism=16,
                              local_dir=str(work / "local"))
    rows: list[dict[str, Any]] = []
    stream = (spark.readStream.schema("key string").option("maxFilesPerTrigger", 1)
              .json(str(work / "in")))
    q = (op.transform(stream).writeStream
         .foreachBatch(lambda df, _: rows.extend(r.asDict() for r in df.collect()))
         .option("checkpointLocation", str(work / "checkpoint"))
         .trigger(availableNow=True).start())
    error = None
    try:
        q.awaitTermination()
    except StreamingQueryException as exc:
        error = exc
    finally:
        op.close()
    assert (error is None) == (q.exception() is None)
    return rows, error


def _write(work: Path, name: str, keys: list[str]) -> None:
    (work / "in").mkdir(parents=True, exist_ok=True)
    (work / "in" / name).write_text("".join(json.dumps({"key": k}) + "\n" for k in keys))


def test_a_restart_with_an_evolved_type_converts_and_an_incompatible_one_fails(
        spark: Any, tmp_path: Path) -> None:  # noqa: F811
    _write(tmp_path, "f0.json", ["a", "b", "a"])
    rows, error = _run(spark, TypedTotal, tmp_path)
    assert error is None
    assert {(r["key"], r["count"], r["last"]) for r in rows} == {("a", 2, None), ("b", 1, None)}

    # compatible: n int -> long, last string added; the stored values are converted at the
    # restart (first batch), and the second batch reads what the first wrote
    _write(tmp_path, "f1.json", ["a", "c"])
    _write(tmp_path, "f2.json", ["a"])
    rows, error = _run(spark, TypedTotalWider, tmp_path)
    assert error is None
    assert sorted((r["key"], r["count"], r["last"] or "") for r in rows) == [
        ("a", 3, ""), ("a", 4, "seen 3"), ("c", 1, "")]

    # incompatible: n long -> string; the restore refuses it
    _write(tmp_path, "f3.json", ["a"])
    rows, error = _run(spark, TypedTotalAsString, tmp_path)
    assert rows == []
    assert error is not None
    text = str(error)
    assert "StateSchemaError" in text, text[-3000:]
    assert ("state 'total' of backend 'total/p" in text
            and "was written with the type struct<n:long,last:string> and is declared "
                "struct<n:string> now" in text
            and "field 'n': changed from long to string" in text
            and "Declare a compatible type" in text), text[-3000:]
