"""The worker's update latency while its LMDB table is materialized in the
worker (the backend's own ``dstl-materializer`` thread, the only way before the agent) vs by the
executor agent (``materializer.external.materialize_table_directory`` in another process, the
code the agent's materializer thread runs), in the same run.

Method: one LMDB backend with N entries (quick: 100 k; full: 1 M) and a checkpoint whose table
marker is committed. Then, per repeat and per mode, the writer runs batches of 100 random updates
(one LMDB write batch each) for exactly as long as one materialization takes — from the moment it
starts (in-worker: ``_start_materialization``; agent: the other process is told to go, after its
imports) until its snapshot is uploaded — and afterwards the same number of batches with no
materialization. Per-update latency = batch time / 100. Reported: p50 and p99 of the batches
with / without, their ratio (goal: p99 <= 2x), and the materialization time.
Medians of the repeats (>= 5) with min..max.

Run: ``.venv/bin/python bench/agent_materializer.py [--quick]``.
"""

from __future__ import annotations

import os
import random
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    add_render,
    fmt,
    parser,
    percentile,
    publish,
    render_stored,
    summary,
    table,
)
from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from materializer import (
    BackendOptions,
    ChangelogKeyedStateBackend,
    ValueStateDescriptor,
)

MP = 128
ALL = KeyGroupRange(0, MP - 1)
BATCH = 100
GOAL_P99_RATIO = 2.0
NO_MAT = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None,
                        lmdb_map_size_bytes=1 << 30)

# The agent's materializer, in a process of its own: imports first, then a snapshot per "go".
_AGENT = r"""
import sys, time
from dstl.keygroups import KeyGroupRange
from dstl.stores import open_store
from materializer.external import materialize_table_directory
env, uri = sys.argv[1], sys.argv[2]
store = open_store(uri)
print("ready", flush=True)
for line in sys.stdin:
    t = time.perf_counter()
    m = materialize_table_directory(env, KeyGroupRange(0, 127), store,
                                    skip_boundary=None)
    print("done", time.perf_counter() - t, m.ref.size if m else 0, flush=True)
"""


