"""Lease verification of snapshots checks integrity without parsing entries,
and every corruption is still a typed error naming the object: at verification when a checksum,
the index or a block's record is wrong, at load when only the entries' framing is."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest
from support.crafted import (
    MP,
    SNAP_META,
    frame_of,
    snap_block_prefix,
    snap_entry_head,
    snapshot,
    snapshot_handle,
)

from dstl import ChangelogStorage, KeyGroupRange, key_group_for
from dstl.errors import ChecksumMismatchError, CorruptObjectError
from dstl.stores import LocalBlobStore
from materializer import snapshot_format
from materializer.options import BackendOptions
from restore.cache import LocalFileCache
from restore.reader import verify_snapshot
from restore.restore import restore_backend

SNAP = "snapshots/crafted_op/00000000001-00000001-0000.snap"
KG = key_group_for(b"k", MP)
OPTIONS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)


def _snap(content: bytes, count: int = 1) -> bytes:
    return snapshot(frame_of(snap_block_prefix(0xFFFF, 0) + SNAP_META),
                    [(KG, count, frame_of(content))])


def _good_content() -> bytes:
    value = b"\x80\x05K\x07."
    return snap_block_prefix(KG, 1) + snap_entry_head(0, b"k", b"", len(value)) + value


def test_verify_reads_no_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Verification must not walk entries (the load does): with the entry parser disabled it
    still passes a good object and still refuses a damaged one."""
    data = _snap(_good_content())

    def no_parsing(*_: object) -> None:
        raise AssertionError("verification parsed entries")

    monkeypatch.setattr(snapshot_format, "_entries", no_parsing)
    verify_snapshot(data, SNAP)
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0x40
    with pytest.raises(CorruptObjectError) as info:
        verify_snapshot(bytes(damaged), SNAP)
    assert info.value.key == SNAP


def test_a_damaged_block_record_is_refused_at_verification_naming_the_object() -> None:
    """The object crc re-sealed after a flipped byte inside the block's frame: the record crc
    still catches it (blocks are checked, not only the object)."""
    data = bytearray(_snap(_good_content()))
    block_at = 8 + 8 + len(frame_of(snap_block_prefix(0xFFFF, 0) + SNAP_META))
    data[block_at + 8 + 4] ^= 1
    body = bytes(data[:-8])
    sealed = body + struct.pack(">I", zlib.crc32(body)) + b"LTSD"
    with pytest.raises(ChecksumMismatchError) as info:
        verify_snapshot(sealed, SNAP)
    assert info.value.key == SNAP and info.value.offset == block_at


def test_entries_that_do_not_fill_their_block_pass_verification_and_fail_the_load(
        tmp_path: Path) -> None:
    """Checksums all match (a crafted object); only the entries' framing is wrong: the cache
    takes it, the restore refuses it, typed, naming the object."""
    value = b"\x80\x05K\x07."
    bad = snap_block_prefix(KG, 1) + snap_entry_head(0, b"k", b"", len(value) + 50) + value
    data = _snap(bad)
    verify_snapshot(data, SNAP)  # integrity holds
    store = LocalBlobStore(str(tmp_path / "store"))
    store.put(SNAP, data)
    cache = LocalFileCache(str(tmp_path / "cache"))
    storage = ChangelogStorage(store=store)
    try:
        for table in ("heap", "lmdb"):
            with pytest.raises(CorruptObjectError) as info:
                restore_backend([snapshot_handle(SNAP, len(data))], storage,
                                KeyGroupRange(0, MP - 1), table=table, cache=cache,
                                options=OPTIONS, local_directory=str(tmp_path / table),
                                auto_materialize=False).close()
            assert info.value.key == SNAP
    finally:
        cache.close()
        storage.close()
