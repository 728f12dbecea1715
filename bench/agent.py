"""Executor agent benchmark: objects per micro-batch and per-batch latency with the
executor agent vs the per-task mode, same workload, same run; objects per day extrapolated to
200 partitions on 10 executors with a 1 s trigger vs Spark's RocksDB + changelog store.

Workload: the demo's click stream and processor (:mod:`dstl.spark.demo`: ``ClickStats`` keyed
by user, value state + map state + value state; events generated here as in the demo), JSON files written once and read by every run through a file
stream source (``maxFilesPerTrigger=1``, ``trigger(availableNow=True)``), ``writeStream
.foreachBatch(op.foreach_batch)`` on a ``local[2,2]`` SparkSession (one executor, 2 cores), LMDB
tables, materialization interval at the operator's default (60 s: longer than a run, so no
snapshots are written), no sink (the outputs still come back to the driver).

Variants (one fresh operator, state store, Spark checkpoint and local dir per run):
``agent=True`` (the executor agent group-commits the change sets of the executor's concurrent
tasks, one segment per flush window) vs ``agent=False`` (each task writes its own segment), for
P partitions and ``persist_delay_s`` W (the flush window; in the per-task mode, the delay each
task's own scheduler waits before uploading).

Per run (a repeat of a variant = one whole run of N micro-batches; steady state = every batch
but the first, which pays worker/agent start-up and state creation), from ``op.batch_stats``:
segments and objects (segments + snapshots + 1 manifest) per batch, ``batch_seconds`` median
and p90, ``commit_seconds`` median (= the slowest task's ``task_commit_seconds``: materialization
if due + waiting for its change sets to be durable, which includes the flush window; + the
driver's ``manifest_seconds``: acknowledgements + manifest put), and both parts; from the query's
progress: ``triggerExecution`` median. Agent runs: the agent's own metrics, read from the driver
over its socket after the query ends (``agent.ChangelogStorage.numberOfSegments`` and
``writersPerSegment.mean``), then the agent is shut down so the next run starts a fresh one whose
metrics cover that run alone (the agent sums its storages' metrics, histogram means included).
The segment keys in the store carry their creation time (ms): the smallest gap between two
consecutive segments of a run checks "at most one object per flush window". A cell is the median
over repeats of the per-run figure, with min..max over repeats; the order of the variants
rotates per repeat.

Run: ``.venv/bin/python bench/agent.py [--quick]`` (quick: 2 repeats of 5 batches of 1500
events, about 3 min; full: 5 repeats of 7 batches of 2000 events, about 8 min on 2 cores; one
SparkSession for the whole script, plus one unmeasured warm-up run).
"""

from __future__ import annotations

import glob
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    add_render,
    fmt,
    other_jvms,
    parser,
    percentile,
    publish,
    render_stored,
    summary,
    table,
)
from dstl import DstlOptions  # noqa: E402
from dstl.spark.demo import ClickStats  # noqa: E402

OUTPUT_SCHEMA = "user string, clicks long, distinct_pages long, last_page string"
DAY_S = 86_400
# figure 2: a large cluster (200 partitions on 10 executors, 1 s trigger)
X_PARTITIONS, X_EXECUTORS, X_TRIGGER_S = 200, 10, 1.0
MATERIALIZATION_S = 60.0  # DstlStatefulOperator's default materialization interval
SPARK_MAINTENANCE_S = 60.0  # spark.sql.streaming.stateStore.maintenanceInterval default


def click_files(n_files: int, per_file: int, users: int, seed: int) -> list[list[dict[str, Any]]]:
    """The demo's click stream (heavy-tailed users), one list of events per micro-batch file."""
    from dstl.spark.demo import click_events

    return click_events(n_files, per_file, users, seed)


