"""The bulk replay (materializer.replay) against the per-change replay it replaced.

Differential tests: the same log replayed block by block (``restore_backend``) and change by
change (``ChangelogReader.read`` + ``backend.apply_change``, the old path, still the one for
metadata and non-SET ops) must leave identical tables — raw entries, heap and LMDB, every state
kind — and a malformed change-set body must make both fail with a DSTL corruption error (or
neither). A fast path that diverged from the slow one fails here.
"""

from __future__ import annotations

import json
import random
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import CorruptObjectError
from dstl.segment import body_blocks, build_change_set, iter_body_changes
from dstl.stores import MemoryBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.changes import (
    ADD,
    ADD_ELEMENT,
    ADD_OR_UPDATE_ELEMENT,
    CLEAR,
    OP_SID,
    REMOVE_ELEMENT,
    SET,
    SET_INTERNAL,
    encode_key_ns,
    encode_map_entry,
    encode_metadata,
    frame,
)
from materializer.codecs import SafeCodec
from materializer.handles import ChangelogStateBackendHandle
from materializer.replay import BlockReplayer
from materializer.state_tables import SnapshotReader
from restore.reader import ChangelogReader
from restore.restore import restore_backend
from tests.integration.restore.test_restore_roundtrip import MP, OPTS, _checkpoint, _workload

RANGE = KeyGroupRange(0, MP - 1)
KEYS = [f"user-{i}" for i in range(40)]
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


def _dump(b: ChangelogKeyedStateBackend) -> dict[tuple[int, int, Any, Any], Any]:
    """Every raw table entry: (state id, key group, key, namespace) -> stored state."""
    out: dict[tuple[int, int, Any, Any], Any] = {}
    for sid in range(8):
        if b.registered_state(sid) is None:
            continue
        for kg in b.key_groups:
            for k, ns, v in b.tables.entries(sid, kg):
                out[(sid, kg, k, ns)] = v
    return out


def _per_change_restore(storage: ChangelogStorage, h: ChangelogStateBackendHandle, table: str,
                        tmp: str) -> ChangelogKeyedStateBackend:
    """The replay as it was before the bulk path: one change at a time."""
    b = ChangelogKeyedStateBackend(storage, "ref", h.key_groups, MP, table=table, options=OPTS,
                                   local_directory=tmp, clear_local=True)
    reader = ChangelogReader(storage)
    with b.tables.write_batch():
        for log in h.non_materialized:
            remap: dict[int, int] = {}
            for kg, payload in reader.read(log, key_groups=h.key_groups):
                b.apply_change(kg, payload, remap=remap)
    return b


def _log(seed: int, steps: int, checkpoints: int) -> tuple[MemoryBlobStore,
                                                           ChangelogStateBackendHandle]:
    """A log (no snapshot) of a random workload over every state kind, in several change sets."""
    store = MemoryBlobStore()
    rng = random.Random(seed)
    with ChangelogStorage(store=store, options=DstlOptions(persist_delay_s=0.0)) as storage:
        b = ChangelogKeyedStateBackend(storage, "op", RANGE, MP, options=OPTS)
        model: dict[Any, Any] = {}
        h = None
        for cp in range(1, checkpoints + 1):
            _workload(b, rng, steps, KEYS, model)
            h = _checkpoint(b, cp)
        b.close()
    assert h is not None and not h.materialized
    return store, h


@pytest.mark.parametrize("table", ["heap", "lmdb"])
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 300),
       checkpoints=st.integers(1, 3))
def test_bulk_replay_equals_per_change_replay(table: str, seed: int, steps: int,
                                              checkpoints: int, tmp_path_factory: Any) -> None:
    store, h = _log(seed, steps, checkpoints)
    storage = ChangelogStorage(store=store)
    ref = _per_change_restore(storage, h, table, str(tmp_path_factory.mktemp("ref")))
    bulk = restore_backend([h], storage, RANGE, table=table, options=OPTS,
                           local_directory=str(tmp_path_factory.mktemp("bulk")))
    try:
        assert _dump(bulk) == _dump(ref)
        assert sorted(bulk.state_names()) == sorted(ref.state_names())
    finally:
        bulk.close()
        ref.close()
        storage.close()


