"""HDFS clients for DSTL's ``hdfs://`` store, measured against one MiniDFSCluster in the same run.

Candidates: ``hdfs-native`` (a native client, no JVM; used directly, as ``dstl.stores.hdfs``
does, and through its fsspec filesystem), fsspec's ``webhdfs`` (REST on the NameNode's HTTP
port, data through the DataNodes' HTTP ports), ``pyarrow.fs.HadoopFileSystem`` (libhdfs + a JVM
+ a Hadoop install; reported as unavailable when it cannot start here). Figures per client:

- 8 MiB put and get throughput (MB/s, median of the repeats);
- small-object (1 KiB) put and get latency (ms, median and p90);
- the write-once primitive the client offers, checked: a second create of an existing path
  without overwrite must fail (hdfs-native: ``WriteOptions(overwrite=False)`` and
  ``rename(..., overwrite=False)``; fsspec webhdfs: whether ``pipe_file`` overwrites).

DSTL's own put (temp file + rename without overwrite, ``HdfsBlobStore.put``) is measured beside
them, and so is a checkpoint's persist latency (p50/p99) and objects per checkpoint with 1 and 8
writers on HDFS beside the local disk and S3 on moto behind 20 ms per request, in the same run
(``write_path.bench_persist``, the write-path bench's own measurement). The cluster: one NameNode and one DataNode in one JVM (tests/support/minidfs.py), loopback.
Usage: ``python bench/hdfs_clients.py [--quick] [--repeats N]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_render, fmt, parser, percentile, publish, render_stored, table
from support.minidfs import MiniDfs

MIB = 1024 * 1024


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _measure(put: Callable[[str, bytes], None], get: Callable[[str], bytes], big_n: int,
             small_n: int, root: str) -> dict[str, Any]:
    big = os.urandom(8 * MIB)
    small = os.urandom(1024)
    put_s, get_s, sput_s, sget_s = [], [], [], []
    for i in range(big_n):
        path = f"{root}/big-{i}"
        put_s.append(_timed(lambda: put(path, big)))  # noqa: B023 - called at once
        got: list[bytes] = []
        get_s.append(_timed(lambda: got.append(get(path))))  # noqa: B023
        assert got[0] == big
    for i in range(small_n):
        path = f"{root}/small-{i}"
        sput_s.append(_timed(lambda: put(path, small)))  # noqa: B023
        sget_s.append(_timed(lambda: get(path)))  # noqa: B023

    def mbps(xs: list[float]) -> dict[str, float]:
        rates = [8 * MIB / x / 1e6 for x in xs]
        return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}

    def ms(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs) * 1000, "p90": percentile(xs, 90) * 1000}

    return {"put_8mib_MBps": mbps(put_s), "get_8mib_MBps": mbps(get_s),
            "put_1kib_ms": ms(sput_s), "get_1kib_ms": ms(sget_s)}


def _hdfs_native(cluster: MiniDfs) -> tuple[Any, Callable[[str, bytes], None],
                                             Callable[[str], bytes]]:
    from hdfs_native import Client, WriteOptions

    client = Client(f"hdfs://{cluster.namenode}")

    def put(path: str, data: bytes) -> None:
        w = client.create(path, WriteOptions(overwrite=False, create_parent=True))
        w.write(data)
        w.close()

    def get(path: str) -> bytes:
        r = client.read(path)
        return bytes(r.read_range(0, len(r)))

    return client, put, get


def _write_once_hdfs_native(cluster: MiniDfs, root: str) -> str:
    from hdfs_native import WriteOptions

    client, put, _ = _hdfs_native(cluster)
    put(f"{root}/once", b"1")
    try:
        client.create(f"{root}/once", WriteOptions(overwrite=False))
        create = "a second create without overwrite SUCCEEDED"
    except FileExistsError:
        create = "create(overwrite=False): a second create fails (FileAlreadyExists)"
    put(f"{root}/once-tmp", b"2")
    try:
        client.rename(f"{root}/once-tmp", f"{root}/once", False)
        rename = "rename without overwrite REPLACED the file"
    except FileExistsError:
        rename = "rename(overwrite=False) onto it fails"
    return f"{create}; {rename}"


def _webhdfs(cluster: MiniDfs) -> tuple[Any, Callable[[str, bytes], None],
                                         Callable[[str], bytes]]:
    import fsspec

    fs = fsspec.filesystem("webhdfs", host="127.0.0.1", port=cluster.http_port,
                           user=os.environ.get("USER", "root"), skip_instance_cache=True)
    return fs, lambda p, d: fs.pipe_file(p, d), lambda p: fs.cat_file(p)


def _write_once_webhdfs(cluster: MiniDfs, root: str) -> str:
    _, put, get = _webhdfs(cluster)
    put(f"{root}/once", b"first")
    try:
        put(f"{root}/once", b"second")
    except Exception as exc:
        return f"pipe_file refuses an existing path ({type(exc).__name__})"
    return ("none: pipe_file overwrites an existing path (fsspec's webhdfs sends "
            f"overwrite=true; read back {get(f'{root}/once')!r})")


def _pyarrow(cluster: MiniDfs) -> str | None:
    """None when pyarrow's HadoopFileSystem works here, else why not."""
    try:
        from pyarrow import fs as pafs

        hdfs = pafs.HadoopFileSystem("127.0.0.1", cluster.rpc_port)
        hdfs.get_file_info("/")
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return None


