"""A long-running streaming query, in its own process, sampled for growth (``test_soak.py``).

``python soak_scenario.py TMP BATCHES`` runs a file-source query over a DSTL operator (LMDB,
executor agent, materialization every 5 s, 3 retained checkpoints) while a writer thread adds
one input file per second, until BATCHES batches ran; every ``SAMPLE_EVERY`` batches a progress
listener appends one sample to ``TMP/samples.jsonl``:

* ``batch``; ``driver_rss`` (this process: the operator, its coordinator, the sink's view) and
  ``jvm_rss``, ``jvm_heap_used`` (the driver JVM: Spark's own, informational);
* ``store_objects`` and ``store_bytes`` (the state store, a local directory);
* ``local_bytes`` (the operator's local directory: LMDB tables, batch-id files) and
  ``spark_local_bytes`` (``SPARK_LOCAL_DIRS``: the agent's directory and cache, Spark's blocks;
  without the agent's log);
* ``agent_log_bytes`` (``agent.log`` and its rotated files) and ``agent_log_files``;
* ``processes`` (every process with TMP in its environment: the JVM, Python workers, the
  agent).

At the end ``TMP/result.json`` has the sink's last counts and the model's. The agent's log rotates
at ``DSTL_AGENT_LOG_MAX_BYTES`` (64 KiB here, 2 backups) so that a run of this length rotates it
several times.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]  # and tests/

SAMPLE_EVERY = 10
KEYS = 500
ROWS_PER_FILE = 40
LOG_MAX_BYTES = 64 * 1024
LOG_BACKUPS = 2


def dir_figures(path: Path) -> tuple[int, int]:
    """(files, bytes) under ``path`` (files that vanish meanwhile are skipped)."""
    files = size = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                size += os.stat(os.path.join(root, n)).st_size
            except FileNotFoundError:  # deleted by the coordinator or the agent meanwhile
                continue
            files += 1
    return files, size


def processes_with(marker: str) -> list[int]:
    """This user's processes whose environment contains ``marker``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker.encode() in f.read():
                    out.append(int(name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return out


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _agent_logs(spark_local: Path) -> list[Path]:
    return [p for p in spark_local.rglob("agent.log*") if p.is_file()]


class Soak:
    def __init__(self, tmp: Path, batches: int) -> None:
        self.tmp, self.batches = tmp, batches
        self.src = tmp / "src"
        self.src.mkdir(parents=True, exist_ok=True)
        self.expected: Counter[str] = Counter()
        self.latest: dict[str, int] = {}
        self.done = threading.Event()
        self.samples = open(tmp / "samples.jsonl", "w")  # noqa: SIM115 - closed in run()
        self.spark: Any = None
        self.jvm_pid = 0

    def write_files(self) -> None:
        """One input file per second until ``batches`` files exist (the query may lag)."""
        for i in range(self.batches):
            if self.done.is_set():
                return
            keys = [f"k{(i * 37 + j * 11) % KEYS}" for j in range(ROWS_PER_FILE)]
            self.expected.update(keys)
            tmp = self.src / f".part-{i:05d}.tmp"
            tmp.write_text("".join(json.dumps({"key": k}) + "\n" for k in keys))
            tmp.rename(self.src / f"part-{i:05d}.json")  # the source never sees half a file
            self.done.wait(1.0)

    def sink(self, df: Any, batch_id: int) -> None:
        self.latest.update({r["key"]: r["count"] for r in df.collect()})

    def sample(self, progress: dict[str, Any]) -> None:
        batch = int(progress["batchId"])
        if batch % SAMPLE_EVERY and batch != self.batches - 1:
            return
        rt = self.spark.sparkContext._jvm.java.lang.Runtime.getRuntime()
        store = dir_figures(self.tmp / "store")
        logs = _agent_logs(self.tmp / "spark-local")
        log_bytes = sum(p.stat().st_size for p in logs)
        self.samples.write(json.dumps({
            "batch": batch, "t": time.time(), "driver_rss": rss_bytes(),
            "jvm_rss": rss_bytes(self.jvm_pid),
            "jvm_heap_used": int(rt.totalMemory()) - int(rt.freeMemory()),
            "store_objects": store[0], "store_bytes": store[1],
            "local_bytes": dir_figures(self.tmp / "local")[1],
            # without the agent's log, a sawtooth of its own (below)
            "spark_local_bytes": dir_figures(self.tmp / "spark-local")[1] - log_bytes,
            "agent_log_bytes": log_bytes,
            "agent_log_files": len(logs),
            "processes": len(processes_with(str(self.tmp))),
            "batch_seconds": progress["durationMs"]["triggerExecution"] / 1000,
            "memory_used_bytes": progress["stateOperators"][0]["memoryUsedBytes"],
        }) + "\n")
        self.samples.flush()

    def run(self) -> dict[str, Any]:
        from spark_support import new_session
        from support.processors import Count

        from dstl.spark import DstlStatefulOperator

        os.environ["SPARK_LOCAL_DIRS"] = str(self.tmp / "spark-local")
        os.environ["DSTL_AGENT_LOG_MAX_BYTES"] = str(LOG_MAX_BYTES)
        os.environ["DSTL_AGENT_LOG_BACKUPS"] = str(LOG_BACKUPS)
        self.spark = spark = new_session("dstl-soak")
        self.jvm_pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
        op = DstlStatefulOperator(
            name="soak", processor=Count, key_column="key",
            output_schema="key string, count long", state_uri=str(self.tmp / "store"),
            partitions=2, max_parallelism=32, sink=self.sink, local_dir=str(self.tmp / "local"),
            materialization_interval_s=5.0, retained=3)
        op.add_listener(self.sample)
        writer = threading.Thread(target=self.write_files, name="soak-writer", daemon=True)
        writer.start()
        q = (spark.readStream.schema("key string").option("maxFilesPerTrigger", 1)
             .json(str(self.src)).writeStream.foreachBatch(op.foreach_batch)
             .trigger(processingTime="1 second")
             .option("checkpointLocation", str(self.tmp / "ck")).start())
        try:
            while q.exception() is None and not (
                    op.batch_stats and op.batch_stats[-1]["batch_id"] >= self.batches - 1):
                time.sleep(1.0)  # the query runs on its own thread; this one only watches
            error = q.exception()
        finally:
            self.done.set()
            q.stop()
            op.close()
            spark.stop()
            self.samples.close()
        writer.join()
        return {"error": None if error is None else str(error)[:3000],
                "latest": self.latest, "expected": dict(self.expected),
                "jvm_pid": self.jvm_pid}


if __name__ == "__main__":
    tmp = Path(sys.argv[1])
    result = Soak(tmp, int(sys.argv[2])).run()
    (tmp / "result.json").write_text(json.dumps(result))
