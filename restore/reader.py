"""``ChangelogReader``: read back the changes a :class:`~dstl.ChangelogHandle` names.

Without a cache, every change set is fetched with one ranged read of exactly its record
``[offset, offset + length)`` and verified on its own (record CRC, zstd checksum, log id and sqn),
so reading one writer's change sets never downloads other writers' data. Adjacent records of the
same segment are coalesced into one ranged read.

With a cache (any :class:`~restore.leasing.LeasingCache`: :class:`~restore.cache.LocalFileCache`,
or the Spark executor agent's ``AgentCache``; wrapped in :class:`SegmentCache`), each segment
is leased whole: the first lease of the cache downloads it and verifies every byte with
:func:`~dstl.segment.decode_segment`, later leases (of this or any other reader sharing the cache)
read the local file. All consecutive change sets of a handle in one segment are read under one
lease, and each record is still verified on its own when decoded (so a local file damaged after
download is detected too).

Either way, changes come out in sqn order per handle, and within a change set by key group
(metadata first) in append order.

A cache that lives in another process cannot be handed a function, so the verify functions are
also named: :data:`VERIFIERS` maps ``"segment"`` and ``"snapshot"`` to :func:`verify_segment` and
:func:`verify_snapshot`.
"""

from __future__ import annotations

import functools
from collections.abc import Container, Iterator
from typing import Protocol, cast

from dstl.errors import ObjectNotFoundError, TruncatedObjectError, UsageError
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.segment import (
    DEFAULT_MAX_CHANGE_SET_BYTES,
    body_blocks,
    decode_record,
    decode_segment,
    iter_body_changes,
)
from dstl.stores.base import BlobStore
from restore.leasing import LeasingCache, Verify

__all__ = ["VERIFIERS", "ChangelogReader", "RecordSource", "SegmentCache", "StorageLike",
           "segment_verifier", "snapshot_verifier", "verify_segment", "verify_snapshot"]

#: Coalesce records of one segment into one ranged read while the gap between them is this small.
_MAX_GAP_BYTES = 64 * 1024


class StorageLike(Protocol):
    """What a reader needs of a :class:`~dstl.ChangelogStorage`: its store."""

    @property
    def store(self) -> BlobStore: ...


class RecordSource(Protocol):
    """Where record bytes come from: direct ranged reads, or the restore cache.

    A source may set ``whole_object = True`` to receive every consecutive ref of one segment in
    one call, whatever the gaps between them (it reads the object whole anyway).
    """

    def read_records(self, key: str, refs: list[ChangeSetRef]) -> list[bytes]: ...


class _DirectSource:
    whole_object = False

    def __init__(self, store: BlobStore) -> None:
        self._store = store

    def read_records(self, key: str, refs: list[ChangeSetRef]) -> list[bytes]:
        start = refs[0].offset
        end = max(r.offset + r.length for r in refs)
        blob = self._store.get_range(key, start, end - start)
        if len(blob) < end - start:
            raise TruncatedObjectError(key, start + len(blob), end - start, len(blob),
                                       f"change-set records at bytes [{start}, {end})")
        return [blob[r.offset - start:r.offset - start + r.length] for r in refs]


def verify_segment(data: bytes | memoryview, key: str, *,
                   max_change_set_bytes: int | None = None) -> None:
    """``verify`` for :meth:`LocalFileCache.lease`: check every byte of a segment (one record
    at a time: at most one change set of at most ``max_change_set_bytes`` is held at once).

    Raises:
        CorruptObjectError: naming the segment and the offset of the first problem.
    """
    decode_segment(data, key, max_change_set_bytes=max_change_set_bytes)


def verify_snapshot(data: bytes | memoryview, key: str, *,
                    max_block_bytes: int | None = None) -> None:
    """``verify`` for :meth:`LocalFileCache.lease`: check every byte of a snapshot object
    (v1 and v3, the delta: object CRC, index, every block, one block at a time, nothing kept;
    v2, file level: object CRC, footer, metadata).

    Raises:
        CorruptObjectError: naming the snapshot and the offset of the first problem.
    """
    # imported here: the materializer package loads the state tables, which reading the log
    # alone does not need
    from materializer.delta_format import DELTA_VERSION, verify_delta_object
    from materializer.file_snapshot import (
        FILE_SNAPSHOT_VERSION,
        snapshot_version,
        verify_file_snapshot,
    )
    from materializer.snapshot_format import verify_snapshot_object

    version = snapshot_version(bytes(data[:8]))
    if version == DELTA_VERSION:
        verify_delta_object(data, key=key, max_block_bytes=max_block_bytes)
        return
    if version == FILE_SNAPSHOT_VERSION:
        # v2 (file level): the object crc over every byte and the structure; the data's zstd
        # checksum and size are checked when the restore decompresses it
        view = memoryview(data)
        verify_file_snapshot(lambda off, n: bytes(view[off:off + n]), len(view), key=key)
        return
    verify_snapshot_object(data, key=key, max_block_bytes=max_block_bytes)


