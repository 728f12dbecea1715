"""The state of one split as stored bytes: snapshot entries, with the log after them applied —
the reader's own replay, which creates no backend and no writer.

Theory of operation
-------------------
A split's state is its handle's snapshots (narrowed to the key groups their owner owns, as
:func:`restore.plan_restore` decides) plus the log after them. When that log is empty for the
split, the snapshot entries *are* the state: :func:`stream_snapshots` yields them as they are
decoded, block by block, and nothing is kept. Otherwise :class:`StateImage` holds every entry
of the split as its **stored form** — the bytes a snapshot block or an LMDB table holds, keyed
by ``(state name, key group, key bytes, namespace bytes)`` — loads the snapshots into it and
replays the log on those bytes through the op table a restore uses
(:func:`materializer.changes.apply_op`, on stored bytes as an LMDB table does: ``CLEAR``
removes, ``SET``/``SET_INTERNAL`` store the payload, list appends append framed element bytes,
map operations decode the map, change it and encode it again, and an emptied map is removed).
Values are decoded once, when
the split's rows are produced. States are identified by name — state ids are per snapshot and
per log (a handle's metadata records map its ids), exactly as a restore maps them.

A v2 (file-level) snapshot — an LMDB data file, what LMDB backends and the executor agent write
by default — is fetched whole, verified, decompressed into a temporary directory and read key
group by key group (``materializer.lmdb_files.iter_key_groups``); its entries are the same stored
forms.

Compared with restoring a backend (:func:`~dstl.reader.state.restored`, kept for
``table="lmdb"``), nothing is decoded twice and no table structure is built; the model tests
(``tests/unit/dstl/reader/test_state_reader.py``) hold both to the job's dict model.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dstl.envelope import HEADER_SIZE
from dstl.errors import CorruptObjectError, StateError, UsageError
from dstl.handle import ChangelogHandle
from dstl.keygroups import META_KEY_GROUP, KeyGroupRange
from dstl.stores.base import BlobStore
from materializer.changes import (
    OPS_BY_KIND,
    READS_CURRENT,
    apply_op,
    decode_change,
    decode_metadata,
)
from materializer.codecs import codec_by_name
from materializer.delta_format import DeltaReader
from materializer.file_snapshot import (
    FileSnapshotLayout,
    read_file_snapshot_layout,
    verify_file_snapshot,
)
from materializer.handles import SnapshotRef
from materializer.lmdb_files import iter_key_groups
from materializer.local_dirs import OwnDirectory, executor_local_dir
from materializer.state_tables import BlobRangeSource, SnapshotReader
from materializer.states import StateShape
from restore.file_restore import StagedSnapshot, is_file_snapshot, read_at, stage_file_snapshot
from restore.leasing import LeasingCache, ObjectLease
from restore.reader import ChangelogReader, verify_snapshot
from restore.restore import check_delta_piece

__all__ = ["Ident", "LeaseSource", "StateImage", "StateInfo", "decompressed_file_snapshot",
           "file_snapshot", "file_snapshot_states", "snapshot_states", "state_info",
           "stream_snapshots"]

#: The directory a v2 snapshot is decompressed into: ``<prefix><pid>-<random>`` (an own
#: directory, :mod:`materializer.local_dirs`) under the executor's local directory.
READER_SNAPSHOT_PREFIX = "dstl-reader-snapshot-"

#: (state name, key group, key bytes, namespace bytes)
Ident = tuple[str, int, bytes, bytes]


@dataclass(frozen=True, slots=True)
class StateInfo:
    """A state as its metadata describes it."""

    name: str
    kind: str
    shape: StateShape
    #: an internal index of the backend (``"raw": true`` in its metadata, e.g. the timer
    #: service's ``$timer_index``): raw bytes with no codecs, which the reader does not show
    raw: bool = False


def state_info(meta: Any, allow_pickle: bool, where: str) -> StateInfo:
    """A state from its metadata record (``where`` names the object for errors)."""
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) \
            or meta.get("kind") not in ("value", "list", "map", "reducing", "aggregating"):
        raise CorruptObjectError(where, 0, f"state metadata {meta!r:.200} has no valid name/kind")
    codec = codec_by_name(meta.get("value_codec") or "safe", allow_pickle=allow_pickle)
    kc = meta.get("key_codec")
    key_codec = codec_by_name(kc, allow_pickle=allow_pickle) if kc else None
    return StateInfo(meta["name"], meta["kind"], StateShape(meta["kind"], codec, key_codec),
                     meta.get("raw") is True)


def snapshot_states(reader: SnapshotReader, allow_pickle: bool) -> dict[int, StateInfo]:
    """A v1 snapshot's states by state id."""
    try:
        states = json.loads(reader.metadata)["states"]
        if not isinstance(states, dict):
            raise TypeError("states is not an object")
        return {int(sid): state_info(meta, allow_pickle, reader.key) for sid, meta in states.items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptObjectError(reader.key, 0, f"snapshot metadata is not DSTL's: {exc}") from exc


class LeaseSource:
    """A snapshot's bytes through a restore cache lease (one verified download per cache)."""

    def __init__(self, lease: ObjectLease) -> None:
        self._lease = lease

    def size(self) -> int:
        return self._lease.size

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self._lease.read(offset, length))


