"""Recovery-time benchmark: restore time, bytes downloaded and downloads per object.

Figures, each against its baseline measured in the same run (medians of ``--repeats`` >= 5,
spread min..max, ratios next to the absolute numbers):

(a) **Backends per process sharing segments** (1, 2, 4, 8). The backends of one
    ``ChangelogStorage`` write 1,000 changes of 64 B values each per checkpoint for 10 (quick: 5)
    checkpoints, all snapshotting together, so every segment holds one change set of each
    backend. All of them are then restored in one process, one after another ("sequential") and
    in one thread each ("parallel"), through one shared ``LocalFileCache`` vs without a cache
    (``cache=None``: one ranged read per change-set run). Goals: with the cache each object is
    fetched once per process; >= 3x faster than without at 8 backends on moto + 20 ms.
(b) **State size** (10 k, 100 k, 1 M keys of 64 B values; quick: 10 k, 50 k): one backend owning
    all key groups, restored from its materialized snapshot + a log tail of 1 % of the keys, with
    the cache, and without it up to 100 k keys (quick: 10 k); baseline: one whole-object GET of
    the snapshot (the download floor).
(c) **Log length since the last materialization** (0, 10 k, 100 k, 1 M changes of 64 B values;
    quick: up to 50 k) on top of a 1,000-key snapshot: replay rate (changes / replay seconds of
    ``RestoreStats``) into the heap table (goal >= 500 k changes/s) and into LMDB; baseline: a bare
    replay loop (zstd-1 decompress -> ``struct`` decode -> dict set / LMDB put in one write
    transaction) over records of the same shape, as in reference B.4.
(e) **Log replay rates** (``--only-replay``, its own docs section ``recovery-replay``):
    (c)'s replay at 200 k and 1 M changes (quick: 50 k) into heap and LMDB against the
    download-and-decompress floor and the bare loop of the same run, and the count job (small
    int values: replay of N changes and load of a v1 snapshot of N keys, heap and LMDB, 1 M;
    quick: 50 k) against its floors; ``--before RESULT.json`` shows a run of earlier code beside
    (run that code's tree with this script and ``--no-doc --tag before``). Every
    restore of (e) is also run without prefetch (``restore_backend(..., prefetch=False)``, the
    path before prefetch existed), interleaved, against the serial GETs of its objects and the
    loading alone (the local-fs restore); and 4 partitions sharing every segment, restored one
    after another and in parallel through one cache, on moto, prefetch on and off.

(f) **Materialization at scale** (``--only-materialize``, docs section
    ``recovery-materialize``): one LMDB backend with 1 M and 4 M keys (``--mat-keys``; quick:
    50 k) of 64 B values: time and bytes of one file-level materialization (median of
    ``--repeats``); and the log tail a restore replays after each of 16 checkpoints of 50 k
    updates on 200 k keys with the size trigger alone (ratio 2, min 8 MiB), the backend's
    policy deciding after each checkpoint as the Spark task does.

Stores: the local filesystem (``LocalBlobStore`` in a temp dir) and a moto S3 server on loopback
behind ``FaultyFileSystem(latency_s=0.020)`` ("moto-loopback + 20 ms"; moto understates real S3
costs for big objects and overstates nothing else). Data sets are written once on the local
store and their objects copied to moto, so both restore identical bytes. Reads per object are
counted by a store wrapper (calls and bytes of ``get``/``get_range``) and, on moto, by
``FaultyFileSystem.calls("cat_file", path)`` (the GET requests S3 would bill). Every restore uses
a fresh ``ChangelogStorage`` and a fresh cache (a process that just started), timed from the
first ``restore_backend`` call to the last return. If heap replay misses 500 k changes/s, one
restore is profiled with cProfile and the top functions are reported.

Plots: ``docs/img/recovery_backends.png``, ``recovery_state_size.png``, ``recovery_log_length.png``.

Run: ``.venv/bin/python bench/recovery.py [--quick]`` (quick < 2 min, full < 8 min on 2 cores);
``--render RESULTS.json`` rebuilds the docs section of a stored run of any part.
"""

from __future__ import annotations

import cProfile
import gc
import hashlib
import io
import json
import os
import pstats
import re
import shutil
import struct
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import zstandard  # noqa: E402

from bench._common import (  # noqa: E402
    LoadSampler,
    add_render,
    fmt,
    load_brief,
    machine_info,
    parser,
    publish,
    render_stored,
    summary,
)
from bench._common import table as md_table  # noqa: E402
from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for  # noqa: E402
from dstl.stores import BlobStore, FsspecBlobStore, LocalBlobStore, ObjectInfo  # noqa: E402  # noqa: E402
from dstl.timer import ManualTimer  # noqa: E402
from materializer.backend import ChangelogKeyedStateBackend  # noqa: E402
from materializer.codecs import SafeCodec  # noqa: E402
from materializer.file_snapshot import read_file_snapshot_layout  # noqa: E402
from materializer.handles import ChangelogStateBackendHandle  # noqa: E402
from materializer.options import BackendOptions  # noqa: E402
from materializer.snapshot_format import (  # noqa: E402
    FOOTER_SIZE,
    RECORD_HEADER_SIZE,
    decode_footer,
    decode_index,
)
from materializer.states import ValueStateDescriptor  # noqa: E402
from restore import LocalFileCache, RestoreStats, restore_backend  # noqa: E402

MP = 128
LATENCY_S = 0.020
VALUE_BYTES = 64
REPLAY_GOAL = 500_000  # heap table, changes/s
REPLAY_GOAL_LMDB = 1_000_000  # LMDB table, changes/s
REPLAY_GOALS = {"heap": REPLAY_GOAL, "lmdb": REPLAY_GOAL_LMDB}
FLOOR_GOAL = 2.0  # snapshot restore within this multiple of GET + zstd-decompress
SPEEDUP_GOAL = 3.0
#: timers off: a benchmark backend must not materialize on its own
OPTS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
DESC = ValueStateDescriptor("v")
IMG = ROOT / "docs" / "img"
LOCAL, MOTO = "local fs", "moto-loopback + 20 ms"


def value(i: int) -> bytes:
    """A 64 B value that differs per change: 32 random hex digits and a counter and timestamp,
    so it compresses about as much as real state does (reference B.4: 3-4x), not more."""
    digest = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).hexdigest().encode()
    return digest + b"|n=%012d|t=%014d" % (i, 1_700_000_000_000 + i)


# ----------------------------------------------------------------- stores


class CountingStore:
    """A BlobStore wrapper counting reads (calls and bytes) per object.

    ``close()`` leaves the inner store open: several restore storages use one store in turn.
    """

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.location = inner.location
        self._lock = threading.Lock()
        self.reads: Counter[str] = Counter()
        self.bytes_read = 0

    def _count(self, key: str, n: int) -> None:
        with self._lock:
            self.reads[key] += 1
            self.bytes_read += n

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self._count(key, len(data))
        return data

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        data = self.inner.get_range(key, offset, length)
        self._count(key, len(data))
        return data

    def head(self, key: str) -> ObjectInfo | None:
        return self.inner.head(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, keys: Iterable[str]) -> None:
        self.inner.delete(keys)

    def close(self) -> None:
        """The inner store belongs to the caller."""


@dataclass
class Place:
    """A data set's objects in one store."""

    target: str
    store: BlobStore
    fs: Any = None  # the FaultyFileSystem on the fsspec path (counts GETs), else None
    prefix: str = ""  # object key -> path for ``fs.calls``

    def gets(self, keys: Iterable[str]) -> dict[str, int]:
        if self.fs is None:
            return {}
        return {k: int(self.fs.calls("cat_file", f"{self.prefix}/{k}")) for k in keys}


class Stores:
    """The local temp dir and (if it starts) the moto server with 20 ms injected latency."""

    def __init__(self, with_moto: bool = True) -> None:
        self.tmp = tempfile.mkdtemp(prefix="dstl-bench-recovery-")
        self.run = uuid.uuid4().hex[:8]
        self.server: Any = None
        self.ffs: Any = None
        self.error = ""
        if not with_moto:
            return
        try:
            import s3fs
            from support.faulty_fs import FaultyFileSystem
            from support.moto_server import create_bucket, s3_storage_options, start_moto_server

            self.server, endpoint = start_moto_server()
            create_bucket(endpoint, "bench")
            fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                                   **s3_storage_options(endpoint))
            self.ffs = FaultyFileSystem(fs, latency_s=LATENCY_S)
        except Exception as exc:  # the local figures are still worth having
            self.error = f"moto unavailable: {exc!r}"
            print(self.error)

    def local_root(self, name: str) -> str:
        return os.path.join(self.tmp, name)

    def place(self, name: str, objects: dict[str, int]) -> list[Place]:
        """The data set ``name`` (written under ``local_root(name)``) in every store."""
        local = LocalBlobStore(self.local_root(name))
        out = [Place(LOCAL, local)]
        if self.ffs is not None:
            prefix = f"bench/{self.run}/{name}"
            moto = FsspecBlobStore(self.ffs, prefix, location=f"s3://{prefix}")
            for key in objects:
                moto.put(key, local.get(key))
            out.append(Place(MOTO, moto, self.ffs, prefix))
        return out

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


# ----------------------------------------------------------------- data sets


@dataclass
class DataSet:
    handles: list[ChangelogStateBackendHandle]
    ranges: list[KeyGroupRange]
    probes: list[tuple[str, bytes]]  # one (key, expected value) per backend: a sanity check
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def objects(self) -> dict[str, int]:
        """Every object the handles reference, with its size (filled by ``_finish``)."""
        return dict(self.info["objects"])

    @property
    def segments(self) -> list[str]:
        return sorted({r.key for h in self.handles for n in h.non_materialized
                       for r in n.change_sets})


