"""open_store with bad input fails early, typed, with a message that names the fix.

A missing bucket or missing credentials must fail at open (before anything is written), an
unknown scheme must list the supported ones, and a secret must never appear in any message,
``repr``, ``location`` or log line. An endpoint that cannot be reached at all (a closed port, a
name that does not resolve) fails at open without retries, while a 503 or a reset after
connecting is still retried (through the S3 fault proxy in front of moto).
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import uuid
from pathlib import Path

import fsspec
import pytest
import s3fs
from support import moto_server
from support.faulty_fs import FaultyFileSystem
from support.moto_server import (
    DUMMY_SECRET,
    boto3_client,
    s3_storage_options,
    unique_bucket_name,
)
from support.s3_fault_proxy import FaultProxy, Rule

from dstl import ChangelogStorage
from dstl.errors import (
    AccessDeniedError,
    ClosedError,
    ConfigError,
    StoreUnreachableError,
    TransientStorageError,
)
from dstl.stores import SUPPORTED_SCHEMES, FsspecBlobStore, LocalBlobStore, open_store

# Fixtures of support.moto_server (one server per xdist worker), bound by assignment so that test
# parameters of the same name do not shadow an import.
moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket


def bucket_exists(endpoint: str, name: str) -> bool:
    buckets = boto3_client(endpoint).list_buckets().get("Buckets", [])
    return any(b["Name"] == name for b in buckets)


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        assert DUMMY_SECRET not in text


@pytest.mark.s3
def test_missing_bucket_fails_at_open_naming_the_bucket(
        moto_endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    name = unique_bucket_name("dstl-missing")
    with pytest.raises(AccessDeniedError, match=f"bucket '{name}' does not exist") as info:
        open_store(f"s3://{name}/app", s3_storage_options(moto_endpoint))
    message = str(info.value)
    assert "create it" in message and "storage_options" in message
    assert not bucket_exists(moto_endpoint, name)  # nothing was created on the way
    assert_no_secret(message, repr(info.value), caplog.text)


@pytest.mark.s3
def test_missing_bucket_through_an_injected_filesystem_writes_nothing(
        moto_endpoint: str) -> None:
    inner = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                              **s3_storage_options(moto_endpoint))
    faulty = FaultyFileSystem(inner)
    name = unique_bucket_name("dstl-missing")
    with pytest.raises(AccessDeniedError, match=name):
        open_store(f"s3://{name}/app", filesystem=faulty)
    assert faulty.write_attempts == 0
    assert not bucket_exists(moto_endpoint, name)


@pytest.mark.s3
def test_missing_credentials_fail_at_open_and_say_how_to_pass_them(
        monkeypatch: pytest.MonkeyPatch, moto_endpoint: str, s3_bucket: str,
        tmp_path: Path) -> None:
    for var in list(os.environ):
        if var.startswith("AWS_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    options = {"client_kwargs": {"endpoint_url": moto_endpoint, "region_name": "us-east-1"}}
    with pytest.raises(AccessDeniedError, match="no usable credentials") as info:
        open_store(f"s3://{s3_bucket}/app", options)
    message = str(info.value)
    assert "key/secret" in message and "storage_options" in message
    assert f"s3://{s3_bucket}/app" in message
    assert boto3_client(moto_endpoint).list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 0


@pytest.mark.parametrize("uri", ["ftp://host/dir", "wasb://c/app", "adl://c/app",
                                 "http://example.com/x"])
def test_unknown_scheme_lists_supported_ones(uri: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_store(uri)
    message = str(info.value)
    assert uri in message
    for scheme in SUPPORTED_SCHEMES:
        assert f"{scheme}://" in message
    assert info.value.field == "base_uri"


@pytest.mark.s3
def test_secret_never_appears(moto_endpoint: str, s3_bucket: str,
                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    options = s3_storage_options(moto_endpoint)
    store = open_store(f"s3://{s3_bucket}/app", options)
    store.put("k", b"v")
    errors: list[BaseException] = []
    for call in (lambda: store.get("missing"), lambda: store.put("k", b"again")):
        try:
            call()
        except Exception as exc:
            errors.append(exc)
    store.close()
    # credentials embedded in the URI are refused without echoing them
    try:
        open_store(f"s3://AKIAEXAMPLE:{DUMMY_SECRET}@{s3_bucket}/app")
    except ConfigError as exc:
        errors.append(exc)
    assert len(errors) == 3
    assert_no_secret(store.location, repr(store), caplog.text,
                     *(str(e) for e in errors), *(repr(e) for e in errors))
    assert options["secret"] == DUMMY_SECRET and "retries" not in options  # caller's dict intact


def test_local_root_below_a_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="file"):
        open_store(str(tmp_path / "file" / "sub"))


def test_storage_options_with_filesystem_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="storage_options"):
        open_store(str(tmp_path), {"key": DUMMY_SECRET}, fsspec.filesystem("file"))


@pytest.mark.s3
def test_open_store_picks_the_backend(tmp_path: Path, moto_endpoint: str,
                                      s3_bucket: str) -> None:
    assert isinstance(open_store(str(tmp_path / "a")), LocalBlobStore)
    assert isinstance(open_store(f"file://{tmp_path}/b"), LocalBlobStore)
    assert (tmp_path / "b").is_dir()
    memory = open_store(f"memory://open-store-{uuid.uuid4().hex}")
    assert isinstance(memory, FsspecBlobStore)
    options = s3_storage_options(moto_endpoint)
    options["config_kwargs"] = {"retries": {"max_attempts": 2}}
    snapshot = copy.deepcopy(options)
    s3a = open_store(f"s3a://{s3_bucket}/app/", options)
    assert s3a.location == f"s3a://{s3_bucket}/app"
    s3a.put("k", b"v")
    assert open_store(f"s3://{s3_bucket}/app", options).get("k") == b"v"
    assert options == snapshot  # botocore must not have rewritten the caller's dict


def test_use_after_close_is_refused() -> None:
    store = open_store(f"memory://closed-{uuid.uuid4().hex}")
    store.close()
    with pytest.raises(ClosedError):
        store.put("k", b"v")
    with pytest.raises(ClosedError):
        store.list()


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_endpoint_that_refuses_connections_fails_at_open_without_retries() -> None:
    port = _closed_port()
    with pytest.raises(StoreUnreachableError) as e:
        ChangelogStorage("s3://bucket/app",
                         storage_options=s3_storage_options(f"http://127.0.0.1:{port}"))
    err = e.value
    assert isinstance(err, ConnectionError) and not isinstance(err, TransientStorageError)
    assert (err.location, err.endpoint) == ("s3://bucket/app", f"127.0.0.1:{port}")
    assert str(err).startswith(f"open s3://bucket/app: no connection to 127.0.0.1:{port} could "
                               "be made: the endpoint refused the connection")
    assert "nothing is retried: check the URI, the endpoint (storage_options' endpoint_url)" \
        in str(err)


def test_a_gcs_endpoint_whose_name_does_not_resolve_fails_at_open() -> None:
    """The probe runs before gcsfs is built: gcsfs's own retries (about 30 s per call, and
    about 15 s of credential lookups without a network) never start."""
    with pytest.raises(StoreUnreachableError) as e:
        open_store("gs://bucket/app", {"endpoint_url": "https://storage.invalid",
                                       "token": "anon"})
    assert e.value.endpoint == "storage.invalid:443"
    assert "open gs://bucket/app: no connection to storage.invalid:443 could be made: the host " \
        "name does not resolve" in str(e.value)


@pytest.mark.parametrize("kind", ["slowdown", "reset"])
def test_a_fault_after_connecting_is_still_retried_at_open(moto_endpoint: str, s3_bucket: str,
                                                           kind: str) -> None:
    proxy = FaultProxy.start(moto_endpoint)
    try:
        proxy.set_rules(Rule("head", kind, count=2))       # the HeadBucket of the open, twice
        store = open_store(f"s3://{s3_bucket}/app", s3_storage_options(proxy.endpoint))
        store.close()
        assert proxy.injected("head", kind) == 2
        assert proxy.stats()["requests"]["head"] == 3      # two faults, then the one that passed
    finally:
        proxy.stop()