def _write_once_brief(primitive: str) -> str:
    """A client's write-once primitive (as the run found it) in a table cell."""
    if primitive.startswith("none"):
        return "no: overwrites"
    if "no create-only mode" in primitive:
        return "not `pipe_file`; `open(..., overwrite=False)`"
    return "yes"


def _markdown(figures: dict[str, Any]) -> str:
    """The benchmarks.md section of a run, from its stored figures."""
    rows = []
    for name in ("dstl HdfsBlobStore", "hdfs-native", "hdfs-native fsspec", "fsspec webhdfs"):
        f = figures[name]
        rows.append([name, fmt(f["put_8mib_MBps"], digits=0), fmt(f["get_8mib_MBps"], digits=0),
                     f"{f['put_1kib_ms']['median']:.1f} ({f['put_1kib_ms']['p90']:.1f})",
                     f"{f['get_1kib_ms']['median']:.1f} ({f['get_1kib_ms']['p90']:.1f})",
                     _write_once_brief(f["write_once"])])
    native, web = figures["hdfs-native"], figures["fsspec webhdfs"]
    md = [table(["client", "8 MiB put MB/s", "8 MiB get MB/s", "1 KiB put ms (p90)",
                 "1 KiB get ms (p90)", "write-once"], rows), "",
          "One MiniDFSCluster on loopback, every client in the same run; "
          f"{figures['big_repeats']} puts and gets of 8 MiB, {figures['small_repeats']} of 1 KiB "
          "(median, min..max or p90). hdfs-native over webhdfs: "
          f"{native['put_8mib_MBps']['median'] / web['put_8mib_MBps']['median']:.2f}x the put, "
          f"{native['get_8mib_MBps']['median'] / web['get_8mib_MBps']['median']:.2f}x the get. A "
          "1 KiB hdfs-native put waits ~500 ms for the NameNode's `complete`; a checkpoint pays "
          "it once per upload."]
    persist = figures.get("persist")
    if persist:
        by_store: dict[str, list[str]] = {}
        for r in persist.values():
            by_store.setdefault(r["store"], []).append(
                f"{r['p50_ms']['median']:.0f} ms at {r['writers']}")
        md += ["", "Persist p50 (one checkpoint of 200 changes per writer), same run: "
               + "; ".join(f"{k} {', '.join(v)} writers" for k, v in by_store.items())
               + "; at most " + f"{max(r['objects_per_checkpoint']['median'] for r in persist.values()):.2f}"
               + " objects per checkpoint."]
    return "\n".join(md)