def _keys_by_backend(ranges: list[KeyGroupRange], per_backend: int) -> list[list[str]]:
    owner = [0] * MP
    for i, r in enumerate(ranges):
        for kg in range(r.start, r.end + 1):
            owner[kg] = i
    out: list[list[str]] = [[] for _ in ranges]
    n = 0
    while min(len(x) for x in out) < per_backend:
        k = f"user-{n:08d}"
        lst = out[owner[key_group_for(k.encode(), MP)]]
        if len(lst) < per_backend:
            lst.append(k)
        n += 1
    return out


def _finish(ds: DataSet, store: BlobStore) -> DataSet:
    keys = dict.fromkeys(k for h in ds.handles for k in h.referenced_keys())
    sizes = {k: int(info.size) for k in keys if (info := store.head(k)) is not None}
    ds.info["objects"] = sizes
    ds.info["stored_mb"] = sum(sizes.values()) / 1e6
    ds.info["snapshot_mb"] = sum(s.size for h in ds.handles for s in h.materialized) / 1e6
    ds.info["log_mb"] = sum(h.non_materialized_size for h in ds.handles) / 1e6
    return ds


def gen_shared(root: str, n_backends: int, rounds: int, per_round: int) -> DataSet:
    """(a): ``n_backends`` backends of one storage; every checkpoint one shared segment."""
    timer = ManualTimer()
    store = LocalBlobStore(root)
    ranges = [KeyGroupRange.of_operator(MP, n_backends, i) for i in range(n_backends)]
    keys = _keys_by_backend(ranges, per_round)
    probes: list[tuple[str, bytes]] = []
    with ChangelogStorage(store=CountingStore(store), options=DstlOptions(persist_delay_s=1.0),
                          timer=timer) as storage:
        backends = [ChangelogKeyedStateBackend(storage, f"op/{i}", ranges[i], MP, options=OPTS)
                    for i in range(n_backends)]
        states = [b.get_state(DESC) for b in backends]
        handles: list[ChangelogStateBackendHandle] = []
        n = 0
        for cp in range(1, rounds + 1):
            for b, st, ks in zip(backends, states, keys):
                for k in ks:
                    b.set_current_key(k)
                    st.update(value(n))
                    n += 1
            futures = [b.snapshot(cp) for b in backends]
            timer.advance(1.0)  # the persist delay: every backend's change set in one segment
            handles = [f.result(60) for f in futures]
            for b in backends:
                b.notify_checkpoint_complete(cp)
        for b, st, ks in zip(backends, states, keys):
            b.set_current_key(ks[-1])
            probes.append((ks[-1], st.value()))
            b.close()
    ds = _finish(DataSet(handles, ranges, probes,
                         {"backends": n_backends, "rounds": rounds,
                          "changes_per_backend_per_checkpoint": per_round, "changes": n}), store)
    ds.info["segments"] = len(ds.segments)
    ds.info["change_sets"] = sum(len(x) for h in handles for x in h.non_materialized)
    return ds


def gen_single(root: str, state_keys: int, log_changes: int, log_keys: int,
               checkpoint_every: int, *, table: str = "heap", materializations: int = 1,
               options: BackendOptions = OPTS) -> DataSet:
    """(b)/(c)/(d): one backend owning every key group: ``state_keys`` keys materialized
    (``materializations`` times, each after a checkpoint and one more update; the last one is
    the restore's), then ``log_changes`` updates over ``log_keys`` keys, one checkpoint per
    ``checkpoint_every``."""
    store = LocalBlobStore(root)
    rng = KeyGroupRange(0, MP - 1)
    with ChangelogStorage(store=CountingStore(store)) as storage:
        b = ChangelogKeyedStateBackend(storage, "op", rng, MP, options=options, table=table)
        st = b.get_state(DESC)
        with b.write_batch():
            for i in range(state_keys):
                b.set_current_key(f"user-{i:08d}")
                st.update(value(i))
        cp = 0
        mat_s: list[float] = []
        for m in range(materializations):
            if m:
                b.set_current_key("user-00000000")
                st.update(value(0))
                cp += 1
                b.snapshot(cp).result(120)
                b.notify_checkpoint_complete(cp)
            t0 = time.perf_counter()
            ref = b.materialize_now(600)
            mat_s.append(time.perf_counter() - t0)
            assert ref is not None
        materialize_s = mat_s[-1]
        h: ChangelogStateBackendHandle | None = None
        for i in range(log_changes):
            b.set_current_key(f"user-{i % log_keys:08d}")
            st.update(value(state_keys + i))
            if (i + 1) % checkpoint_every == 0 or i + 1 == log_changes:
                cp += 1
                h = b.snapshot(cp).result(120)
                b.notify_checkpoint_complete(cp)
        if h is None:
            cp += 1
            h = b.snapshot(cp).result(120)
            b.notify_checkpoint_complete(cp)
        probe_key = f"user-{(log_changes - 1) % log_keys:08d}" if log_changes else "user-00000000"
        b.set_current_key(probe_key)
        probe = (probe_key, st.value())
        b.close()
    ds = _finish(DataSet([h], [rng], [probe],
                         {"state_keys": state_keys, "log_changes": log_changes,
                          "materialize_s": materialize_s, "materialize_runs_s": mat_s,
                          "materialize_bytes": ref.size, "checkpoints": cp}), store)
    ds.info["change_sets"] = sum(len(x) for x in h.non_materialized)
    ds.info["segments"] = len(ds.segments)
    return ds


# ----------------------------------------------------------------- one restore


def restore_all(place: Place, ds: DataSet, *, cache: bool, parallel: bool = False,
                table: str = "heap", profile: cProfile.Profile | None = None,
                prefetch: bool = True) -> dict[str, Any]:
    """Restore every backend of ``ds`` in a fresh storage (+ fresh cache); time and count."""
    counting = CountingStore(place.store)
    objects = ds.objects
    gets_before = place.gets(objects)
    tmp = tempfile.mkdtemp(prefix="dstl-bench-cache-")
    c = LocalFileCache(os.path.join(tmp, "cache")) if cache else None
    storage = ChangelogStorage(store=counting)
    restored: list[ChangelogKeyedStateBackend | None] = [None] * len(ds.handles)
    stats = [RestoreStats() for _ in ds.handles]

    def one(i: int) -> None:
        restored[i] = restore_backend([ds.handles[i]], storage, ds.ranges[i], table=table,
                                      cache=c, options=OPTS, stats=stats[i], prefetch=prefetch)

    gc.collect()
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        if profile is not None:
            profile.enable()
        if parallel and len(ds.handles) > 1:
            with ThreadPoolExecutor(len(ds.handles), thread_name_prefix="bench-restore") as ex:
                for f in [ex.submit(one, i) for i in range(len(ds.handles))]:
                    f.result()
        else:
            for i in range(len(ds.handles)):
                one(i)
        if profile is not None:
            profile.disable()
        seconds = time.perf_counter() - t0
        cpu_seconds = time.process_time() - c0
        for b, (k, v) in zip(restored, ds.probes):  # untimed sanity check
            assert b is not None
            b.set_current_key(k)
            got = b.get_state(DESC).value()
            assert got == v, f"restored {k!r} = {got!r}, expected {v!r}"
        cstats = c.stats() if c is not None else {}
    finally:
        for b in restored:
            if b is not None:
                b.close()
        if c is not None:
            c.close()
        storage.close()
        shutil.rmtree(tmp, ignore_errors=True)
    gets_after = place.gets(objects)
    reads = [counting.reads[k] for k in objects]
    gets = [gets_after[k] - gets_before[k] for k in gets_after]
    seg = set(ds.segments)
    return {
        "seconds": seconds,
        # the process's CPU time over the same span: a rate per CPU second hardly depends on
        # how many other processes share the cores (wall rates on a loaded machine do)
        "cpu_seconds": cpu_seconds,
        "bytes": counting.bytes_read,
        "reads_per_object_mean": sum(reads) / max(1, len(reads)),
        "reads_per_object_max": max(reads, default=0),
        "reads_per_segment_max": max((counting.reads[k] for k in seg), default=0),
        "gets_per_object_mean": sum(gets) / len(gets) if gets else None,
        "gets_per_object_max": max(gets) if gets else None,
        "cache": cstats,
        "changes": sum(s.get("changes", 0) for s in stats),
        "entries": sum(s.get("entries", 0) for s in stats),
        "replay_seconds": sum(s.get("replay_seconds", 0.0) for s in stats),
        "snapshot_seconds": sum(s.get("snapshot_seconds", 0.0) for s in stats),
    }


def measure(place: Place, ds: DataSet, repeats: int, **kw: Any) -> dict[str, Any]:
    return summarise([restore_all(place, ds, **kw) for _ in range(repeats)])


