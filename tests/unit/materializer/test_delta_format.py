"""Snapshot object format v3 (the delta): golden file, round trips, and the forged-object rules —
every damaged, truncated or forged delta (checksums recomputed, as an attacker would) is a
:class:`CorruptObjectError` naming the object, never an untyped exception or wrong entries."""

from __future__ import annotations

import json
import os
import random
import struct
import zlib
from pathlib import Path

import pytest

from dstl.errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    TruncatedObjectError,
    UnsupportedFormatError,
    UsageError,
)
from dstl.keygroups import KeyGroupRange, key_group_for
from materializer.delta_format import (
    DELTA_VERSION,
    DeltaEntry,
    DeltaMeta,
    DeltaReader,
    decode_delta,
    encode_delta,
    verify_delta_object,
)
from materializer.snapshot_format import SnapshotEncoder, decode_snapshot, encode_snapshot
from materializer.state_tables import BytesSource

GOLDEN = Path(__file__).resolve().parents[2] / "data" / "format" / "v3" / "delta_small.bin"
MP = 16
RANGE = KeyGroupRange(0, MP - 1)
STATES = {"0": {"name": "count", "kind": "value", "value_codec": "safe", "key_codec": None},
          "1": {"name": "$ttl_index", "kind": "value", "value_codec": "bytes",
                "key_codec": None, "raw": True}}
META = DeltaMeta(RANGE, MP, "count/p0", 5, 4, 812, STATES)
KEYS = [b"alice", b"bob", b"carol", b"dave", b"erin", b"frank"]


def _blocks() -> list[tuple[int, list[DeltaEntry]]]:
    by_kg: dict[int, list[DeltaEntry]] = {}
    for i, k in enumerate(KEYS):
        value = None if k == b"bob" else struct.pack(">I", i)
        by_kg.setdefault(key_group_for(k, MP), []).append((0, k, b"", value))
    # a raw state's key is not hashed to its key group; a namespace; a tombstone of it
    by_kg.setdefault(3, []).append((1, b"\x00\x01raw", b"ns", b""))
    by_kg[3].append((1, b"\x00\x02raw", b"", None))
    return [(kg, sorted(es, key=lambda e: (e[0], e[1], e[2]))) for kg, es in sorted(by_kg.items())]


def golden_bytes() -> bytes:
    return encode_delta(META, _blocks(), zstd_level=1)


def _forge(meta: bytes, blocks: list[tuple[int, list[DeltaEntry]]],
           key_groups: KeyGroupRange = RANGE, version: int = DELTA_VERSION) -> bytes:
    """An object with valid checksums and any metadata and entries (the encoder's own order
    checks bypassed): what someone who can write to the store can produce."""
    enc = SnapshotEncoder(key_groups, meta, version=version)
    out = [enc.start()]
    out.extend(enc.add_key_group(kg, es) for kg, es in blocks)
    out.append(enc.finish())
    return b"".join(out)


def _meta(**changes: object) -> bytes:
    obj = json.loads(META.to_bytes())
    for k, v in changes.items():
        if v is None:
            obj.pop(k)
        else:
            obj[k] = v
    return json.dumps(obj).encode()