def stream_snapshots(store: BlobStore, refs: Iterable[SnapshotRef], key_groups: KeyGroupRange,
                     allow_pickle: bool, cache: LeasingCache | None = None
                     ) -> Iterator[tuple[StateInfo, int, bytes, bytes, bytes]]:
    """``(state, key group, key bytes, namespace bytes, stored value)`` of every entry of the
    snapshots in ``key_groups`` (each narrowed to its ``ref.key_groups``), block by block:
    ranged reads, or through ``cache``. Full snapshots only: a delta changes entries already
    yielded, so a chain with deltas is read through :meth:`StateImage.load` (a delta here is an
    ``UnsupportedFormatError``)."""
    for ref in refs:
        wanted = key_groups.intersection(ref.key_groups)
        if not len(wanted):
            continue
        if is_file_snapshot(store.get_range(ref.key, 0, HEADER_SIZE)):
            yield from _file_snapshot_entries(store, ref, wanted, allow_pickle, cache)
            continue
        with block_snapshot(store, ref, allow_pickle, cache) as (reader, states):
            for kg, block in reader.read(wanted.intersection(reader.key_groups)):
                for sid, kb, nb, vb in block:
                    info = states.get(sid)
                    if info is None:
                        raise CorruptObjectError(ref.key, 0, f"entry of state id {sid}, which "
                                                             "the snapshot's metadata does not "
                                                             "name")
                    yield info, kg, kb, nb, vb


@contextlib.contextmanager
def block_snapshot(store: BlobStore, ref: SnapshotRef, allow_pickle: bool,
                   cache: LeasingCache | None
                   ) -> Iterator[tuple[SnapshotReader, dict[int, StateInfo]]]:
    """A v1 (key-group block) snapshot open for reading: its reader and its states, read by
    ranged reads or, with ``cache``, from a lease held until the block exits."""
    lease = cache.lease(store, ref.key, verify=verify_snapshot) if cache else None
    try:
        source = LeaseSource(lease) if lease else BlobRangeSource(store, ref.key, ref.size)
        reader = SnapshotReader(source, key=ref.key)
        yield reader, snapshot_states(reader, allow_pickle)
    finally:
        if lease is not None:
            lease.release()


@contextlib.contextmanager
def file_snapshot(store: BlobStore, ref: SnapshotRef, cache: LeasingCache | None
                  ) -> Iterator[tuple[Callable[[int, int], bytes], int, FileSnapshotLayout]]:
    """A v2 (file-level) snapshot's bytes (a ranged reader and the size) and its checked layout:
    through ``cache`` — one verified download per cache, shared by every split of the process
    that needs the object (the slices of one partition) — or with one GET verified here.

    A v2 object is one zstd frame of an LMDB file: no key group of it can be read without the
    whole object, so a split that needs one key group (a key filter) still fetches it whole;
    the key groups are narrowed when the decompressed file is read."""
    if cache is None:
        read, size = read_at(store, ref.key)
        yield read, size, verify_file_snapshot(read, size, key=ref.key)
        return
    lease = cache.lease(store, ref.key, verify=verify_snapshot)  # the object crc, checked once
    try:
        def read_lease(offset: int, length: int) -> bytes:
            return bytes(lease.read(offset, length))

        yield read_lease, lease.size, read_file_snapshot_layout(read_lease, lease.size,
                                                                key=ref.key)
    finally:
        lease.release()


def file_snapshot_states(ref: SnapshotRef, layout: FileSnapshotLayout, allow_pickle: bool
                         ) -> dict[int, StateInfo]:
    """A v2 snapshot's states by state id."""
    try:
        return {int(sid): state_info(meta, allow_pickle, ref.key)
                for sid, meta in layout.meta.states.items()}
    except (ValueError, TypeError) as exc:
        raise CorruptObjectError(ref.key, 0, f"snapshot metadata is not DSTL's: {exc}") from exc


