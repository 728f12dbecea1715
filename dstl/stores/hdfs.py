"""Blob store on HDFS through ``hdfs-native`` (a native client: no JVM, no libhdfs).

Identity: without Kerberos the client acts as ``HADOOP_USER_NAME`` of the process environment
(else the OS user), as Hadoop's own clients do; with
Kerberos, as the principal of the ticket cache or of ``kerberos_principal``/``kerberos_keytab``.

Theory of operation: a key maps to the file ``<root>/<key>``; the NameNode's namespace is the
index and the DataNodes hold the bytes.

- ``put`` writes the bytes to a temp file beside the final name
  (``.<basename>.<16 hex>.tmp``, created without overwrite, parents created), closes it (the
  NameNode completes the file once its blocks reached their minimal replication), then publishes
  it with ``rename(tmp, final)`` **without overwrite**: the NameNode performs the rename
  atomically and refuses it when ``final`` exists, so two writers of one key cannot both succeed
  (:class:`~dstl.errors.ObjectExistsError`; ``tests/integration/stores/test_hdfs.py`` races them).
  A create without overwrite is atomic as well, but it makes the name visible, empty and
  growing, while the bytes stream in; the rename publishes only a complete, closed file, so a
  reader (restore, ``dstl verify``, retention) never sees a partial object. A failed put removes
  its temp file; a writer killed in between leaves one, which HDFS keeps open under the dead
  client's lease until the lease's soft limit (60 s) passes. Temp names are never listed, and
  :meth:`HdfsBlobStore.remove_stale_temp_files` (run by :func:`dstl.stores.open_store`) removes
  those older than :data:`STALE_TEMP_S`.
- ``get``/``get_range`` read through one ``read`` of the file (its block locations); a ranged
  read is clamped to the file's length (the client refuses to read past the end).
  A file whose visible length is shorter than the NameNode's length is still being written by
  another client: a typed error, not a short read.
- ``head`` -> ``get_file_info``; ``list`` -> one recursive listing of the prefix's directory
  part, filtered by the string prefix; ``delete`` -> one non-recursive delete per key (a missing
  key is fine).

Retries: as in :mod:`dstl.stores.fsspec_store`, reads and deletes retry here on
:class:`~dstl.errors.TransientStorageError` as the :class:`~dstl.retry.RetryPolicy` says; writes
are the upload scheduler's to retry (each attempt its own object name). The client's own NameNode
failover loop (``dfs.client.failover.max.attempts``, 15 attempts and up to 15 s between them in
Hadoop, about three minutes against a NameNode that is down) is set to one pass over the
NameNodes unless the options say otherwise, so DSTL's deadlines hold. Every exception passes
through :func:`dstl.stores.base.translate_error`, which knows the NameNode's remote exceptions
(permission, safe mode, leases, standby) and the client's transport errors.
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final, TypeVar

from dstl.errors import (
    ClosedError,
    ConfigError,
    ConfigTypeError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    UnsafePathError,
)
from dstl.retry import RetryPolicy, call_with_retries
from dstl.stores.base import ObjectInfo, check_key, check_range, translate_error

__all__ = ["CLIENT_DEFAULTS", "NAME_SERVICE_DEFAULTS", "OPTIONS", "STALE_TEMP_S", "HdfsBlobStore", "open_hdfs"]

_log = logging.getLogger(__name__)

T = TypeVar("T")

#: Hadoop client settings DSTL sets unless ``config`` names them: one pass over the NameNodes
#: per call (DSTL's retry policy owns the retries and their deadline). For ``host:port`` URIs no
#: failover at all; for a name service as many failovers as it has NameNodes after the first
#: (``dfs.ha.namenodes.<ns>`` in ``config``; 1 when the XML files define it), 100 ms apart.
CLIENT_DEFAULTS: Final[Mapping[str, str]] = {"dfs.client.failover.max.attempts": "0"}
NAME_SERVICE_DEFAULTS: Final[Mapping[str, str]] = {"dfs.client.failover.sleep.base.millis": "100",
                                                   "dfs.client.failover.sleep.max.millis": "1000"}

#: The storage options of an ``hdfs://`` store (docs/deploy.md, "HDFS"): what each one does.
OPTIONS: Final[Mapping[str, str]] = {
    "config": "Hadoop client settings (a dict of str: str), over core-site.xml/hdfs-site.xml: "
              "name services, failover, dfs.client.* settings",
    "config_dir": "directory of core-site.xml and hdfs-site.xml; default: $HADOOP_CONF_DIR, "
                  "else $HADOOP_HOME/etc/hadoop",
    "kerberos_principal": "Kerberos principal (hadoop.security.authentication=kerberos)",
    "kerberos_keytab": "keytab of the principal",
    "kerberos_cache": "Kerberos credential cache (default: the KRB5CCNAME/default cache)",
    "replication": "replication of the objects DSTL writes (default: the cluster's "
                   "dfs.replication)",
    "block_size": "block size in bytes of the objects DSTL writes (default: the cluster's)",
}

#: A temp file older than this is a crashed writer's: far past HDFS's lease hard limit (1 h),
#: after which the NameNode itself closes the file.
STALE_TEMP_S: Final = 2 * 3600.0


def _is_temp(name: str) -> bool:
    """``.<basename>.<16 hex>.tmp``: a put's temp file."""
    if not (name.startswith(".") and name.endswith(".tmp")):
        return False
    stem = name[:-4]
    token = stem.rpartition(".")[2]
    return len(stem) > 18 and len(token) == 16 and all(c in "0123456789abcdef" for c in token)