def test_regenerate_golden_when_asked() -> None:
    """Set DSTL_REGEN_GOLDEN=1 to rewrite the golden file (only for a deliberate format change)."""
    if os.environ.get("DSTL_REGEN_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_bytes(golden_bytes())
    assert GOLDEN.exists(), "golden file missing: run with DSTL_REGEN_GOLDEN=1 once"


def test_golden_decodes_to_the_exact_entries() -> None:
    meta, blocks = decode_delta(GOLDEN.read_bytes(), key=str(GOLDEN))
    assert meta == META
    assert blocks == dict(_blocks())
    data = GOLDEN.read_bytes()
    assert data[:8] == b"DSTL\x02\x03\x00\x00"
    assert data[-12:-8] == b"\x02\x03\x00\x00"  # the footer repeats kind, version, flags
    assert struct.unpack(">I", data[-8:-4])[0] == zlib.crc32(data[:-8])


def test_encoder_reproduces_the_golden_file_byte_for_byte() -> None:
    # After a zstandard upgrade only the frames may change: the decode test above still passing
    # proves compatibility; regenerate deliberately.
    assert golden_bytes() == GOLDEN.read_bytes()


def test_round_trip_of_random_deltas_and_ranged_reads() -> None:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    for _ in range(30):
        entries: dict[tuple[int, bytes, bytes], bytes | None] = {}
        for _ in range(rng.randrange(0, 60)):
            k = rng.randbytes(rng.randrange(0, 12))
            ns = rng.choice([b"", b"w1", rng.randbytes(3)])
            entries[(0, k, ns)] = None if rng.random() < 0.2 else rng.randbytes(rng.randrange(40))
        by_kg: dict[int, list[DeltaEntry]] = {}
        for (sid, k, ns), v in sorted(entries.items()):
            by_kg.setdefault(key_group_for(k, MP), []).append((sid, k, ns, v))
        data = encode_delta(META, sorted(by_kg.items()))
        _, blocks = decode_delta(data, key="d")
        assert blocks == by_kg
        part = KeyGroupRange(3, 9)
        reader = DeltaReader(BytesSource(data), key="d")
        got = {kg: list(es) for kg, _, es in reader.read(part)}
        assert got == {kg: es for kg, es in by_kg.items() if kg in part}


def test_the_encoder_refuses_unsorted_or_repeated_entries_and_v1_tombstones() -> None:
    k = KEYS[0]
    kg = key_group_for(k, MP)
    with pytest.raises(UsageError, match="ascending"):
        encode_delta(META, [(kg, [(0, k, b"b", b"1"), (0, k, b"a", b"2")])])
    with pytest.raises(UsageError, match="ascending"):
        encode_delta(META, [(kg, [(0, k, b"", b"1"), (0, k, b"", None)])])
    with pytest.raises(UsageError, match="tombstone"):
        encode_snapshot(RANGE, b"{}", [(kg, [(0, k, b"", None)])])  # type: ignore[list-item]


def test_every_bit_flip_of_the_golden_delta_is_detected() -> None:
    data = GOLDEN.read_bytes()
    for bit in range(len(data) * 8):
        corrupted = bytearray(data)
        corrupted[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptObjectError) as info:
            decode_delta(bytes(corrupted), key="golden")
        assert info.value.key == "golden"


def test_every_truncation_of_the_golden_delta_is_detected() -> None:
    data = GOLDEN.read_bytes()
    for n in range(len(data)):
        with pytest.raises(CorruptObjectError) as info:
            decode_delta(data[:n], key="golden")
        assert info.value.key == "golden"
        # the ranged reader (what a restore without a cache uses) as well
        with pytest.raises(CorruptObjectError):
            reader = DeltaReader(BytesSource(data[:n]), key="golden")
            for _kg, _off, entries in reader.read():
                list(entries)


def test_versions_are_not_confused() -> None:
    """A v1 decoder refuses a delta and the delta reader a v1 snapshot: a delta is never read as
    a full snapshot (its tombstones would be lost) nor the reverse."""
    with pytest.raises(UnsupportedFormatError):
        decode_snapshot(GOLDEN.read_bytes(), key="d")
    v1 = encode_snapshot(RANGE, META.to_bytes(), [(key_group_for(b"a", MP), [(0, b"a", b"", b"")])])
    with pytest.raises(UnsupportedFormatError):
        decode_delta(v1, key="s")
    with pytest.raises(UnsupportedFormatError):
        DeltaReader(BytesSource(v1), key="s")
    with pytest.raises(UnsupportedFormatError):
        verify_delta_object(v1, key="s")


def _entries_of(kg: int) -> list[DeltaEntry]:
    return dict(_blocks())[kg]


KG_A = key_group_for(b"alice", MP)
WRONG_KG = (KG_A + 1) % MP

#: name -> (metadata bytes, blocks, index range): each forged with valid checksums
FORGERIES: dict[str, tuple[bytes, list[tuple[int, list[DeltaEntry]]], KeyGroupRange]] = {
    "entries out of order": (META.to_bytes(), [(KG_A, [(0, b"alice", b"z", b"1"),
                                                       (0, b"alice", b"a", b"2")])], RANGE),
    "an entry twice": (META.to_bytes(), [(KG_A, [(0, b"alice", b"", b"1"),
                                                 (0, b"alice", b"", None)])], RANGE),
    "a key in another key group": (META.to_bytes(), [(WRONG_KG, [(0, b"alice", b"", b"1")])],
                                   RANGE),
    "a state the metadata does not describe": (META.to_bytes(),
                                               [(KG_A, [(7, b"alice", b"", b"1")])], RANGE),
    "index range other than the metadata's": (META.to_bytes(), [], KeyGroupRange(0, 7)),
    "metadata not JSON": (b"\xff{", [], RANGE),
    "metadata of a full snapshot": (b'{"states": {}}', [], RANGE),
    "metadata with a missing field": (_meta(follows=None), [], RANGE),
    "metadata with an extra field": (_meta(extra=1), [], RANGE),
    "follows not below the id": (_meta(follows=5), [], RANGE),
    "a negative up_to": (_meta(up_to=-1), [], RANGE),
    "a range beyond max parallelism": (_meta(key_groups=[0, 40]), [], KeyGroupRange(0, 40)),
    "a bool for an int": (_meta(materialization_id=True), [], RANGE),
    "a state id that is not decimal": (_meta(states={"00": STATES["0"]}), [], RANGE),
    "a state without a kind": (_meta(states={"0": {"name": "x"}}), [], RANGE),
    "an empty operator id": (_meta(operator_id=""), [], RANGE),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_deltas_are_typed_errors_naming_the_object(name: str) -> None:
    meta, blocks, kgs = FORGERIES[name]
    data = _forge(meta, blocks, kgs)
    for read in (lambda: decode_delta(data, key="snapshots/forged.snap"),
                 lambda: [list(es) for _, _, es in
                          DeltaReader(BytesSource(data), key="snapshots/forged.snap").read()]):
        with pytest.raises(CorruptObjectError) as info:
            read()
        assert info.value.key == "snapshots/forged.snap", name


def test_an_entry_that_does_not_fill_its_block_is_refused() -> None:
    """Framing forged inside a block: a value length past the block's end, a tombstone
    followed by bytes, a block shorter than its entries."""
    from dstl.envelope import encode_record
    from materializer.delta_format import DELTA_FORMAT
    good = _forge(META.to_bytes(), [(KG_A, [(0, b"alice", b"", b"1234")])])
    _, blocks = decode_delta(good, key="g")
    assert blocks == {KG_A: [(0, b"alice", b"", b"1234")]}
    entry = struct.pack(">HI", 0, 5) + b"alice" + struct.pack(">I", 0)
    same = encode_record(struct.pack(">HI", KG_A, 1) + entry + struct.pack(">I", 4) + b"1234",
                         DELTA_FORMAT, zstd_level=1, what="block")
    assert _replace_block(good, same) == good   # the forging itself is exact
    for body in (entry + struct.pack(">I", 9) + b"1234",        # value past the end
                 entry + b"\xff\xff\xff\xff" + b"xx",            # bytes after a tombstone
                 entry[:-2]):                                    # cut inside the entry
        content = struct.pack(">HI", KG_A, 1) + body
        record = encode_record(content, DELTA_FORMAT, zstd_level=1, what="block")
        forged = _replace_block(good, record)
        with pytest.raises(CorruptObjectError) as info:
            decode_delta(forged, key="f")
        assert info.value.key == "f"


def _replace_block(data: bytes, record: bytes) -> bytes:
    """``data`` (one metadata block and one key-group block) with its key-group block replaced
    by ``record``: the index, its crc and the object crc recomputed."""
    footer = data[-28:]
    index_offset, index_len = struct.unpack(">QI", footer[:12])
    index = data[index_offset:index_offset + index_len]
    head, meta_entry, block_entry = index[:8], index[8:26], index[26:44]
    kg, offset, _length, count = struct.unpack(">HQII", block_entry)
    body = data[:offset] + record
    new_index = head + meta_entry + struct.pack(">HQII", kg, offset, len(record), count)
    new_footer_head = struct.pack(">QII", len(body), len(new_index), zlib.crc32(new_index)) \
        + footer[16:20]
    obj = body + new_index + new_footer_head
    return obj + struct.pack(">I", zlib.crc32(obj)) + b"LTSD"


def test_errors_name_object_and_offset() -> None:
    data = bytearray(GOLDEN.read_bytes())
    data[20] ^= 0xFF
    with pytest.raises(ChecksumMismatchError) as info:
        decode_delta(bytes(data), key="snapshots/d.snap")
    assert info.value.key == "snapshots/d.snap" and info.value.offset == len(data) - 8
    with pytest.raises(TruncatedObjectError):
        decode_delta(GOLDEN.read_bytes()[:7], key="snapshots/d.snap")