@contextlib.contextmanager
def opened_file_snapshot(store: BlobStore, ref: SnapshotRef, wanted: KeyGroupRange,
                         allow_pickle: bool, cache: LeasingCache | None
                         ) -> Iterator[tuple[Callable[[int, int], bytes], FileSnapshotLayout,
                                             KeyGroupRange, dict[int, StateInfo]] | None]:
    """A v2 (file-level) snapshot opened for reading the key groups in ``wanted``: the object
    read whole and verified (:func:`file_snapshot`). Yields ``(read, layout, owned key groups,
    states by id)`` — the data is decompressed by the caller, which checks zstd's content
    checksum and the raw size — or None when the snapshot holds none of ``wanted``."""
    with file_snapshot(store, ref, cache) as (read, _, layout):
        owned = wanted.intersection(layout.meta.key_groups)
        if not len(owned):
            yield None
            return
        yield read, layout, owned, file_snapshot_states(ref, layout, allow_pickle)


@contextlib.contextmanager
def staged_file(prefix: str = READER_SNAPSHOT_PREFIX) -> Iterator[str]:
    """The path of a new ``data.mdb`` in an own directory under the executor's local directory,
    removed on exit: pid-stamped and locked, so what a process killed while it reads leaves
    (a decompressed LMDB file) the next read removes."""
    own = OwnDirectory.create(prefix, executor_local_dir())
    try:
        yield os.path.join(own.path, "data.mdb")
    finally:
        own.remove()


@contextlib.contextmanager
def decompressed_file_snapshot(store: BlobStore, ref: SnapshotRef, wanted: KeyGroupRange,
                               allow_pickle: bool, cache: LeasingCache | None
                               ) -> Iterator[tuple[StagedSnapshot, KeyGroupRange,
                                                   dict[int, StateInfo]] | None]:
    """A v2 (file-level) snapshot opened for reading the key groups in ``wanted``
    (:func:`opened_file_snapshot`), its LMDB file decompressed into a temporary directory and
    validated whole as a restore stages it (:func:`restore.file_restore.stage_file_snapshot`),
    removed on exit. Yields ``(staged snapshot, owned key groups, states by id)``, or None when
    the snapshot holds none of ``wanted`` (nothing is decompressed then)."""
    with opened_file_snapshot(store, ref, wanted, allow_pickle, cache) as opened:
        if opened is None:
            yield None
            return
        read, layout, owned, states = opened
        with staged_file() as path:
            yield (stage_file_snapshot(ref, read, layout.size, os.path.dirname(path),
                                       verified=True), owned, states)


def _file_snapshot_entries(store: BlobStore, ref: SnapshotRef, wanted: KeyGroupRange,
                           allow_pickle: bool, cache: LeasingCache | None
                           ) -> Iterator[tuple[StateInfo, int, bytes, bytes, bytes]]:
    """The entries of a v2 (file-level) snapshot in ``wanted``
    (:func:`decompressed_file_snapshot`), read key group by key group, in the stored form a v1
    block holds."""
    with decompressed_file_snapshot(store, ref, wanted, allow_pickle, cache) as opened:
        if opened is None:
            return
        staged, owned, states = opened
        for kg, entries in iter_key_groups(staged.directory, owned, key=ref.key):
            for sid, kb, nb, vb in entries:
                info = states.get(sid)
                if info is None:
                    raise CorruptObjectError(ref.key, 0, f"entry of state id {sid}, which the "
                                                         "snapshot's metadata does not name")
                yield info, kg, kb, nb, vb


