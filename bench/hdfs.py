"""DSTL on HDFS beside the local disk and S3 on moto, in one run: restore time and small puts.

(a) **Restore at 1 M keys** (quick: 50 k): one backend owning every key group, 64 B values,
    materialized once, then a log tail of 1 % of the keys (``bench/recovery.py``'s data set (b),
    written once on the local disk and copied object by object to each store, so every store
    restores identical bytes). Restored into the heap table and into LMDB through a fresh
    ``LocalFileCache`` in a fresh ``ChangelogStorage`` (a process that just started), timed from
    the first ``restore_backend`` call to its return; beside it the snapshot's whole-object GET
    (the download floor). Stores: the local filesystem, moto S3 on loopback behind 20 ms per
    request (``FaultyFileSystem``), and a MiniDFSCluster (one NameNode, one DataNode, one JVM,
    loopback: ``tests/support/minidfs.py``). The repeats of the three stores are interleaved
    (local, S3, HDFS, local, ...), so a change of the machine's load hits all alike; ratios are
    against the local disk of the same run.
(b) **A small object's put on HDFS** (1 KiB, DSTL's ``HdfsBlobStore.put``: a temp file created
    without overwrite, closed, renamed without overwrite), on a cluster with Hadoop's default
    ``dfs.namenode.file.close.num-committed-allowed=0`` and on one with ``1``. hdfs-native's
    ``complete`` call comes before the DataNode reported the file's last block, the NameNode
    says "not yet" and the client waits 500 ms before asking again (no client setting changes
    that wait: hdfs-native reads ``dfs.client.failover.*`` and
    ``dfs.client.use.datanode.hostname`` of the ``dfs.client`` family only). With ``1`` the
    NameNode closes a file whose last block is committed by the client (the pipeline acknowledged
    every packet) before the DataNode's report arrives.

Checkpoint persist latency and objects per checkpoint on HDFS beside the local disk and S3, and
the 8 MB throughput of the HDFS clients: ``bench/hdfs_clients.py``.

Run: ``python bench/hdfs.py [--quick] [--repeats N]``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from support.minidfs import MiniDfs  # noqa: E402

from bench._common import (  # noqa: E402
    LoadSampler,
    add_render,
    fmt,
    load_brief,
    parser,
    percentile,
    publish,
    render_stored,
    summary,
    table,
)
from bench.recovery import (  # noqa: E402
    Place,
    Stores,
    download_floor,
    gen_single,
    restore_all,
    summarise,
)
from dstl.stores import open_store  # noqa: E402

HDFS = "hdfs (MiniDFSCluster)"
#: the NameNode setting of (b)
CLOSE_SETTING = "dfs.namenode.file.close.num-committed-allowed"


def _hdfs_place(cluster: MiniDfs, name: str, local: Place, objects: dict[str, int]) -> Place:
    store = open_store(cluster.uri(f"/bench-hdfs/{uuid.uuid4().hex[:8]}/{name}"))
    for key in objects:
        store.put(key, local.store.get(key))
    return Place(HDFS, store)


def bench_restore(cluster: MiniDfs, keys: int, repeats: int) -> dict[str, Any]:
    stores = Stores()
    try:
        name = f"state-{keys}"
        tail = max(1000, keys // 100)
        t0 = time.perf_counter()
        ds = gen_single(stores.local_root(name), keys, tail, keys, tail)
        print(f"(a) data set: {keys} keys + {tail} changes in {time.perf_counter() - t0:.1f}s, "
              f"{ds.info['stored_mb']:.1f} MB")
        places = stores.place(name, ds.objects)
        places.append(_hdfs_place(cluster, name, places[0], ds.objects))
        snap = ds.handles[0].materialized[0].key
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {
            p.target: {"heap": [], "lmdb": []} for p in places}
        for _ in range(repeats):
            for place in places:
                for table in ("heap", "lmdb"):
                    runs[place.target][table].append(restore_all(place, ds, cache=True,
                                                                 table=table))
        out: dict[str, Any] = {"keys": keys, "tail_changes": tail,
                               "data": {k: v for k, v in ds.info.items() if k != "objects"},
                               "stores": {}}
        for place in places:
            floor = download_floor(place, snap, repeats)
            out["stores"][place.target] = {"floor": floor, "heap": summarise(
                runs[place.target]["heap"]), "lmdb": summarise(runs[place.target]["lmdb"])}
            s = out["stores"][place.target]
            print(f"(a) {place.target}: heap {s['heap']['seconds']['median']:.2f}s, lmdb "
                  f"{s['lmdb']['seconds']['median']:.2f}s, GET {floor['get_s']['median']:.3f}s")
        local = out["stores"][places[0].target]
        for s in out["stores"].values():
            for table in ("heap", "lmdb"):
                s[f"{table}_vs_local"] = (s[table]["seconds"]["median"]
                                          / local[table]["seconds"]["median"])
        for place in places[2:]:
            place.store.close()
        return out
    finally:
        stores.close()


def bench_small_puts(n: int, directory: Path) -> dict[str, Any]:
    """1 KiB puts through ``HdfsBlobStore`` on a cluster with the NameNode's default and with
    ``CLOSE_SETTING=1``; the same number of gets as a reference."""
    out: dict[str, Any] = {}
    data = os.urandom(1024)
    for value in ("0", "1"):
        cluster = MiniDfs(directory / f"close-{value}", datanodes=1,
                          settings={CLOSE_SETTING: value})
        try:
            store = open_store(cluster.uri(f"/bench-put/{uuid.uuid4().hex[:8]}"))
            put_s, get_s = [], []
            for i in range(n):
                t0 = time.perf_counter()
                store.put(f"dstl/obj-{i:05d}", data)
                put_s.append(time.perf_counter() - t0)
            for i in range(n):
                t0 = time.perf_counter()
                assert store.get(f"dstl/obj-{i:05d}") == data
                get_s.append(time.perf_counter() - t0)
            store.close()
        finally:
            cluster.close()
        out[value] = {"put_s": summary(put_s), "put_p90_s": percentile(put_s, 90),
                      "get_s": summary(get_s), "n": n}
        print(f"(b) {CLOSE_SETTING}={value}: put median {out[value]['put_s']['median'] * 1e3:.1f}"
              f" ms, get {out[value]['get_s']['median'] * 1e3:.1f} ms")
    out["ratio"] = out["1"]["put_s"]["median"] / out["0"]["put_s"]["median"]
    return out


def _markdown(figures: dict[str, Any]) -> str:
    """The docs section of a run, from its stored figures."""
    r, p = figures["restore"], figures["small_puts"]
    rows = [[target, fmt(st["heap"]["seconds"]), f"{st['heap_vs_local']:.2f}x",
             fmt(st["lmdb"]["seconds"]), f"{st['lmdb_vs_local']:.2f}x",
             fmt(st["floor"]["get_s"], digits=3)] for target, st in r["stores"].items()]
    return "\n".join([
        table(["store", "restore into the heap table s", "vs local (same run)",
               "into LMDB s", "vs local", "snapshot GET s"], rows), "",
        f"Restore at {r['keys']:,} keys ({r['data']['snapshot_mb']:.1f} MB snapshot, "
        f"{r['tail_changes']:,}-change tail), fresh cache; median (min..max) of "
        f"{figures['repeats']}, stores interleaved; HDFS = a MiniDFSCluster. A 1 KiB put: "
        f"{p['0']['put_s']['median'] * 1e3:.0f} ms with `{CLOSE_SETTING}=0`, "
        f"{p['1']['put_s']['median'] * 1e3:.0f} ms with `1`; {load_brief(figures.get('load'))}.",
    ])


def main() -> None:
    p = parser(__doc__ or "")
    add_render(p)
    args = p.parse_args()
    if args.render:
        render_stored("hdfs", Path(args.render), _markdown)
        return
    repeats = max(args.repeats, 5)
    keys = 50_000 if args.quick else 1_000_000
    tmp = Path(tempfile.mkdtemp(prefix="dstl-bench-hdfs-"))
    load = LoadSampler()
    figures: dict[str, Any] = {"repeats": repeats}
    try:
        cluster = MiniDfs(tmp / "cluster", datanodes=1)
        try:
            figures["restore"] = bench_restore(cluster, keys, repeats)
        finally:
            cluster.close()
        figures["small_puts"] = bench_small_puts(20 if args.quick else 100, tmp)
    finally:
        figures["load"] = load.stop()
        figures["load_note"] = load.note()
        shutil.rmtree(tmp, ignore_errors=True)
    publish("hdfs", figures, _markdown, quick=args.quick,
            command="python bench/hdfs.py" + (" --quick" if args.quick else ""),
            no_doc=args.no_doc, tag=args.tag)


if __name__ == "__main__":
    main()
