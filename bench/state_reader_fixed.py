"""The fixed cost of one state read: what a ``spark.read.format("dstl")`` read of
a tiny state costs besides its rows, process by process, next to Spark's ``statestore`` reader
and the floor source of ``bench/state_reader.py`` on the same tiny state.

Theory of operation
-------------------
A read of a Python data source runs Python in three kinds of processes (PySpark 4.x;
``PythonPlannerRunner`` / ``PythonWorkerFactory``): on the driver, planner workers —
``pyspark.sql.worker.create_data_source`` (``load()``: the source instance and its schema) and
``pyspark.sql.worker.plan_data_source_read`` (the reader, ``partitions()``, the pickled read
function) — each forked by a daemon of its own (one ``python -m <spark.python.daemon.module>
<worker module>`` per module), and on the executors the read tasks' workers (``pyspark.worker``
through the executor's daemon). With ``spark.python.worker.reuse`` (default on) a worker that
finished is kept idle and reused by the next call of the same module; the JVM closes workers
idle for a minute, and the daemon forks new ones (``pyspark.daemon`` imports the worker module
after the fork, so a new worker imports everything again). Spark's ``statestore`` reader runs
no Python at all.

This script builds a tiny state with both engines (``bench/state_reader.py``'s jobs, ``--keys``
keys, default 100) and measures, in fresh SparkSessions of one driver process (new
SparkContext, daemons and workers; the driver JVM stays warm):

* a **cold** read — the first read of a session (daemons and workers start, modules are
  imported), one session per reader and round, the reader rotating;
* **warm** reads — the same session's next reads of every reader, interleaved (reused workers);
* each with ``spark.python.daemon.module`` unset (``pyspark.daemon``) and set to
  ``dstl.spark.daemon`` (which preloads the modules a worker imports before it forks; set up
  for reading: ``DSTL_DAEMON_AGENT=0``, ``DSTL_DAEMON_PRELOAD`` = :data:`READ_PRELOAD`);
* each with ``spark.python.worker.reuse`` on (Spark's default) and off: then every call forks
  a new worker, as every read meets after a minute without one (Spark closes idle workers).

CPU per process comes from ``/proc`` (utime + stime of every descendant, sampled every 50 ms on
a thread, so a process that ends between two samples loses at most 50 ms; the sampler's own
CPU is left out), grouped by kind: the JVM (driver and executors), each daemon, each module's
workers, the executor agent, the driver's Python. ``forks`` = processes started during the
read. Medians of the rounds (min..max).

Run: ``nice -n 10 .venv/bin/python bench/state_reader_fixed.py [--keys 100] [--repeats 5]
[--warm 2]``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    add_render,
    fmt,
    parser,
    publish,
    render_stored,
    summary,
    table,
)
from bench.state_reader import (  # noqa: E402
    _build,
    _floor_source,
    _read_dstl,
    _read_floor,
    _read_spark,
    _session,
)

READERS = ("dstl", "spark", "floor")
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class _Proc:
    ppid: int
    start: int  # /proc/<pid>/stat starttime: tells a reused pid from the process seen before
    argv: list[str]
    comm: str
    ticks: int


def _scan() -> dict[int, _Proc]:
    """Every process (its parent, start, argv, CPU ticks); cmdline read once per new pid by the
    caller."""
    out: dict[int, _Proc] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                raw = f.read()
            comm = raw[raw.index("(") + 1:raw.rindex(")")]
            fields = raw.rsplit(")", 1)[1].split()
            out[int(d)] = _Proc(int(fields[1]), int(fields[19]), [], comm,
                                int(fields[11]) + int(fields[12]))
        except (OSError, ValueError, IndexError):
            continue
    return out


class ProcessCpu:
    """The descendants of this process, sampled on a thread: CPU ticks and argv per process."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.me = os.getpid()
        self.procs: dict[tuple[int, int], _Proc] = {}
        self.lock = threading.Lock()
        self.sampler_cpu_s = 0.0
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="bench-proc-cpu", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            t0 = time.thread_time()
            self.sample()
            self.sampler_cpu_s += time.thread_time() - t0

    def sample(self) -> None:
        seen = _scan()
        with self.lock:
            for pid, p in seen.items():
                if not self._descends(pid, seen):
                    continue
                key = (pid, p.start)
                old = self.procs.get(key)
                if old is None or old.comm != p.comm:  # new, or exec'd (spark-submit -> java)
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            p.argv = [a.decode(errors="replace") for a in f.read().split(b"\0")
                                      if a]
                    except OSError:
                        continue
                    self.procs[key] = p
                else:
                    old.ticks = p.ticks

    def _descends(self, pid: int, seen: dict[int, _Proc]) -> bool:
        p = pid
        while p > 1 and p != self.me:
            parent = seen.get(p)
            if parent is None:
                return False
            p = parent.ppid
        return p == self.me

    def snapshot(self) -> dict[tuple[int, int], int]:
        self.sample()
        with self.lock:
            return {k: p.ticks for k, p in self.procs.items()}

    def kind(self, key: tuple[int, int]) -> str:
        """A process's kind: jvm, driver python, agent, executor daemon/worker, planner
        daemon/worker <module>."""
        with self.lock:
            p = self.procs[key]
            parent = next((q for (pid, _), q in self.procs.items() if pid == p.ppid), None)
        if key[0] == self.me:
            return "driver python"
        if p.comm == "java":
            return "jvm"
        if any("dstl.spark.agent" in a for a in p.argv):
            return "agent"
        module = _daemon_module(p.argv)
        if module is not None:
            is_worker = parent is not None and _daemon_module(parent.argv) == module
            role = "worker" if is_worker else "daemon"
            return f"executor {role}" if module == "worker" else f"planner {role} {module}"
        return "other (scripts, short-lived tools)"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _daemon_module(argv: list[str]) -> str | None:
    """The worker module of a Spark Python daemon's command line (``python -m <daemon>
    <worker module>``), shortened; ``None`` for another process."""
    if "-m" not in argv:
        return None
    i = argv.index("-m")
    if i + 1 >= len(argv) or not argv[i + 1].endswith("daemon"):
        return None
    module = argv[i + 2] if i + 2 < len(argv) else "pyspark.worker"
    return module.rsplit(".", 1)[-1]