def write_file(dirpath: str, index: int, events: list[dict[str, Any]]) -> None:
    tmp = os.path.join(dirpath, f".part-{index:05d}.json.tmp")  # hidden: the source skips it
    with open(tmp, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    os.replace(tmp, os.path.join(dirpath, f"part-{index:05d}.json"))


def session(local_dir: str) -> Any:
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    spark = (SparkSession.builder.master("local[2,2]").appName("dstl-bench-agent")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "4")
             .config("spark.driver.memory", "1g")
             .config("spark.local.dir", local_dir)  # the executor dir, where the agent lives
             .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def agent_socket(spark_local: str, pid: int) -> str | None:
    """The socket of agent ``pid`` under ``spark.local.dir`` (blockmgr-*/dstl-agent)."""
    from dstl.spark.agent import AgentClient, socket_path

    for agent_dir in glob.glob(os.path.join(spark_local, "**", "dstl-agent"), recursive=True):
        sock = socket_path(agent_dir)
        try:
            client = AgentClient(sock)
        except OSError:
            continue
        try:
            if int(client.metrics().get("agent.pid", -1)) == pid:
                return sock
        finally:
            client.close()
    return None


def agent_metrics_and_stop(sock: str, pid: int) -> dict[str, float]:
    from dstl.spark.agent import AgentClient
    from dstl.spark.agent.protocol import ShutdownRequest

    client = AgentClient(sock)
    try:
        m = client.metrics()
        client.request(ShutdownRequest()).result(10)
    finally:
        client.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)  # polling another process's exit; there is no event to wait on
    return m


def segment_gaps_ms(state_uri: str) -> list[float]:
    """Gaps between consecutive segments' creation times (from their keys), in ms."""
    times = sorted(int(os.path.basename(p).split("-", 1)[0], 16)
                   for p in glob.glob(os.path.join(state_uri, "dstl", "*.seg")))
    return [float(b - a) for a, b in itertools.pairwise(times)]


def run_once(spark: Any, work: str, src: str, spark_local: str, run_no: int, *, agent: bool,
             partitions: int, delay_s: float, batches: int, events: int) -> dict[str, Any]:
    from dstl.spark.operator import DstlStatefulOperator

    d = os.path.join(work, f"run-{run_no}")
    state_uri = os.path.join(d, "state")
    op = DstlStatefulOperator(
        name=f"bench-agent-{run_no}", processor=ClickStats, key_column="user",
        output_schema=OUTPUT_SCHEMA, state_uri=state_uri, partitions=partitions,
        max_parallelism=128, table="lmdb", options=DstlOptions(persist_delay_s=delay_s),
        local_dir=os.path.join(d, "local"), agent=agent)
    load0 = os.getloadavg()[0]
    try:
        stream = (spark.readStream.schema("user string, page string, ts long")
                  .option("maxFilesPerTrigger", 1).json(src))
        q = (stream.writeStream.foreachBatch(op.foreach_batch)
             .option("checkpointLocation", os.path.join(d, "ck"))
             .trigger(availableNow=True).start())
        q.awaitTermination()
        if q.exception() is not None:
            raise RuntimeError(f"query failed: {q.exception()}")
        progress = [p for p in q.recentProgress if p.get("numInputRows", 0) > 0]
        stats = list(op.batch_stats)
    finally:
        op.close()
    load1 = os.getloadavg()[0]
    jvms = other_jvms()
    if len(stats) != batches or sum(s["rows_in"] for s in stats) != batches * events:
        raise RuntimeError(f"run {run_no}: {len(stats)} batches, "
                           f"{sum(s['rows_in'] for s in stats)} rows (expected {batches} x "
                           f"{events})")
    steady = stats[1:]
    bs = [s["batch_seconds"] for s in steady]
    out: dict[str, Any] = {
        "agent": agent, "partitions": partitions, "persist_delay_s": delay_s,
        "segments_per_batch": statistics.mean(s["segments"] for s in steady),
        "segments_max": max(s["segments"] for s in steady),
        "objects_per_batch": statistics.mean(s["objects_written"] for s in steady),
        "materializations": sum(s["materializations"] for s in stats),
        "batch_s_median": statistics.median(bs), "batch_s_p90": percentile(bs, 90),
        "commit_s_median": statistics.median(s["commit_seconds"] for s in steady),
        "task_commit_s_median": statistics.median(s.get("task_commit_seconds", float("nan"))
                                                  for s in steady),
        "manifest_s_median": statistics.median(s.get("manifest_seconds", float("nan"))
                                               for s in steady),
        "trigger_s_median": statistics.median(
            p["durationMs"]["triggerExecution"] / 1e3 for p in progress[1:]) if len(
            progress) > 1 else float("nan"),
        "first_batch_s": stats[0]["batch_seconds"],
        "restores": sum(s["restores"] for s in stats),
        "loadavg_1m": [load0, load1], "other_jvms": jvms,
    }
    gaps = segment_gaps_ms(state_uri)
    out["segment_min_gap_ms"] = min(gaps) if gaps else float("nan")
    out["segments_total"] = sum(s["segments"] for s in stats)
    if agent:
        pids = {pid for s in stats for pid in s["agents"]}
        out["agent_pids"] = sorted(pids)
        last = {pid: m for s in stats for pid, m in s["agents"].items()}
        m: dict[str, float] = {}
        if len(pids) == 1:
            pid = next(iter(pids))
            sock = agent_socket(spark_local, pid)
            m = agent_metrics_and_stop(sock, pid) if sock else last[pid]
        elif pids:  # more than one agent in a run (a restart): sum what the batches reported
            for mm in last.values():
                for k, v in mm.items():
                    m[k] = m.get(k, 0.0) + v
        out["agent_segments"] = m.get("agent.ChangelogStorage.numberOfSegments", float("nan"))
        out["writers_per_segment"] = m.get("agent.ChangelogStorage.writersPerSegment.mean",
                                           float("nan"))
        out["writers_per_segment_max"] = m.get("agent.ChangelogStorage.writersPerSegment.max",
                                               float("nan"))
    else:
        out["writers_per_segment"] = 1.0  # each task's own storage; checked: segments == P
    shutil.rmtree(d, ignore_errors=True)
    return out


