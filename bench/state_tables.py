"""Benchmarks of the state tables: heap map vs dict, rehash latency, snapshot pause,
write-out under a concurrent writer, LMDB rates. Every ratio is measured in the same run as its
baseline. ``--quick`` for CI smoke runs (~1 minute), default sizes for the report, ``--profile`` to
print a cProfile of the heap map's hot paths, ``--render RESULTS.json`` to rebuild the docs
section of a stored run.
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import add_render, fmt, parser, publish, render_stored, repeat, summary, table
from dstl.keygroups import KeyGroupRange
from materializer import CopyOnWriteStateMap, HeapStateTables, LmdbStateTable

pc = time.perf_counter
GOALS = {"get_put_ratio": 0.25, "longest_put_ratio": 0.2, "snapshot_pause_ratio": 0.3,
         "writer_during_writeout_ratio": 0.5}


def keys_of(n: int) -> list[str]:
    return [f"user-{i:08d}" for i in range(n)]


# --------------------------------------------------------------------------- throughput


def throughput(n: int, repeats: int) -> dict[str, Any]:
    keys = keys_of(n)
    out: dict[str, Any] = {}

    def run(label: str, fn: Callable[[], None]) -> None:
        def once() -> float:
            t = pc()
            fn()
            return n / (pc() - t)
        out[label] = repeat(once, repeats)

    m: CopyOnWriteStateMap[str, None, int] = CopyOnWriteStateMap()
    d: dict[tuple[str, None], int] = {}
    for k in keys:  # steady state: both hold every key, no rehash in flight
        m.put(k, None, 1)
        d[(k, None)] = 1
    while m.is_rehashing:
        m.get(keys[0], None)

    def m_get() -> None:
        get = m.get
        for k in keys:
            get(k, None)

    def d_get() -> None:
        get = d.get
        for k in keys:
            get((k, None))

    def m_put() -> None:
        put = m.put
        for k in keys:
            put(k, None, 2)

    def d_put() -> None:
        for k in keys:
            d[(k, None)] = 2

    def m_insert() -> None:
        mm: CopyOnWriteStateMap[str, None, int] = CopyOnWriteStateMap()
        put = mm.put
        for k in keys:
            put(k, None, 1)

    def d_insert() -> None:
        dd: dict[tuple[str, None], int] = {}
        for k in keys:
            dd[(k, None)] = 1

    for label, fn in (("map_get", m_get), ("dict_get", d_get), ("map_update", m_put),
                      ("dict_update", d_put), ("map_insert", m_insert),
                      ("dict_insert", d_insert)):
        run(label, fn)
    for op in ("get", "update", "insert"):
        out[f"{op}_ratio"] = out[f"map_{op}"]["median"] / out[f"dict_{op}"]["median"]
    return out


# --------------------------------------------------------------------------- latency


def longest_put(n: int, repeats: int, gc_enabled: bool) -> dict[str, Any]:
    def map_once() -> float:
        m: CopyOnWriteStateMap[int, None, int] = CopyOnWriteStateMap()
        put = m.put
        worst = 0.0
        for i in range(n):
            t = pc()
            put(i, None, i)
            dt = pc() - t
            if dt > worst:
                worst = dt
        return worst

    def dict_once() -> float:
        d: dict[tuple[int, None], int] = {}
        worst = 0.0
        for i in range(n):
            t = pc()
            d[(i, None)] = i
            dt = pc() - t
            if dt > worst:
                worst = dt
        return worst

    was = gc.isenabled()
    (gc.enable if gc_enabled else gc.disable)()
    try:
        maps, dicts = [], []
        for _ in range(repeats):  # interleaved so both see the same machine state
            gc.collect()
            maps.append(map_once())
            gc.collect()
            dicts.append(dict_once())
    finally:
        (gc.enable if was else gc.disable)()
    sm, sd = summary(maps), summary(dicts)
    return {"map_s": sm, "dict_s": sd, "ratio": sm["median"] / sd["median"]}


def snapshot_pause(n: int, repeats: int) -> dict[str, Any]:
    m: CopyOnWriteStateMap[int, None, int] = CopyOnWriteStateMap()
    d: dict[tuple[int, None], int] = {}
    for i in range(n):
        m.put(i, None, i)
        d[(i, None)] = i
    while m.is_rehashing:
        m.get(0, None)
    snaps, copies = [], []
    for _ in range(repeats):
        t = pc()
        s = m.snapshot()
        snaps.append(pc() - t)
        s.release()
        t = pc()
        c = d.copy()
        copies.append(pc() - t)
        del c
    ss, sc = summary(snaps), summary(copies)
    return {"snapshot_s": ss, "dict_copy_s": sc, "ratio": ss["median"] / sc["median"],
            "capacity": m.capacity}


# --------------------------------------------------------------------------- write-out


def _writer_rate(write: Callable[[int], None], stop: threading.Event,
                 counter: list[int]) -> None:
    i = 0
    while not stop.is_set():
        write(i)
        i += 1
    counter.append(i)


def writeout_heap(n: int, repeats: int) -> dict[str, Any]:
    kgs = KeyGroupRange(0, 127)
    value = b"v" * 48
    results: dict[str, list[float]] = {"mb_s": [], "alone_mb_s": [], "alone": [], "during": []}
    for _ in range(repeats):
        tables = HeapStateTables(kgs)
        keys = [b"user-%08d" % i for i in range(n)]
        for i, k in enumerate(keys):
            tables.put(0, i & 127, k, b"", value)

        for kg in kgs:  # steady state: no incremental rehash in flight in either phase
            cm = tables.table(0).map_for(kg)
            while cm.is_rehashing:
                cm.contains_key(b"", b"")

        def write(i: int, tables: HeapStateTables = tables, keys: list[bytes] = keys) -> None:
            j = (i * 7919) % n
            tables.put(0, j & 127, keys[j], b"", b"w" * 48)

        t = pc()
        tables.snapshot().write(io.BytesIO().write, metadata=b"{}")
        results["alone_mb_s"].append(n * (12 + 48) / (pc() - t) / 1e6)
        ops = n
        t = pc()
        for i in range(ops):
            write(i)
        results["alone"].append(ops / (pc() - t))
        snap = tables.snapshot()
        stop = threading.Event()
        counter: list[int] = []
        th = threading.Thread(target=_writer_rate, args=(write, stop, counter),
                              name="dstl-bench-writer")
        sink = io.BytesIO()
        th.start()
        t = pc()
        stats = snap.write(sink.write, metadata=b"{}")
        elapsed = pc() - t
        stop.set()
        th.join()
        results["mb_s"].append(n * (12 + 48) / elapsed / 1e6)
        results["during"].append(counter[0] / elapsed)
        assert stats.entries == n
    out: dict[str, Any] = {k: summary(v) for k, v in results.items()}
    out["writer_ratio"] = out["during"]["median"] / out["alone"]["median"]
    return out


def lmdb_figures(n: int, repeats: int) -> dict[str, Any]:
    kgs = KeyGroupRange(0, 127)
    value = b"v" * 48
    keys = [b"user-%08d" % i for i in range(n)]
    res: dict[str, list[float]] = {"put_batched": [], "put_single": [], "get": [], "mb_s": [],
                                   "alone": [], "during": []}
    for _ in range(repeats):
        d = tempfile.mkdtemp(prefix="dstl-bench-lmdb-")
        try:
            t_ = LmdbStateTable(d, kgs, map_size_bytes=1 << 30)
            t = pc()
            with t_.write_batch():
                for i, k in enumerate(keys):
                    t_.put(0, i & 127, k, b"", value)
            res["put_batched"].append(n / (pc() - t))
            single = min(n, 5000)
            t = pc()
            for i in range(single):
                t_.put(1, i & 127, keys[i], b"", value)
            res["put_single"].append(single / (pc() - t))
            t = pc()
            for i, k in enumerate(keys):
                t_.get(0, i & 127, k, b"")
            res["get"].append(n / (pc() - t))

            def write(i: int, tbl: LmdbStateTable = t_) -> None:
                with tbl.write_batch():
                    for j in range(100):
                        x = (i * 100 + j) * 7919 % n
                        tbl.put(0, x & 127, keys[x], b"", b"w" * 48)

            ops = max(n // 400, 20)
            t = pc()
            for i in range(ops):
                write(i)
            res["alone"].append(ops * 100 / (pc() - t))
            snap = t_.snapshot()
            stop = threading.Event()
            counter: list[int] = []
            th = threading.Thread(target=_writer_rate, args=(write, stop, counter),
                                  name="dstl-bench-lmdb-writer")
            sink = io.BytesIO()
            th.start()
            t = pc()
            snap.write(sink.write)
            elapsed = pc() - t
            stop.set()
            th.join()
            res["mb_s"].append(n * (12 + 48) / elapsed / 1e6)
            res["during"].append(counter[0] * 100 / elapsed)
            t_.close()
        finally:
            shutil.rmtree(d)
    out: dict[str, Any] = {k: summary(v) for k, v in res.items()}
    out["writer_ratio"] = out["during"]["median"] / out["alone"]["median"]
    return out


def profile(n: int) -> None:
    keys = keys_of(n)
    m: CopyOnWriteStateMap[str, None, int] = CopyOnWriteStateMap()
    pr = cProfile.Profile()
    pr.enable()
    for k in keys:
        m.put(k, None, 1)
    for k in keys:
        m.get(k, None)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(8)


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--profile", action="store_true", help="print a cProfile of the heap map")
    add_render(p)
    args = p.parse_args()
    if args.render:
        render_stored("state_tables", Path(args.render), markdown)
        return
    q = args.quick
    if args.profile:
        profile(200_000)
        return
    r = args.repeats
    n_tp = 100_000 if q else 1_000_000
    n_grow = 200_000 if q else 2_000_000
    n_snap = 100_000 if q else 1_000_000
    n_wo = 50_000 if q else 500_000
    n_lmdb = 50_000 if q else 500_000
    t0 = pc()
    fig: dict[str, Any] = {"sizes": {"throughput": n_tp, "grow": n_grow, "snapshot": n_snap,
                                     "writeout": n_wo, "lmdb": n_lmdb}, "goals": GOALS}
    fig["throughput"] = throughput(n_tp, r)
    fig["longest_put_gc_off"] = longest_put(n_grow, r, gc_enabled=False)
    fig["longest_put_gc_on"] = longest_put(n_grow, r if q else max(3, r // 2), gc_enabled=True)
    fig["snapshot_pause"] = snapshot_pause(n_snap, r)
    fig["writeout_heap"] = writeout_heap(n_wo, r)
    fig["lmdb"] = lmdb_figures(n_lmdb, r)
    fig["elapsed_s"] = pc() - t0

    cmd = "python bench/state_tables.py" + (" --quick" if q else "")
    publish("state_tables", fig, markdown, quick=q, command=cmd, no_doc=args.no_doc)


def markdown(fig: dict[str, Any]) -> str:
    """The docs section of a run, from its stored figures: the figures that have a goal."""
    tp, lp0, lp1 = fig["throughput"], fig["longest_put_gc_off"], fig["longest_put_gc_on"]
    sp, wo, lm, n = fig["snapshot_pause"], fig["writeout_heap"], fig["lmdb"], fig["sizes"]

    def ok(v: float, goal: float, le: bool = False) -> str:
        return "met" if (v <= goal if le else v >= goal) else "**missed**"

    rows = [
        [f"get, {n['throughput']:,} keys (M ops/s)", fmt(tp["map_get"], "", 1e-6),
         f"dict {fmt(tp['dict_get'], '', 1e-6)}", f"{tp['get_ratio']:.2f}x",
         f">= 0.25x: {ok(tp['get_ratio'], 0.25)}"],
        ["put, existing key (M ops/s)", fmt(tp["map_update"], "", 1e-6),
         f"dict {fmt(tp['dict_update'], '', 1e-6)}", f"{tp['update_ratio']:.2f}x",
         f">= 0.25x: {ok(tp['update_ratio'], 0.25)}"],
        ["put, new key incl. growth (M ops/s)", fmt(tp["map_insert"], "", 1e-6),
         f"dict {fmt(tp['dict_insert'], '', 1e-6)}", f"{tp['insert_ratio']:.2f}x",
         f">= 0.25x: {ok(tp['insert_ratio'], 0.25)}"],
        [f"longest put growing to {n['grow']:,}, GC off / on (ms)",
         f"{fmt(lp0['map_s'], '', 1e3)} / {lp1['map_s']['median'] * 1e3:,.0f}",
         f"dict {fmt(lp0['dict_s'], '', 1e3)}", f"{lp0['ratio']:.2f}x / {lp1['ratio']:.1f}x",
         f"<= 0.2x: {ok(max(lp0['ratio'], lp1['ratio']), 0.2, True)}"],
        [f"snapshot pause, {n['snapshot']:,} entries (ms)", fmt(sp["snapshot_s"], "", 1e3),
         f"`dict.copy()` {fmt(sp['dict_copy_s'], '', 1e3)}", f"{sp['ratio']:.2f}x",
         f"<= 0.3x: {ok(sp['ratio'], 0.3, True)}"],
        [f"heap writer during a write-out of {n['writeout']:,} (k puts/s)",
         fmt(wo["during"], "", 1e-3), f"alone {fmt(wo['alone'], '', 1e-3)}",
         f"{wo['writer_ratio']:.2f}x", f">= 0.5x: {ok(wo['writer_ratio'], 0.5)}"],
        [f"LMDB put, one write transaction for {n['lmdb']:,} (k puts/s)",
         fmt(lm["put_batched"], "", 1e-3), f"a transaction per put {fmt(lm['put_single'], '', 1e-3)}",
         f"{lm['put_batched']['median'] / lm['put_single']['median']:.1f}x", "—"],
        ["LMDB writer during a write-out (k puts/s, batches of 100)", fmt(lm["during"], "", 1e-3),
         f"alone {fmt(lm['alone'], '', 1e-3)}", f"{lm['writer_ratio']:.2f}x",
         f">= 0.5x: {ok(lm['writer_ratio'], 0.5)}"],
    ]
    return (table(["figure", "heap map / LMDB", "baseline (same run)", "ratio", "goal"], rows)
            + f"\n\nMedian (min..max) of {tp['map_get']['n']} repeats (GC-on growth: "
            f"{lp1['map_s']['n']}); keys `user-%08d`. Analysis: [state_tables.md](state_tables.md).")


if __name__ == "__main__":
    main()
