"""Replay refuses what the log could never contain: a change whose key group
lies outside its change set's recorded range, two change sets of one log with the same sqn in one
segment, and a change for a key group the restoring backend does not own are corruption —
typed errors naming the object and the offset, never silently applied or skipped."""

from __future__ import annotations

import dataclasses
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fakes import ScriptedStore
from support.segments import make_change_set

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.envelope import encode_header, encode_record, encode_trailer
from dstl.errors import CorruptObjectError, UsageError
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.scheduler import UploadTask
from dstl.segment import (
    SEGMENT_FORMAT,
    ChangeSet,
    IndexEntry,
    _encode_index,
    decode_segment,
    encode_segment,
)
from dstl.stores import MemoryBlobStore
from dstl.timer import ManualTimer
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle
from materializer.options import BackendOptions
from materializer.states import ValueStateDescriptor
from restore import ChangelogReader, LocalFileCache
from restore.restore import restore_backend

MP = 32
OPTS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
WAIT = 10.0


def _assemble(change_sets: list[ChangeSet]) -> bytes:
    """A segment exactly as the encoder lays it out, without the encoder's checks (so tests can
    build what a foreign or broken writer might have written)."""
    parts = [encode_header(SEGMENT_FORMAT)]
    entries = []
    pos = len(parts[0])
    for cs in change_sets:
        record = encode_record(cs.body, SEGMENT_FORMAT, zstd_level=1, what="test")
        parts.append(record)
        entries.append(IndexEntry(cs.log_id, cs.sqn, cs.kg_min, cs.kg_max, pos, len(record),
                                  cs.change_count, cs.payload_bytes))
        pos += len(record)
    index = _encode_index(entries)
    parts += [index, struct.pack(">QII", pos, len(index), len(entries))]
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    return b"".join([*parts, encode_trailer(crc)])


def test_a_change_outside_its_indexed_key_group_range_is_corrupt() -> None:
    cs = make_change_set("op", 0, [(-1, b"meta"), (3, b"a"), (7, b"b")])
    assert (cs.kg_min, cs.kg_max) == (-1, 7)
    decode_segment(_assemble([cs]), "seg")  # the honest one decodes
    lying = dataclasses.replace(cs, kg_max=5)  # the index claims [-1, 5]; the body holds 7
    data = _assemble([make_change_set("other", 4, [(1, b"x")]), lying])
    with pytest.raises(CorruptObjectError, match=r"key group 7.*\[-1, 5\]") as info:
        decode_segment(data, "segments/x.seg")
    assert info.value.key == "segments/x.seg"
    assert info.value.offset > 8  # the second record, not the header


def test_duplicate_sqns_of_one_log_in_one_segment_are_corrupt() -> None:
    a = make_change_set("op", 3, [(1, b"a")])
    b = make_change_set("op", 3, [(1, b"b")])
    with pytest.raises(CorruptObjectError, match=r"'op'.*sqn 3.*twice") as info:
        decode_segment(_assemble([a, b]), "segments/dup.seg")
    assert info.value.key == "segments/dup.seg"
    # the same sqn of two different logs is fine
    decode_segment(_assemble([a, make_change_set("op2", 3, [(1, b"b")])]), "ok")
    with pytest.raises(UsageError, match="twice"):
        encode_segment([a, b])


def test_the_scheduler_never_puts_one_change_set_twice_into_a_segment() -> None:
    """Two queued tasks carrying the same change set ``(log id, sqn)`` in one flush window (a
    writer closed with an upload queued and a new writer of the same log id, e.g. a retry
    restoring in the same process): two segments, each decodable, not one that every reader
    refuses. Fails without ``_segment_groups`` (one segment: encode_segment refuses it and both
    tasks fail)."""
    timer = ManualTimer()
    store = ScriptedStore()  # records every put
    with ChangelogStorage(store=store, timer=timer,
                          options=DstlOptions(persist_delay_s=0.25)) as s:
        results: list[object] = []

        def task(payload: bytes) -> UploadTask:
            cs = make_change_set("op", 1, [(1, payload)])
            return UploadTask([cs], on_success=lambda refs: results.append(refs[0][1]),
                              on_failure=lambda _cs, exc: results.append(exc))

        s.scheduler.upload(task(b"old"))
        s.scheduler.upload(task(b"new"))
        timer.advance(0.25)
        deadline = time.monotonic() + WAIT
        while len(results) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(results) == 2 and all(isinstance(r, ChangeSetRef) for r in results), results
        assert len(store.puts) == 2, store.puts  # one window, two segments
        for key in store.puts:
            decode_segment(store.get(key), key)


@pytest.fixture
def storage() -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(store=MemoryBlobStore(), options=DstlOptions(persist_delay_s=0.0))
    yield s
    s.close()