def main() -> int:
    p = parser(__doc__.split("\n", 1)[0])
    p.add_argument("--partitions", default="4,8", help="P values, comma-separated")
    p.add_argument("--delays-ms", default="10,100", help="persist_delay_s values in ms")
    p.add_argument("--batches", type=int, default=None, help="micro-batches per run")
    p.add_argument("--events", type=int, default=None, help="events per micro-batch")
    p.add_argument("--users", type=int, default=2000)
    add_render(p)
    args = p.parse_args()
    if args.render:
        return render_stored("agent", Path(args.render), markdown)
    repeats = 2 if args.quick and args.repeats == 5 else args.repeats
    batches = args.batches or (5 if args.quick else 7)
    args.events = args.events or (1500 if args.quick else 2000)
    parts = [int(x) for x in args.partitions.split(",")]
    delays = [float(x) / 1e3 for x in args.delays_ms.split(",")]
    configs = [(pp, w, ag) for pp in parts for w in delays for ag in (False, True)]

    t_start = time.monotonic()
    load_start = os.getloadavg()
    jvms_start = other_jvms()
    work = tempfile.mkdtemp(prefix="dstl-bench-agent-")
    src = os.path.join(work, "clicks")
    # short: the agent's socket is <spark.local.dir>/blockmgr-<uuid>/dstl-agent/agent.sock and
    # AF_UNIX paths are limited to 107 bytes (a longer one: the agent cannot bind, see report)
    spark_local = tempfile.mkdtemp(prefix="dsa-", dir="/tmp")
    os.makedirs(src)
    for i, evs in enumerate(click_files(batches, args.events, args.users, seed=7)):
        write_file(src, i, evs)
    runs: list[dict[str, Any]] = []
    spark = session(spark_local)
    try:
        # warm-up (not measured): JVM JIT, Python worker daemon and imports
        run_once(spark, work, src, spark_local, 0, agent=True, partitions=parts[0],
                 delay_s=delays[0], batches=batches, events=args.events)
        n = 1
        for r in range(repeats):
            k = r % len(configs)
            for pp, w, ag in configs[k:] + configs[:k]:
                res = run_once(spark, work, src, spark_local, n, agent=ag, partitions=pp,
                               delay_s=w, batches=batches, events=args.events)
                res["repeat"] = r
                runs.append(res)
                n += 1
                print(f"rep {r} P={pp} W={w * 1e3:.0f}ms {'agent' if ag else 'per-task'}: "
                      f"{res['segments_per_batch']:.2f} seg/batch, batch "
                      f"{res['batch_s_median']:.3f}s p90 {res['batch_s_p90']:.3f}s, "
                      f"wps {res['writers_per_segment']:.2f}, load {res['loadavg_1m'][1]:.1f}",
                      flush=True)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(spark_local, ignore_errors=True)
    elapsed = time.monotonic() - t_start
    load_end = os.getloadavg()
    jvms = max([jvms_start, *(x["other_jvms"] for x in runs)])

    def cell(pp: int, w: float, ag: bool) -> list[dict[str, Any]]:
        return [x for x in runs if x["partitions"] == pp and x["persist_delay_s"] == w
                and x["agent"] == ag]

    fields = ("segments_per_batch", "objects_per_batch", "writers_per_segment", "batch_s_median",
              "batch_s_p90", "commit_s_median", "task_commit_s_median", "manifest_s_median",
              "trigger_s_median", "first_batch_s")
    table: list[dict[str, Any]] = []
    for pp, w, ag in configs:
        xs = cell(pp, w, ag)
        row: dict[str, Any] = {"partitions": pp, "persist_delay_ms": w * 1e3,
                               "mode": "agent" if ag else "per-task", "repeats": len(xs)}
        for f in fields:
            row[f] = summary([x[f] for x in xs])
        row["segments_max"] = max(x["segments_max"] for x in xs)
        row["segment_min_gap_ms"] = min(x["segment_min_gap_ms"] for x in xs)
        row["materializations"] = sum(x["materializations"] for x in xs)
        if ag:
            row["agent_segments_match"] = all(x["agent_segments"] == x["segments_total"]
                                              for x in xs)
            row["writers_per_segment_max"] = max(x["writers_per_segment_max"] for x in xs)
        table.append(row)

    def get(pp: int, w: float, mode: str) -> dict[str, Any]:
        return next(t for t in table if t["partitions"] == pp and t["persist_delay_ms"] == w * 1e3
                    and t["mode"] == mode)

    ratios: dict[str, dict[str, float]] = {}
    goal_met = True
    for pp in parts:
        for w in delays:
            a, b = get(pp, w, "agent"), get(pp, w, "per-task")
            ratios[f"P{pp}_W{w * 1e3:.0f}ms"] = {
                "segments": a["segments_per_batch"]["median"] / b["segments_per_batch"]["median"],
                "batch_median": a["batch_s_median"]["median"] / b["batch_s_median"]["median"],
                "batch_p90": a["batch_s_p90"]["median"] / b["batch_s_p90"]["median"],
            }
            # at most one object per flush window: consecutive segments at least W apart
            # (key times are whole ms), and fewer segments than partitions
            if not (a["segment_min_gap_ms"] >= w * 1e3 - 1
                    and a["segments_per_batch"]["median"] <= pp):
                goal_met = False

    # ---------------------------------------------------------------- figure 2
    bpd = int(DAY_S / X_TRIGGER_S)
    w_ref = max(delays)
    p_ref = max(parts)
    windows = get(p_ref, w_ref, "agent")["segments_per_batch"]
    w_med = windows["median"]
    tasks_per_exec = X_PARTITIONS // X_EXECUTORS
    w_bound = min(tasks_per_exec, math.ceil(X_TRIGGER_S / w_ref))
    spark_logs = X_PARTITIONS * bpd
    spark_periodic = int(X_PARTITIONS * DAY_S / SPARK_MAINTENANCE_S) * 2  # zip + >= 1 SST
    dstl_snaps = int(X_PARTITIONS * DAY_S / MATERIALIZATION_S)
    per_task = X_PARTITIONS * bpd
    agent_est = round(X_EXECUTORS * w_med * bpd)
    agent_lo = round(X_EXECUTORS * windows["min"] * bpd)
    agent_hi = round(X_EXECUTORS * windows["max"] * bpd)
    agent_worst = X_EXECUTORS * w_bound * bpd
    totals = {
        "spark_rocksdb_changelog_s3": spark_logs + spark_periodic,
        "spark_rocksdb_changelog_hdfs_crc": 2 * (spark_logs + spark_periodic),
        "dstl_per_task": per_task + bpd + dstl_snaps,
        "dstl_agent_estimate": agent_est + bpd + dstl_snaps,
        "dstl_agent_worst_case": agent_worst + bpd + dstl_snaps,
    }
    extrap = {"partitions": X_PARTITIONS, "executors": X_EXECUTORS, "trigger_s": X_TRIGGER_S,
              "batches_per_day": bpd, "windows_per_batch_per_executor_measured": windows,
              "measured_at": {"partitions": p_ref, "persist_delay_ms": w_ref * 1e3},
              "windows_bound": w_bound, "spark_changelogs": spark_logs,
              "spark_periodic_min": spark_periodic, "dstl_snapshots": dstl_snaps,
              "dstl_manifests": bpd, "dstl_per_task_segments": per_task,
              "dstl_agent_segments": agent_est, "dstl_agent_segments_range": [agent_lo, agent_hi],
              "dstl_agent_segments_worst": agent_worst, "totals": totals}

    # this script alone keeps ~2 runnable (JVM + workers + agent); more means someone else
    high = jvms > 0 or max(load_start[0], load_end[0], *(x["loadavg_1m"][1] for x in runs)) > (
        os.cpu_count() or 1) + 1
    figures = {"config": {"batches": batches, "events": args.events, "users": args.users,
                          "repeats": repeats, "partitions": parts,
                          "persist_delay_ms": [w * 1e3 for w in delays],
                          "master": "local[2,2]", "elapsed_s": elapsed,
                          "loadavg_start": load_start, "loadavg_end": load_end,
                          "other_jvms_max": jvms,
                          "high_load": high},
               "table": table, "ratios": ratios, "goal_met": goal_met,
               "extrapolation": extrap, "runs": runs}
    command = ".venv/bin/python bench/agent.py" + (" --quick" if args.quick else "")
    publish("agent", figures, markdown, quick=args.quick, command=command, no_doc=args.no_doc)
    return 0


