"""Blob store over any fsspec filesystem (S3 via s3fs, HDFS, memory, or an injected wrapper).

Theory of operation: a key maps to ``<root>/<key>`` in the filesystem's own path syntax
(``fs._strip_protocol`` normalises the root, so ``memory://x`` and ``/x`` are the same place).

- ``put`` -> ``fs.pipe_file(path, data, mode="create")`` when the filesystem's ``pipe_file`` takes
  a ``mode`` argument. s3fs maps ``mode="create"`` to a conditional PUT (``If-None-Match: *``), so
  write-once is enforced by the service; a concurrent second writer gets ``412`` ->
  :class:`~dstl.errors.ObjectExistsError`. fsspec's generic implementation (local, memory) checks
  existence first, which is not atomic; filesystems without ``mode`` get the same check here.
  DSTL never reuses an object name, so the check only guards against bugs — with one exception:
  the HTTP client under s3fs (aiohttp) resends an idempotent request (PUT is one) once by itself
  when a reused keep-alive connection breaks, also after the first copy landed, and that resend
  meets ``412``. So on ``ObjectExistsError`` the existing object is read back: the same bytes
  are this put's own earlier landing and the put succeeds; other bytes stay an error. Directory-based
  filesystems (fsspec local, HDFS) need the parent directory: when the write fails with "not
  found", the parent is created once and the write repeated.
- ``get``/``get_range`` -> ``cat_file`` (a ranged GET on S3); ``head`` -> ``info``; ``list`` ->
  ``find`` below the prefix's directory part, filtered by the string prefix; ``delete`` -> one
  batched ``rm`` (s3fs: DeleteObjects), falling back to per-key removal on filesystems that refuse
  a batch naming a missing path.

Retries: read-side operations (``get``, ``get_range``, ``head``, ``list``) and deletes are
retried here on :class:`~dstl.errors.TransientStorageError` as the :class:`~dstl.retry.RetryPolicy`
says (``read_max_attempts``, jittered exponential backoff, throttling bounded by
``retry_deadline_s``), because their callers (restore, the cache, retention, segment release) have
no retry loop of their own; a delete is idempotent, so repeating it is safe. Writes are NOT
retried here: the upload scheduler owns write retries, counts attempts and names each attempt's
object. The retry layers of s3fs and botocore below are set to one attempt each by
:func:`dstl.stores.open_store`, so this is the one layer that owns the budget. Every exception
passes through :func:`dstl.stores.base.translate_error`.
"""

from __future__ import annotations

import inspect
import logging
import random
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from dstl.errors import (
    AccessDeniedError,
    ClosedError,
    ConfigError,
    DstlError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    StoreUnreachableError,
    TransientStorageError,
)
from dstl.retry import RetryPolicy, call_with_retries
from dstl.stores.base import (
    ObjectInfo,
    check_key,
    check_range,
    connect_failure,
    translate_error,
)

if TYPE_CHECKING:  # imported where a filesystem is built: workers of a local store never pay for it
    import fsspec

__all__ = ["FsspecBlobStore"]

_log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long opening a store waits for a TCP connection to its endpoint: far above a healthy
#: handshake (milliseconds, a second across continents), far below a client library's retry
#: loop (gcsfs: about 30 s per call), so an endpoint that never answers fails in seconds.
PROBE_TIMEOUT_S = 10.0

#: Keys per ``rm`` call: S3's DeleteObjects limit.
_DELETE_BATCH = 1000


#: Azure filesystems (adlfs): ``overwrite=False`` is an ``If-None-Match: *`` upload.
_AZURE_PROTOCOLS = frozenset({"abfs", "abfss", "az"})


def write_once_primitive(fs: fsspec.AbstractFileSystem) -> str | None:
    """How ``fs`` creates an object only if absent, atomically in the service: ``"mode"``
    (``pipe_file(mode="create")``: s3fs's ``If-None-Match: *``, gcsfs's ``ifGenerationMatch=0``),
    ``"overwrite"`` (adlfs: ``overwrite=False``), or ``None`` (no such primitive: an existence
    check before the write, which is not atomic)."""
    try:
        params = inspect.signature(fs.pipe_file).parameters
    except (TypeError, ValueError):  # builtins or C callables without a signature
        return None
    if "mode" in params:
        return "mode"
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "overwrite" in params and _AZURE_PROTOCOLS.intersection(protocols):
        return "overwrite"
    return None


