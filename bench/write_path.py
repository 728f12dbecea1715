"""Write-path benchmark: append rate, segment encoding, persist latency.

Figures, each against its baseline in the same run:

1. ``writer.append`` of 64 B and 1 KiB payloads vs a bare ``struct`` + ``bytearray`` framing loop
   (the least any length-prefixed log must do), their repeats interleaved so that load from
   other jobs on a shared machine hits both alike. Goal: >= 1 M changes/s at 64 B, ratio >= 0.5.
2. Segment encoding (per-change-set zstd frames + CRCs + index) vs one-shot raw zstd of the same
   bytes at the same level. Goal: ratio >= 0.7.
3. Persist latency p50/p99 and objects per checkpoint with 1, 8, 32 writers of one storage, on
   the local filesystem and on a moto S3 server behind a 20 ms-per-request latency wrapper.

Run: ``.venv/bin/python bench/write_path.py [--quick]``; ``--render RESULTS.json`` rebuilds the
docs section of a stored run.
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import zstandard  # noqa: E402

from bench._common import (  # noqa: E402
    LoadSampler,
    add_render,
    fmt,
    load_brief,
    parser,
    percentile,
    publish,
    render_stored,
    repeat,
    summary,
    table,
)
from dstl import ChangelogStorage, DstlOptions, KeyGroupRange  # noqa: E402
from dstl.segment import CHANGE_LEN, build_change_set, encode_segment  # noqa: E402
from dstl.stores import (  # noqa: E402
    FsspecBlobStore,
    LocalBlobStore,
    MemoryBlobStore,
)

KGS = KeyGroupRange(0, 127)


def payloads(n: int, size: int, offset: int = 0) -> list[bytes]:
    # changelog-like: op byte, state id, a key and a value (compressible, but not repeated
    # between writers: one-shot zstd must not win by back-referencing another writer's bytes)
    out = []
    for i in range(offset, offset + n):
        head = b"\x01\x00\x03user-%08d|" % (i * 7919 % 10_000_000)
        out.append((head + b"%d;" % (i * 2654435761 % 1_000_003) * (size // 6 + 1))[:size])
    return out


# ----------------------------------------------------------------- 1. append


def bench_append(size: int, n: int, repeats: int) -> dict[str, Any]:
    """Changes per second, by the wall clock and by the CPU time of the appending thread (the
    code's own cost: a thread waiting for a core on a shared machine is not charged; append
    does all its work on the calling thread here, since no persist fires)."""
    data = payloads(n, size)
    kgs = [i % 128 for i in range(n)]

    def bare() -> tuple[float, float]:
        pack = struct.Struct(">I").pack
        bufs: dict[int, bytearray] = {}
        t0, c0 = time.perf_counter(), time.thread_time()
        for kg, p in zip(kgs, data):
            buf = bufs.get(kg)
            if buf is None:
                buf = bufs[kg] = bytearray()
            buf += pack(len(p))
            buf += p
        return n / (time.perf_counter() - t0), n / (time.thread_time() - c0)

    def dstl_append() -> tuple[float, float]:
        opts = DstlOptions(preemptive_persist_threshold_bytes=(1 << 31) - 1,
                           max_change_set_bytes=1 << 31,
                           persist_size_threshold_bytes=1 << 30, max_in_flight_bytes=1 << 41)
        with ChangelogStorage(store=MemoryBlobStore(), options=opts) as s:
            w = s.create_writer("bench", KGS)
            append = w.append
            t0, c0 = time.perf_counter(), time.thread_time()
            for kg, p in zip(kgs, data):
                append(kg, p)
            rates = n / (time.perf_counter() - t0), n / (time.thread_time() - c0)
            w.close()
        return rates

    bs: list[tuple[float, float]] = []
    ds: list[tuple[float, float]] = []
    for _ in range(repeats):  # interleaved: a ratio compares runs made under the same load
        bs.append(bare())
        ds.append(dstl_append())
    out: dict[str, Any] = {"payload_bytes": size, "changes": n}
    for clock, i in (("", 0), ("cpu_", 1)):
        rb, rd = summary([b[i] for b in bs]), summary([d[i] for d in ds])
        out.update({
            f"bare_{clock}per_s": rb, f"append_{clock}per_s": rd,
            f"{clock}ratio": rd["median"] / rb["median"],
            f"{clock}ratio_per_repeat": summary([d[i] / b[i] for b, d in zip(bs, ds)]),
            f"{clock}ns_per_change": 1e9 / rd["median"],
            f"bare_{clock}ns_per_change": 1e9 / rb["median"]})
    return out


# ----------------------------------------------------------------- 2. encode


def bench_encode(n_sets: int, per_set: int, level: int, repeats: int) -> dict[str, Any]:
    sets = []
    for w in range(n_sets):
        data = payloads(per_set, 64, offset=w * per_set)
        blocks: dict[int, bytearray] = {}
        for i, p in enumerate(data):
            buf = blocks.setdefault(i % 128, bytearray())
            buf += CHANGE_LEN.pack(len(p))
            buf += p
        sets.append(build_change_set(f"writer-{w}", 0, blocks, per_set, sum(map(len, data))))
    raw = b"".join(cs.body for cs in sets)
    mb = len(raw) / 1e6

    def encode() -> float:
        t0 = time.perf_counter()
        encode_segment(sets, level)
        return mb / (time.perf_counter() - t0)

    def raw_zstd() -> float:
        cctx = zstandard.ZstdCompressor(level=level)
        t0 = time.perf_counter()
        cctx.compress(raw)
        return mb / (time.perf_counter() - t0)

    seg, _ = encode_segment(sets, level)
    re_ = repeat(encode, repeats)
    rz = repeat(raw_zstd, repeats)
    return {"change_sets": n_sets, "changes_per_set": per_set, "level": level,
            "input_mb": mb, "segment_mb_per_s": re_, "raw_zstd_mb_per_s": rz,
            "ratio": re_["median"] / rz["median"], "compression_ratio": len(raw) / len(seg),
            "crc32_mb_per_s": mb / _time(lambda: zlib.crc32(raw))}


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ----------------------------------------------------------------- 3. persist latency


def bench_persist(make_store: Callable[[], Any], writers: int, rounds: int,
                  changes_per_round: int) -> dict[str, Any]:
    data = payloads(changes_per_round, 64)
    with ChangelogStorage(store=make_store(), options=DstlOptions()) as s:
        ws = [s.create_writer(f"w{i}", KGS) for i in range(writers)]
        frm = [0] * writers
        lat: list[float] = []
        objects: list[int] = []
        for cp in range(1, rounds + 1):
            for w in ws:
                for i, p in enumerate(data):
                    w.append(i % 128, p)
            before = s.metrics()["ChangelogStorage.numberOfSegments"]
            t0 = time.perf_counter()
            futs = [w.persist(frm[i], cp) for i, w in enumerate(ws)]
            for i, f in enumerate(futs):
                h = f.result(60)
                lat.append(time.perf_counter() - t0)
                ws[i].confirm(h.from_sqn, h.to_sqn, cp)
                ws[i].truncate(h.to_sqn)  # as if materialized: keeps the log short
                frm[i] = h.to_sqn
            objects.append(int(s.metrics()["ChangelogStorage.numberOfSegments"] - before))
        for w in ws:
            w.close()
    return {"p50_ms": percentile(lat, 50) * 1e3, "p99_ms": percentile(lat, 99) * 1e3,
            "objects_per_checkpoint": sum(objects) / len(objects)}


def persist_matrix(stores: dict[str, Callable[[], Any]], writer_counts: list[int], rounds: int,
                   repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, make in stores.items():
        for n in writer_counts:
            runs = [bench_persist(make, n, rounds, 200) for _ in range(repeats)]
            out[f"{name}/{n}"] = {
                "store": name, "writers": n,
                "p50_ms": summary([r["p50_ms"] for r in runs]),
                "p99_ms": summary([r["p99_ms"] for r in runs]),
                "objects_per_checkpoint": summary([r["objects_per_checkpoint"] for r in runs]),
            }
    return out


def main() -> None:
    p = parser(__doc__ or "")
    add_render(p)
    args = p.parse_args()
    if args.render:
        render_stored("write_path", Path(args.render), markdown)
        return
    q = args.quick
    reps = args.repeats
    n = 200_000 if q else 1_000_000
    figures: dict[str, Any] = {}
    load = LoadSampler()
    figures["append_64"] = bench_append(64, n, reps)
    figures["append_1k"] = bench_append(1024, n // 4, reps)
    figures["append_load"] = load.stop()
    figures["encode"] = bench_encode(16, 5_000 if q else 20_000, 1, reps)
    figures["encode_l3"] = bench_encode(16, 5_000 if q else 20_000, 3, reps)

    tmp = tempfile.mkdtemp(prefix="dstl-bench-")
    counter = iter(range(10**9))
    stores: dict[str, Callable[[], Any]] = {
        "local fs": lambda: LocalBlobStore(os.path.join(tmp, str(next(counter)))),
    }
    server = None
    try:
        import s3fs
        from support.faulty_fs import FaultyFileSystem
        from support.moto_server import create_bucket, s3_storage_options, start_moto_server

        server, endpoint = start_moto_server()
        create_bucket(endpoint, "bench")

        def moto_store() -> Any:
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_storage_options(endpoint))
            return FsspecBlobStore(FaultyFileSystem(fs, latency_s=0.020),
                                   f"bench/{next(counter)}", location="moto+20ms")

        stores["moto + 20 ms"] = moto_store
        counts = [1, 8] if q else [1, 8, 32]
        figures["persist"] = persist_matrix(stores, counts, 8 if q else 20, reps)
    finally:
        if server is not None:
            server.stop()

    publish("write_path", figures, markdown, quick=q,
            command=f"python bench/write_path.py{' --quick' if q else ''}", no_doc=args.no_doc)


def markdown(figures: dict[str, Any]) -> str:
    """The docs section of a run, from its stored figures."""
    a64, a1k, enc, enc3 = (figures["append_64"], figures["append_1k"], figures["encode"],
                           figures["encode_l3"])

    def met(ok: bool) -> str:
        return "met" if ok else "**missed**"

    rows = [
        ["append, 64 B payloads (changes/s)", fmt(a64["append_per_s"], digits=0),
         f"bare `struct` + `bytearray` loop: {fmt(a64['bare_per_s'], digits=0)}",
         f"{a64['ratio']:.2f}x (per repeat {fmt(a64['ratio_per_repeat'])})",
         ">= 1 M/s and >= 0.5x: "
         + met(a64["append_per_s"]["median"] >= 1e6 and a64["ratio"] >= 0.5)],
        ["append, 1 KiB payloads (changes/s)", fmt(a1k["append_per_s"], digits=0),
         f"bare loop: {fmt(a1k['bare_per_s'], digits=0)}",
         f"{a1k['ratio']:.2f}x (per repeat {fmt(a1k['ratio_per_repeat'])})",
         ">= 0.5x: " + met(a1k["ratio"] >= 0.5)],
        ["segment encoding, zstd 1 (MB/s of input)", fmt(enc["segment_mb_per_s"], digits=0),
         f"raw zstd 1: {fmt(enc['raw_zstd_mb_per_s'], digits=0)}", f"{enc['ratio']:.2f}x",
         ">= 0.7x: " + met(enc["ratio"] >= 0.7)],
        ["segment encoding, zstd 3 (MB/s of input)", fmt(enc3["segment_mb_per_s"], digits=0),
         f"raw zstd 3: {fmt(enc3['raw_zstd_mb_per_s'], digits=0)}", f"{enc3['ratio']:.2f}x",
         ">= 0.7x: " + met(enc3["ratio"] >= 0.7)],
    ]
    persist: dict[str, list[str]] = {}
    writers: list[str] = []
    for r in figures.get("persist", {}).values():
        persist.setdefault(r["store"], []).append(f"{r['p50_ms']['median']:.0f}")
        writers += [] if str(r["writers"]) in writers else [str(r["writers"])]
    objects = max((r["objects_per_checkpoint"]["median"]
                   for r in figures.get("persist", {}).values()), default=float("nan"))
    return "\n".join([
        table(["figure", "DSTL", "baseline (same run)", "ratio", "goal"], rows), "",
        f"Median (min..max) of {a64['append_per_s']['n']} repeats, interleaved; "
        f"{load_brief(figures.get('append_load'))}; by the thread's CPU time the 64 B ratio is "
        f"{a64['cpu_ratio']:.2f}x. Persist p50 in ms at {' / '.join(writers)} writers (one "
        "checkpoint of 200 changes each): "
        + ", ".join(f"{store} {' / '.join(v)}" for store, v in persist.items())
        + f"; <= {objects:.2f} objects per checkpoint.",
    ])


if __name__ == "__main__":
    main()
