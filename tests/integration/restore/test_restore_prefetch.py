"""Restore with prefetch against S3: a moto server reached through s3fs, no mocked
calls. Snapshots of both formats (v1 written by a heap backend, v2 file-level written by LMDB),
restored into heap and LMDB.

- In process (``LocalFileCache``): prefetch on equals prefetch off equals no cache; each object is
  fetched once (``cat_file`` calls of the ``FaultyFileSystem`` around s3fs); a missing object, a
  corrupt one and a store error give the restore the same typed error naming the same object as
  without prefetch; a failure of the prefetch alone is forgotten (the restore succeeds); a tiny
  budget raises ``CacheFullError`` exactly when the restore without prefetch does.
- Through the executor agent (a real agent process whose storage reaches moto through the S3
  fault proxy, which counts the GETs on the wire): the same states, each object GET once per
  agent, whichever worker restores.
- A restoring process SIGKILLed while prefetching leaves a cache directory that the next process
  opens cleanly and restores through.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import s3fs
from support import moto_server
from support.faulty_fs import FaultyFileSystem, permanent_error
from support.moto_server import (
    create_bucket,
    delete_bucket,
    s3_storage_options,
    unique_bucket_name,
)
from support.s3_fault_proxy import FaultProxy

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import (
    CacheFullError,
    CorruptObjectError,
    DstlError,
    ObjectNotFoundError,
    StorageError,
    UsageError,
)
from dstl.spark.agent import AgentCache, AgentCacheService, AgentClient, ensure_agent
from dstl.spark.agent.protocol import CacheStatsRequest, ShutdownRequest
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle
from materializer.options import BackendOptions
from materializer.states import ValueStateDescriptor
from restore import LocalFileCache, restore_backend

pytestmark = pytest.mark.s3
moto_endpoint = moto_server.moto_endpoint

MP = 32
WAIT = 30.0
KEYS = [f"k{i}" for i in range(300)]
OPTS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
DOPTS = DstlOptions(persist_delay_s=0.0)
KGS = KeyGroupRange(0, MP - 1)
REPO = Path(__file__).resolve().parents[3]
CHILD = REPO / "tests" / "support" / "prefetch_child.py"


@dataclass
class Data:
    uri: str
    root: str  # the s3fs path of uri
    ffs: FaultyFileSystem
    handles: dict[str, ChangelogStateBackendHandle]  # by the table that wrote them
    models: dict[str, dict[str, int]]

    def storage(self) -> ChangelogStorage:
        return ChangelogStorage(self.uri, options=DOPTS, filesystem=self.ffs)

    def gets(self, keys: list[str]) -> list[int]:
        return [self.ffs.calls("cat_file", f"{self.root}/{k}") for k in keys]


def _write(storage: ChangelogStorage, table: str) -> tuple[ChangelogStateBackendHandle,
                                                           dict[str, int]]:
    """A snapshot (heap: v1, LMDB: v2) of 300 keys and four checkpoints of log after it."""
    b = ChangelogKeyedStateBackend(storage, f"op-{table}", KGS, MP, table=table, options=OPTS)
    st = b.get_state(ValueStateDescriptor("v"))
    model: dict[str, int] = {}
    for i, k in enumerate(KEYS):
        b.set_current_key(k)
        st.update(i)
        model[k] = i
    b.snapshot(1).result(WAIT)
    b.notify_checkpoint_complete(1)
    assert b.materialize_now(WAIT) is not None
    handle = None
    for cp in range(2, 6):
        for i in range(0, len(KEYS), cp):
            b.set_current_key(KEYS[i])
            st.update(i * cp)
            model[KEYS[i]] = i * cp
        handle = b.snapshot(cp).result(WAIT)
        b.notify_checkpoint_complete(cp)
    b.close()
    assert handle is not None and handle.materialized
    assert len({r.key for n in handle.non_materialized for r in n.change_sets}) >= 4
    return handle, model


@pytest.fixture(scope="module")
def data(moto_endpoint: str) -> Iterator[Data]:
    bucket = create_bucket(moto_endpoint, unique_bucket_name("dstl-prefetch"))
    inner = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False,
                              **s3_storage_options(moto_endpoint))
    ffs = FaultyFileSystem(inner)
    d = Data(f"s3://{bucket}/job", f"{bucket}/job", ffs, {}, {})
    with d.storage() as storage:
        for table in ("heap", "lmdb"):
            d.handles[table], d.models[table] = _write(storage, table)
    try:
        yield d
    finally:
        delete_bucket(moto_endpoint, bucket)


def _values(b: ChangelogKeyedStateBackend) -> dict[str, int]:
    try:
        st = b.get_state(ValueStateDescriptor("v"))
        out = {}
        for k in KEYS:
            b.set_current_key(k)
            out[k] = st.value()
        return out
    finally:
        b.close()


def _objects(h: ChangelogStateBackendHandle) -> list[str]:
    return list(dict.fromkeys(h.referenced_keys()))


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dstl-prefetch"]


# --------------------------------------------------------------------------- in process


@pytest.mark.parametrize("made_by", ["heap", "lmdb"])
def test_prefetch_restores_the_same_state_and_gets_each_object_once(
        data: Data, tmp_path: Path, made_by: str) -> None:
    handle, model = data.handles[made_by], data.models[made_by]
    objects = _objects(handle)
    with data.storage() as storage:
        for table in ("heap", "lmdb"):
            assert _values(restore_backend([handle], storage, KGS, table=table,
                                           options=OPTS)) == model  # no cache
            for prefetch in (False, True):
                before = data.gets(objects)
                with LocalFileCache(tmp_path / f"{table}-{prefetch}") as cache:
                    got = _values(restore_backend([handle], storage, KGS, table=table,
                                                  cache=cache, options=OPTS, prefetch=prefetch))
                    st = cache.stats()
                assert got == model, (table, prefetch)
                assert [a - b for a, b in zip(data.gets(objects), before)] == [1] * len(objects)
                assert st["downloads"] == len(objects)
                if prefetch:
                    # the leases found (or joined) what the prefetch fetched, or raced it; a job
                    # still queued when the restore ended was dropped (cancelled)
                    assert st["prefetch_started"] + st["prefetch_present"] \
                        + st["prefetch_cancelled"] == len(objects)
                    assert st["prefetch_joined"] == st["prefetch_started"] > 0
                else:
                    assert st["prefetch_started"] == st["prefetch_present"] == 0
                assert _prefetch_threads() == []


def _corrupt(data: Data, key: str) -> bytes:
    path = f"{data.root}/{key}"
    raw = data.ffs.inner.cat_file(path)
    bad = bytearray(raw)
    bad[len(bad) // 2] ^= 0x5A
    data.ffs.inner.pipe_file(path, bytes(bad))
    return bytes(raw)


@pytest.mark.parametrize("fault", ["missing", "corrupt", "store error"])
@pytest.mark.parametrize("which", ["snapshot", "segment"])
def test_a_bad_object_fails_the_restore_as_without_prefetch(
        data: Data, tmp_path: Path, fault: str, which: str) -> None:
    handle = data.handles["lmdb" if which == "snapshot" else "heap"]
    key = (handle.materialized[0].key if which == "snapshot"
           else handle.non_materialized[-1].change_sets[-1].key)
    path = f"{data.root}/{key}"
    raw = data.ffs.inner.cat_file(path)
    if fault == "missing":
        data.ffs.inner.rm_file(path)
    elif fault == "corrupt":
        _corrupt(data, key)
    else:
        data.ffs.fail_reads([path], error=permanent_error)
    expected = {"missing": ObjectNotFoundError, "corrupt": CorruptObjectError,
                "store error": StorageError}[fault]
    errors: list[tuple[type[DstlError], object, str]] = []
    try:
        with data.storage() as storage:
            for prefetch in (False, True):
                with LocalFileCache(tmp_path / f"c-{prefetch}") as cache:
                    with pytest.raises(DstlError) as exc:
                        restore_backend([handle], storage, KGS, table="lmdb", cache=cache,
                                        options=OPTS, prefetch=prefetch)
                    st = cache.stats()
                assert isinstance(exc.value, expected), exc.value
                errors.append((type(exc.value), getattr(exc.value, "key", None),
                               str(exc.value)))
                assert st["leases_open"] == 0 and _prefetch_threads() == []
                assert not (tmp_path / f"c-{prefetch}").exists()
    finally:
        data.ffs.clear_faults()
        data.ffs.inner.pipe_file(path, raw)
    assert errors[0] == errors[1]
    assert errors[1][1] == key and key in errors[1][2]


def test_a_failure_of_the_prefetch_alone_is_forgotten(data: Data, tmp_path: Path) -> None:
    handle, model = data.handles["heap"], data.models["heap"]
    segments = list(dict.fromkeys(r.key for n in handle.non_materialized for r in n.change_sets))
    victim = segments[-1]  # leased last: its prefetch fails long before the lease
    data.ffs.fail_reads([f"{data.root}/{victim}"], count=1, ops=("cat_file",),
                        error=permanent_error)
    before = data.gets([victim])
    try:
        with data.storage() as storage, LocalFileCache(tmp_path / "c") as cache:
            assert _values(restore_backend([handle], storage, KGS, cache=cache,
                                           options=OPTS)) == model
            st = cache.stats()
    finally:
        data.ffs.clear_faults()
    assert st["prefetch_failed"] == 1 and st["download_failures"] == 0
    assert data.gets([victim])[0] - before[0] == 2  # the prefetch's, then the lease's


@pytest.mark.parametrize("made_by", ["heap", "lmdb"])
def test_a_tiny_budget_fails_exactly_when_it_fails_without_prefetch(
        data: Data, tmp_path: Path, made_by: str) -> None:
    handle, model = data.handles[made_by], data.models[made_by]
    with data.storage() as storage:
        sizes = {k: storage.store.head(k).size for k in _objects(handle)}  # type: ignore[union-attr]
        biggest = max(sizes.values())
        # room for the biggest object and a little: every lease evicts the idle files before it
        for budget, fits in ((biggest + min(sizes.values()), True), (biggest - 1, False)):
            outcomes: list[Any] = []
            for prefetch in (False, True):
                with LocalFileCache(tmp_path / f"c-{budget}-{prefetch}",
                                    max_bytes=budget) as cache:
                    try:
                        outcomes.append(_values(restore_backend(
                            [handle], storage, KGS, table="lmdb", cache=cache, options=OPTS,
                            prefetch=prefetch)))
                    except CacheFullError as exc:
                        outcomes.append((type(exc), str(exc).split(";")[0].replace(
                            cache.directory, "<cache>")))
                    st = cache.stats()
                assert st["bytes_cached"] <= budget and _prefetch_threads() == []
                if prefetch:
                    assert st["prefetch_started"] + st["prefetch_skipped"] \
                        + st["prefetch_present"] + st["prefetch_cancelled"] == len(sizes)
            assert outcomes[0] == outcomes[1]
            assert (outcomes[1] == model) is fits


# --------------------------------------------------------------------------- the agent


def test_restores_through_the_agent_prefetch_each_object_once(
        data: Data, moto_endpoint: str, tmp_path: Path) -> None:
    proxy = FaultProxy.start(moto_endpoint)
    path = ensure_agent(str(tmp_path / "agent"), watch_pid=os.getpid())
    client = AgentClient(path)
    agent_pid = int(client.metrics()["agent.pid"])
    try:
        opts = s3_storage_options(proxy.endpoint)
        with data.storage() as storage:
            for made_by in ("heap", "lmdb"):
                handle, model = data.handles[made_by], data.models[made_by]
                objects = _objects(handle)
                for n, table in enumerate(("lmdb", "heap")):
                    proxy.reset()
                    with AgentCache(client, data.uri, opts, DOPTS) as cache:
                        got = _values(restore_backend([handle], storage, KGS, table=table,
                                                      cache=cache, options=OPTS))
                        st = cache.stats()
                    assert got == model, (made_by, table)
                    gets = proxy.stats()["requests"].get("get", 0)
                    # the first restore of these objects GETs each once; the next none
                    assert gets == (len(objects) if n == 0 else 0), (made_by, table, gets)
                    assert st["leases_open"] == 0
            st = client.call(CacheStatsRequest(), WAIT).stats
        assert st["downloads"] == sum(len(_objects(h)) for h in data.handles.values())
        assert st["prefetch_joined"] == st["prefetch_started"] > 0
        assert st["prefetch_failed"] == 0
    finally:
        client.request(ShutdownRequest()).result(WAIT)
        client.close()
        proxy.stop()
        _wait_gone(agent_pid)
    assert not (tmp_path / "agent" / "cache").exists() or \
        os.listdir(tmp_path / "agent" / "cache") == []


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise AssertionError(f"agent {pid} did not exit")


# --------------------------------------------------------------------------- a kill midway


def test_a_process_killed_while_prefetching_leaves_a_cache_the_next_one_opens(
        tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    with ChangelogStorage(str(store_dir), options=DOPTS) as storage:
        handle, model = _write(storage, "heap")
    handle_file = tmp_path / "handle.json"
    handle_file.write_text(handle.to_json())
    cache_dir = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    child = subprocess.Popen([sys.executable, str(CHILD), str(store_dir), str(handle_file),
                              str(cache_dir), "0.15"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip() == "prefetching", child.stderr.read() if child.stderr else line
        os.kill(child.pid, signal.SIGKILL)
        child.wait(WAIT)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(WAIT)
        child.communicate()
    left = os.listdir(cache_dir)
    assert any(n.endswith(".obj") for n in left), left  # killed with files in the cache
    with LocalFileCache(cache_dir) as cache:  # the lock died with the child: opens cleanly
        assert [n for n in os.listdir(cache_dir) if n.endswith((".obj", ".tmp"))] == []
        with ChangelogStorage(str(store_dir), options=DOPTS) as storage:
            assert _values(restore_backend([handle], storage, KGS, cache=cache,
                                           options=OPTS)) == model
        assert cache.stats()["downloads"] == len(_objects(handle))


# --------------------------------------------------------------------------- the agent's service


class _SlowStore:
    """Opening the store waits for the test, so a prefetch stays unqueued while it is cancelled."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.started = threading.Event()
        self.go = threading.Event()

    def open(self) -> Any:
        self.started.set()
        assert self.go.wait(WAIT)
        return self.store