def _persist(cluster: MiniDfs, quick: bool, repeats: int) -> dict[str, Any]:
    """Persist latency and objects per checkpoint on the local disk, S3 (moto + 20 ms) and
    HDFS, in this run (``bench/write_path.py``'s measurement)."""
    import s3fs
    from support.faulty_fs import FaultyFileSystem
    from support.moto_server import create_bucket, s3_storage_options, start_moto_server
    from write_path import persist_matrix

    from dstl.stores import FsspecBlobStore, LocalBlobStore, open_store

    tmp = tempfile.mkdtemp(prefix="dstl-bench-persist-")
    counter = iter(range(10**9))
    server, endpoint = start_moto_server()
    try:
        create_bucket(endpoint, "bench")

        def moto_store() -> Any:
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_storage_options(endpoint))
            return FsspecBlobStore(FaultyFileSystem(fs, latency_s=0.020),
                                   f"bench/{next(counter)}", location="moto+20ms")

        stores = {
            "local fs": lambda: LocalBlobStore(os.path.join(tmp, str(next(counter)))),
            "moto + 20 ms": moto_store,
            "hdfs (MiniDFSCluster)": lambda: open_store(
                cluster.uri(f"/bench-persist/{uuid.uuid4().hex[:8]}")),
        }
        return persist_matrix(stores, [1, 8], 5 if quick else 20, max(3, repeats))
    finally:
        server.stop()


def main() -> None:
    p = parser(__doc__ or "")
    add_render(p)
    args = p.parse_args()
    if args.render:
        render_stored("hdfs_clients", Path(args.render), _markdown)
        return
    big_n = 3 if args.quick else max(args.repeats, 5)
    small_n = 20 if args.quick else 100
    tmp = Path(tempfile.mkdtemp(prefix="dstl-bench-hdfs-"))
    cluster = MiniDfs(tmp / "cluster", datanodes=1, webhdfs=True)
    figures: dict[str, Any] = {"big_repeats": big_n, "small_repeats": small_n}
    try:
        run = uuid.uuid4().hex[:8]
        _, put, get = _hdfs_native(cluster)
        figures["hdfs-native"] = _measure(put, get, big_n, small_n, f"/bench-{run}/native")
        figures["hdfs-native"]["write_once"] = _write_once_hdfs_native(cluster, f"/bench-{run}/w1")

        from dstl.stores import open_store

        store = open_store(cluster.uri(f"/bench-{run}/dstl"))
        figures["dstl HdfsBlobStore"] = _measure(
            lambda p, d: store.put(p.lstrip("/"), d), lambda p: store.get(p.lstrip("/")),
            big_n, small_n, "objects")
        figures["dstl HdfsBlobStore"]["write_once"] = (
            "temp file created without overwrite, then rename(overwrite=False)")
        store.close()

        from hdfs_native.fsspec import HdfsFileSystem

        nfs = HdfsFileSystem(host="127.0.0.1", port=cluster.rpc_port, skip_instance_cache=True)
        figures["hdfs-native fsspec"] = _measure(
            lambda p, d: nfs.pipe_file(p, d), lambda p: nfs.cat_file(p), big_n, small_n,
            f"/bench-{run}/nfsspec")
        figures["hdfs-native fsspec"]["write_once"] = (
            "pipe_file has no create-only mode (open(path, 'wb', overwrite=False) does)")

        _, wput, wget = _webhdfs(cluster)
        figures["fsspec webhdfs"] = _measure(wput, wget, big_n, small_n, f"/bench-{run}/webhdfs")
        figures["fsspec webhdfs"]["write_once"] = _write_once_webhdfs(cluster, f"/bench-{run}/w2")
        figures["pyarrow HadoopFileSystem"] = {"unavailable": _pyarrow(cluster)}
        figures["persist"] = _persist(cluster, args.quick, big_n)
    finally:
        cluster.close()

    native, web = figures["hdfs-native"], figures["fsspec webhdfs"]
    figures["native_over_webhdfs"] = {
        "put_8mib": native["put_8mib_MBps"]["median"] / web["put_8mib_MBps"]["median"],
        "get_8mib": native["get_8mib_MBps"]["median"] / web["get_8mib_MBps"]["median"]}
    publish("hdfs_clients", figures, _markdown, quick=args.quick,
            command="python bench/hdfs_clients.py" + (" --quick" if args.quick else ""),
            no_doc=args.no_doc)


if __name__ == "__main__":
    main()
