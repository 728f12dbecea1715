"""Blob store over any fsspec filesystem (S3 via s3fs, HDFS, memory, or an injected wrapper).

Theory of operation: a key maps to ``<root>/<key>`` in the filesystem's own path syntax
(``fs._strip_protocol`` normalises the root, so ``memory://x`` and ``/x`` are the same place).

- ``put`` -> ``fs.pipe_file(path, data, mode="create")`` when the filesystem's ``pipe_file`` takes
  a ``mode`` argument. s3fs maps ``mode="create"`` to a conditional PUT (``If-None-Match: *``), so
  write-once is enforced by the service; a concurrent second writer gets ``412`` ->
  :class:`~dstl.errors.ObjectExistsError`. fsspec's generic implementation (local, memory) checks
  existence first, which is not atomic; filesystems without ``mode`` get the same check here.
  DSTL never reuses an object name, so the check only guards against bugs. Directory-based
  filesystems (fsspec local, HDFS) need the parent directory: when the write fails with "not
  found", the parent is created once and the write repeated.
- ``get``/``get_range`` -> ``cat_file`` (a ranged GET on S3); ``head`` -> ``info``; ``list`` ->
  ``find`` below the prefix's directory part, filtered by the string prefix; ``delete`` -> one
  batched ``rm`` (s3fs: DeleteObjects), falling back to per-key removal on filesystems that refuse
  a batch naming a missing path.

Retries: read-side operations (``get``, ``get_range``, ``head``, ``list``) are retried here on
:class:`~dstl.errors.TransientStorageError`, up to ``read_attempts`` attempts with a short backoff,
because their callers (restore, the cache) have no retry loop of their own. Writes and deletes are
NOT retried here: the upload scheduler owns write retries and counts attempts. Every exception
passes through :func:`dstl.stores.base.translate_error`.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar, cast

import fsspec

from dstl.errors import (
    AccessDeniedError,
    ClosedError,
    ConfigError,
    ObjectNotFoundError,
    StorageError,
    TransientStorageError,
    UsageError,
)
from dstl.stores.base import ObjectInfo, check_key, translate_error

__all__ = ["DEFAULT_READ_BACKOFF_S", "FsspecBlobStore"]

_log = logging.getLogger(__name__)

T = TypeVar("T")

#: Pause before read attempt 2, 3, ...: long enough to ride out a connection reset or a throttling
#: burst, short enough that a restore waiting on a dead store fails within a second.
DEFAULT_READ_BACKOFF_S: tuple[float, ...] = (0.05, 0.2)
#: Keys per ``rm`` call: S3's DeleteObjects limit.
_DELETE_BATCH = 1000


def _takes_mode(fs: fsspec.AbstractFileSystem) -> bool:
    try:
        return "mode" in inspect.signature(fs.pipe_file).parameters
    except (TypeError, ValueError):  # builtins or C callables without a signature
        return False


class FsspecBlobStore:
    """A :class:`~dstl.stores.base.BlobStore` over an fsspec filesystem (see the module docstring).

    Args:
        fs: the filesystem. Its credentials stay inside it; they never reach messages or logs.
        root: the root path (or URL) in ``fs``'s syntax, e.g. ``bucket/prefix`` for s3fs.
        location: how the root is shown in messages; defaults to ``root``. Never include
            credentials.
        read_attempts: attempts of each read-side operation (>= 1).
        read_backoff_s: pauses between read attempts; the last value repeats.
        bucket: the bucket (or container) holding ``root``, if the filesystem has them;
            :meth:`validate` checks that it exists.

    Raises:
        ConfigError: ``read_attempts`` < 1, or ``root`` is the filesystem's root.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, location: str | None = None,
                 read_attempts: int = 3,
                 read_backoff_s: Sequence[float] = DEFAULT_READ_BACKOFF_S,
                 bucket: str | None = None) -> None:
        if read_attempts < 1:
            raise ConfigError("read_attempts", read_attempts, "an integer >= 1",
                              owner="FsspecBlobStore")
        if not read_backoff_s or any(b < 0 for b in read_backoff_s):
            raise ConfigError("read_backoff_s", tuple(read_backoff_s),
                              "a non-empty sequence of delays >= 0", owner="FsspecBlobStore")
        stripped = str(fs._strip_protocol(root)).rstrip("/")
        if not stripped:
            raise ConfigError("root", location or root, "a directory or bucket below the "
                              "filesystem root", owner="FsspecBlobStore")
        self._fs: fsspec.AbstractFileSystem | None = fs
        self._root = stripped
        self.location = location if location is not None else root.rstrip("/")
        self._read_attempts = read_attempts
        self._backoff = tuple(read_backoff_s)
        self._bucket = bucket
        self._create_mode = _takes_mode(fs)
        self._lock = threading.Lock()
        _log.info("opened fsspec blob store %s (%s, write-once via %s)", self.location,
                  type(fs).__name__, "mode='create'" if self._create_mode else "existence check")

    def __repr__(self) -> str:
        return f"FsspecBlobStore({self.location!r})"

    @property
    def filesystem(self) -> fsspec.AbstractFileSystem:
        """The underlying filesystem (for diagnostics and tests)."""
        return self._open_fs()

    # ------------------------------------------------------------------ BlobStore

    def put(self, key: str, data: bytes) -> None:
        """Write a new object; fail if ``key`` exists. Not retried here.

        Raises:
            ObjectExistsError: the key exists (its content is unchanged).
            TransientStorageError: this attempt failed and may be retried by the caller (the
                object may or may not have been written).
            AccessDeniedError: credentials or bucket problem.
            UnsafePathError: the key is not allowed.
        """
        fs = self._open_fs()
        path = self._path(key)
        try:
            self._pipe(fs, path, data)
        except Exception as exc:
            err = translate_error(exc, op="put", key=key, location=self.location)
            if not isinstance(err, ObjectNotFoundError):
                raise err from exc
            # A directory-based filesystem is missing the parent directory (object stores never
            # get here): create it and write once more.
            try:
                fs.makedirs(path.rpartition("/")[0], exist_ok=True)
                self._pipe(fs, path, data)
            except Exception as exc2:
                raise translate_error(exc2, op="put", key=key,
                                      location=self.location) from exc2

    def get(self, key: str) -> bytes:
        """Return the whole object.

        Raises:
            ObjectNotFoundError: no such object (also a ``FileNotFoundError``).
            TransientStorageError: all ``read_attempts`` failed.
        """
        fs = self._open_fs()
        path = self._path(key)
        return self._read("get", key, lambda: cast(bytes, fs.cat_file(path)))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Return up to ``length`` bytes from ``offset``; fewer at the end of the object.

        Raises:
            ObjectNotFoundError: no such object.
            UsageError: negative offset or length.
        """
        if offset < 0 or length < 0:
            raise UsageError(f"get_range {self.location}/{key}: bad range offset={offset} "
                             f"length={length} (both must be >= 0)")
        fs = self._open_fs()
        path = self._path(key)
        if length == 0:
            # S3 ignores an empty range ("bytes=5-4") and returns the whole object.
            if self.head(key) is None:
                raise ObjectNotFoundError(f"get_range {self.location}/{key}: object not found",
                                          key=key)
            return b""
        try:
            return self._read("get_range", key, lambda: cast(
                bytes, fs.cat_file(path, start=offset, end=offset + length)))
        except (ObjectNotFoundError, AccessDeniedError, TransientStorageError):
            raise
        except StorageError:
            # S3 answers a range that starts at or past the end with 416; the contract says
            # "fewer bytes", so confirm that this is the reason before returning none.
            info = self.head(key)
            if info is not None and offset >= info.size:
                return b""
            raise

    def head(self, key: str) -> ObjectInfo | None:
        """Return the object's size, or ``None`` if there is no object at ``key``."""
        fs = self._open_fs()
        path = self._path(key)

        def info() -> dict[str, Any] | None:
            try:
                return cast(dict[str, Any], fs.info(path))
            except Exception as exc:
                err = translate_error(exc, op="head", key=key, location=self.location)
                if isinstance(err, ObjectNotFoundError):
                    return None
                raise err from exc

        found = self._read("head", key, info)
        if found is None or found.get("type") != "file":
            return None
        return ObjectInfo(key, int(found["size"]))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects whose key starts with ``prefix`` (a string prefix, not a directory), sorted."""
        fs = self._open_fs()
        dir_part = prefix.rpartition("/")[0]
        if dir_part:
            check_key(dir_part)  # the directory part is a path; it must stay below the root
        base = f"{self._root}/{dir_part}" if dir_part else self._root

        def find() -> dict[str, dict[str, Any]]:
            try:
                return cast(dict[str, dict[str, Any]], fs.find(base, detail=True))
            except Exception as exc:
                err = translate_error(exc, op="list", key=prefix or None,
                                      location=self.location)
                if isinstance(err, ObjectNotFoundError):
                    return {}  # a directory-based filesystem without that directory
                raise err from exc

        start = self._root + "/"
        found: list[ObjectInfo] = []
        for name, entry in self._read("list", prefix or None, find).items():
            if entry.get("type") != "file":
                continue
            full = str(fs._strip_protocol(entry.get("name", name)))
            if not full.startswith(start):
                continue
            key = full[len(start):]
            if key.startswith(prefix):
                found.append(ObjectInfo(key, int(entry["size"])))
        found.sort(key=lambda info: info.key)
        return iter(found)

    def delete(self, keys: Iterable[str]) -> None:
        """Remove objects; missing keys are fine. Every key is validated before any removal.

        Not retried here (the caller's cleanup is idempotent and may run again).
        """
        fs = self._open_fs()
        pairs = [(key, self._path(key)) for key in keys]
        for i in range(0, len(pairs), _DELETE_BATCH):
            batch = pairs[i:i + _DELETE_BATCH]
            try:
                fs.rm([path for _, path in batch])
                continue
            except Exception as exc:
                err = translate_error(exc, op="delete", key=batch[0][0], location=self.location)
                if not isinstance(err, ObjectNotFoundError):
                    raise err from exc
            # fsspec's generic rm() refuses the whole batch when one path is missing.
            for key, path in batch:
                try:
                    fs.rm_file(path)
                except Exception as exc:
                    err = translate_error(exc, op="delete", key=key, location=self.location)
                    if not isinstance(err, ObjectNotFoundError):
                        raise err from exc

    def close(self) -> None:
        """Mark the store closed and drop its reference to the filesystem.

        The filesystem itself is never closed here: an injected one belongs to the caller, and
        one made by :func:`dstl.stores.open_store` is referenced only by this store, so s3fs
        closes its HTTP session when it is collected.
        """
        with self._lock:
            fs, self._fs = self._fs, None
        if fs is not None:
            _log.info("closed fsspec blob store %s", self.location)

    # ------------------------------------------------------------------ extras

    def validate(self) -> None:
        """Check that the root is reachable with the configured credentials.

        An empty or not yet existing root is fine (object stores have no directories).

        Raises:
            AccessDeniedError: missing credentials, no permission, or (S3) no such bucket.
            TransientStorageError: the store did not answer.
        """
        fs = self._open_fs()
        if self._bucket is not None:
            # HeadBucket: proves both that the bucket exists and that the credentials work.
            try:
                fs.info(self._bucket)
            except Exception as exc:
                err = translate_error(exc, op="open", key=None, location=self.location)
                if isinstance(err, ObjectNotFoundError):
                    raise AccessDeniedError(
                        f"open {self.location}: bucket {self._bucket!r} does not exist or is "
                        "not visible with these credentials; create it, or fix base_uri or the "
                        "credentials in storage_options") from exc
                raise err from exc
            return
        try:
            fs.info(self._root)
        except Exception as exc:
            err = translate_error(exc, op="open", key=None, location=self.location)
            if not isinstance(err, ObjectNotFoundError):
                raise err from exc

    # ------------------------------------------------------------------ internals

    def _open_fs(self) -> fsspec.AbstractFileSystem:
        fs = self._fs
        if fs is None:
            raise ClosedError(repr(self))
        return fs

    def _path(self, key: str) -> str:
        return f"{self._root}/{check_key(key)}"

    def _pipe(self, fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
        if self._create_mode:
            fs.pipe_file(path, data, mode="create")
            return
        try:
            fs.info(path)
        except Exception as exc:
            err = translate_error(exc, op="put", key=None, location=self.location)
            if not isinstance(err, ObjectNotFoundError):
                raise err from exc
            fs.pipe_file(path, data)
            return
        raise FileExistsError(path)  # translated by put()

    def _read(self, op: str, key: str | None, fn: Callable[[], T]) -> T:
        """Run a read-side call, retrying transient failures with backoff."""
        for attempt in range(1, self._read_attempts + 1):
            try:
                return fn()
            except Exception as exc:
                err = translate_error(exc, op=op, key=key, location=self.location)
                if not isinstance(err, TransientStorageError) or attempt == self._read_attempts:
                    if attempt > 1:
                        _log.warning("%s %s/%s failed after %d attempts: %s", op, self.location,
                                     key or "", attempt, err)
                    raise err from exc
                delay = self._backoff[min(attempt - 1, len(self._backoff) - 1)]
                _log.debug("%s %s/%s attempt %d failed (%s); retrying in %.3fs", op,
                           self.location, key or "", attempt, err, delay)
                time.sleep(delay)
        raise AssertionError("unreachable: the last attempt returns or raises")