def _snapshot(seed: int, steps: int) -> tuple[MemoryBlobStore, ChangelogStateBackendHandle]:
    """A materialized snapshot (and an empty log after it) of a random workload."""
    store = MemoryBlobStore()
    rng = random.Random(seed)
    with ChangelogStorage(store=store, options=DstlOptions(persist_delay_s=0.0)) as storage:
        b = ChangelogKeyedStateBackend(storage, "op", RANGE, MP, options=OPTS)
        _workload(b, rng, steps, KEYS, {})
        assert b.materialize_now(10) is not None
        h = _checkpoint(b, 1)
        b.close()
    assert h.materialized
    return store, h


def _per_entry_load(storage: ChangelogStorage, h: ChangelogStateBackendHandle, table: str,
                    tmp: str) -> ChangelogKeyedStateBackend:
    """The snapshot load as it was before the bulk path: one put per entry."""
    b = ChangelogKeyedStateBackend(storage, "ref", h.key_groups, MP, table=table, options=OPTS,
                                   local_directory=tmp, clear_local=True)
    for ref in h.materialized:
        reader = SnapshotReader(storage.store.get(ref.key), key=ref.key)
        states = json.loads(reader.metadata)["states"]
        remap = {int(sid): b.register_restored_state(meta, int(sid))
                 for sid, meta in states.items()}
        for kg, entries in reader.read(h.key_groups):
            with b.tables.write_batch():
                for sid, kb, nb, vb in entries:
                    new = remap[sid]
                    if table == "heap":
                        k, ns, state = b.decode_entry(new, kb, nb, vb)
                        b.tables.put(new, kg, k, ns, state)
                    else:
                        b.tables.put(new, kg, kb, nb, vb)
    return b


@pytest.mark.parametrize("table", ["heap", "lmdb"])
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 400))
def test_bulk_snapshot_load_equals_per_entry_load(table: str, seed: int, steps: int,
                                                  tmp_path_factory: Any) -> None:
    store, h = _snapshot(seed, steps)
    storage = ChangelogStorage(store=store)
    ref = _per_entry_load(storage, h, table, str(tmp_path_factory.mktemp("ref")))
    bulk = restore_backend([h], storage, RANGE, table=table, options=OPTS,
                           local_directory=str(tmp_path_factory.mktemp("bulk")))
    try:
        assert _dump(bulk) == _dump(ref)
    finally:
        bulk.close()
        ref.close()
        storage.close()


# --------------------------------------------------------------------------- crafted bodies

_SAFE = SafeCodec()
_STATES = {0: {"name": "v", "kind": "value", "value_codec": "safe"},
           1: {"name": "l", "kind": "list", "value_codec": "safe"},
           2: {"name": "m", "kind": "map", "value_codec": "safe", "key_codec": "safe"}}


@st.composite
def _change(draw: Any) -> bytes:
    """One ``u32 len | change`` record: mostly well formed, sometimes damaged."""
    op = draw(st.sampled_from([CLEAR, SET, SET_INTERNAL, ADD, ADD_ELEMENT,
                               ADD_OR_UPDATE_ELEMENT, REMOVE_ELEMENT, 9]))
    sid = draw(st.sampled_from([0, 0, 1, 2, 3]))
    key = draw(st.sampled_from([b"a", b"b", b"c", b"\xff"]))
    ns = draw(st.sampled_from([b"", _SAFE.encode("w1")]))
    v = _SAFE.encode(draw(st.integers(-5, 300)))
    payload = {CLEAR: b"", SET: v, SET_INTERNAL: frame([v]) if sid == 1 else v,
               ADD: frame([v, v]), ADD_ELEMENT: v,
               ADD_OR_UPDATE_ELEMENT: encode_map_entry(_SAFE.encode("k"), v),
               REMOVE_ELEMENT: _SAFE.encode("k"), 9: b"x"}[op]
    change = OP_SID.pack(op, sid) + encode_key_ns(key, ns) + payload
    damage = draw(st.sampled_from(["none"] * 6 + ["cut", "flip", "length"]))
    if damage == "cut":
        change = change[:draw(st.integers(0, len(change)))]
    elif damage == "flip":
        i = draw(st.integers(0, len(change) - 1))
        change = change[:i] + bytes([change[i] ^ draw(st.integers(1, 255))]) + change[i + 1:]
    n = len(change)
    if damage == "length":
        n = draw(st.integers(0, n + 8))
    return struct.pack(">I", n) + change


