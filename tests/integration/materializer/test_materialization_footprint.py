"""What a file-level materialization of an LMDB table costs besides the table, and what its
restore installs: the copy streams through a pipe into the compressor (no uncompressed copy on
disk or in memory), the object is spooled in an unnamed file, nothing is left beside the table;
a table whose pages are far from full is packed first, so its object and the table restored from
it are smaller, with the same entries — from another process (the executor agent's materializer)
and in the writer's own process."""

from __future__ import annotations

import json
import os
import random
import stat
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from materializer import (
    BackendOptions,
    ChangelogKeyedStateBackend,
    ValueStateDescriptor,
    lmdb_files,
)
from materializer.file_snapshot import spool_file_snapshot
from materializer.lmdb_files import PACK_BELOW_FILL
from restore import restore_backend

MP = 16
KGS = KeyGroupRange(0, MP - 1)
OP = "op-footprint"
NO_TIMER = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
ENTRIES = 30_000
#: Chunks a streamed write holds at most besides the object: the compressor's input chunk
#: (4 MiB), its output and Python's buffers around them.
CHUNK_ALLOWANCE = 12 << 20

# The agent's materializer in a process of its own (py-lmdb opens an environment once per
# process), with the copy and the directory beside the table watched.
_MATERIALIZE = r"""
import json, os, stat, sys, tracemalloc
from dstl.keygroups import KeyGroupRange
from dstl.stores import open_store
from materializer import lmdb_files
from materializer.external import materialize_table_directory
directory, store_uri, end = sys.argv[1], sys.argv[2], int(sys.argv[3])
parent = os.path.dirname(directory)
seen = {}
spool = lmdb_files.spool_file_snapshot
def watched(copy, raw_size, meta, where, **kw):
    def watching(fd):
        seen["fifo"] = stat.S_ISFIFO(os.fstat(fd).st_mode)
        seen["beside"] = sorted(os.listdir(parent))
        copy(fd)
    seen["raw_size"] = raw_size
    return spool(watching, raw_size, meta, where, **kw)
lmdb_files.spool_file_snapshot = watched
before = sorted(os.listdir(parent))
tracemalloc.start()
m = materialize_table_directory(directory, KeyGroupRange(0, end), open_store(store_uri))
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"peak": peak, "size": m.ref.size, "before": before,
                  "after": sorted(os.listdir(parent)), **seen}))
"""


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(str(tmp_path / "store"), options=DstlOptions(persist_delay_s=0.0))
    yield s
    s.close()


def _value(rng: random.Random) -> str:
    return f"{rng.getrandbits(64):016x}" + "text " * 60


def _filled(storage: ChangelogStorage, local: Path) -> tuple[ChangelogKeyedStateBackend,
                                                              dict[str, str]]:
    """A table of ``ENTRIES`` compressible values written in key order (ascending in each of
    the 16 key groups: leaves about two thirds full), checkpointed with its marker as a Spark
    task leaves it; and its model."""
    b = ChangelogKeyedStateBackend(storage, OP, KGS, MP, table="lmdb", options=NO_TIMER,
                                   local_directory=str(local))
    state = b.get_state(ValueStateDescriptor("v"))
    rng = random.Random(5)
    model = {}
    with b.write_batch():
        for i in range(ENTRIES):
            k = f"key-{i:07d}"
            b.set_current_key(k)
            model[k] = _value(rng)
            state.update(model[k])
        h = b.snapshot(1).result(30)
        b.write_table_marker(h)
    b.notify_checkpoint_complete(1)
    return b, model


def _checkpoint(b: ChangelogKeyedStateBackend, cp: int) -> Any:
    with b.write_batch():
        h = b.snapshot(cp).result(30)
        b.write_table_marker(h)
    b.notify_checkpoint_complete(cp)
    return h


_META = struct.Struct("<IIQQ" + "IHHQQQQQ" * 2 + "QQ")   # LMDB's MDB_meta after the page header


def _pages(directory: str) -> dict[str, int]:
    """The main tree's figures from the current meta page of an environment's data file (read
    from the file: the environment may be open in this process)."""
    with open(os.path.join(directory, "data.mdb"), "rb") as f:
        first = f.read(16 + _META.size)
        psize = _META.unpack_from(first, 16)[4]
        f.seek(psize)
        metas = [_META.unpack_from(first, 16), _META.unpack_from(f.read(16 + _META.size), 16)]
    m = max(metas, key=lambda x: x[21])
    return {"psize": psize, "branch_pages": m[15], "leaf_pages": m[16], "entries": m[18]}