def measure_interleaved(place: Place, ds: DataSet, repeats: int,
                        variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``measure`` of each variant, their repeats interleaved (A B A B ...), so a change of the
    machine's load during the run hits every variant alike and their ratio holds."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, kw in variants.items():
            runs[name].append(restore_all(place, ds, **kw))
    return {name: summarise(rs) for name, rs in runs.items()}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"seconds": summary([r["seconds"] for r in runs]),
                           "mb_downloaded": summary([r["bytes"] / 1e6 for r in runs])}
    for name in ("reads_per_object_mean", "reads_per_object_max", "reads_per_segment_max",
                 "gets_per_object_mean", "gets_per_object_max"):
        xs = [r[name] for r in runs if r[name] is not None]
        out[name] = max(xs) if xs else None  # worst repeat
    out["changes"] = runs[0]["changes"]
    out["entries"] = runs[0]["entries"]
    out["snapshot_s"] = summary([r["snapshot_seconds"] for r in runs])
    out["replay_s"] = summary([r["replay_seconds"] for r in runs])
    if runs[0]["changes"]:
        out["replay_per_s"] = summary([r["changes"] / r["replay_seconds"] for r in runs])
        out["changes_per_cpu_s"] = summary([r["changes"] / r["cpu_seconds"] for r in runs])
    if runs[0]["entries"]:
        out["load_entries_per_s"] = summary([r["entries"] / r["snapshot_seconds"] for r in runs])
    out["cache_downloads"] = runs[-1]["cache"].get("downloads")
    out["cache_hits"] = runs[-1]["cache"].get("hits")
    out["prefetch_joined"] = runs[-1]["cache"].get("prefetch_joined")
    return out


# ----------------------------------------------------------------- (a) backends


