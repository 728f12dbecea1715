"""DSTL's write and read paths on the GCS and Azure emulators (tests/support/store_emulators.py),
end to end through ``ChangelogStorage``: segments uploaded write-once, read back by the restore
reader; and the typed errors a user meets first (a missing bucket or container, a wrong key)."""

from __future__ import annotations

from typing import Any

import pytest
from support import store_emulators
from support.store_emulators import azure_storage_options, gcs_storage_options

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import AccessDeniedError
from dstl.segment import decode_segment
from restore import ChangelogReader

gcs_endpoint = store_emulators.gcs_endpoint
gcs_bucket = store_emulators.gcs_bucket
azurite_connection = store_emulators.azurite_connection
azure_container = store_emulators.azure_container

KINDS = [pytest.param("gcs", marks=pytest.mark.xdist_group("gcs-emulator")),
         pytest.param("azure", marks=pytest.mark.xdist_group("azurite"))]


def _store(kind: str, request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """A base URI on a fresh bucket / container of ``kind``, and its storage options."""
    if kind == "gcs":
        return (f"gs://{request.getfixturevalue('gcs_bucket')}/app",
                gcs_storage_options(request.getfixturevalue("gcs_endpoint")))
    return (f"abfs://{request.getfixturevalue('azure_container')}/app",
            azure_storage_options(request.getfixturevalue("azurite_connection")))


@pytest.mark.parametrize("kind", KINDS)
def test_writers_share_a_segment_and_read_back(kind: str, request: pytest.FixtureRequest) -> None:
    uri, opts = _store(kind, request)
    with ChangelogStorage(uri, options=DstlOptions(persist_delay_s=0.3),
                          storage_options=opts) as storage:
        writers = [storage.create_writer(f"op/{i}", KeyGroupRange.of_operator(128, 4, i))
                   for i in range(4)]
        sent: dict[str, list[tuple[int, bytes]]] = {}
        for checkpoint in (1, 2):
            futures = {}
            for w in writers:
                changes = [(kg, b"%s:%d:%d" % (w.log_id.encode(), kg, checkpoint))
                           for kg in w.key_groups]
                for kg, payload in changes:
                    w.append(kg, payload)
                sent.setdefault(w.log_id, []).extend(changes)
                futures[w.log_id] = w.persist(0, checkpoint)
            handles = {k: f.result(60) for k, f in futures.items()}
        objects = list(storage.store.list("dstl/"))
        assert 1 <= len(objects) <= 8, objects
        for info in objects:  # every object is a whole, checksummed segment
            decode_segment(storage.store.get(info.key), info.key)
        reader = ChangelogReader(storage)
        for log_id, handle in handles.items():
            assert sorted(reader.read(handle)) == sorted(sent[log_id])


@pytest.mark.parametrize("kind", KINDS)
def test_missing_bucket_is_access_denied_naming_it(kind: str,
                                                   request: pytest.FixtureRequest) -> None:
    uri, opts = _store(kind, request)
    missing = uri.replace("://dstl-", "://nobucket-", 1)
    with pytest.raises(AccessDeniedError, match="nobucket-"):
        ChangelogStorage(missing, storage_options=opts)


@pytest.mark.xdist_group("azurite")
def test_azure_wrong_key_is_access_denied(azure_container: str, azurite_connection: str) -> None:
    key = azurite_connection.split("AccountKey=", 1)[1].split(";", 1)[0]
    wrong = azurite_connection.replace(key, "A" * (len(key) - 2) + "==")
    with pytest.raises(AccessDeniedError, match=azure_container) as info:
        ChangelogStorage(f"abfs://{azure_container}/app",
                         storage_options=azure_storage_options(wrong))
    assert key not in str(info.value) and "A" * 20 not in str(info.value)
