"""The storage seam: a small object-store interface every backend sits behind.

Six operations, object-store semantics (keys are ``/``-separated relative paths below a root):

- ``put(key, data)`` — write-once: the object appears whole or not at all; writing a key that
  exists raises :class:`~dstl.errors.ObjectExistsError` (DSTL never reuses a name: segment names
  are unique per upload attempt).
- ``get(key)`` / ``get_range(key, offset, length)`` — a missing object raises
  :class:`~dstl.errors.ObjectNotFoundError`; a ranged read past the end returns fewer bytes (the
  caller decides whether that is corruption).
- ``head(key)`` — :class:`ObjectInfo` or ``None``.
- ``list(prefix)`` — objects whose key starts with ``prefix``, sorted by key.
- ``delete(keys)`` — idempotent (missing keys are fine).

Implementations (all in :mod:`dstl.stores`): ``MemoryBlobStore`` (:mod:`dstl.stores.memory`,
reference, tests), ``LocalBlobStore`` (:mod:`dstl.stores.local`: durable local disk: temp file,
fsync, atomic publish, directory fsync) and ``FsspecBlobStore`` (:mod:`dstl.stores.fsspec_store`:
S3 via s3fs, HDFS via fsspec's Arrow filesystem, memory, or any injected fsspec filesystem). One
contract test suite (``tests/contract``) runs against all of them.

Third-party exceptions are translated in exactly one place, :func:`translate_error`, which also
decides what is retryable (:func:`is_retryable`).
"""

from __future__ import annotations

import errno
import posixpath
import re
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

from dstl.errors import (
    AccessDeniedError,
    ConfigTypeError,
    DstlError,
    LocalDiskFullError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    ThrottledError,
    TransientStorageError,
    UnsafePathError,
    UsageError,
)

