"""CRC-valid but malformed content raises only DSTL errors naming the object and an offset:
the malformed cases, each crafted by hand (``support.crafted``) and read
through a whole restore, as a job restoring from a damaged or hostile checkpoint directory would.

A decoder without these checks raises a builtin on each of them (``TypeError``, ``KeyError``,
``AttributeError``, ``AssertionError``, ``RecursionError``, ``MemoryError``, ``ValueError``), or
restored state that could not be read back. The mutation fuzz suite
(``tests/property/test_decoder_fuzz.py``) generalises them.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.crafted import (
    MP,
    OPERATOR,
    SNAP_META,
    block,
    body_head,
    change_payload,
    frame_of,
    log_handle,
    metadata_payload,
    segment,
    snap_block_prefix,
    snap_entry_head,
    snapshot,
    snapshot_handle,
)

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for
from dstl.errors import CorruptObjectError, DstlError, MalformedHandleError
from dstl.stores import LocalBlobStore
from materializer.handles import ChangelogStateBackendHandle
from materializer.options import BackendOptions
from materializer.states import MapStateDescriptor, ValueStateDescriptor
from restore.restore import restore_backend

SEG = "dstl/00000000001-crafted00000-00000001-01.seg"
SNAP = "snapshots/crafted_op/00000000001-00000001-0000.snap"
ALL = KeyGroupRange(0, MP - 1)
OPTIONS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
SET, SET_INTERNAL, ADD_ELEMENT, ADD_OR_UPDATE_ELEMENT = 1, 2, 5, 6
KG = key_group_for(b"k", MP)  # the key group of key "k", which every crafted change uses


def meta(**fields: object) -> bytes:
    return json.dumps({"name": "s", "kind": "value", "value_codec": "safe", "key_codec": None,
                       **fields}).encode()


def one(x: object) -> bytes:
    return pickle.dumps(x, protocol=5)


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[ChangelogStorage]:
    with ChangelogStorage(store=LocalBlobStore(tmp_path / "store"),
                          options=DstlOptions(persist_delay_s=0.0)) as s:
        yield s


def restore_log(storage: ChangelogStorage, metadata: bytes, changes: list[bytes]) -> None:
    """Restore from a one-record segment: a metadata record for state 0, then ``changes`` in
    the key group of key "k"."""
    body = (body_head(OPERATOR, 0, 2) + block(-1, [metadata_payload(0, metadata)])
            + block(KG, changes))
    seg = segment([(0, frame_of(body))])
    storage.store.put(SEG, seg)
    restore_backend([log_handle(SEG, seg)], storage, ALL, options=OPTIONS,
                    auto_materialize=False).close()


def assert_names_the_record(err: DstlError, key: str = SEG, offset: int = 8) -> None:
    assert getattr(err, "key", None) == key and getattr(err, "offset", None) == offset, err
    assert key in str(err) and "<" not in str(err).split(":")[0]


def test_a_codec_name_of_the_wrong_json_type(storage: ChangelogStorage) -> None:
    for codec in (["safe"], {"name": "safe"}, 5, True):
        with pytest.raises(CorruptObjectError, match="value_codec") as info:
            restore_log(storage, meta(value_codec=codec), [])
        assert_names_the_record(info.value)
        storage.store.delete([SEG])


@pytest.mark.parametrize(("op", "payload"), [
    (ADD_ELEMENT, one(1)),                               # a list op on a value state
    (ADD_OR_UPDATE_ELEMENT, b"\0\0\0\1k" + one(1)),     # a map op on a value state
])
def test_a_state_of_the_wrong_kind_for_its_op(storage: ChangelogStorage, op: int,
                                             payload: bytes) -> None:
    changes = [change_payload(SET, 0, b"k", b"", one(5)), change_payload(op, 0, b"k", b"",
                                                                         payload)]
    with pytest.raises(CorruptObjectError, match=f"op {op} is not an operation of value") \
            as info:
        restore_log(storage, meta(), changes)
    assert_names_the_record(info.value)


def test_a_namespace_that_decodes_to_an_unhashable_value(storage: ChangelogStorage) -> None:
    for ns in (one([1, 2]), one(([1],)), one({"a": 1})):
        with pytest.raises(CorruptObjectError, match="namespace decodes to an unhashable") \
                as info:
            restore_log(storage, meta(), [change_payload(SET, 0, b"k", ns, one(1))])
        assert_names_the_record(info.value)
        storage.store.delete([SEG])


def test_a_map_key_that_decodes_to_an_unhashable_value(storage: ChangelogStorage) -> None:
    key = one([1])
    entry = len(key).to_bytes(4, "big") + key + one(1)
    with pytest.raises(CorruptObjectError, match="map key decodes to an unhashable") as info:
        restore_log(storage, meta(kind="map", key_codec="safe"),
                    [change_payload(ADD_OR_UPDATE_ELEMENT, 0, b"k", b"", entry)])
    assert_names_the_record(info.value)


def test_a_map_state_without_a_key_codec_uses_the_safe_one(storage: ChangelogStorage) -> None:
    """Its key codec used to be ``None``: replay failed with AssertionError/AttributeError."""
    framed = b"\0\0\0\2" + len(one("a")).to_bytes(4, "big") + one("a") + \
        len(one(1)).to_bytes(4, "big") + one(1)
    body = (body_head(OPERATOR, 0, 2) + block(-1, [metadata_payload(0, meta(kind="map"))])
            + block(KG, [change_payload(SET_INTERNAL, 0, b"k", b"", framed),
                        change_payload(ADD_OR_UPDATE_ELEMENT, 0, b"k", b"",
                                       b"\0\0\0" + bytes([len(one("b"))]) + one("b") + one(2))]))
    seg = segment([(0, frame_of(body))])
    storage.store.put(SEG, seg)
    b = restore_backend([log_handle(SEG, seg)], storage, ALL, options=OPTIONS,
                        auto_materialize=False)
    try:
        m = b.get_state(MapStateDescriptor("s"))
        b.set_current_key("k")
        assert dict(m.items()) == {"a": 1, "b": 2}
    finally:
        b.close()


def test_values_nested_100000_deep(storage: ChangelogStorage) -> None:
    """It used to restore, and then every read of the value raised RecursionError."""
    deep = b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b"."
    with pytest.raises(CorruptObjectError, match="nesting deeper than 64") as info:
        restore_log(storage, meta(), [change_payload(SET, 0, b"k", b"", deep)])
    assert_names_the_record(info.value)


def test_json_nested_100000_deep(storage: ChangelogStorage) -> None:
    with pytest.raises(CorruptObjectError, match=r"larger than the limit|not a valid JSON "
                                                  r"document|nests deeper") as info:
        restore_log(storage, b"[" * 100_000 + b"]" * 100_000, [])
    assert_names_the_record(info.value)
    storage.store.delete([SEG])
    with pytest.raises(CorruptObjectError, match="nests deeper than 64") as info:
        restore_log(storage, b'{"name":"s","kind":"value","x":' + b"[" * 200 + b"]" * 200
                    + b"}", [])
    assert_names_the_record(info.value)


def test_a_metadata_record_without_a_state_description(storage: ChangelogStorage) -> None:
    for bad in (b"{}", b'{"name":"s"}', b'{"name":"s","kind":"tree"}', b'{"name":7,"kind":'
                b'"value"}', b"[1]", b'"s"', b'{"name":"","kind":"value"}'):
        with pytest.raises(CorruptObjectError) as info:
            restore_log(storage, bad, [])
        assert_names_the_record(info.value)
        storage.store.delete([SEG])


def restore_snapshot(storage: ChangelogStorage, metadata: bytes,
                     blocks: list[tuple[int, int, bytes]]) -> None:
    snap = snapshot(frame_of(snap_block_prefix(0xFFFF, 0) + metadata), blocks)
    storage.store.put(SNAP, snap)
    restore_backend([snapshot_handle(SNAP, len(snap))], storage, ALL, options=OPTIONS,
                    auto_materialize=False).close()


@pytest.mark.parametrize("states", [
    {"x": {"name": "v", "kind": "value"}},          # not an integer
    {"-1": {"name": "v", "kind": "value"}},
    {"65536": {"name": "v", "kind": "value"}},
    {"0": {"name": "v"}},                           # no kind
    {"0": ["v", "value"]},
], ids=["x", "-1", "65536", "no-kind", "a-list"])
def test_snapshot_metadata_with_bad_state_ids_or_descriptions(storage: ChangelogStorage,
                                                              states: object) -> None:
    with pytest.raises(CorruptObjectError) as info:
        restore_snapshot(storage, json.dumps({"states": states}).encode(), [])
    assert_names_the_record(info.value, SNAP, 8)


def test_a_snapshot_entry_of_a_state_the_metadata_does_not_describe(
        storage: ChangelogStorage) -> None:
    """``remap[sid]`` used to raise KeyError."""
    value = one(1)
    content = snap_block_prefix(KG, 1) + snap_entry_head(7, b"k", b"", len(value)) + value
    snap_meta_len = len(frame_of(snap_block_prefix(0xFFFF, 0) + SNAP_META)) + 8
    with pytest.raises(CorruptObjectError, match="state id 7") as info:
        restore_snapshot(storage, SNAP_META, [(KG, 1, frame_of(content))])
    assert_names_the_record(info.value, SNAP, 8 + snap_meta_len)


def test_a_100_byte_handle_of_2_62_sqns(storage: ChangelogStorage) -> None:
    """It used to raise MemoryError (the sqn range was materialized to be compared)."""
    handle = json.dumps({"v": 1, "operator_id": "o", "key_groups": [0, 1], "checkpoint_id": 1,
                         "materialization_id": 0, "materialized": [], "non_materialized": [
                             {"v": 1, "log_id": "o", "key_groups": [0, 1], "from": 0,
                              "to": 2**62, "change_sets": []}], "incremental_size": 0,
                         "max_parallelism": 2})
    with pytest.raises(MalformedHandleError, match="non_materialized") as info:
        ChangelogStateBackendHandle.from_json(handle, key="manifest m: task t")
    assert info.value.key == "manifest m: task t" and info.value.offset == 0
    with pytest.raises(MalformedHandleError):
        restore_backend([handle], storage, KeyGroupRange(0, 1), options=OPTIONS)


@pytest.mark.parametrize(("offset", "length"), [(2**62, 100), (8, 2**62), (2**62, 2**62),
                                                (2**64, 8), (8, 2**33)])
def test_offsets_and_lengths_of_2_62_and_beyond(storage: ChangelogStorage, offset: int,
                                                length: int) -> None:
    body = body_head(OPERATOR, 0, 2) + block(-1, [metadata_payload(0, meta())]) + block(3, [])
    seg = segment([(0, frame_of(body))])
    storage.store.put(SEG, seg)
    h = json.loads(log_handle(SEG, seg))
    h["non_materialized"][0]["change_sets"][0][2:4] = [offset, length]
    with pytest.raises(CorruptObjectError) as info:
        restore_backend([json.dumps(h)], storage, ALL, options=OPTIONS)
    err = info.value
    if isinstance(err, MalformedHandleError):  # refused by the handle's ranges
        assert err.field.startswith("non_materialized[0].change_sets[0][")
    else:  # a ranged read past the end of the segment
        assert err.key == SEG and err.offset == offset


def test_a_handle_of_every_wrong_json_type_is_a_typed_error() -> None:
    good = json.loads(snapshot_handle(SNAP, 100))
    for field in ("v", "operator_id", "key_groups", "checkpoint_id", "materialization_id",
                  "materialized", "non_materialized", "incremental_size", "max_parallelism"):
        for wrong in (None, "x", 1.5, [], {}, True, -5, 2**70):
            bad = {**good, field: wrong}
            try:
                ChangelogStateBackendHandle.from_json(json.dumps(bad), key="here")
            except MalformedHandleError as exc:
                assert exc.key == "here" and field in str(exc)
    with pytest.raises(MalformedHandleError, match="key_groups"):
        ChangelogStateBackendHandle.from_json(json.dumps({**good, "key_groups": [5, 1]}))
    with pytest.raises(MalformedHandleError, match="not JSON"):
        ChangelogStateBackendHandle.from_json("{", key="here")


def test_a_value_state_read_after_restore_sees_typed_data(storage: ChangelogStorage) -> None:
    """The positive case: a well-formed crafted log restores and reads back."""
    restore_log(storage, meta(), [change_payload(SET, 0, b"k", b"", one({"a": [1]}))])
    b = restore_backend([log_handle(SEG, storage.store.get(SEG))], storage, ALL,
                        operator_id="again", options=OPTIONS, auto_materialize=False)
    try:
        v = b.get_state(ValueStateDescriptor("s"))
        b.set_current_key("k")
        assert v.value() == {"a": [1]}
    finally:
        b.close()


def test_an_lmdb_restore_names_the_table_when_a_stored_value_does_not_decode(
        storage: ChangelogStorage, tmp_path: Path) -> None:
    """An LMDB restore stores values as they are (undecoded); the first read decodes one and
    names the table, the objects its state came from, the state and the key — not
    ``<state value>``."""
    body = (body_head(OPERATOR, 0, 2) + block(-1, [metadata_payload(0, meta())])
            + block(KG, [change_payload(SET, 0, b"k", b"", one({1, 2}))]))  # a set: refused
    seg = segment([(0, frame_of(body))])
    storage.store.put(SEG, seg)
    b = restore_backend([log_handle(SEG, seg)], storage, ALL, table="lmdb", options=OPTIONS,
                        local_directory=str(tmp_path / "lmdb"), auto_materialize=False)
    try:
        v = b.get_state(ValueStateDescriptor("s"))
        b.set_current_key("k")
        with pytest.raises(CorruptObjectError, match="value of state 's'") as info:
            v.value()
        assert "(LMDB table; its state came from " in info.value.key and SEG in info.value.key
        assert "<state value>" not in str(info.value)
    finally:
        b.close()