@st.composite
def _body(draw: Any) -> bytes:
    meta = b"".join(struct.pack(">I", len(r)) + r
                    for r in (encode_metadata(sid, m) for sid, m in _STATES.items()))
    blocks: dict[int, bytes] = {-1: meta}
    for kg in draw(st.sets(st.integers(0, 5), max_size=3)):
        blocks[kg] = b"".join(draw(st.lists(_change(), min_size=1, max_size=6)))
    return build_change_set("log", 1, blocks, 0, 0).body


def _outcome(fn: Any) -> tuple[str, Any]:
    """The result, or which error: any corruption error alike (the bulk path may find a damaged
    change as truncated where the per-change path calls it malformed); another exception by its
    type (the per-change path's own, e.g. ADD on a value state, reached by both)."""
    try:
        return "ok", fn()
    except CorruptObjectError:
        return "corrupt", None
    except Exception as exc:  # compared by type, not swallowed
        return "error", type(exc).__name__


@pytest.mark.parametrize("table", ["heap", "lmdb"])
@SETTINGS
@given(body=_body())
def test_crafted_bodies_same_outcome_both_paths(table: str, body: bytes,
                                               tmp_path_factory: Any) -> None:
    storage = ChangelogStorage(store=MemoryBlobStore())
    kgs = KeyGroupRange(0, 3)  # blocks 4 and 5 are outside: the per-change path's rules
    slow = ChangelogKeyedStateBackend(storage, "slow", kgs, MP, table=table, options=OPTS,
                                      local_directory=str(tmp_path_factory.mktemp("s")))
    fast = ChangelogKeyedStateBackend(storage, "fast", kgs, MP, table=table, options=OPTS,
                                      local_directory=str(tmp_path_factory.mktemp("f")))
    try:
        def per_change() -> Any:
            remap: dict[int, int] = {}
            with slow.tables.write_batch():
                for kg, payload in iter_body_changes(body, key="seg", offset=8):
                    slow.apply_change(kg, payload, remap=remap)
            return _dump(slow)

        def bulk() -> Any:
            with fast.bulk_restore() as loader:
                BlockReplayer(fast, loader, {}, False).apply(
                    body, body_blocks(body, key="seg", offset=8), "seg", 8)
            return _dump(fast)

        assert _outcome(bulk) == _outcome(per_change)
    finally:
        slow.close()
        fast.close()
        storage.close()


