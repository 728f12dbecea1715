"""Keyed state backend benchmark: logging overhead, checkpoint latency, update latency
under materialization, log growth with and without the size trigger, value codec choice.

Figures, each against its baseline measured in the same run:

1. ``ValueState.update`` rate (updates/s, ns/update) of a ``ChangelogKeyedStateBackend`` on the
   heap and on LMDB vs the table alone over the same keys and values: ``HeapStateTables.put`` and
   ``LmdbStateTable.put`` inside one ``write_batch()`` with values pre-encoded by the safe codec.
   The backend's cost includes key encoding, the key group, value encoding and the log append.
   Materialization off; pre-emptive persist at its default; local-filesystem storage. The LMDB
   backend runs once as users call it (one LMDB transaction per update) and once inside
   ``backend.tables.write_batch()``, which isolates the logging overhead from the transaction.
2. Checkpoint latency p50/p99 (``snapshot(cp)`` call -> future resolved) of 8 heap backends in one
   ``ChangelogStorage`` on a local temp dir, one driver thread, 100 ms ticks of N updates per
   backend, a checkpoint (snapshot on all 8, wait, complete, subsume the previous) every tick;
   baseline: 8 bare ``ChangelogWriter`` s of the same kind of storage appending the identical
   change records and persisting/confirming on the same cadence. Goal: p99 <= 100 ms. Also the
   segments written per checkpoint.
3. Update latency (per update, timed in batches of 100 so the timer costs little) while a heap
   table of 1 M entries (quick: 200 k) is materialized on the backend's background thread
   (started with the backend's ``materialization.start()``; waited for at the end) vs the same
   number of batches without a materialization, alternating in one run. Goal: p99 <= 2x.
4. Space: (materialized snapshot bytes + log bytes since the last materialization, i.e. the
   checkpoint handle's ``full_size`` = ``lastFullSizeOfMaterialization`` +
   ``lastFullSizeOfNonMaterialization``) / (current table, encoded as a snapshot object now) on a
   sliding-window workload (each event added to W=5 overlapping window namespaces of a
   ReducingState, a window cleared W ticks after it opened, a checkpoint per tick with complete +
   subsume), with the size trigger (``materialize_log_ratio=2.0``, 64 KiB minimum) vs without;
   time trigger off in both (``materialization_interval_s=None``).
5. Value codec: encode+decode round trips/s of ``SafeCodec`` vs plain pickle (``PickleCodec``) vs
   a JSON codec with tags for bytes/tuples/non-str dict keys written here (a candidate, not
   product code) on a mix of typical values.

Run: ``.venv/bin/python bench/backend.py [--quick]`` (quick ~1.5 min, full a few minutes).
"""

from __future__ import annotations

import base64
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    add_render,
    fmt,
    parser,
    percentile,
    publish,
    render_stored,
    summary,
    table,
)
from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for  # noqa: E402
from dstl.errors import UsageError  # noqa: E402
from materializer.backend import ChangelogKeyedStateBackend  # noqa: E402
from materializer.changes import OP_SID, SET, encode_key_ns  # noqa: E402
from materializer.codecs import PickleCodec, SafeCodec  # noqa: E402
from materializer.handles import ChangelogStateBackendHandle  # noqa: E402
from materializer.lmdb_table import LmdbStateTable  # noqa: E402
from materializer.options import BackendOptions  # noqa: E402
from materializer.state_tables import HeapStateTables  # noqa: E402
from materializer.states import ReducingStateDescriptor, ValueStateDescriptor  # noqa: E402

pc = time.perf_counter
MP = 128
ALL = KeyGroupRange(0, MP - 1)
NO_MAT = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
GOAL_CP_P99_MS = 100.0
GOAL_UPDATE_P99_RATIO = 2.0


def keys_of(n: int) -> list[str]:
    return [f"user-{i:08d}" for i in range(n)]


