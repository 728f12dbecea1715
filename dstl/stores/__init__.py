"""The storage seam and every store behind it, plus :func:`open_store`, which picks one from a
base URI.

- :mod:`dstl.stores.base` — the :class:`BlobStore` protocol, :class:`ObjectInfo`,
  :func:`check_key` and the one error-translation place (:func:`translate_error`,
  :func:`is_retryable`);
- :mod:`dstl.stores.memory` — :class:`MemoryBlobStore`, the reference implementation;
- :mod:`dstl.stores.local` — :class:`LocalBlobStore`;
- :mod:`dstl.stores.fsspec_store` — :class:`FsspecBlobStore`.

=====================  ====================================================================
``base_uri``           store
=====================  ====================================================================
plain path, file://    :class:`LocalBlobStore` (temp file + fsync + atomic link + dir fsync)
memory://              :class:`FsspecBlobStore` over fsspec's memory filesystem (process-wide)
s3://, s3a://          :class:`FsspecBlobStore` over ``s3fs.S3FileSystem``
hdfs://host:port/path  :class:`FsspecBlobStore` over fsspec's Arrow HDFS filesystem
``filesystem=fs``      :class:`FsspecBlobStore` over the given filesystem (wrappers, fakes)
=====================  ====================================================================

Retries on S3: DSTL's own loops are the ones that count (the upload scheduler for writes, with
its attempt limit and per-attempt timeout; :class:`FsspecBlobStore` for reads). Left at their
defaults, botocore (3-5 attempts) inside s3fs (5 attempts) inside DSTL would multiply attempts and
stretch a failure far past DSTL's deadlines, so unless ``storage_options`` says otherwise s3fs
makes one attempt (``retries=1``) and botocore one (``total_max_attempts=1``), with connect/read
timeouts of a few seconds. Listing caches are off (``use_listings_cache=False``): other processes
write to the same bucket.

Credentials live in ``storage_options`` or the standard AWS chain; they never reach a message,
``location``, a log line or a ``repr``.
"""

from __future__ import annotations

import copy
import os
import urllib.parse
from typing import Any, TypeVar

import fsspec

from dstl.errors import ConfigError
from dstl.stores.base import BlobStore, ObjectInfo, check_key, is_retryable, translate_error
from dstl.stores.fsspec_store import FsspecBlobStore
from dstl.stores.local import LocalBlobStore
from dstl.stores.memory import MemoryBlobStore

__all__ = ["SUPPORTED_SCHEMES", "BlobStore", "FsspecBlobStore", "LocalBlobStore",
           "MemoryBlobStore", "ObjectInfo", "check_key", "is_retryable", "open_store",
           "translate_error"]

SUPPORTED_SCHEMES = ("file", "memory", "s3", "s3a", "hdfs")
_SUPPORTED_TEXT = ("a local path or a URI with one of the schemes "
                   + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES))

#: s3fs's own retry loop (its default is 5): one attempt, DSTL retries.
S3_DEFAULT_RETRIES = 1
#: botocore settings merged under the caller's ``config_kwargs``: one attempt per call, and
#: timeouts short enough for a stuck connection to surface well within DSTL's upload timeout.
S3_DEFAULT_CONFIG_KWARGS: dict[str, Any] = {
    "retries": {"total_max_attempts": 1, "mode": "standard"},
    "connect_timeout": 5,
    "read_timeout": 30,
}


def open_store(base_uri: str, storage_options: dict[str, Any] | None = None,
               filesystem: fsspec.AbstractFileSystem | None = None, *,
               validate: bool = True) -> BlobStore:
    """Open the blob store for ``base_uri``.

    Args:
        base_uri: a local path, or a ``file://``, ``memory://``, ``s3://``/``s3a://`` or
            ``hdfs://`` URI; with ``filesystem``, a path (or URL) that filesystem understands.
        storage_options: passed to the fsspec filesystem (for S3: ``key``, ``secret``,
            ``token``, ``profile``, ``client_kwargs={"endpoint_url": ...}``, ``config_kwargs``,
            and ``retries`` for s3fs's own loop). Not copied into messages or logs.
        filesystem: an fsspec filesystem to use instead of one built from the URI. The caller
            keeps owning it.
        validate: check right away that the root is reachable and usable (S3: the bucket exists
            and the credentials work; local: the directory can be created and written), so a
            bad bucket or missing credentials fail before any data is written.

    Returns:
        The store.

    Raises:
        ConfigError: unsupported scheme, malformed URI, credentials embedded in the URI, or
            ``storage_options`` given together with ``filesystem``.
        AccessDeniedError: (with ``validate``) missing or wrong credentials, no such bucket, or
            a directory that cannot be written. The message names the bucket/path and the fix.
    """
    if not isinstance(base_uri, str) or not base_uri:
        raise ConfigError("base_uri", base_uri, _SUPPORTED_TEXT, owner="open_store")
    if filesystem is not None:
        return _open_injected(filesystem, base_uri, storage_options, validate)
    if "://" not in base_uri:
        return _open_local(base_uri, validate)
    return _open_url(base_uri, storage_options, validate)


