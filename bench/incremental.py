"""Store bytes written per steady interval with full and with incremental materialization.

What it drives: four LMDB backends (partitions of 128 key groups) in one process, as a Spark
task without the executor agent does (polled materialization: ``materialize_now``), a
checkpoint coordinator (2 retained checkpoints, deletions after every completion) and a local
store whose ``put`` counts bytes by prefix (``dstl/`` segments, ``snapshots/``).

Workload (the state-size measurement's, without Spark): N keys ``user-<9 digits>``, a 256-byte
value each (half random hex, half repeated text), loaded in batches of 100 k keys (a checkpoint
each) and materialized once; then ``--intervals`` steady intervals, each updating
``--update-frac`` of the keys at random (read-modify-write of a ``ValueState``) and
checkpointing, with a materialization of every partition every ``--mat-every`` intervals (the
Spark run's 10 s materialization interval over 5 s batches). The same workload (same seed) runs
with ``incremental_snapshots`` off and on, in this order, in one run.

Measured per steady interval (reported as the mean over the steady intervals, with the
smallest and largest interval): bytes put to the store (log segments, snapshot objects), CPU time
of the process (all threads: the materializer's included); at the end, the snapshot pieces the
last checkpoint names, the store's size, and the restore of partition 0 from the last checkpoint
into a fresh LMDB table (wall time, sample keys checked).

Also measured: the write path's cost of remembering the changed entries (200 k updates in one
write batch, heap and LMDB, tracking off and on, alternating repeats).

Run: ``.venv/bin/python bench/incremental.py [--quick] [--keys 200000 1000000]``; sizes
200 k and 1 M keys by default, ``--quick`` 20 k.
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    LoadSampler,
    add_render,
    load_brief,
    parser,
    publish,
    render_stored,
    table,
)
from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.checkpoint import CheckpointCoordinator
from dstl.stores import open_store
from materializer.backend import ChangelogKeyedStateBackend
from materializer.options import BackendOptions
from materializer.states import ValueStateDescriptor
from restore.restore import RestoreStats, restore_backend

MP = 128
PARTITIONS = 4
LOAD_BATCH = 100_000
TEXT = ("the quick brown fox jumps over the lazy dog; " * 4)[:128]


class CountingStore:
    """A blob store that counts the bytes of every put by top-level prefix."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.put_bytes: dict[str, int] = {}

    def put(self, key: str, data: bytes) -> None:
        self._inner.put(key, data)
        prefix = key.split("/", 1)[0]
        self.put_bytes[prefix] = self.put_bytes.get(prefix, 0) + len(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _value(rng: random.Random) -> str:
    return rng.randbytes(64).hex() + TEXT


def _key(i: int) -> str:
    return f"user-{i:09d}"


def run(n: int, incremental: bool, intervals: int, update_frac: float, mat_every: int,
        seed: int, work: Path) -> dict[str, Any]:
    rng = random.Random(seed)
    inner = open_store(str(work / "store"))
    store = CountingStore(inner)
    storage = ChangelogStorage(store=store, options=DstlOptions())
    coord = CheckpointCoordinator(store, job_id="bench", retained=2)
    opts = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None,
                          incremental_snapshots=incremental)
    backends = [ChangelogKeyedStateBackend(
        storage, f"op/p{i}", KeyGroupRange.of_operator(MP, PARTITIONS, i), MP, table="lmdb",
        options=opts, local_directory=str(work / "local"), auto_materialize=False)
        for i in range(PARTITIONS)]
    states = [b.get_state(ValueStateDescriptor("v")) for b in backends]
    from dstl import key_group_for
    owner = [0] * MP
    for i, b in enumerate(backends):
        for kg in b.key_groups:
            owner[kg] = i
    part_of = [owner[key_group_for(_key(i).encode(), MP)] for i in range(n)]
    last: dict[int, str] = {}
    handles: list[Any] = []

    def checkpoint() -> None:
        cid = coord.trigger([b.operator_id for b in backends])
        completion = None
        hs = []
        for b in backends:
            h = b.snapshot(cid).result(600)
            hs.append(h)
            completion = coord.acknowledge(cid, b.operator_id, h.to_json_obj(),
                                           h.referenced_keys(), h.full_size,
                                           h.incremental_size)
        assert completion is not None
        for b in backends:
            b.notify_checkpoint_complete(cid)
        for m in completion.subsumed:
            for b in backends:
                b.notify_checkpoint_subsumed(m.checkpoint_id)
        handles[:] = hs

    def write(keys: list[int]) -> None:
        by_part: list[list[int]] = [[] for _ in backends]
        for i in keys:
            by_part[part_of[i]].append(i)
        for p, b in enumerate(backends):
            s = states[p]
            with b.write_batch():
                for i in by_part[p]:
                    b.set_current_key(_key(i))
                    s.value()   # read-modify-write
                    v = _value(rng)
                    s.update(v)
                    last[i] = v

    def materialize() -> list[Any]:
        return [b.materialize_now(3600) for b in backends]

    t0 = time.monotonic()
    for start in range(0, n, LOAD_BATCH):
        write(list(range(start, min(n, start + LOAD_BATCH))))
        checkpoint()
    materialize()
    checkpoint()
    build_s = time.monotonic() - t0
    per: list[dict[str, Any]] = []
    updates = max(1, int(n * update_frac))
    for k in range(intervals):
        before = dict(store.put_bytes)
        c0 = time.process_time()
        w0 = time.monotonic()
        write(rng.sample(range(n), updates))
        checkpoint()
        refs = materialize() if (k + 1) % mat_every == 0 else []
        per.append({
            "log_bytes": store.put_bytes.get("dstl", 0) - before.get("dstl", 0),
            "snapshot_bytes": store.put_bytes.get("snapshots", 0) - before.get("snapshots", 0),
            "cpu_s": time.process_time() - c0, "wall_s": time.monotonic() - w0,
            "pieces": [None if r is None else ("delta" if r.delta else "full") for r in refs]})
        per[-1]["store_bytes"] = per[-1]["log_bytes"] + per[-1]["snapshot_bytes"]
    checkpoint()   # the last materialization confirmed, as the next batch would
    pieces = [[("delta" if r.delta else "full", r.size) for r in h.materialized]
              for h in handles]
    stored = sum(o.size for o in inner.list(""))
    h0 = handles[0]
    for b in backends:
        b.close()
    coord.close()
    # restore partition 0 from the last checkpoint into a fresh table
    w0 = time.monotonic()
    rst = RestoreStats()
    r = restore_backend([h0], storage, h0.key_groups, table="lmdb", operator_id="restored/p0",
                        options=opts, local_directory=str(work / "restored"), stats=rst)
    restore_s = time.monotonic() - w0
    try:
        s = r.get_state(ValueStateDescriptor("v"))
        sample = [i for i in rng.sample(range(n), min(n, 4000)) if part_of[i] == 0][:500]
        for i in sample:
            r.set_current_key(_key(i))
            assert s.value() == last[i], f"key {i} restored wrong"
    finally:
        r.close()
        storage.close()
    steady = per
    # per interval = the mean over the steady intervals (a materialization every mat_every)
    mean = {f: statistics.fmean(x[f] for x in steady)
            for f in ("store_bytes", "log_bytes", "snapshot_bytes", "cpu_s", "wall_s")}
    return {"keys": n, "incremental": incremental, "build_s": build_s, "intervals": per,
            "mean": mean, "min_store_bytes": min(x["store_bytes"] for x in steady),
            "max_store_bytes": max(x["store_bytes"] for x in steady),
            "total_store_bytes": sum(x["store_bytes"] for x in steady),
            "pieces_last_checkpoint": pieces, "store_size_end": stored,
            "restore_p0_s": restore_s, "restore_stats": dict(rst),
            "checked_keys": len(sample)}