class Tmp:
    """A temp directory per bench figure; each storage/table gets a fresh subdirectory."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="dstl-bench-backend-")
        self._n = 0

    def sub(self, name: str) -> str:
        self._n += 1
        return os.path.join(self.root, f"{name}-{self._n}")

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# ----------------------------------------------------------------- 1. update rate


def bench_update_rate(tmp: Tmp, n_keys: int, n_updates: int, repeats: int) -> dict[str, Any]:
    keys = keys_of(n_keys)
    rng = random.Random(1)
    seq = [rng.randrange(n_keys) for _ in range(n_updates)]
    seq_keys = [keys[i] for i in seq]
    seq_kb = [k.encode() for k in seq_keys]
    seq_kg = [key_group_for(kb, MP) for kb in seq_kb]
    seq_v = [i % 100 for i in range(n_updates)]
    enc = SafeCodec().encode
    pre = [enc(v) for v in range(100)]
    seq_vb = [pre[v] for v in seq_v]

    storage = ChangelogStorage(tmp.sub("rate-storage"), options=DstlOptions())
    heap_b = ChangelogKeyedStateBackend(storage, "heap", ALL, MP, table="heap", options=NO_MAT)
    lmdb_b = ChangelogKeyedStateBackend(storage, "lmdb", ALL, MP, table="lmdb", options=NO_MAT,
                                        local_directory=tmp.sub("rate-lmdb-backend"))
    heap_s = heap_b.get_state(ValueStateDescriptor("v"))
    lmdb_s = lmdb_b.get_state(ValueStateDescriptor("v"))
    heap_t = HeapStateTables(ALL)
    lmdb_t = LmdbStateTable(tmp.sub("rate-lmdb-table"), ALL)
    # steady state: every key exists in every table before measuring
    for b, s in ((heap_b, heap_s), (lmdb_b, lmdb_s)):
        with b.tables.write_batch():
            for k in keys:
                b.set_current_key(k)
                s.update(1)
    with lmdb_t.write_batch():
        for k in keys:
            kb = k.encode()
            lmdb_t.put(0, key_group_for(kb, MP), kb, b"", pre[1])
    for k in keys:
        heap_t.put(0, key_group_for(k.encode(), MP), k, None, 1)

    def table_heap() -> float:
        put = heap_t.put
        t0 = pc()
        for kg, k, v in zip(seq_kg, seq_keys, seq_v):
            put(0, kg, k, None, v)
        return pc() - t0

    def table_lmdb() -> float:
        put = lmdb_t.put
        t0 = pc()
        with lmdb_t.write_batch():
            for kg, kb, vb in zip(seq_kg, seq_kb, seq_vb):
                put(0, kg, kb, b"", vb)
        return pc() - t0

    def backend(b: ChangelogKeyedStateBackend, s: Any, batched: bool) -> Callable[[], float]:
        def run() -> float:
            set_key, update = b.set_current_key, s.update
            t0 = pc()
            if batched:
                with b.tables.write_batch():
                    for k, v in zip(seq_keys, seq_v):
                        set_key(k)
                        update(v)
            else:
                for k, v in zip(seq_keys, seq_v):
                    set_key(k)
                    update(v)
            return pc() - t0
        return run

    variants: dict[str, Callable[[], float]] = {
        "heap_table": table_heap, "heap_backend": backend(heap_b, heap_s, False),
        "lmdb_table": table_lmdb, "lmdb_backend": backend(lmdb_b, lmdb_s, False),
        "lmdb_backend_batched": backend(lmdb_b, lmdb_s, True),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):  # interleaved, so drift hits every variant alike
        for name, fn in variants.items():
            samples[name].append(n_updates / fn())
    out: dict[str, Any] = {"keys": n_keys, "updates_per_repeat": n_updates}
    for name, xs in samples.items():
        out[name] = {"per_s": summary(xs), "ns_per_update": 1e9 / summary(xs)["median"]}
    for b_name, t_name in (("heap_backend", "heap_table"), ("lmdb_backend", "lmdb_table"),
                           ("lmdb_backend_batched", "lmdb_table")):
        out[f"{b_name}_ratio"] = out[b_name]["ns_per_update"] / out[t_name]["ns_per_update"]
    out["preemptive_persists"] = storage.metrics().get(
        "ChangelogStorage.numberOfPreemptivePersists", 0.0)
    heap_b.close()
    lmdb_b.close()
    storage.close()
    heap_t.close()
    lmdb_t.close()
    return out


# ----------------------------------------------------------------- 2. checkpoint latency


def _keys_per_range(ranges: list[KeyGroupRange], per: int) -> list[list[str]]:
    out: list[list[str]] = [[] for _ in ranges]
    width = ranges[0].end - ranges[0].start + 1
    i = 0
    while min(len(x) for x in out) < per:
        k = f"user-{i:08d}"
        bucket = out[key_group_for(k.encode(), MP) // width]
        if len(bucket) < per:
            bucket.append(k)
        i += 1
    return out


def bench_checkpoints(tmp: Tmp, n_backends: int, ticks: int, per_tick: int, tick_s: float,
                      repeats: int) -> dict[str, Any]:
    width = MP // n_backends
    ranges = [KeyGroupRange(i * width, (i + 1) * width - 1) for i in range(n_backends)]
    keys = _keys_per_range(ranges, 5 * per_tick)
    enc = SafeCodec().encode
    # the exact change records the backend appends for ValueState.update(j) (state id 0)
    records = [[OP_SID.pack(SET, 0) + encode_key_ns(k.encode(), b"") + enc(j % per_tick)
                for j, k in enumerate(ks)] for ks in keys]
    rec_kgs = [[key_group_for(k.encode(), MP) for k in ks] for ks in keys]

    def run(kind: str) -> dict[str, Any]:
        storage = ChangelogStorage(tmp.sub(f"cp-{kind}"), options=DstlOptions())
        lat: list[float] = []
        objects: list[float] = []
        late = 0
        if kind == "backend":
            bs = [ChangelogKeyedStateBackend(storage, f"op-{i}", r, MP, table="heap",
                                             options=NO_MAT) for i, r in enumerate(ranges)]
            states = [b.get_state(ValueStateDescriptor("v")) for b in bs]
        else:
            ws = [storage.create_writer(f"w-{i}", r) for i, r in enumerate(ranges)]
        lock = threading.Lock()

        def record(t0: float) -> Callable[[Future[Any]], None]:
            def cb(_: Future[Any]) -> None:
                dt = pc() - t0
                with lock:
                    lat.append(dt)
            return cb

        start = pc()
        for tick in range(ticks):
            delay = start + tick * tick_s - pc()
            if delay > 0:
                time.sleep(delay)
            elif tick:
                late += 1
            base = tick * per_tick
            for i in range(n_backends):
                n = len(keys[i])
                if kind == "backend":
                    set_key, update, ks = bs[i].set_current_key, states[i].update, keys[i]
                    for j in range(base, base + per_tick):
                        set_key(ks[j % n])
                        update(j % per_tick)
                else:
                    append, recs, kgs = ws[i].append, records[i], rec_kgs[i]
                    for j in range(base, base + per_tick):
                        append(kgs[j % n], recs[j % n])
            cp = tick + 1
            before = storage.metrics()["ChangelogStorage.numberOfSegments"]
            futs: list[Future[Any]] = []
            tos: list[int] = []
            for i in range(n_backends):
                t0 = pc()
                f: Future[Any]
                if kind == "backend":
                    f = bs[i].snapshot(cp)
                else:
                    f = ws[i].persist(0, cp)
                    tos.append(ws[i].next_sqn())
                f.add_done_callback(record(t0))
                futs.append(f)
            for f in futs:
                f.result(60)
            for i in range(n_backends):
                if kind == "backend":
                    bs[i].notify_checkpoint_complete(cp)
                    bs[i].notify_checkpoint_subsumed(cp - 1)
                else:
                    ws[i].confirm(0, tos[i], cp)
            objects.append(storage.metrics()["ChangelogStorage.numberOfSegments"] - before)
        if kind == "backend":
            for b in bs:
                b.close()
        storage.close()
        with lock:
            xs = list(lat)
        return {"p50_ms": percentile(xs, 50) * 1e3, "p99_ms": percentile(xs, 99) * 1e3,
                "max_ms": max(xs) * 1e3, "objects": sum(objects) / len(objects),
                "late_ticks": late}

    runs: dict[str, list[dict[str, Any]]] = {"backend": [], "writers": []}
    for _ in range(repeats):
        for kind in runs:
            runs[kind].append(run(kind))
    out: dict[str, Any] = {"backends": n_backends, "ticks": ticks, "updates_per_tick": per_tick,
                           "tick_ms": tick_s * 1e3}
    for kind, rs in runs.items():
        out[kind] = {f: summary([r[f] for r in rs])
                     for f in ("p50_ms", "p99_ms", "max_ms", "objects", "late_ticks")}
    out["p99_ratio"] = out["backend"]["p99_ms"]["median"] / out["writers"]["p99_ms"]["median"]
    out["p50_ratio"] = out["backend"]["p50_ms"]["median"] / out["writers"]["p50_ms"]["median"]
    out["goal_met"] = out["backend"]["p99_ms"]["median"] <= GOAL_CP_P99_MS
    return out


# ----------------------------------------------------------------- 3. latency under materialization


def bench_update_latency(tmp: Tmp, n_entries: int, batch: int, repeats: int) -> dict[str, Any]:
    storage = ChangelogStorage(tmp.sub("lat-storage"), options=DstlOptions())
    b = ChangelogKeyedStateBackend(storage, "lat", ALL, MP, table="heap", options=NO_MAT)
    s = b.get_state(ValueStateDescriptor("v"))
    keys = keys_of(n_entries)
    t0 = pc()
    for i, k in enumerate(keys):
        b.set_current_key(k)
        s.update(i)
    fill_s = pc() - t0
    cp = 0

    def checkpoint() -> None:
        nonlocal cp
        cp += 1
        b.snapshot(cp).result(120)
        b.notify_checkpoint_complete(cp)
        b.notify_checkpoint_subsumed(cp - 1)

    checkpoint()
    rng = random.Random(3)
    set_key, update = b.set_current_key, s.update

    def one_batch() -> float:
        ks = [keys[rng.randrange(n_entries)] for _ in range(batch)]
        t = pc()
        for j, k in enumerate(ks):
            set_key(k)
            update(j)
        return (pc() - t) / batch

    p99_with: list[float] = []
    p99_without: list[float] = []
    p50_with: list[float] = []
    p50_without: list[float] = []
    max_with: list[float] = []
    max_without: list[float] = []
    sync_ms: list[float] = []
    mat_ms: list[float] = []
    batches: list[float] = []
    for _ in range(repeats):
        t = pc()
        fut = b.materialization.start()
        sync_ms.append((pc() - t) * 1e3)
        if fut is None:
            raise RuntimeError("materialization did not start")
        with_lat: list[float] = []
        while not fut.done():
            with_lat.append(one_batch())
        fut.result()
        checkpoint()
        without_lat = [one_batch() for _ in range(len(with_lat))]
        checkpoint()
        mat_ms.append(b.metrics()["ChangelogBackend.lat.lastDurationOfMaterialization"])
        batches.append(float(len(with_lat)))
        for xs, p50, p99, mx in ((with_lat, p50_with, p99_with, max_with),
                                 (without_lat, p50_without, p99_without, max_without)):
            p50.append(percentile(xs, 50) * 1e6)
            p99.append(percentile(xs, 99) * 1e6)
            mx.append(max(xs) * 1e6)
    snap_bytes = b.metrics()["ChangelogBackend.lat.lastFullSizeOfMaterialization"]
    b.close()
    storage.close()
    out: dict[str, Any] = {
        "entries": n_entries, "batch": batch, "fill_s": fill_s,
        "with_p50_us": summary(p50_with), "with_p99_us": summary(p99_with),
        "with_max_us": summary(max_with), "without_p50_us": summary(p50_without),
        "without_p99_us": summary(p99_without), "without_max_us": summary(max_without),
        "sync_part_ms": summary(sync_ms), "materialization_ms": summary(mat_ms),
        "batches_per_materialization": summary(batches), "snapshot_bytes": snap_bytes,
        "gc_threshold": gc.get_threshold(), "switch_interval_s": sys.getswitchinterval(),
    }
    out["p99_ratio"] = out["with_p99_us"]["median"] / out["without_p99_us"]["median"]
    out["p50_ratio"] = out["with_p50_us"]["median"] / out["without_p50_us"]["median"]
    out["goal_met"] = out["p99_ratio"] <= GOAL_UPDATE_P99_RATIO
    return out


# ----------------------------------------------------------------- 4. log / table space


def _table_bytes(b: ChangelogKeyedStateBackend) -> int:
    """The current table encoded as a snapshot object (same format and zstd level)."""
    snap = b.tables.snapshot()
    return len(snap.to_bytes(metadata=b"", encode=b.encode_entry,
                             zstd_level=b.options.zstd_level))


def bench_space(tmp: Tmp, ticks: int, n_keys: int, events: int, window: int, min_log: int,
                repeats: int) -> dict[str, Any]:
    keys = keys_of(n_keys)
    points = sorted({max(1, ticks * q // 8) for q in (1, 2, 4, 6, 8)})

    def run(trigger: bool) -> dict[str, Any]:
        opts = BackendOptions(materialization_interval_s=None,
                              materialize_log_ratio=2.0 if trigger else None,
                              materialize_min_log_bytes=min_log)
        storage = ChangelogStorage(tmp.sub("space"), options=DstlOptions())
        b = ChangelogKeyedStateBackend(storage, "win", ALL, MP, table="heap", options=opts)
        s = b.get_state(ReducingStateDescriptor("sum", lambda a, c: a + c))
        rng = random.Random(7)
        open_keys: dict[int, set[str]] = {}
        samples: list[dict[str, float]] = []
        cp = prev = failed = 0

        def checkpoint() -> ChangelogStateBackendHandle:
            # A checkpoint whose persist is in flight when a materialization completes can fail
            # ("range ... was truncated"): the backend truncates below its from_sqn. Count it,
            # abort it as a job would, and take the next one.
            nonlocal cp, prev, failed
            while True:
                cp += 1
                try:
                    h = b.snapshot(cp).result(60)
                except UsageError:
                    failed += 1
                    b.notify_checkpoint_aborted(cp)
                    continue
                b.notify_checkpoint_complete(cp)
                b.notify_checkpoint_subsumed(prev)
                prev = cp
                return h

        for tick in range(ticks):
            for _ in range(events):
                k = keys[rng.randrange(n_keys)]
                v = rng.randrange(1000)
                b.set_current_key(k)
                for w in range(tick, tick + window):  # window w collects ticks w-W+1 .. w
                    b.set_current_namespace(w)
                    s.add(v)
                    open_keys.setdefault(w, set()).add(k)
            b.set_current_namespace(tick)
            for k in sorted(open_keys.pop(tick, ())):  # window `tick` fires and is purged
                b.set_current_key(k)
                s.clear()
            b.set_current_namespace(None)
            h = checkpoint()
            if tick + 1 in points:
                fut = b.materialization.current
                if fut is not None:
                    fut.result(60)
                table = _table_bytes(b)
                m = b.metrics()
                samples.append({
                    "tick": tick + 1, "table_bytes": table, "full_size": h.full_size,
                    "materialized": h.materialized_size, "log": h.non_materialized_size,
                    "ratio": h.full_size / table,
                    "logBytesSinceMaterialization": m["ChangelogBackend.win."
                                                      "logBytesSinceMaterialization"],
                    "lastFullSizeOfMaterialization": m["ChangelogBackend.win."
                                                       "lastFullSizeOfMaterialization"],
                    "materializations": m["ChangelogBackend.win.completedMaterialization"],
                    "failed_checkpoints": failed})
        b.close()
        storage.close()
        return {"samples": samples}

    runs: dict[str, list[dict[str, Any]]] = {"with": [], "without": []}
    for _ in range(repeats):
        for label in runs:
            runs[label].append(run(label == "with"))
    out: dict[str, Any] = {"ticks": ticks, "keys": n_keys, "events_per_tick": events,
                           "window": window, "min_log_bytes": min_log, "points": points}
    for label, rs in runs.items():
        out[label] = [{f: summary([r["samples"][i][f] for r in rs])
                       for f in rs[0]["samples"][i]} for i in range(len(points))]
    out["end_ratio"] = (out["without"][-1]["ratio"]["median"]
                        / out["with"][-1]["ratio"]["median"])
    return out


# ----------------------------------------------------------------- 5. codecs


class TaggedJsonCodec:
    """Candidate (bench only, not product code): JSON with tags for bytes, tuples and dicts whose
    keys are not plain strings, so the safe codec's value domain round-trips exactly."""

    name = "json-tagged"

    def _to(self, v: Any) -> Any:
        t = type(v)
        if t is str or t is int or t is float or t is bool or v is None:
            return v
        if t is bytes:
            return {"$b": base64.b64encode(v).decode("ascii")}
        if t is list:
            return [self._to(x) for x in v]
        if t is tuple:
            return {"$t": [self._to(x) for x in v]}
        if t is dict:
            if all(type(k) is str and not k.startswith("$") for k in v):
                return {k: self._to(x) for k, x in v.items()}
            return {"$d": [[self._to(k), self._to(x)] for k, x in v.items()]}
        raise TypeError(t.__name__)

    @staticmethod
    def _hook(d: dict[str, Any]) -> Any:
        if len(d) == 1:
            if "$b" in d:
                return base64.b64decode(d["$b"])
            if "$t" in d:
                return tuple(d["$t"])
            if "$d" in d:
                return {(tuple(k) if type(k) is list else k): x for k, x in d["$d"]}
        return d

    def encode(self, value: Any) -> bytes:
        return json.dumps(self._to(value), separators=(",", ":")).encode("utf-8")

    def decode(self, data: bytes) -> Any:
        return json.loads(data, object_hook=self._hook)