def markdown(figures: dict[str, Any]) -> str:
    """The docs section of a run, from its stored figures."""
    c, x = figures["config"], figures["extrapolation"]
    rows = []
    for pp in c["partitions"]:
        for w in c["persist_delay_ms"]:
            a, b = (next(t for t in figures["table"] if t["partitions"] == pp
                         and t["persist_delay_ms"] == w and t["mode"] == m)
                    for m in ("agent", "per-task"))
            r = figures["ratios"][f"P{pp}_W{w:.0f}ms"]
            one = a["segment_min_gap_ms"] >= w - 1 and a["segments_per_batch"]["median"] <= pp
            rows.append([f"P = {pp}, W = {w:.0f} ms", fmt(a["segments_per_batch"]),
                         fmt(b["segments_per_batch"]), f"{r['segments']:.2f}x",
                         f"{r['batch_median']:.2f}x",
                         "one per window: " + ("met" if one else "**missed**")])
    t = x["totals"]
    return "\n".join([
        table(["partitions, flush window", "agent: segments / batch",
               "per-task (same run)", "ratio", "batch time ratio", "goal"], rows), "",
        f"`{c['master']}`, {c['batches']} micro-batches of {c['events']:,} clicks per run; "
        f"median (min..max) over {c['repeats']} runs" + ("; noisy" if c.get("high_load") else "")
        + f". Objects per day at {x['partitions']} partitions, {x['executors']} executors, "
        f"{x['trigger_s']:.0f} s trigger: Spark >= {t['spark_rocksdb_changelog_s3'] / 1e6:.1f} M, "
        f"DSTL per-task {t['dstl_per_task'] / 1e6:.1f} M, with the agent "
        f"{t['dstl_agent_estimate'] / 1e6:.1f} M (worst {t['dstl_agent_worst_case'] / 1e6:.1f} M).",
    ])


if __name__ == "__main__":
    sys.exit(main())