def main() -> int:
    p = parser(__doc__ or "")
    add_render(p)
    args = p.parse_args()
    if args.render:
        return render_stored("agent_materializer", Path(args.render), markdown)
    n = 100_000 if args.quick else 1_000_000
    repeats = max(args.repeats, 5)
    tmp = tempfile.mkdtemp(prefix="dstl-bench-agentmat-")
    store_uri = os.path.join(tmp, "store")
    storage = ChangelogStorage(store_uri, options=DstlOptions(persist_delay_s=0.0))
    b = ChangelogKeyedStateBackend(storage, "mat", ALL, MP, table="lmdb", options=NO_MAT,
                                   local_directory=os.path.join(tmp, "local"))
    state = b.get_state(ValueStateDescriptor("v"))
    keys = [f"user-{i:08d}" for i in range(n)]
    t0 = time.perf_counter()
    for i in range(0, n, 10_000):
        with b.write_batch():
            for j, k in enumerate(keys[i:i + 10_000]):
                b.set_current_key(k)
                state.update(i + j)
    fill_s = time.perf_counter() - t0
    cp = 0

    def checkpoint() -> None:
        nonlocal cp
        cp += 1
        with b.write_batch():
            h = b.snapshot(cp).result(300)
            b.write_table_marker(h)
        b.notify_checkpoint_complete(cp)
        if cp > 1:
            b.notify_checkpoint_subsumed(cp - 1)

    checkpoint()
    rng = random.Random(7)

    def one_batch() -> float:
        ks = [keys[rng.randrange(n)] for _ in range(BATCH)]
        t = time.perf_counter()
        with b.write_batch():
            for j, k in enumerate(ks):
                b.set_current_key(k)
                state.update(j)
        return (time.perf_counter() - t) / BATCH

    agent = subprocess.Popen([sys.executable, "-c", _AGENT, b.tables.path, store_uri],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert agent.stdin is not None and agent.stdout is not None
    if agent.stdout.readline().strip() != "ready":
        raise RuntimeError("the materializer process did not start")

    def in_worker() -> tuple[list[float], float]:
        fut = b.materialization.start()
        if fut is None:
            raise RuntimeError("materialization did not start")
        t = time.perf_counter()
        lat = []
        while not fut.done():
            lat.append(one_batch())
        fut.result()
        return lat, time.perf_counter() - t

    def in_agent() -> tuple[list[float], float]:
        t = time.perf_counter()
        agent.stdin.write("go\n")  # type: ignore[union-attr]
        agent.stdin.flush()  # type: ignore[union-attr]
        lat = []
        while not select.select([agent.stdout], [], [], 0)[0]:
            lat.append(one_batch())
        line = agent.stdout.readline().split()  # type: ignore[union-attr]
        if not line or line[0] != "done":
            raise RuntimeError(f"the materializer process failed: {line}")
        return lat, time.perf_counter() - t

    rows: dict[str, dict[str, list[float]]] = {
        m: {"p50_with": [], "p99_with": [], "p50_without": [], "p99_without": [], "mat_s": [],
            "batches": []} for m in ("worker", "agent")}
    for r in range(repeats):
        for mode, run in (("worker", in_worker), ("agent", in_agent)) if r % 2 == 0 else \
                (("agent", in_agent), ("worker", in_worker)):
            with_lat, mat_s = run()
            checkpoint()
            without = [one_batch() for _ in range(max(len(with_lat), 20))]
            checkpoint()
            row = rows[mode]
            row["p50_with"].append(percentile(with_lat, 50) * 1e6)
            row["p99_with"].append(percentile(with_lat, 99) * 1e6)
            row["p50_without"].append(percentile(without, 50) * 1e6)
            row["p99_without"].append(percentile(without, 99) * 1e6)
            row["mat_s"].append(mat_s)
            row["batches"].append(float(len(with_lat)))
    agent.stdin.close()
    agent.wait(30)
    b.close()
    storage.close()
    figures: dict[str, Any] = {"entries": n, "batch": BATCH, "fill_s": fill_s}
    for mode, row in rows.items():
        f = {k: summary(v) for k, v in row.items()}
        ratios99 = [w / o for w, o in zip(row["p99_with"], row["p99_without"])]
        ratios50 = [w / o for w, o in zip(row["p50_with"], row["p50_without"])]
        f["p99_ratio"] = summary(ratios99)
        f["p50_ratio"] = summary(ratios50)
        f["goal_met"] = f["p99_ratio"]["median"] <= GOAL_P99_RATIO
        figures[mode] = f
    publish("agent_materializer", figures, markdown, quick=args.quick,
            command=".venv/bin/python bench/agent_materializer.py"
            + (" --quick" if args.quick else ""), no_doc=args.no_doc)
    return 0


def markdown(figures: dict[str, Any]) -> str:
    """The docs section of a run, from its stored figures."""
    w, a = figures["worker"], figures["agent"]

    def met(f: dict[str, Any]) -> str:
        return "met" if f["goal_met"] else "**missed**"

    rows = [
        ["update p99 while materializing (µs)", fmt(a["p99_with"]), fmt(w["p99_with"])],
        ["update p99 not materializing (µs)", fmt(a["p99_without"]), fmt(w["p99_without"])],
        [f"**p99 ratio with / without** (goal <= {GOAL_P99_RATIO:g}x)",
         f"{fmt(a['p99_ratio'])}x: {met(a)}", f"{fmt(w['p99_ratio'])}x: {met(w)}"],
        ["p50 ratio with / without", f"{fmt(a['p50_ratio'])}x", f"{fmt(w['p50_ratio'])}x"],
        ["materialization time (s)", fmt(a["mat_s"]), fmt(w["mat_s"])],
    ]
    return "\n".join([
        table(["figure", "in the executor agent (other process)",
               "in the worker (backend thread, same run)"], rows), "",
        f"Update latency while an LMDB table of {figures['entries']:,} entries is materialized, "
        f"batches of {figures['batch']} updates; median (min..max) of {a['p99_with']['n']} "
        "repeats, modes alternating. In the worker the encoding shares the writer's GIL.",
    ])


if __name__ == "__main__":
    sys.exit(main())