def _open_injected(filesystem: fsspec.AbstractFileSystem, base_uri: str,
                   storage_options: dict[str, Any] | None, validate: bool) -> FsspecBlobStore:
    if storage_options:
        raise ConfigError("storage_options", "<given>", "None when filesystem= is given "
                          "(configure the filesystem itself)", owner="open_store")
    injected = FsspecBlobStore(filesystem, base_uri, location=_redact(base_uri))
    return _validated(injected) if validate else injected


def _open_url(base_uri: str, storage_options: dict[str, Any] | None,
              validate: bool) -> BlobStore:
    """A store for a ``scheme://`` URI: the scheme picks it."""
    parts = urllib.parse.urlsplit(base_uri)
    scheme = parts.scheme.lower()
    if parts.username is not None or parts.password is not None:
        raise ConfigError("base_uri", _redact(base_uri), "a URI without user info; pass "
                          "credentials in storage_options", owner="open_store")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError("base_uri", base_uri, "file:///absolute/path (no host)",
                              owner="open_store")
        return _open_local(urllib.parse.unquote(parts.path), validate)
    store: FsspecBlobStore
    if scheme == "memory":
        store = FsspecBlobStore(fsspec.filesystem("memory"), base_uri,
                                location=base_uri.rstrip("/"))
    elif scheme in ("s3", "s3a"):
        store = _open_s3(scheme, parts, storage_options)
    elif scheme == "hdfs":
        store = _open_hdfs(parts, storage_options)
    else:
        raise ConfigError("base_uri", _redact(base_uri), _SUPPORTED_TEXT, owner="open_store")
    return _validated(store) if validate else store


def _open_local(path: str, validate: bool) -> LocalBlobStore:
    if not path:
        raise ConfigError("base_uri", path, "a non-empty directory path", owner="open_store")
    store = LocalBlobStore(os.path.expanduser(path))
    return _validated(store) if validate else store


def _open_s3(scheme: str, parts: urllib.parse.SplitResult,
             storage_options: dict[str, Any] | None) -> FsspecBlobStore:
    import s3fs  # imported lazily: only S3 users pay for aiobotocore

    bucket = parts.netloc
    if not bucket:
        raise ConfigError("base_uri", f"{scheme}://{parts.path}", f"{scheme}://bucket/prefix",
                          owner="open_store")
    prefix = parts.path.strip("/")
    root = f"{bucket}/{prefix}" if prefix else bucket
    opts = dict(storage_options or {})
    retries = int(opts.pop("retries", S3_DEFAULT_RETRIES))  # s3fs attribute, not an init arg
    # Copied deeply because botocore rewrites config_kwargs["retries"] in place and the
    # caller's dict must stay as it was (the rest may hold objects such as a session).
    config_kwargs = copy.deepcopy(opts.get("config_kwargs") or {})
    for name, value in S3_DEFAULT_CONFIG_KWARGS.items():
        config_kwargs.setdefault(name, copy.deepcopy(value))
    opts["config_kwargs"] = config_kwargs
    opts.setdefault("use_listings_cache", False)
    opts["skip_instance_cache"] = True  # never share an instance (and its credentials) by token
    fs = s3fs.S3FileSystem(**opts)
    fs.retries = retries
    return FsspecBlobStore(fs, root, location=f"{scheme}://{root}", bucket=bucket)


def _open_hdfs(parts: urllib.parse.SplitResult,
               storage_options: dict[str, Any] | None) -> FsspecBlobStore:
    # Not exercised by the test suite (no HDFS here): kept to the minimum fsspec needs.
    host = parts.hostname or "default"  # "default": fs.defaultFS from the Hadoop configuration
    try:
        port = parts.port or 0
    except ValueError as exc:
        raise ConfigError("base_uri", parts.geturl(), "hdfs://host:port/path with a numeric "
                          "port", owner="open_store") from exc
    opts = {**(storage_options or {}), "skip_instance_cache": True}
    fs = fsspec.filesystem("hdfs", host=host, port=port, **opts)
    location = f"hdfs://{parts.netloc}{parts.path}".rstrip("/")
    return FsspecBlobStore(fs, parts.path or "/", location=location)


_S = TypeVar("_S", LocalBlobStore, FsspecBlobStore)


def _validated(store: _S) -> _S:
    try:
        store.validate()
    except BaseException:
        store.close()  # nothing may stay open behind a failed open_store
        raise
    return store


def _redact(uri: str) -> str:
    """``uri`` without user info (``s3://key:secret@bucket`` -> ``s3://***@bucket``)."""
    if "://" not in uri or "@" not in uri.split("://", 1)[1].split("/", 1)[0]:
        return uri
    scheme, rest = uri.split("://", 1)
    netloc, sep, path = rest.partition("/")
    return f"{scheme}://***@{netloc.rpartition('@')[2]}{sep}{path}"