def value_mix(n: int) -> list[Any]:
    """Typical state values: counters, sums, ids, small accumulators, records, blobs."""
    rng = random.Random(5)
    makers: list[Callable[[], Any]] = [
        lambda: rng.randrange(100),
        lambda: rng.randrange(1 << 40),
        lambda: rng.random() * 1000,
        lambda: f"user-{rng.randrange(10**6):06d}",
        lambda: rng.randbytes(16),
        lambda: rng.random() < 0.5,
        lambda: (rng.randrange(10**6), rng.randrange(1000)),                # (sum, count)
        lambda: [rng.randrange(1000) for _ in range(5)],
        lambda: {"count": rng.randrange(100), "sum": rng.random() * 100, "last": "click"},
        lambda: {"id": rng.randrange(10**6), "tags": ["a", "b"], "pos": (1.5, 2.5),
                 "raw": b"\x00\x01\x02"},
    ]
    return [makers[i % len(makers)]() for i in range(n)]


def bench_codecs(n: int, repeats: int) -> dict[str, Any]:
    values = value_mix(n)
    codecs: dict[str, Any] = {"safe": SafeCodec(), "pickle": PickleCodec(),
                              "json_tagged": TaggedJsonCodec()}
    for name, c in codecs.items():
        for v in values[:50]:
            back = c.decode(c.encode(v))
            if back != v or type(back) is not type(v):
                raise AssertionError(f"{name} does not round-trip {v!r}: {back!r}")

    def rate(c: Any) -> float:
        enc, dec = c.encode, c.decode
        t0 = pc()
        for v in values:
            dec(enc(v))
        return n / (pc() - t0)

    samples: dict[str, list[float]] = {name: [] for name in codecs}
    for _ in range(repeats):
        for name, c in codecs.items():
            samples[name].append(rate(c))
    out: dict[str, Any] = {"values": n}
    for name, c in codecs.items():
        out[name] = {"round_trips_per_s": summary(samples[name]),
                     "bytes_per_value": sum(len(c.encode(v)) for v in values) / n}
    p = out["pickle"]["round_trips_per_s"]["median"]
    out["safe_over_pickle"] = out["safe"]["round_trips_per_s"]["median"] / p
    out["json_over_pickle"] = out["json_tagged"]["round_trips_per_s"]["median"] / p
    return out


