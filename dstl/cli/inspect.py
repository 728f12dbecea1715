"""``dstl inspect <file or base URI> [--key K]``: verify any stored object and print what it holds
— the first thing to run when a restore reports a corrupt or unexpected object.

The kind is recognised from the bytes (:func:`dstl.reader.identify_object`): a **segment**
(every record verified; its index: writers, sqns, key-group ranges, offsets), a **snapshot**
(object CRC and every block verified; its states and per key group the entries; a delta's
entries checked as a restore reads them, and its tombstones counted), or a
**manifest** (strictly decoded; its tasks and what they reference). Anything else is an
``UnsupportedFormatError`` naming what was found (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os

from dstl.checkpoint.manifest import decode_manifest
from dstl.cli.checkpoints import detail
from dstl.cli.common import add_storage_options, storage_options
from dstl.envelope import HEADER_SIZE
from dstl.errors import ConfigError
from dstl.reader import identify_object, open_read_only
from dstl.segment import decode_segment
from materializer.delta_format import DELTA_VERSION, decode_delta
from materializer.file_snapshot import snapshot_version
from materializer.snapshot_format import decode_snapshot
from restore.file_restore import is_file_snapshot, validate_file_snapshot

__all__ = ["run"]


def run(argv: list[str]) -> int:
    """Run ``dstl inspect`` with ``argv`` (the arguments after the command name)."""
    p = argparse.ArgumentParser(prog="dstl inspect",
                                description="verify and describe a segment, snapshot or "
                                            "manifest")
    p.add_argument("path", help="a local object file, or <base_uri> with --key")
    p.add_argument("--key", help="object key below the base URI (e.g. dstl/...seg, "
                                 "snapshots/.../...snap, checkpoints/...manifest)")
    add_storage_options(p)
    args = p.parse_args(argv)
    if args.key:
        with open_read_only(args.path, storage_options(p, args)) as store:
            data = store.get(args.key)
            name = f"{store.location}/{args.key}"
        key = args.key
    else:
        if not os.path.isfile(args.path):
            raise ConfigError("path", args.path, "an object file", owner="dstl inspect",
                              fix="no such file; for an object of a store pass <base_uri> "
                                  "--key <key>")
        with open(args.path, "rb") as f:
            data = f.read()
        name = key = args.path
    kind = identify_object(data, name)
    if kind == "segment":
        _segment(data, name)
    elif kind == "snapshot":
        _snapshot(data, name)
    else:
        # a store key is checked against the body's id and attempt; a local file name is not
        m = decode_manifest(data, key)
        print(f"{name}: manifest, {len(data)} bytes, checksum OK")
        print(json.dumps(detail(m), indent=2))
    return 0


def _segment(data: bytes, name: str) -> None:
    seg = decode_segment(data, name)
    print(f"{name}: segment, {seg.size} bytes, {len(seg.entries)} change sets, checksums OK")
    print(f"{'log id':<32}{'sqn':>8}{'key groups':>14}{'offset':>10}{'length':>9}{'changes':>9}")
    for e in seg.entries:
        print(f"{e.log_id:<32}{e.sqn:>8}{f'{e.kg_min}..{e.kg_max}':>14}{e.offset:>10}"
              f"{e.length:>9}{e.change_count:>9}")


def _file_snapshot(data: bytes, name: str) -> None:
    """A v2 (file-level) snapshot: verified whole as a restore stages it (object crc, the data's
    zstd checksum and size, the LMDB file validated page by page); its metadata."""
    view = memoryview(data)
    staged = validate_file_snapshot(lambda off, n: bytes(view[off:off + n]), len(data), key=name)
    layout, entries = staged.layout, staged.valid.entries
    m = layout.meta
    print(f"{name}: snapshot v2 (LMDB file), {len(data)} bytes ({layout.raw_size} raw), key "
          f"groups {m.key_groups.start}..{m.key_groups.end}, {entries} entries, checksums OK")
    shown = {"operator_id": m.operator_id, "materialization_id": m.materialization_id,
             "boundary": m.boundary, "max_parallelism": m.max_parallelism, **(m.extra or {})}
    print(f"metadata: {json.dumps(shown, sort_keys=True)}")
    for sid, st in sorted(m.states.items(), key=lambda kv: int(kv[0])):
        print(f"  state {sid}: {st.get('name')!r} ({st.get('kind')}, value codec "
              f"{st.get('value_codec')}, key codec {st.get('key_codec')})")


def _delta(data: bytes, name: str) -> None:
    """A delta (format v3): verified whole as a restore reads it (object crc, every block, every
    entry's framing, order, state and key group); its metadata and per key group the entries and
    tombstones."""
    meta, blocks = decode_delta(data, key=name)
    entries = sum(len(v) for v in blocks.values())
    tombstones = sum(1 for v in blocks.values() for e in v if e[3] is None)
    print(f"{name}: delta (snapshot v3), {len(data)} bytes, key groups {meta.key_groups.start}.."
          f"{meta.key_groups.end}, {len(blocks)} non-empty key groups, {entries} entries "
          f"({tombstones} tombstones), checksums OK")
    shown = {"operator_id": meta.operator_id, "materialization_id": meta.materialization_id,
             "follows": meta.follows, "up_to": meta.up_to,
             "max_parallelism": meta.max_parallelism}
    print(f"metadata: {json.dumps(shown, sort_keys=True)}")
    for sid, st in sorted(meta.states.items(), key=lambda kv: int(kv[0])):
        print(f"  state {sid}: {st.get('name')!r} ({st.get('kind')}, value codec "
              f"{st.get('value_codec')}, key codec {st.get('key_codec')})")
    print(f"{'key group':>10}{'entries':>10}{'tombstones':>12}")
    for kg, es in blocks.items():
        print(f"{kg:>10}{len(es):>10}{sum(1 for e in es if e[3] is None):>12}")


def _snapshot(data: bytes, name: str) -> None:
    if is_file_snapshot(data[:HEADER_SIZE]):
        _file_snapshot(data, name)
        return
    if snapshot_version(data[:HEADER_SIZE]) == DELTA_VERSION:
        _delta(data, name)
        return
    snap = decode_snapshot(data, key=name)
    entries = sum(len(v) for v in snap.blocks.values())
    print(f"{name}: snapshot, {len(data)} bytes, key groups {snap.key_groups.start}.."
          f"{snap.key_groups.end}, {len(snap.blocks)} non-empty key groups, {entries} entries, "
          "checksums OK")
    try:
        meta = json.loads(snap.metadata)
    except ValueError:
        meta = None
    if isinstance(meta, dict):
        extra = {k: v for k, v in meta.items() if k != "states"}
        print(f"metadata: {json.dumps(extra, sort_keys=True)}")
        for sid, s in sorted((meta.get("states") or {}).items(), key=lambda kv: int(kv[0])):
            print(f"  state {sid}: {s.get('name')!r} ({s.get('kind')}, value codec "
                  f"{s.get('value_codec')}, key codec {s.get('key_codec')})")
    else:
        print(f"metadata: {len(snap.metadata)} bytes, not DSTL's JSON")
    print(f"{'key group':>10}{'entries':>10}")
    for kg, es in snap.blocks.items():
        print(f"{kg:>10}{len(es):>10}")