def segment_verifier(max_change_set_bytes: int | None) -> Verify:
    """:func:`verify_segment` with a limit: the named function itself for the default (so a
    cache in another process can run it), else a partial (in-process caches only)."""
    if max_change_set_bytes is None or max_change_set_bytes == DEFAULT_MAX_CHANGE_SET_BYTES:
        return verify_segment
    return functools.partial(verify_segment, max_change_set_bytes=max_change_set_bytes)


def snapshot_verifier(max_block_bytes: int | None) -> Verify:
    """:func:`verify_snapshot` with a limit (see :func:`segment_verifier`)."""
    from materializer.snapshot_format import DEFAULT_MAX_SNAPSHOT_BLOCK_BYTES

    if max_block_bytes is None or max_block_bytes == DEFAULT_MAX_SNAPSHOT_BLOCK_BYTES:
        return verify_snapshot
    return functools.partial(verify_snapshot, max_block_bytes=max_block_bytes)


#: The verify functions by name, so that a cache in another process (the executor agent's) can be
#: told which one to run; a callable not in here cannot be used with such a cache.
VERIFIERS: dict[str, Verify] = {"segment": verify_segment, "snapshot": verify_snapshot}


class SegmentCache:
    """A :class:`RecordSource` that reads segments through a cache's leases.

    Args:
        cache: the process's :class:`~restore.cache.LocalFileCache`, or any
            :class:`~restore.leasing.LeasingCache`.
        store: the store the segments live in.
    """

    whole_object = True

    def __init__(self, cache: LeasingCache, store: BlobStore, *,
                 max_change_set_bytes: int | None = None) -> None:
        self._cache = cache
        self._store = store
        self._verify = segment_verifier(max_change_set_bytes)

    def read_records(self, key: str, refs: list[ChangeSetRef]) -> list[bytes]:
        """Read the records ``refs`` of segment ``key`` under one lease of the whole object.

        Raises:
            ObjectNotFoundError: the segment is missing.
            CorruptObjectError: the segment fails verification (nothing is cached), or a record
                lies outside it.
            CacheFullError: the segment cannot be cached and the cache is not in direct mode.
        """
        with self._cache.lease(self._store, key, verify=self._verify) as lease:
            return [lease.read(r.offset, r.length) for r in refs]


