"""The checkpoint coordinator on S3 (a moto server reached through s3fs, no mocked calls).

A few checkpoints with overlapping references and a re-run: after each completion the bucket
holds exactly the retained manifests and the objects they reference (G5); a fresh driver
recovers the same retained set from the bucket; orphan collection removes an abandoned upload.
"""

from __future__ import annotations

import pytest
from support import moto_server
from support.moto_server import s3_storage_options

from dstl.checkpoint.coordinator import CheckpointCoordinator
from dstl.layout import manifest_key, segment_key
from dstl.stores import open_store

pytestmark = pytest.mark.s3
moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket

T0_MS = 1_700_000_000_000


def bucket_keys(endpoint: str, bucket: str) -> set[str]:
    client = moto_server.boto3_client(endpoint)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="job/")
    return {obj["Key"][len("job/"):] for page in pages for obj in page.get("Contents", [])}


def test_retention_on_s3_deletes_exactly_the_unreferenced_objects(moto_endpoint: str,
                                                                  s3_bucket: str) -> None:
    store = open_store(f"s3://{s3_bucket}/job", storage_options=s3_storage_options(moto_endpoint))
    coord = CheckpointCoordinator(store, job_id="clicks", retained=2,
                                  wall_clock=lambda: T0_MS / 1000)
    log: list[str] = []
    for n in range(6):
        seg = segment_key(T0_MS + n, "0123456789ab", n, 0)
        store.put(seg, b"changes %d" % n)
        log = [seg] if n == 3 else [*log, seg]  # n == 3: a materialization truncates the log
        cid = coord.trigger(["op/0", "op/1"])
        assert coord.acknowledge(cid, "op/0", {"n": n}, log, len(log), 1) is None
        assert coord.acknowledge(cid, "op/1", {"n": n}, log[-1:], 1, 1)
        expected = {m.key for m in coord.manifests()} | \
            {k for m in coord.manifests() for k in m.referenced_keys}
        assert bucket_keys(moto_endpoint, s3_bucket) == expected
    # A re-run of the last batch replaces attempt 1.
    rerun = segment_key(T0_MS + 99, "0123456789ab", 99, 0)
    store.put(rerun, b"re-run")
    cid = coord.trigger(["op/0"], checkpoint_id=6)
    assert coord.acknowledge(cid, "op/0", {}, [*log[:-1], rerun], 3, 1)
    assert bucket_keys(moto_endpoint, s3_bucket) == {
        manifest_key(5, 1), manifest_key(6, 2), *log[:-1], rerun}

    # A new driver (and a new store object) sees the same retained checkpoints.
    fresh = open_store(f"s3://{s3_bucket}/job",
                       storage_options=s3_storage_options(moto_endpoint))
    again = CheckpointCoordinator.recover(fresh, "clicks", retained=2)
    assert again.manifests() == coord.manifests()
    abandoned = segment_key(T0_MS - 600_000, "fedcba987654", 0, 0)
    fresh.put(abandoned, b"an upload of a failed batch")
    assert again.collect_orphans(min_age_s=300, now_ms=T0_MS) == [abandoned]
    assert abandoned not in bucket_keys(moto_endpoint, s3_bucket)
    store.close()
    fresh.close()