def _one_backend_handle(storage: ChangelogStorage) -> ChangelogStateBackendHandle:
    b = ChangelogKeyedStateBackend(storage, "op", KeyGroupRange(0, MP - 1), MP, options=OPTS)
    v = b.get_state(ValueStateDescriptor("v"))
    for i in range(40):
        b.set_current_key(f"k{i}")
        v.update(i)
    h = b.snapshot(1).result(WAIT)
    b.notify_checkpoint_complete(1)
    b.close()
    return h


@pytest.mark.parametrize("cached", [False, True])
def test_a_change_outside_its_logs_range_is_corrupt_on_replay(storage: ChangelogStorage,
                                                              tmp_path: Path,
                                                              cached: bool) -> None:
    """A handle says its writer owned [0, 7]; the change set holds other key groups: the
    handle and the object disagree — refused, even for a restore of [0, 7] that would have
    skipped them."""
    h = _one_backend_handle(storage)
    small = KeyGroupRange(0, 7)
    log = h.non_materialized[0]
    forged = dataclasses.replace(h, key_groups=small, non_materialized=(
        dataclasses.replace(log, key_groups=small),))
    cache = LocalFileCache(str(tmp_path / "cache")) if cached else None
    try:
        with pytest.raises(CorruptObjectError, match=r"outside.*\[0, 7\]") as info:
            restore_backend([forged], storage, small, cache=cache)
        assert info.value.key == log.change_sets[0].key
        assert info.value.offset == log.change_sets[0].offset
    finally:
        if cache is not None:
            cache.close()


def test_a_change_the_backend_does_not_own_is_never_skipped(storage: ChangelogStorage) -> None:
    h = _one_backend_handle(storage)
    log = h.non_materialized[0]
    changes = list(ChangelogReader(storage).read(log))
    meta = [p for kg, p in changes if kg == -1]
    kg, payload = next((kg, p) for kg, p in changes if kg >= 8)
    b = ChangelogKeyedStateBackend(storage, "small", KeyGroupRange(0, 7), MP, options=OPTS)
    try:
        remap: dict[int, int] = {}
        for m in meta:
            b.apply_change(-1, m, remap=remap)
        with pytest.raises(CorruptObjectError, match=rf"key group {kg}.*\[0, 7\]"):
            b.apply_change(kg, payload, remap=remap)
    finally:
        b.close()


@pytest.mark.parametrize("cached", [False, True])
def test_a_change_outside_its_recorded_range_is_corrupt_on_every_read_path(
        storage: ChangelogStorage, tmp_path: Path, cached: bool) -> None:
    """The index and the handle's reference both record [0, 5]; the body holds key group 7
    (inside the writer's range [0, 31]): ranged reads check the reference, the cache checks the
    index when it verifies the whole segment."""
    lying = dataclasses.replace(make_change_set("op", 0, [(7, b"junk")]), kg_min=0, kg_max=5)
    data = _assemble([lying])
    key = "dstl/forged.seg"
    storage.store.put(key, data)
    offset = 8  # the first record follows the header
    length = len(encode_record(lying.body, SEGMENT_FORMAT, zstd_level=1, what="test"))
    ref = ChangeSetRef(0, key, offset, length, 1, 4, 0, 5)
    log = ChangelogHandle("op", KeyGroupRange(0, MP - 1), 0, 1, (ref,))
    h = ChangelogStateBackendHandle("op", KeyGroupRange(0, MP - 1), 1, 0, (), (log,), 0, MP)
    cache = LocalFileCache(str(tmp_path / "cache")) if cached else None
    try:
        with pytest.raises(CorruptObjectError, match=r"key group 7.*\[0, 5\]") as info:
            restore_backend([h], storage, KeyGroupRange(0, MP - 1), cache=cache)
        assert info.value.key == key and info.value.offset == offset
    finally:
        if cache is not None:
            cache.close()


def test_references_record_their_key_group_range(storage: ChangelogStorage) -> None:
    h = _one_backend_handle(storage)
    refs = [r for log in h.non_materialized for r in log.change_sets]
    assert refs and all(r.kg_min == -1 and r.kg_max is not None and r.kg_max < MP for r in refs)
    assert ChangelogStateBackendHandle.from_json(h.to_json()) == h
    # references of older handles (six fields) still parse
    old = ChangeSetRef.from_json_obj([0, "dstl/k.seg", 8, 10, 1, 1])
    assert (old.kg_min, old.kg_max) == (None, None)
    for bad in ([0, "dstl/k.seg", 8, 10, 1, 1, 5], [0, "dstl/k.seg", 8, 10, 1, 1, 5, 4],
                [0, "dstl/k.seg", 8, 10, 1, 1, -2, 4], [0, "dstl/k.seg", 8, 10, 1, 1, 0, True]):
        with pytest.raises(UsageError):
            ChangeSetRef.from_json_obj(bad)