__all__ = [
    "check_range",
    "MAX_KEY_BYTES",
    "MAX_KEY_SEGMENT_BYTES",
    "BlobStore",
    "ObjectInfo",
    "check_key",
    "check_store",
    "connect_failure",
    "is_retryable",
    "translate_error",
]


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What ``head``/``list`` know about an object."""

    key: str
    size: int


@runtime_checkable
class BlobStore(Protocol):
    """The storage seam (see the module docstring for the semantics)."""

    #: Human-readable location of the root, for messages (never contains credentials).
    location: str

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def get_range(self, key: str, offset: int, length: int) -> bytes: ...

    def head(self, key: str) -> ObjectInfo | None: ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]: ...

    def delete(self, keys: Iterable[str]) -> None: ...

    def close(self) -> None: ...


#: Longest key, in UTF-8 bytes: S3's limit on an object key, so a key valid here is valid in every
#: store (a prefix in the base URI comes on top of it).
MAX_KEY_BYTES: Final = 1024
#: Longest path segment, in UTF-8 bytes: POSIX ``NAME_MAX`` of local filesystems (ext4, xfs), so a
#: key never fails on a local disk where it would pass on S3.
MAX_KEY_SEGMENT_BYTES: Final = 255


def check_store(value: object, field: str, owner: str) -> BlobStore:
    """``value`` if it is a :class:`BlobStore` (has ``location`` and the seven methods).

    Raises:
        ConfigTypeError: it is not; the message names ``owner.field``.
    """
    if not isinstance(value, BlobStore):
        raise ConfigTypeError(field, value, "a dstl.stores.BlobStore (location, put, get, "
                              "get_range, head, list, delete, close)", owner=owner,
                              fix="open one with dstl.stores.open_store(uri)")
    return value


def check_range(location: str, key: str, offset: int, length: int) -> None:
    """Every store's ``get_range`` argument check.

    Raises:
        UsageError: a negative offset or length.
    """
    if offset < 0 or length < 0:
        raise UsageError(f"get_range {location}/{key}: bad range offset={offset} "
                         f"length={length} (both must be >= 0)")


def check_key(key: object) -> str:
    """Validate an object key; return it.

    Keys come from handles and manifests, which are untrusted input: a key must be a non-empty
    relative POSIX path without ``.``/``..`` segments, backslashes, NUL or a scheme, so it can never
    escape the storage root, and at most :data:`MAX_KEY_BYTES` long with segments of at most
    :data:`MAX_KEY_SEGMENT_BYTES` (UTF-8 bytes), so it is valid in every store.

    Raises:
        UnsafePathError: the key is not allowed.
    """
    if not isinstance(key, str) or not key:
        raise UnsafePathError(repr(key)[:200], "not a non-empty string")
    if len(key) > MAX_KEY_BYTES or len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise UnsafePathError(key[:100] + "...", f"longer than {MAX_KEY_BYTES} bytes "
                                                 f"(MAX_KEY_BYTES, S3's key limit)")
    if any(len(p.encode("utf-8", "surrogatepass")) > MAX_KEY_SEGMENT_BYTES
           for p in key.split("/")):
        raise UnsafePathError(key, f"a path segment is longer than {MAX_KEY_SEGMENT_BYTES} "
                                   "bytes (MAX_KEY_SEGMENT_BYTES, a local filesystem's name limit)")
    if key.startswith("/") or "\\" in key or "\x00" in key or "://" in key:
        raise UnsafePathError(key, "absolute, has a scheme, or contains '\\' or NUL")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(key, "empty, '.' or '..' path segment")
    if posixpath.normpath(key) != key:
        raise UnsafePathError(key, "not in normal form")
    return key


# --------------------------------------------------------------------------- error translation

_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
# The request can never succeed as made (a bad name, a file where a directory must be, a
# read-only filesystem): retrying only delays the typed failure.
_PERMANENT_ERRNOS = {errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.EINVAL, errno.EROFS,
                     errno.ELOOP, errno.EMLINK, errno.EXDEV, errno.ENOTEMPTY, errno.EBADF,
                     errno.ENOSYS, errno.EOPNOTSUPP, errno.ERANGE, errno.EOVERFLOW, errno.ENXIO,
                     errno.ENODEV, errno.ESPIPE, errno.EFAULT}
_TRANSIENT_ERRNOS = {errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
                     errno.EPIPE, errno.EAGAIN, errno.EINTR, errno.EHOSTUNREACH, errno.ENETUNREACH}
# The service is overloaded or failed internally: S3 advises retrying all of these with an
# exponential backoff, so they become ThrottledError (retried after a jittered, growing delay).
_THROTTLE_S3_CODES = {"SlowDown", "InternalError", "ServiceUnavailable", "Throttling",
                      "ThrottlingException", "ThrottledException", "RequestThrottled",
                      "RequestThrottledException", "TooManyRequestsException",
                      "RequestLimitExceeded", "BandwidthLimitExceeded",
                      "429", "500", "502", "503", "504"}
# One request went wrong on the way (a timeout, a body damaged in transit): retry it.
_TRANSIENT_S3_CODES = {"RequestTimeout", "RequestTimeTooSkewed", "XAmzContentSHA256Mismatch",
                       "BadDigest", "IncompleteBody"}
_DENIED_S3_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket",
                    "AllAccessDisabled", "ExpiredToken", "InvalidToken", "AccountProblem",
                    "InvalidSecurity", "401", "403"}
_NOT_FOUND_S3_CODES = {"NoSuchKey", "404"}
_EXISTS_S3_CODES = {"PreconditionFailed", "412"}
# The request itself is wrong (a range past the end, a bad name): retrying cannot help.
_PERMANENT_S3_CODES = {"InvalidRange", "416", "InvalidArgument", "InvalidRequest",
                       "InvalidBucketName", "InvalidURI", "KeyTooLongError", "EntityTooLarge",
                       "MalformedXML", "MethodNotAllowed", "NotImplemented", "400", "405", "501"}
_TRANSIENT_CLASS_NAMES = {
    # s3fs's retryable set plus botocore/aiohttp transport errors, matched by class name so the
    # core does not import them.
    "FSTimeoutError", "IncompleteRead", "ResponseParserError", "ClientPayloadError",
    "HTTPClientError", "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
    "ConnectTimeoutError", "ServerDisconnectedError", "ClientOSError", "ClientConnectorError",
    "ProxyConnectionError", "ConnectionError", "TimeoutError", "ServerTimeoutError",
}
_CREDENTIAL_CLASS_NAMES = {"NoCredentialsError", "PartialCredentialsError",
                           "CredentialRetrievalError"}


def _chain_names(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


#: Azure Storage error codes (``azure.core.exceptions.HttpResponseError.error_code``) mapped to
#: the S3 code of the same meaning; other Azure errors are classified by their HTTP status.
_AZURE_CODES = {"AuthenticationFailed": "AccessDenied", "AuthorizationFailure": "AccessDenied",
                "AuthorizationPermissionMismatch": "AccessDenied",
                "InsufficientAccountPermissions": "AccessDenied", "AccountIsDisabled": "AccessDenied",
                "ContainerNotFound": "NoSuchBucket", "BlobNotFound": "NoSuchKey",
                "BlobAlreadyExists": "PreconditionFailed", "ConditionNotMet": "PreconditionFailed",
                "ServerBusy": "SlowDown", "InternalError": "InternalError",
                "OperationTimedOut": "RequestTimeout", "InvalidRange": "InvalidRange"}


def _service_code(exc: BaseException) -> str | None:
    """What the remote service said, as an S3 error code or an HTTP status: botocore's
    ``response``; Azure's ``error_code`` / ``status_code`` (adlfs raises azure.core errors);
    gcsfs's ``HttpError.code`` (the HTTP status)."""
    code = _s3_code(exc)
    if code is not None:
        return code
    azure = getattr(exc, "error_code", None)
    if isinstance(azure, str) and azure in _AZURE_CODES:
        return _AZURE_CODES[azure]
    status = getattr(exc, "status_code", None)
    if type(status) is int and hasattr(exc, "error_code"):
        return str(status)
    gcs = getattr(exc, "code", None)
    if type(exc).__name__ == "HttpError" and type(gcs) is int:
        return str(gcs)
    return None