class StateImage:
    """A split's entries as stored bytes, with the log applied (see the module docstring)."""

    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.states: dict[str, StateInfo] = {}
        self.entries: dict[Ident, bytes] = {}

    def known(self, info: StateInfo, where: str) -> StateInfo:
        """Register ``info`` (the first registration of a name wins); a state met with another
        kind is a :class:`~dstl.errors.StateError`."""
        had = self.states.setdefault(info.name, info)
        if had.kind != info.kind:
            raise StateError(f"state {info.name!r} is a {had.kind} state in one part of the "
                             f"checkpoint and a {info.kind} state in {where}")
        return had

    def load(self, store: BlobStore, refs: Sequence[SnapshotRef], key_groups: KeyGroupRange,
             cache: LeasingCache | None = None, *, max_parallelism: int | None = None) -> None:
        """Add the snapshot entries of ``key_groups``, piece by piece in order: a full
        snapshot's entries, then a delta's puts and tombstones on top of them — each delta
        checked to be the piece the chain names, as a restore checks it
        (:func:`restore.restore.check_delta_piece`; ``max_parallelism``: the checkpoint's,
        needed when ``refs`` hold a delta)."""
        entries = self.entries
        for i, ref in enumerate(refs):
            if ref.delta:
                if max_parallelism is None:
                    raise UsageError("StateImage.load: a chain with deltas needs the "
                                     "checkpoint's max_parallelism")
                self._load_delta(store, ref, key_groups, cache, refs[:i], max_parallelism)
                continue
            for info, kg, kb, nb, vb in stream_snapshots(store, (ref,), key_groups,
                                                         self.allow_pickle, cache):
                name = self.known(info, "a snapshot").name
                entries[(name, kg, kb, nb)] = vb

    def _load_delta(self, store: BlobStore, ref: SnapshotRef, key_groups: KeyGroupRange,
                    cache: LeasingCache | None, earlier: Sequence[SnapshotRef],
                    max_parallelism: int) -> None:
        """A delta's entries of ``key_groups`` over the entries loaded so far (read and checked
        as a restore reads it: :class:`~materializer.delta_format.DeltaReader`)."""
        wanted = key_groups.intersection(ref.key_groups)
        if not len(wanted):
            return
        lease = cache.lease(store, ref.key, verify=verify_snapshot) if cache else None
        try:
            source = LeaseSource(lease) if lease else BlobRangeSource(store, ref.key, ref.size)
            reader = DeltaReader(source, key=ref.key)
            check_delta_piece(ref, reader.meta, reader.metadata_offset, earlier,
                              max_parallelism)
            names = {int(sid): self.known(state_info(m, self.allow_pickle, ref.key),
                                          "a delta").name
                     for sid, m in reader.meta.states.items()}
            entries = self.entries
            for kg, _, block in reader.read(wanted):
                for sid, kb, nb, vb in block:
                    if vb is None:
                        entries.pop((names[sid], kg, kb, nb), None)
                    else:
                        entries[(names[sid], kg, kb, nb)] = vb
        finally:
            if lease is not None:
                lease.release()

    def replay(self, reader: ChangelogReader, handle: ChangelogHandle,
               key_groups: Container[int]) -> int:
        """Apply the changes of ``handle`` in ``key_groups``; returns how many were applied."""
        n = 0
        for ident, info, op, payload in self.changes(reader, handle, key_groups):
            self.apply(ident, info, op, payload)
            n += 1
        return n

    def changes(self, reader: ChangelogReader, handle: ChangelogHandle,
                key_groups: Container[int]) -> Iterator[tuple[Ident, StateInfo, int, bytes]]:
        """``(ident, state, op, payload)`` of every change of ``handle`` in ``key_groups``, in
        log order (states registered as their metadata records are met)."""
        return self.decode(reader.read(handle, key_groups=key_groups), handle.log_id)

    def decode(self, records: Iterable[tuple[int, bytes]], log_id: str
               ) -> Iterator[tuple[Ident, StateInfo, int, bytes]]:
        """:meth:`changes` of ``(key group, payload)`` records of the log ``log_id``."""
        names: dict[int, StateInfo] = {}  # this log's state ids
        for kg, payload in records:
            if kg == META_KEY_GROUP:
                sid, meta = decode_metadata(payload)
                names[sid] = self.known(state_info(meta, self.allow_pickle, log_id),
                                        f"the log of {log_id}")
                continue
            ch = decode_change(payload)
            info = names.get(ch.state_id)
            if info is None:
                raise CorruptObjectError(f"<changelog of {log_id}>", 0,
                                         f"change for state id {ch.state_id} before its "
                                         "metadata record")
            yield (info.name, kg, ch.key, ch.namespace), info, ch.op, ch.payload

    def apply(self, ident: Ident, info: StateInfo, op: int, payload: bytes) -> None:
        """Apply one change to the entry ``ident`` (the op table,
        :func:`materializer.changes.apply_op`, on stored bytes: the LMDB table's semantics).

        Raises:
            CorruptObjectError: an op that is not one of the state's kind, or a payload that
                does not decode.
        """
        if op not in OPS_BY_KIND[info.kind]:
            raise CorruptObjectError("<changelog>", 0, f"op code {op} on {info.kind} state "
                                                       f"{info.name!r}")
        entries = self.entries
        new = apply_op(op, info.shape, entries.get(ident) if op in READS_CURRENT else None,
                       payload, objects=False)
        if new is None:
            entries.pop(ident, None)
        else:
            entries[ident] = new

    def rows(self) -> Iterator[tuple[StateInfo, int, bytes, bytes, bytes]]:
        """``(state, key group, key bytes, namespace bytes, stored value)`` of every entry."""
        states = self.states
        for (name, kg, kb, nb), vb in self.entries.items():
            yield states[name], kg, kb, nb, vb