def bench_backends(stores: Stores, counts: list[int], rounds: int, per_round: int,
                   repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in counts:
        name = f"shared-{n}"
        ds = gen_shared(stores.local_root(name), n, rounds, per_round)
        for place in stores.place(name, ds.objects):
            for mode in ("sequential", "parallel"):
                if n == 1 and mode == "parallel":
                    continue
                par = mode == "parallel"
                nc = measure(place, ds, repeats, cache=False, parallel=par)
                wc = measure(place, ds, repeats, cache=True, parallel=par)
                out[f"{place.target}/{mode}/{n}"] = {
                    "store": place.target, "mode": mode, "backends": n,
                    "data": {k: v for k, v in ds.info.items() if k != "objects"},
                    "no_cache": nc, "cache": wc,
                    "speedup": nc["seconds"]["median"] / wc["seconds"]["median"]}
                print(f"(a) {place.target} {mode} {n}: no cache "
                      f"{nc['seconds']['median']:.3f}s, cache {wc['seconds']['median']:.3f}s")
    return out


# ----------------------------------------------------------------- (b) state size


def download_floor(place: Place, key: str, repeats: int) -> dict[str, Any]:
    """The floor of any restore from snapshot ``key``: one whole-object GET, then zstd-decompress
    every block (no parsing, no table). ``get_s``: the GET alone."""
    get_s, total_s = [], []
    raw = 0
    dz = zstandard.ZstdDecompressor()
    for _ in range(repeats):
        t0 = time.perf_counter()
        data = place.store.get(key)
        t1 = time.perf_counter()
        footer = decode_footer(data[-FOOTER_SIZE:], len(data), key=key)
        index = decode_index(data[footer.index_offset:footer.index_offset + footer.index_length],
                             footer, key=key)
        raw = sum(len(dz.decompress(data[b.offset + RECORD_HEADER_SIZE:b.offset + b.length]))
                  for b in index.blocks)
        total_s.append(time.perf_counter() - t0)
        get_s.append(t1 - t0)
    return {"get_s": summary(get_s), "floor_s": summary(total_s), "raw_mb": raw / 1e6}


def bench_state_size(stores: Stores, sizes: list[int], nocache_max_keys: int,
                     repeats: int) -> dict[str, Any]:
    """Restore from a snapshot of each size into the heap table (with the cache, and without it
    up to ``nocache_max_keys``: its extra cost is per-request latency, the same at every size)
    and into LMDB (with the cache), against the download-and-decompress floor."""
    out: dict[str, Any] = {}
    for n in sizes:
        name = f"state-{n}"
        tail = max(1000, n // 100)
        ds = gen_single(stores.local_root(name), n, tail, n, tail)
        snap_key = ds.handles[0].materialized[0].key
        for place in stores.place(name, ds.objects):
            floor = download_floor(place, snap_key, repeats)
            nc = measure(place, ds, repeats, cache=False) if n <= nocache_max_keys else None
            wc = measure(place, ds, repeats, cache=True)
            lm = measure(place, ds, repeats, cache=True, table="lmdb")
            f = floor["floor_s"]["median"]
            out[f"{place.target}/{n}"] = {
                "store": place.target, "keys": n, "tail_changes": tail,
                "data": {k: v for k, v in ds.info.items() if k != "objects"},
                "download_floor_s": floor["get_s"], "floor": floor, "no_cache": nc, "cache": wc,
                "lmdb": lm,
                "speedup": nc["seconds"]["median"] / wc["seconds"]["median"] if nc else None,
                "cache_vs_floor": wc["seconds"]["median"] / floor["get_s"]["median"],
                "heap_vs_floor": wc["snapshot_s"]["median"] / f,
                "lmdb_vs_floor": lm["snapshot_s"]["median"] / f}
            print(f"(b) {place.target} {n}: floor {f:.3f}s, heap snapshot "
                  f"{wc['snapshot_s']['median']:.3f}s, lmdb {lm['snapshot_s']['median']:.3f}s")
    return out


# ----------------------------------------------------------------- (c) log length


# ----------------------------------------------------------------- (d) LMDB file snapshots


def file_floor(place: Place, key: str, repeats: int) -> dict[str, Any]:
    """The floor of a restore from the v2 (file-level) snapshot ``key``: one whole-object GET,
    then zstd-decompress its data into memory (no file, no checks beyond zstd's)."""
    get_s, total_s = [], []
    raw = 0
    dz = zstandard.ZstdDecompressor()
    for _ in range(repeats):
        t0 = time.perf_counter()
        data = place.store.get(key)
        t1 = time.perf_counter()
        layout = read_file_snapshot_layout(lambda o, n, d=data: d[o:o + n], len(data), key=key)
        raw = len(dz.decompress(data[layout.data_offset:layout.data_offset + layout.data_length]))
        total_s.append(time.perf_counter() - t0)
        get_s.append(t1 - t0)
    return {"get_s": summary(get_s), "floor_s": summary(total_s), "raw_mb": raw / 1e6}


def _half(ds: DataSet, n: int) -> DataSet:
    """The same checkpoint restored by a backend owning the lower half of the key groups."""
    half = KeyGroupRange(0, MP // 2 - 1)
    i = next(i for i in range(n) if key_group_for(f"user-{i:08d}".encode(), MP) in half)
    return DataSet(ds.handles, [half], [(f"user-{i:08d}", value(i))], ds.info)


def bench_file_snapshots(stores: Stores, sizes: list[int], repeats: int,
                         heap_max_keys: int) -> dict[str, Any]:
    """One LMDB backend owning all key groups, materialized as a v2 (file-level)
    snapshot with no log after it; its restore into LMDB (install by rename: the whole range;
    range copy: half the key groups) and into the heap, against GET + zstd-decompress."""
    out: dict[str, Any] = {}
    for n in sizes:
        name = f"filesnap-{n}"
        ds = gen_single(stores.local_root(name), n, 0, n, 1, table="lmdb",
                        materializations=repeats)
        v1 = gen_single(stores.local_root(f"{name}-v1"), n, 0, n, 1, table="lmdb",
                        materializations=repeats,
                        options=OPTS.replace(lmdb_snapshot_format="entries"))
        snap_key = ds.handles[0].materialized[0].key
        v1_places = {p.target: p for p in stores.place(f"{name}-v1", v1.objects)}
        for place in stores.place(name, ds.objects):
            assert place.store.get_range(snap_key, 5, 1)[0] == 2, "not a v2 snapshot"
            floor = file_floor(place, snap_key, repeats)
            lm = measure(place, ds, repeats, cache=True, table="lmdb")
            nc = measure(place, ds, repeats, cache=False, table="lmdb")
            half = measure(place, _half(ds, n), repeats, cache=True, table="lmdb")
            heap = (measure(place, ds, repeats, cache=True, table="heap")
                    if n <= heap_max_keys else None)
            entries = measure(v1_places[place.target], v1, repeats, cache=True, table="lmdb")
            f = floor["floor_s"]["median"]
            out[f"{place.target}/{n}"] = {
                "store": place.target, "keys": n,
                "data": {k: v for k, v in ds.info.items() if k != "objects"},
                "materialize_s": summary(ds.info["materialize_runs_s"]),
                "floor": floor, "lmdb": lm, "lmdb_no_cache": nc, "lmdb_half": half,
                "heap": heap, "entries_lmdb": entries,
                "entries_data": {k: v for k, v in v1.info.items() if k != "objects"},
                "entries_materialize_s": summary(v1.info["materialize_runs_s"]),
                "lmdb_vs_floor": lm["snapshot_s"]["median"] / f,
                "lmdb_total_vs_floor": lm["seconds"]["median"] / f,
                "lmdb_no_cache_vs_floor": nc["snapshot_s"]["median"] / f}
            print(f"(d) {place.target} {n}: floor {f:.3f}s, lmdb load "
                  f"{lm['snapshot_s']['median']:.3f}s (no cache "
                  f"{nc['snapshot_s']['median']:.3f}s), half {half['snapshot_s']['median']:.3f}s"
                  f", heap {heap['snapshot_s']['median'] if heap else float('nan'):.3f}s")
    return out


def markdown_file_snapshots(figs: dict[str, Any], before: dict[str, Any] | None = None
                            ) -> str:
    """Section ``recovery-filesnap``: an LMDB file-level (v2) snapshot's validated restore
    against GET + zstd-decompress (and against ``before``, a run on earlier code)."""
    fd = figs["file_snapshots"]
    old = (before or {}).get("file_snapshots", {})
    rows = []
    for name, r in sorted(fd.items(), key=lambda kv: (kv[1]["store"], kv[1]["keys"])):
        lm, vs = r["lmdb"], r["lmdb_vs_floor"]
        rows.append([f"install (validated), {r['keys']:,} keys, {r['store']} (s)",
                     _s(lm["snapshot_s"]), f"GET + zstd-decompress {_ms(r['floor']['floor_s'])}",
                     f"{vs:.1f}x", f"<= {FLOOR_GOAL:.0f}x: {_met(vs <= FLOOR_GOAL)}"])
        was = old.get(name)
        if was is not None:
            x = lm["snapshot_s"]["median"] / was["lmdb"]["snapshot_s"]["median"]
            rows.append([f"the same against the code before ({(before or {}).get('git', '?')})",
                         _s(lm["snapshot_s"]), f"before {_s(was['lmdb']['snapshot_s'])}",
                         f"{x:.2f}x", f"<= {FLOOR_GOAL:.0f}x: {_met(x <= FLOOR_GOAL)}"])
    return "\n".join([
        md_table(["figure", "DSTL", "floor or before (same run)", "ratio", "goal"], rows), "",
        "An LMDB backend's v2 snapshot (the LMDB file, zstd 1) restored into LMDB with the "
        "cache: download, crc check, decompress, validate the file, rename. Median (min..max) "
        f"of {figs['repeats']} repeats; {load_brief(figs.get('load'))}.",
    ])


def bare_replay(n: int, repeats: int) -> dict[str, Any]:
    """Reference B.4's replay loop over ``n`` records shaped like DSTL's value changes."""
    import lmdb

    head = struct.Struct("<BHII")
    buf = bytearray()
    for i in range(n):
        k = b"user-%08d" % (i % 100_000)
        v = value(i)
        buf += head.pack(1, i % MP, len(k), len(v))
        buf += k
        buf += v
    frame = zstandard.ZstdCompressor(level=1).compress(bytes(buf))
    unpack = head.unpack_from
    hs = head.size

    def records() -> Iterator[tuple[bytes, bytes]]:
        data = zstandard.ZstdDecompressor().decompress(frame)
        pos, end = 0, len(data)
        while pos < end:
            _, _, kl, vl = unpack(data, pos)
            pos += hs
            k = data[pos:pos + kl]
            pos += kl
            yield k, data[pos:pos + vl]
            pos += vl

    def to_dict() -> float:
        d: dict[bytes, bytes] = {}
        t0 = time.perf_counter()
        for k, v in records():
            d[k] = v
        return n / (time.perf_counter() - t0)

    def to_lmdb() -> float:
        tmp = tempfile.mkdtemp(prefix="dstl-bench-lmdb-")
        env = lmdb.open(tmp, map_size=1 << 30, sync=False, metasync=False)
        try:
            t0 = time.perf_counter()
            with env.begin(write=True) as txn:
                put = txn.put
                for k, v in records():
                    put(k, v)
            return n / (time.perf_counter() - t0)
        finally:
            env.close()
            shutil.rmtree(tmp, ignore_errors=True)

    return {"records": n, "compressed_mb": len(frame) / 1e6,
            "dict_per_s": summary([to_dict() for _ in range(repeats)]),
            "lmdb_per_s": summary([to_lmdb() for _ in range(repeats)])}


def log_floor(place: Place, ds: DataSet, repeats: int) -> dict[str, Any]:
    """The floor of replaying ``ds``'s log: GET every segment whole and zstd-decompress each
    change-set record the handles name (no parsing, no table)."""
    refs: dict[str, list[tuple[int, int]]] = {}
    for h in ds.handles:
        for n in h.non_materialized:
            for r in n.change_sets:
                refs.setdefault(r.key, []).append((r.offset, r.length))
    dz = zstandard.ZstdDecompressor()
    xs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for key, rs in refs.items():
            data = place.store.get(key)
            for off, ln in rs:
                dz.decompress(data[off + RECORD_HEADER_SIZE:off + ln])
        xs.append(time.perf_counter() - t0)
    return summary(xs)


def gets_floor(place: Place, ds: DataSet, repeats: int) -> dict[str, Any]:
    """The downloads of a restore of ``ds`` one after another: GET every object it reads
    (snapshot and segments) whole, nothing else."""
    keys = list(ds.objects)
    xs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for key in keys:
            place.store.get(key)
        xs.append(time.perf_counter() - t0)
    return summary(xs)


def bench_log_length(stores: Stores, lengths: list[int], repeats: int,
                     control: bool = False) -> dict[str, Any]:
    """(c)/(e): replay of logs of ``lengths`` changes; with ``control``, every restore is also
    run without prefetch (interleaved) and the serial GETs of its objects are timed."""
    out: dict[str, Any] = {}
    for n in lengths:
        name = f"log-{n}"
        ds = gen_single(stores.local_root(name), 1000, n, 100_000, 100_000)
        for place in stores.place(name, ds.objects):
            floor = log_floor(place, ds, repeats)
            gets = gets_floor(place, ds, repeats) if control else None
            for table in ("heap", "lmdb"):
                variants = {"cache": {"cache": True, "table": table}}
                if control:
                    variants["no_prefetch"] = {"cache": True, "table": table, "prefetch": False}
                rs = measure_interleaved(place, ds, repeats, variants)
                r = rs["cache"]
                out[f"{place.target}/{table}/{n}"] = {
                    "store": place.target, "table": table, "changes": n,
                    "data": {k: v for k, v in ds.info.items() if k != "objects"}, "cache": r,
                    "no_prefetch": rs.get("no_prefetch"), "gets_s": gets,
                    "floor_s": floor,
                    "replay_vs_floor": (r["replay_s"]["median"] / floor["median"]
                                        if n else None)}
                rate = r.get("replay_per_s", {}).get("median", 0.0)
                print(f"(c) {place.target} {table} {n}: {r['seconds']['median']:.3f}s, "
                      f"replay {rate:,.0f}/s")
    return out


def profile_replay(stores: Stores, n: int) -> dict[str, Any]:
    """One heap restore of an ``n``-change log from the local store under cProfile."""
    name = f"log-{n}"
    ds = gen_single(stores.local_root(name) + "-profile", 1000, n, 100_000, 100_000)
    place = Place(LOCAL, LocalBlobStore(stores.local_root(name) + "-profile"))
    prof = cProfile.Profile()
    restore_all(place, ds, cache=True, profile=prof)
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())  # type: ignore[attr-defined]
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
    top = []
    for (file, line, func), (_cc, ncalls, tt, ct, _callers) in rows[:12]:
        where = f"{os.path.relpath(file, ROOT) if file.startswith(str(ROOT)) else file}:{line}"
        top.append({"function": f"{func} ({where})", "calls": ncalls, "tottime_s": tt,
                    "cumtime_s": ct, "share": tt / total if total else 0.0})
    groups: Counter[str] = Counter()
    for (file, _line, func), (_cc, _n, tt, _ct, _callers) in rows:
        groups[_profile_group(file, func)] += tt
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
    print(text.getvalue())
    return {"changes": n, "total_tottime_s": total, "top": top,
            "groups": {g: t / total for g, t in groups.most_common()}}


def _profile_group(file: str, func: str) -> str:
    """The layer of the replay path a profiled function belongs to."""
    if file.endswith(("materializer/codecs.py", "materializer/states.py")) \
            or "Unpickler" in func or "BytesIO" in func:
        return "value codec (safe unpickler per value)"
    if file.endswith("materializer/changes.py") or "unpack_from" in func:
        return "change-record decoding"
    if file.endswith("materializer/backend.py") or "of 'bytes' objects" in func:
        return "backend dispatch + key/namespace decoding"
    if file.endswith(("state_tables.py", "cow_table.py", "cow_map.py")):
        return "heap table put chain (facade -> table -> copy-on-write map)"
    if file.endswith(("dstl/segment.py", "restore/reader.py", "restore/cache.py")) \
            or "decompress" in func or "crc32" in func or "fsync" in func:
        return "log reading (cache, CRC, zstd, body parsing)"
    return "other (restore setup, restore.py loop)"


# ----------------------------------------------------------------- plots


def _errbar(ax: Any, xs: list[float], ss: list[dict[str, float]], label: str,
            style: str) -> None:
    med = [s["median"] for s in ss]
    lo = [s["median"] - s["min"] for s in ss]
    hi = [s["max"] - s["median"] for s in ss]
    ax.errorbar(xs, med, yerr=[lo, hi], fmt=style, capsize=3, label=label)


def plot_backends(fig_a: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, mode in zip(axes, ("sequential", "parallel")):
        for target, style in ((LOCAL, "-"), (MOTO, "--")):
            rows = sorted((r for r in fig_a.values()
                           if r["store"] == target and (r["mode"] == mode or r["backends"] == 1)),
                          key=lambda r: r["backends"])
            if not rows:
                continue
            xs = [r["backends"] for r in rows]
            _errbar(ax, xs, [r["no_cache"]["seconds"] for r in rows], f"{target}, no cache",
                    "o" + style)
            _errbar(ax, xs, [r["cache"]["seconds"] for r in rows], f"{target}, cache", "s" + style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.set_xlabel("backends per process (restored together)")
        ax.set_title(f"{mode} restores")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("restore time of all backends (s)")
    axes[0].legend(fontsize=8)
    fig.suptitle("(a) restore time vs backends sharing segments: shared cache vs none")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_state_size(fig_b: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for target, style in ((LOCAL, "-"), (MOTO, "--")):
        rows = sorted((r for r in fig_b.values() if r["store"] == target), key=lambda r: r["keys"])
        if not rows:
            continue
        xs = [r["keys"] for r in rows]
        nc = [r for r in rows if r["no_cache"] is not None]
        _errbar(ax, [r["keys"] for r in nc], [r["no_cache"]["seconds"] for r in nc],
                f"{target}, no cache", "o" + style)
        _errbar(ax, xs, [r["cache"]["seconds"] for r in rows], f"{target}, cache", "s" + style)
        _errbar(ax, xs, [r["download_floor_s"] for r in rows], f"{target}, 1 GET of snapshot",
                "x:")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("keys in the materialized snapshot (+1 % log tail)")
    ax.set_ylabel("restore time (s)")
    ax.set_title("(b) restore time vs state size (heap table)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_log_length(fig_c: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for target, style in ((LOCAL, "-"), (MOTO, "--")):
        for table, mark in (("heap", "o"), ("lmdb", "s")):
            rows = sorted((r for r in fig_c.values()
                           if r["store"] == target and r["table"] == table),
                          key=lambda r: r["changes"])
            if not rows:
                continue
            _errbar(ax, [r["changes"] for r in rows], [r["cache"]["seconds"] for r in rows],
                    f"{target}, {table}", mark + style)
    ax.set_xscale("symlog", linthresh=10_000)
    ax.set_yscale("log")
    ax.set_xlabel("changes in the log since the last materialization (64 B values)")
    ax.set_ylabel("restore time (s)")
    ax.set_title("(c) restore time vs log length (1,000-key snapshot + log, with cache)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------- report


def _n(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def _s(s: dict[str, float]) -> str:
    return fmt(s, digits=3)


def _ms(s: dict[str, float]) -> str:
    return fmt(s, "ms", scale=1e3, digits=1)


def _rate(s: dict[str, float]) -> str:
    return fmt(s, scale=1e-3, digits=0) + " k/s"


def _intervals(rows: list[tuple[int, float, float]], col: int, snap_s: float,
               budget_s: float) -> str:
    """Longest materialization intervals per write rate, or why none fits."""
    if snap_s >= budget_s:
        return (f"**none fits**: the snapshot load alone ({snap_s:.1f} s) exceeds the budget, "
                "whatever the interval")
    return ", ".join(f"**{r[col]:,.1f} min** at {r[0]:,} changes/s" for r in rows)


def advice(fig_b: dict[str, Any], fig_c: dict[str, Any], fig_d: dict[str, Any] | None = None
           ) -> tuple[str, dict[str, Any]]:
    """The materialization-interval paragraph, from the measured rates (LMDB: the file-level
    snapshot of (d), LMDB's default format, when (d) ran on the same store)."""
    target = MOTO if any(r["store"] == MOTO for r in fig_c.values()) else LOCAL
    big_c = max((r for r in fig_c.values() if r["store"] == target and r["table"] == "heap"),
                key=lambda r: r["changes"])
    big_l = max((r for r in fig_c.values() if r["store"] == target and r["table"] == "lmdb"),
                key=lambda r: r["changes"])
    zero = min((r for r in fig_c.values() if r["store"] == target and r["table"] == "heap"),
               key=lambda r: r["changes"])
    big_b = max((r for r in fig_b.values() if r["store"] == target), key=lambda r: r["keys"])
    # end-to-end rates (downloads included), not the CPU-only replay rate
    r_heap = big_c["changes"] / max(1e-9, big_c["cache"]["seconds"]["median"]
                                    - zero["cache"]["seconds"]["median"])
    r_lmdb = big_l["changes"] / max(1e-9, big_l["cache"]["seconds"]["median"]
                                    - zero["cache"]["seconds"]["median"])
    t0 = zero["cache"]["seconds"]["median"]
    r_snap = big_b["keys"] / big_b["cache"]["seconds"]["median"]
    r_snap_lmdb = big_b["keys"] / big_b["lmdb"]["seconds"]["median"]
    lmdb_from = f"{big_b['keys']:,}-key v1 snapshot"
    file_rows = [r for r in (fig_d or {}).values() if r["store"] == target]
    if file_rows:  # the v2 (file-level) snapshot: what an LMDB backend writes by default
        big_d = max(file_rows, key=lambda r: r["keys"])
        r_snap_lmdb = big_d["keys"] / big_d["lmdb"]["seconds"]["median"]
        lmdb_from = f"{big_d['keys']:,}-key v2 file-level snapshot, LMDB's default"
    keys, budget = 1_000_000, 10.0
    snap_s, snap_lmdb_s = keys / r_snap, keys / r_snap_lmdb
    rows = []
    for w in (1_000, 10_000, 50_000):
        i_heap = (budget - t0 - snap_s) * r_heap / w / 60.0
        i_lmdb = (budget - t0 - snap_lmdb_s) * r_lmdb / w / 60.0
        rows.append((w, i_heap, i_lmdb))
    # what the size trigger counts per change: op + state id, key and namespace, encoded value
    bytes_per_change = 3 + 4 + len(b"user-00000000") + 4 + len(SafeCodec().encode(value(0)))
    snap_b_per_key = big_b["data"]["snapshot_mb"] * 1e6 / big_b["keys"]
    cap_changes = 2.0 * snap_b_per_key * keys / bytes_per_change
    text = (
        "**Choosing the materialization interval.** Restore time is about "
        "`T = T0 + S / r_snap + w * I / r_replay`, where `S` is the number of keys of the "
        "backend, `w` its write rate (changes/s), `I` the materialization interval (worst case: "
        "the failure hits just before a materialization completes, so the log holds `w * I` "
        "changes, plus those written while it runs) and `r_snap`, `r_replay` the end-to-end "
        f"load and replay rates. Measured here on {target} with the cache: `T0` = {t0:.2f} s, "
        f"`r_snap` = {r_snap / 1e3:,.0f} k keys/s into the heap table and "
        f"{r_snap_lmdb / 1e3:,.0f} k keys/s into LMDB ({lmdb_from}; the heap's from a "
        f"{big_b['keys']:,}-key snapshot), "
        f"`r_replay` = {r_heap / 1e3:,.0f} k changes/s into the heap table and "
        f"{r_lmdb / 1e3:,.0f} k changes/s into LMDB (downloads included; "
        f"{big_c['changes']:,}-change log). So `I <= (T_max - T0 - S / r_snap) * r_replay / w`: "
        f"to keep the restore of a {keys:,}-key backend ({snap_s:.1f} s of snapshot load into "
        f"the heap, {snap_lmdb_s:.1f} s into LMDB) under "
        f"{budget:.0f} s, materialize at least every: heap table "
        + _intervals(rows, 1, snap_s, budget - t0) + "; LMDB: "
        + _intervals(rows, 2, snap_lmdb_s, budget - t0)
        + ". Flink's 10-minute default fits only write rates below "
        f"{max(0.0, (budget - t0 - snap_s) * r_heap / 600):,.0f} changes/s per backend (heap; "
        f"LMDB {max(0.0, (budget - t0 - snap_lmdb_s) * r_lmdb / 600):,.0f}) for that budget. Each materialization rewrites the whole table (heap), so do not go much below "
        "the time it takes (measured here once: "
        f"{big_b['data']['materialize_s']:.1f} s for {big_b['keys']:,} keys). The size trigger "
        "(`materialize_log_ratio`, default 2) bounds the log independently of time: at "
        f"~{snap_b_per_key:.0f} B per key in the snapshot and ~{bytes_per_change} B per logged "
        f"64 B change it caps a {keys:,}-key backend's log near {cap_changes / 1e6:,.1f} M "
        f"changes, i.e. <= {cap_changes / r_heap:,.1f} s of replay on the heap table; "
        "keep it on. Real S3 adds tens of ms per request and less bandwidth than moto on "
        "loopback: recompute with your store's numbers.")
    return text, {"target": target, "T0_s": t0, "r_snap_keys_per_s": r_snap,
                  "r_snap_lmdb_keys_per_s": r_snap_lmdb,
                  "r_replay_heap_per_s": r_heap, "r_replay_lmdb_per_s": r_lmdb,
                  "budget_s": budget, "keys": keys,
                  "max_interval_min": {str(w): {"heap": h, "lmdb": m} for w, h, m in rows},
                  "size_trigger_cap_changes": cap_changes}


def floor_goals(fig_b: dict[str, Any], fig_c: dict[str, Any]) -> dict[str, Any]:
    """The restore goals, on the local store at the largest size: replay rates into LMDB and the
    heap, snapshot restore (load phase) vs GET + zstd-decompress of the snapshot."""
    lmdb_local = max((r for r in fig_c.values() if r["store"] == LOCAL and r["table"] == "lmdb"),
                     key=lambda r: r["changes"])
    big_b = max((r for r in fig_b.values() if r["store"] == LOCAL), key=lambda r: r["keys"])
    rate = lmdb_local["cache"]["replay_per_s"]["median"]
    return {"replay_lmdb": rate, "replay_lmdb_met": rate >= REPLAY_GOAL_LMDB,
            "floor_keys": big_b["keys"], "heap_vs_floor": big_b["heap_vs_floor"],
            "lmdb_vs_floor": big_b["lmdb_vs_floor"],
            "heap_floor_met": big_b["heap_vs_floor"] <= FLOOR_GOAL,
            "lmdb_floor_met": big_b["lmdb_vs_floor"] <= FLOOR_GOAL}


def _met(ok: bool | None) -> str:
    return "met" if ok else "**missed**"


def _largest(part: dict[str, Any], store: str, **match: Any) -> dict[str, Any] | None:
    rows = [r for r in part.values()
            if r["store"] == store and all(r.get(k) == v for k, v in match.items())]
    return max(rows, key=lambda r: r.get("changes", r.get("keys", 0))) if rows else None


def markdown(figs: dict[str, Any]) -> str:
    """Section ``recovery``: the goals of a full run, its plots and the interval advice."""
    fa, fb, fc, fd = (figs["backends"], figs["state_size"], figs["log_length"],
                      figs.get("file_snapshots") or {})
    g, bare = figs["goals"], figs["bare_replay"]
    rows = []
    for mode in ("sequential", "parallel"):
        r = fa.get(f"{MOTO}/{mode}/8")
        if r:
            rows.append([f"restore 8 backends sharing segments, {mode}, moto + 20 ms (s)",
                         _s(r["cache"]["seconds"]), f"no cache {_s(r['no_cache']['seconds'])}",
                         f"{r['speedup']:.2f}x faster",
                         f">= {SPEEDUP_GOAL:.0f}x: {_met(r['speedup'] >= SPEEDUP_GOAL)}"])
    rows.append(["fetches of any object, with the cache",
                 _n(g["max_fetches_per_object_cache"], 0),
                 f"no cache, 8 backends: {_n(g['no_cache_gets_8'], 0)}", "—",
                 f"once: {_met(g['fetch_once'])}"])
    for table_ in ("heap", "lmdb"):
        r = _largest(fc, LOCAL, table=table_)
        if r:
            rate = r["cache"]["replay_per_s"]
            base = bare["dict_per_s" if table_ == "heap" else "lmdb_per_s"]
            goal = REPLAY_GOALS[table_]
            rows.append([f"replay {r['changes']:,} changes into {table_}, local fs (changes/s)",
                         _rate(rate), f"bare replay loop {_rate(base)}",
                         f"{rate['median'] / base['median']:.2f}x",
                         f">= {goal / 1e3:,.0f} k/s: {_met(rate['median'] >= goal)}"])
    big = _largest(fb, LOCAL)
    if big:
        for label, key, vs in (("heap", "cache", big["heap_vs_floor"]),
                               ("LMDB from v1 (entries)", "lmdb", big["lmdb_vs_floor"])):
            rows.append([f"snapshot load, {big['keys']:,} keys, {label}, local fs (s)",
                         _s(big[key]["snapshot_s"]),
                         f"GET + zstd-decompress {_ms(big['floor']['floor_s'])}", f"{vs:.1f}x",
                         f"<= {FLOOR_GOAL:.0f}x: {_met(vs <= FLOOR_GOAL)}"])
    d = _largest(fd, LOCAL)
    if d:
        rows.append([f"snapshot load, {d['keys']:,} keys, LMDB from v2 (file-level), local fs "
                     "(s)", _s(d["lmdb"]["snapshot_s"]),
                     f"GET + zstd-decompress {_ms(d['floor']['floor_s'])}",
                     f"{d['lmdb_vs_floor']:.1f}x",
                     f"<= {FLOOR_GOAL:.0f}x: {_met(d['lmdb_vs_floor'] <= FLOOR_GOAL)}"])
    md = [md_table(["figure", "DSTL", "peer (same run)", "ratio", "goal"], rows), "",
          "![restore time vs backends](img/recovery_backends.png) "
          "![restore time vs state size](img/recovery_state_size.png) "
          "![restore time vs log length](img/recovery_log_length.png)", "",
          f"Median (min..max) of {figs['repeats']} repeats, each restore with a fresh storage and "
          "cache; moto + 20 ms = moto S3 on loopback, 20 ms added per request; "
          f"{load_brief(figs.get('load'))}."]
    if figs.get("moto_error"):
        md += ["", f"_moto figures missing: {figs['moto_error']}_"]
    a = figs.get("advice")
    if a:
        per = a["max_interval_min"]
        md += ["", "**Materialization interval.** Restore time ~ "
               "`T0 + S / r_snap + w * I / r_replay` (`S` keys, `w` changes/s, `I` the interval; "
               f"{a['target']}: `T0` {a['T0_s']:.2f} s, `r_snap` "
               f"{a['r_snap_keys_per_s'] / 1e3:,.0f} / {a['r_snap_lmdb_keys_per_s'] / 1e3:,.0f} k "
               f"keys/s, `r_replay` {a['r_replay_heap_per_s'] / 1e3:,.0f} / "
               f"{a['r_replay_lmdb_per_s'] / 1e3:,.0f} k changes/s, heap / LMDB). A "
               f"{a['keys']:,}-key backend restored within {a['budget_s']:.0f} s needs "
               "`I` <= " + ", ".join(f"{v['heap']:,.1f} / {v['lmdb']:,.1f} min at {int(w):,}"
                                     for w, v in per.items()) + " changes/s."]
    return "\n".join(md)


def main_file_snapshots(args: Any) -> None:
    """``--only-file``: section (d) alone, as the docs section ``recovery-filesnap``."""
    q, reps = args.quick, args.repeats
    t0 = time.perf_counter()
    sizes = [50_000] if q else [int(x) for x in args.file_keys.split(",")]
    load = LoadSampler()
    stores = Stores()
    try:
        fd = bench_file_snapshots(stores, sizes, reps, 100_000)
    finally:
        stores.close()
    figures = {"repeats": reps, "file_snapshots": fd, "moto_error": stores.error,
               "wall_seconds": time.perf_counter() - t0, "load": load.stop(),
               "load_note": load.note(), "git": machine_info()["git_sha"]}
    before = _before(args.before)
    cmd = (f"python bench/recovery.py --only-file{' --quick' if q else ''}"
           + (f" --file-keys {args.file_keys}" if not q else "")
           + (f" --before {args.before}" if args.before else ""))
    publish("recovery-filesnap", figures, lambda f: markdown_file_snapshots(f, before), quick=q,
            command=cmd, no_doc=args.no_doc, tag=args.tag)


def _before(path: str | None) -> dict[str, Any] | None:
    """The figures of the run on earlier code a run was compared with (``--before``)."""
    if not path:
        return None
    record = json.loads(Path(path).read_text())
    figures: dict[str, Any] = record["figures"]
    figures.setdefault("git", record.get("machine", {}).get("git_sha"))
    return figures


def _before_of(command: str) -> dict[str, Any] | None:
    """The ``--before`` figures named in a stored run's command, when that file is kept."""
    m = re.search(r"--before (\S+)", command)
    return _before(m.group(1)) if m and (ROOT / m.group(1)).exists() else None


# ----------------------------------------------------------------- (e) replay rates


def markdown_replay(figs: dict[str, Any], before: dict[str, Any] | None) -> str:
    """Section ``recovery-replay``: replay rates into heap and LMDB against their goals and
    the bare loop, and what prefetch does on moto + 20 ms (both in the same run)."""
    bare, fc = figs["bare_replay"], figs["log_length"]
    old = (before or {}).get("log_length", {})
    rows = []
    for store in (LOCAL, MOTO):
        for table_ in ("heap", "lmdb"):
            r = _largest(fc, store, table=table_)
            if not r or not r["changes"]:
                continue
            rate, goal = r["cache"]["replay_per_s"], REPLAY_GOALS[table_]
            base = bare["dict_per_s" if table_ == "heap" else "lmdb_per_s"]
            was = old.get(f"{store}/{table_}/{r['changes']}", {}).get("cache", {})
            rows.append([f"replay {r['changes']:,} changes, {table_}, {store} (changes/s)",
                         _rate(rate), f"bare loop {_rate(base)}",
                         f"{rate['median'] / base['median']:.2f}x"
                         + (f" ({rate['median'] / was['replay_per_s']['median']:.1f}x the code "
                            f"before, {(before or {}).get('git', '?')})"
                            if was.get("replay_per_s") else ""),
                         f">= {goal / 1e3:,.0f} k/s: {_met(rate['median'] >= goal)}"])
    for table_ in ("heap", "lmdb"):
        r = _largest(fc, MOTO, table=table_)
        if not r or not r["changes"] or not r.get("no_prefetch"):
            continue
        on, off = r["cache"]["seconds"], r["no_prefetch"]["seconds"]
        rows.append([f"restore with prefetch, {r['changes']:,} changes, {table_}, moto + 20 ms "
                     "(s)", _s(on), f"prefetch off {_s(off)}",
                     f"{on['median'] / off['median']:.2f}x", "—"])
    return "\n".join([
        md_table(["figure", "DSTL", "baseline (same run)", "ratio", "goal"], rows), "",
        "A log of 64 B value changes over 100 k keys on a 1,000-key snapshot, through a fresh "
        "cache; the bare loop decompresses, decodes and sets a dict / puts into LMDB. Median "
        f"(min..max) of {figs['repeats']} repeats; {load_brief(figs.get('load'))}.",
    ])


def bench_partitions(stores: Stores, n: int, rounds: int, per_round: int,
                     repeats: int) -> dict[str, Any]:
    """(e) ``n`` partitions (backends) of one storage sharing every segment, restored in one
    process through one cache, one after another and in parallel, with and without prefetch
    (interleaved); moto + 20 ms only (on local fs there is nothing to overlap)."""
    name = f"partitions-{n}"
    ds = gen_shared(stores.local_root(name), n, rounds, per_round)
    out: dict[str, Any] = {}
    for place in stores.place(name, ds.objects):
        if place.target != MOTO:
            continue
        for mode in ("sequential", "parallel"):
            par = mode == "parallel"
            rs = measure_interleaved(place, ds, repeats, {
                "on": {"cache": True, "parallel": par},
                "off": {"cache": True, "parallel": par, "prefetch": False}})
            out[mode] = {"store": place.target, "mode": mode, "partitions": n,
                         "data": {k: v for k, v in ds.info.items() if k != "objects"},
                         "gets_s": gets_floor(place, ds, repeats), **rs}
            print(f"(e) {n} partitions {mode}: prefetch off {rs['off']['seconds']['median']:.3f}s,"
                  f" on {rs['on']['seconds']['median']:.3f}s", flush=True)
    return out


def gen_counts(root: str, state_keys: int, log_changes: int) -> DataSet:
    """(e) The restart job's data: keys ``k%08d``, one value state holding a small int (what
    ``groupBy(key).count()`` keeps): ``state_keys`` keys materialized by a heap backend (a v1
    snapshot), then ``log_changes`` increments over them, a checkpoint every 200 k changes."""
    store = LocalBlobStore(root)
    rng = KeyGroupRange(0, MP - 1)
    keys = max(state_keys, 1)
    with ChangelogStorage(store=CountingStore(store)) as storage:
        b = ChangelogKeyedStateBackend(storage, "count", rng, MP, options=OPTS)
        st = b.get_state(DESC)
        for i in range(keys):
            b.set_current_key(f"k{i:08d}")
            st.update(1)
        assert b.materialize_now(900) is not None
        h: ChangelogStateBackendHandle | None = None
        cp = 0
        for i in range(log_changes):
            b.set_current_key(f"k{i % keys:08d}")
            st.update(2 + i // keys)
            if (i + 1) % 200_000 == 0 or i + 1 == log_changes:
                cp += 1
                h = b.snapshot(cp).result(300)
                b.notify_checkpoint_complete(cp)
        if h is None:
            h = b.snapshot(cp + 1).result(300)
            b.notify_checkpoint_complete(cp + 1)
        b.set_current_key("k00000000")
        probe = ("k00000000", st.value())
        b.close()
    return _finish(DataSet([h], [rng], [probe], {"state_keys": keys,
                                                  "log_changes": log_changes}), store)


def bench_count_job(stores: Stores, n: int, repeats: int) -> dict[str, Any]:
    """(e) The count job on local fs: replay of ``n`` changes (on 1,000 keys materialized)
    and load of a v1 snapshot of ``n`` keys, into heap and LMDB, against their floors."""
    out: dict[str, Any] = {}
    log = gen_counts(stores.local_root("count-log"), 1000, n)
    snap = gen_counts(stores.local_root("count-snap"), n, 0)
    place_log = stores.place("count-log", {})[0]
    place_snap = stores.place("count-snap", {})[0]
    log_floor_s = log_floor(place_log, log, repeats)
    snap_key = snap.handles[0].materialized[0].key
    snap_floor = download_floor(place_snap, snap_key, repeats)
    for table in ("heap", "lmdb"):
        r = measure(place_log, log, repeats, cache=True, table=table)
        out[f"replay/{table}"] = {"what": "replay", "table": table, "n": n, "cache": r,
                                  "rate": r["replay_per_s"], "phase_s": r["replay_s"],
                                  "floor_s": log_floor_s,
                                  "vs_floor": r["replay_s"]["median"] / log_floor_s["median"]}
        s = measure(place_snap, snap, repeats, cache=True, table=table)
        out[f"snapshot/{table}"] = {"what": "snapshot load (v1)", "table": table, "n": n,
                                    "cache": s, "rate": s["load_entries_per_s"],
                                    "phase_s": s["snapshot_s"], "floor_s": snap_floor["floor_s"],
                                    "vs_floor": (s["snapshot_s"]["median"]
                                                 / snap_floor["floor_s"]["median"])}
        print(f"(e) count job {table}: replay {r['replay_per_s']['median']:,.0f}/s, "
              f"snapshot load {s['load_entries_per_s']['median']:,.0f}/s")
    return out


def main_replay(args: Any) -> None:
    """``--only-replay``: section (e) alone (bare loop + log replay rates, heap and LMDB)."""
    q, reps = args.quick, args.repeats
    t0 = time.perf_counter()
    lengths = [50_000] if q else [int(x) for x in args.replay_lengths.split(",")]
    load = LoadSampler()
    stores = Stores()
    try:
        figures: dict[str, Any] = {"repeats": reps,
                                   "bare_replay": bare_replay(50_000 if q else 200_000, reps),
                                   "log_length": bench_log_length(stores, lengths, reps,
                                                                  control=True),
                                   "partitions": bench_partitions(stores, 4, 5 if q else 10,
                                                                  1000 if q else 5000, reps),
                                   "count_job": bench_count_job(stores, 50_000 if q else
                                                                1_000_000, reps)}
    finally:
        stores.close()
    figures.update({"moto_error": stores.error, "wall_seconds": time.perf_counter() - t0,
                    "load": load.stop(), "load_note": load.note(),
                    "git": machine_info()["git_sha"]})
    before = _before(args.before)
    cmd = (f"python bench/recovery.py --only-replay{' --quick' if q else ''}"
           + (f" --replay-lengths {args.replay_lengths}" if not q else "")
           + (f" --before {args.before}" if args.before else ""))
    publish("recovery-replay", figures, lambda f: markdown_replay(f, before), quick=q,
            command=cmd, no_doc=args.no_doc, tag=args.tag)


# ----------------------------------------------------------------- (f) materialization


def _fill(b: ChangelogKeyedStateBackend, keys: int) -> float:
    """Write ``keys`` keys of 64 B values in write batches of 100 k; the seconds it took."""
    st = b.get_state(DESC)
    t0 = time.perf_counter()
    for lo in range(0, keys, 100_000):
        with b.write_batch():
            for i in range(lo, min(keys, lo + 100_000)):
                b.set_current_key(f"user-{i:08d}")
                st.update(value(i))
    return time.perf_counter() - t0


def bench_materialize(root: str, keys: int, repeats: int) -> dict[str, Any]:
    """(f) One LMDB backend owning all key groups, ``keys`` keys of 64 B values: the time and
    bytes of one materialization (file-level snapshot: compacting copy from a read transaction,
    zstd, upload to the local store), ``repeats`` times (one changed key in between)."""
    rng = KeyGroupRange(0, MP - 1)
    with ChangelogStorage(store=LocalBlobStore(root)) as storage:
        b = ChangelogKeyedStateBackend(storage, "op", rng, MP, options=OPTS, table="lmdb",
                                       auto_materialize=False)
        try:
            fill_s = _fill(b, keys)
            st = b.get_state(DESC)
            runs: list[float] = []
            sizes: list[int] = []
            for r in range(repeats):
                b.set_current_key("user-00000000")
                st.update(value(r))
                b.snapshot(r + 1).result(900)
                b.notify_checkpoint_complete(r + 1)
                t0 = time.perf_counter()
                ref = b.materialize_now(1800)
                runs.append(time.perf_counter() - t0)
                assert ref is not None
                sizes.append(ref.size)
            disk = b.tables.stats()["disk_bytes"]
        finally:
            b.close()
    return {"keys": keys, "fill_s": fill_s, "materialize_s": summary(runs),
            "object_bytes": summary([float(s) for s in sizes]), "table_disk_bytes": disk}


def bench_log_tail(root: str, keys: int, per_checkpoint: int, checkpoints: int,
                   ratio: float, min_log_bytes: int) -> dict[str, Any]:
    """(f) The log tail a restore replays, bounded by the size trigger: one LMDB backend with
    ``keys`` keys, then ``checkpoints`` checkpoints of ``per_checkpoint`` updates, no interval;
    after each checkpoint the backend's policy decides, as the Spark task does, whether to
    materialize (size trigger: log since the last snapshot > max(``min_log_bytes``, ``ratio``
    x snapshot bytes)). Per checkpoint: the tail and snapshot bytes its handle names."""
    rng = KeyGroupRange(0, MP - 1)
    opts = OPTS.replace(materialize_log_ratio=ratio, materialize_min_log_bytes=min_log_bytes)
    rows: list[dict[str, Any]] = []
    with ChangelogStorage(store=LocalBlobStore(root)) as storage:
        b = ChangelogKeyedStateBackend(storage, "op", rng, MP, options=opts, table="lmdb",
                                       auto_materialize=False)
        try:
            _fill(b, keys)
            st = b.get_state(DESC)
            for cp in range(1, checkpoints + 1):
                with b.write_batch():
                    for j in range(per_checkpoint):
                        k = ((cp - 1) * per_checkpoint + j) % keys
                        b.set_current_key(f"user-{k:08d}")
                        st.update(value(k + cp))
                h = b.snapshot(cp).result(900)
                b.notify_checkpoint_complete(cp)
                row: dict[str, Any] = {"checkpoint": cp, "tail_bytes": h.non_materialized_size,
                                       "snapshot_bytes": h.materialized_size,
                                       "materialize_s": None}
                if b.materialization.due():
                    t0 = time.perf_counter()
                    if b.materialize_now(900) is not None:
                        row["materialize_s"] = time.perf_counter() - t0
                rows.append(row)
        finally:
            b.close()
    snap = [r for r in rows if r["snapshot_bytes"]]
    return {"keys": keys, "per_checkpoint": per_checkpoint, "ratio": ratio,
            "min_log_bytes": min_log_bytes, "rows": rows,
            "max_tail_bytes": max(r["tail_bytes"] for r in rows),
            "max_tail_vs_snapshot": max((r["tail_bytes"] / r["snapshot_bytes"] for r in snap),
                                        default=float("nan")),
            "materializations": sum(1 for r in rows if r["materialize_s"] is not None)}


def markdown_materialize(figs: dict[str, Any]) -> str:
    """Section ``recovery-materialize``: a file-level materialization at scale and the log
    tail under the size trigger alone."""
    t = figs["log_tail"]
    rows = [[f"materialize {m['keys']:,} keys (s)", _s(m["materialize_s"]),
             f"{m['object_bytes']['median'] / 1e6:,.1f} MB object, "
             f"{m['table_disk_bytes'] / 1e6:,.1f} MB table", "—", "—"]
            for m in figs["materialize"]]
    rows.append([f"largest log tail over {len(t['rows'])} checkpoints (MB)",
                 f"{t['max_tail_bytes'] / 1e6:.2f}", "the snapshot it follows",
                 f"{t['max_tail_vs_snapshot']:.2f}x",
                 f"bounded: {_met(t['max_tail_vs_snapshot'] <= t['ratio'])}"])
    return "\n".join([
        md_table(["figure", "DSTL", "context", "ratio", "goal"], rows), "",
        "One LMDB backend, 64 B values, local fs; a file-level snapshot (compacting copy, "
        f"zstd, upload), {figs['repeats']} repeats. Log tail: size trigger alone (ratio "
        f"{t['ratio']:g}), {t['keys']:,} keys, {t['per_checkpoint']:,} updates per checkpoint; "
        f"{load_brief(figs.get('load'))}.",
    ])


def main_materialize(args: Any) -> None:
    """``--only-materialize``: section (f) alone (docs section ``recovery-materialize``)."""
    q, reps = args.quick, args.repeats
    t0 = time.perf_counter()
    sizes = [50_000] if q else [int(x) for x in args.mat_keys.split(",")]
    load = LoadSampler()
    tmp = tempfile.mkdtemp(prefix="dstl-bench-mat-")
    try:
        mats = [bench_materialize(os.path.join(tmp, f"m{n}"), n, reps) for n in sizes]
        for m in mats:
            print(f"(f) {m['keys']:,} keys: materialize {m['materialize_s']['median']:.2f}s, "
                  f"{m['object_bytes']['median'] / 1e6:.1f} MB", flush=True)
        tail = (bench_log_tail(os.path.join(tmp, "tail"), 20_000, 5_000, 8, 2.0, 256 * 1024)
                if q else bench_log_tail(os.path.join(tmp, "tail"), 200_000, 50_000, 16, 2.0,
                                         8 * 2**20))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures = {"repeats": reps, "materialize": mats, "log_tail": tail,
               "wall_seconds": time.perf_counter() - t0, "load": load.stop(),
               "load_note": load.note()}
    cmd = (f"python bench/recovery.py --only-materialize{' --quick' if q else ''}"
           + (f" --mat-keys {args.mat_keys}" if not q else "") + f" --repeats {reps}")
    publish("recovery-materialize", figures, markdown_materialize, quick=q, command=cmd,
            no_doc=args.no_doc, tag=args.tag)


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--only-replay", action="store_true",
                   help="run only (e), the log replay rates into heap and LMDB (own docs section)")
    p.add_argument("--replay-lengths", default="200000,1000000",
                   help="log lengths of (e) without --quick (comma-separated)")
    p.add_argument("--before", default=None,
                   help="(d) and (e): the JSON of a run on earlier code, shown beside this "
                        "run's figures")
    p.add_argument("--only-file", action="store_true",
                   help="run only (d), the LMDB file-level snapshots (own docs section)")
    p.add_argument("--file-keys", default="1000000",
                   help="state sizes of (d) without --quick (comma-separated)")
    p.add_argument("--only-materialize", action="store_true",
                   help="run only (f): one materialization at --mat-keys keys (time, bytes) and "
                        "the log tail under the size trigger (own docs section)")
    p.add_argument("--mat-keys", default="1000000,4000000",
                   help="state sizes of (f) without --quick (comma-separated)")
    add_render(p)
    args = p.parse_args()
    if args.render:
        sys.exit(render(Path(args.render)))
    if args.only_materialize:
        main_materialize(args)
        return
    if args.only_replay:
        main_replay(args)
        return
    if args.only_file:
        main_file_snapshots(args)
        return
    q, reps = args.quick, args.repeats
    t_start = time.perf_counter()
    counts = [1, 2, 4, 8]
    rounds = 5 if q else 10
    sizes = [10_000, 50_000] if q else [10_000, 100_000, 1_000_000]
    nocache_max_keys = 10_000 if q else 100_000
    lengths = [0, 10_000, 50_000] if q else [0, 10_000, 100_000, 1_000_000]
    wall: dict[str, float] = {}
    figures: dict[str, Any] = {"repeats": reps, "value_bytes": VALUE_BYTES,
                               "latency_s": LATENCY_S, "max_parallelism": MP}
    load = LoadSampler()
    stores = Stores()
    if stores.error:
        figures["moto_error"] = stores.error
    try:
        t = time.perf_counter()
        figures["bare_replay"] = bare_replay(50_000 if q else 200_000, reps)
        wall["bare_replay"], t = time.perf_counter() - t, time.perf_counter()
        figures["backends"] = bench_backends(stores, counts, rounds, 1000, reps)
        wall["backends"], t = time.perf_counter() - t, time.perf_counter()
        figures["state_size"] = bench_state_size(stores, sizes, nocache_max_keys, reps)
        wall["state_size"], t = time.perf_counter() - t, time.perf_counter()
        figures["log_length"] = bench_log_length(stores, lengths, reps)
        wall["log_length"], t = time.perf_counter() - t, time.perf_counter()
        figures["file_snapshots"] = bench_file_snapshots(
            stores, [50_000] if q else [int(x) for x in args.file_keys.split(",")], reps,
            100_000)
        wall["file_snapshots"], t = time.perf_counter() - t, time.perf_counter()
        heap_local = max((r for r in figures["log_length"].values()
                          if r["store"] == LOCAL and r["table"] == "heap"),
                         key=lambda r: r["changes"])
        replay_heap = heap_local["cache"]["replay_per_s"]["median"]
        if replay_heap < REPLAY_GOAL:
            figures["profile"] = profile_replay(stores, lengths[-2])
            wall["profile"] = time.perf_counter() - t
    finally:
        stores.close()

    fa = figures["backends"]
    at8 = {r["mode"]: r for r in fa.values() if r["backends"] == 8 and r["store"] == MOTO}
    cached = [r["cache"] for r in [*fa.values(), *figures["state_size"].values(),
                                   *figures["log_length"].values()]]
    cached += [r["lmdb"] for r in figures["state_size"].values()]
    fetches_cache = [c["gets_per_object_max"] if c["gets_per_object_max"] is not None
                     else c["reads_per_object_max"] for c in cached]
    seq8 = at8.get("sequential", {}).get("speedup")
    par8 = at8.get("parallel", {}).get("speedup")
    figures["goals"] = {
        "max_fetches_per_object_cache": max(fetches_cache),
        "fetch_once": max(fetches_cache) <= 1,
        "no_cache_gets_8": at8.get("sequential", {}).get("no_cache", {}).get(
            "gets_per_object_max"),
        "speedup_8_seq": seq8, "speedup_8_par": par8,
        "speedup_met": seq8 is not None and seq8 >= SPEEDUP_GOAL,
        "speedup_par_met": par8 is not None and par8 >= SPEEDUP_GOAL,
        "replay_heap": replay_heap, "replay_changes": heap_local["changes"],
        "replay_met": replay_heap >= REPLAY_GOAL,
    }
    figures["goals"].update(floor_goals(figures["state_size"], figures["log_length"]))
    big_d = max((r for r in figures["file_snapshots"].values() if r["store"] == LOCAL),
                key=lambda r: r["keys"])
    figures["goals"].update({"file_keys": big_d["keys"],
                             "lmdb_file_vs_floor": big_d["lmdb_vs_floor"],
                             "lmdb_file_floor_met": big_d["lmdb_vs_floor"] <= FLOOR_GOAL})
    text, numbers = advice(figures["state_size"], figures["log_length"],
                           figures.get("file_snapshots"))
    figures["advice_text"], figures["advice"] = text, numbers

    imgs = {k: f"img/recovery_{k}.png" for k in ("backends", "state_size", "log_length")}
    if not args.no_doc:
        IMG.mkdir(parents=True, exist_ok=True)
        plot_backends(fa, ROOT / "docs" / imgs["backends"])
        plot_state_size(figures["state_size"], ROOT / "docs" / imgs["state_size"])
        plot_log_length(figures["log_length"], ROOT / "docs" / imgs["log_length"])
    figures["wall_seconds"] = time.perf_counter() - t_start
    figures["wall_seconds_per_part"] = wall
    figures["tag"] = args.tag
    figures["load"] = load.stop()
    figures["load_note"] = load.note()
    publish("recovery", figures, markdown, quick=q,
            command=f"python bench/recovery.py{' --quick' if q else ''}", no_doc=args.no_doc,
            tag=args.tag)
    print(f"wall: {figures['wall_seconds']:.0f} s {wall}")


def render(path: Path) -> int:
    """``--render RESULTS.json``: the section of a stored run of any of the four parts (by the
    file's name), measuring nothing."""
    record = json.loads(path.read_text())
    name, before = record["name"], _before_of(record["command"])
    renderers = {"recovery": markdown, "recovery-materialize": markdown_materialize,
                 "recovery-filesnap": lambda f: markdown_file_snapshots(f, before),
                 "recovery-replay": lambda f: markdown_replay(f, before)}
    return render_stored(name, path, renderers[name])


if __name__ == "__main__":
    main()
