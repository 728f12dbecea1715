"""What the examples share and is not the point of any of them: the input files, the local
SparkSession, the run-once query and the command line. Each example keeps its processor, its
input generator, its plain-Python expectation and its report.

The examples run as scripts (``python examples/<name>.py``), which puts this directory on
``sys.path``; tests/integration/spark/test_spark_timers.py adds it before importing them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_files(src: Path, batches: list[list[dict[str, Any]]], first: int = 0) -> None:
    """One JSON-lines file per batch under ``src``, numbered from ``first``; modification times
    one second apart, because the file source takes files in modification-time order (with
    ``maxFilesPerTrigger=1``: one file per micro-batch)."""
    src.mkdir(parents=True, exist_ok=True)
    base = 1_700_000_000
    for i, rows in enumerate(batches, start=first):
        f = src / f"part-{i:04d}.json"
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.utime(f, (base + i, base + i))


def run_available_now(spark: Any, schema: str, src: Path, op: Any, workdir: Path) -> None:
    """Read every file of ``src`` (one per micro-batch) through ``op.foreach_batch`` and wait
    for the end; a failed query raises."""
    q = (spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).json(str(src))
         .writeStream.foreachBatch(op.foreach_batch)
         .option("checkpointLocation", str(workdir / "checkpoint"))
         .trigger(availableNow=True).start())
    q.awaitTermination()
    if q.exception() is not None:
        raise RuntimeError(f"the query failed: {q.exception()}")


def main(doc: str, app: str, run: Callable[..., dict[str, Any]],
         report: Callable[[dict[str, Any]], int], conf: dict[str, str] | None = None) -> int:
    """The examples' command line (``--quick``, ``--table``): ``run(spark, workdir, quick=,
    table=)`` on a local[2] session in a temporary directory, then ``report(result)``, whose
    return is the exit status; ``conf``: more session settings. Workers run ``PYSPARK_PYTHON``
    (this interpreter unless set)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small input, for a smoke run")
    ap.add_argument("--table", choices=("lmdb", "heap"), default="lmdb")
    args = ap.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master("local[2]").appName(app)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false"))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        with tempfile.TemporaryDirectory(prefix=f"{app}-") as tmp:
            result = run(spark, Path(tmp), quick=args.quick, table=args.table)
    finally:
        spark.stop()
    return report(result)
