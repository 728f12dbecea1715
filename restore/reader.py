"""``ChangelogReader``: read back the changes a :class:`~dstl.ChangelogHandle` names.

Without a cache, every change set is fetched with one ranged read of exactly its record
``[offset, offset + length)`` and verified on its own (record CRC, zstd checksum, log id and sqn),
so reading one writer's change sets never downloads other writers' data. Adjacent records of the
same segment are coalesced into one ranged read. Changes come out in sqn order, and within a change
set by key group (metadata first) in append order. With a cache (``restore.cache``), each segment
is fetched once per process and shared by all readers.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from typing import Any, Protocol

from dstl.blobstore import BlobStore
from dstl.errors import ObjectNotFoundError, TruncatedObjectError
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.segment import decode_record, iter_body_changes

__all__ = ["ChangelogReader"]

#: Coalesce records of one segment into one ranged read while the gap between them is this small.
_MAX_GAP_BYTES = 64 * 1024


class _StorageLike(Protocol):
    store: BlobStore


class RecordSource(Protocol):
    """Where record bytes come from: direct ranged reads, or the restore cache."""

    def read_records(self, key: str, refs: list[ChangeSetRef]) -> list[bytes]: ...


class _DirectSource:
    def __init__(self, store: BlobStore) -> None:
        self._store = store

    def read_records(self, key: str, refs: list[ChangeSetRef]) -> list[bytes]:
        start = refs[0].offset
        end = max(r.offset + r.length for r in refs)
        blob = self._store.get_range(key, start, end - start)
        if len(blob) < end - start:
            raise TruncatedObjectError(key, start + len(blob), end - start, len(blob),
                                       "ranged read of change-set records")
        return [blob[r.offset - start:r.offset - start + r.length] for r in refs]


class ChangelogReader:
    """Reads change sets named by handles.

    Args:
        storage: a :class:`~dstl.ChangelogStorage` (or anything with a ``store`` attribute), or a
            :class:`~dstl.blobstore.BlobStore`.
        cache: a restore cache offering ``read_records(key, refs)``; ``None`` reads ranges
            directly from the store.
    """

    def __init__(self, storage: Any, cache: RecordSource | None = None) -> None:
        store = getattr(storage, "store", storage)
        self._source: RecordSource = cache if cache is not None else _DirectSource(store)

    def read(self, handle: ChangelogHandle, key_groups: Container[int] | None = None
             ) -> Iterator[tuple[int, bytes]]:
        """Yield ``(key_group, payload)`` of every change in the handle, in sqn order.

        Args:
            handle: what to read.
            key_groups: keep only these key groups (metadata, key group -1, is always kept).

        Raises:
            ObjectNotFoundError: a segment is missing (names the segment and the writer).
            CorruptObjectError: a record fails verification (names segment and offset).
        """
        for ref, record in self._records(handle):
            body = decode_record(record, key=ref.key, offset=ref.offset, log_id=handle.log_id,
                                 sqn=ref.sqn)
            yield from iter_body_changes(body, key=ref.key, offset=ref.offset,
                                         key_groups=key_groups)

    def _records(self, handle: ChangelogHandle) -> Iterator[tuple[ChangeSetRef, bytes]]:
        refs = list(handle.change_sets)
        i = 0
        while i < len(refs):
            # a run of refs in the same segment, ascending and close together
            j = i + 1
            while (j < len(refs) and refs[j].key == refs[i].key
                   and refs[j - 1].offset + refs[j - 1].length <= refs[j].offset
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