def test_the_agents_service_queues_cancels_and_drops_prefetches_with_their_connection(
        tmp_path: Path) -> None:
    with ChangelogStorage(str(tmp_path / "store"), options=DOPTS) as storage:
        handle, _ = _write(storage, "heap")
        objects = _objects(handle)
        svc = AgentCacheService(str(tmp_path / "svc"))
        try:
            with pytest.raises(UsageError, match="nope"):
                svc.submit_prefetch(1, 1, lambda: storage.store, [(objects[0], "nope", None)])
            # cancelled while its store is being opened: nothing is queued or downloaded
            slow = _SlowStore(storage.store)
            svc.submit_prefetch(1, 2, slow.open, [(k, None, None) for k in objects])
            assert slow.started.wait(WAIT)
            svc.cancel_prefetch(1, 2)
            slow.go.set()
            # the connection's end cancels what it has queued
            slow2 = _SlowStore(storage.store)
            svc.submit_prefetch(2, 1, slow2.open, [(k, None, None) for k in objects])
            assert slow2.started.wait(WAIT)
            assert svc.release_connection(2) == 0
            slow2.go.set()
            # an ordinary prefetch: every object downloaded once, then leased from the cache
            svc.submit_prefetch(3, 1, lambda: storage.store,
                                [(k, None, None) for k in objects])
            svc.cache.wait_for_stats(lambda s: s["files"] == len(objects), WAIT)
            for k in objects:
                reply = svc.lease(3, storage.store, k, None, None)
                svc.release(3, reply.lease)
            svc.cancel_prefetch(3, 1)
            svc.cancel_prefetch(3, 99)  # unknown: nothing to do
        finally:
            svc.close()  # waits for the service's threads: every prefetch start has run
    st = svc.cache.stats()
    assert (st["downloads"], st["prefetch_joined"], st["prefetch_started"]) == \
        (len(objects), len(objects), len(objects))
    # the cancelled prefetches never reached the cache's queue
    assert st["prefetch_present"] == st["prefetch_cancelled"] == 0
    assert _prefetch_threads() == []
    assert not (tmp_path / "svc" / "cache").exists()
