"""LMDB state table: what compressing values would save on local disk and cost per put and get.

An LMDB table's leaf pages end about two thirds full, so its local disk is about twice the keys
and values it stores; Spark's RocksDB compresses its blocks. This bench measures, on real LMDB
tables (``LmdbStateTable``, its key layout, its write batches), value encodings:

* ``raw`` — the value as it is, in a table of key layout ``"1"`` (what tables stored before
  layout ``"2"``);
* ``zstd-1`` — one zstd frame per value, level 1, no dictionary (content size in the frame, no
  checksum; the value kept raw when the frame is not smaller), encoded outside a layout-1 table;
* ``dict-1`` — the same with a zstd dictionary of 8 KiB trained per table on 2,000 of its values
  with zstd's parameter search (the prototype of layout ``"2"``);
* ``table`` — the table as it is (key layout ``"2"``, :mod:`materializer.value_codec`): values
  put as they are, the table trains its dictionary from its first large write batch and encodes
  and decodes every value itself.

Disk (``disk`` rows): the workload of ``bench/scale.py`` without Spark — N keys ``k<9 digits>``,
each a 256-character value (two sha256 hex digests + 128 ``x``, the string a ``ValueState``
stores through the safe codec: 274 bytes), 4 tables of ``KeyGroupRange.of_operator(128, 4, i)``
(4 partitions), the build one write batch per table in random key order (a task's batch), then
12 rounds each updating 1 % of the keys at random, one write batch per table and round. Figures:
the data files' allocated bytes after the build and after the rounds, the size of a compacting
copy (the tree's pages, what a table snapshot holds) and of that copy through zstd level 1 (the
data of a snapshot object, :mod:`materializer.file_snapshot`), of a packed copy (the records
appended in key order, :class:`materializer.lmdb_files.PackedEnvironment`: what packing a live
table would reach), the leaf fill (``leaf_fill``), and the key
and value bytes stored. Also, at the smaller size, values that compress less: 256 random hex
characters (``hex``), 256 random bytes (``random``). And the rounds committed every
:data:`COMMIT_EVERY` puts of a table instead of once (LMDB reuses a page freed by a transaction
only two transactions later, so the free pages a table keeps follow the pages one transaction
changes). Deterministic for a seed: one run per cell.

Cost (``cost`` rows, medians of ``--repeats`` interleaved repeats with min..max): ns per
``LmdbStateTable.put`` of the encoded value inside a write batch, encoding included, and per
``get`` with decoding, over 100 k entries (quick: 20 k) updated and read at random; the same
for ``raw``, so the ratio is against the table as it is, same run. And ns per
``ValueState.update`` of the 256-character string on a ``ChangelogKeyedStateBackend`` on LMDB
inside ``tables.write_batch()`` (the path a task's batch takes: key, codec, log append, table
put), to set the codec's cost against a whole update; and the time to train a dictionary.

Spark's figure (its RocksDB working directories at the same sizes) comes from the stored
``bench/scale.py`` runs that measured it, not this run: they vary between runs (RocksDB's
compactions), and the ratio is taken against the smallest.

Run: ``.venv/bin/python bench/table_codec.py [--quick]``; ``--render RESULTS.json`` rebuilds
the docs section of a stored run.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lmdb  # noqa: E402
import zstandard  # noqa: E402

from bench._common import (  # noqa: E402
    RESULTS,
    LoadSampler,
    add_render,
    load_brief,
    parser,
    publish,
    render_stored,
    summary,
    table,
)
from dstl import ChangelogStorage, DstlOptions  # noqa: E402
from dstl.keygroups import KeyGroupRange, key_group_for  # noqa: E402
from materializer import ChangelogKeyedStateBackend, ValueStateDescriptor  # noqa: E402
from materializer.codecs import SafeCodec  # noqa: E402
from materializer.lmdb_files import PackedEnvironment  # noqa: E402
from materializer.lmdb_table import LAYOUT_KEY, LmdbStateTable  # noqa: E402
from materializer.options import BackendOptions  # noqa: E402
from materializer.value_codec import DICT_KEY_PREFIX  # noqa: E402

MP = 128
PARTITIONS = 4
ROUNDS = 12
UPDATE_FRAC = 0.01
DICT_BYTES = 8192
DICT_SAMPLES = 2000
COMMIT_EVERY = 256
VARIANTS = ("raw", "zstd-1", "dict-1", "table")
KINDS = ("scale", "hex", "random")
SAFE = SafeCodec()

Encode = Callable[[bytes], bytes]
Decode = Callable[[bytes], bytes]


def value_of(kind: str, i: int, version: int) -> bytes:
    """The stored bytes of key ``i``'s value at ``version`` (the safe codec's encoding)."""
    salt = f"{i}:{version}"
    if kind == "scale":
        text = (hashlib.sha256((salt + "a").encode()).hexdigest()
                + hashlib.sha256((salt + "b").encode()).hexdigest() + "x" * 128)
        return SAFE.encode(text)
    if kind == "hex":
        return SAFE.encode("".join(hashlib.sha256(f"{salt}:{j}".encode()).hexdigest()
                                   for j in range(4)))
    return SAFE.encode(random.Random(salt).randbytes(256))


def codec(variant: str, samples: list[bytes]) -> tuple[Encode, Decode, int]:
    """``(encode, decode, dictionary bytes)`` of a variant; ``samples`` train a dictionary
    (``table``: the table encodes, so nothing here)."""
    if variant in ("raw", "table"):
        return (lambda v: v), (lambda v: v), 0
    level = int(variant.split("-")[1])
    data = None
    if variant.startswith("dict"):
        train: list[bytes | bytearray | memoryview] = list(samples)
        data = zstandard.train_dictionary(DICT_BYTES, train, level=level)
    c = zstandard.ZstdCompressor(level=level, dict_data=data, write_content_size=True,
                                 write_checksum=False, write_dict_id=False)
    d = zstandard.ZstdDecompressor(dict_data=data) if data else zstandard.ZstdDecompressor()
    compress, decompress = c.compress, d.decompress

    # A flag byte would tell raw from compressed in a format; here the length decides, which
    # is enough to measure (every value of a kind is the same length).
    def encode(v: bytes) -> bytes:
        x = compress(v)
        return x if len(x) < len(v) else v

    def decode(x: bytes, n: int = len(samples[0])) -> bytes:
        return x if len(x) == n else decompress(x)

    return encode, decode, len(data.as_bytes()) if data else 0


def new_table(directory: str, key_groups: KeyGroupRange, variant: str) -> LmdbStateTable:
    """A table for ``variant``: key layout ``"2"`` for ``table``, else a table of layout ``"1"``
    (values stored as they are put), made by writing its layout record first."""
    if variant != "table":
        os.makedirs(directory, exist_ok=True)
        env = lmdb.open(directory, map_size=1 << 20)
        try:
            with env.begin(write=True) as txn:
                txn.put(LAYOUT_KEY, b"1")
        finally:
            env.close()
    t = LmdbStateTable(directory, key_groups)
    assert t.layout == (b"2" if variant == "table" else b"1")
    return t


def _dictionary_bytes(tables: list[LmdbStateTable]) -> int:
    total = 0
    for t in tables:
        snap = t.snapshot()
        try:
            total += sum(len(v) for k, v in snap.records() if k.startswith(DICT_KEY_PREFIX))
        finally:
            snap.release()
    return total


def _allocated(directory: str) -> int:
    return sum(os.stat(os.path.join(directory, str(p), "data.mdb")).st_blocks * 512
               for p in range(PARTITIONS))


def _snapshot_object_bytes(snap: Any, path: str) -> int:
    """The data of a table snapshot's object: its compacting copy through zstd at level 1
    (what :func:`materializer.file_snapshot.write_file_snapshot` stores, header aside)."""
    with open(path, "wb") as f:
        snap.copy_to(f.fileno())
    try:
        with open(path, "rb") as f:
            out = zstandard.ZstdCompressor(level=1).compress(f.read())
        return len(out)
    finally:
        os.remove(path)


def disk(n: int, kind: str, variant: str, seed: int, where: str, *,
         commit_every: int | None = None) -> dict[str, Any]:
    """One cell of the disk rows (module docstring); ``commit_every``: the rounds commit after
    that many puts of a table instead of once per table and round."""
    rng = random.Random(seed)
    keys = [f"k{i:09d}".encode() for i in range(n)]
    kgs = [key_group_for(k, MP) for k in keys]
    ranges = [KeyGroupRange.of_operator(MP, PARTITIONS, p) for p in range(PARTITIONS)]
    part = [next(p for p, r in enumerate(ranges) if kg in r) for kg in range(MP)]
    by_part: list[list[int]] = [[] for _ in ranges]
    order = list(range(n))
    rng.shuffle(order)
    for i in order:
        by_part[part[kgs[i]]].append(i)
    d = tempfile.mkdtemp(prefix="table-codec-", dir=where)
    tables = [new_table(os.path.join(d, str(p)), r, variant) for p, r in enumerate(ranges)]
    raw = stored = dict_bytes = 0
    decoders = []
    try:
        t0 = time.perf_counter()
        encoders = []
        for p, t in enumerate(tables):
            samples = [value_of(kind, i, 0) for i in by_part[p][:DICT_SAMPLES]]
            enc, dec, nd = codec(variant, samples)
            encoders.append(enc)
            decoders.append(dec)
            dict_bytes += nd
            with t.write_batch():
                put = t.put
                for i in by_part[p]:
                    v = value_of(kind, i, 0)
                    e = enc(v)
                    raw += len(keys[i]) + len(v)
                    stored += len(keys[i]) + len(e)
                    put(1, kgs[i], keys[i], b"", e)
        build_s = time.perf_counter() - t0
        after_build = _allocated(d)
        if variant == "table":   # what the table stores: its own encoding
            dict_bytes = _dictionary_bytes(tables)
            stored = 0
            for t in tables:
                snap = t.snapshot()
                try:
                    stored += sum(len(k) - 8 + len(v) for k, v in snap.records()
                                  if k[:2] != b"\xff\xff")
                finally:
                    snap.release()
        for r in range(ROUNDS):
            chosen = rng.sample(range(n), int(n * UPDATE_FRAC))
            for p, t in enumerate(tables):
                enc = encoders[p]
                mine = [i for i in chosen if part[kgs[i]] == p]
                step = commit_every or len(mine) or 1
                for s in range(0, len(mine), step):
                    with t.write_batch():
                        for i in mine[s:s + step]:
                            t.put(1, kgs[i], keys[i], b"", enc(value_of(kind, i, r + 1)))
        after_rounds = _allocated(d)
        copy = obj = packed = 0
        fills = []
        for p, t in enumerate(tables):
            snap = t.snapshot()
            try:
                copy += snap.copy_size()
                fills.append(snap.leaf_fill())
                obj += _snapshot_object_bytes(snap, os.path.join(d, f"copy-{p}"))
                with PackedEnvironment(snap, d) as env:
                    packed += env.copy_size()
            finally:
                snap.release()
        # what is read back decodes to a value written for that key (a sample of keys)
        for i in random.Random(seed + 1).sample(range(n), min(n, 200)):
            t = tables[part[kgs[i]]]
            got = decoders[part[kgs[i]]](t.get(1, kgs[i], keys[i], b"") or b"")
            if got not in {value_of(kind, i, v) for v in range(ROUNDS + 1)}:
                raise AssertionError(f"key {i}: the value read back is none written")
    finally:
        for t in tables:
            t.close()
        shutil.rmtree(d, ignore_errors=True)
    return {"keys": n, "kind": kind, "variant": variant, "raw_bytes": raw,
            "stored_bytes": stored, "dict_bytes": dict_bytes, "build_s": build_s,
            "allocated_after_build": after_build, "allocated_after_rounds": after_rounds,
            "copy_bytes": copy, "object_bytes": obj, "packed_bytes": packed,
            "commit_every": commit_every, "leaf_fill": statistics.mean(fills)}


def cost(n: int, repeats: int, where: str) -> dict[str, Any]:
    """The cost rows (module docstring): per-variant put/get ns, interleaved repeats."""
    rng = random.Random(11)
    keys = [f"k{i:09d}".encode() for i in range(n)]
    kgs = [key_group_for(k, MP) for k in keys]
    versions = [[value_of("scale", i, v) for i in range(n)] for v in range(2)]
    ops = n // 5
    d = tempfile.mkdtemp(prefix="table-codec-cost-", dir=where)
    tables: dict[str, tuple[LmdbStateTable, Encode, Decode]] = {}
    samples: dict[str, dict[str, list[float]]] = {}
    storage = ChangelogStorage(os.path.join(d, "store"), options=DstlOptions())
    backend = ChangelogKeyedStateBackend(
        storage, "codec", KeyGroupRange(0, MP - 1), MP, table="lmdb",
        options=BackendOptions(materialization_interval_s=None, materialize_log_ratio=None),
        local_directory=os.path.join(d, "backend"))
    try:
        for variant in VARIANTS:
            enc, dec, _ = codec(variant, versions[0][:DICT_SAMPLES])
            t = new_table(os.path.join(d, variant), KeyGroupRange(0, MP - 1), variant)
            with t.write_batch():
                for i in rng.sample(range(n), n):
                    t.put(1, kgs[i], keys[i], b"", enc(versions[0][i]))
            tables[variant] = (t, enc, dec)
            samples[variant] = {"put_ns": [], "get_ns": []}
        state = backend.get_state(ValueStateDescriptor("v"))
        texts = [SAFE.decode(versions[1][i]) for i in range(n)]
        strs = [k.decode() for k in keys]
        with backend.tables.write_batch():
            for i in range(n):
                backend.set_current_key(strs[i])
                state.update(texts[i])
        samples["backend"] = {"update_ns": [], "value_ns": []}
        for rep in range(repeats):
            chosen = random.Random(rep).sample(range(n), ops)
            new = versions[rep % 2]
            for variant, (t, enc, dec) in tables.items():
                put, get = t.put, t.get
                t0 = time.perf_counter_ns()
                with t.write_batch():
                    for i in chosen:
                        put(1, kgs[i], keys[i], b"", enc(new[i]))
                samples[variant]["put_ns"].append((time.perf_counter_ns() - t0) / ops)
                t0 = time.perf_counter_ns()
                with t.write_batch():
                    for i in chosen:
                        dec(get(1, kgs[i], keys[i], b"") or b"")
                samples[variant]["get_ns"].append((time.perf_counter_ns() - t0) / ops)
            set_key, update, value = backend.set_current_key, state.update, state.value
            t0 = time.perf_counter_ns()
            with backend.tables.write_batch():
                for i in chosen:
                    set_key(strs[i])
                    update(texts[i])
            samples["backend"]["update_ns"].append((time.perf_counter_ns() - t0) / ops)
            t0 = time.perf_counter_ns()
            with backend.tables.write_batch():
                for i in chosen:
                    set_key(strs[i])
                    value()
            samples["backend"]["value_ns"].append((time.perf_counter_ns() - t0) / ops)
    finally:
        for t, _, _ in tables.values():
            t.close()
        backend.close()
        storage.close()
        shutil.rmtree(d, ignore_errors=True)
    out: dict[str, Any] = {"entries": n, "ops_per_repeat": ops}
    # training: the default (zstd searches its parameters: what the disk rows use) and fixed
    # parameters; CPU seconds of this process, and the mean size of 2,000 other values
    train: list[bytes | bytearray | memoryview] = list(versions[0][:DICT_SAMPLES])
    held_out = versions[1][DICT_SAMPLES:2 * DICT_SAMPLES]
    for name, params in (("train_default", {}), ("train_k1024_d8", {"k": 1024, "d": 8})):
        cpu: list[float] = []
        wall: list[float] = []
        data = None
        for _ in range(repeats):
            c0, w0 = time.process_time(), time.perf_counter()
            data = zstandard.train_dictionary(DICT_BYTES, train, level=1, **params)
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
        comp = zstandard.ZstdCompressor(level=1, dict_data=data, write_content_size=True,
                                        write_checksum=False, write_dict_id=False)
        out[name] = {"cpu_s": summary(cpu), "wall_s": summary(wall),
                     "mean_bytes": statistics.mean(len(comp.compress(v)) for v in held_out)}
    for name, figs in samples.items():
        out[name] = {k: summary(v) for k, v in figs.items()}
    return out


def spark_disk() -> dict[str, Any]:
    """Spark's local disk per size in every stored ``bench/scale.py`` run that holds it (RocksDB's
    working directories vary between runs with its compactions: the ratio is taken against
    the smallest)."""
    files: list[str] = []
    found: dict[str, list[int]] = {}
    for path in sorted(RESULTS.glob("scale-2*.json")):
        rows = json.loads(path.read_text())["figures"].get("results", [])
        got = [(str(r["keys"]), int(r["local_disk_bytes"])) for r in rows
               if r.get("variant") == "spark" and r.get("local_disk_bytes")]
        if got:
            files.append(path.name)
        for size, b in got:
            found.setdefault(size, []).append(b)
    return {"files": files, "bytes": found}


def main() -> None:
    p = parser(__doc__.split("\n", 1)[0])
    add_render(p)
    p.add_argument("--keys", default=None, help="comma-separated sizes of the disk rows")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--dir", default=None, help="where the tables go (default: a temp dir)")
    args = p.parse_args()
    if args.render:
        sys.exit(render_stored("table_codec", Path(args.render), markdown))
    sizes = ([int(x) for x in args.keys.split(",")] if args.keys
             else [20_000] if args.quick else [200_000, 1_000_000])
    where = args.dir or tempfile.gettempdir()
    sampler = LoadSampler()
    rows = []
    for n in sizes:
        for kind in KINDS if n == sizes[0] else ("scale",):
            for variant in VARIANTS:
                r = disk(n, kind, variant, args.seed, where)
                print(json.dumps(r), flush=True)
                rows.append(r)
        for variant in VARIANTS:
            r = disk(n, "scale", variant, args.seed, where, commit_every=COMMIT_EVERY)
            print(json.dumps(r), flush=True)
            rows.append(r)
    c = cost(20_000 if args.quick else 100_000, args.repeats, where)
    print(json.dumps(c), flush=True)
    figures = {"disk": rows, "cost": c, "spark": spark_disk(), "load": sampler.stop(),
               "config": {"sizes": sizes, "partitions": PARTITIONS, "rounds": ROUNDS,
                          "update_frac": UPDATE_FRAC, "dict_bytes": DICT_BYTES,
                          "repeats": args.repeats, "seed": args.seed}}
    command = "python bench/table_codec.py" + (" --quick" if args.quick else "") + (
        f" --keys {args.keys}" if args.keys else "")
    publish("table_codec", figures, markdown, quick=args.quick, command=command,
            no_doc=args.no_doc, tag=args.tag)


def _train(t: dict[str, Any]) -> str:
    cpu = t["cpu_s"]
    wall = t["wall_s"]
    return (f"{cpu['median']:.2f} s of CPU ({cpu['min']:.2f}..{cpu['max']:.2f}) in "
            f"{wall['median']:.2f} s ({wall['min']:.2f}..{wall['max']:.2f}), "
            f"{t['mean_bytes']:.1f} bytes per value of 2,000 others")


def _mb(b: float) -> str:
    return f"{b / 1e6:.1f}"


def _other_kinds(disk: list[dict[str, Any]]) -> str:
    """The value kinds other than ``scale`` in one sentence: each encoding's disk after the rounds
    as a share of the raw encoding's, per kind and size (one commit per round)."""
    raw = {(r["kind"], r["keys"]): r["allocated_after_rounds"] for r in disk
           if r["variant"] == "raw" and r["commit_every"] is None}
    parts = []
    for kind in sorted({r["kind"] for r in disk} - {"scale"}):
        cells = [f"{r['variant']} {r['allocated_after_rounds'] / raw[(kind, r['keys'])]:.2f}x"
                 + (f" at {r['keys']:,} keys" if len({x['keys'] for x in disk
                                                       if x['kind'] == kind}) > 1 else "")
                 for r in disk if r["kind"] == kind and r["variant"] != "raw"
                 and r["commit_every"] is None and (kind, r["keys"]) in raw]
        parts.append(f"{kind} values: " + ", ".join(cells))
    return ("Disk after the rounds against the raw encoding, one commit per round, "
            + "; ".join(parts) + ".") if parts else ""


