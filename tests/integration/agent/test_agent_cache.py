"""The executor agent owns the executor's restore cache: a real agent process, a local-directory
store with real segments and a real snapshot, and workers that are separate processes with their
own AgentClient. Checked: one download per object for all workers, leases given back on release
and when a worker is SIGKILLed, typed errors (missing, corrupt) in the worker with nothing cached,
the lease contract, the agent's death, and restore_backend through the agent equal to a restore
through a LocalFileCache."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for
from dstl.errors import (
    ClosedError,
    CorruptObjectError,
    LeaseError,
    ObjectNotFoundError,
    TruncatedObjectError,
    UsageError,
)
from dstl.handle import ChangelogHandle
from dstl.spark.agent import (
    AgentCache,
    AgentCacheService,
    AgentClient,
    AgentLease,
    AgentUnavailableError,
    StoreRef,
    ensure_agent,
)
from dstl.spark.agent.protocol import LeaseRequest, ShutdownRequest
from dstl.stores import BlobStore
from dstl.timer import ManualTimer
from materializer.backend import ChangelogKeyedStateBackend
from materializer.options import BackendOptions
from materializer.states import ValueStateDescriptor
from restore import LocalFileCache, restore_backend
from restore.reader import ChangelogReader, verify_segment, verify_snapshot

MP = 64
WAIT = 10.0
WORKER = Path(__file__).resolve().parents[2] / "support" / "agent_cache_worker.py"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs. The agent is this process's child (ensure_agent started it), so
    once it exits it is a zombie until reaped: count that as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_until(what: str, check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``check`` until it holds: only for state of ANOTHER process, where no event exists."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s}s")
        time.sleep(0.05)


@dataclass
class Agent:
    """A real executor agent in ``directory`` and this test process's connection to it."""

    directory: Path
    path: str = ""
    client: AgentClient | None = None
    pids: set[int] = field(default_factory=set)

    def start(self) -> AgentClient:
        self.path = ensure_agent(str(self.directory), watch_pid=os.getpid())
        self.client = AgentClient(self.path)
        self.pids.add(int(self.client.metrics()["agent.pid"]))
        return self.client

    @property
    def pid(self) -> int:
        assert self.client is not None
        return int(self.client.metrics()["agent.pid"])

    def stop(self) -> None:
        if self.client is not None and not self.client.broken:
            self.client.request(ShutdownRequest()).result(WAIT)
        if self.client is not None:
            self.client.close()
        for pid in self.pids:
            _wait_until(f"agent {pid} exits", _gone(pid))


def _gone(pid: int) -> Callable[[], bool]:
    return lambda: not _alive(pid)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = Agent(tmp_path / "agent")
    a.start()
    try:
        yield a
    finally:
        a.stop()
    # the agent's cache removed its files when the agent stopped (G8), and its directory too
    # unless a dead predecessor had made it
    cache_dir = tmp_path / "agent" / "cache"
    assert not cache_dir.exists() or os.listdir(cache_dir) == []


@dataclass
class Store:
    uri: str
    storage: ChangelogStorage
    handles: list[ChangelogHandle]
    segments: list[str]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """Two writers, three checkpoints, one flush window each: three segments, each shared by
    both writers (as the segments of an executor agent are)."""
    uri = str(tmp_path / "store")
    timer = ManualTimer()
    storage = ChangelogStorage(uri, options=DstlOptions(persist_delay_s=1.0), timer=timer)
    writers = [storage.create_writer(f"op/{i}", KeyGroupRange.of_operator(MP, 2, i))
               for i in range(2)]
    handles: list[ChangelogHandle] = []
    for cp in range(1, 4):
        for i, w in enumerate(writers):
            kgs = KeyGroupRange.of_operator(MP, 2, i)
            for n in range(20):
                w.append(kgs.start + n % 5, f"w{i}-cp{cp}-{n}".encode() * 3)
        futures = [w.persist(0, cp) for w in writers]
        timer.advance(1.0)
        handles = [f.result(WAIT) for f in futures]
    segments = sorted({ref.key for h in handles for ref in h.change_sets})
    assert len(segments) == 3
    try:
        yield Store(uri, storage, handles, segments)
    finally:
        for w in writers:
            w.close()
        storage.close()


def _cache(a: Agent, s: Store) -> AgentCache:
    assert a.client is not None
    return AgentCache(a.client, s.uri, None)


def _runs(handles: list[ChangelogHandle]) -> int:
    """Leases a cached read of ``handles`` takes: one per run of refs in the same segment."""
    n = 0
    for h in handles:
        keys = [r.key for r in h.change_sets]
        n += sum(1 for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k)
    return n


