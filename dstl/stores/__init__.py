"""The storage seam and every store behind it, plus :func:`open_store`, which picks one from a
base URI.

- :mod:`dstl.stores.base` — the :class:`BlobStore` protocol, :class:`ObjectInfo`,
  :func:`check_key` and the one error-translation place (:func:`translate_error`,
  :func:`is_retryable`);
- :mod:`dstl.stores.memory` — :class:`MemoryBlobStore`, the reference implementation;
- :mod:`dstl.stores.local` — :class:`LocalBlobStore`;
- :mod:`dstl.stores.fsspec_store` — :class:`FsspecBlobStore`;
- :mod:`dstl.stores.hdfs` — :class:`HdfsBlobStore`.

=====================  ====================================================================
``base_uri``           store
=====================  ====================================================================
plain path, file://    :class:`LocalBlobStore` (temp file + fsync + atomic link + dir fsync)
memory://              :class:`FsspecBlobStore` over fsspec's memory filesystem (process-wide)
s3://, s3a://          :class:`FsspecBlobStore` over ``s3fs.S3FileSystem``
hdfs://host:port/path  :class:`HdfsBlobStore` over ``hdfs-native`` (no JVM, no libhdfs); also
hdfs://nameservice/p   an HA name service from the configuration, ``hdfs:///path`` for
                       ``fs.defaultFS`` (options: :data:`dstl.stores.hdfs.OPTIONS`)
gs://, gcs://          :class:`FsspecBlobStore` over ``gcsfs`` (>= 2024.12: write-once through
                       ``ifGenerationMatch=0``)
abfs://, abfss://, az://  :class:`FsspecBlobStore` over ``adlfs`` (write-once through
                       ``overwrite=False``: an ``If-None-Match: *`` upload)
``filesystem=fs``      :class:`FsspecBlobStore` over the given filesystem (wrappers, fakes)
=====================  ====================================================================

Retries on S3: one layer owns the budget, DSTL's (the upload scheduler for writes, with its
attempt limit, per-attempt timeout and throttling backoff; :class:`FsspecBlobStore` for reads and
deletes; both follow :mod:`dstl.retry`, bounded by ``retry_deadline_s``). Left at their defaults,
botocore (3-5 attempts, its own backoff of up to 20 s) inside s3fs (5 attempts) inside DSTL would
multiply attempts and backoffs and stretch a failure far past DSTL's deadlines, so unless
``storage_options`` says otherwise s3fs makes one attempt (``retries=1``) and botocore one
(``total_max_attempts=1``), with connect/read timeouts of a few seconds. What stays below DSTL:
aiohttp resends an idempotent request (GET, HEAD, PUT, DELETE) once when a reused keep-alive
connection breaks, and s3fs sleeps 0.1 s after a failed attempt before raising; the first is why
:meth:`FsspecBlobStore.put` accepts its own bytes under an existing key. Listing caches are off
(``use_listings_cache=False``): other processes write to the same bucket.

Credentials live in ``storage_options`` or the standard AWS chain; they never reach a message,
``location``, a log line or a ``repr``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from dstl.checks import check_bool, check_instance, check_int, check_mapping
from dstl.errors import ConfigError, ConfigTypeError
from dstl.retry import RetryPolicy
from dstl.stores.base import (
    BlobStore,
    ObjectInfo,
    check_key,
    check_store,
    is_retryable,
    translate_error,
)
from dstl.stores.fsspec_store import FsspecBlobStore, probe_endpoint, write_once_primitive
from dstl.stores.hdfs import HdfsBlobStore, open_hdfs
from dstl.stores.local import LocalBlobStore
from dstl.stores.memory import MemoryBlobStore

if TYPE_CHECKING:  # imported where a filesystem is built: workers of a local store never pay for it
    import fsspec

__all__ = ["SUPPORTED_SCHEMES", "BlobStore", "FsspecBlobStore", "HdfsBlobStore", "LocalBlobStore",
           "MemoryBlobStore", "ObjectInfo", "check_key", "check_store", "check_store_uri",
           "is_retryable", "open_store", "parse_storage_options", "translate_error"]

SUPPORTED_SCHEMES = ("file", "memory", "s3", "s3a", "hdfs", "gs", "gcs", "abfs", "abfss", "az")
#: Azure URIs may name the account: ``abfs://container@account.dfs.core.windows.net/path``.
_AZURE_SCHEMES = ("abfs", "abfss", "az")
#: The first gcsfs whose ``pipe_file(mode="create")`` is a ``ifGenerationMatch=0`` upload.
GCSFS_MIN_VERSION = "2024.12.0"
#: RFC 3986 scheme syntax.
_SCHEME_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
#: A "path" starting like a URI scheme of two or more characters (one letter would be a
#: Windows drive, ``C:``).
_SCHEME_PREFIX_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")
#: A relative "path" that is a supported scheme missing its colon: ``s3//bucket/app``.
_SCHEME_WITHOUT_COLON_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+)//")
#: Bucket names: S3's rules plus the legacy characters (uppercase, ``_``) some stores allow.
_BUCKET_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
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


def open_store(base_uri: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None,
               filesystem: fsspec.AbstractFileSystem | None = None, *,
               validate: bool = True, retry: RetryPolicy | None = None) -> BlobStore:
    """Open the blob store for ``base_uri``.

    Args:
        base_uri: a local path (``str`` or ``os.PathLike``), or a ``file://``, ``memory://``,
            ``s3://``/``s3a://``, ``gs://``/``gcs://``, ``abfs://``/``abfss://``/``az://`` or
            ``hdfs://`` URI (form rules: :func:`check_store_uri`);
            with ``filesystem``, a path (or URL) that filesystem understands.
        storage_options: passed to the fsspec filesystem (for S3: ``key``, ``secret``,
            ``token``, ``profile``, ``client_kwargs={"endpoint_url": ...}``, ``config_kwargs``,
            and ``retries`` for s3fs's own loop; for HDFS: :data:`dstl.stores.hdfs.OPTIONS`).
            Not copied into messages or logs.
        filesystem: an fsspec filesystem to use instead of one built from the URI. The caller
            keeps owning it.
        validate: check right away that the root is reachable and usable (S3: the bucket exists
            and the credentials work; local: the directory can be created and written), so a
            bad bucket or missing credentials fail before any data is written.
        retry: how reads and deletes of a remote (fsspec) store retry; ``ChangelogStorage``
            passes ``RetryPolicy.for_store(options)``. Local stores do not retry.

    Returns:
        The store.

    Raises:
        ConfigError: unsupported scheme, malformed URI (also ``s3:/x``-like "paths"), a
            missing filesystem package (gcsfs, adlfs: named) or one without a write-once
            primitive, the ``hdfs-native`` package missing for ``hdfs://`` or an unknown
            ``hdfs://`` option,
            credentials embedded in the URI, ``storage_options`` for a store that takes none
            or together with ``filesystem``; ConfigTypeError: an argument of the wrong type.
        AccessDeniedError: (with ``validate``) missing or wrong credentials, no such bucket, or
            a directory that cannot be written. The message names the bucket/path and the fix.
        StoreUnreachableError: (with ``validate``) the endpoint cannot be reached at all: an
            S3 ``endpoint_url`` or GCS's endpoint refuses a TCP connection, does not resolve or
            does not answer (probed before the filesystem is built), or the first request
            cannot connect. Not retried; a 503 or a reset after connecting is.
    """
    owner = "open_store"
    storage_options = check_mapping(storage_options, "storage_options", owner)
    check_bool(validate, "validate", owner)
    if retry is not None:
        check_instance(retry, "retry", owner, RetryPolicy,
                       fix="pass dstl.retry.RetryPolicy.for_store(options), or None")
    if filesystem is not None:
        import fsspec

        check_instance(filesystem, "filesystem", owner, fsspec.AbstractFileSystem,
                       fix="pass an fsspec filesystem instance, or None to build one from "
                           "the URI")
        return _open_injected(filesystem, _uri_text(base_uri, owner), storage_options, validate,
                              retry)
    uri = check_store_uri(base_uri, storage_options, owner=owner)
    if "://" not in uri:
        return _open_local(uri, validate)
    return _open_url(uri, storage_options, validate, retry)


def check_store_uri(base_uri: object, storage_options: Mapping[str, Any] | None = None, *,
                    owner: str = "open_store", field: str = "base_uri") -> str:
    """``base_uri`` as a string if its form is one :func:`open_store` accepts — checked without
    touching any store (the Spark operator checks its ``state_uri`` on the driver this way) —
    and ``storage_options`` are given only to a store that takes them (not ``file://``,
    ``memory://`` or a path).

    A plain path is a local directory. Anything that starts like a URI scheme (``s3:``,
    ``file:``, ``ftp:``) must be a complete ``scheme://`` URI of a supported scheme: ``s3:/typo``
    or ``s3:bucket`` would otherwise become a local directory named ``s3:``, silently. So must a
    relative path that starts with a supported scheme's name and ``//`` (``s3//bucket/app``,
    ``hdfs//nn/x``: the colon forgotten); ``./s3//bucket`` says a local directory is meant.

    Raises:
        ConfigError: the form is wrong; the message names the supported forms and the fix
            (ConfigTypeError: not a string or path).
    """
    uri = _uri_text(base_uri, owner, field)
    if "://" not in uri:
        _check_not_a_broken_uri(uri, owner, field)
        _no_storage_options(storage_options, "a local path", owner)
        return uri
    scheme_text = uri.split("://", 1)[0]
    scheme = scheme_text.lower()
    if _SCHEME_RE.fullmatch(scheme_text) is None or scheme not in SUPPORTED_SCHEMES:
        raise ConfigError(field, _redact(uri), _SUPPORTED_TEXT, owner=owner,
                          fix=f"{scheme_text!r:.40} is not a supported scheme")
    parts = urllib.parse.urlsplit(uri)
    if parts.password is not None or (parts.username is not None
                                       and scheme not in _AZURE_SCHEMES):
        raise ConfigError(field, _redact(uri), "a URI without user info", owner=owner,
                          fix="pass credentials in storage_options")
    if parts.query or parts.fragment or uri.endswith(("?", "#")):
        raise ConfigError(field, _redact(uri), f"{scheme}://... without '?' or '#'",
                          owner=owner, fix="options go in storage_options, not in the URI")
    _check_uri_location(scheme, parts, uri, owner, field)
    if scheme in ("file", "memory"):
        _no_storage_options(storage_options, f"a {scheme}:// URI", owner)
    return uri


def _uri_text(base_uri: object, owner: str, field: str = "base_uri") -> str:
    """``base_uri`` (a ``str`` or ``os.PathLike``) as a string: non-empty, no control characters
    or surrounding whitespace."""
    expected = "a local path (str or os.PathLike) or " + _SUPPORTED_TEXT.removeprefix(
        "a local path or ")
    if isinstance(base_uri, os.PathLike):
        base_uri = os.fspath(base_uri)
    if not isinstance(base_uri, str):
        raise ConfigTypeError(field, base_uri, expected, owner=owner)
    if (not base_uri or base_uri != base_uri.strip()
            or any(ord(c) < 0x20 or ord(c) == 0x7F for c in base_uri)):
        raise ConfigError(field, _redact(base_uri), expected + ", without control characters "
                          "or surrounding whitespace", owner=owner)
    return base_uri


def _check_not_a_broken_uri(path: str, owner: str, field: str) -> None:
    """Refuse a "path" that starts like a URI scheme (``s3:/typo/app``, ``s3:bucket``,
    ``file:/x``, ``ftp:host``): a local directory of that name is never what was meant."""
    m = _SCHEME_PREFIX_RE.match(path)
    if m is None:
        m = _SCHEME_WITHOUT_COLON_RE.match(path)
        if m is None or m.group(1).lower() not in SUPPORTED_SCHEMES:
            return
    scheme, rest = m.group(1), path[m.end():]
    if scheme.lower() in SUPPORTED_SCHEMES:
        tail = rest.lstrip("/")
        hint = (f"did you mean file:///{tail}, or the plain path /{tail}?"
                if scheme.lower() == "file" else f"did you mean {scheme.lower()}://{tail}?")
    else:
        hint = f"{scheme!r:.40} is not a supported scheme."
    local = "has a colon" if ":" in m.group(0) else f"is {scheme!r}"
    raise ConfigError(field, _redact(path), _SUPPORTED_TEXT, owner=owner,
                      fix=f"{hint} A local directory whose name {local} is written ./{path}")


def _check_uri_location(scheme: str, parts: urllib.parse.SplitResult, uri: str, owner: str,
                        field: str) -> None:
    """The host and path rules of each scheme."""
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ConfigError(field, uri, "file:///absolute/path (no host)", owner=owner)
    elif scheme in ("s3", "s3a", "gs", "gcs"):
        if _BUCKET_RE.fullmatch(parts.netloc) is None:
            raise ConfigError(field, _redact(uri), f"{scheme}://bucket/prefix with a bucket "
                              "name of letters, digits, '.', '-' and '_'", owner=owner)
        segments = parts.path.strip("/").split("/") if parts.path.strip("/") else []
        if any(seg in ("", ".", "..") for seg in segments):
            raise ConfigError(field, _redact(uri), f"{scheme}://bucket/prefix without empty, "
                              "'.' or '..' path segments", owner=owner)
    elif scheme in _AZURE_SCHEMES:
        container = parts.username if parts.username is not None else parts.netloc
        if _BUCKET_RE.fullmatch(container or "") is None or (
                parts.username is not None and not parts.hostname):
            raise ConfigError(field, _redact(uri), f"{scheme}://container/path or "
                              f"{scheme}://container@account.dfs.core.windows.net/path",
                              owner=owner)
    elif scheme == "hdfs":
        try:
            parts.port  # noqa: B018 - parsing the port is the check
        except ValueError as exc:
            raise ConfigError(field, uri, "hdfs://host:port/path with a numeric port",
                              owner=owner) from exc


def _no_storage_options(storage_options: Mapping[str, Any] | None, what: str,
                        owner: str) -> None:
    if storage_options:
        raise ConfigError("storage_options", f"<{len(storage_options)} options>",
                          f"None or empty for {what}", owner=owner,
                          fix="storage_options configure s3://, gs://, abfs:// and hdfs:// stores; was the "
                              "URI meant to be one?")


def _open_injected(filesystem: fsspec.AbstractFileSystem, base_uri: str,
                   storage_options: dict[str, Any] | None, validate: bool,
                   retry: RetryPolicy | None) -> FsspecBlobStore:
    if storage_options:
        raise ConfigError("storage_options", "<given>", "None when filesystem= is given "
                          "(configure the filesystem itself)", owner="open_store")
    injected = FsspecBlobStore(filesystem, base_uri, location=_redact(base_uri), retry=retry)
    return _validated(injected) if validate else injected


def _open_url(base_uri: str, storage_options: dict[str, Any] | None,
              validate: bool, retry: RetryPolicy | None) -> BlobStore:
    """A store for a ``scheme://`` URI: the scheme picks it."""
    parts = urllib.parse.urlsplit(base_uri)
    scheme = parts.scheme.lower()
    if scheme == "file":
        return _open_local(urllib.parse.unquote(parts.path), validate)
    store: FsspecBlobStore
    if scheme == "memory":
        import fsspec

        store = FsspecBlobStore(fsspec.filesystem("memory"), base_uri,
                                location=base_uri.rstrip("/"), retry=retry)
    elif scheme in ("s3", "s3a"):
        store = _open_s3(scheme, parts, storage_options, retry, probe=validate)
    elif scheme in ("gs", "gcs"):
        store = _open_gcs(scheme, parts, storage_options, retry, probe=validate)
    elif scheme in _AZURE_SCHEMES:
        store = _open_azure(scheme, parts, storage_options, retry)
    else:
        hdfs = open_hdfs(parts, storage_options, retry)
        return _validated(hdfs) if validate else hdfs
    return _validated(store) if validate else store


def _open_local(path: str, validate: bool) -> LocalBlobStore:
    if not path:
        raise ConfigError("base_uri", path, "a non-empty directory path", owner="open_store")
    store = LocalBlobStore(os.path.expanduser(path))
    return _validated(store) if validate else store


def _open_s3(scheme: str, parts: urllib.parse.SplitResult,
             storage_options: dict[str, Any] | None, retry: RetryPolicy | None, *,
             probe: bool = False) -> FsspecBlobStore:
    """S3 through s3fs; with ``probe``, a given ``endpoint_url`` must accept a connection
    (:func:`~dstl.stores.fsspec_store.probe_endpoint`)."""
    import s3fs  # imported lazily: only S3 users pay for aiobotocore

    bucket = parts.netloc
    if not bucket:
        raise ConfigError("base_uri", f"{scheme}://{parts.path}", f"{scheme}://bucket/prefix",
                          owner="open_store")
    prefix = parts.path.strip("/")
    root = f"{bucket}/{prefix}" if prefix else bucket
    opts = dict(storage_options or {})
    # s3fs attribute, not an init arg
    retries = check_int(opts.pop("retries", S3_DEFAULT_RETRIES), "storage_options['retries']",
                        "open_store", lo=1, hi=100, fix="s3fs's own attempts per call")
    # Copied deeply because botocore rewrites config_kwargs["retries"] in place and the
    # caller's dict must stay as it was (the rest may hold objects such as a session).
    config_kwargs = copy.deepcopy(opts.get("config_kwargs") or {})
    for name, value in S3_DEFAULT_CONFIG_KWARGS.items():
        config_kwargs.setdefault(name, copy.deepcopy(value))
    opts["config_kwargs"] = config_kwargs
    opts.setdefault("use_listings_cache", False)
    opts["skip_instance_cache"] = True  # never share an instance (and its credentials) by token
    endpoint = opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
    endpoint = endpoint if isinstance(endpoint, str) else None
    if probe and endpoint is not None:
        probe_endpoint(endpoint, f"{scheme}://{root}")
    fs = s3fs.S3FileSystem(**opts)
    fs.retries = retries
    return FsspecBlobStore(fs, root, location=f"{scheme}://{root}", bucket=bucket, retry=retry,
                           endpoint=endpoint)


def _import_filesystem(module: str, scheme: str, uri: str, package: str) -> Any:
    """``module`` imported, or a ConfigError naming the package to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError("base_uri", _redact(uri), f"{scheme}:// with the {package!r} "
                          "package installed", owner="open_store",
                          fix=f"pip install '{package}' on the driver and every executor "
                              f"({exc})") from exc


def _open_gcs(scheme: str, parts: urllib.parse.SplitResult,
              storage_options: dict[str, Any] | None, retry: RetryPolicy | None, *,
              probe: bool = False) -> FsspecBlobStore:
    """GCS through gcsfs, refused unless its ``pipe_file`` creates objects only if absent;
    with ``probe``, its endpoint must accept a connection first."""
    uri = parts.geturl()
    gcsfs = _import_filesystem("gcsfs", scheme, uri, f"gcsfs>={GCSFS_MIN_VERSION}")
    prefix = parts.path.strip("/")
    root = f"{parts.netloc}/{prefix}" if prefix else parts.netloc
    endpoint = _gcs_endpoint(storage_options)
    if probe:
        # before the filesystem: building it looks for credentials (the GCE metadata server,
        # retried for about 15 s without a network), and each call retries for about 30 s
        probe_endpoint(endpoint, f"{scheme}://{root}")
    fs = gcsfs.GCSFileSystem(**{**(storage_options or {}), "skip_instance_cache": True})
    if write_once_primitive(fs) != "mode":
        raise ConfigError("base_uri", _redact(uri), f"{scheme}:// with a gcsfs that writes "
                          "an object only if absent (pipe_file(mode='create'))",
                          owner="open_store",
                          fix=f"pip install 'gcsfs>={GCSFS_MIN_VERSION}' (installed: "
                              f"{getattr(gcsfs, '__version__', 'unknown')}); DSTL's objects "
                              "are write-once")
    return FsspecBlobStore(fs, root, location=f"{scheme}://{root}", bucket=parts.netloc,
                           retry=retry, endpoint=endpoint)


def _gcs_endpoint(storage_options: Mapping[str, Any] | None) -> str:
    """The endpoint gcsfs talks to: ``endpoint_url``, else ``STORAGE_EMULATOR_HOST``, else
    Google's (gcsfs's own order)."""
    given = (storage_options or {}).get("endpoint_url")
    if isinstance(given, str) and given:
        return given
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if emulator not in ("", "default"):
        return emulator if emulator.startswith(("http://", "https://")) else f"http://{emulator}"
    return "https://storage.googleapis.com"


def _open_azure(scheme: str, parts: urllib.parse.SplitResult,
                storage_options: dict[str, Any] | None, retry: RetryPolicy | None
                ) -> FsspecBlobStore:
    """Azure Blob / ADLS Gen2 through adlfs (``overwrite=False`` is its write-once upload);
    ``container@account.<host>`` sets ``account_name`` unless storage_options do."""
    uri = parts.geturl()
    adlfs = _import_filesystem("adlfs", scheme, uri, "adlfs")
    opts = {**(storage_options or {}), "skip_instance_cache": True}
    container = parts.netloc
    if parts.username is not None:
        container = parts.username
        opts.setdefault("account_name", (parts.hostname or "").split(".", 1)[0])
    fs = adlfs.AzureBlobFileSystem(**opts)
    if write_once_primitive(fs) is None:
        raise ConfigError("base_uri", _redact(uri), f"{scheme}:// with an adlfs that writes "
                          "an object only if absent", owner="open_store",
                          fix="pip install --upgrade adlfs; DSTL's objects are write-once")
    prefix = parts.path.strip("/")
    root = f"{container}/{prefix}" if prefix else container
    return FsspecBlobStore(fs, root, location=f"{scheme}://{root}", bucket=container,
                           retry=retry)


_S = TypeVar("_S", LocalBlobStore, FsspecBlobStore, HdfsBlobStore)


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


def parse_storage_options(items: Iterable[str]) -> dict[str, Any] | None:
    """Storage options from ``key=value`` strings (the CLI's ``--storage-option``, the Spark
    sources' ``storage.<key>`` options): the value is JSON when it parses as JSON (``anon=true``,
    ``config_kwargs.retries={"max_attempts": 3}``), else a string; a dotted key nests
    (``client_kwargs.endpoint_url=http://host:9000`` is ``{"client_kwargs": {"endpoint_url":
    ...}}``). ``None`` when there are none.

    Raises:
        ConfigError: an item without ``=``, with an empty key part, a key given twice, or that
            puts a group where a value already is (the message shows the key, never the value).
    """
    out: dict[str, Any] = {}
    given: set[str] = set()
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not key or not all(parts):
            raise ConfigError("storage option", key or "<empty>", "key=value (e.g. "
                              "client_kwargs.endpoint_url=http://host:9000)",
                              owner="storage options")
        if key in given:
            # the second value would silently win: a typo'd repeat is more likely than intent
            raise ConfigError("storage option", key, "each key once", owner="storage options",
                              fix=f"give {key} one value")
        given.add(key)
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError("storage option", key, f"a value for {p!r} or a group under "
                                  "it, not both", owner="storage options")
        node[parts[-1]] = value
    return out or None
