"""translate_error / is_retryable with real exception objects.

Two sources: botocore ``ClientError`` objects built from the response dicts moto and AWS send,
wrapped exactly as s3fs wraps them (``s3fs.errors.translate_boto_error``, raised inside the
``except`` so the chain is the real one); and exceptions captured live from s3fs against the moto
server (marker ``s3``). Builtin ``OSError`` s with errnos cover local disks and sockets; HDFS's
errors are those hdfs-native raised against a MiniDFSCluster.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from typing import Any

import botocore.exceptions
import pytest
import s3fs
import s3fs.errors
from fsspec.exceptions import FSTimeoutError
from support import moto_server
from support.moto_server import DUMMY_SECRET, s3_storage_options

from dstl.errors import (
    AccessDeniedError,
    DstlError,
    LocalDiskFullError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    ThrottledError,
    TransientStorageError,
)
from dstl.stores import is_retryable, translate_error

# Fixtures of support.moto_server (one server per xdist worker), bound by assignment so that test
# parameters of the same name do not shadow an import.
moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket

LOCATION = "s3://bkt/app"
KEY = "dstl/seg-0001"


def client_error(code: str, status: int, operation: str = "GetObject",
                 **extra: str) -> botocore.exceptions.ClientError:
    response: dict[str, Any] = {
        "Error": {"Code": code, "Message": f"moto says {code}", **extra},
        "ResponseMetadata": {"RequestId": "r-1", "HTTPStatusCode": status,
                             "HTTPHeaders": {"server": "amazon.com"}, "RetryAttempts": 0},
    }
    return botocore.exceptions.ClientError(response, operation)


def as_s3fs_raises(err: botocore.exceptions.ClientError) -> BaseException:
    """What s3fs actually raises for ``err``: its builtin translation, chained to ``err``."""
    try:
        raise err
    except botocore.exceptions.ClientError as e:
        try:
            raise s3fs.errors.translate_boto_error(e)
        except BaseException as wrapped:  # capture with its real __cause__/__context__
            return wrapped
    raise AssertionError("unreachable")


def translate(exc: BaseException, op: str = "get") -> DstlError:
    return translate_error(exc, op=op, key=KEY, location=LOCATION)


CASES: list[tuple[str, Callable[[], BaseException], type[DstlError], bool]] = [
    ("NoSuchKey", lambda: client_error("NoSuchKey", 404), ObjectNotFoundError, False),
    ("HeadObject 404", lambda: client_error("404", 404, "HeadObject"), ObjectNotFoundError,
     False),
    ("NoSuchBucket", lambda: client_error("NoSuchBucket", 404, BucketName="bkt"),
     AccessDeniedError, False),
    ("AccessDenied", lambda: client_error("AccessDenied", 403), AccessDeniedError, False),
    ("InvalidAccessKeyId", lambda: client_error("InvalidAccessKeyId", 403), AccessDeniedError,
     False),
    ("SignatureDoesNotMatch", lambda: client_error("SignatureDoesNotMatch", 403),
     AccessDeniedError, False),
    ("HeadBucket 403", lambda: client_error("403", 403, "HeadBucket"), AccessDeniedError, False),
    ("PreconditionFailed", lambda: client_error("PreconditionFailed", 412, "PutObject",
                                                Condition="If-None-Match"),
     ObjectExistsError, False),
    # throttling and internal errors: retried after a backoff (dstl.retry)
    ("SlowDown", lambda: client_error("SlowDown", 503, "PutObject"), ThrottledError, True),
    ("InternalError", lambda: client_error("InternalError", 500), ThrottledError, True),
    ("ServiceUnavailable", lambda: client_error("ServiceUnavailable", 503), ThrottledError,
     True),
    ("HeadObject 503", lambda: client_error("503", 503, "HeadObject"), ThrottledError, True),
    ("429", lambda: client_error("429", 429, "PutObject"), ThrottledError, True),
    ("Throttling", lambda: client_error("Throttling", 400, "ListObjectsV2"), ThrottledError,
     True),
    ("RequestTimeout", lambda: client_error("RequestTimeout", 400, "PutObject"),
     TransientStorageError, True),
    ("InvalidRange", lambda: client_error("InvalidRange", 416, ActualObjectSize="5"),
     StorageError, False),
]


@pytest.mark.parametrize(("make", "expected", "retryable"),
                         [pytest.param(m, e, r, id=i) for i, m, e, r in CASES])
def test_client_errors_bare_and_as_s3fs_raises_them(make: Callable[[], BaseException],
                                                    expected: type[DstlError],
                                                    retryable: bool) -> None:
    for exc in (make(), as_s3fs_raises(make())):
        err = translate(exc)
        assert type(err) is expected, (exc, err)
        assert is_retryable(err) is retryable
        assert is_retryable(exc) is retryable
        assert err.key == KEY  # type: ignore[attr-defined]
        message = str(err)
        assert message.startswith(f"get {LOCATION}/{KEY}: "), message


def test_no_such_bucket_wrapped_as_file_not_found_is_access_denied() -> None:
    # s3fs raises FileNotFoundError("The specified bucket does not exist"); the ClientError code
    # in the chain is the more precise fact.
    exc = as_s3fs_raises(client_error("NoSuchBucket", 404, "ListObjectsV2", BucketName="bkt"))
    assert isinstance(exc, FileNotFoundError)
    err = translate(exc, op="list")
    assert isinstance(err, AccessDeniedError)
    assert "bucket" in str(err) and "storage_options" in str(err)


@pytest.mark.parametrize(("make", "expected", "retryable"), [
    pytest.param(botocore.exceptions.NoCredentialsError, AccessDeniedError, False,
                 id="NoCredentialsError"),
    pytest.param(lambda: botocore.exceptions.PartialCredentialsError(
        provider="env", cred_var="AWS_SECRET_ACCESS_KEY"), AccessDeniedError, False,
                 id="PartialCredentialsError"),
    pytest.param(lambda: botocore.exceptions.EndpointConnectionError(
        endpoint_url="http://127.0.0.1:1/bkt"), TransientStorageError, True,
                 id="EndpointConnectionError"),
    pytest.param(lambda: botocore.exceptions.ReadTimeoutError(
        endpoint_url="http://127.0.0.1:1/bkt"), TransientStorageError, True,
                 id="ReadTimeoutError"),
    pytest.param(lambda: botocore.exceptions.ConnectTimeoutError(
        endpoint_url="http://127.0.0.1:1/bkt"), TransientStorageError, True,
                 id="ConnectTimeoutError"),
    pytest.param(FSTimeoutError, TransientStorageError, True, id="FSTimeoutError"),
    pytest.param(lambda: OSError(errno.ENOSPC, "No space left on device", "/data/x"),
                 LocalDiskFullError, False, id="ENOSPC"),
    pytest.param(lambda: OSError(errno.EFBIG, "File too large"), LocalDiskFullError, False,
                 id="EFBIG"),
    pytest.param(lambda: OSError(errno.EDQUOT, "Disk quota exceeded"), LocalDiskFullError,
                 False, id="EDQUOT"),
    pytest.param(lambda: ConnectionResetError(errno.ECONNRESET, "reset"),
                 TransientStorageError, True, id="ECONNRESET"),
    pytest.param(lambda: OSError(errno.ETIMEDOUT, "timed out"), TransientStorageError, True,
                 id="ETIMEDOUT"),
    pytest.param(lambda: TimeoutError("read timed out"), TransientStorageError, True,
                 id="TimeoutError"),
    pytest.param(lambda: PermissionError(errno.EACCES, "Permission denied", "/data/x"),
                 AccessDeniedError, False, id="EACCES"),
    pytest.param(lambda: FileNotFoundError(errno.ENOENT, "No such file", "/data/x"),
                 ObjectNotFoundError, False, id="ENOENT"),
    pytest.param(lambda: FileExistsError(errno.EEXIST, "File exists", "/data/x"),
                 ObjectExistsError, False, id="EEXIST"),
    pytest.param(lambda: OSError(errno.EIO, "I/O error"), TransientStorageError, True,
                 id="unknown-OSError"),
    pytest.param(lambda: ValueError("bad"), StorageError, False, id="not-an-OSError"),
])
def test_builtin_and_botocore_errors(make: Callable[[], BaseException],
                                     expected: type[DstlError], retryable: bool) -> None:
    err = translate(make(), op="put")
    assert type(err) is expected
    assert is_retryable(err) is retryable
    assert f"put {LOCATION}/{KEY}" in str(err)


def test_disk_full_says_which_and_carries_the_path() -> None:
    err = translate(OSError(errno.EFBIG, "File too large", "/data/x"), op="put")
    assert isinstance(err, LocalDiskFullError)
    assert "EFBIG" in str(err) and err.path == "/data/x"
    err = translate(OSError(errno.ENOSPC, "No space left on device", "/data/y"), op="put")
    assert isinstance(err, LocalDiskFullError)
    assert "no space left" in str(err) and err.path == "/data/y"


def test_no_credentials_message_says_how_to_pass_them() -> None:
    err = translate(botocore.exceptions.NoCredentialsError(), op="open")
    assert "storage_options" in str(err) and "environment" in str(err)


def test_dstl_errors_pass_through_unchanged() -> None:
    original = ObjectExistsError("already there", key=KEY)
    assert translate(original) is original
    assert not is_retryable(original)
    assert is_retryable(TransientStorageError("x"))


def test_key_none_names_the_location() -> None:
    err = translate_error(TimeoutError(), op="list", key=None, location=LOCATION)
    assert str(err).startswith(f"list {LOCATION}: ")


# --------------------------------------------------------------------------- captured live


def capture(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except Exception as exc:
        return exc
    raise AssertionError("expected the call to fail")


@pytest.fixture
def live_fs(moto_endpoint: str) -> s3fs.S3FileSystem:
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                           config_kwargs={"retries": {"total_max_attempts": 1}},
                           **s3_storage_options(moto_endpoint))
    fs.retries = 1
    return fs


@pytest.mark.s3
def test_captured_from_moto(live_fs: s3fs.S3FileSystem, s3_bucket: str) -> None:
    live_fs.pipe_file(f"{s3_bucket}/k", b"hello", mode="create")
    cases: list[tuple[Callable[[], object], type[DstlError], bool]] = [
        (lambda: live_fs.cat_file(f"{s3_bucket}/missing"), ObjectNotFoundError, False),
        (lambda: live_fs.info(f"{s3_bucket}/missing"), ObjectNotFoundError, False),
        (lambda: live_fs.cat_file("no-such-bucket-dstl/k"), AccessDeniedError, False),
        (lambda: live_fs.pipe_file("no-such-bucket-dstl/k", b"x"), AccessDeniedError, False),
        (lambda: live_fs.pipe_file(f"{s3_bucket}/k", b"again", mode="create"),
         ObjectExistsError, False),
        (lambda: live_fs.cat_file(f"{s3_bucket}/k", start=5, end=10), StorageError, False),
    ]
    for call, expected, retryable in cases:
        exc = capture(call)
        err = translate(exc)
        assert type(err) is expected, (exc, err)
        assert is_retryable(exc) is retryable
        assert DUMMY_SECRET not in str(err) and DUMMY_SECRET not in repr(err)


@pytest.mark.s3
def test_captured_connection_refused_is_transient() -> None:
    with socket.socket() as sock:  # a port that nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    fs = s3fs.S3FileSystem(skip_instance_cache=True,
                           config_kwargs={"retries": {"total_max_attempts": 1},
                                          "connect_timeout": 2},
                           **s3_storage_options(f"http://127.0.0.1:{port}"))
    fs.retries = 1
    exc = capture(lambda: fs.cat_file("bkt/k"))
    err = translate(exc)
    assert isinstance(err, TransientStorageError), exc
    assert DUMMY_SECRET not in str(err)


def _gcs(code: int) -> BaseException:
    from gcsfs.retry import HttpError

    return HttpError({"code": code, "message": "from GCS"})


def _azure(status: int, error_code: str | None) -> BaseException:
    from azure.core.exceptions import HttpResponseError

    err = HttpResponseError(message="from Azure")
    err.status_code, err.error_code = status, error_code
    return err


@pytest.mark.parametrize(("make", "expected"), [
    (lambda: _gcs(401), AccessDeniedError), (lambda: _gcs(403), AccessDeniedError),
    (lambda: _gcs(404), ObjectNotFoundError), (lambda: _gcs(412), ObjectExistsError),
    (lambda: _gcs(429), ThrottledError), (lambda: _gcs(503), ThrottledError),
    (lambda: _gcs(400), StorageError),
    (lambda: _azure(403, "AuthorizationFailure"), AccessDeniedError),
    (lambda: _azure(403, "AuthenticationFailed"), AccessDeniedError),
    (lambda: _azure(404, "ContainerNotFound"), AccessDeniedError),
    (lambda: _azure(404, "BlobNotFound"), ObjectNotFoundError),
    (lambda: _azure(409, "BlobAlreadyExists"), ObjectExistsError),
    (lambda: _azure(412, "ConditionNotMet"), ObjectExistsError),
    (lambda: _azure(503, "ServerBusy"), ThrottledError),
    (lambda: _azure(500, "SomethingNew"), ThrottledError),
    (lambda: _azure(403, None), AccessDeniedError),
    (lambda: _azure(400, "InvalidHeaderValue"), StorageError),
], ids=["gcs-401", "gcs-403", "gcs-404", "gcs-412", "gcs-429", "gcs-503", "gcs-400",
        "az-authz", "az-authn", "az-container", "az-blob", "az-exists", "az-condition",
        "az-busy", "az-500-unknown-code", "az-403-no-code", "az-400"])
def test_gcs_and_azure_service_errors(make: Callable[[], BaseException],
                                      expected: type[DstlError]) -> None:
    """gcsfs's ``HttpError`` (its ``code`` is the HTTP status) and azure.core's
    ``HttpResponseError`` (``error_code``, else ``status_code``), bare and wrapped in the
    ``OSError`` a filesystem raises from them."""
    for exc in (make(), _wrapped(make())):
        err = translate_error(exc, op="get", key="dstl/x", location="gs://b/app")
        assert type(err) is expected, (exc, err)
        assert "gs://b/app/dstl/x" in str(err)


def _wrapped(cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except Exception as exc:
            raise OSError("the filesystem's own wrapper") from exc
    except OSError as outer:
        return outer


# --------------------------------------------------------------------------- HDFS (hdfs-native)
# The exceptions as hdfs-native 0.14 raised them against a MiniDFSCluster (the texts are those
# observed, stack lines cut); tests/integration/stores/test_hdfs.py provokes each one for real.

_RPC = 'RPCError("org.apache.hadoop.{cls}", "{msg}\\n\\tat org.apache.hadoop.hdfs.server.X(X.java:1)")'


@pytest.mark.parametrize(("exc", "kind", "words"), [
    (RuntimeError(_RPC.format(cls="security.AccessControlException",
                              msg="Permission denied: user=alice, access=EXECUTE")),
     AccessDeniedError, ["user=alice", "chown", "HADOOP_USER_NAME"]),
    (RuntimeError(_RPC.format(cls="hdfs.server.namenode.SafeModeException",
                              msg="Cannot create file/a/sm. Name node is in safe mode.")),
     TransientStorageError, ["safe mode", "dfsadmin -safemode leave"]),
    (RuntimeError(_RPC.format(cls="ipc.StandbyException", msg="Operation category WRITE")),
     TransientStorageError, ["cannot serve"]),
    (RuntimeError(_RPC.format(cls="hdfs.protocol.RecoveryInProgressException",
                              msg="Failed to APPEND_FILE")),
     TransientStorageError, ["lease", "recoverLease"]),
    (RuntimeError(_RPC.format(cls="hdfs.protocol.DSQuotaExceededException",
                              msg="The DiskSpace quota is exceeded")),
     StorageError, ["quota", "setSpaceQuota"]),
    (FileExistsError("Failed to CREATE_FILE /a/open for hdfs_native_client-1 on 127.0.0.1 "
                     "because this file lease is currently owned by hdfs_native_client-2 on "
                     "127.0.0.1\n\tat org.apache.hadoop.X"),
     ObjectExistsError, ["lease", "recoverLease"]),
    (FileExistsError("/a/b/c already exists"), ObjectExistsError, ["write-once"]),
    (OSError("Connection refused (os error 111)"), TransientStorageError,
     ["unreachable", "NameNode", "rpc-address"]),
    (RuntimeError('DataTransferError("All DataNodes failed: [DatanodeInfoProto { ... }]")'),
     TransientStorageError, ["DataNode", "replication >= 2"]),
], ids=["denied", "safe-mode", "standby", "lease-recovery", "quota", "lease-held", "exists",
        "refused", "datanodes"])
def test_hdfs_errors(exc: BaseException, kind: type[DstlError], words: list[str]) -> None:
    err = translate_error(exc, op="put", key="dstl/seg", location="hdfs://nn:8020/app")
    assert type(err) is kind, err
    text = str(err)
    assert "hdfs://nn:8020/app/dstl/seg" in text and err.key == "dstl/seg"  # type: ignore[attr-defined]
    for word in words:
        assert word in text, (word, text)
    assert is_retryable(exc) == issubclass(kind, TransientStorageError)
    assert "\tat org.apache" not in text  # the Java stack stays out of the message