def _worker(a: Agent, s: Store, tmp_path: Path, mode: str) -> subprocess.Popen[str]:
    handles_file = tmp_path / "handles.jsonl"
    if not handles_file.exists():
        handles_file.write_text("".join(h.to_json() + "\n" for h in s.handles))
    return subprocess.Popen([sys.executable, str(WORKER), a.path, s.uri, str(handles_file), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _expected(s: Store) -> list[list[list[Any]]]:
    reader = ChangelogReader(s.storage)  # direct ranged reads, no cache
    return [[[kg, p.hex()] for kg, p in reader.read(h)] for h in s.handles]


def _cache_files(a: Agent) -> list[str]:
    return sorted(os.listdir(a.directory / "cache"))


# --------------------------------------------------------------------------- two workers


def test_two_worker_processes_share_one_download_per_object(agent: Agent, store: Store,
                                                            tmp_path: Path) -> None:
    workers = [_worker(agent, store, tmp_path, "read") for _ in range(2)]
    outs = [w.communicate(timeout=30) for w in workers]
    for w, (_, err) in zip(workers, outs):
        assert w.returncode == 0, err
    expected = _expected(store)
    assert expected and all(expected)
    for out, _ in outs:
        assert json.loads(out)["changes"] == expected
    with _cache(agent, store) as cache:
        st = cache.stats()
    leases = 2 * _runs(store.handles)
    assert (st["downloads"], st["hits"], st["leases_open"], st["files"]) == \
        (len(store.segments), leases - len(store.segments), 0, len(store.segments))
    assert st["download_failures"] == 0
    # the agent reports its cache with its other metrics
    assert agent.client is not None
    m = agent.client.metrics()
    assert m["agent.cache.downloads"] == len(store.segments)
    assert m["agent.cache.leases_open"] == 0


def test_a_sigkilled_worker_gives_its_leases_back(agent: Agent, store: Store,
                                                  tmp_path: Path) -> None:
    worker = _worker(agent, store, tmp_path, "hold")
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "held"
        cache = _cache(agent, store)
        assert cache.stats()["leases_open"] == 1
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(WAIT)
        # the agent notices the closed connection on its own thread: poll its stats
        _wait_until("leases_open back to 0", lambda: cache.stats()["leases_open"] == 0)
        st = cache.stats()
        assert (st["downloads"], st["files"]) == (1, 1)  # idle, kept until its TTL
        cache.close()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(WAIT)
        worker.communicate()


# --------------------------------------------------------------------------- leases


def test_lease_contract_matches_cache_lease(agent: Agent, store: Store) -> None:
    key = store.segments[0]
    data = store.storage.store.get(key)
    with _cache(agent, store) as cache:
        lease = cache.lease(store.storage.store, key, verify=verify_segment)
        assert isinstance(lease, AgentLease)
        assert (lease.key, lease.size, lease.direct, lease.released) == \
            (key, len(data), False, False)
        assert lease.path is not None and lease.path.startswith(str(agent.directory / "cache"))
        assert lease.read(0, len(data)) == data
        assert lease.read(7, 13) == data[7:20]
        assert lease.read(len(data), 0) == b""
        with pytest.raises(TruncatedObjectError) as trunc:
            lease.read(len(data) - 4, 10)
        assert trunc.value.key == key
        with pytest.raises(UsageError):
            lease.read(-1, 4)
        assert cache.stats()["leases_open"] == 1
        lease.release()
        assert lease.released
        assert cache.stats()["leases_open"] == 0
        with pytest.raises(LeaseError):
            lease.read(0, 1)
        with pytest.raises(LeaseError):
            lease.release()
        # a with block releases quietly, also after an explicit release inside it
        with cache.lease(store.storage.store, key, verify=verify_segment) as again:
            assert again.read(0, 4) == data[:4]
            again.release()
        assert again.released
        # closing the cache gives back what is still open and invalidates it
        held = cache.lease(store.storage.store, key)
        assert cache.stats()["leases_open"] == 1
    assert held.released
    with pytest.raises(LeaseError):
        held.read(0, 1)
    held.release()  # after close: a no-op, as for CacheLease
    with _cache(agent, store) as other:
        st = other.stats()
        assert (st["downloads"], st["hits"], st["leases_open"]) == (1, 2, 0)
        with pytest.raises(ClosedError):
            cache.lease(store.storage.store, key)


def test_verify_functions_are_named_over_the_wire(agent: Agent, store: Store) -> None:
    with _cache(agent, store) as cache:
        with pytest.raises(UsageError, match="VERIFIERS"):
            cache.lease(store.storage.store, store.segments[0], verify=lambda d, k: None)
        assert agent.client is not None
        bogus = LeaseRequest(StoreRef(store.uri, None, DstlOptions()), store.segments[0],
                             "bogus", None)
        with pytest.raises(UsageError) as refused:  # the agent's reply, raised as its type
            agent.client.request(bogus).result(WAIT)
        err = refused.value
        assert isinstance(err, UsageError) and "bogus" in str(err)
        assert cache.stats()["leases_open"] == 0


def test_missing_object_is_object_not_found_in_the_worker(agent: Agent, store: Store) -> None:
    with _cache(agent, store) as cache:
        with pytest.raises(ObjectNotFoundError) as direct:
            cache.lease(store.storage.store, "dstl/no-such-segment", verify=verify_segment)
        assert direct.value.key == "dstl/no-such-segment"
        assert "executor agent" in str(direct.value)
        os.unlink(os.path.join(store.uri, store.segments[1]))
        with pytest.raises(ObjectNotFoundError) as via_reader:
            list(ChangelogReader(store.storage, cache=cache).read(store.handles[0]))
        assert via_reader.value.key == store.segments[1]
        st = cache.stats()
        assert (st["leases_open"], st["download_failures"]) == (0, 2)


def test_corrupt_object_is_corrupt_object_error_in_the_worker_and_nothing_cached(
        agent: Agent, store: Store) -> None:
    key = store.handles[0].change_sets[0].key  # the first object the reader leases
    path = os.path.join(store.uri, key)
    raw = bytearray(Path(path).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    Path(path).write_bytes(bytes(raw))
    with _cache(agent, store) as cache:
        with pytest.raises(CorruptObjectError) as exc:
            list(ChangelogReader(store.storage, cache=cache).read(store.handles[0]))
        assert exc.value.key == key
        assert isinstance(exc.value.offset, int) and exc.value.reason
        assert "executor agent" in str(exc.value) and key in str(exc.value)
        st = cache.stats()
        assert (st["files"], st["leases_open"], st["download_failures"]) == (0, 0, 1)
    assert [f for f in _cache_files(agent) if f.endswith((".obj", ".tmp"))] == []


# --------------------------------------------------------------------------- the agent's death


def test_the_agent_dies_leases_fail_retryably_and_its_successor_cleans_up(
        agent: Agent, store: Store) -> None:
    key = store.segments[0]
    data = store.storage.store.get(key)
    cache = _cache(agent, store)
    held = cache.lease(store.storage.store, key)
    dead_file = held.path
    assert dead_file is not None
    os.kill(agent.pid, signal.SIGKILL)
    _wait_until("client sees the agent gone", lambda: agent.client is not None
                and agent.client.broken)
    # what a worker has open stays readable; new requests fail retryably
    assert held.read(0, len(data)) == data
    with pytest.raises(AgentUnavailableError):
        cache.lease(store.storage.store, key)
    held.release()  # quiet: the dead agent's leases died with it
    cache.close()
    assert agent.client is not None
    agent.client.close()
    # the next worker starts a new agent, whose cache removes the dead one's files
    agent.start()
    assert not os.path.exists(dead_file)
    with _cache(agent, store) as fresh, fresh.lease(store.storage.store, key) as lease:
        assert lease.read(0, len(data)) == data


def test_a_published_file_gone_before_it_is_opened_is_agent_unavailable(
        agent: Agent, store: Store) -> None:
    with _cache(agent, store) as cache:
        lease = cache.lease(store.storage.store, store.segments[0])
        lease_id = lease.lease_id
        lease.invalidate()  # keep the agent's lease, drop the worker's fd
        with pytest.raises(AgentUnavailableError, match="gone"):
            AgentLease(cache, lease_id, store.storage.store, lease.key, lease.size,
                       str(agent.directory / "cache" / "vanished.obj"))
        # the failed lease was given back to the agent
        assert cache.stats()["leases_open"] == 0


def test_a_direct_lease_reads_ranges_from_the_workers_store(agent: Agent, store: Store) -> None:
    key = store.segments[0]
    data = store.storage.store.get(key)
    assert agent.client is not None
    with _cache(agent, store) as cache:
        reply = agent.client.request(LeaseRequest(StoreRef(store.uri, None, DstlOptions()), key,
                                                  None, None)).result(WAIT)
        assert reply.size == len(data)  # a failed request raises instead of resolving
        # what the worker makes of a reply without a path (the agent's on_full="direct" mode)
        direct = AgentLease(cache, reply.lease, store.storage.store, key, len(data), None)
        assert direct.direct and direct.path is None
        assert direct.read(5, 40) == data[5:45]
        with pytest.raises(TruncatedObjectError):
            direct.read(len(data) - 1, 2)
        direct.release()  # gives the agent's lease back
        assert cache.stats()["leases_open"] == 0


# --------------------------------------------------------------------------- in the agent


class _BlockingStore:
    """Opening the store waits for the test: a lease stays pending while its connection ends."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.started = threading.Event()
        self.go = threading.Event()

    def open(self) -> BlobStore:
        self.started.set()
        assert self.go.wait(WAIT)
        return self.inner


def test_a_lease_granted_after_its_connection_ended_is_given_back(tmp_path: Path,
                                                                  store: Store) -> None:
    svc = AgentCacheService(str(tmp_path / "svc"))
    try:
        blocking = _BlockingStore(store.storage.store)
        fut = svc.submit_lease(1, blocking.open, store.segments[0], "segment", None)
        assert blocking.started.wait(WAIT)
        assert svc.release_connection(1) == 0  # the worker went away mid-request
        blocking.go.set()
        with pytest.raises(ClosedError, match="went away"):
            fut.result(WAIT)
        assert svc.stats()["leases_open"] == 0
        # an ordinary connection: leases balance, and a connection's end gives back the rest
        reply = svc.lease(2, store.storage.store, store.segments[0], "segment", None)
        assert reply.path is not None and reply.size > 0
        svc.lease(2, store.storage.store, store.segments[1], None, None)
        svc.release(2, reply.lease)
        with pytest.raises(LeaseError):
            svc.release(2, reply.lease)
        with pytest.raises(LeaseError):
            svc.release(3, reply.lease)
        assert svc.stats()["leases_open"] == 1
        assert svc.release_connection(2) == 1
        assert svc.stats()["leases_open"] == 0
        with pytest.raises(UsageError, match="nope"):
            svc.lease(4, store.storage.store, store.segments[0], "nope", None)
    finally:
        svc.close()
    assert not (tmp_path / "svc" / "cache").exists()
    # an object that cannot be cached in direct mode: a lease without a path
    small = AgentCacheService(str(tmp_path / "small"), max_bytes=1, on_full="direct")
    try:
        reply = small.lease(1, store.storage.store, store.segments[0], "segment", None)
        assert reply.path is None
        assert reply.size == len(store.storage.store.get(store.segments[0]))
        assert small.stats()["direct_leases"] == 1
        assert small.release_connection(1) == 1
        assert small.stats()["leases_open"] == 0
    finally:
        small.close()


# --------------------------------------------------------------------------- restore_backend


def test_restore_backend_through_the_agent_equals_a_local_cache(agent: Agent,
                                                                tmp_path: Path) -> None:
    uri = str(tmp_path / "restore-store")
    opts = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
    kgs = KeyGroupRange(0, MP - 1)
    keys = [f"user-{i}" for i in range(120)]
    with ChangelogStorage(uri, options=DstlOptions(persist_delay_s=0.0)) as storage:
        b = ChangelogKeyedStateBackend(storage, "op", kgs, MP, options=opts)
        state = b.get_state(ValueStateDescriptor("v"))
        for n, k in enumerate(keys):
            b.set_current_key(k)
            state.update(n)
        b.snapshot(1).result(WAIT)
        b.notify_checkpoint_complete(1)
        assert b.materialize_now(WAIT) is not None  # a real snapshot object
        for n, k in enumerate(keys[::3]):
            b.set_current_key(k)
            state.update(-n)
        handle = b.snapshot(2).result(WAIT)
        b.close()
        assert handle.materialized and handle.non_materialized
        objects = {r.key for r in handle.materialized} | {
            ref.key for nm in handle.non_materialized for ref in nm.change_sets}

        def read(r: ChangelogKeyedStateBackend) -> dict[str, int]:
            s = r.get_state(ValueStateDescriptor("v"))
            out = {}
            for k in keys:
                assert key_group_for(k.encode(), MP) in kgs
                r.set_current_key(k)
                out[k] = s.value()
            r.close()
            return out

        with LocalFileCache(tmp_path / "local-cache") as local:
            expected = read(restore_backend([handle], storage, kgs, cache=local))
        assert agent.client is not None
        cache = AgentCache(agent.client, uri, None, DstlOptions(persist_delay_s=0.0))
        try:
            assert read(restore_backend([handle], storage, kgs, cache=cache)) == expected
            first = cache.stats()
            assert (first["downloads"], first["leases_open"]) == (len(objects), 0)
            # a second restore (another worker, another partition) downloads nothing
            assert read(restore_backend([handle], storage, kgs, cache=cache)) == expected
            again = cache.stats()
            assert again["downloads"] == len(objects) and again["hits"] > first["hits"]
            assert again["leases_open"] == 0
            # the snapshot was verified whole by the agent with the named function
            with cache.lease(storage.store, next(iter(handle.materialized)).key,
                             verify=verify_snapshot) as lease:
                assert lease.size > 0
        finally:
            cache.close()