def _s3_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error") or {}
        code = err.get("Code")
        if code:
            return str(code)
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if status:
            return str(status)
    return None


def _from_service(cur: BaseException, *, op: str, key: str | None,
                  where: str) -> DstlError | None:
    """Translate what the remote service said (botocore credential errors, S3 error codes, and
    Azure's and GCS's codes through :func:`_service_code`)."""
    name = type(cur).__name__
    if name in _CREDENTIAL_CLASS_NAMES:
        return AccessDeniedError(
            f"{op} {where}: no usable credentials ({name}); pass key/secret (or a profile) "
            "in storage_options, or set the standard AWS environment variables", key=key)
    code = _service_code(cur)
    if code is None:
        return None
    if code in _DENIED_S3_CODES:
        return AccessDeniedError(
            f"{op} {where}: access denied or bucket missing ({code}); check the bucket name, "
            "that it exists, and the credentials in storage_options", key=key)
    if code in _NOT_FOUND_S3_CODES:
        return ObjectNotFoundError(f"{op} {where}: object not found", key=key)
    if code in _EXISTS_S3_CODES:
        return ObjectExistsError(f"{op} {where}: object already exists (write-once)", key=key)
    if code in _THROTTLE_S3_CODES:
        return ThrottledError(f"{op} {where}: the store asks to slow down or failed internally "
                              f"({code}: {cur})", key=key)
    if code in _TRANSIENT_S3_CODES:
        return TransientStorageError(f"{op} {where}: transient failure ({code}: {cur})", key=key)
    if code in _PERMANENT_S3_CODES:
        return StorageError(f"{op} {where}: request rejected by the store ({code}: {cur})",
                            key=key)
    return _from_status(cur, code, op=op, key=key, where=where)


def _from_status(cur: BaseException, code: str, *, op: str, key: str | None,
                 where: str) -> DstlError | None:
    """An error code this module does not know, classified by its HTTP status: a 4xx (other
    than 408 and 429, which say "later") is the request's fault and permanent; a 5xx is the
    service's and transient."""
    status = _http_status(cur)
    if status is None or status in (408, 429):
        return None
    if 400 <= status < 500:
        return StorageError(f"{op} {where}: request rejected by the store ({code}, HTTP "
                            f"{status}: {cur})", key=key)
    if status >= 500:
        return TransientStorageError(f"{op} {where}: transient failure ({code}, HTTP {status}: "
                                     f"{cur})", key=key)
    return None


def _http_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return status if isinstance(status, int) and not isinstance(status, bool) else None


def _from_local(cur: BaseException, *, op: str, key: str | None,
                where: str) -> DstlError | None:
    """Translate builtin exception types and errnos (local disk, sockets, fsspec wrappers)."""
    name = type(cur).__name__
    if isinstance(cur, PermissionError):
        return AccessDeniedError(
            f"{op} {where}: permission denied ({name}: {cur}); fix the permissions of the "
            "directory, or the credentials in storage_options for a remote store", key=key)
    if isinstance(cur, FileNotFoundError):
        return ObjectNotFoundError(f"{op} {where}: object not found", key=key)
    if isinstance(cur, FileExistsError):
        return ObjectExistsError(f"{op} {where}: object already exists (write-once)", key=key)
    if name in _TRANSIENT_CLASS_NAMES:
        return TransientStorageError(f"{op} {where}: transient failure ({name}: {cur})", key=key)
    if isinstance(cur, OSError) and cur.errno in _DISK_FULL_ERRNOS:
        what = "file too large (EFBIG)" if cur.errno == errno.EFBIG else "no space left"
        return LocalDiskFullError(f"{op} {where}: {what}; free space or move the directory",
                                  key=key, path=getattr(cur, "filename", None))
    if isinstance(cur, OSError) and cur.errno in _PERMANENT_ERRNOS:
        return StorageError(f"{op} {where}: the request cannot succeed ({name}: {cur})",
                            key=key)
    if isinstance(cur, OSError) and cur.errno in _TRANSIENT_ERRNOS:
        return TransientStorageError(f"{op} {where}: transient failure ({cur})", key=key)
    if isinstance(cur, (TimeoutError, ConnectionError)):
        return TransientStorageError(f"{op} {where}: transient failure ({name}: {cur})",
                                     key=key)
    return None