def measure(cpu: ProcessCpu, fn: Callable[[], float]) -> dict[str, Any]:
    """One read: wall seconds, CPU seconds per process kind, processes started."""
    before = cpu.snapshot()
    sampler0 = cpu.sampler_cpu_s
    wall = fn()
    after = cpu.snapshot()
    by_kind: dict[str, float] = {}
    forks: dict[str, int] = {}
    for key, ticks in after.items():
        kind = cpu.kind(key)
        by_kind[kind] = by_kind.get(kind, 0.0) + (ticks - before.get(key, 0)) / _TICK
        if key not in before:
            forks[kind] = forks.get(kind, 0) + 1
    by_kind["driver python"] = max(0.0, by_kind.get("driver python", 0.0)
                                   - (cpu.sampler_cpu_s - sampler0))
    return {"wall_s": wall, "cpu_s": by_kind, "forks": forks,
            "cpu_total_s": sum(by_kind.values())}


#: (label, spark.python.daemon.module, spark.python.worker.reuse)
CONFIGS: tuple[tuple[str, str | None, bool], ...] = (
    ("pyspark.daemon", None, True), ("dstl.spark.daemon", "dstl.spark.daemon", True),
    ("pyspark.daemon, no reuse", None, False),
    ("dstl.spark.daemon, no reuse", "dstl.spark.daemon", False))
#: The DSTL daemon set up for a session that reads state (docs/configuration.md): no executor
#: agent, and the modules a read task imports preloaded in the executors' daemon.
READ_PRELOAD = "pyspark.sql.worker.plan_data_source_read,dstl.spark.datasource,dstl.reader.columns"


