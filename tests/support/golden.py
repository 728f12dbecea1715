"""Golden objects for the decoder fuzz suite, and the tools that re-seal mutated ones.

``golden()`` runs a real heap backend with one state of every kind (keys in the default
namespace and in a tuple namespace), checkpoints it twice around a materialization, and keeps
what a restore reads: the segment(s) of the first checkpoint's log, the snapshot object of the
materialization, both backend handles, the table marker of the first checkpoint, a manifest
naming them, and one frame per agent request. Built once per process (deterministic: fixed keys,
values and operator id; the object names carry random parts, which no assertion depends on).

The re-sealers make a mutated object pass every checksum a decoder checks before it parses, so a
mutation reaches the parsers: :func:`encode_body_segment` re-encodes change-set bodies into a
fresh segment (valid zstd frames, record CRCs, index, object CRC) and re-points a handle at it;
:func:`reseal_segment` and :func:`reseal_snapshot` recompute the index and object CRCs of a
segment or snapshot mutated byte by byte; :func:`reseal_manifest` re-encodes a manifest document
with its CRC.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.checkpoint.manifest import Manifest, TaskEntry
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.segment import ChangeSet, IndexEntry, decode_record, decode_segment, encode_segment
from dstl.spark.agent.materializer import PartitionSpec
from dstl.spark.agent.protocol import (
    CommittedRequest,
    LeaseRequest,
    MaterializationRequest,
    PersistRequest,
    ReleaseRequest,
    StoreRef,
    encode_frame,
)
from dstl.stores import MemoryBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle
from materializer.options import BackendOptions
from materializer.states import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)

MP = 16
ALL = KeyGroupRange(0, MP - 1)
WAIT = 30.0
_NO_TIMER = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)


class _Avg:
    def create_accumulator(self) -> list[int]:
        return [0, 0]

    def add(self, v: int, acc: list[int]) -> list[int]:
        return [acc[0] + v, acc[1] + 1]

    def get_result(self, acc: list[int]) -> float:
        return acc[0] / max(acc[1], 1)

    def merge(self, a: list[int], b: list[int]) -> list[int]:
        return [a[0] + b[0], a[1] + b[1]]


@dataclass(frozen=True)
class Golden:
    """The golden objects (see the module docstring)."""

    objects: dict[str, bytes]            # every segment and snapshot, by key
    log_handle: ChangelogStateBackendHandle   # checkpoint 1: log only
    snap_handle: ChangelogStateBackendHandle  # checkpoint 2: snapshot (+ log)
    marker: bytes
    manifest: bytes
    frames: tuple[bytes, ...]

    @property
    def segment_key(self) -> str:
        return self.log_handle.non_materialized[0].change_sets[0].key

    @property
    def snapshot_key(self) -> str:
        return self.snap_handle.materialized[0].key


def _write(backend: ChangelogKeyedStateBackend, round_: int) -> None:
    v = backend.get_state(ValueStateDescriptor("v"))
    lst = backend.get_state(ListStateDescriptor("l"))
    m = backend.get_state(MapStateDescriptor("m"))
    r = backend.get_state(ReducingStateDescriptor("r", max))
    a = backend.get_state(AggregatingStateDescriptor("a", _Avg()))
    for i in range(4):
        backend.set_current_key(f"key{i}")
        backend.set_current_namespace(None if i % 2 else ("window", i))
        v.update({"n": i + round_, "s": "x" * i})
        lst.add(i)
        lst.add_all([round_, (i, "t")])
        m.put(f"mk{i}", [i])
        m.put_all({("tk", i): None, i: 1.5})
        if i == 1:
            m.remove(f"mk{i}")
        r.add(i * 10 + round_)
        a.add(i)
    backend.set_current_namespace(None)


@functools.cache
def golden() -> Golden:
    store = MemoryBlobStore()
    options = DstlOptions(persist_delay_s=0.0)
    with ChangelogStorage(store=store, options=options) as storage:
        b = ChangelogKeyedStateBackend(storage, "golden/op", ALL, MP, options=_NO_TIMER,
                                       auto_materialize=False)
        _write(b, 0)
        log_handle = b.snapshot(1).result(WAIT)
        b.notify_checkpoint_complete(1)
        marker = b.table_marker(log_handle).to_bytes()
        b.materialize_now(WAIT)
        _write(b, 1)
        snap_handle = b.snapshot(2).result(WAIT)
        b.notify_checkpoint_complete(2)
        b.close()
        objects = {i.key: store.get(i.key) for i in store.list()}
    assert len(log_handle.non_materialized) == 1 and snap_handle.materialized
    return Golden(objects, log_handle, snap_handle, marker, _manifest(snap_handle),
                  _frames(log_handle, objects))


def _manifest(h: ChangelogStateBackendHandle) -> bytes:
    entry = TaskEntry.of("golden/op", {"handle": h.to_json()}, h.referenced_keys(),
                         h.full_size, h.incremental_size)
    m = Manifest.build(job_id="golden-job", checkpoint_id=2, attempt=1,
                       created_ms=1_700_000_000_000, tasks=[entry],
                       trigger_ms=1_700_000_000_000, duration_ms=12.5,
                       ack_latency_ms={"golden/op": 3.0}, retained=2)
    return m.encode()


def _frames(h: ChangelogStateBackendHandle, objects: dict[str, bytes]) -> tuple[bytes, ...]:
    store = StoreRef("memory://golden", None, DstlOptions())
    log = h.non_materialized[0]
    ref = log.change_sets[0]
    body = decode_record(objects[ref.key][ref.offset:ref.offset + ref.length], key=ref.key,
                         offset=ref.offset, log_id=log.log_id, sqn=ref.sqn)
    cs = ChangeSet(log.log_id, ref.sqn, body, ref.change_count, ref.payload_bytes, -1, MP - 1)
    spec = PartitionSpec("golden/op", "/tmp/golden", ALL, 60.0, 2.0, 1024, 1, 3,
                         ("dstl/seg", 17), 5, 6)
    requests = [PersistRequest(store, (cs,)), LeaseRequest(store, ref.key, "segment", 100),
                ReleaseRequest(3), CommittedRequest(store, spec),
                MaterializationRequest(store, "golden/op")]
    out = []
    for i, req in enumerate(requests):
        header, payload = req.encode()
        out.append(encode_frame({"id": i, **header}, payload))
    return tuple(out)


# --------------------------------------------------------------------------- segments


@dataclass(frozen=True)
class Record:
    """One change set of a golden segment: its index entry and body."""

    entry: IndexEntry
    body: bytes


def records(data: bytes, key: str) -> list[Record]:
    out = []
    for e in decode_segment(data, key).entries:
        out.append(Record(e, decode_record(data[e.offset:e.offset + e.length], key=key,
                                           offset=e.offset, log_id=e.log_id, sqn=e.sqn)))
    return out


def encode_body_segment(recs: list[Record], bodies: list[bytes]) -> tuple[bytes, list[IndexEntry]]:
    """A fresh, fully sealed segment of ``bodies`` (in place of the records' bodies)."""
    sets = [ChangeSet(r.entry.log_id, r.entry.sqn, body, r.entry.change_count,
                      r.entry.payload_bytes, r.entry.kg_min, r.entry.kg_max)
            for r, body in zip(recs, bodies)]
    return encode_segment(sets)


def repoint(h: ChangelogStateBackendHandle, key: str,
            entries: list[IndexEntry]) -> ChangelogStateBackendHandle:
    """``h`` with its (single) log's references pointing at ``entries`` of segment ``key``."""
    log = h.non_materialized[0]
    by_sqn = {e.sqn: e for e in entries}
    refs = tuple(ChangeSetRef(r.sqn, key, by_sqn[r.sqn].offset, by_sqn[r.sqn].length,
                              r.change_count, r.payload_bytes) for r in log.change_sets)
    new_log = ChangelogHandle(log.log_id, log.key_groups, log.from_sqn, log.to_sqn, refs,
                              log.incremental_size)
    return dataclasses.replace(h, non_materialized=(new_log,))


def reseal_segment(data: bytes) -> bytes:
    """``data`` with its object CRC recomputed (if it still ends like a DSTL object)."""
    if len(data) < 8 or data[-4:] != b"LTSD":
        return data
    return data[:-8] + struct.pack(">I", zlib.crc32(data[:-8])) + b"LTSD"


def reseal_snapshot(data: bytes) -> bytes:
    """``data`` with its index CRC (if the footer still locates an index) and object CRC
    recomputed."""
    if len(data) < 28 or data[-4:] != b"LTSD":
        return data
    foot = len(data) - 28
    index_offset, index_len = struct.unpack_from(">QI", data, foot)
    buf = bytearray(data)
    if index_offset + index_len <= foot:
        struct.pack_into(">I", buf, foot + 12, zlib.crc32(data[index_offset:index_offset
                                                               + index_len]))
    struct.pack_into(">I", buf, len(buf) - 8, zlib.crc32(bytes(buf[:-8])))
    return bytes(buf)


def reseal_manifest(doc: Any, deep: str | None = None) -> bytes:
    """A manifest document (``{"body": ..., ...}``) re-encoded canonically with the CRC of its
    body; ``deep`` replaces the string ``"__DEEP__"`` in the encoding (nesting the encoder
    itself could not produce)."""
    body = doc.get("body") if isinstance(doc, dict) else None

    def canonical(obj: Any) -> bytes:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return (text.replace('"__DEEP__"', deep) if deep else text).encode()

    if isinstance(doc, dict) and "crc32" in doc:
        doc = {**doc, "crc32": f"{zlib.crc32(canonical(body)):08x}"}
    return canonical(doc) + b"\n"
