"""The write path against S3 (a moto server reached through s3fs, no mocked calls)."""

from __future__ import annotations

import threading

import pytest
from support import moto_server
from support.moto_server import s3_storage_options

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import AccessDeniedError
from dstl.segment import decode_segment
from restore import ChangelogReader

pytestmark = pytest.mark.s3
moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket


def test_eight_writers_in_one_window_write_exactly_one_object(moto_endpoint: str,
                                                              s3_bucket: str) -> None:
    opts = DstlOptions(persist_delay_s=0.5)  # a window wide enough for all eight
    with ChangelogStorage(f"s3://{s3_bucket}/app", options=opts,
                          storage_options=s3_storage_options(moto_endpoint)) as storage:
        writers = [storage.create_writer(f"op/{i}", KeyGroupRange.of_operator(128, 8, i))
                   for i in range(8)]
        sent = {}
        for w in writers:
            changes = [(kg, b"%s:%d" % (w.log_id.encode(), kg)) for kg in w.key_groups] * 3
            for kg, p in changes:
                w.append(kg, p)
            sent[w.log_id] = sorted(changes, key=lambda c: c[0])
        barrier = threading.Barrier(8)
        futures: dict[str, object] = {}

        def persist(w: object) -> None:
            barrier.wait()
            futures[w.log_id] = w.persist(0, 1)  # type: ignore[attr-defined]

        threads = [threading.Thread(target=persist, args=(w,), name=f"test-persist-{i}")
                   for i, w in enumerate(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        handles = {k: f.result(30) for k, f in futures.items()}  # type: ignore[attr-defined]
        objects = list(storage.store.list("dstl/"))
        assert len(objects) == 1, objects
        assert {k for h in handles.values() for k in h.segment_keys()} == {objects[0].key}
        seg = decode_segment(storage.store.get(objects[0].key), objects[0].key)
        assert sorted(e.log_id for e in seg.entries) == sorted(sent)
        reader = ChangelogReader(storage)
        for log_id, h in handles.items():
            assert list(reader.read(h)) == sent[log_id]
        assert storage.metrics()["ChangelogStorage.numberOfSegments"] == 1


def test_missing_bucket_fails_before_any_write(moto_endpoint: str) -> None:
    with pytest.raises(AccessDeniedError, match="no-such-bucket"):
        ChangelogStorage("s3://no-such-bucket/app",
                         storage_options=s3_storage_options(moto_endpoint))