def _session_for(local_dir: str, daemon: str | None, reuse: bool = True) -> Any:
    extra = {"spark.python.worker.reuse": str(reuse).lower()}
    if daemon is not None:
        extra["spark.python.daemon.module"] = daemon
        extra["spark.executorEnv.DSTL_DAEMON_AGENT"] = "0"
        extra["spark.executorEnv.DSTL_DAEMON_PRELOAD"] = READ_PRELOAD
    spark = _session(local_dir, True, extra=extra)
    from dstl.spark import register

    register(spark)
    spark.dataSource.register(_floor_source())
    return spark


def _readers(spark: Any, uri: str, ck: str, keys: int) -> dict[str, Callable[[], float]]:
    return {"dstl": lambda: _read_dstl(spark, uri), "spark": lambda: _read_spark(spark, ck),
            "floor": lambda: _read_floor(spark, keys)}


def probe(spark: Any, uri: str, repeats: int = 20) -> dict[str, Any]:
    """DSTL's own Python of one read, called in this process as the planner workers and the read
    tasks call it (no Spark in between): process CPU seconds (median of ``repeats``) of the
    source and its schema (``create_data_source``), the reader, ``partitions()`` and the pickles
    sent back (``plan_data_source_read``), and reading every split; the pickles' sizes."""
    import pickle

    from pyspark import cloudpickle
    from pyspark.sql.datasource import CaseInsensitiveDict

    from dstl.spark.datasource import DstlStateDataSource

    schema = spark.read.format("dstl").option("operator", "count").load(uri).schema
    phases: dict[str, list[float]] = {"create": [], "plan": [], "read": []}
    sizes: dict[str, int] = {}
    rows = splits = 0
    for _ in range(repeats):
        t0 = time.process_time()
        ds = DstlStateDataSource(options=CaseInsensitiveDict({"path": uri, "operator": "count"}))
        ds.schema()
        sizes["source"] = len(cloudpickle.dumps(ds))  # type: ignore[no-untyped-call]
        t1 = time.process_time()
        reader = ds.reader(schema)
        parts = reader.partitions()
        sizes["reader"] = len(cloudpickle.dumps(reader))  # type: ignore[no-untyped-call]
        sizes["partitions"] = sum(len(pickle.dumps(p)) for p in parts)
        t2 = time.process_time()
        rows = sum(int(getattr(b, "num_rows", 1)) for p in parts for b in reader.read(p))
        t3 = time.process_time()
        splits = len(parts)
        phases["create"].append(t1 - t0)
        phases["plan"].append(t2 - t1)
        phases["read"].append(t3 - t2)
    return {"cpu_s": {k: summary(v) for k, v in phases.items()}, "pickle_bytes": sizes,
            "splits": splits, "rows": rows}


def run(keys: int, repeats: int, warm: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="dstl-bench-fixed-"))
    cpu = ProcessCpu()
    samples: dict[str, list[dict[str, Any]]] = {}
    loads: list[float] = []
    try:
        spark = _session_for(str(work / "spark-local-build"), None)
        uri, ck, _build_info = _build(spark, work, keys, keys, True)
        dstl_python = probe(spark, uri)
        spark.stop()
        sessions = [(c, "dstl") for c in CONFIGS] + [(CONFIGS[0], "spark")]
        for r in range(repeats):
            for i in range(len(sessions)):
                (label, daemon, reuse), cold = sessions[(r + i) % len(sessions)]
                spark = _session_for(str(work / f"spark-local-{r}-{i}"), daemon, reuse)
                try:
                    reads = _readers(spark, uri, ck, keys)
                    samples.setdefault(f"{label}/{cold}/cold", []).append(
                        measure(cpu, reads[cold]))
                    for name in READERS:  # the warm reads below meet running workers
                        if name != cold:
                            reads[name]()
                    for w in range(warm):
                        order = READERS if (w + r) % 2 == 0 else READERS[::-1]
                        for name in order:
                            samples.setdefault(f"{label}/{name}/warm", []).append(
                                measure(cpu, reads[name]))
                finally:
                    spark.stop()
                loads.append(os.getloadavg()[0])
                print(f"  round {r + 1}/{repeats}, {label}, cold {cold}: load "
                      f"{loads[-1]:.1f}", flush=True)
    finally:
        cpu.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {"keys": keys, "repeats": repeats, "warm": warm, "loadavg_1m": summary(loads),
            "dstl_python": dstl_python,
            "samples": samples, "summary": {k: _summarise(v) for k, v in samples.items()}}