# --------------------------------------------------------------------------- HDFS (hdfs-native)

#: hdfs-native raises the NameNode's remote exceptions as ``RuntimeError('RPCError("<Java
#: class>", "<message and stack>")')``, DataNode failures as ``DataTransferError(...)``, and Rust
#: I/O errors as ``OSError("<text> (os error <errno>)")`` without an ``errno`` attribute.
_HDFS_RPC_RE = re.compile(r'RPCError\("(?P<cls>[\w.$]+)", "(?P<msg>.*)', re.S)
_RUST_OS_ERROR_RE = re.compile(r"\(os error (?P<errno>\d+)\)")
_HDFS_DENIED = {"AccessControlException", "AuthorizationException", "InvalidToken",
                "SaslException"}
#: The NameNode cannot serve the call now, another one (or the same, later) will.
_HDFS_TRANSIENT = {"StandbyException", "ObserverRetryOnActiveException", "RetriableException",
                   "NotReplicatedYetException", "ServerTooBusyException"}
_HDFS_LEASE = {"AlreadyBeingCreatedException", "RecoveryInProgressException",
               "LeaseExpiredException"}
_HDFS_QUOTA = {"DSQuotaExceededException", "NSQuotaExceededException", "QuotaExceededException"}


def _hdfs_message(raw: str) -> str:
    """The first line of a remote exception's message (its Java stack follows)."""
    return raw.replace("\\n", "\n").split("\n", 1)[0].rstrip('")').strip()[:300]


def _from_hdfs(cur: BaseException, *, op: str, key: str | None,
               where: str) -> DstlError | None:
    """Translate what an HDFS NameNode or DataNode said through hdfs-native."""
    text = str(cur)
    if isinstance(cur, FileExistsError) and "lease is currently owned" in text:
        return ObjectExistsError(
            f"{op} {where}: the file is being written by another client, which holds its "
            f"lease ({_hdfs_message(text)}); if that writer died, the NameNode frees the lease "
            "after its soft limit (60 s), or run `hdfs debug recoverLease -path <file>`",
            key=key)
    if type(cur).__name__ == "RuntimeError":
        m = _HDFS_RPC_RE.search(text)
        if m is not None:
            return _from_hdfs_rpc(m.group("cls").rpartition(".")[2],
                                  _hdfs_message(m.group("msg")), op=op, key=key, where=where)
        if text.startswith(("DataTransferError(", "ChecksumError", "BlocksNotFound")):
            return TransientStorageError(
                f"{op} {where}: no DataNode holding the data answered ({text[:300]}); the "
                "blocks are unavailable until a DataNode holding a replica is back (with "
                "replication 1 one DataNode's loss is enough: use replication >= 2)", key=key)
    if isinstance(cur, OSError) and cur.errno is None:
        m = _RUST_OS_ERROR_RE.search(text)
        code = int(m.group("errno")) if m else None
        if code in _TRANSIENT_ERRNOS or (code is None and "connection" in text.lower()):
            return TransientStorageError(
                f"{op} {where}: HDFS unreachable ({text[:200]}): the NameNode, or a DataNode "
                "it named, is down or not at that address; check that the NameNode runs and "
                "the URI's host:port (or the name service's dfs.namenode.rpc-address.*); "
                "DSTL retries", key=key)
    return None