class FsspecBlobStore:
    """A :class:`~dstl.stores.base.BlobStore` over an fsspec filesystem (see the module docstring).

    Args:
        fs: the filesystem. Its credentials stay inside it; they never reach messages or logs.
        root: the root path (or URL) in ``fs``'s syntax, e.g. ``bucket/prefix`` for s3fs.
        location: how the root is shown in messages; defaults to ``root``. Never include
            credentials.
        retry: how reads and deletes retry (default: :class:`~dstl.retry.RetryPolicy`'s
            defaults, which are ``DstlOptions``'s).
        bucket: the bucket (or container) holding ``root``, if the filesystem has them;
            :meth:`validate` checks that it exists.
        clock, sleep, draw: time, waiting and the jitter's random numbers (tests inject them).

    Raises:
        ConfigError: ``root`` is the filesystem's root.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, location: str | None = None,
                 retry: RetryPolicy | None = None, bucket: str | None = None,
                 endpoint: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 draw: Callable[[], float] = random.random) -> None:
        stripped = str(fs._strip_protocol(root)).rstrip("/")
        if not stripped:
            raise ConfigError("root", location or root, "a directory or bucket below the "
                              "filesystem root", owner="FsspecBlobStore")
        self._fs: fsspec.AbstractFileSystem | None = fs
        self._root = stripped
        self.location = location if location is not None else root.rstrip("/")
        self.retry = retry if retry is not None else RetryPolicy()
        self._clock = clock
        self._sleep = sleep
        self._draw = draw
        self._bucket = bucket
        self._endpoint = endpoint
        self._create = write_once_primitive(fs)
        self._lock = threading.Lock()
        _log.info("opened fsspec blob store %s (%s, write-once via %s)", self.location,
                  type(fs).__name__, {"mode": "mode='create'", "overwrite": "overwrite=False"}
                  .get(self._create or "", "existence check"))

    def __repr__(self) -> str:
        return f"FsspecBlobStore({self.location!r})"

    @property
    def filesystem(self) -> fsspec.AbstractFileSystem:
        """The underlying filesystem (for diagnostics and tests)."""
        return self._open_fs()

    # ------------------------------------------------------------------ BlobStore

    def put(self, key: str, data: bytes) -> None:
        """Write a new object; fail if ``key`` holds other bytes. Not retried here.

        Raises:
            ObjectExistsError: the key exists with other bytes (its content is unchanged).
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
            if isinstance(err, ObjectExistsError):
                self._check_own_landing(key, data, err)
                return
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

    def _check_own_landing(self, key: str, data: bytes, err: ObjectExistsError) -> None:
        """A write-once conflict: succeed if the object holds exactly ``data`` (the HTTP client
        resent this put after its first copy landed), else raise ``err``."""
        try:
            existing = self.get(key)
        except ObjectNotFoundError:
            existing = None  # deleted in between: still not ours to overwrite
        if existing != data:
            raise err
        _log.info("put %s/%s: the object already holds these exact bytes (a resent request "
                  "whose first copy landed); the put succeeded", self.location, key)

    def get(self, key: str) -> bytes:
        """Return the whole object.

        Raises:
            ObjectNotFoundError: no such object (also a ``FileNotFoundError``).
            TransientStorageError: the retries ran out (see :mod:`dstl.retry`).
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
        check_range(self.location, key, offset, length)
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

        Retried like reads (a delete is idempotent).

        Raises:
            TransientStorageError: the retries ran out (some keys may be gone, others not).
        """
        fs = self._open_fs()
        pairs = [(key, self._path(key)) for key in keys]
        for i in range(0, len(pairs), _DELETE_BATCH):
            batch = pairs[i:i + _DELETE_BATCH]
            self._retrying("delete", batch[0][0], self._batch_deleter(fs, batch))

    def _batch_deleter(self, fs: fsspec.AbstractFileSystem,
                       batch: Sequence[tuple[str, str]]) -> Callable[[], None]:
        return lambda: self._delete_batch(fs, batch)

    def _delete_batch(self, fs: fsspec.AbstractFileSystem,
                      batch: Sequence[tuple[str, str]]) -> None:
        try:
            fs.rm([path for _, path in batch])
            return
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

        A store whose endpoint cannot be reached at all fails at once: a host name that does
        not resolve or a refused connection in this first request is not retried (nothing has
        worked yet: it is the configuration). :func:`dstl.stores.open_store` also probes a
        known endpoint (:func:`probe_endpoint`) before it builds the filesystem, whose client
        library may retry by itself for long. A failure after connecting (an error status, a
        reset) is retried as before.

        Raises:
            StoreUnreachableError: the endpoint's name does not resolve or it refuses
                connections.
            AccessDeniedError: missing credentials, no permission, or (S3) no such bucket.
            TransientStorageError: the store did not answer (retried like a read).
        """
        fs = self._open_fs()

        def translate(exc: BaseException) -> DstlError:
            why = connect_failure(exc)
            if why is None:
                return translate_error(exc, op="open", key=None, location=self.location)
            return _unreachable(self.location, self._endpoint or "its endpoint", why)

        call_with_retries(lambda: self._check_root(fs), self.retry, translate=translate,
                          what=f"open {self.location}", clock=self._clock, sleep=self._sleep,
                          draw=self._draw)

    def _check_root(self, fs: fsspec.AbstractFileSystem) -> None:
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
        if self._create == "mode":
            fs.pipe_file(path, data, mode="create")
            return
        if self._create == "overwrite":
            try:
                fs.pipe_file(path, data, overwrite=False)
            except Exception as exc:
                # older adlfs lets azure's ResourceExistsError through
                if type(exc).__name__ == "ResourceExistsError":
                    raise FileExistsError(path) from exc
                raise
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
        """Run a read-side call, retrying transient failures as the retry policy says."""
        return self._retrying(op, key, fn)

    def _retrying(self, op: str, key: str | None, fn: Callable[[], T]) -> T:
        return call_with_retries(
            fn, self.retry,
            translate=lambda exc: translate_error(exc, op=op, key=key, location=self.location),
            what=f"{op} {self.location}/{key or ''}", clock=self._clock, sleep=self._sleep,
            draw=self._draw)



def probe_endpoint(endpoint: str, location: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Open (and close) one TCP connection to ``endpoint`` (a URL), unless a proxy carries the
    traffic to it (``HTTPS_PROXY`` and the like: the client connects to the proxy instead).

    Raises:
        StoreUnreachableError: the host name does not resolve, the port refuses connections,
            the network has no route to it, or nothing answers within ``timeout_s``.
    """
    parts = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    host = parts.hostname
    if not host:
        return
    port = parts.port or (80 if parts.scheme == "http" else 443)
    proxies = urllib.request.getproxies()
    if (proxies.get(parts.scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(host):
        return
    where = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except socket.gaierror as exc:
        why = f"the host name does not resolve ({exc})"
    except ConnectionRefusedError as exc:
        why = f"the endpoint refused the connection ({exc})"
    except TimeoutError as exc:
        why = f"no answer within {timeout_s:g} s ({exc or 'timed out'})"
    except OSError as exc:
        why = f"no connection ({type(exc).__name__}: {exc})"
    raise _unreachable(location, where, why)


def _unreachable(location: str, endpoint: str, why: str) -> StoreUnreachableError:
    return StoreUnreachableError(
        f"open {location}: no connection to {endpoint} could be made: {why}. Nothing has "
        "worked yet, so nothing is retried: check the URI, the endpoint (storage_options' "
        "endpoint_url), that the service runs there, and that this machine reaches it "
        "(network, DNS, firewall; HTTPS_PROXY when a proxy is required)",
        location=location, endpoint=endpoint)
