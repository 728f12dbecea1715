"""Spark jobs on a real HDFS (the MiniDFSCluster of ``tests/support/minidfs.py``, shared with
``tests/integration/stores/test_hdfs.py``), both with ``DSTL_DEEP=1`` only: the Spark demo job
(``dstl demo --state-uri hdfs://...``), and a query whose Spark checkpoint and DSTL state are both
on HDFS, with and without a NameNode restart after its first batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hdfs_native import Client
from spark_support import spark  # noqa: F401 - the shared session of the Spark tests
from support.minidfs import MiniDfs, hdfs_uri

pytestmark = pytest.mark.hdfs

DEEP = os.environ.get("DSTL_DEEP") == "1"
ROOT = Path(__file__).resolve().parents[3]


def _client(cluster: MiniDfs) -> Client:
    return Client(f"hdfs://{cluster.namenode}", {"dfs.client.failover.max.attempts": "0"})


@pytest.mark.spark
@pytest.mark.skipif(not DEEP, reason="the Spark demo job on HDFS runs with DSTL_DEEP=1")
def test_spark_demo_on_hdfs(hdfs_cluster: MiniDfs) -> None:
    uri = hdfs_uri(hdfs_cluster, "spark-demo")
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    done = subprocess.run([sys.executable, "-m", "dstl", "demo", "--state-uri", uri,
                           "--files", "4", "--restart-after", "2", "--events", "200"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "OK" in done.stdout


@pytest.mark.spark
@pytest.mark.skipif(not DEEP, reason="Spark's checkpointLocation on HDFS runs with DSTL_DEEP=1")
@pytest.mark.parametrize("fault", ["none", "namenode-restart"])
def test_a_query_with_its_spark_checkpoint_and_state_on_hdfs(
        hdfs_cluster: MiniDfs, spark: Any, tmp_path: Path, fault: str) -> None:  # noqa: F811
    """Spark's own checkpointLocation and DSTL's state_uri on the same HDFS: a query runs three
    files, a new query on the same checkpoint runs three more, and the counts are exact. With
    ``namenode-restart`` the NameNode restarts after the first batch of the first query: the
    query goes on, or fails and its restart on the same checkpoint resumes it."""
    from collections import Counter

    from pyspark.errors import StreamingQueryException
    from support.processors import Count

    from dstl.spark import DstlStatefulOperator

    base = hdfs_uri(hdfs_cluster, "query")
    keys = [[f"k{(7 * i + j * j) % 11:02d}" for j in range(30)] for i in range(6)]
    (tmp_path / "in").mkdir()
    failures: list[str] = []
    restarts: list[threading.Thread] = []

    def write(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            tmp = tmp_path / f"f{i}.tmp"
            tmp.write_text("".join(json.dumps({"key": k}) + "\n" for k in keys[i]))
            os.utime(tmp, (1_700_000_000 + i, 1_700_000_000 + i))
            tmp.rename(tmp_path / "in" / f"f{i:03d}.json")

    def restart_after_first_batch(op: DstlStatefulOperator) -> None:
        deadline = time.monotonic() + 300
        while op.last_progress is None and time.monotonic() < deadline:
            time.sleep(0.1)
        hdfs_cluster.restart_namenode()

    def run(run_id: int) -> None:
        failed_before = len(failures)
        op = DstlStatefulOperator(name="counts", processor=Count, key_column="key",
                                  output_schema="key string, count bigint",
                                  state_uri=f"{base}/state", partitions=2,
                                  local_dir=str(tmp_path / f"local-{run_id}"))
        try:
            if fault == "namenode-restart" and run_id == 0:
                restarts.append(threading.Thread(target=restart_after_first_batch, args=(op,)))
                restarts[-1].start()
            src = (spark.readStream.schema("key string").option("maxFilesPerTrigger", 1)
                   .json(str(tmp_path / "in")))
            q = (op.transform(src).writeStream.format("parquet")
                 .option("path", f"{base}/out").option("checkpointLocation", f"{base}/spark")
                 .trigger(availableNow=True).start())
            try:
                q.awaitTermination()
            except StreamingQueryException as exc:
                failures.append(str(exc).splitlines()[0][:300])
            else:
                assert op.wait_for_checkpoint(int(q.lastProgress["batchId"]))
        finally:
            op.close()
        for t in restarts:
            t.join(300)
        if len(failures) > failed_before:
            run(run_id + 10)  # a new query on the same checkpoint, this one closed

    write(0, 3)
    run(0)
    write(3, 6)
    run(1)
    got = Counter(tuple(r) for r in spark.read.parquet(f"{base}/out")
                  .select("key", "count").collect())
    seen: Counter[str] = Counter()
    want: Counter[tuple[str, int]] = Counter()
    for batch in keys:
        here = Counter(batch)
        for k, n in here.items():
            seen[k] += n
            want[(k, seen[k])] += 1
    assert got == want, failures
    assert len(failures) <= 1, failures
    assert (fault == "none") == (not restarts) and not any(t.is_alive() for t in restarts)
    client = _client(hdfs_cluster)
    path = base.split(hdfs_cluster.namenode, 1)[1]
    names = {s.path.rsplit("/", 1)[-1] for s in client.list_status(f"{path}/spark", True)}
    assert {"commits", "offsets"} <= names  # Spark's checkpoint lives on HDFS