def _check_options(storage_options: Mapping[str, Any]) -> dict[str, Any]:
    owner = "open_store"
    unknown = sorted(set(storage_options) - set(OPTIONS))
    if unknown:
        raise ConfigError("storage_options", unknown, "options of an hdfs:// store: "
                          + ", ".join(OPTIONS), owner=owner,
                          fix="Hadoop settings go in config={'dfs....': '...'}")
    opts = dict(storage_options)
    for name in ("config_dir", "kerberos_principal", "kerberos_keytab", "kerberos_cache"):
        if name in opts and not (isinstance(opts[name], str) and opts[name]):
            raise ConfigTypeError(f"storage_options[{name!r}]", opts[name], "a non-empty str",
                                  owner=owner)
    config = opts.get("config", {})
    if not isinstance(config, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str | int | bool) for k, v in config.items()):
        raise ConfigTypeError("storage_options['config']", config, "a dict of Hadoop setting "
                              "names to str values", owner=owner)
    for name in ("replication", "block_size"):
        value = opts.get(name)
        if value is not None and (type(value) is not int or value < 1):
            raise ConfigTypeError(f"storage_options[{name!r}]", value, "an int >= 1",
                                  owner=owner)
    return opts


def open_hdfs(parts: urllib.parse.SplitResult, storage_options: Mapping[str, Any] | None,
              retry: RetryPolicy | None) -> HdfsBlobStore:
    """The store of an ``hdfs://`` URI (:func:`dstl.stores.open_store` calls it).

    ``hdfs://host:port/path`` names one NameNode; ``hdfs://nameservice/path`` an HA name
    service defined in the configuration (``dfs.ha.namenodes.<ns>``,
    ``dfs.namenode.rpc-address.<ns>.<nn>``); ``hdfs:///path`` the configuration's
    ``fs.defaultFS``.

    Raises:
        ConfigError: an unknown option or one of the wrong type, a path that is not below the
            filesystem root, or the ``hdfs-native`` package missing.
    """
    try:
        import hdfs_native
    except ImportError as exc:
        raise ConfigError("base_uri", parts.geturl(), "hdfs:// with the 'hdfs-native' package "
                          "installed", owner="open_store",
                          fix="pip install 'dstl[hdfs]' (or hdfs-native) on the driver and every "
                              f"executor ({exc})") from exc
    opts = _check_options(storage_options or {})
    given = {k: str(v).lower() if isinstance(v, bool) else str(v)
             for k, v in opts.get("config", {}).items()}
    if parts.port is None and parts.hostname:
        namenodes = [n for n in given.get(f"dfs.ha.namenodes.{parts.hostname}", "").split(",")
                     if n.strip()]
        defaults = {**NAME_SERVICE_DEFAULTS,
                    "dfs.client.failover.max.attempts": str(max(1, len(namenodes) - 1))}
    else:
        defaults = dict(CLIENT_DEFAULTS)
    config = {**defaults, **given}
    url = f"hdfs://{parts.netloc}" if parts.netloc else None
    kwargs = {k: opts[k] for k in ("kerberos_principal", "kerberos_keytab", "kerberos_cache")
              if k in opts}
    try:
        client = hdfs_native.Client(url, config, opts.get("config_dir"), **kwargs)
    except Exception as exc:
        raise ConfigError("base_uri", parts.geturl(), "an hdfs:// URI the client can "
                          "resolve (host:port, a configured name service, or hdfs:/// with "
                          "fs.defaultFS set)", owner="open_store",
                          fix=f"hdfs-native said: {exc!s:.300}") from exc
    location = f"hdfs://{parts.netloc}{parts.path}".rstrip("/")
    return HdfsBlobStore(client, parts.path or "/", location=location, retry=retry,
                         replication=opts.get("replication"), block_size=opts.get("block_size"))


