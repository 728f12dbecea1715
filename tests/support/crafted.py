"""Crafted objects: the worst small objects we know how to build, with every checksum valid.

Each :class:`Crafted` is one stored object (a segment, a snapshot, a manifest, a handle, a table
marker, an agent frame) of at most 1 MiB — except a 44 MiB manifest — built by hand
so that it passes the CRCs and reaches the decoders: zstd frames that declare 3 GB, records that
really decompress to hundreds of MiB (a zstd "bomb"), pickles that decode to millions of objects,
JSON nested 100,000 deep or made of millions of ``{}``, handles whose sqn range or offsets are
2^62. ``tests/support/read_crafted.py`` reads one in a fresh process and reports the peak RSS;
``tests/integration/restore/test_crafted_memory.py`` asserts the bound (docs/guarantees.md, "Untrusted stores").

Everything here is written from the format specification (docs/format.md), not with DSTL's
encoders, so the encoders' own limits cannot hide a crafted case.
"""

from __future__ import annotations

import json
import pickle
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import zstandard

MiB = 1 << 20
OPERATOR = "crafted/op"
MP = 16


@dataclass(frozen=True)
class Crafted:
    """One crafted object and how a reader meets it.

    Attributes:
        name: for the report table.
        read: how ``read_crafted.py`` reads it: ``restore`` (a heap restore from ``handle``
            with the object stored under ``key`` in a local store), ``manifest``, ``marker``,
            ``frame``, ``handle``.
        data: the object's bytes.
        key: its object key (``restore``).
        handle: the backend handle JSON a restore starts from (``restore``, ``handle``).
        what: one line saying what it is.
    """

    name: str
    read: str
    data: bytes
    what: str
    key: str = ""
    handle: str = ""
    extra: dict[str, bytes] = field(default_factory=dict)


# --------------------------------------------------------------------------- zstd frames


def frame_of(content: bytes) -> bytes:
    return zstandard.ZstdCompressor(write_checksum=True).compress(content)