class ChangelogReader:
    """Reads change sets named by handles.

    Args:
        storage: a :class:`~dstl.ChangelogStorage` (or anything with a ``store`` attribute), or a
            :class:`~dstl.stores.base.BlobStore`.
        cache: a :class:`~restore.cache.LocalFileCache` or any other
            :class:`~restore.leasing.LeasingCache` (an object with ``lease(store, key, *,
            verify=None, size_hint=None)``; each segment is read whole, once per cache), any
            :class:`RecordSource`, or ``None`` to read ranges directly from the store.
        max_change_set_bytes: the limit on one change-set body
            (``DstlOptions.max_change_set_bytes``; default the format's).

    Raises:
        UsageError: ``cache`` has neither ``lease`` nor ``read_records``.
    """

    def __init__(self, storage: StorageLike | BlobStore,
                 cache: LeasingCache | RecordSource | None = None, *,
                 max_change_set_bytes: int | None = None) -> None:
        # a storage has a store; a store has none (both are protocols: no isinstance)
        store = cast(BlobStore, getattr(storage, "store", storage))
        self._max = max_change_set_bytes
        self._source: RecordSource
        if cache is None:
            self._source = _DirectSource(store)
        elif callable(getattr(cache, "lease", None)):
            self._source = SegmentCache(cast(LeasingCache, cache), store,
                                        max_change_set_bytes=max_change_set_bytes)
        elif callable(getattr(cache, "read_records", None)):
            self._source = cast(RecordSource, cache)
        else:
            raise UsageError(f"ChangelogReader(cache={cache!r}): expected a cache with "
                             "lease(store, key, *, verify=None, size_hint=None) (such as "
                             "LocalFileCache), an object with read_records(key, refs), or None")
        self._whole_object = bool(getattr(self._source, "whole_object", False))

    def read(self, handle: ChangelogHandle, key_groups: Container[int] | None = None
             ) -> Iterator[tuple[int, bytes]]:
        """Yield ``(key_group, payload)`` of every change in the handle, in sqn order.

        Args:
            handle: what to read.
            key_groups: keep only these key groups (metadata, key group -1, is always kept).

        Raises:
            ObjectNotFoundError: a segment is missing (names the segment and the writer).
            CorruptObjectError: a record fails verification, or holds a change outside the
                writer's key-group range (names segment and offset).
            CacheFullError: (with a cache) a segment cannot be cached.
        """
        for _ref, kg, payload in self.read_located(handle, key_groups):
            yield kg, payload

    def read_located(self, handle: ChangelogHandle, key_groups: Container[int] | None = None
                     ) -> Iterator[tuple[ChangeSetRef, int, bytes]]:
        """:meth:`read`, each change with the reference of its change set (where it lies).

        Every change must lie in the writer's key-group range (``handle.key_groups``) or be
        metadata, and in the range recorded for its change set (the reference's ``kg_min``/
        ``kg_max``, when it has them), whether ``key_groups`` keeps it or not.

        Raises:
            CorruptObjectError: as :meth:`read`, and for a change outside the writer's range
                (names the segment and the record's offset).
        """
        log_range = (handle.key_groups.start, handle.key_groups.end)
        for ref, record in self._records(handle):
            body = decode_record(record, key=ref.key, offset=ref.offset, log_id=handle.log_id,
                                 sqn=ref.sqn, max_change_set_bytes=self._max)
            recorded = (None if ref.kg_min is None or ref.kg_max is None
                        else (ref.kg_min, ref.kg_max))
            for kg, payload in iter_body_changes(body, key=ref.key, offset=ref.offset,
                                                 key_groups=key_groups, log_range=log_range,
                                                 recorded=recorded):
                yield ref, kg, payload

    def read_blocks(self, handle: ChangelogHandle, key_groups: Container[int] | None = None
                    ) -> Iterator[tuple[ChangeSetRef, bytes, list[tuple[int, int, int]]]]:
        """Each change set of the handle, in sqn order, as its verified body and its key-group
        blocks ``(key_group, start, end)`` (:func:`~dstl.segment.body_blocks`): what the bulk
        replay applies, one block at a time. Same checks and errors as :meth:`read` (a block
        outside the writer's range or its reference's recorded range is corrupt, kept or not);
        the changes' own framing is checked by whoever parses the blocks."""
        log_range = (handle.key_groups.start, handle.key_groups.end)
        for ref, record in self._records(handle):
            body = decode_record(record, key=ref.key, offset=ref.offset, log_id=handle.log_id,
                                 sqn=ref.sqn, max_change_set_bytes=self._max)
            recorded = (None if ref.kg_min is None or ref.kg_max is None
                        else (ref.kg_min, ref.kg_max))
            yield ref, body, body_blocks(body, key=ref.key, offset=ref.offset,
                                         key_groups=key_groups, log_range=log_range,
                                         recorded=recorded)

    def _records(self, handle: ChangelogHandle) -> Iterator[tuple[ChangeSetRef, bytes]]:
        refs = list(handle.change_sets)
        i = 0
        while i < len(refs):
            # a run of refs in the same segment (for ranged reads: ascending and close together)
            j = i + 1
            while j < len(refs) and refs[j].key == refs[i].key and (
                    self._whole_object
                    or refs[j - 1].offset + refs[j - 1].length <= refs[j].offset
                    <= refs[j - 1].offset + refs[j - 1].length + _MAX_GAP_BYTES):
                j += 1
            run = refs[i:j]
            try:
                records = self._source.read_records(run[0].key, run)
            except ObjectNotFoundError as exc:
                raise ObjectNotFoundError(
                    f"segment {run[0].key} named by writer {handle.log_id!r} (sqn {run[0].sqn}) "
                    "is missing; it was deleted early or never written — restore an earlier "
                    "checkpoint", key=run[0].key) from exc
            yield from zip(run, records)
            i = j