class HdfsBlobStore:
    """A :class:`~dstl.stores.base.BlobStore` on HDFS (see the module docstring).

    Args:
        client: an ``hdfs_native.Client`` connected to the NameNode (or name service).
        root: absolute path of the root directory; must not be ``/``.
        location: how the root is shown in messages (never credentials).
        retry: how reads and deletes retry (default: :class:`~dstl.retry.RetryPolicy`'s).
        replication, block_size: write options of the objects (``None``: the cluster's).
        clock, sleep, draw: time, waiting and jitter (tests inject them).

    Raises:
        ConfigError: ``root`` is the filesystem root or not absolute.
    """

    def __init__(self, client: Any, root: str, *, location: str | None = None,
                 retry: RetryPolicy | None = None, replication: int | None = None,
                 block_size: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 draw: Callable[[], float] = random.random) -> None:
        stripped = root.rstrip("/")
        if not stripped.startswith("/") or any(
                p in (".", "..") for p in stripped.split("/")):
            raise ConfigError("root", location or root, "an absolute directory below the HDFS "
                              "root (hdfs://namenode:port/dir)", owner="HdfsBlobStore")
        self._client: Any = client
        self._root = stripped
        self.location = location if location is not None else stripped
        self.retry = retry if retry is not None else RetryPolicy()
        self._replication = replication
        self._block_size = block_size
        self._clock = clock
        self._sleep = sleep
        self._draw = draw
        self._lock = threading.Lock()
        _log.info("opened HDFS blob store %s", self.location)

    def __repr__(self) -> str:
        return f"HdfsBlobStore({self.location!r})"

    # ------------------------------------------------------------------ BlobStore

    def put(self, key: str, data: bytes) -> None:
        """Write a new object, published whole by a rename without overwrite. Not retried here.

        Raises:
            ObjectExistsError: the key exists with other bytes (its content is unchanged).
            TransientStorageError: NameNode or DataNodes unreachable, safe mode: the attempt
                may be retried (by the caller, under another key).
            AccessDeniedError: HDFS refused the user.
            UnsafePathError: the key is not allowed.
        """
        client = self._open()
        path = self._path(key)
        directory, _, name = path.rpartition("/")
        tmp = f"{directory}/.{name}.{secrets.token_hex(8)}.tmp"
        from hdfs_native import WriteOptions

        options = WriteOptions(overwrite=False, create_parent=True)
        if self._replication is not None:
            options.replication = self._replication
        if self._block_size is not None:
            options.block_size = self._block_size
        try:
            writer = client.create(tmp, options)
            try:
                writer.write(data)
            finally:
                writer.close()
            client.rename(tmp, path, False)
        except Exception as exc:
            err = translate_error(exc, op="put", key=key, location=self.location)
            self._remove_temp(client, tmp, key)
            if isinstance(err, ObjectExistsError):
                self._check_own_landing(key, data, err)
                return
            raise err from exc

    def _remove_temp(self, client: Any, tmp: str, key: str) -> None:
        try:
            client.delete(tmp, False)
        except Exception as exc:  # noqa: BLE001 - any failure: the put's error is reported
            # The put's own error is the one to report; the temp file is removed later by
            # remove_stale_temp_files.
            _log.warning("put %s/%s: could not remove its temp file %s (%s); a later open "
                         "removes it", self.location, key, tmp, exc)

    def _check_own_landing(self, key: str, data: bytes, err: ObjectExistsError) -> None:
        """A write-once conflict: succeed if the object holds exactly ``data``, else raise."""
        try:
            existing = self.get(key)
        except ObjectNotFoundError:
            existing = None
        if existing != data:
            raise err
        _log.info("put %s/%s: the object already holds these exact bytes; the put succeeded",
                  self.location, key)

    def get(self, key: str) -> bytes:
        """Return the whole object.

        Raises:
            ObjectNotFoundError: no such object.
            StorageError: the file is still being written by another client.
            TransientStorageError: the retries ran out (NameNode or DataNodes unreachable).
        """
        return self._read_range("get", key, 0, None)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Return up to ``length`` bytes from ``offset``; fewer at the end of the object.

        Raises:
            ObjectNotFoundError: no such object.
            UsageError: negative offset or length.
        """
        check_range(self.location, key, offset, length)
        return self._read_range("get_range", key, offset, length)

    def _read_range(self, op: str, key: str, offset: int, length: int | None) -> bytes:
        client = self._open()
        path = self._path(key)

        def read() -> bytes:
            status = client.get_file_info(path)
            if status.isdir:
                raise FileNotFoundError(path)
            reader = client.read(path)
            size = len(reader)
            if size < status.length:
                raise StorageError(
                    f"{op} {self.location}/{key}: the file is still being written by another "
                    f"client ({size} of {status.length} bytes readable; its writer holds the "
                    "lease); DSTL publishes only closed files, so this one was not written by "
                    "DSTL or its writer died: wait for the lease to expire (60 s) or run "
                    f"`hdfs debug recoverLease -path {path}`", key=key)
            end = size if length is None else min(size, offset + length)
            if offset >= end:
                return b""
            return bytes(reader.read_range(offset, end - offset))

        return self._retrying(op, key, read)

    def head(self, key: str) -> ObjectInfo | None:
        """Return the object's size, or ``None`` if there is no file at ``key``."""
        client = self._open()
        path = self._path(key)

        def info() -> ObjectInfo | None:
            try:
                status = client.get_file_info(path)
            except FileNotFoundError:
                return None
            return None if status.isdir else ObjectInfo(key, int(status.length))

        return self._retrying("head", key, info)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects whose key starts with ``prefix`` (a string prefix), sorted; temp files of
        puts are not objects."""
        client = self._open()
        dir_part = prefix.rpartition("/")[0]
        if dir_part:
            check_key(dir_part)
        base = f"{self._root}/{dir_part}" if dir_part else self._root
        start = self._root + "/"

        def find() -> list[ObjectInfo]:
            try:
                statuses = list(client.list_status(base, True))
            except FileNotFoundError:
                return []
            found = []
            for status in statuses:
                full = status.path if status.path.startswith("/") else f"{base}/{status.path}"
                if status.isdir or not full.startswith(start):
                    continue
                key = full[len(start):]
                if key.startswith(prefix) and not _is_temp(key.rpartition("/")[2]):
                    found.append(ObjectInfo(key, int(status.length)))
            return found

        found = self._retrying("list", prefix or None, find)
        found.sort(key=lambda info: info.key)
        return iter(found)

    def delete(self, keys: Iterable[str]) -> None:
        """Remove objects; missing keys are fine. Every key is validated before any removal.

        Raises:
            TransientStorageError: the retries ran out (some keys may be gone, others not).
            AccessDeniedError: HDFS refused the user.
        """
        client = self._open()
        pairs = [(key, self._path(key)) for key in keys]
        for key, path in pairs:
            self._retrying("delete", key, self._deleter(client, path))

    @staticmethod
    def _deleter(client: Any, path: str) -> Callable[[], bool]:
        return lambda: bool(client.delete(path, False))

    def close(self) -> None:
        """Mark the store closed and drop the client (its connections close with it)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            _log.info("closed HDFS blob store %s", self.location)

    # ------------------------------------------------------------------ extras

    def validate(self) -> None:
        """Check that the NameNode answers and the user may use the root; remove stale temps.

        Raises:
            AccessDeniedError: the user may not traverse to the root.
            TransientStorageError: the NameNode did not answer (after the read retries).
        """
        client = self._open()

        def check() -> None:
            try:
                client.get_file_info(self._root)
            except FileNotFoundError:
                return
        self._retrying("open", None, check)
        self.remove_stale_temp_files()

    def remove_stale_temp_files(self, older_than_s: float = STALE_TEMP_S) -> int:
        """Remove the temp files of puts whose writers died, older than ``older_than_s``
        (by modification time); return how many. Live writers' temp files are younger."""
        client = self._open()

        def find() -> list[str]:
            try:
                statuses = list(client.list_status(self._root, True))
            except FileNotFoundError:
                return []
            now_ms = time.time() * 1000.0
            return [s.path for s in statuses if not s.isdir
                    and _is_temp(s.path.rpartition("/")[2])
                    and now_ms - s.modification_time > older_than_s * 1000.0]

        stale = self._retrying("open", None, find)
        for path in stale:
            self._retrying("delete", None, self._deleter(client, path))
        if stale:
            _log.info("removed %d stale temp files under %s", len(stale), self.location)
        return len(stale)

    # ------------------------------------------------------------------ internals

    def _open(self) -> Any:
        client = self._client
        if client is None:
            raise ClosedError(repr(self))
        return client

    def _path(self, key: str) -> str:
        check_key(key)
        if _is_temp(key.rpartition("/")[2]):
            raise UnsafePathError(key, "the name is reserved for HdfsBlobStore temp files")
        return f"{self._root}/{key}"

    def _retrying(self, op: str, key: str | None, fn: Callable[[], T]) -> T:
        return call_with_retries(
            fn, self.retry,
            translate=lambda exc: translate_error(exc, op=op, key=key, location=self.location),
            what=f"{op} {self.location}/{key or ''}", clock=self._clock, sleep=self._sleep,
            draw=self._draw)