def _from_hdfs_rpc(cls: str, msg: str, *, op: str, key: str | None,
                   where: str) -> DstlError | None:
    if cls in _HDFS_DENIED:
        return AccessDeniedError(
            f"{op} {where}: HDFS denied it ({cls}: {msg}); give the user access to the "
            "directory (hdfs dfs -chown / -chmod, or an ACL with hdfs dfs -setfacl), or act as "
            "a user who has it (HADOOP_USER_NAME, or the Kerberos principal)", key=key)
    if cls == "SafeModeException":
        return TransientStorageError(
            f"{op} {where}: the NameNode is in safe mode ({msg}); it reads but does not write "
            "or delete. After a restart it leaves by itself once the DataNodes have reported "
            "their blocks; a manual safe mode ends with `hdfs dfsadmin -safemode leave`. DSTL "
            "retries", key=key)
    if cls in _HDFS_LEASE:
        return TransientStorageError(
            f"{op} {where}: the file's lease is held by another client ({cls}: {msg}); if that "
            "writer died the NameNode frees it after the soft limit (60 s), or run "
            "`hdfs debug recoverLease -path <file>`", key=key)
    if cls in _HDFS_TRANSIENT:
        return TransientStorageError(f"{op} {where}: the NameNode cannot serve this now "
                                     f"({cls}: {msg}); DSTL retries", key=key)
    if cls == "FileNotFoundException":
        return ObjectNotFoundError(f"{op} {where}: object not found ({msg})", key=key)
    if cls in ("FileAlreadyExistsException",):
        return ObjectExistsError(f"{op} {where}: object already exists (write-once)", key=key)
    if cls in _HDFS_QUOTA:
        return StorageError(f"{op} {where}: an HDFS quota is exhausted ({cls}: {msg}); raise "
                            "it (hdfs dfsadmin -setSpaceQuota / -setQuota) or free space "
                            "(retention, `dstl gc`)", key=key)
    return StorageError(f"{op} {where}: the NameNode refused it ({cls}: {msg})", key=key)


def translate_error(exc: BaseException, *, op: str, key: str | None, location: str) -> DstlError:
    """Turn any exception raised by a storage backend into a DSTL error.

    This is the only place that inspects third-party errors (botocore codes, Azure and gcsfs
    HTTP errors, s3fs/aiohttp transport errors, ``OSError`` errnos). The result is retryable iff it is a
    :class:`~dstl.errors.TransientStorageError`; a :class:`~dstl.errors.ThrottledError` (the
    service said slow down, or failed internally) is retried only after a backoff
    (:mod:`dstl.retry`).

    The whole ``__cause__``/``__context__`` chain is searched for what the service said first
    (an S3 error code, a botocore credential error), then for builtin types: s3fs wraps
    ``NoSuchBucket`` in a ``FileNotFoundError`` and ``InvalidRange`` in ``OSError(EINVAL)`` with
    the ``ClientError`` as cause, and the code is the more precise fact.

    Args:
        exc: what the backend raised.
        op: the operation (``put``, ``get``, ...), for the message.
        key: the object key, if any.
        location: the store's root, for the message.
    """
    if isinstance(exc, DstlError):
        return exc
    where = f"{location}/{key}" if key else location
    chain = list(_chain_names(exc))
    for translate in (_from_hdfs, _from_service, _from_local):
        for cur in chain:
            err = translate(cur, op=op, key=key, where=where)
            if err is not None:
                return err
    if isinstance(exc, OSError):
        # Unknown I/O failures are retried: an upload that fails for good still ends after
        # upload_max_attempts, so the cost of a wrong guess is bounded.
        return TransientStorageError(f"{op} {where}: I/O error ({type(exc).__name__}: {exc})",
                                     key=key)
    return StorageError(f"{op} {where}: {type(exc).__name__}: {exc}", key=key)


def connect_failure(exc: BaseException) -> str | None:
    """Why no connection could be made at all, if that is what ``exc`` (or its chain) says: the
    host name does not resolve, or the endpoint refused the connection; ``None`` for anything
    else (a reset, a timeout or an error status after connecting, which may pass). Opening a
    store turns it into a :class:`~dstl.errors.StoreUnreachableError`; in use it stays
    transient."""
    for cur in _chain_names(exc):
        if isinstance(cur, socket.gaierror) or type(cur).__name__ == "ClientConnectorDNSError":
            return f"the host name does not resolve ({cur})"
        if isinstance(cur, ConnectionRefusedError) or (
                isinstance(cur, OSError) and cur.errno == errno.ECONNREFUSED):
            return f"the endpoint refused the connection ({cur})"
    return None


def is_retryable(exc: BaseException) -> bool:
    """Whether an attempt that failed with ``exc`` may be retried."""
    if isinstance(exc, DstlError):
        return isinstance(exc, TransientStorageError)
    return isinstance(translate_error(exc, op="?", key=None, location="?"),
                      TransientStorageError)
