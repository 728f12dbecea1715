"""Gs:// and abfs:// are accepted only when the installed filesystem package
can create an object only if absent (DSTL's objects are write-once), otherwise a ConfigError
names the package; hdfs:// without its client package (hdfs-native) is a ConfigError saying what
to install, and its options are checked by name and type.

No GCS or Azure service (or emulator) runs here: the packages are replaced by fakes that have,
or lack, the write-once primitive, which is what the decision looks at."""

from __future__ import annotations

import sys
import types
import uuid
from typing import Any

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from dstl.errors import ConfigError, ObjectExistsError
from dstl.stores import GCSFS_MIN_VERSION, FsspecBlobStore, check_store_uri, open_store
from dstl.stores.fsspec_store import write_once_primitive


class ResourceExistsError(Exception):
    """Named like azure.core's: what older adlfs lets through on a conditional upload."""


class FakeAzure(MemoryFileSystem):
    """adlfs's shape: protocol abfs/az, ``pipe_file(path, value, overwrite=True, **kw)``."""

    protocol = ("abfs", "az")
    made: list[dict[str, Any]] = []

    def __init__(self, **kwargs: Any) -> None:
        FakeAzure.made.append(kwargs)
        super().__init__()

    def pipe_file(self, path: str, value: bytes, overwrite: bool = True,  # type: ignore[override]
                  **kwargs: Any) -> None:
        if not overwrite and self.exists(path):
            raise ResourceExistsError("BlobAlreadyExists")
        super().pipe_file(path, value)


class OldGcs(MemoryFileSystem):
    """gcsfs before 2024.12: ``pipe_file`` has no ``mode``."""

    protocol = ("gs", "gcs")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:  # type: ignore[override]
        super().pipe_file(path, value)


class NewGcs(MemoryFileSystem):
    protocol = ("gs", "gcs")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()


def _module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> None:
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)


@pytest.mark.parametrize(("uri", "package"), [("gs://bucket/app", "gcsfs>=2024.12.0"),
                                              ("gcs://bucket/app", "gcsfs>=2024.12.0"),
                                              ("abfs://container/app", "adlfs"),
                                              ("az://container/app", "adlfs")])
def test_missing_package_is_named(monkeypatch: pytest.MonkeyPatch, uri: str,
                                  package: str) -> None:
    monkeypatch.setitem(sys.modules, package.split(">")[0], None)  # import fails
    with pytest.raises(ConfigError, match=f"pip install '{package}'") as info:
        open_store(uri, validate=False)
    assert info.value.field == "base_uri"


def test_gcsfs_without_create_mode_is_refused_and_with_it_accepted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _module(monkeypatch, "gcsfs", GCSFileSystem=OldGcs, __version__="2024.6.0")
    with pytest.raises(ConfigError, match=rf"gcsfs>={GCSFS_MIN_VERSION}.*2024\.6\.0"):
        open_store("gs://bucket/app", validate=False)
    _module(monkeypatch, "gcsfs", GCSFileSystem=NewGcs, __version__="2024.12.0")
    store = open_store(f"gs://bucket/app-{uuid.uuid4().hex}", validate=False)
    try:
        assert isinstance(store, FsspecBlobStore) and store.location.startswith("gs://bucket/")
        assert write_once_primitive(store.filesystem) == "mode"
        store.put("k", b"one")
        with pytest.raises(ObjectExistsError):
            store.put("k", b"two")
        assert store.get("k") == b"one"
    finally:
        store.close()


def test_adlfs_writes_once_with_overwrite_false_and_names_the_account(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _module(monkeypatch, "adlfs", AzureBlobFileSystem=FakeAzure)
    FakeAzure.made.clear()
    container = f"c{uuid.uuid4().hex[:8]}"
    uri = f"abfs://{container}@acct.dfs.core.windows.net/app"
    assert check_store_uri(uri) == uri
    store = open_store(uri, {"credential": "x"}, validate=False)
    try:
        assert FakeAzure.made[-1]["account_name"] == "acct"
        assert write_once_primitive(store.filesystem) == "overwrite"
        store.put("seg", b"bytes")
        store.put("seg", b"bytes")  # a resend of the same bytes is its own landing
        with pytest.raises(ObjectExistsError):
            store.put("seg", b"other")
        assert store.get("seg") == b"bytes"
    finally:
        store.close()


@pytest.mark.parametrize("bad", ["abfs://user:pw@acct.dfs.core.windows.net/app",
                                 "abfs://bad container/app", "az://@acct/app",
                                 "gs://bad bucket/x"])
def test_malformed_cloud_uris_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError):
        check_store_uri(bad)


def test_hdfs_without_its_client_package_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hdfs_native", None)  # as if not installed
    with pytest.raises(ConfigError, match="hdfs-native") as info:
        open_store("hdfs://localhost:8020/app", validate=False)
    assert "pip install" in str(info.value)


def test_hdfs_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="replicaton") as info:
        open_store("hdfs://localhost:8020/app", {"replicaton": 2}, validate=False)
    assert "config=" in str(info.value)  # where Hadoop settings go
    with pytest.raises(ConfigError, match="replication"):
        open_store("hdfs://localhost:8020/app", {"replication": 0}, validate=False)
    with pytest.raises(ConfigError, match="config"):
        open_store("hdfs://localhost:8020/app", {"config": {"dfs.replication": [2]}},
                   validate=False)