def markdown(f: dict[str, Any]) -> str:
    spark = f["spark"]
    if "file" in spark:   # a run that read one scale run: its figure per size
        spark = {"files": [spark["file"]] if spark["file"] else [],
                 "bytes": {k: [v] for k, v in spark["bytes"].items()}}
    rows = []
    others = _other_kinds(f["disk"])
    for r in f["disk"]:
        if r["kind"] != "scale":
            continue   # summarised in one sentence (``others``)
        runs = spark["bytes"].get(str(r["keys"])) if r["kind"] == "scale" else None
        sp = min(runs) if runs else None
        rounds = "one per round" if r["commit_every"] is None else f"every {r['commit_every']}"
        rows.append([f"{r['keys']:,}", r["variant"], rounds, _mb(r["stored_bytes"]),
                     _mb(r["allocated_after_build"]), _mb(r["allocated_after_rounds"]),
                     _mb(r["copy_bytes"]), _mb(r["packed_bytes"]), _mb(r["object_bytes"]),
                     f"{r['leaf_fill']:.2f}",
                     f"{r['allocated_after_rounds'] / sp:.2f}x" if sp else "-"])
    c = f["cost"]

    def cell(s: dict[str, float]) -> str:
        return f"{s['median']:.0f} ({s['min']:.0f}..{s['max']:.0f})"

    crow = []
    for v in VARIANTS:
        put, get = c[v]["put_ns"], c[v]["get_ns"]
        crow.append([v, cell(put), f"{put['median'] / c['raw']['put_ns']['median']:.2f}x",
                     cell(get), f"{get['median'] / c['raw']['get_ns']['median']:.2f}x"])
    b = c["backend"]
    spans = "; ".join(f"{int(k):,} keys {_mb(min(v))}..{_mb(max(v))} MB"
                      for k, v in sorted(spark["bytes"].items(), key=lambda kv: int(kv[0])))
    sp_note = (f"Spark column: the smallest of Spark's RocksDB working directories in the "
               f"{len(spark['files'])} stored `bench/scale.py` runs that measured them (not this "
               f"run; {spans}: they vary with RocksDB's compactions)"
               if spark["files"] else "no Spark figure stored")
    return "\n\n".join([
        table(["keys (`scale` values)", "encoding", "commits in a round (per table)",
               "keys + values stored (MB)", "disk after build (MB)", "disk after 12 rounds (MB)",
               "compacted copy (MB)", "packed copy (MB)", "snapshot object (MB)", "leaf fill",
               "disk / Spark (smallest)"], rows),
        others,
        table(["encoding", "put ns, encoding included", "vs raw", "get ns, decoding included",
               "vs raw"], crow),
        f"For scale: a `ValueState.update` of the same value on an LMDB backend in a write batch "
        f"costs {cell(b['update_ns'])} ns, a `value()` {cell(b['value_ns'])} ns (same run). "
        + (f"Training a dictionary of {f['config']['dict_bytes'] // 1024} KiB on "
           f"{DICT_SAMPLES:,} values: {_train(c['train_default'])} with zstd's parameter search "
           f"(the rows above), {_train(c['train_k1024_d8'])} with k=1024, d=8. "
           if "train_k1024_d8" in c else "")
        + f"{c['entries']:,} entries, {c['ops_per_repeat']:,} puts and gets per repeat, "
        f"{f['config']['repeats']} interleaved repeats: median (min..max). Disk: 4 tables (4 "
        f"partitions), the build one write batch per table in random key order, 12 rounds of 1 % "
        f"updates; deterministic for the seed, one run per cell. {sp_note}. "
        f"{load_brief(f.get('load'))}.",
    ])


if __name__ == "__main__":
    main()