def _summarise(xs: list[dict[str, Any]]) -> dict[str, Any]:
    kinds = sorted({k for x in xs for k in x["cpu_s"]})
    return {"wall_s": summary([x["wall_s"] for x in xs]),
            "cpu_total_s": summary([x["cpu_total_s"] for x in xs]),
            "cpu_s": {k: summary([x["cpu_s"].get(k, 0.0) for x in xs]) for k in kinds},
            "forks": {k: statistics.median([x["forks"].get(k, 0) for x in xs])
                      for k in sorted({k for x in xs for k in x["forks"]})}}


def markdown(res: dict[str, Any]) -> str:
    """The docs section of a run, from its stored figures: per Python-worker setting, DSTL's
    cold and warm read against Spark's reader and the floor in the same sessions."""
    sm = res["summary"]

    def cell(key: str) -> str:
        return fmt(sm[key]["wall_s"]) if key in sm else "-"

    rows = []
    for name, *_ in CONFIGS:
        d, sp = sm.get(f"{name}/dstl/warm"), sm.get(f"{name}/spark/warm")
        ratio = (f"{d['wall_s']['median'] / sp['wall_s']['median']:.2f}x" if d and sp else "-")
        rows.append([name, cell(f"{name}/dstl/cold"), cell(f"{name}/dstl/warm"),
                     cell(f"{name}/spark/warm"), ratio, cell(f"{name}/floor/warm")])
    spark_cold = sm.get(f"{CONFIGS[0][0]}/spark/cold")
    c = res["dstl_python"]["cpu_s"]
    return "\n".join([
        table(["Python workers", "DSTL cold read s", "DSTL warm read s",
               "Spark `statestore` warm (same run)", "DSTL / Spark, warm",
               "floor (Python data source), warm"], rows), "",
        f"A read of a {res['keys']}-key state into the `noop` sink: cold = a fresh "
        "SparkSession's first, warm = the next; median (min..max) s"
        + (f"; Spark's cold read {fmt(spark_cold['wall_s'])} s (JVM only)" if spark_cold else "")
        + ". DSTL's own Python per read: "
        f"{(c['create']['median'] + c['plan']['median'] + c['read']['median']) * 1e3:.1f} ms; "
        "the rest is Spark's Python data source plumbing.",
    ])


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--keys", type=int, default=100, help="keys in the tiny state (default 100)")
    p.add_argument("--warm", type=int, default=2, help="warm reads of each reader per session")
    add_render(p)
    args = p.parse_args()
    if args.render:
        render_stored("state_reader_fixed", Path(args.render), markdown)
        return
    if args.repeats < 5 and not args.quick:
        p.error("--repeats must be >= 5 (medians of at least five reads)")
    res = run(args.keys, args.repeats, args.warm)
    cmd = (f"nice -n 10 python bench/state_reader_fixed.py --keys {args.keys} --repeats "
           f"{args.repeats} --warm {args.warm}" + (" --quick" if args.quick else ""))
    publish("state_reader_fixed", dict(res), markdown, quick=args.quick, command=cmd,
            no_doc=args.no_doc, tag=args.tag)


if __name__ == "__main__":
    main()