def zero_frame(prefix: bytes, size: int, suffix: bytes = b"", fill: bytes = b"\0") -> bytes:
    """A real frame of ``size`` bytes: ``prefix``, ``fill`` repeated, ``suffix`` (streamed: the
    content is never held whole)."""
    cobj = zstandard.ZstdCompressor(write_checksum=True).compressobj(size=size)
    parts = [cobj.compress(prefix)]
    left = size - len(prefix) - len(suffix)
    chunk = (fill * (MiB // len(fill) + 1))[:MiB]
    while left > 0:
        n = min(left, MiB)
        parts.append(cobj.compress(chunk[:n]))
        left -= n
    parts.append(cobj.compress(suffix))
    parts.append(cobj.flush())
    return b"".join(parts)


def lying_frame(declared: int, content: bytes = b"tiny") -> bytes:
    """A frame that declares ``declared`` bytes of content (8-byte field) but holds one raw
    block of ``content``."""
    fhd = 0b1100_0100  # 8-byte content size, checksum, not single-segment
    window = bytes([0x00])  # 1 KiB window
    block = struct.pack("<I", (len(content) << 3) | 1)[:3] + content  # raw, last
    checksum = struct.pack("<I", 0)
    return (b"\x28\xb5\x2f\xfd" + bytes([fhd]) + window + struct.pack("<Q", declared) + block
            + checksum)


def record(frame: bytes) -> bytes:
    return struct.pack(">II", len(frame), zlib.crc32(frame)) + frame


# --------------------------------------------------------------------------- segments


def body_head(log_id: str, sqn: int, n_blocks: int) -> bytes:
    lid = log_id.encode()
    return struct.pack(">H", len(lid)) + lid + struct.pack(">QI", sqn, n_blocks)


def change_payload(op: int, sid: int, key: bytes, ns: bytes, rest: bytes) -> bytes:
    return (struct.pack(">BH", op, sid) + struct.pack(">I", len(key)) + key
            + struct.pack(">I", len(ns)) + ns + rest)


def metadata_payload(sid: int, meta: bytes) -> bytes:
    return struct.pack(">BH", 8, sid) + meta


def block(kg: int, payloads: Iterable[bytes]) -> bytes:
    inner = b"".join(struct.pack(">I", len(p)) + p for p in payloads)
    return struct.pack(">iI", kg, len(inner)) + inner


def segment(frames: list[tuple[int, bytes]], log_id: str = OPERATOR) -> bytes:
    """A sealed segment of ``(sqn, frame)`` records."""
    out = bytearray(b"DSTL\x01\x01\x00\x00")
    index = [struct.pack(">I", len(frames))]
    for sqn, fr in frames:
        rec = record(fr)
        lid = log_id.encode()
        index.append(struct.pack(">H", len(lid)) + lid + struct.pack(
            ">QiiQQIQ", sqn, -1, MP - 1, len(out), len(rec), 1, 1))
        out += rec
    index_bytes = b"".join(index)
    index_offset = len(out)
    out += index_bytes + struct.pack(">QII", index_offset, len(index_bytes), len(frames))
    out += struct.pack(">I", zlib.crc32(bytes(out))) + b"LTSD"
    return bytes(out)


def log_handle(key: str, seg: bytes, sqns: int = 1) -> str:
    """A backend handle whose log is the ``sqns`` records of segment ``key``."""
    entries = _index_of(seg)
    refs = [[sqn, key, off, length, 1, 1] for sqn, off, length in entries[:sqns]]
    return json.dumps({"v": 1, "operator_id": OPERATOR, "key_groups": [0, MP - 1],
                       "checkpoint_id": 1, "materialization_id": 0, "materialized": [],
                       "non_materialized": [{"v": 1, "log_id": OPERATOR,
                                             "key_groups": [0, MP - 1], "from": 0,
                                             "to": len(refs), "change_sets": refs}],
                       "incremental_size": 0, "max_parallelism": MP})


def _index_of(seg: bytes) -> list[tuple[int, int, int]]:
    index_offset, _len, n = struct.unpack_from(">QII", seg, len(seg) - 24)
    pos = index_offset + 4
    out = []
    for _ in range(n):
        (lid_len,) = struct.unpack_from(">H", seg, pos)
        pos += 2 + lid_len
        sqn, _a, _b, off, length, _c, _d = struct.unpack_from(">QiiQQIQ", seg, pos)
        pos += struct.calcsize(">QiiQQIQ")
        out.append((sqn, off, length))
    return out


META_VALUE = json.dumps({"name": "v", "kind": "value", "value_codec": "safe",
                         "key_codec": None}).encode()


def change_set_with(value: bytes, sqn: int = 0) -> bytes:
    """A change-set body: the value state's metadata, then one SET of ``value`` for key b"k"."""
    return (body_head(OPERATOR, sqn, 2) + block(-1, [metadata_payload(0, META_VALUE)])
            + block(3, [change_payload(1, 0, b"k", b"", value)]))


# --------------------------------------------------------------------------- snapshots


def snapshot(metadata_frame: bytes, blocks: list[tuple[int, int, bytes]]) -> bytes:
    """A sealed snapshot: the metadata record, then ``(key group, entry count, frame)``."""
    out = bytearray(b"DSTL\x02\x01\x00\x00")
    entries = [(0xFFFF, len(out), len(record(metadata_frame)), 0)]
    out += record(metadata_frame)
    for kg, count, fr in blocks:
        rec = record(fr)
        entries.append((kg, len(out), len(rec), count))
        out += rec
    index = struct.pack(">HHI", 0, MP, len(entries)) + b"".join(
        struct.pack(">HQII", *e) for e in entries)
    index_offset = len(out)
    out += index
    out += struct.pack(">QIIBBH", index_offset, len(index), zlib.crc32(index), 2, 1, 0)
    out += struct.pack(">I", zlib.crc32(bytes(out))) + b"LTSD"
    return bytes(out)


SNAP_META = json.dumps({"states": {"0": {"name": "v", "kind": "value", "value_codec": "safe",
                                         "key_codec": None}}}).encode()


def snap_block_prefix(kg: int, count: int) -> bytes:
    return struct.pack(">HI", kg, count)


def snap_entry_head(sid: int, key: bytes, ns: bytes, value_len: int) -> bytes:
    return (struct.pack(">HI", sid, len(key)) + key + struct.pack(">I", len(ns)) + ns
            + struct.pack(">I", value_len))


def snapshot_handle(key: str, size: int) -> str:
    return json.dumps({"v": 1, "operator_id": OPERATOR, "key_groups": [0, MP - 1],
                       "checkpoint_id": 1, "materialization_id": 1,
                       "materialized": [{"key": key, "size": size, "key_groups": [0, MP - 1],
                                         "materialization_id": 1}],
                       "non_materialized": [], "incremental_size": 0, "max_parallelism": MP})


# --------------------------------------------------------------------------- the catalogue


def _binbytes8(n: int) -> tuple[bytes, bytes]:
    """Prefix (11 bytes) and suffix (1 byte) of a pickle of ``n`` bytes (BINBYTES8)."""
    return b"\x80\x05\x8e" + struct.pack("<Q", n), b"."


def _change_set_bomb(total: int, sqn: int = 0, *, fill: bytes = b"\0",
                     value_prefix: bytes | None = None, value_suffix: bytes = b".") -> bytes:
    """A frame of one change set whose body really is ``total`` bytes: (metadata at sqn 0,) one
    SET of key b"k" whose value is ``value_prefix``, ``fill`` repeated, ``value_suffix`` (by
    default a pickle of a bytes value of zeros)."""
    meta = [block(-1, [metadata_payload(0, META_VALUE)])] if sqn == 0 else []
    head = body_head(OPERATOR, sqn, len(meta) + 1) + b"".join(meta)
    key_ns = struct.pack(">BH", 1, 0) + struct.pack(">I", 1) + b"k" + struct.pack(">I", 0)
    fixed = len(head) + 8 + 4 + len(key_ns) + 11 + len(value_suffix)
    n = total - fixed
    prefix = value_prefix if value_prefix is not None else _binbytes8(n)[0]
    n += 11 - len(prefix)
    payload_len = len(key_ns) + len(prefix) + n + len(value_suffix)
    content_head = (head + struct.pack(">iI", 3, 4 + payload_len)
                    + struct.pack(">I", payload_len) + key_ns + prefix)
    return zero_frame(content_head, total, value_suffix, fill)


def _value_block(kg: int, total: int) -> bytes:
    """A frame of one snapshot block whose content really is ``total`` bytes: one entry of key
    group ``kg`` with a bytes value of zeros."""
    key = b"k%d" % kg
    head_len = 6 + 14 + len(key)
    value_len = total - head_len
    prefix, suffix = _binbytes8(value_len - 12)
    content_head = snap_block_prefix(kg, 1) + snap_entry_head(0, key, b"", value_len) + prefix
    return zero_frame(content_head, total, suffix)


def _segments() -> list[Crafted]:
    out = []
    key = "dstl/00000000001-crafted00000-00000001-01.seg"

    def add(name: str, what: str, frames: list[tuple[int, bytes]]) -> None:
        seg = segment(frames)
        out.append(Crafted(name, "restore", seg, what, key, log_handle(key, seg, len(frames))))

    add("segment: frame declares 3 GB", "one record whose zstd frame declares 3e9 bytes of "
        "content", [(0, lying_frame(3_000_000_000))])
    add("segment: 32 MiB zstd bomb at the cap", "one record that really decompresses to just "
        "under the 32 MiB cap (a SET of a 32 MiB bytes value)",
        [(0, _change_set_bomb(32 * MiB - 1024))])
    add("segment: 256 MiB zstd bomb", "one record that really decompresses to 256 MiB "
        "(above the cap)", [(0, _change_set_bomb(256 * MiB))])
    add("segment: 8 records of 32 MiB", "eight records that each decompress to just under "
        "32 MiB (read one at a time)",
        [(sqn, _change_set_bomb(32 * MiB - 1024, sqn)) for sqn in range(8)])
    add("segment: pickle of 30M dicts", "a value pickle of 30 MiB of EMPTY_DICT opcodes "
        "(2.2 GB if decoded)", [(0, _change_set_bomb(30 * MiB, fill=b"}",
                                                     value_prefix=b"\x80\x05](",
                                                     value_suffix=b"e."))])
    deep = b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b"."
    add("segment: value nested 100,000 deep", "a value pickle of lists nested 100,000 deep",
        [(0, frame_of(change_set_with(deep)))])
    meta = b"[" * 100_000 + b"]" * 100_000
    add("segment: metadata JSON 100,000 deep", "a metadata record whose JSON nests 100,000 "
        "deep", [(0, frame_of(body_head(OPERATOR, 0, 1)
                              + block(-1, [metadata_payload(0, meta)])))])
    return out


def _snapshots() -> list[Crafted]:
    out = []
    key = "snapshots/crafted_op/00000000001-00000001-0000.snap"
    meta = frame_of(struct.pack(">HI", 0xFFFF, 0) + SNAP_META)

    def add(name: str, what: str, snap: bytes) -> None:
        out.append(Crafted(name, "restore", snap, what, key, snapshot_handle(key, len(snap))))

    add("snapshot: block declares 4 GB", "one block whose frame declares 4e9 bytes",
        snapshot(meta, [(3, 1, lying_frame(4_000_000_000))]))
    add("snapshot: 4 blocks of 256 MiB", "four blocks that really decompress to 256 MiB "
        "each (1 GiB in all)", snapshot(meta, [(kg, 1, _value_block(kg, 256 * MiB))
                                               for kg in (3, 4, 5, 6)]))
    add("snapshot: 60 MiB block at the cap", "one block that really decompresses to 60 MiB "
        "(a 60 MiB value)", snapshot(meta, [(3, 1, _value_block(3, 60 * MiB))]))
    states = {"states": {str(i): {"name": f"s{i}", "kind": "value", "pad": [{}] * 20}
                         for i in range(3000)}}
    big_meta = json.dumps(states, separators=(",", ":")).encode()
    add("snapshot: metadata of 60,000 {}", f"a metadata block of {len(big_meta) // 1024} KiB "
        "of state records full of {}",
        snapshot(frame_of(struct.pack(">HI", 0xFFFF, 0) + big_meta), []))
    bad_ids = json.dumps({"states": {"x": {"name": "v", "kind": "value"}}}).encode()
    add("snapshot: non-integer state id", "snapshot metadata naming state id 'x'",
        snapshot(frame_of(struct.pack(">HI", 0xFFFF, 0) + bad_ids), []))
    return out


def _json_bomb(n_bytes: int) -> bytes:
    return b"[" + b"{}," * (n_bytes // 3 - 1) + b"{}]"


def _others() -> list[Crafted]:
    out = []
    handle = json.dumps({"v": 1, "operator_id": "o", "key_groups": [0, 1], "checkpoint_id": 1,
                         "materialization_id": 0, "materialized": [], "non_materialized": [
                             {"v": 1, "log_id": "o", "key_groups": [0, 1], "from": 0,
                              "to": 2**62, "change_sets": []}],
                         "incremental_size": 0, "max_parallelism": 2})
    out.append(Crafted("handle: sqn range of 2^62", "handle", handle.encode(),
                       f"a {len(handle)}-byte handle whose log spans 2^62 sqns"))
    key = "dstl/00000000001-crafted00000-00000001-01.seg"
    seg = segment([(0, frame_of(change_set_with(pickle.dumps(1))))])
    h = json.loads(log_handle(key, seg))
    h["non_materialized"][0]["change_sets"][0][2:4] = [2**62, 2**62]
    out.append(Crafted("handle: offset and length 2^62", "restore", seg,
                       "a handle whose record lies at offset 2^62, 2^62 bytes long", key,
                       json.dumps(h)))
    out.append(Crafted("manifest: 1 MiB of {} (valid CRC)", "manifest",
                       _manifest_with(_json_bomb(MiB - 1024)),
                       "a manifest whose task state is 1 MiB of {} with a valid CRC"))
    out.append(Crafted("manifest: 44 MiB, bad CRC", "manifest",
                       _manifest_with(_json_bomb(44 * MiB), crc="00000000"),
                       "a 44 MiB manifest whose CRC does not match"))
    marker = json.dumps({"v": 1, "operator_id": "o", "key_groups": [0, 1],
                         "max_parallelism": 2, "checkpoint_id": 1, "materialization_id": 0,
                         "boundary": None, "log_bytes": 0, "snapshot_bytes": 0,
                         "states": {"0": {"name": "v", "kind": "value",
                                          "pad": "__BOMB__"}}}).encode()
    marker = marker.replace(b"\"__BOMB__\"", _json_bomb(MiB - 1024))
    out.append(Crafted("table marker: 1 MiB of {}", "marker", marker,
                       "a table marker whose states hold 1 MiB of {}"))
    header = _json_bomb(MiB - 64)
    frame = struct.pack(">II", 4 + len(header), len(header)) + header
    out.append(Crafted("agent frame: 1 MiB header of {}", "frame", frame,
                       "an agent frame whose header is 1 MiB of {}"))
    return out


def _manifest_with(state_json: bytes, crc: str | None = None) -> bytes:
    body = (b'{"attempt":1,"checkpoint_id":1,"created_ms":1,"job_id":"j","stats":{'
            b'"ack_latency_ms":{"t":1.0},"duration_ms":1.0,"full_size":0,"incremental_size":0,'
            b'"trigger_ms":1},"tasks":[{"full_size":0,"incremental_size":0,'
            b'"referenced_keys":[],"state":{"x":' + state_json + b'},"task_id":"t"}]}')
    digest = crc if crc is not None else f"{zlib.crc32(body):08x}"
    return (b'{"body":' + body + b',"crc32":"' + digest.encode()
            + b'","format":"dstl-manifest","version":1}\n')


CATALOGUE: list[Callable[[], list[Crafted]]] = [_segments, _snapshots, _others]


def crafted_objects() -> list[Crafted]:
    return [c for make in CATALOGUE for c in make()]
