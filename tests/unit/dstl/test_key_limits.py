"""Object keys have a length limit, and a permanent storage failure is never retried as transient
(the deletion pass's part is in test_deletion_pass.py)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest
import s3fs.errors

from dstl.errors import StorageError, TransientStorageError, UnsafePathError
from dstl.handle import ChangelogHandle
from dstl.stores import LocalBlobStore, MemoryBlobStore, is_retryable, translate_error
from dstl.stores.base import MAX_KEY_BYTES, MAX_KEY_SEGMENT_BYTES, check_key


def long_key(n_bytes: int, segment: int = 200) -> str:
    """A key of exactly ``n_bytes`` with segments of at most ``segment`` bytes."""
    parts: list[str] = []
    left = n_bytes
    while left > 0:
        take = min(segment, left if not parts else left - 1)
        if parts:
            left -= 1  # the "/"
        parts.append("k" * take)
        left -= take
    key = "/".join(parts)
    assert len(key) == n_bytes
    return key


def test_a_key_of_the_limit_passes_one_byte_more_does_not() -> None:
    assert MAX_KEY_BYTES == 1024 and MAX_KEY_SEGMENT_BYTES == 255
    ok = long_key(MAX_KEY_BYTES)
    assert check_key(ok) == ok
    with pytest.raises(UnsafePathError, match="longer than 1024 bytes"):
        check_key(long_key(MAX_KEY_BYTES + 1))
    with pytest.raises(UnsafePathError, match="longer than 1024 bytes"):
        check_key("d/" + "k" * 200 + "/" + "x" * 10_000_000)  # huge: refused before splitting


def test_the_limit_counts_utf8_bytes_not_characters() -> None:
    two_byte = "é" * 100  # 200 bytes per segment
    key = "/".join([two_byte] * 5)  # 500 characters, 1004 bytes
    assert check_key(key) == key
    with pytest.raises(UnsafePathError, match="1024 bytes"):
        check_key("/".join([two_byte] * 6))  # 605 characters, 1205 bytes


def test_a_segment_longer_than_a_file_name_is_refused() -> None:
    assert check_key("dstl/" + "s" * 255) == "dstl/" + "s" * 255
    with pytest.raises(UnsafePathError, match="segment is longer than 255"):
        check_key("dstl/" + "s" * 256)
    with pytest.raises(UnsafePathError, match="segment is longer than 255"):
        check_key("dstl/" + "é" * 128)  # 256 bytes


@pytest.mark.parametrize("store_kind", ["memory", "local"])
def test_every_store_refuses_an_overlong_key_before_any_io(store_kind: str,
                                                          tmp_path: Path) -> None:
    store: Any = MemoryBlobStore() if store_kind == "memory" else LocalBlobStore(tmp_path)
    key = long_key(MAX_KEY_BYTES + 1)
    for call in (lambda: store.put(key, b"x"), lambda: store.get(key),
                 lambda: store.head(key), lambda: store.delete([key])):
        with pytest.raises(UnsafePathError):
            call()
    with pytest.raises(UnsafePathError):
        store.put("dstl/" + "s" * 256, b"x")  # ENAMETOOLONG on a local disk, refused everywhere


def test_a_handle_naming_an_overlong_key_is_refused() -> None:
    obj = {"v": 1, "log_id": "op", "key_groups": [0, 3], "from": 0, "to": 1,
           "change_sets": [[0, long_key(2000), 8, 40, 1, 10]]}
    with pytest.raises(UnsafePathError):
        ChangelogHandle.from_json_obj(obj)


# --------------------------------------------------------------------------- permanence


def client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": code},
         "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def wrapped(err: botocore.exceptions.ClientError) -> BaseException:
    try:
        raise err
    except botocore.exceptions.ClientError as e:
        try:
            raise s3fs.errors.translate_boto_error(e)
        except BaseException as out:
            return out
    raise AssertionError


PERMANENT_ERRNOS = [errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.EINVAL,
                    errno.EROFS, errno.ELOOP]


@pytest.mark.parametrize("code", PERMANENT_ERRNOS, ids=[errno.errorcode[c] for c in
                                                        PERMANENT_ERRNOS])
def test_permanent_local_errors_are_not_transient(code: int) -> None:
    err = translate_error(OSError(code, "injected"), op="put", key="dstl/x", location="/r")
    assert isinstance(err, StorageError) and not isinstance(err, TransientStorageError)
    assert not is_retryable(OSError(code, "injected"))
    assert err.key == "dstl/x"


@pytest.mark.parametrize(("code", "status"), [
    ("InvalidObjectState", 403), ("NoSuchUpload", 404), ("MissingContentLength", 411),
    ("InvalidStorageClass", 400), ("EntityTooSmall", 400), ("InvalidTag", 400),
    ("UnexpectedContent", 400), ("MetadataTooLarge", 400), ("InvalidPart", 400),
])
def test_unknown_4xx_codes_are_permanent(code: str, status: int) -> None:
    for exc in (client_error(code, status), wrapped(client_error(code, status))):
        err = translate_error(exc, op="put", key="k", location="s3://b")
        assert not isinstance(err, TransientStorageError), (code, err)
        assert isinstance(err, StorageError)
        assert not is_retryable(exc)


@pytest.mark.parametrize(("code", "status"), [("SomethingNew", 500), ("Whatever", 503),
                                              ("RequestTimeout", 408), ("TooManyRequests", 429)])
def test_unknown_5xx_and_later_codes_stay_transient(code: str, status: int) -> None:
    exc = wrapped(client_error(code, status))
    assert is_retryable(exc), code