@st.composite
def _uniform_body(draw: Any) -> bytes:
    """Blocks the uniform fast path takes (>= 8 SETs of one state, fixed key and value
    lengths, no namespace), sometimes with one change made different: another op, state id,
    key length or namespace, a flipped byte, a wrong length, a cut block."""
    meta = b"".join(struct.pack(">I", len(r)) + r
                    for r in (encode_metadata(sid, m) for sid, m in _STATES.items()))
    blocks: dict[int, bytes] = {-1: meta}
    for kg in draw(st.sets(st.integers(0, 5), min_size=1, max_size=3)):
        op = draw(st.sampled_from([SET, SET_INTERNAL]))
        sid = draw(st.sampled_from([0, 0, 1, 3]))  # 3: no metadata
        n = draw(st.integers(8, 40))
        changes = []
        for _ in range(n):
            v = _SAFE.encode(draw(st.integers(0, 255)))  # one pickled length for all
            payload = frame([v]) if (sid == 1 and op == SET_INTERNAL) else v
            key = bytes([97, draw(st.integers(97, 101))])  # duplicates: order matters
            changes.append(OP_SID.pack(op, sid) + encode_key_ns(key, b"") + payload)
        damage = draw(st.sampled_from(["none"] * 2 + ["op", "sid", "key", "ns", "flip",
                                                      "length", "cut", "klen", "ns-only"]))
        i = draw(st.integers(0, n - 1))
        c = changes[i]
        if damage == "op":
            c = OP_SID.pack(draw(st.sampled_from([CLEAR, ADD_ELEMENT, 9])), sid) + c[3:]
        elif damage == "sid":
            c = OP_SID.pack(op, 2 if sid != 2 else 0) + c[3:]
        elif damage == "key":
            c = OP_SID.pack(op, sid) + encode_key_ns(b"a", b"") + c[3 + 4 + 2 + 4:]
        elif damage == "ns":
            c = OP_SID.pack(op, sid) + encode_key_ns(c[7:9], b"n") + c[3 + 4 + 2 + 4:]
        elif damage == "klen":  # same change length, key one byte shorter, value one longer
            c = OP_SID.pack(op, sid) + encode_key_ns(c[7:8], b"") + b"\0" + c[3 + 4 + 2 + 4:]
        elif damage == "ns-only":  # same change and key length, a namespace, value shorter
            c = OP_SID.pack(op, sid) + encode_key_ns(c[7:9], b"n") + c[3 + 4 + 2 + 4:-1]
        elif damage == "flip":
            j = draw(st.integers(0, len(c) - 1))
            c = c[:j] + bytes([c[j] ^ draw(st.integers(1, 255))]) + c[j + 1:]
        changes[i] = c
        records = [struct.pack(">I", len(x)) + x for x in changes]
        if damage == "length":
            records[i] = struct.pack(">I", len(changes[i]) + draw(st.sampled_from(
                [-1, 1, 4]))) + changes[i]
        block = b"".join(records)
        if damage == "cut":
            block = block[:len(block) - draw(st.integers(1, 8))]
        blocks[kg] = block
    return build_change_set("log", 1, blocks, 0, 0).body


@pytest.mark.parametrize("table", ["heap", "lmdb"])
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=_uniform_body())
def test_uniform_blocks_same_outcome_both_paths(table: str, body: bytes,
                                               tmp_path_factory: Any) -> None:
    """The uniform fast path (materializer.replay.uniform_block) against the per-change path,
    on blocks it takes and on blocks that differ from uniform in exactly one change."""
    test_crafted_bodies_same_outcome_both_paths.hypothesis.inner_test(  # type: ignore[attr-defined]
        table, body, tmp_path_factory)


def test_the_fast_path_takes_uniform_blocks_and_refuses_near_misses() -> None:
    """The check itself: a uniform block is recognised, and each single difference is not."""
    from materializer.replay import uniform_block, uniform_changes

    def block(changes: list[bytes]) -> bytes:
        return b"".join(struct.pack(">I", len(c)) + c for c in changes)

    v = _SAFE.encode(7)
    good = [OP_SID.pack(SET, 0) + encode_key_ns(b"k%d" % (i % 10), b"") + v for i in range(12)]
    body = b"xx" + block(good) + b"yy"
    got = uniform_block(body, 2, len(body) - 2)
    assert got == (0, 2, len(v))
    assert [k for k, _ in uniform_changes(body, 2, len(body) - 2, 2, len(v), False)] == [
        b"k%d" % (i % 10) for i in range(12)]
    near = {
        "op": OP_SID.pack(CLEAR, 0) + encode_key_ns(b"k0", b"") + v,
        "sid": OP_SID.pack(SET, 1) + encode_key_ns(b"k0", b"") + v,
        "ns": OP_SID.pack(SET, 0) + encode_key_ns(b"k", b"n") + v,  # same length, other split
        "value": OP_SID.pack(SET, 0) + encode_key_ns(b"k", b"") + v + b"x",  # same length
        # same length, and zeros where the namespace length is expected: only the key length
        # field tells
        "klen": OP_SID.pack(SET, 0) + encode_key_ns(b"k", b"") + b"\0" + v,
        # same length and key length: only the namespace length tells
        "ns-only": OP_SID.pack(SET, 0) + encode_key_ns(b"k0", b"n") + v[:-1],
    }
    for what, c in near.items():
        assert len(c) == len(good[0]) or what in ("sid", "op"), what
        for i in (0, 5, 11):
            changed = [*good[:i], c, *good[i + 1:]]
            b = block(changed)
            assert uniform_block(b, 0, len(b)) is None, (what, i)
    short = block(good[:7])
    assert uniform_block(short, 0, len(short)) is None  # below the threshold: the loop