def _watch_copies(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Record each streamed copy: whether its descriptor is a pipe, its size."""
    seen: list[dict[str, Any]] = []

    def watched(copy: Callable[[int], object], raw_size: int, *args: Any, **kw: Any) -> Any:
        def watching(fd: int) -> None:
            seen.append({"fifo": stat.S_ISFIFO(os.fstat(fd).st_mode), "raw_size": raw_size})
            copy(fd)
        return spool_file_snapshot(watching, raw_size, *args, **kw)

    monkeypatch.setattr(lmdb_files, "spool_file_snapshot", watched)
    return seen


def test_agent_materialization_streams_the_copy_and_leaves_nothing(storage: ChangelogStorage,
                                                                   tmp_path: Path) -> None:
    b, _ = _filled(storage, tmp_path / "local")
    try:
        out = subprocess.run([sys.executable, "-c", _MATERIALIZE, b.tables.path,
                              str(tmp_path / "store"), str(MP - 1)], capture_output=True,
                             text=True, timeout=120, check=True)
        r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        b.close()
    assert r["fifo"], "the copy went to a file, not to the compressor's pipe"
    # beside the table while the copy runs: only the packed environment (a sparse table), and
    # nothing at all after it
    assert [n for n in r["beside"] if n not in r["before"]] == [
        n for n in r["beside"] if n.startswith(".dstl-pack-")]
    assert r["after"] == r["before"]
    # the point: the copy is much larger than the object (values framed with the table's
    # dictionary already, the file's zstd frame still takes 3.5x off)
    assert r["raw_size"] > 2 * r["size"]
    assert r["peak"] <= r["size"] + CHUNK_ALLOWANCE, (
        f"held {r['peak']} bytes in memory for an object of {r['size']} bytes")


def test_a_sparse_table_is_packed_and_restores_smaller_with_the_same_entries(
        storage: ChangelogStorage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process materialization of a table filled in key order: estimated below the packing
    threshold, packed (a pipe, no file left), Python memory bounded by the object; the restored
    table has a third fewer leaf pages and every entry; materialized again, the restored table
    (full pages) is copied as it is."""
    copies = _watch_copies(monkeypatch)
    b, model = _filled(storage, tmp_path / "local")
    try:
        snap = b.tables.snapshot()
        try:
            fill, table_copy = snap.leaf_fill(), snap.copy_size()
        finally:
            snap.release()
        assert fill < PACK_BELOW_FILL
        parent = os.path.dirname(b.tables.path)
        before = sorted(os.listdir(parent))
        tracemalloc.start()
        try:
            start = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            ref = b.materialize_now(timeout_s=60)
            peak = tracemalloc.get_traced_memory()[1] - start
        finally:
            tracemalloc.stop()
        assert ref is not None
        assert sorted(os.listdir(parent)) == before
        assert peak <= ref.size + CHUNK_ALLOWANCE, (
            f"held {peak} bytes in memory for an object of {ref.size} bytes")
        assert [c["fifo"] for c in copies] == [True]
        assert copies[0]["raw_size"] < 0.8 * table_copy   # packed
        h = _checkpoint(b, 2)
        old_leaves = _pages(b.tables.path)["leaf_pages"]
    finally:
        b.close()
    r = restore_backend([h], storage, KGS, table="lmdb", local_directory=str(tmp_path / "r"),
                        operator_id="restored", options=NO_TIMER)
    try:
        assert _pages(r.tables.path)["leaf_pages"] < 0.8 * old_leaves
        state = r.get_state(ValueStateDescriptor("v"))
        for k, v in model.items():
            r.set_current_key(k)
            assert state.value() == v
        assert len(r.tables) == ENTRIES
        snap = r.tables.snapshot()
        try:
            assert snap.leaf_fill() > 0.9
        finally:
            snap.release()
        r.set_current_key("key-0000000")
        state.update("changed")   # something new to materialize
        _checkpoint(r, 3)
        snap = r.tables.snapshot()
        try:
            own_copy = snap.copy_size()
        finally:
            snap.release()
        copies.clear()
        assert r.materialize_now(timeout_s=60) is not None
        assert copies == [{"fifo": True, "raw_size": own_copy}]   # not packed again
    finally:
        r.close()


def test_leaf_fill_estimate_is_close_to_the_exact_fill(storage: ChangelogStorage,
                                                       tmp_path: Path) -> None:
    """The sampled estimate against the exact fill (every leaf node's bytes over the leaf
    pages' room), for a table filled in key order and for a random-order one."""
    for order in ("keys", "random"):
        b = ChangelogKeyedStateBackend(storage, f"fill-{order}", KGS, MP, table="lmdb",
                                       options=NO_TIMER, local_directory=str(tmp_path / order))
        try:
            state = b.get_state(ValueStateDescriptor("v"))
            idx = list(range(20_000))
            rng = random.Random(3)
            if order == "random":
                rng.shuffle(idx)
            with b.write_batch():
                for i in idx:
                    b.set_current_key(f"key-{i:07d}")
                    state.update("x" * rng.randrange(100, 400))
            snap = b.tables.snapshot()
            try:
                estimate = snap.leaf_fill()
                st = _pages(b.tables.path)
                used = 0
                for k, v in snap.records():
                    node = 8 + len(k) + len(v)
                    used += node + (node & 1) + 2
                exact = used / (st["leaf_pages"] * (st["psize"] - 16))
            finally:
                snap.release()
            assert estimate == pytest.approx(exact, abs=0.05), order
        finally:
            b.close()


_BUILD = r"""
import json, os, sys, threading
from dstl.keygroups import KeyGroupRange
from materializer.lmdb_files import RangeSource, build_environment
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
peak = [0]
stop = threading.Event()
def sample():
    while not stop.wait(0.002):
        peak[0] = max(peak[0], anon())
base = anon()
threading.Thread(target=sample, daemon=True).start()
n = build_environment(sys.argv[2], [RangeSource(sys.argv[1], "k", KeyGroupRange(0, 15), {})])
stop.set()
print(json.dumps({"records": n, "grew": max(peak[0], anon()) - base}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc")
def test_range_copy_holds_one_transaction_of_pages_in_memory(tmp_path: Path) -> None:
    """A range copy (a rescaling restore) writes its new environment in bounded transactions:
    LMDB keeps a write transaction's dirty pages in memory, so one transaction for the whole
    environment (~90 MB here) would hold all of it."""
    import lmdb

    src = tmp_path / "src"
    records = 200_000
    with lmdb.open(str(src), map_size=1 << 30) as env, env.begin(write=True) as txn, \
            txn.cursor() as cur:
        cur.putmulti(((struct.pack(">HHI", i * 16 // records, 0, 8) + b"%08d" % i,
                       os.urandom(200).hex().encode()) for i in range(records)), append=True)
    assert os.path.getsize(src / "data.mdb") > 80 << 20
    out = subprocess.run([sys.executable, "-c", _BUILD, str(src), str(tmp_path / "dst")],
                         capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["records"] == records
    assert r["grew"] < lmdb_files.TXN_BYTES * 3, f"anonymous memory grew by {r['grew']} bytes"


_OUTGROWN = r"""
import json, os, sys, lmdb
from dstl.keygroups import KeyGroupRange
from materializer.file_snapshot import FileSnapshotMeta, decompress_file_snapshot, \
    verify_file_snapshot
from materializer.lmdb_files import spool_table_snapshot
from materializer.lmdb_table import LmdbStateTable
directory, out = sys.argv[1], sys.argv[2]
table = LmdbStateTable(directory, KeyGroupRange(0, 15), readonly=True, map_size_bytes=1 << 20)
snap = table.snapshot()
print("ready", flush=True)
sys.stdin.readline()
r = {"entries": snap.entry_count(), "copy_size": snap.copy_size(), "fill": snap.leaf_fill()}
meta = FileSnapshotMeta(KeyGroupRange(0, 15), 16, {}, "op", 1)
with spool_table_snapshot(snap, meta, os.path.dirname(directory)) as spool:
    data = spool.read()
layout = verify_file_snapshot(lambda o, n: data[o:o + n], len(data), key="k")
os.makedirs(out)
decompress_file_snapshot(lambda o, n: data[o:o + n], layout, os.path.join(out, "data.mdb"),
                         key="k")
with lmdb.open(out, readonly=True, lock=False) as env:
    r["copied"] = env.stat()["entries"]
print(json.dumps(r), flush=True)
"""


def test_a_table_outgrowing_the_materializers_map_is_still_snapshotted(tmp_path: Path) -> None:
    """The agent opens a worker's table read-only with a map of the size it had; the worker
    grows it beyond while the snapshot is open. The snapshot's own read transaction still reads
    its pages: its figures and its file come from it (a lookup that began another transaction
    failed with MDB_MAP_RESIZED)."""
    from materializer.lmdb_table import LmdbStateTable

    directory = str(tmp_path / "table")
    writer = LmdbStateTable(directory, KGS, map_size_bytes=1 << 20)
    try:
        with writer.write_batch():
            for i in range(300):
                writer.put(1, i % MP, b"k%04d" % i, b"", b"v" * 300)
        child = subprocess.Popen([sys.executable, "-c", _OUTGROWN, directory,
                                  str(tmp_path / "copied")], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        noise = random.Random(3).randbytes(300 * 12_000)   # incompressible: the map grows
        with writer.write_batch():
            for i in range(300, 12_000):
                writer.put(1, i % MP, b"k%05d" % i, b"", noise[300 * i:300 * (i + 1)])
        assert writer.map_size_bytes > 4 << 20
        out, _ = child.communicate("go\n", timeout=60)
        assert child.returncode == 0
    finally:
        writer.close()
    r = json.loads(out.strip().splitlines()[-1])
    assert r["entries"] == r["copied"] == 301   # the layout record and the snapshot's 300
