"""``hdfs://`` stores on a real HDFS: a MiniDFSCluster (one NameNode, two DataNodes) per pytest
worker, started by ``tests/support/minidfs.py`` (the store contract suite's HDFS run shares it).

- write-once: racing creates without overwrite (the primitive) and racing puts (DSTL's
  temp file + rename without overwrite): exactly one wins, the object holds its bytes;
- typed errors naming the object and the fix: permission denied, safe mode, the NameNode down,
  a file whose writer still holds the lease;
- HA name services: a name service whose first NameNode is down fails over to the second;
- the log on HDFS: uploads while the NameNode restarts (every acknowledged change set readable
  afterwards), a restore through the restore cache, DataNode loss with replication 1 (typed
  error) and 2 (transparent);
- operations: ``dstl verify``, ``dstl gc``, ``dstl state dump`` and ``dstl checkpoints`` on a
  job whose state is on HDFS, the log demo (``dstl demo --log-only --state-uri hdfs://...``); with ``DSTL_DEEP=1`` also
  restores across a NameNode restart. The Spark jobs on HDFS: ``tests/integration/spark/test_spark_hdfs.py``.

Faults go through the cluster's own seams (its NameNode restart, DataNode stop, safe mode), never
through patched calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
from hdfs_native import Client, WriteOptions
from support.minidfs import MiniDfs, hdfs_uri
from support.state_job import MiniJob, state_of

from dstl import ChangelogHandle, ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.cli import main
from dstl.errors import (
    AccessDeniedError,
    DstlError,
    ObjectExistsError,
    StorageError,
    TransientStorageError,
)
from dstl.layout import segment_key
from dstl.reader import from_json
from dstl.retry import RetryPolicy
from dstl.stores import HdfsBlobStore, open_store, translate_error
from restore import ChangelogReader, LocalFileCache

pytestmark = pytest.mark.hdfs

DEEP = os.environ.get("DSTL_DEEP") == "1"
ROOT = Path(__file__).resolve().parents[3]
#: Read retries of the fault tests: a few quick attempts, so a down NameNode is a typed error
#: within seconds.
QUICK_RETRY = RetryPolicy(max_attempts=3, backoff_base_s=0.05, backoff_max_s=0.2,
                          deadline_s=5.0)


def _client(cluster: MiniDfs) -> Client:
    return Client(f"hdfs://{cluster.namenode}", {"dfs.client.failover.max.attempts": "0"})


@pytest.fixture
def store(hdfs_cluster: MiniDfs) -> Iterator[HdfsBlobStore]:
    s = open_store(hdfs_uri(hdfs_cluster, "store"), retry=QUICK_RETRY)
    assert isinstance(s, HdfsBlobStore)
    yield s
    s.close()


# --------------------------------------------------------------------------- write-once


def test_racing_creates_without_overwrite_have_one_winner(hdfs_cluster: MiniDfs) -> None:
    """HDFS's create without overwrite is decided on the NameNode: of 8 clients creating one
    path at the same instant exactly one gets it, the others FileExistsError."""
    path = f"/dstl-tests/race-{uuid.uuid4().hex}/obj"
    clients = [_client(hdfs_cluster) for _ in range(8)]
    clients[0].mkdirs(path.rpartition("/")[0], 0o755, True)
    barrier = threading.Barrier(len(clients))
    outcome: dict[int, str] = {}

    def create(i: int) -> None:
        barrier.wait()
        try:
            writer = clients[i].create(path, WriteOptions(overwrite=False))
        except FileExistsError:
            outcome[i] = "exists"
            return
        writer.write(b"writer %d" % i)
        writer.close()
        outcome[i] = "created"

    threads = [threading.Thread(target=create, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [i for i, o in outcome.items() if o == "created"]
    assert len(outcome) == len(clients) and len(winners) == 1, outcome
    reader = clients[0].read(path)
    assert reader.read_range(0, len(reader)) == b"writer %d" % winners[0]


def test_racing_puts_of_one_key_have_one_winner(store: HdfsBlobStore) -> None:
    """DSTL's put (temp file, then rename without overwrite): one of 8 racing puts of a key
    publishes it, the others get ObjectExistsError, and no temp file is left."""
    barrier = threading.Barrier(8)
    results: dict[int, str] = {}

    def put(i: int) -> None:
        barrier.wait()
        try:
            store.put("checkpoints/manifest", b"manifest of writer %d" % i)
            results[i] = "won"
        except ObjectExistsError as exc:
            assert "checkpoints/manifest" in str(exc)
            results[i] = "exists"

    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [i for i, r in results.items() if r == "won"]
    assert len(results) == 8 and len(winners) == 1, results
    assert store.get("checkpoints/manifest") == b"manifest of writer %d" % winners[0]
    client = store._client
    names = [s.path for s in client.list_status(store._root, True)]
    assert not [n for n in names if n.endswith(".tmp")], names


# --------------------------------------------------------------------------- typed errors


def test_permission_denied_names_the_object_and_the_fix(hdfs_cluster: MiniDfs,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    uri = hdfs_uri(hdfs_cluster, "locked")
    path = uri.split(hdfs_cluster.namenode, 1)[1]
    _client(hdfs_cluster).mkdirs(path, 0o700, True)  # owned by the cluster's superuser
    monkeypatch.setenv("HADOOP_USER_NAME", "alice")  # how Hadoop clients pick the simple user
    with pytest.raises(AccessDeniedError) as opening:
        open_store(uri, retry=QUICK_RETRY)  # refused at open, before any data is written
    assert uri in str(opening.value) and "user=alice" in str(opening.value)
    store = open_store(uri, retry=QUICK_RETRY, validate=False)
    try:
        with pytest.raises(AccessDeniedError) as info:
            store.put("dstl/seg", b"x")
        text = str(info.value)
        assert "dstl/seg" in text and "user=alice" in text and "chown" in text
        assert "HADOOP_USER_NAME" in text and info.value.key == "dstl/seg"
    finally:
        store.close()


def test_safe_mode_is_a_transient_error_and_reads_go_on(hdfs_cluster: MiniDfs,
                                                        store: HdfsBlobStore) -> None:
    store.put("dstl/a", b"before")
    hdfs_cluster.safe_mode(True)
    try:
        with pytest.raises(TransientStorageError) as info:
            store.put("dstl/b", b"during")
        assert "dstl/b" in str(info.value) and "safe mode" in str(info.value)
        assert "dfsadmin -safemode leave" in str(info.value)
        assert store.get("dstl/a") == b"before"
    finally:
        hdfs_cluster.safe_mode(False)
    store.put("dstl/b", b"after")
    assert store.get("dstl/b") == b"after"


def test_a_file_still_being_written_is_a_typed_error(hdfs_cluster: MiniDfs,
                                                     store: HdfsBlobStore) -> None:
    """Another client holds the lease of a file at a key (its writer is alive, or died less
    than the lease's soft limit ago): reading it and creating it name the lease."""
    other = _client(hdfs_cluster)
    path = f"{store._root}/snapshots/open"
    writer = other.create(path, WriteOptions(overwrite=False, create_parent=True))
    writer.write(b"partial bytes")
    writer.hsync()
    try:
        with pytest.raises(StorageError, match="still being written") as info:
            store.get("snapshots/open")
        assert "recoverLease" in str(info.value) and info.value.key == "snapshots/open"
        with pytest.raises(FileExistsError) as raw:
            _client(hdfs_cluster).create(path, WriteOptions(overwrite=False))
        err = translate_error(raw.value, op="put", key="snapshots/open",
                              location=store.location)
        assert isinstance(err, ObjectExistsError), err
        assert "snapshots/open" in str(err) and "lease" in str(err)
        assert "recoverLease" in str(err)
    finally:
        writer.close()
    assert store.get("snapshots/open") == b"partial bytes"


_DEAD_WRITER = """
import os, sys
from hdfs_native import Client, WriteOptions
client = Client(sys.argv[1], {"dfs.client.failover.max.attempts": "0"})
writer = client.create(sys.argv[2], WriteOptions(overwrite=False, create_parent=True))
writer.write(b"half of a segment")
writer.hsync()
print("written", flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_lease_held_by_a_dead_writer(hdfs_cluster: MiniDfs, store: HdfsBlobStore) -> None:
    """A writer SIGKILLed with a file open leaves it under construction, its lease held by a
    client that is gone: reading it and putting its key are typed errors naming the lease, and
    once the lease is recovered the file is readable (never replaced)."""
    path = f"{store._root}/dstl/held"
    done = subprocess.run([sys.executable, "-c", _DEAD_WRITER, f"hdfs://{hdfs_cluster.namenode}",
                           path], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == -9 and "written" in done.stdout, done.stderr[-2000:]
    with pytest.raises(StorageError, match="still being written") as reading:
        store.get("dstl/held")
    assert "recoverLease" in str(reading.value)
    with pytest.raises(StorageError, match=r"still being written|lease"):
        store.put("dstl/held", b"another writer's bytes")
    client = _client(hdfs_cluster)
    deadline = time.monotonic() + 60
    while not client.recover_lease(path):  # what `hdfs debug recoverLease` does
        assert time.monotonic() < deadline, "lease not recovered within 60 s"
        time.sleep(0.5)
    assert store.get("dstl/held") == b"half of a segment"


def test_namenode_down_is_a_transient_error_within_the_deadline(hdfs_cluster: MiniDfs,
                                                                store: HdfsBlobStore) -> None:
    store.put("dstl/x", b"x")
    hdfs_cluster.stop_namenode()
    try:
        started = time.monotonic()
        with pytest.raises(TransientStorageError) as info:
            store.get("dstl/x")
        assert time.monotonic() - started < 10.0  # DSTL's retry policy, not the client's
        text = str(info.value)
        assert "dstl/x" in text and "unreachable" in text and "NameNode" in text
    finally:
        hdfs_cluster.start_namenode()
    assert store.get("dstl/x") == b"x"


def test_an_ha_name_service_fails_over_to_the_live_namenode(hdfs_cluster: MiniDfs) -> None:
    """``hdfs://<nameservice>/path`` with two NameNodes configured, the first of them down (no
    process at its address): the client fails over to the second."""
    dead = f"127.0.0.1:{_free_port()}"
    config = {"dfs.nameservices": "dstlns", "dfs.ha.namenodes.dstlns": "nn1,nn2",
              "dfs.namenode.rpc-address.dstlns.nn1": dead,
              "dfs.namenode.rpc-address.dstlns.nn2": hdfs_cluster.namenode,
              "dfs.client.failover.proxy.provider.dstlns":
                  "org.apache.hadoop.hdfs.server.namenode.ha.ConfiguredFailoverProxyProvider"}
    path = f"/dstl-tests/ha-{uuid.uuid4().hex[:8]}"
    store = open_store(f"hdfs://dstlns{path}", {"config": config}, retry=QUICK_RETRY)
    try:
        assert store.location == f"hdfs://dstlns{path}"
        store.put("dstl/seg", b"through the name service")
        assert store.get("dstl/seg") == b"through the name service"
    finally:
        store.close()
    direct = open_store(hdfs_cluster.uri(path))
    assert direct.get("dstl/seg") == b"through the name service"
    direct.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- the log on HDFS


def _append_and_persist(storage: ChangelogStorage, writer_ids: list[str], rounds: int,
                        acked: dict[str, list[ChangelogHandle]],
                        failed: list[BaseException], on_round: threading.Event) -> None:
    writers = [storage.create_writer(w, KeyGroupRange(0, 7)) for w in writer_ids]
    sqn = {w.log_id: 0 for w in writers}
    for r in range(rounds):
        futures: list[tuple[str, Future[ChangelogHandle]]] = []
        for w in writers:
            for kg in range(8):
                w.append(kg, f"{w.log_id}:{r}:{kg}".encode())
            futures.append((w.log_id, w.persist(sqn[w.log_id], r + 1)))
        for log_id, fut in futures:
            try:
                acked[log_id].append(fut.result(120))
            except DstlError as exc:
                failed.append(exc)
        on_round.set()
    for w in writers:
        w.close()


def test_uploads_survive_a_namenode_restart(hdfs_cluster: MiniDfs) -> None:
    """Writers persist change sets while the NameNode restarts: every acknowledged change set
    reads back afterwards (G1), a failed one fails with a typed error, and the log goes on."""
    uri = hdfs_uri(hdfs_cluster, "restart")
    options = DstlOptions(persist_delay_s=0.05, upload_retry_delay_s=0.5,
                          upload_max_attempts=40, upload_timeout_s=30.0)
    acked: dict[str, list[ChangelogHandle]] = {"op/0": [], "op/1": []}
    failed: list[BaseException] = []
    first_round = threading.Event()
    with ChangelogStorage(uri, options=options) as storage:
        worker = threading.Thread(target=_append_and_persist,
                                  args=(storage, list(acked), 12, acked, failed, first_round))
        worker.start()
        assert first_round.wait(120)
        hdfs_cluster.restart_namenode()
        worker.join(300)
        assert not worker.is_alive()
        assert all(isinstance(e, DstlError) for e in failed), failed
        assert sum(len(v) for v in acked.values()) >= 12  # it resumed after the restart
        reader = ChangelogReader(storage)
        for log_id, handles in acked.items():
            for handle in handles:
                got = list(reader.read(handle))
                assert got, handle
                assert all(p.decode().startswith(log_id + ":") for _, p in got)


def test_restore_through_the_cache_reads_each_segment_once(hdfs_cluster: MiniDfs,
                                                           tmp_path: Path) -> None:
    uri = hdfs_uri(hdfs_cluster, "cache")
    with ChangelogStorage(uri, options=DstlOptions(persist_delay_s=0.01)) as storage:
        writers = [storage.create_writer(f"op/{i}", KeyGroupRange(i * 4, i * 4 + 3))
                   for i in range(3)]
        for w in writers:
            for kg in w.key_groups:
                w.append(kg, b"%d" % kg)
        futures = [w.persist(0, 1) for w in writers]
        handles = [f.result(60) for f in futures]
        direct = [list(ChangelogReader(storage).read(h)) for h in handles]
        with LocalFileCache(tmp_path / "cache") as cache:
            cached = [list(ChangelogReader(storage, cache=cache).read(h)) for h in handles]
            stats = cache.stats()
        segments = list(storage.store.list("dstl/"))
        assert cached == direct
        # each segment object downloaded once, every other read of it a hit
        assert stats["downloads"] == len(segments)
        assert stats["hits"] == len(handles) - len(segments)
        assert stats["bytes_downloaded"] == sum(s.size for s in segments)
        assert stats["leases_open"] == 0
        for w in writers:
            w.close()


@pytest.mark.skipif(not DEEP, reason="a restore across a NameNode restart runs with DSTL_DEEP=1")
def test_a_restore_across_a_namenode_restart(hdfs_cluster: MiniDfs, tmp_path: Path) -> None:
    """Readers restore change sets while the NameNode restarts: each read returns exactly what
    was written or fails with a typed transient error, and reads after the restart succeed."""
    uri = hdfs_uri(hdfs_cluster, "restore-restart")
    with ChangelogStorage(uri, options=DstlOptions(persist_delay_s=0.01)) as storage:
        writer = storage.create_writer("op/0", KeyGroupRange(0, 15))
        handles = []
        for r in range(6):
            start = writer.next_sqn()
            for kg in range(16):
                writer.append(kg, b"%d:%d" % (r, kg))
            handles.append(writer.persist(start, r + 1).result(120))
        expected = [list(ChangelogReader(storage).read(h)) for h in handles]
        outcomes: list[str] = []
        stop = threading.Event()

        def restore() -> None:
            while not stop.is_set():
                for h, want in zip(handles, expected):
                    try:
                        with LocalFileCache(tmp_path / f"c{len(outcomes)}") as cache:
                            got = list(ChangelogReader(storage, cache=cache).read(h))
                        outcomes.append("ok" if got == want else "WRONG")
                    except TransientStorageError:
                        outcomes.append("transient")

        reader = threading.Thread(target=restore)
        reader.start()
        hdfs_cluster.restart_namenode()
        stop.set()
        reader.join(120)
        assert "WRONG" not in outcomes and "ok" in outcomes, outcomes
        assert [list(ChangelogReader(storage).read(h)) for h in handles] == expected
        writer.close()


@pytest.mark.parametrize("replication", [1, 2])
def test_a_lost_datanode(hdfs_cluster: MiniDfs, replication: int) -> None:
    """Replication 1: the object's only DataNode stopped, a read is a typed error naming the
    object and the fix; replication 2: the other replica serves it."""
    store = open_store(hdfs_uri(hdfs_cluster, f"dn{replication}"),
                       {"replication": replication}, retry=QUICK_RETRY)
    assert isinstance(store, HdfsBlobStore)
    data = os.urandom(300_000)
    store.put("snapshots/s", data)
    hdfs_cluster.stop_datanode_of(f"{store._root}/snapshots/s")
    try:
        if replication == 1:
            with pytest.raises(TransientStorageError) as info:
                store.get("snapshots/s")
            text = str(info.value)
            assert "snapshots/s" in text and "replication" in text and "DataNode" in text
        else:
            assert store.get("snapshots/s") == data
            assert store.get_range("snapshots/s", 1000, 10) == data[1000:1010]
    finally:
        hdfs_cluster.start_datanodes()
        store.close()


# --------------------------------------------------------------------------- operations


class _Row:
    """A dumped state row as the model compares it (attributes, like a Spark Row)."""

    def __init__(self, d: dict[str, object]) -> None:
        for f in ("key", "namespace", "user_key", "value"):
            d[f] = from_json(json.dumps(d[f])) if d[f] is not None else None
        self.__dict__.update(d)


def test_verify_gc_state_and_checkpoints_on_hdfs(hdfs_cluster: MiniDfs,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    uri = hdfs_uri(hdfs_cluster, "cli")
    store = open_store(uri)
    job = MiniJob(store, partitions=2, seed=7, retained=1)
    job.run(60)
    job.checkpoint()
    job.materialize()
    job.run(30)
    job.checkpoint()
    job.close()
    orphan = segment_key(int(time.time() * 1000) - 2 * 3_600_000, "0123456789ab", 0, 0)
    store.put(orphan, b"an abandoned upload")
    store.close()
    assert main(["checkpoints", "list", uri, "--json"]) == 0
    listed = [json.loads(x)["checkpoint"] for x in capsys.readouterr().out.splitlines()]
    assert listed == [1]
    assert main(["verify", uri, "--job", "job"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("OK")
    # the state reader restores the checkpoint from HDFS
    assert main(["state", "dump", uri]) == 0
    rows = [_Row(json.loads(x)) for x in capsys.readouterr().out.splitlines()]
    assert state_of(rows) == job.checkpoint_models[1]
    assert main(["gc", uri, "--job", "job", "--min-age", "0"]) == 0
    assert "objects deleted from" in capsys.readouterr().out
    after = open_store(uri)
    assert after.head(orphan) is None
    after.close()
    assert main(["verify", uri, "--job", "job"]) == 0  # gc kept what the checkpoint needs


def test_log_demo_on_hdfs(hdfs_cluster: MiniDfs, capsys: pytest.CaptureFixture[str]) -> None:
    uri = hdfs_uri(hdfs_cluster, "demo")
    assert main(["demo", "--log-only", "--state-uri", uri, "--writers", "3", "--threads", "2",
                 "--seconds", "1.0", "--checkpoint-interval", "0.2"]) == 0
    out = capsys.readouterr().out
    assert f"store {uri}" in out and out.rstrip().endswith("changes: OK")
