"""Forged v2 snapshots: real LMDB data files of a small job, rewritten byte by byte, inside an
envelope whose object crc and zstd content checksum are valid (an attacker who can write the store,
or a buggy writer, produces exactly this).

* :func:`build_store` runs a two-partition job (LMDB tables, v2 snapshots, a coordinator writing
  manifests) into a local store and records its state as canonical rows (:func:`canonical_row`);
  partition 1's snapshot object (:attr:`Built.target`) is the one the cases replace.
* :class:`LmdbFile` parses a compacted LMDB data file (LMDB 0.9, 64-bit little endian): meta pages,
  the B-tree level by level, leaf nodes, overflow pages — written from LMDB's ``mdb.c`` layout,
  independently of :mod:`materializer.lmdb_pages`.
* :func:`reencode` puts a new data file into a valid object; :func:`install` replaces the target
  object in a copy of the store and rewrites the manifest so that the handle's recorded size is
  the new object's (what a forger who controls the store does too).
* :data:`FORGERIES` are the named cases, :func:`flip` and :func:`flip_targets` the random ones.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import os
import shutil
import struct
import tempfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for
from dstl.checkpoint import CheckpointCoordinator
from dstl.checkpoint.manifest import Manifest, decode_manifest, encode_manifest
from dstl.envelope import encode_header, encode_record, encode_trailer
from dstl.reader.rows import to_plain
from dstl.stores import LocalBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.file_snapshot import (
    FILE_SNAPSHOT_FORMAT,
    decompress_file_snapshot_into,
    read_file_snapshot_layout,
    write_file_snapshot,
)
from materializer.options import BackendOptions
from materializer.states import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from materializer.value_codec import ValueCodec, dictionary_key, train_dictionary
from support.crafted import lying_frame, zero_frame

MP = 16
PARTITIONS = 2
JOB = "forged"
TARGET_PARTITION = 1
MiB = 1 << 20
OPTIONS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)

#: canonical row: [key group, state, key, namespace, user key, value] (JSON values)
Row = list[Any]


def operator(p: int) -> str:
    return f"{JOB}/p{p}"


def key_groups_of(p: int) -> KeyGroupRange:
    return KeyGroupRange.of_operator(MP, PARTITIONS, p)


def descriptors() -> dict[str, Any]:
    return {"v": ValueStateDescriptor("v"), "l": ListStateDescriptor("l"),
            "m": MapStateDescriptor("m")}


def canonical_row(kg: int, state: str, key: Any, ns: Any, user_key: Any, value: Any) -> Row:
    return [kg, state, to_plain(key), to_plain(ns), to_plain(user_key), to_plain(value)]


def rows_of(kg: int, state: str, kind: str, key: Any, ns: Any, value: Any) -> list[Row]:
    """The canonical rows of one stored state (a map: one row per entry)."""
    if kind == "map":
        return [canonical_row(kg, state, key, ns, uk, v) for uk, v in dict(value).items()]
    return [canonical_row(kg, state, key, ns, None, value)]


def sorted_rows(rows: Sequence[Row]) -> list[Row]:
    return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True))


# --------------------------------------------------------------------------- the job


@dataclass(frozen=True)
class Built:
    """A store with one checkpoint of :data:`PARTITIONS` LMDB backends (v2 snapshots).

    Attributes:
        root: holds ``store/`` (the state_uri) and ``info.json`` (this, as JSON).
        target: the object key of partition :data:`TARGET_PARTITION`'s snapshot.
        manifest: the object key of the newest manifest (it names ``target``).
        rows: the checkpoint's state as canonical rows, sorted.
    """

    root: Path
    target: str
    manifest: str
    rows: list[Row]

    @property
    def store(self) -> Path:
        return self.root / "store"

    def object_bytes(self) -> bytes:
        return (self.store / self.target).read_bytes()

    def rows_in(self, kgs: KeyGroupRange) -> list[Row]:
        return [r for r in self.rows if r[0] in kgs]


def _values(i: int) -> tuple[Any, list[Any], dict[str, Any]]:
    """Key ``i``'s value, list and map (some values span overflow pages: 3 000 and 9 000
    bytes)."""
    value: Any = i
    if i % 25 == 0:
        value = "x" * 3000
    elif i % 40 == 7:
        value = "y" * 9000
    items: list[Any] = [i, "e" * 10, ("t", i)]
    entries: dict[str, Any] = {f"a{j}": j * i for j in range(3)}
    if i % 7 == 0:
        entries["raw"] = b"\x00\xff" * 4
    return value, items, entries


def _key(i: int) -> str:
    """Long keys (~190 bytes): few separators fit a branch page, so the tree has depth 3."""
    return f"user-{i:04d}-" + "k" * 180


def build_store(root: Path, keys: int = 300) -> Built:
    """Run the job into ``root/store`` and return what it wrote (about 0.3 s)."""
    store = LocalBlobStore(str(root / "store"))
    storage = ChangelogStorage(store=store, options=DstlOptions(persist_delay_s=0.0))
    coordinator = CheckpointCoordinator(store, job_id=JOB, retained=3)
    backends = [ChangelogKeyedStateBackend(storage, operator(p), key_groups_of(p), MP,
                                           table="lmdb", options=OPTIONS,
                                           local_directory=str(root / "writer"),
                                           auto_materialize=False)
                for p in range(PARTITIONS)]
    rows: list[Row] = []
    try:
        states = [{n: b.get_state(d) for n, d in descriptors().items()} for b in backends]
        for i in range(keys):
            key = _key(i)
            kg = key_group_for(key.encode("utf-8"), MP)
            p = kg * PARTITIONS // MP
            b, st = backends[p], states[p]
            value, items, entries = _values(i)
            b.set_current_key(key)
            b.set_current_namespace(None)
            st["v"].update(value)
            st["l"].add_all(items)
            st["m"].put_all(entries)
            rows += rows_of(kg, "v", "value", key, None, value)
            rows += rows_of(kg, "l", "list", key, None, items)
            rows += rows_of(kg, "m", "map", key, None, entries)
            if i % 3 == 0:
                ns = ("w", i % 2)
                b.set_current_namespace(ns)
                st["v"].update(i * 2)
                rows += rows_of(kg, "v", "value", key, ns, i * 2)
        first = _checkpoint(coordinator, backends, 1)
        for b, h in zip(backends, first, strict=True):
            b.write_table_marker(h)   # the snapshot's file holds a marker, as under Spark
            assert b.materialize_now(timeout_s=30) is not None
        handles = _checkpoint(coordinator, backends, 2)
    finally:
        for b in backends:
            b.close()
        coordinator.close()
        storage.close()
    target = handles[TARGET_PARTITION].materialized[0].key
    manifest = sorted(p.relative_to(root / "store").as_posix()
                      for p in (root / "store" / "checkpoints").iterdir())[-1]
    built = Built(root, target, manifest, sorted_rows(rows))
    (root / "info.json").write_text(json.dumps({"target": target, "manifest": manifest,
                                                "rows": built.rows}))
    shutil.rmtree(root / "writer", ignore_errors=True)
    return built


def load_built(root: Path) -> Built:
    info = json.loads((root / "info.json").read_text())
    return Built(root, info["target"], info["manifest"], info["rows"])


def _checkpoint(coordinator: CheckpointCoordinator, backends: list[ChangelogKeyedStateBackend],
                cid: int) -> list[Any]:
    coordinator.trigger([f"p{i}" for i in range(len(backends))], checkpoint_id=cid)
    handles = []
    for i, b in enumerate(backends):
        h = b.snapshot(cid).result(timeout=30)
        coordinator.acknowledge(cid, f"p{i}", h.to_json_obj(), h.referenced_keys(), h.full_size,
                                h.incremental_size)
        handles.append(h)
    for b in backends:
        b.notify_checkpoint_complete(cid)
    return handles


def copy_store(built: Built, dest: Path) -> Built:
    """A copy of the store (and ``info.json``) in ``dest``."""
    shutil.copytree(built.store, dest / "store")
    shutil.copy(built.root / "info.json", dest / "info.json")
    return dataclasses.replace(built, root=dest)


def install(built: Built, obj: bytes) -> None:
    """Replace the target object by ``obj`` and rewrite the manifest so that the handle records
    its size (the manifest's crc and canonical form stay valid)."""
    (built.store / built.target).write_bytes(obj)
    path = built.store / built.manifest
    m = decode_manifest(path.read_bytes(), built.manifest)
    tasks = []
    for t in m.tasks:
        state = json.loads(json.dumps(dict(t.state)))
        for ref in state.get("materialized", []):
            if ref["key"] == built.target:
                ref["size"] = len(obj)
        tasks.append(dataclasses.replace(t, state=state))
    rewritten = Manifest(m.job_id, m.checkpoint_id, m.attempt, m.created_ms, tuple(tasks),
                         m.stats, m.retained, m.properties)
    path.write_bytes(encode_manifest(rewritten))


# --------------------------------------------------------------------------- the envelope


def layout_of(obj: bytes, key: str = "forged") -> Any:
    return read_file_snapshot_layout(lambda o, n: obj[o:o + n], len(obj), key=key)


def data_file(obj: bytes) -> bytes:
    """The LMDB data file of a (valid) v2 object."""
    layout = layout_of(obj)
    out = bytearray(layout.raw_size)
    decompress_file_snapshot_into(lambda o, n: obj[o:o + n], layout, out, key="forged")
    return bytes(out)


def reencode(original: bytes, data: bytes, meta_changes: dict[str, Any] | None = None) -> bytes:
    """A valid v2 object around ``data``, with the original's metadata (``meta_changes``:
    fields of :class:`FileSnapshotMeta` replaced)."""
    meta = layout_of(original).meta
    if meta_changes:
        meta = dataclasses.replace(meta, **meta_changes)
    out = io.BytesIO()
    write_file_snapshot(lambda fd: os.write(fd, data), meta, out)
    return out.getvalue()


def envelope(original: bytes, frame: bytes, raw_size: int) -> bytes:
    """A v2 object holding ``frame`` as its data, the footer promising ``raw_size`` bytes (the
    original's metadata; every crc valid)."""
    fmt = FILE_SNAPSHOT_FORMAT
    meta = layout_of(original).meta
    head = encode_header(fmt) + encode_record(meta.to_bytes(), fmt, zstd_level=1,
                                              what="the metadata")
    body = head + frame + struct.pack(">QQQBBH", len(head), len(frame), raw_size, fmt.kind,
                                      fmt.version, 0)
    return body + encode_trailer(zlib.crc32(body))


# --------------------------------------------------------------------------- the data file

P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_DIRTY, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
P_INVALID = (1 << 64) - 1
HEADER = 16
#: offsets in a meta page: the main DB's flags, depth, page counts, entries, root; last page,
#: txn id; the free DB's pad field holds the page size
M_PSIZE, M_FLAGS, M_DEPTH, M_BRANCH, M_LEAF, M_OVERFLOW, M_ENTRIES, M_ROOT = (
    40, 92, 94, 96, 104, 112, 120, 128)
M_LAST, M_TXN = 136, 144


@dataclass(frozen=True)
class Node:
    """One node of a page: ``at`` its offset in the file."""

    page: int
    index: int
    at: int
    flags: int
    ksize: int
    size: int   # leaf: value size; branch: the child page number

    @property
    def key_at(self) -> int:
        return self.at + 8

    @property
    def value_at(self) -> int:
        return self.at + 8 + self.ksize


@dataclass
class LmdbFile:
    """A compacted LMDB data file, parsed (it must be valid: this parses the originals)."""

    data: bytes
    psize: int = 0
    meta_page: int = 0
    root: int = 0
    levels: list[list[int]] = field(default_factory=list)
    nodes: dict[int, list[Node]] = field(default_factory=dict)
    overflow: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        d = self.data
        self.psize = struct.unpack_from("<I", d, M_PSIZE)[0]
        txns = [struct.unpack_from("<Q", d, p * self.psize + M_TXN)[0] for p in (0, 1)]
        self.meta_page = 0 if txns[0] > txns[1] else 1
        self.root = self.meta_u64(M_ROOT)
        level = [self.root]
        while level:
            self.levels.append(level)
            nxt = []
            for pg in level:
                self.nodes[pg] = self._nodes(pg)
                if self.flags(pg) & P_BRANCH:
                    nxt += [n.size for n in self.nodes[pg]]
            level = nxt
        self.overflow = [struct.unpack_from("<Q", d, n.value_at)[0] for n in self.leaf_nodes()
                         if n.flags & F_BIGDATA]

    # ----------------------------------------------------------------- reading

    @property
    def pages(self) -> int:
        return len(self.data) // self.psize

    @property
    def meta_at(self) -> int:
        return self.meta_page * self.psize

    def meta_u64(self, off: int) -> int:
        return int(struct.unpack_from("<Q", self.data, self.meta_at + off)[0])

    def flags(self, pg: int) -> int:
        return int(struct.unpack_from("<H", self.data, pg * self.psize + 10)[0])

    def _nodes(self, pg: int) -> list[Node]:
        base = pg * self.psize
        lower = struct.unpack_from("<H", self.data, base + 12)[0]
        out = []
        for i in range((lower - HEADER) // 2):
            off = struct.unpack_from("<H", self.data, base + HEADER + 2 * i)[0]
            lo, hi, flags, ksize = struct.unpack_from("<HHHH", self.data, base + off)
            size = lo | hi << 16
            if self.flags(pg) & P_BRANCH:
                size |= flags << 32
            out.append(Node(pg, i, base + off, flags, ksize, size))
        return out

    @property
    def branches(self) -> list[int]:
        return [pg for level in self.levels[:-1] for pg in level]

    @property
    def leaves(self) -> list[int]:
        return self.levels[-1]

    def leaf_nodes(self) -> list[Node]:
        return [n for pg in self.leaves for n in self.nodes[pg]]

    def key(self, n: Node) -> bytes:
        return self.data[n.key_at:n.key_at + n.ksize]

    def data_nodes(self) -> list[Node]:
        """The leaf nodes of DSTL's data (not the reserved ``0xFFFF`` records)."""
        return [n for n in self.leaf_nodes() if not self.key(n).startswith(b"\xff\xff")]


def _u16(d: bytearray, at: int, v: int) -> None:
    struct.pack_into("<H", d, at, v)


def _u32(d: bytearray, at: int, v: int) -> None:
    struct.pack_into("<I", d, at, v)


def _u64(d: bytearray, at: int, v: int) -> None:
    struct.pack_into("<Q", d, at, v)


def _set_child(d: bytearray, n: Node, child: int) -> None:
    """A branch node's 48-bit child page number (lo, hi, flags)."""
    struct.pack_into("<HHH", d, n.at, child & 0xFFFF, (child >> 16) & 0xFFFF, child >> 32)


def flip(data: bytes, positions: Sequence[tuple[int, int]]) -> bytes:
    """``data`` with each ``(offset, mask)`` XORed in (offsets past the end are ignored)."""
    out = bytearray(data)
    for at, mask in positions:
        if 0 <= at < len(out):
            out[at] ^= mask & 0xFF or 0x01
    return bytes(out)


def with_lmdb(data: bytes, edit: Callable[[Any], None]) -> bytes:
    """``data`` changed by LMDB itself: ``edit(txn)`` in a write transaction, then a compacting
    copy (a valid file of other content)."""
    with tempfile.TemporaryDirectory(prefix="forged-") as tmp:
        src, dst = os.path.join(tmp, "src"), os.path.join(tmp, "dst")
        os.makedirs(src)
        os.makedirs(dst)
        Path(src, "data.mdb").write_bytes(data)
        env = lmdb.open(src, map_size=max(len(data) * 4, 1 << 20), max_dbs=0)
        try:
            with env.begin(write=True) as txn:
                edit(txn)
            env.copy(dst, compact=True)
        finally:
            env.close()
        return Path(dst, "data.mdb").read_bytes()


# --------------------------------------------------------------------------- named forgeries

#: What a forgery's paths may do: ``fail`` (every path raises a typed error), ``model`` (the
#: file still describes the model: a path fails typed or returns the model's state)
FAIL, MODEL = "fail", "model"
LAYOUT_KEY = b"\xff\xffdstl-layout"


@dataclass(frozen=True)
class Forgery:
    """One named forged object: ``make(built, original object)`` -> the forged object;
    ``deep``: read along the paths with ``DSTL_DEEP=1`` only (its refusal is also covered by a
    unit test of the decoder that refuses it)."""

    name: str
    make: Callable[[Built, bytes], bytes]
    expect: str = FAIL
    what: str = ""
    deep: bool = False


def _file_forgery(name: str, edit: Callable[[LmdbFile, bytearray], object],
                  expect: str = FAIL, what: str = "",
                  meta: Callable[[Built], dict[str, Any]] | None = None,
                  deep: bool = False) -> Forgery:
    def make(built: Built, obj: bytes) -> bytes:
        f = LmdbFile(data_file(obj))
        d = bytearray(f.data)
        out = edit(f, d)
        data = bytes(out) if isinstance(out, (bytes, bytearray)) else bytes(d)
        return reencode(obj, data, meta(built) if meta is not None else None)
    return Forgery(name, make, expect, what, deep)


def _meta_set(off: int, value: Callable[[LmdbFile], int], size: int = 8
              ) -> Callable[[LmdbFile, bytearray], None]:
    def edit(f: LmdbFile, d: bytearray) -> None:
        (_u64 if size == 8 else _u16)(d, f.meta_at + off, value(f))
    return edit


def _leaf_flags(pick: Callable[[LmdbFile], int], flags: Callable[[int], int]
                ) -> Callable[[LmdbFile, bytearray], None]:
    def edit(f: LmdbFile, d: bytearray) -> None:
        pg = pick(f)
        _u16(d, pg * f.psize + 10, flags(f.flags(pg)))
    return edit


def _lower_branch(f: LmdbFile) -> int:
    """A branch page of the level above the leaves (depth >= 3: not the root)."""
    return f.levels[-2][len(f.levels[-2]) // 2]


def _marker_leaf(f: LmdbFile) -> int:
    return f.leaves[-1]


def _truncate_pages(f: LmdbFile, d: bytearray) -> bytes:
    return bytes(d[:f.pages // 2 * f.psize])


def _truncate_mid_page(f: LmdbFile, d: bytearray) -> bytes:
    return bytes(d[:len(d) - f.psize // 2])


def _child_of(target: Callable[[LmdbFile], int], parent: Callable[[LmdbFile], int] | None = None
              ) -> Callable[[LmdbFile, bytearray], None]:
    """The last child of a branch page (default: the lower branch) set to ``target``."""
    def edit(f: LmdbFile, d: bytearray) -> None:
        pg = parent(f) if parent is not None else _lower_branch(f)
        _set_child(d, f.nodes[pg][-1], target(f))
    return edit


def _big_node(f: LmdbFile) -> Node:
    return next(n for n in f.leaf_nodes() if n.flags & F_BIGDATA)


def _overflow_pgno(f: LmdbFile, d: bytearray) -> None:
    _u64(d, _big_node(f).value_at, f.pages + 5)


def _overflow_count(f: LmdbFile, d: bytearray) -> None:
    pg = f.overflow[0]
    _u32(d, pg * f.psize + 12, 1000)


def _overflow_size(f: LmdbFile, d: bytearray) -> None:
    n = _big_node(f)
    struct.pack_into("<HH", d, n.at, 0, 0x8000)   # 2**31


def _node_flag(flag: int) -> Callable[[LmdbFile, bytearray], None]:
    def edit(f: LmdbFile, d: bytearray) -> None:
        n = f.data_nodes()[len(f.data_nodes()) // 2]
        _u16(d, n.at + 4, n.flags | flag)
    return edit


def _swap_keys(f: LmdbFile, d: bytearray) -> None:
    pg = f.leaves[len(f.leaves) // 2]
    base = pg * f.psize + HEADER
    a, b = struct.unpack_from("<HH", d, base + 2)
    struct.pack_into("<HH", d, base + 2, b, a)


def _duplicate_key(f: LmdbFile, d: bytearray) -> None:
    for pg in f.leaves:
        ns = f.nodes[pg]
        for a, b in itertools.pairwise(ns):
            if a.ksize == b.ksize and not f.key(a).startswith(b"\xff\xff"):
                d[b.key_at:b.key_at + b.ksize] = f.key(a)
                return
    raise AssertionError("no two neighbouring keys of one size")


def _key_group(which: str) -> Callable[[LmdbFile, bytearray], None]:
    """The first data key moved into the key group before the range, or the last one into the
    key group after it (both stay in key order)."""
    def edit(f: LmdbFile, d: bytearray) -> None:
        kgs = key_groups_of(TARGET_PARTITION)
        n = f.data_nodes()[0 if which == "first" else -1]
        struct.pack_into(">H", d, n.key_at, kgs.start - 1 if which == "first" else kgs.end + 1)
    return edit


def _short_key(f: LmdbFile, d: bytearray) -> None:
    n = f.data_nodes()[0]   # the smallest key: a 5-byte prefix of it stays the smallest
    _u16(d, n.at + 6, 5)


def _long_length(f: LmdbFile, d: bytearray) -> None:
    n = f.data_nodes()[-1]   # the largest data key: a larger length field keeps it the largest
    struct.pack_into(">I", d, n.key_at + 4, 0x7FFFFFF0)


def _empty_env(f: LmdbFile, d: bytearray) -> None:
    for off, v in ((M_ROOT, P_INVALID), (M_ENTRIES, 0), (M_BRANCH, 0), (M_LEAF, 0),
                   (M_OVERFLOW, 0)):
        _u64(d, f.meta_at + off, v)
    _u16(d, f.meta_at + M_DEPTH, 0)


def _other_meta_newer(f: LmdbFile, d: bytearray) -> None:
    other = (1 - f.meta_page) * f.psize
    _u64(d, other + M_TXN, f.meta_u64(M_TXN) + 1)


def _pgno_field(f: LmdbFile, d: bytearray) -> None:
    pg = f.leaves[len(f.leaves) // 2]
    _u64(d, pg * f.psize, pg + 1)


def _page_field(pick: Callable[[LmdbFile], int], off: int, value: Callable[[LmdbFile], int]
                ) -> Callable[[LmdbFile, bytearray], None]:
    def edit(f: LmdbFile, d: bytearray) -> None:
        _u16(d, pick(f) * f.psize + off, value(f))
    return edit


def _node_pointer(f: LmdbFile, d: bytearray) -> None:
    pg = f.leaves[len(f.leaves) // 2]
    _u16(d, pg * f.psize + HEADER + 2, f.psize - 4)


def _mid_leaf(f: LmdbFile) -> int:
    return f.leaves[len(f.leaves) // 2]


def _layout(value: bytes | None) -> Callable[[LmdbFile, bytearray], bytes]:
    def edit(f: LmdbFile, d: bytearray) -> bytes:
        def change(txn: Any) -> None:
            if value is None:
                txn.delete(LAYOUT_KEY)
            else:
                txn.put(LAYOUT_KEY, value)
        return with_lmdb(f.data, change)
    return edit


def _dictionary() -> bytes:
    """A zstd dictionary of key layout "2" (trained on values like the store's)."""
    data = train_dictionary(f"{i}:{_values(i)}:{_key(i)}".encode()[:300] for i in range(1200))
    assert data is not None
    return data


def _framed(value: Callable[[bytes], bytes] | None = None,
            record: Callable[[bytes], bytes] | None = None
            ) -> Callable[[LmdbFile, bytearray], bytes]:
    """The file as a table with a dictionary holds it (key layout "2"): dictionary 0 written
    and every value it shrinks stored with it (tag 1); then ``value`` edits the stored bytes of
    the middle framed value, ``record`` the dictionary record."""
    def edit(f: LmdbFile, d: bytearray) -> bytes:
        def change(txn: Any) -> None:
            data = _dictionary()
            codec = ValueCodec({0: data})
            framed = []
            with txn.cursor() as cur:
                for k, v in cur:
                    if not k.startswith(b"\xff\xff") and v[:1] == b"\x00":
                        stored = codec.encode(v[1:])
                        if stored[0] == 1:
                            framed.append((k, stored))
            assert len(framed) > 100
            for k, stored in framed:
                txn.put(k, stored)
            txn.put(dictionary_key(0), data if record is None else record(data))
            if value is not None:
                k, stored = framed[len(framed) // 2]
                txn.put(k, value(stored))
        return with_lmdb(f.data, change)
    return edit


def _declaring(size: Callable[[int], int]) -> Callable[[bytes], bytes]:
    """A framed value whose zstd frame header declares ``size(true size)`` bytes, the blocks
    unchanged: the header rebuilt with an 8-byte content-size field."""
    def edit(stored: bytes) -> bytes:
        frame = stored[2:]
        fhd = frame[4]
        single = bool(fhd & 0x20)
        dict_id = (0, 1, 2, 4)[fhd & 3]
        width = {0: 1 if single else 0, 1: 2, 2: 4, 3: 8}[fhd >> 6]
        fields = 5 + (0 if single else 1)
        head = frame[5:fields + dict_id]
        true = int.from_bytes(frame[fields + dict_id:fields + dict_id + width], "little")
        true += 256 if width == 2 else 0
        out = bytes([frame[0], frame[1], frame[2], frame[3], (3 << 6) | (fhd & 0x3F)]) + head
        return stored[:2] + out + size(true).to_bytes(8, "little") + \
            frame[fields + dict_id + width:]
    return edit


def _layout_1_with_dictionary(f: LmdbFile, d: bytearray) -> bytes:
    """Key layout "1" (values as they are) with a dictionary record, which only layout "2"
    has."""
    def change(txn: Any) -> None:
        txn.put(LAYOUT_KEY, b"1")
        txn.put(dictionary_key(0), _dictionary())
    return with_lmdb(f.data, change)


def _declared(size: int) -> Callable[[Built, bytes], bytes]:
    def make(built: Built, obj: bytes) -> bytes:
        return envelope(obj, lying_frame(size), size)
    return make


def _zeros(size: int, keep_file: bool) -> Callable[[Built, bytes], bytes]:
    def make(built: Built, obj: bytes) -> bytes:
        return envelope(obj, zero_frame(data_file(obj) if keep_file else b"", size), size)
    return make


def _widened(built: Built) -> dict[str, Any]:
    kgs = key_groups_of(TARGET_PARTITION)
    return {"key_groups": KeyGroupRange(kgs.start - 2, kgs.end)}


def _narrowed(built: Built) -> dict[str, Any]:
    kgs = key_groups_of(TARGET_PARTITION)
    return {"key_groups": KeyGroupRange(kgs.start, kgs.end - 2)}


def _unchanged(f: LmdbFile, d: bytearray) -> None:
    return None


FORGERIES: list[Forgery] = [
    _file_forgery("truncated-pages", _truncate_pages, what="half the pages cut off"),
    _file_forgery("truncated-mid-page", _truncate_mid_page, what="cut in the middle of the root"),
    _file_forgery("last-pg-huge", _meta_set(M_LAST, lambda f: 1 << 40)),
    _file_forgery("last-pg-small", _meta_set(M_LAST, lambda f: f.pages // 2)),
    _file_forgery("root-past-end", _meta_set(M_ROOT, lambda f: f.pages + 10)),
    _file_forgery("root-meta-0", _meta_set(M_ROOT, lambda f: 0)),
    _file_forgery("root-meta-1", _meta_set(M_ROOT, lambda f: 1)),
    _file_forgery("overflow-pgno-past-end", _overflow_pgno),
    _file_forgery("overflow-mp-pages-1000", _overflow_count),
    _file_forgery("overflow-value-size-2g", _overflow_size),
    _file_forgery("cycle-branch-to-itself", _child_of(_lower_branch)),
    _file_forgery("cycle-branch-to-root", _child_of(lambda f: f.root)),
    _file_forgery("child-meta-0", _child_of(lambda f: 0)),
    _file_forgery("child-meta-1", _child_of(lambda f: 1)),
    _file_forgery("child-overflow-page", _child_of(lambda f: f.overflow[0])),
    _file_forgery("child-leaf-from-root", _child_of(lambda f: f.leaves[0], lambda f: f.root)),
    _file_forgery("child-branch-from-branch",
                  _child_of(lambda f: f.levels[-2][0])),
    _file_forgery("leaf-as-branch", _leaf_flags(_mid_leaf, lambda x: x & ~P_LEAF | P_BRANCH)),
    _file_forgery("leaf-as-overflow", _leaf_flags(_mid_leaf, lambda x: x & ~P_LEAF | P_OVERFLOW)),
    _file_forgery("leaf-as-leaf2", _leaf_flags(_mid_leaf, lambda x: x | P_LEAF2)),
    _file_forgery("leaf-dirty", _leaf_flags(_mid_leaf, lambda x: x | P_DIRTY)),
    _file_forgery("marker-leaf-dirty", _leaf_flags(_marker_leaf, lambda x: x | P_DIRTY)),
    _file_forgery("root-dirty", _leaf_flags(lambda f: f.root, lambda x: x | P_DIRTY)),
    _file_forgery("node-subdata", _node_flag(F_SUBDATA)),
    _file_forgery("node-dupdata", _node_flag(F_DUPDATA)),
    _file_forgery("keys-swapped", _swap_keys),
    _file_forgery("duplicate-key", _duplicate_key),
    _file_forgery("key-before-range", _key_group("first")),
    _file_forgery("key-after-range", _key_group("last")),
    _file_forgery("meta-key-groups-widened", _unchanged, MODEL, meta=_widened,
                  what="metadata claims two more key groups; the file is unchanged"),
    _file_forgery("meta-key-groups-narrowed", _unchanged, meta=_narrowed),
    _file_forgery("key-shorter-than-8", _short_key),
    _file_forgery("key-length-past-key", _long_length),
    _file_forgery("db-integerkey", _meta_set(M_FLAGS, lambda f: 0x08, 2)),
    _file_forgery("db-dupsort", _meta_set(M_FLAGS, lambda f: 0x04, 2)),
    _file_forgery("db-reversekey", _meta_set(M_FLAGS, lambda f: 0x02, 2)),
    _file_forgery("entries-plus-one", _meta_set(M_ENTRIES, lambda f: f.meta_u64(M_ENTRIES) + 1),
                  MODEL, what="a statistic: the tree is unchanged"),
    _file_forgery("entries-zero", _meta_set(M_ENTRIES, lambda f: 0), MODEL),
    _file_forgery("layout-removed", _layout(None)),
    _file_forgery("layout-3", _layout(b"3")),
    _file_forgery("layout-2-framed", _framed(), MODEL,
                  what="values stored with a dictionary: the positive control of layout 2"),
    _file_forgery("value-unknown-tag", _framed(lambda v: b"\x07" + v[1:])),
    _file_forgery("value-empty", _framed(lambda v: b""), deep=True),
    _file_forgery("value-missing-dictionary", _framed(lambda v: v[:1] + b"\x05" + v[2:])),
    _file_forgery("value-declares-too-much", _framed(_declaring(lambda n: 1 << 40)),
                  what="the frame declares 1 TiB, more than a value may decode to", deep=True),
    _file_forgery("value-declares-more", _framed(_declaring(lambda n: n + 1)),
                  what="the frame declares one byte more than it decodes to"),
    _file_forgery("value-declares-less", _framed(_declaring(lambda n: n - 1)), deep=True),
    _file_forgery("value-declares-same", _framed(_declaring(lambda n: n)), MODEL,
                  what="the header rebuilt with a wider size field: the same value", deep=True),
    _file_forgery("value-truncated-frame", _framed(lambda v: v[:-3])),
    _file_forgery("value-frame-trailing-bytes", _framed(lambda v: v + b"zz"), MODEL,
                  what="bytes after a value's zstd frame, which ends itself: every path reads "
                       "the frame's value", deep=True),
    _file_forgery("value-not-a-frame", _framed(lambda v: v[:2] + b"not a zstd frame"),
                  deep=True),
    _file_forgery("dictionary-corrupt", _framed(record=lambda d: d[:8] + b"\xff" * 200)),
    _file_forgery("dictionary-empty", _framed(record=lambda d: b""), deep=True),
    _file_forgery("dictionary-in-layout-1", _layout_1_with_dictionary, deep=True),
    _file_forgery("empty-environment", _empty_env),
    _file_forgery("other-meta-newer-empty", _other_meta_newer),
    _file_forgery("page-pgno-field", _pgno_field),
    _file_forgery("lower-past-page", _page_field(_mid_leaf, 12, lambda f: f.psize + 2)),
    _file_forgery("upper-past-page", _page_field(_mid_leaf, 14, lambda f: f.psize + 100)),
    _file_forgery("lower-above-upper", _page_field(_mid_leaf, 12, lambda f: f.psize - 64)),
    _file_forgery("node-pointer-past-page", _node_pointer),
    Forgery("declared-8gib", _declared(8 << 30), FAIL,
            "footer and frame declare 8 GiB, the frame holds 4 bytes"),
    Forgery("zeros-300mib", _zeros(300 * MiB, keep_file=False), FAIL,
            "a real frame of 300 MiB of zeros"),
    Forgery("file-then-zeros-300mib", _zeros(300 * MiB, keep_file=True), MODEL,
            "the real file followed by zeros up to 300 MiB"),
]


# --------------------------------------------------------------------------- random flips

#: where flips go, with weights
REGIONS: dict[str, int] = {"meta": 3, "branch": 3, "leaf-node-header": 4, "leaf-key": 3,
                           "overflow-header": 2, "page-header": 2, "anywhere": 1}


def flip_targets(f: LmdbFile) -> dict[str, list[int]]:
    """File offsets per region (:data:`REGIONS`) of a parsed original."""
    ps = f.psize
    meta = [p * ps + o for p in (0, 1) for o in range(HEADER, M_TXN + 8)]
    branch = [pg * ps + o for pg in f.branches for o in range(ps)]
    headers = [n.at + o for n in f.leaf_nodes() for o in range(8)]
    keys = [n.key_at + o for n in f.leaf_nodes() for o in range(min(n.ksize, 16))]
    overflow = [pg * ps + o for pg in f.overflow for o in range(HEADER)]
    page_headers = [pg * ps + o for pg in range(2, f.pages) for o in range(HEADER)]
    return {"meta": meta, "branch": branch, "leaf-node-header": headers, "leaf-key": keys,
            "overflow-header": overflow, "page-header": page_headers,
            "anywhere": list(range(len(f.data)))}


def flipped(obj: bytes, positions: Sequence[tuple[int, int]]) -> bytes:
    """The object with its data file's bytes flipped."""
    return reencode(obj, flip(data_file(obj), positions))
