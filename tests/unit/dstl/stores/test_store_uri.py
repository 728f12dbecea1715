"""``open_store`` and ``check_store_uri`` refuse every URI they would misread: a scheme
without ``//`` (``s3:/x``) or without its colon (``s3//x``) would become a local directory
named ``s3:`` or ``s3``, and query strings, empty buckets or prefixes with ``..`` would be
accepted or fail late. A plain path
(str or ``os.PathLike``) stays a local directory, and a local path takes no storage options.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dstl.errors import ConfigError
from dstl.stores import SUPPORTED_SCHEMES, LocalBlobStore, open_store


def check_store_uri(uri: str) -> str:
    from dstl.stores import check_store_uri as check

    return check(uri)

BROKEN = [
    # (uri, text the message must contain)  -- each looks like a local path
    ("s3:/typo/app", "did you mean s3://typo/app?"),
    ("s3:bucket/app", "did you mean s3://bucket/app?"),
    ("s3a:/b/app", "did you mean s3a://b/app?"),
    ("S3:/b/app", "did you mean s3://b/app?"),
    ("file:/x/y", "file:///x/y"),
    ("hdfs:/nn/path", "did you mean hdfs://nn/path?"),
    ("ftp:host/dir", "'ftp' is not a supported scheme"),
    ("data:2024", "./data:2024"),
    # a scheme without its colon: a relative directory named after the scheme
    ("s3//bucket/app", "did you mean s3://bucket/app?"),
    ("S3//bucket/app", "did you mean s3://bucket/app?"),
    ("s3a///b/app", "did you mean s3a://b/app?"),
    ("hdfs//nn/x", "did you mean hdfs://nn/x?"),
    ("gs//bucket/app", "did you mean gs://bucket/app?"),
    ("abfs//container/app", "did you mean abfs://container/app?"),
    ("file//tmp/x", "file:///tmp/x"),
]


@pytest.mark.parametrize(("uri", "hint"), BROKEN)
def test_scheme_without_slashes_is_refused_not_a_directory(tmp_path: Path, uri: str,
                                                           hint: str) -> None:
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(ConfigError) as info:
            open_store(uri)
        assert os.listdir(tmp_path) == []  # no directory was made on the way
    finally:
        os.chdir(cwd)
    message = str(info.value)
    assert info.value.field == "base_uri" and repr(uri) in message and hint in message
    for scheme in SUPPORTED_SCHEMES:
        assert f"{scheme}://" in message


@pytest.mark.parametrize(("uri", "expected"), [
    ("ftp://host/dir", "not a supported scheme"),
    ("gopher://x/y", "not a supported scheme"),
    ("s 3://b/app", "not a supported scheme"),
    ("://b/app", "not a supported scheme"),
    ("s3://", "s3://bucket/prefix"),
    ("s3:///app", "s3://bucket/prefix"),
    ("s3://b/app?versionId=1", "without '?' or '#'"),
    ("s3://b/app#x", "without '?' or '#'"),
    ("s3://b/app?", "without '?' or '#'"),
    ("s3://b/a//c", "without empty, '.' or '..'"),
    ("s3://b/../c", "without empty, '.' or '..'"),
    ("s3://b/./c", "without empty, '.' or '..'"),
    ("s3://bad bucket/x", "bucket name"),
    ("file://host/x", "file:///absolute/path"),
    ("file://", "file:///absolute/path"),
    ("hdfs://nn:port/x", "numeric port"),
    (" /tmp/x", "surrounding whitespace"),
    ("/tmp/x\n", "control characters"),
    ("/tmp/a\0b", "control characters"),
    ("", "a local path"),
])
def test_malformed_uris_are_refused_before_any_store_is_touched(uri: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_store(uri, validate=False)
    assert expected in str(info.value) and info.value.field == "base_uri"
    with pytest.raises(ConfigError):
        check_store_uri(uri)


@pytest.mark.parametrize("value", [5, b"/tmp/x", None, ["/tmp"]])
def test_a_uri_of_the_wrong_type_is_a_type_error(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        open_store(value)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError) and info.value.field == "base_uri"


def test_credentials_in_a_refused_uri_are_never_shown() -> None:
    with pytest.raises(ConfigError) as info:
        check_store_uri("s3://AKIA:topsecret@bucket/app?x=1")
    assert "topsecret" not in str(info.value) and "topsecret" not in repr(info.value.value)


@pytest.mark.parametrize("good", ["s3://bucket", "s3://bucket/", "s3://Bucket_1.x/a/b",
                                  "s3a://b/app", "memory://x/y", "file:///tmp/x",
                                  "file://localhost/tmp/x", "hdfs://nn:8020/x", "/abs/path",
                                  "rel/path", "./s3:/typo/app", "/x/s3:y", "C:/windows-drive",
                                  "s3/app", "./s3//bucket/app", "data//x", "/s3//b"])
def test_accepted_forms(good: str) -> None:
    assert check_store_uri(good) == good


def test_plain_paths_and_path_objects_are_local_directories(tmp_path: Path) -> None:
    store = open_store(tmp_path / "a")
    assert isinstance(store, LocalBlobStore) and os.path.isdir(tmp_path / "a")
    store.close()
    store = open_store(str(tmp_path / "colon:dir"))  # an absolute path may contain a colon
    assert isinstance(store, LocalBlobStore)
    store.close()


@pytest.mark.parametrize("uri_of", [str, lambda p: f"file://{p}", lambda p: "memory://cfg"])
def test_storage_options_for_a_store_that_takes_none_are_refused(tmp_path: Path,
                                                                 uri_of: object) -> None:
    uri = uri_of(tmp_path / "x")  # type: ignore[operator]
    with pytest.raises(ConfigError, match="storage_options") as info:
        open_store(uri, {"key": "AKIA", "secret": "hidden"})
    assert info.value.field == "storage_options" and "hidden" not in str(info.value)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(("options", "field"), [
    (5, "storage_options"), ({1: "x"}, "storage_options"),
    ({"retries": "many"}, "storage_options['retries']"), ({"retries": 0}, "storage_options['retries']"),
])
def test_bad_storage_options_are_refused(options: object, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_store("s3://bucket/app", options, validate=False)  # type: ignore[arg-type]
    assert info.value.field == field


def test_validate_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="validate"):
        open_store(str(tmp_path), validate="no")  # type: ignore[arg-type]


def test_a_filesystem_that_is_not_an_fsspec_filesystem_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        open_store(str(tmp_path), filesystem=object())  # type: ignore[arg-type]
    assert info.value.field == "filesystem" and isinstance(info.value, TypeError)