@given(body=_body(), keep=st.sets(st.integers(-1, 6)))
@settings(max_examples=100, deadline=None)
def test_body_blocks_hold_exactly_the_changes_iter_body_changes_yields(body: bytes,
                                                                      keep: set[int]) -> None:
    """Same framing checks and the same changes, in the same order, for any key-group filter."""
    def flat() -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        for kg, start, end in body_blocks(body, key_groups=keep):
            pos = start
            while pos < end:
                (n,) = struct.unpack_from(">I", body, pos)
                if pos + 4 + n > end:
                    raise CorruptObjectError("<change set>", 0, "past the block")
                out.append((kg, body[pos + 4:pos + 4 + n]))
                pos += 4 + n
        return out

    assert _outcome(flat) == _outcome(lambda: list(iter_body_changes(body, key_groups=keep)))


@given(cut=st.integers(0, 40))
def test_body_blocks_refuse_a_truncated_body(cut: int) -> None:
    body = build_change_set("log", 1, {3: struct.pack(">I", 2) + b"ab"}, 1, 2).body
    truncated = body[:len(body) - 1 - cut % len(body)]
    with pytest.raises(CorruptObjectError):
        body_blocks(truncated, key="seg", offset=8)


def test_every_state_kind_accepts_both_fast_ops() -> None:
    """The bulk path stores SET and SET_INTERNAL of any state without the per-kind op check the
    per-change path makes; that is only right while every kind allows both."""
    from materializer.changes import OPS_BY_KIND

    assert all({SET, SET_INTERNAL} <= ops for ops in OPS_BY_KIND.values())


def test_a_failed_bulk_replay_into_lmdb_leaves_no_table_and_the_next_restore_starts_clean(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bulk load commits as it goes (every COMMIT_BYTES, here 1 byte: after every change
    set), so a replay that fails late has committed rows — the failed restore removes its
    table with them (nothing stays to adopt or open), and the next restore starts clean."""
    from materializer.lmdb_table import LmdbBulkLoad
    from restore import restore as restore_mod

    monkeypatch.setattr(LmdbBulkLoad, "COMMIT_BYTES", 1)
    store, h = _log(7, 200, 3)
    storage = ChangelogStorage(store=store)
    local = str(tmp_path / "local")
    real = restore_mod.BlockReplayer.apply
    calls = {"n": 0}

    def failing_third(self: Any, body: bytes, blocks: Any, key: str, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise CorruptObjectError(key, offset, "injected: the third change set is damaged")
        return real(self, body, blocks, key, offset)

    monkeypatch.setattr(restore_mod.BlockReplayer, "apply", failing_third)
    try:
        with pytest.raises(CorruptObjectError, match="injected"):
            restore_backend([h], storage, RANGE, table="lmdb", options=OPTS,
                            local_directory=local)
        assert calls["n"] == 3   # two change sets were committed before the failure ...
        assert not list((tmp_path / "local").rglob("data.mdb"))  # ... and went with the table
        monkeypatch.setattr(restore_mod.BlockReplayer, "apply", real)
        ref = _per_change_restore(storage, h, "lmdb", str(tmp_path / "ref"))
        again = restore_backend([h], storage, RANGE, table="lmdb", options=OPTS,
                                local_directory=local)
        try:
            assert _dump(again) == _dump(ref)
        finally:
            again.close()
            ref.close()
    finally:
        storage.close()