def write_cost(n: int, repeats: int, work: Path) -> dict[str, Any]:
    """What the change tracking costs the write path: ``n`` updates of 256-byte values in one
    write batch (heap, LMDB), with ``incremental_snapshots`` off and on, in alternating order;
    seconds per repeat."""
    out: dict[str, Any] = {}
    storage = ChangelogStorage(store=open_store(str(work / "wstore")), options=DstlOptions())
    rng = random.Random(7)
    values = [_value(rng) for _ in range(1000)]
    try:
        for table in ("heap", "lmdb"):
            times: dict[bool, list[float]] = {False: [], True: []}
            for r in range(repeats):
                for inc in ((False, True) if r % 2 == 0 else (True, False)):
                    gc.collect()   # the previous repeat's table is freed before the clock
                    opts = BackendOptions(materialization_interval_s=None,
                                          materialize_log_ratio=None, incremental_snapshots=inc)
                    b = ChangelogKeyedStateBackend(
                        storage, f"w/{table}/{inc}/{r}", KeyGroupRange(0, MP - 1), MP,
                        table=table, options=opts, local_directory=str(work / "wlocal"),
                        auto_materialize=False)
                    s = b.get_state(ValueStateDescriptor("v"))
                    t0 = time.perf_counter()
                    with b.write_batch():
                        for i in range(n):
                            b.set_current_key(_key(i))
                            s.update(values[i % 1000])
                    times[inc].append(time.perf_counter() - t0)
                    b.close()
            off, on = statistics.median(times[False]), statistics.median(times[True])
            out[table] = {"off_s": times[False], "on_s": times[True], "median_off_s": off,
                          "median_on_s": on, "ratio": on / off}
            print(f"write cost {table}: {n / off:,.0f} -> {n / on:,.0f} updates/s "
                  f"({on / off:.2f}x the time)", flush=True)
    finally:
        storage.close()
    return out