# ----------------------------------------------------------------- report


def _met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def markdown(f: dict[str, Any]) -> str:
    """The docs section of a run, from its stored figures."""
    r, c, lat, sp, cod = f["rate"], f["checkpoint"], f["latency"], f["space"], f["codec"]

    def kps(x: dict[str, Any]) -> str:
        return fmt(x["per_s"], scale=1e-3, digits=0)

    bk, wr = c["backend"], c["writers"]
    end_w, end_wo = sp["with"][-1], sp["without"][-1]
    rows = [
        [f"`ValueState.update`, heap, {r['keys']:,} keys (k/s)", kps(r["heap_backend"]),
         f"`HeapStateTables.put` {kps(r['heap_table'])}", f"{r['heap_backend_ratio']:.1f}x time",
         "—"],
        ["`ValueState.update`, LMDB, in `write_batch()` (k/s)", kps(r["lmdb_backend_batched"]),
         f"`LmdbStateTable.put` {kps(r['lmdb_table'])}",
         f"{r['lmdb_backend_batched_ratio']:.1f}x time (one txn per update "
         f"{r['lmdb_backend_ratio']:.1f}x)", "—"],
        [f"checkpoint latency p99, {c['backends']} backends (ms)", fmt(bk["p99_ms"], digits=1),
         f"{c['backends']} bare writers {fmt(wr['p99_ms'], digits=1)}", f"{c['p99_ratio']:.2f}x",
         f"<= {GOAL_CP_P99_MS:.0f} ms: {_met(c['goal_met'])}"],
        [f"update p99 while materializing {lat['entries']:,} entries (µs)",
         fmt(lat["with_p99_us"], digits=1),
         f"not materializing {fmt(lat['without_p99_us'], digits=1)}", f"{lat['p99_ratio']:.2f}x "
         f"(p50 {lat['p50_ratio']:.2f}x)",
         f"<= {GOAL_UPDATE_P99_RATIO:.0f}x: {_met(lat['goal_met'])}"],
        [f"(snapshot + log) / table after {sp['ticks']} ticks", f"size trigger "
         f"{fmt(end_w['ratio'], digits=1)}", f"time trigger only {fmt(end_wo['ratio'], digits=1)}",
         f"{sp['end_ratio']:.1f}x less", "—"],
        [f"value codec, {cod['values']:,} mixed values (k round trips/s)", "`SafeCodec` "
         f"{fmt(cod['safe']['round_trips_per_s'], scale=1e-3, digits=0)}", "pickle "
         f"{fmt(cod['pickle']['round_trips_per_s'], scale=1e-3, digits=0)}",
         f"{cod['safe_over_pickle']:.2f}x", "—"],
    ]
    return "\n".join([
        table(["figure", "DSTL", "baseline (same run)", "ratio", "goal"], rows), "",
        f"Median (min..max) of {f['repeats']} repeats, interleaved; local fs; checkpoint "
        "latency from `snapshot()` to its future resolving. The p99 while materializing is the "
        "GIL: the write-out encodes in Python on a thread of the writer's process (the executor "
        "agent moves it out: next section).",
    ])


