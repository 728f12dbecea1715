"""A read-only view of a blob store: the reader's guarantee that it never writes.

Every reader path (the state reader, the change feed, ``dstl verify``, ``dstl state dump``) opens
the store through :class:`ReadOnlyBlobStore`. Restoring a split goes through the same
:func:`~restore.restore_backend` as a job's restore, which builds a backend with a changelog
writer; on this store any write — an upload, a snapshot, a delete — is refused with a
:class:`~dstl.errors.UsageError` instead of reaching the job's store. Reads are passed through.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from dstl.checks import check_mapping
from dstl.errors import ConfigError, UsageError
from dstl.layout import MANIFEST_PREFIX, SEGMENT_PREFIX, SNAPSHOT_PREFIX
from dstl.options import DstlOptions
from dstl.reader.errors import NoStoreError
from dstl.retry import RetryPolicy
from dstl.stores import LocalBlobStore, check_store_uri, open_store
from dstl.stores.base import BlobStore, ObjectInfo

if TYPE_CHECKING:
    import fsspec

__all__ = ["ReadOnlyBlobStore", "open_read_only", "require_store"]

#: The prefixes only DSTL writes (:mod:`dstl.layout`): a root with an object below one of them is
#: a DSTL store.
STORE_PREFIXES: tuple[str, ...] = (MANIFEST_PREFIX, SEGMENT_PREFIX, SNAPSHOT_PREFIX)
#: What a Spark streaming query keeps in its checkpointLocation.
_SPARK_CHECKPOINT_PREFIXES = ("offsets/", "commits/")
#: Entries of a local root a refusal names.
_SHOWN_ENTRIES = 5


class ReadOnlyBlobStore:
    """Reads of ``store``; ``put`` and ``delete`` raise.

    Args:
        store: the store to read.
        owned: close ``store`` when this view is closed (``False``: the caller closes it).
    """

    def __init__(self, store: BlobStore, *, owned: bool = False) -> None:
        self._store = store
        self._owned = owned
        self.location = store.location

    @property
    def inner(self) -> BlobStore:
        """The wrapped store."""
        return self._store

    def put(self, key: str, data: bytes) -> None:
        raise UsageError(f"put {self.location}/{key}: refused — the state reader opens the store "
                         "read-only and never writes")

    def delete(self, keys: Iterable[str]) -> None:
        raise UsageError(f"delete under {self.location}: refused — the state reader opens the "
                         "store read-only and never deletes")

    def get(self, key: str) -> bytes:
        return self._store.get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self._store.get_range(key, offset, length)

    def head(self, key: str) -> ObjectInfo | None:
        return self._store.head(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self._store.list(prefix)

    def close(self) -> None:
        if self._owned:
            self._store.close()

    def __enter__(self) -> ReadOnlyBlobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_read_only(state_uri: str | os.PathLike[str],
                   storage_options: Mapping[str, Any] | None = None, *,
                   retry: RetryPolicy | None = None,
                   filesystem: fsspec.AbstractFileSystem | None = None) -> ReadOnlyBlobStore:
    """Open ``state_uri`` (any URI :func:`dstl.stores.open_store` takes) read-only; closing the
    view closes the store. Nothing is written to validate it (a local directory must exist).

    Reads retry as a job's restore reads do: the store is opened by the same
    :func:`~dstl.stores.open_store` with the policy a job's storage uses,
    ``RetryPolicy.for_store(DstlOptions())`` (``read_max_attempts`` attempts, jittered backoff,
    ``retry_deadline_s``), and the store classifies failures (transient, throttled, permanent)
    the same way. Local directories do not retry (as for a job).

    Args:
        state_uri: the job's ``state_uri``.
        storage_options: the filesystem's options (S3 credentials, endpoint, ...).
        retry: another read policy (e.g. ``RetryPolicy.for_store(options)`` of the job's
            ``DstlOptions``).
        filesystem: an fsspec filesystem to read ``state_uri`` with (``open_store``'s seam).

    Raises:
        ConfigError: a malformed URI (``dstl.stores.check_store_uri``), unsupported scheme or
            options.
        ConfigError: a local directory that does not exist (a usage error: exit 2 in the CLI).
    """
    policy = retry if retry is not None else RetryPolicy.for_store(DstlOptions())
    if filesystem is not None:
        return ReadOnlyBlobStore(open_store(state_uri, storage_options, filesystem,
                                            validate=False, retry=policy), owned=True)
    state_uri = check_store_uri(state_uri, storage_options, owner="open_read_only",
                                field="state_uri")
    storage_options = check_mapping(storage_options, "storage_options", "open_read_only")
    local = _local_path(state_uri)
    if local is not None and not os.path.isdir(local):
        raise ConfigError("state_uri", local, "an existing directory", owner="open_read_only",
                          fix="the directory does not exist; pass the state_uri the job "
                              "writes to")
    return ReadOnlyBlobStore(open_store(state_uri, storage_options, validate=False,
                                        retry=policy), owned=True)


def _local_path(uri: str) -> str | None:
    if "://" not in uri:
        return os.path.expanduser(uri) if uri else None
    parts = urllib.parse.urlsplit(uri)
    return urllib.parse.unquote(parts.path) if parts.scheme.lower() == "file" else None


def require_store(store: ReadOnlyBlobStore) -> None:
    """Refuse a root that is not a DSTL store.

    A root is a DSTL store when it holds at least one object below ``checkpoints/``, ``dstl/``
    or ``snapshots/`` (:data:`STORE_PREFIXES`, :mod:`dstl.layout`) — a manifest, a segment or a
    snapshot; a job's store has one as soon as its first upload is done, before any checkpoint.
    An empty directory or prefix (a mistyped ``state_uri``, or a job that has uploaded nothing
    yet), a Spark checkpoint directory or a directory of other files is not. A store without a
    checkpoint passes (it lists nothing).

    Raises:
        NoStoreError: not a DSTL store; the message says what is there (a Spark checkpoint, the
            first entries of a local directory, nothing) and the fix.
    """
    if any(_holds(store, prefix) for prefix in STORE_PREFIXES):
        return
    fix = ("pass the state_uri the job writes to (a DSTL store holds objects below "
           + ", ".join(STORE_PREFIXES[:-1]) + f" or {STORE_PREFIXES[-1]})")
    if all(_holds(store, prefix) for prefix in _SPARK_CHECKPOINT_PREFIXES):
        raise NoStoreError(store.location, "it holds a Spark checkpoint (offsets/, commits/)",
                           "pass the operator's state_uri, not the query's checkpointLocation")
    inner = store.inner
    if isinstance(inner, LocalBlobStore):
        raise NoStoreError(store.location, _local_entries(inner.location), fix)
    raise NoStoreError(store.location, "nothing is stored below its checkpoints/, dstl/ or "
                       "snapshots/ (a mistyped bucket or prefix?)", fix)


def _holds(store: ReadOnlyBlobStore, prefix: str) -> bool:
    return next(iter(store.list(prefix)), None) is not None


def _local_entries(root: str) -> str:
    """What a local directory that is not a store holds: nothing, or its first entries."""
    with os.scandir(root) as it:
        names = sorted(e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in it)
    if not names:
        return "it is empty"
    shown = ", ".join(names[:_SHOWN_ENTRIES])
    more = f", ... {len(names)} entries" if len(names) > _SHOWN_ENTRIES else ""
    return f"it holds other files ({shown}{more})"