def main() -> None:
    p = parser(__doc__.split("\n", 1)[0])
    p.add_argument("--keys", type=int, nargs="*", default=None)
    p.add_argument("--intervals", type=int, default=12)
    p.add_argument("--update-frac", type=float, default=0.01)
    p.add_argument("--mat-every", type=int, default=2)
    add_render(p)
    a = p.parse_args()
    if a.render:
        render_stored("incremental", Path(a.render), markdown)
        return
    sizes = a.keys or ([20_000] if a.quick else [200_000, 1_000_000])
    sampler = LoadSampler()
    work = Path(tempfile.mkdtemp(prefix="dstl-bench-inc-"))
    try:
        writes = write_cost(20_000 if a.quick else 200_000, max(a.repeats, 5), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = []
    for n in sizes:
        for incremental in (False, True):
            work = Path(tempfile.mkdtemp(prefix="dstl-bench-inc-"))
            try:
                res = run(n, incremental, a.intervals, a.update_frac, a.mat_every, 1234, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            m = res["mean"]
            print(f"{n} keys incremental={incremental}: store bytes/interval mean "
                  f"{m['store_bytes'] / 1e6:.2f} MB (log {m['log_bytes'] / 1e6:.2f}, snapshots "
                  f"{m['snapshot_bytes'] / 1e6:.2f}), cpu {m['cpu_s']:.2f} s, restore p0 "
                  f"{res['restore_p0_s']:.2f} s {res['restore_stats']}", flush=True)
            results.append(res)
    load = sampler.stop()
    command = "python bench/incremental.py" + (" --quick" if a.quick else "") + (
        f" --keys {' '.join(map(str, a.keys))}" if a.keys else "") + (
        f" --intervals {a.intervals}" if a.intervals != 12 else "") + (
        f" --mat-every {a.mat_every}" if a.mat_every != 2 else "") + (
        f" --update-frac {a.update_frac:g}" if a.update_frac != 0.01 else "")
    publish("incremental", {"sizes": results, "write_cost": writes, "load": load,
                            "config": {"intervals": a.intervals, "update_frac": a.update_frac,
                                       "mat_every": a.mat_every}},
            markdown, quick=a.quick, command=command, no_doc=a.no_doc, tag=a.tag)


def markdown(figures: dict[str, Any]) -> str:
    """The docs section of a run, from its stored figures."""
    results, writes = figures["sizes"], figures["write_cost"]
    rows = []
    for n in sorted({r["keys"] for r in results}):
        full, inc = (next(r for r in results if r["keys"] == n and r["incremental"] is m)
                     for m in (False, True))
        fm, im = full["mean"], inc["mean"]
        rows.append([f"{n:,}", f"{im['store_bytes'] / 1e6:.2f} ({inc['min_store_bytes'] / 1e6:.2f}"
                     f"..{inc['max_store_bytes'] / 1e6:.2f})",
                     f"{fm['store_bytes'] / 1e6:.2f} ({full['min_store_bytes'] / 1e6:.2f}.."
                     f"{full['max_store_bytes'] / 1e6:.2f})",
                     f"**{fm['store_bytes'] / im['store_bytes']:.1f}x** less",
                     f"{im['store_bytes'] / im['log_bytes']:.2f}x",
                     f"{full['restore_p0_s']:.2f} / {inc['restore_p0_s']:.2f}"])
    cost = ", ".join(f"{t} {w['ratio']:.2f}x" for t, w in writes.items())
    # runs stored before the config was recorded used the defaults (their commands set none)
    c = {"intervals": 12, "update_frac": 0.01, "mat_every": 2, **figures.get("config", {})}
    return "\n".join([
        table(["keys", "incremental: store MB per interval", "full snapshots (same run)",
               "ratio", "incremental / the log alone", "restore of one partition s, full / "
               "incremental"], rows), "",
        f"Four LMDB partitions, {c['intervals']} intervals each updating "
        f"{c['update_frac']:.0%} of the keys (256 B values), materialized every "
        f"{c['mat_every']} intervals, `incremental_snapshots` off and on in one run; mean (min.."
        "max) per interval. Write path cost of tracking changed entries (on / off, median of 5): "
        f"{cost}; {load_brief(figures.get('load'))}.",
    ])


if __name__ == "__main__":
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")
    main()