def main() -> None:
    p = parser(__doc__ or "")
    add_render(p)
    args = p.parse_args()
    if args.render:
        render_stored("backend", Path(args.render), markdown)
        return
    q, reps = args.quick, args.repeats
    t_start = pc()
    tmp = Tmp()
    figures: dict[str, Any] = {"repeats": reps}
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("rate", lambda: bench_update_rate(tmp, 100_000, 50_000 if q else 200_000, reps)),
        ("checkpoint", lambda: bench_checkpoints(tmp, 8, 20 if q else 60, 1_000, 0.1, reps)),
        ("latency", lambda: bench_update_latency(tmp, 200_000 if q else 1_000_000, 100, reps)),
        ("space", lambda: bench_space(tmp, 120 if q else 300, 5_000, 400, 5, 64 * 1024, reps)),
        ("codec", lambda: bench_codecs(20_000 if q else 100_000, reps)),
    ]
    try:
        for i, (name, fn) in enumerate(steps, 1):
            print(f"{i}/{len(steps)} {name}", flush=True)
            t0 = pc()
            figures[name] = fn()
            figures[name]["elapsed_s"] = pc() - t0
    finally:
        tmp.cleanup()
    total = pc() - t_start
    figures["total_s"] = total
    publish("backend", figures, markdown, quick=q,
            command=f"python bench/backend.py{' --quick' if q else ''}", no_doc=args.no_doc)


if __name__ == "__main__":
    main()
