"""The manifest codec (dstl.checkpoint.manifest) and the manifest names (dstl.layout); all pure:
no store, no clock. The planners are tested in ``test_retention.py``.

Decoding treats a manifest as untrusted input: malformed, unsafe or damaged manifests raise typed
errors naming the manifest and the field; every single-bit flip is detected.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dstl.checkpoint.manifest import (
    CorruptManifestError,
    Manifest,
    TaskEntry,
    UnsafeManifestKeyError,
    decode_manifest,
)
from dstl.errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    UnsafePathError,
    UnsupportedFormatError,
    UsageError,
)
from dstl.layout import (
    MAX_CHECKPOINT_ID,
    created_ms_of,
    manifest_key,
    parse_manifest_key,
    segment_key,
)

SEG_A = segment_key(0x18F00000000, "a1b2c3d4e5f6", 1, 0)
SEG_B = segment_key(0x18F00000001, "a1b2c3d4e5f6", 2, 1)
SNAP = "snapshots/count/18f00000002-0003.snap"


def make_manifest(checkpoint_id: int = 7, attempt: int = 1) -> Manifest:
    tasks = [
        TaskEntry.of("count/0", {"handle": {"v": 1, "segments": [SEG_A]}, "ratio": 0.25},
                     [SEG_B, SEG_A, SEG_A], 1000, 100),
        TaskEntry.of("count/1", {"handle": None, "name": "é ✓"}, [SNAP], 2000, 0),
    ]
    return Manifest.build(job_id="job-1", checkpoint_id=checkpoint_id, attempt=attempt,
                          created_ms=1_700_000_000_123, tasks=tasks, trigger_ms=1_700_000_000_000,
                          duration_ms=123.4567, ack_latency_ms={"count/0": 5.0, "count/1": 99.5},
                          retained=3)


def resign(body: dict[str, Any], version: int = 2) -> bytes:
    """A well-formed, correctly checksummed manifest around ``body`` (an attacker's forgery)."""
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    doc = {"format": "dstl-manifest", "version": version, "crc32": f"{zlib.crc32(canon):08x}",
           "body": body}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def body_of(m: Manifest) -> dict[str, Any]:
    return json.loads(m.encode())["body"]  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- names


def test_manifest_names_sort_numerically_and_parse_back() -> None:
    pairs = [(0, 1), (1, 1), (1, 2), (15, 1), (16, 1), (255, 65535), (2**40, 3),
             (MAX_CHECKPOINT_ID, 1)]
    keys = [manifest_key(c, a) for c, a in pairs]
    assert keys == sorted(keys)
    assert [parse_manifest_key(k) for k in keys] == pairs
    assert keys[2] == "checkpoints/0000000000000001-0002.manifest"


@pytest.mark.parametrize("key", ["checkpoints/0000000000000001-0000.manifest",  # attempt 0
                                 "checkpoints/0000000000000001-0001.manifest.tmp",
                                 "checkpoints/000000000000001-0001.manifest",
                                 "checkpoints/000000000000000A-0001.manifest",
                                 "dstl/0000000000000001-0001.manifest", "checkpoints/stats.json"])
def test_non_manifest_names_do_not_parse(key: str) -> None:
    assert parse_manifest_key(key) is None


@pytest.mark.parametrize("cid,attempt", [(-1, 1), (0, 0), (MAX_CHECKPOINT_ID + 1, 1),
                                         (1, 65536), (True, 1)])
def test_manifest_key_rejects_out_of_range(cid: int, attempt: int) -> None:
    with pytest.raises(UsageError):
        manifest_key(cid, attempt)


def test_creation_time_comes_from_the_fixed_width_name() -> None:
    assert created_ms_of(SEG_A) == 0x18F00000000
    assert created_ms_of(SNAP) == 0x18F00000002
    for key in ("dstl/garbage.seg", "snapshots/x/18F00000002-1.snap", "dstl/18f0000000-x.seg"):
        assert created_ms_of(key) is None


# --------------------------------------------------------------------------- round trip


def test_round_trip_keeps_every_field() -> None:
    m = make_manifest()
    data = m.encode()
    assert data.endswith(b"\n") and data.isascii()
    back = decode_manifest(data, m.key)
    assert back == m
    assert back.referenced_keys == frozenset({SEG_A, SEG_B, SNAP})
    assert back.task("count/0").referenced_keys == (SEG_A, SEG_B)  # sorted, de-duplicated
    assert back.task("count/1").state == {"handle": None, "name": "é ✓"}
    assert back.stats.full_size == 3000 and back.stats.incremental_size == 100
    assert back.stats.duration_ms == 123.457
    assert back.encode() == data  # canonical: encoding is deterministic


def test_task_state_is_copied_not_aliased() -> None:
    state: dict[str, Any] = {"handle": [1, 2]}
    entry = TaskEntry.of("t", state, [SEG_A], 1, 1)
    state["handle"].append(3)
    assert entry.state == {"handle": [1, 2]}


# --------------------------------------------------------------------------- strict decoding

UNSAFE_KEYS = ["../etc/passwd", "dstl/../../etc/passwd", "/etc/passwd", "s3://other/dstl/x",
               "file:///etc/passwd", "dstl//x", "dstl/./x", "dstl\\x", "dstl/x\x00", "",
               "checkpoints/0000000000000001-0001.manifest", "app/other-data", 7, None]


@pytest.mark.parametrize("bad", UNSAFE_KEYS, ids=repr)
def test_unsafe_keys_in_a_manifest_are_refused(bad: object) -> None:
    body = body_of(make_manifest())
    body["tasks"][1]["referenced_keys"] = [bad]
    data = resign(body)
    key = manifest_key(7, 1)
    with pytest.raises(UnsafeManifestKeyError) as info:
        decode_manifest(data, key)
    err = info.value
    assert isinstance(err, CorruptObjectError) and isinstance(err, UnsafePathError)
    assert err.key == key and err.field == "body.tasks[1].referenced_keys[0]"
    assert key in str(err)


@pytest.mark.parametrize("bad", UNSAFE_KEYS, ids=repr)
def test_unsafe_keys_from_a_task_are_a_usage_error(bad: object) -> None:
    with pytest.raises(UnsafePathError):
        TaskEntry.of("t", {}, [bad], 0, 0)  # type: ignore[list-item]


Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: object) -> Mutation:
    def mutate(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = body
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        node[int(last) if last.isdigit() else last] = value
    return mutate


def _delete(path: str) -> Mutation:
    def mutate(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = body
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        del node[last]
    return mutate


MALFORMED: list[tuple[str, Mutation, str]] = [
    ("job_id not a string", _set("job_id", 5), "body.job_id"),
    ("job_id empty", _set("job_id", ""), "body.job_id"),
    ("checkpoint id negative", _set("checkpoint_id", -1), "body.checkpoint_id"),
    ("checkpoint id a bool", _set("checkpoint_id", True), "body.checkpoint_id"),
    ("checkpoint id a float", _set("checkpoint_id", 7.0), "body.checkpoint_id"),
    ("attempt zero", _set("attempt", 0), "body.attempt"),
    ("created_ms a string", _set("created_ms", "now"), "body.created_ms"),
    ("missing field", _delete("created_ms"), "body.created_ms"),
    ("unknown field", _set("extra", 1), "body.extra"),
    ("tasks not a list", _set("tasks", {}), "body.tasks"),
    ("no tasks", _set("tasks", []), "body.tasks"),
    ("task not an object", _set("tasks.0", "x"), "body.tasks[0]"),
    ("task id missing", _delete("tasks.0.task_id"), "body.tasks[0].task_id"),
    ("task state a list", _set("tasks.0.state", [1]), "body.tasks[0].state"),
    ("keys not a list", _set("tasks.0.referenced_keys", SEG_A), "body.tasks[0].referenced_keys"),
    ("keys unsorted", _set("tasks.0.referenced_keys", [SEG_B, SEG_A]),
     "body.tasks[0].referenced_keys"),
    ("keys repeated", _set("tasks.0.referenced_keys", [SEG_A, SEG_A]),
     "body.tasks[0].referenced_keys"),
    ("size negative", _set("tasks.1.full_size", -5), "body.tasks[1].full_size"),
    ("task ids repeat", _set("tasks.1.task_id", "count/0"), "body.tasks"),
    ("stats missing", _delete("stats"), "body.stats"),
    ("duration a string", _set("stats.duration_ms", "1"), "body.stats.duration_ms"),
    ("duration negative", _set("stats.duration_ms", -1.0), "body.stats.duration_ms"),
    ("latency for an unknown task", _set("stats.ack_latency_ms", {"count/0": 1, "zz": 2}),
     "body.stats.ack_latency_ms"),
    ("full size not the sum", _set("stats.full_size", 1), "body.stats.full_size"),
    ("incremental size not the sum", _set("stats.incremental_size", 0),
     "body.stats.incremental_size"),
]


@pytest.mark.parametrize("mutate,field", [(m, f) for _, m, f in MALFORMED],
                         ids=[name for name, _, _ in MALFORMED])
def test_malformed_fields_are_named(mutate: Mutation, field: str) -> None:
    body = body_of(make_manifest())
    mutate(body)
    key = manifest_key(7, 1)
    with pytest.raises(CorruptManifestError) as info:
        decode_manifest(resign(body), key)
    assert info.value.field == field, str(info.value)
    assert info.value.key == key and key in str(info.value)


def test_body_must_match_the_object_name() -> None:
    data = make_manifest(7, 1).encode()
    with pytest.raises(CorruptManifestError, match="object name says 8"):
        decode_manifest(data, manifest_key(8, 1))


@pytest.mark.parametrize("data,error", [
    (b"", CorruptObjectError),
    (b"\xff\xfe{}", CorruptObjectError),
    (b"{not json", CorruptObjectError),
    (b"[]", UnsupportedFormatError),
    (b'{"format":"dstl-manifest","version":4}', UnsupportedFormatError),
    (b'{"format":"dstl-manifest","version":true}', UnsupportedFormatError),
    (b'{"format":"zarr","version":1}', UnsupportedFormatError),
    (b'{"body":{},"crc32":NaN,"format":"dstl-manifest","version":1}', CorruptObjectError),
    (b"[" * 100_000 + b"]" * 100_000, CorruptObjectError),
    (b'{"body":{},"crc32":"ABCDEF01","format":"dstl-manifest","version":1}',
     CorruptManifestError),
    (b'{"body":[],"crc32":"00000000","format":"dstl-manifest","version":1}',
     CorruptManifestError),
], ids=["empty", "not utf-8", "not json", "a list", "newer version", "bool version",
        "other format", "NaN", "deep nesting", "uppercase crc", "body not an object"])
def test_garbage_is_a_typed_corruption_naming_the_key(data: bytes,
                                                      error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        decode_manifest(data, "checkpoints/x")
    assert isinstance(info.value, CorruptObjectError)
    assert "checkpoints/x" in str(info.value)


def test_a_changed_value_fails_the_crc() -> None:
    data = make_manifest().encode()
    damaged = data.replace(b'"full_size":1000', b'"full_size":1001')
    assert damaged != data
    with pytest.raises(ChecksumMismatchError) as info:
        decode_manifest(damaged, manifest_key(7, 1))
    assert info.value.key == manifest_key(7, 1)


def test_non_canonical_text_is_detected_even_with_a_valid_crc() -> None:
    pretty = json.dumps(json.loads(make_manifest().encode()), indent=1).encode()
    with pytest.raises(CorruptObjectError, match="canonical"):
        decode_manifest(pretty, manifest_key(7, 1))


def test_oversized_manifest_is_rejected_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    import dstl.checkpoint.manifest as manifest_mod

    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(CorruptObjectError, match="larger than the manifest limit"):
        decode_manifest(make_manifest().encode(), manifest_key(7, 1))


@given(st.data())
def test_every_single_bit_flip_is_detected(data: st.DataObject) -> None:
    blob = make_manifest().encode()
    pos = data.draw(st.integers(0, len(blob) - 1), label="byte")
    bit = data.draw(st.integers(0, 7), label="bit")
    damaged = bytearray(blob)
    damaged[pos] ^= 1 << bit
    with pytest.raises(CorruptObjectError):
        decode_manifest(bytes(damaged), manifest_key(7, 1))


@pytest.mark.parametrize("kwargs,match", [
    ({"state": [1]}, "state"),
    ({"state": {"x": float("nan")}}, "state"),
    ({"state": {"x": object()}}, "state"),
    ({"referenced_keys": "dstl/x"}, "single string"),
    ({"full_size": -1}, "full_size"),
    ({"incremental_size": 1.5}, "incremental_size"),
    ({"task_id": ""}, "task_id"),
])
def test_task_entries_validate_caller_values(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"task_id": "t", "state": {}, "referenced_keys": [SEG_A],
                            "full_size": 1, "incremental_size": 1, **kwargs}
    with pytest.raises(UsageError, match=match):
        TaskEntry.of(**args)


def test_build_rejects_inconsistent_latencies() -> None:
    with pytest.raises(UsageError, match="ack_latency_ms"):
        Manifest.build(job_id="j", checkpoint_id=1, attempt=1, created_ms=0,
                       tasks=[TaskEntry.of("a", {}, [], 0, 0)], trigger_ms=0, duration_ms=0,
                       ack_latency_ms={"b": 1.0}, retained=3)


# --------------------------------------------------------------------------- retention (v2)


def test_a_manifest_records_the_jobs_retention() -> None:
    m = make_manifest()
    assert m.retained == 3 and m.version == 2
    doc = json.loads(m.encode())
    assert doc["version"] == 2 and doc["body"]["retained"] == 3
    assert decode_manifest(m.encode(), m.key) == m


def test_version_1_manifests_stay_readable_with_an_unknown_retention() -> None:
    body = body_of(make_manifest())
    del body["retained"]
    data = resign(body, version=1)
    m = decode_manifest(data, manifest_key(7, 1))
    assert m.retained is None and m.version == 1
    assert m.encode() == data  # a v1 manifest round-trips as v1
    assert m.tasks == make_manifest().tasks


@pytest.mark.parametrize(("version", "retained", "reason"), [
    (2, None, "missing"), (2, 0, "out of range"), (2, 1001, "out of range"),
    (2, True, "expected an integer"), (2, "3", "expected an integer"), (2, 2.0, "integer"),
    (1, 3, "unknown field"),
])
def test_a_bad_recorded_retention_is_a_corrupt_manifest(version: int, retained: object,
                                                        reason: str) -> None:
    body = body_of(make_manifest())
    if retained is None:
        del body["retained"]
    else:
        body["retained"] = retained
    with pytest.raises(CorruptManifestError) as info:
        decode_manifest(resign(body, version), manifest_key(7, 1))
    assert info.value.field == "body.retained" and reason in str(info.value)


def test_a_null_retention_in_version_2_is_refused() -> None:
    body = body_of(make_manifest())
    body["retained"] = None
    with pytest.raises(CorruptManifestError, match=r"body\.retained"):
        decode_manifest(resign(body, 2), manifest_key(7, 1))


@pytest.mark.parametrize("retained", [0, -1, 1001, True])
def test_building_a_manifest_needs_a_valid_retention(retained: int) -> None:
    with pytest.raises(UsageError, match="retained"):
        Manifest.build(job_id="j", checkpoint_id=1, attempt=1, created_ms=0,
                       tasks=[TaskEntry.of("t", {}, [], 0, 0)], trigger_ms=0, duration_ms=0,
                       ack_latency_ms={"t": 0.0}, retained=retained)


# --------------------------------------------------------------------------- v3: properties


def _with_properties(props: dict[str, Any]) -> Manifest:
    m = make_manifest()
    return Manifest.build(job_id=m.job_id, checkpoint_id=m.checkpoint_id, attempt=m.attempt,
                          created_ms=m.created_ms, tasks=list(m.tasks),
                          trigger_ms=m.stats.trigger_ms, duration_ms=m.stats.duration_ms,
                          ack_latency_ms=dict(m.stats.ack_latency_ms), retained=3,
                          properties=props)


def test_properties_round_trip_as_version_3_and_only_then() -> None:
    props = {"watermark_ms": -5, "big": (1 << 63) - 1, "f": 0.5, "s": "x", "b": True, "n": None}
    m = _with_properties(props)
    data = m.encode()
    assert json.loads(data)["version"] == 3
    back = decode_manifest(data, m.key)
    assert back.properties == props and back == m and back.encode() == data
    assert json.loads(make_manifest().encode())["version"] == 2  # no properties: v2 as before
    assert _with_properties({}).encode() == make_manifest().encode()


@pytest.mark.parametrize("props,where", [
    ({"": 1}, "name"), ({"1abc": 1}, "name"), ({"a b": 1}, "name"), ({"x" * 65: 1}, "name"),
    ({"a": 1 << 63}, "properties.a"), ({"a": float("inf")}, "properties.a"),
    ({"a": [1]}, "properties.a"), ({"a": {"b": 1}}, "properties.a"),
    ({"a": "x" * 1025}, "properties.a"), ({"a": "line\nbreak"}, "properties.a"),
    ({f"p{i}": i for i in range(65)}, "at most 64"),
])
def test_bad_properties_are_refused_when_built_and_when_decoded(props: dict[str, Any],
                                                                where: str) -> None:
    with pytest.raises(UsageError, match=where):
        _with_properties(props)
    body = body_of(_with_properties({"ok": 1}))
    body["properties"] = props
    with pytest.raises(CorruptObjectError, match=r"properties|Infinity is not allowed"):
        decode_manifest(resign(body, version=3), "checkpoints/x.manifest")


def test_properties_need_version_3_and_version_3_needs_properties() -> None:
    body = body_of(_with_properties({"watermark_ms": 1}))
    with pytest.raises(CorruptManifestError, match="unknown field"):
        decode_manifest(resign(body, version=2), "checkpoints/x.manifest")
    body["properties"] = {}
    with pytest.raises(CorruptManifestError, match="empty"):
        decode_manifest(resign(body, version=3), "checkpoints/x.manifest")
