"""``dstl gc --storage-option`` against S3 (a moto server reached through s3fs, no mocked calls):
the options reach the store (JSON values parsed, plain strings kept), the retained checkpoints
and their objects stay, orphans go, ``--dry-run`` deletes nothing, and the secret never shows.
"""

from __future__ import annotations

import json
import time

import pytest
from support import moto_server
from support.moto_server import DUMMY_KEY, DUMMY_SECRET, REGION, s3_storage_options

from dstl.checkpoint import CheckpointCoordinator
from dstl.cli import main
from dstl.layout import segment_key
from dstl.stores import open_store

pytestmark = pytest.mark.s3
moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket

OLD_MS = int(time.time() * 1000) - 2 * 3_600_000


def _keys(endpoint: str, bucket: str) -> set[str]:
    client = moto_server.boto3_client(endpoint)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="job/")
    return {obj["Key"][len("job/"):] for page in pages for obj in page.get("Contents", [])}


def test_gc_on_s3_with_storage_options(moto_endpoint: str, s3_bucket: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"s3://{s3_bucket}/job"
    store = open_store(uri, s3_storage_options(moto_endpoint))
    coord = CheckpointCoordinator(store, job_id="clicks", retained=2)
    segs = [segment_key(OLD_MS + n, "0123456789ab", n, 0) for n in range(4)]
    for n, seg in enumerate(segs[:3]):
        store.put(seg, b"changes %d" % n)
        cid = coord.trigger(["op/0"])
        assert coord.acknowledge(cid, "op/0", {}, [seg], 1, 1)
    retained = coord.manifests()
    coord.close()
    store.put(segs[3], b"abandoned upload")  # an orphan
    store.close()
    options = ["--storage-option", f"key={DUMMY_KEY}", "--storage-option", f"secret={DUMMY_SECRET}",
               "--storage-option",
               "client_kwargs=" + json.dumps({"endpoint_url": moto_endpoint,
                                              "region_name": REGION}),
               "--storage-option", "retries=2"]
    before = _keys(moto_endpoint, s3_bucket)

    assert main(["gc", uri, "--job", "clicks", "--min-age", "60", "--dry-run", *options]) == 0
    assert _keys(moto_endpoint, s3_bucket) == before
    assert f"would delete {segs[3]}" in capsys.readouterr().out

    assert main(["gc", uri, "--job", "clicks", "--min-age", "60", "--retained", "1",
                 *options]) == 2  # below the job's 2
    assert _keys(moto_endpoint, s3_bucket) == before

    assert main(["gc", uri, "--job", "clicks", "--min-age", "60", *options]) == 0
    captured = capsys.readouterr()
    expected = {m.key for m in retained} | {k for m in retained for k in m.referenced_keys}
    assert _keys(moto_endpoint, s3_bucket) == expected and segs[3] not in expected
    assert DUMMY_SECRET not in captured.out + captured.err


def test_gc_on_s3_without_the_storage_options_fails_without_deleting(
        moto_endpoint: str, s3_bucket: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(f"s3://{s3_bucket}/job", s3_storage_options(moto_endpoint))
    store.put(segment_key(OLD_MS, "0123456789ab", 0, 0), b"orphan")
    store.close()
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    endpoint_only = json.dumps({"endpoint_url": moto_endpoint, "region_name": REGION})
    assert main(["gc", f"s3://{s3_bucket}/job", "--job", "clicks", "--min-age", "0",
                 "--storage-option", f"client_kwargs={endpoint_only}"]) == 2  # fix the options
    assert "AccessDeniedError" in capsys.readouterr().err
    assert len(_keys(moto_endpoint, s3_bucket)) == 1
