"""The checkpoint coordinator against an in-memory store, with fake clocks and a manual executor.

Names the guarantees it checks: G3 (the manifest is the last write; a checkpoint exists iff its
manifest does), G5 (nothing retained or pending is deleted; nothing unreferenced stays), and
recovery after a driver restart.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import pytest
from support.fakes import DelegatingStore

from dstl.checkpoint.coordinator import (
    AbortedCheckpoint,
    CheckpointCommitError,
    CheckpointCoordinator,
    CheckpointListener,
    Completion,
)
from dstl.checkpoint.manifest import Manifest, TaskEntry, decode_manifest
from dstl.errors import (
    ChecksumMismatchError,
    ClosedError,
    ConfigError,
    CorruptObjectError,
    UnsafePathError,
    UsageError,
)
from dstl.layout import manifest_key, segment_key

T0_MS = 1_700_000_000_000
TASKS = ("op/0", "op/1")


class RecordingStore(DelegatingStore):
    """A MemoryBlobStore that records every put and delete, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str]] = []
        self.existing_at_put: dict[str, set[str]] = {}

    def put(self, key: str, data: bytes) -> None:
        self.existing_at_put[key] = {i.key for i in self.inner.list()}
        self.inner.put(key, data)
        self.log.append(("put", key))

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self.inner.delete(keys)
        self.log.extend(("delete", k) for k in keys)

    def names(self, prefix: str = "") -> set[str]:
        return {i.key for i in self.inner.list(prefix)}


class FakeClock:
    def __init__(self) -> None:
        self.mono = 100.0
        self.wall_ms = T0_MS

    def monotonic(self) -> float:
        return self.mono

    def wall(self) -> float:
        return self.wall_ms / 1000.0

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall_ms += int(seconds * 1000)


class ManualExecutor(Executor):
    """Queues submitted calls; ``run_all`` runs them on the test's thread."""

    def __init__(self) -> None:
        self.queue: list[tuple[Future[Any], Callable[[], Any]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self.queue.append((fut, lambda: fn(*args, **kwargs)))
        return fut

    def run_all(self) -> None:
        while self.queue:
            fut, call = self.queue.pop(0)
            fut.set_result(call())


class Recorder(CheckpointListener):
    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []

    def on_complete(self, checkpoint: Manifest) -> None:
        self.events.append(("complete", checkpoint.checkpoint_id, checkpoint.attempt))

    def on_subsumed(self, checkpoint: Manifest) -> None:
        self.events.append(("subsumed", checkpoint.checkpoint_id, checkpoint.attempt))

    def on_aborted(self, checkpoint: AbortedCheckpoint) -> None:
        self.events.append(("aborted", checkpoint.checkpoint_id, 0))


_upload_no = itertools.count()


def upload(store: Any, clock: FakeClock | None = None, *, created_ms: int | None = None,
           prefix: str = "dstl/") -> str:
    """Store one fake segment (or snapshot) with a creation-time name, as a task would."""
    created = created_ms if created_ms is not None else (clock.wall_ms if clock else T0_MS)
    n = next(_upload_no)
    if prefix == "dstl/":
        key = segment_key(created, "a1b2c3d4e5f6", n, 0)
    else:
        key = f"{prefix}{created:011x}-{n:08x}.snap"
    store.put(key, b"payload %d" % n)
    return key


def run_checkpoint(coord: CheckpointCoordinator, refs: Mapping[str, Sequence[str]],
                   checkpoint_id: int | None = None) -> Completion:
    cid = coord.trigger(refs, checkpoint_id)
    result = None
    for task, keys in refs.items():
        result = coord.acknowledge(cid, task, {"task": task, "keys": len(keys)}, keys,
                                   full_size=10 * len(keys), incremental_size=len(keys))
    assert isinstance(result, Completion)
    return result


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store() -> RecordingStore:
    return RecordingStore()


def coordinator(store: Any, clock: FakeClock, **kwargs: Any) -> CheckpointCoordinator:
    return CheckpointCoordinator(store, job_id="job", clock=clock.monotonic,
                                 wall_clock=clock.wall, **kwargs)


def retained_refs(coord: CheckpointCoordinator) -> set[str]:
    return {k for m in coord.manifests() for k in m.referenced_keys}


# --------------------------------------------------------------------------- G3: manifest last


def test_g3_the_manifest_is_the_last_write_of_a_checkpoint(store: RecordingStore,
                                                           clock: FakeClock) -> None:
    coord = coordinator(store, clock)
    cid = coord.trigger(TASKS)
    a, b = upload(store, clock), upload(store, clock)
    assert coord.acknowledge(cid, "op/0", {"h": 1}, [a], 10, 10) is None
    assert store.names("checkpoints/") == set()  # not complete: no manifest
    c = upload(store, clock)
    clock.advance(0.25)
    done = coord.acknowledge(cid, "op/1", {"h": 2}, [b, c], 20, 20)
    assert done and done.checkpoint_id == cid == 1
    puts = [k for op, k in store.log if op == "put"]
    assert puts[-1] == manifest_key(1, 1)  # the last write of the checkpoint
    assert {a, b, c} <= store.existing_at_put[manifest_key(1, 1)]  # everything it names exists
    m = coord.latest()
    assert m is not None and m.key == manifest_key(1, 1)
    assert m.task("op/1").referenced_keys == tuple(sorted([b, c]))
    assert m.stats.duration_ms == 250.0 and m.stats.trigger_ms == T0_MS
    assert m.stats.ack_latency_ms == {"op/0": 0.0, "op/1": 250.0}
    assert m.stats.full_size == 30 and m.stats.incremental_size == 30
    assert decode_manifest(store.get(m.key), m.key) == m


# --------------------------------------------------------------------------- G5: retention


def test_g5_retained_n_never_deletes_a_referenced_object_and_leaves_nothing_unreferenced(
        store: RecordingStore, clock: FakeClock) -> None:
    coord = coordinator(store, clock, retained=3)
    recorder = Recorder()
    coord.add_listener(recorder)
    live: dict[str, list[str]] = {t: [] for t in TASKS}  # each task's log since materialization
    for i in range(12):
        clock.advance(1)
        for t in TASKS:
            if i % 4 == 3:  # a materialization: a snapshot replaces the log so far
                live[t] = [upload(store, clock, prefix=f"snapshots/{t}/")]
            live[t].append(upload(store, clock))
        done = run_checkpoint(coord, live)
        kept = retained_refs(coord)
        # Every retained checkpoint is intact, and nothing else is left.
        assert kept <= store.names()
        assert store.names("dstl/") | store.names("snapshots/") == kept
        assert store.names("checkpoints/") == {m.key for m in coord.manifests()}
        assert [m.checkpoint_id for m in coord.manifests()] == list(range(max(1, i - 1), i + 2))
        assert [m.checkpoint_id for m in done.subsumed] == ([i - 2] if i >= 3 else [])
    assert recorder.events[0] == ("complete", 1, 1)
    assert ("subsumed", 1, 1) in recorder.events
    stats = coord.stats()
    assert stats["CheckpointCoordinator.numberOfCompletedCheckpoints"] == 12
    assert stats["CheckpointCoordinator.numberOfSubsumedCheckpoints"] == 9
    assert stats["CheckpointCoordinator.numberOfDeletedManifests"] == 9
    assert stats["CheckpointCoordinator.numberOfDeletedObjects"] > 0
    assert stats["CheckpointCoordinator.numberOfRetainedCheckpoints"] == 3
    assert stats["CheckpointCoordinator.lastCompletedCheckpointId"] == 12
    assert stats["CheckpointCoordinator.pendingDeletions"] == 0


def test_subsumed_manifests_are_deleted_before_their_objects(store: RecordingStore,
                                                             clock: FakeClock) -> None:
    coord = coordinator(store, clock, retained=1)
    a = upload(store, clock)
    run_checkpoint(coord, {"t": [a]})
    b = upload(store, clock)
    done = run_checkpoint(coord, {"t": [b]})
    deletes = [k for op, k in store.log if op == "delete"]
    assert deletes == [manifest_key(1, 1), a]
    assert done.deleted == (manifest_key(1, 1), a)


def test_deletions_on_an_executor_recheck_live_references(store: RecordingStore,
                                                          clock: FakeClock) -> None:
    executor = ManualExecutor()
    coord = coordinator(store, clock, retained=1, executor=executor)
    a = upload(store, clock)
    run_checkpoint(coord, {"t": [a]})
    executor.run_all()
    b = upload(store, clock)
    done = run_checkpoint(coord, {"t": [b]})  # a is doomed, the deletion is queued
    assert done.deleted == () and a in store.names()
    assert coord.doomed() == (frozenset({manifest_key(1, 1)}), frozenset({a}))
    # Before the deletion runs, an in-flight checkpoint references a again.
    cid = coord.trigger(["t", "u"])
    coord.acknowledge(cid, "t", {}, [a, b], 0, 0)
    executor.run_all()
    assert a in store.names()  # pinned by the pending checkpoint (G5)
    assert manifest_key(1, 1) not in store.names()
    coord.acknowledge(cid, "u", {}, [], 0, 0)
    executor.run_all()
    assert a in store.names() and retained_refs(coord) == {a, b}
    assert coord.doomed() == (frozenset(), frozenset())


def test_an_aborted_checkpoint_releases_its_pins(store: RecordingStore,
                                                 clock: FakeClock) -> None:
    executor = ManualExecutor()
    coord = coordinator(store, clock, retained=1, executor=executor)
    a, b, c = upload(store, clock), upload(store, clock), upload(store, clock)
    run_checkpoint(coord, {"t": [a]})
    run_checkpoint(coord, {"t": [b]})
    cid = coord.trigger(["t", "u"])
    coord.acknowledge(cid, "t", {}, [a], 0, 0)  # pins a (doomed by checkpoint 2)
    executor.run_all()
    assert a in store.names()
    coord.abort(cid, "batch failed")
    run_checkpoint(coord, {"t": [b, c]})
    executor.run_all()
    assert a not in store.names() and {b, c} <= store.names()


# --------------------------------------------------------------------------- ids and re-runs


def test_rerun_of_a_checkpoint_id_writes_attempt_2_and_replaces_attempt_1(
        store: RecordingStore, clock: FakeClock) -> None:
    coord = coordinator(store, clock)
    recorder = Recorder()
    coord.add_listener(recorder)
    a, b = upload(store, clock), upload(store, clock)
    run_checkpoint(coord, {"t": [a]})
    run_checkpoint(coord, {"t": [a, b]})
    c = upload(store, clock)
    done = run_checkpoint(coord, {"t": [a, c]}, checkpoint_id=2)  # Spark re-runs batch 2
    latest = coord.latest()
    assert latest is not None and (latest.checkpoint_id, latest.attempt) == (2, 2)
    assert latest.key == manifest_key(2, 2) and manifest_key(2, 2) in store.names()
    assert [(m.checkpoint_id, m.attempt) for m in done.subsumed] == [(2, 1)]
    assert [(m.checkpoint_id, m.attempt) for m in coord.manifests()] == [(1, 1), (2, 2)]
    assert manifest_key(2, 1) not in store.names()
    assert b not in store.names()  # only the first run of batch 2 referenced it
    assert {a, c} <= store.names()
    assert recorder.events[-2:] == [("complete", 2, 2), ("subsumed", 2, 1)]
    assert coord.trigger(["t"]) == 3  # automatic ids continue above


def test_ids_grow_and_never_go_below_the_last_completed(store: RecordingStore,
                                                        clock: FakeClock) -> None:
    coord = coordinator(store, clock)
    assert run_checkpoint(coord, {"t": []}).checkpoint_id == 1
    assert run_checkpoint(coord, {"t": []}, checkpoint_id=10).checkpoint_id == 10
    assert run_checkpoint(coord, {"t": []}).checkpoint_id == 11
    with pytest.raises(UsageError, match="below the last completed checkpoint 11"):
        coord.trigger(["t"], checkpoint_id=10)
    for bad in (-1, True, 2**64, 1.5):
        with pytest.raises(UsageError):
            coord.trigger(["t"], checkpoint_id=bad)  # type: ignore[arg-type]


def test_a_new_trigger_aborts_the_pending_checkpoint(store: RecordingStore,
                                                     clock: FakeClock) -> None:
    recorder = Recorder()
    coord = coordinator(store, clock, listeners=[recorder])
    first = coord.trigger(TASKS)
    coord.acknowledge(first, "op/0", {}, [], 0, 0)
    second = coord.trigger(TASKS)
    assert recorder.events == [("aborted", first, 0)]
    assert coord.pending_checkpoint_id == second
    with pytest.raises(UsageError, match=r"aborted \(superseded by checkpoint 2\)"):
        coord.acknowledge(first, "op/1", {}, [], 0, 0)
    run_ids = [coord.acknowledge(second, t, {}, [], 0, 0) for t in TASKS]
    assert run_ids[0] is None and run_ids[1]
    assert store.names("checkpoints/") == {manifest_key(2, 1)}
    assert coord.stats()["CheckpointCoordinator.numberOfAbortedCheckpoints"] == 1


def test_abort_returns_the_value_and_notifies(store: RecordingStore, clock: FakeClock) -> None:
    recorder = Recorder()
    coord = coordinator(store, clock, listeners=[recorder])
    cid = coord.trigger(TASKS)
    coord.acknowledge(cid, "op/1", {}, [], 0, 0)
    aborted = coord.abort(cid, "executor lost")
    assert aborted == AbortedCheckpoint(cid, TASKS, ("op/1",), "executor lost")
    assert recorder.events == [("aborted", cid, 0)]
    assert coord.pending_checkpoint_id is None
    with pytest.raises(UsageError, match="not pending"):
        coord.abort(cid, "again")


def test_unknown_task_or_checkpoint_is_a_usage_error(store: RecordingStore,
                                                     clock: FakeClock) -> None:
    coord = coordinator(store, clock)
    with pytest.raises(UsageError, match="never triggered"):
        coord.acknowledge(5, "op/0", {}, [], 0, 0)
    cid = coord.trigger(TASKS)
    with pytest.raises(UsageError, match="not one of the 2 tasks"):
        coord.acknowledge(cid, "op/9", {}, [], 0, 0)
    with pytest.raises(UsageError, match="still waits for 2 tasks"):
        coord.complete(cid)
    for bad_tasks in ([], ["a", "a"], [""]):
        with pytest.raises(UsageError):
            coord.trigger(bad_tasks)
    with pytest.raises(UnsafePathError):
        coord.acknowledge(cid, "op/0", {}, ["../outside"], 0, 0)
    with pytest.raises(UnsafePathError, match="not below dstl/ or snapshots/"):
        coord.acknowledge(cid, "op/0", {}, [manifest_key(1, 1)], 0, 0)
    with pytest.raises(UsageError, match="state"):
        coord.acknowledge(cid, "op/0", {"x": object()}, [], 0, 0)
    run_checkpoint(coord, {"op/0": [], "op/1": []}, checkpoint_id=cid)
    with pytest.raises(UsageError, match="already complete"):
        coord.acknowledge(cid, "op/0", {}, [], 0, 0)


def test_a_repeated_acknowledgement_replaces_the_earlier_one(store: RecordingStore,
                                                             clock: FakeClock) -> None:
    coord = coordinator(store, clock)
    cid = coord.trigger(TASKS)
    old, new = upload(store, clock), upload(store, clock)
    coord.acknowledge(cid, "op/0", {"attempt": 1}, [old], 5, 5)
    clock.advance(2)
    coord.acknowledge(cid, "op/0", {"attempt": 2}, [new], 7, 7)  # the task was retried
    done = coord.acknowledge(cid, "op/1", {}, [], 0, 0)
    assert done
    entry = done.manifest.task("op/0")
    assert entry.state == {"attempt": 2} and entry.referenced_keys == (new,)
    assert done.manifest.stats.ack_latency_ms["op/0"] == 2000.0
    assert done.manifest.stats.full_size == 7


def test_a_failing_listener_does_not_undo_the_commit(store: RecordingStore, clock: FakeClock,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    class Broken(CheckpointListener):
        def on_complete(self, checkpoint: Manifest) -> None:
            raise RuntimeError("listener bug")

    recorder = Recorder()
    coord = coordinator(store, clock, listeners=[Broken(), recorder])
    with caplog.at_level(logging.ERROR, logger="dstl.checkpoint.coordinator"):
        assert run_checkpoint(coord, {"t": []})
    assert recorder.events == [("complete", 1, 1)]
    assert "listener bug" in caplog.text
    coord.remove_listener(recorder)
    run_checkpoint(coord, {"t": []})
    assert len(recorder.events) == 1


def test_closed_coordinator_refuses_calls(store: RecordingStore, clock: FakeClock) -> None:
    with coordinator(store, clock) as coord:
        cid = coord.trigger(["t"])
    with pytest.raises(ClosedError):
        coord.acknowledge(cid, "t", {}, [], 0, 0)
    with pytest.raises(ClosedError):
        coord.trigger(["t"])
    coord.close()  # idempotent


@pytest.mark.parametrize("retained", [0, -1, True, 1.0])
def test_retained_must_be_a_positive_int(store: RecordingStore, retained: Any) -> None:
    with pytest.raises(ConfigError, match="retained"):
        CheckpointCoordinator(store, job_id="j", retained=retained)


# --------------------------------------------------------------------------- recovery


def test_recover_after_a_driver_restart_continues_correctly(store: RecordingStore,
                                                            clock: FakeClock) -> None:
    coord = coordinator(store, clock, retained=3)
    keys: list[str] = []
    for _ in range(5):
        keys.append(upload(store, clock))
        run_checkpoint(coord, {"t": keys[-3:]})  # each checkpoint: the last three segments
    before = coord.manifests()
    del coord  # the driver dies; no close

    again = CheckpointCoordinator.recover(store, "job", retained=3, clock=clock.monotonic,
                                          wall_clock=clock.wall)
    assert again.manifests() == before
    latest = again.latest()
    assert latest is not None and latest.checkpoint_id == 5
    assert again.doomed() == (frozenset(), frozenset())
    for _ in range(3):
        keys.append(upload(store, clock))
        done = run_checkpoint(again, {"t": keys[-3:]})
        assert retained_refs(again) <= store.names()
        assert store.names("dstl/") == retained_refs(again)
    assert done.checkpoint_id == 8
    assert [m.checkpoint_id for m in again.manifests()] == [6, 7, 8]
    assert store.names("checkpoints/") == {manifest_key(i, 1) for i in (6, 7, 8)}


def test_recover_dooms_stale_manifests_and_keeps_the_highest_attempt(
        store: RecordingStore, clock: FakeClock) -> None:
    coord = coordinator(store, clock, retained=2)
    a, b, c = upload(store, clock), upload(store, clock), upload(store, clock)
    run_checkpoint(coord, {"t": [a]})
    run_checkpoint(coord, {"t": [b]})
    m2 = coord.latest()
    assert m2 is not None
    # Leftovers a crashed driver could leave: a subsumed manifest whose delete never ran, and
    # attempt 1 of a re-run.
    old = Manifest.build(job_id="job", checkpoint_id=0, attempt=1, created_ms=0,
                         tasks=m2.tasks, trigger_ms=0, duration_ms=0,
                         ack_latency_ms={"t": 0.0}, retained=3)
    store.put(old.key, old.encode())
    run_checkpoint(coord, {"t": [b, c]}, checkpoint_id=2)
    store.inner.put(m2.key, m2.encode())  # attempt 1 of checkpoint 2 is back
    store.put("checkpoints/README", b"not a manifest")

    again = CheckpointCoordinator.recover(store, "job", retained=2)
    assert [(m.checkpoint_id, m.attempt) for m in again.manifests()] == [(1, 1), (2, 2)]
    assert again.doomed()[0] == {old.key, m2.key}
    d = upload(store, clock)
    done = run_checkpoint(again, {"t": [c, d]})
    assert {old.key, m2.key, manifest_key(1, 1)} <= set(done.deleted)
    assert store.names("checkpoints/") == {manifest_key(2, 2), manifest_key(3, 1),
                                          "checkpoints/README"}


def test_recover_an_empty_store_and_the_wrong_job(store: RecordingStore,
                                                  clock: FakeClock) -> None:
    empty = CheckpointCoordinator.recover(store, "job")
    assert empty.latest() is None and empty.manifests() == ()
    run_checkpoint(empty, {"t": []})
    with pytest.raises(UsageError, match="belongs to job 'job', not 'other'"):
        CheckpointCoordinator.recover(store, "other")


def _two_checkpoints_then_corrupt_the_newest(store: RecordingStore, clock: FakeClock) -> str:
    coord = coordinator(store, clock)
    a, b = upload(store, clock), upload(store, clock)
    run_checkpoint(coord, {"t": [a]})
    run_checkpoint(coord, {"t": [a, b]})
    key = manifest_key(2, 1)
    data = bytearray(store.get(key))
    data[data.index(b'"full_size":20') + 12] ^= 0x01  # 20 -> 21: a bit flip inside the body
    store.inner.delete([key])
    store.inner.put(key, bytes(data))
    return key


def test_a_corrupt_newest_manifest_is_an_error_naming_it(store: RecordingStore,
                                                         clock: FakeClock) -> None:
    key = _two_checkpoints_then_corrupt_the_newest(store, clock)
    with pytest.raises(ChecksumMismatchError) as info:
        CheckpointCoordinator.recover(store, "job")
    assert info.value.key == key
    assert "fallback=True" in "".join(getattr(info.value, "__notes__", []))


def test_fallback_takes_the_previous_valid_checkpoint(store: RecordingStore,
                                                      clock: FakeClock) -> None:
    key = _two_checkpoints_then_corrupt_the_newest(store, clock)
    coord = CheckpointCoordinator.recover(store, "job", fallback=True, clock=clock.monotonic,
                                          wall_clock=clock.wall)
    latest = coord.latest()
    assert latest is not None and latest.checkpoint_id == 1
    assert coord.doomed()[0] == {key}
    # The corrupt id is not reused automatically; a re-run of it is still allowed.
    done = run_checkpoint(coord, {"t": list(latest.referenced_keys)}, checkpoint_id=2)
    assert done.manifest.attempt == 2 and key in done.deleted
    assert coord.trigger(["t"]) == 3


def test_recover_fails_when_no_manifest_is_valid(store: RecordingStore) -> None:
    store.put(manifest_key(1, 1), b"{}")
    with pytest.raises(CorruptObjectError, match="none of the 1 manifests"):
        CheckpointCoordinator.recover(store, "job", fallback=True)


# --------------------------------------------------------------------------- orphans


def test_orphan_collection_respects_the_grace_period(store: RecordingStore,
                                                     clock: FakeClock) -> None:
    coord = coordinator(store, clock)
    old = T0_MS - 3_600_000
    referenced = upload(store, created_ms=old)
    orphan = upload(store, created_ms=old)
    orphan_snap = upload(store, created_ms=old, prefix="snapshots/op/")
    young = upload(store, created_ms=T0_MS - 10_000)
    store.put("dstl/unparseable-name.seg", b"?")
    store.put("elsewhere/keep-me", b"?")
    run_checkpoint(coord, {"t": [referenced]})
    pinned = upload(store, created_ms=old)
    cid = coord.trigger(["t", "u"])
    coord.acknowledge(cid, "t", {}, [pinned], 0, 0)  # in-flight: must survive

    deleted = coord.collect_orphans(min_age_s=60, now_ms=T0_MS)
    assert sorted(deleted) == sorted([orphan, orphan_snap])
    assert {referenced, young, pinned, "dstl/unparseable-name.seg",
            "elsewhere/keep-me"} <= store.names()
    # An hour later the young object is old enough.
    assert coord.collect_orphans(min_age_s=60, now_ms=T0_MS + 3_600_000) == [young]
    clock.advance(3600)
    assert coord.collect_orphans(min_age_s=60) == []  # default now: the wall clock
    assert coord.stats()["CheckpointCoordinator.numberOfCollectedOrphans"] == 3
    with pytest.raises(UsageError):
        coord.collect_orphans(min_age_s=-1)


def test_orphan_collection_deletes_stale_manifests_first(store: RecordingStore,
                                                         clock: FakeClock) -> None:
    coord = coordinator(store, clock)
    a = upload(store, created_ms=0)
    run_checkpoint(coord, {"t": []})
    m1 = coord.latest()
    assert m1 is not None
    # A manifest the coordinator does not retain (say, left by a crash) that names a.
    ghost = Manifest.build(job_id="job", checkpoint_id=0, attempt=1, created_ms=0,
                           tasks=[TaskEntry.of("t", {}, [a], 0, 0)], trigger_ms=0,
                           duration_ms=0, ack_latency_ms={"t": 0.0}, retained=3)
    store.put(ghost.key, ghost.encode())
    store.log.clear()
    deleted = coord.collect_orphans(min_age_s=0, now_ms=T0_MS)
    assert deleted == [ghost.key, a]
    assert [k for op, k in store.log if op == "delete"] == [ghost.key, a]
    assert store.names("checkpoints/") == {m1.key}


def test_an_acknowledgement_naming_an_object_being_deleted_is_refused(
        clock: FakeClock) -> None:
    """Between choosing an object for deletion and deleting it, an acknowledgement naming it
    would yield a checkpoint that references deleted data: it is refused, typed."""
    store = RecordingStore()
    executor = ManualExecutor()  # deletions wait until the test runs them
    coord = coordinator(store, clock, retained=1, executor=executor)
    a, b = upload(store, clock), upload(store, clock)
    run_checkpoint(coord, {"t": [a]})
    executor.run_all()
    refused: list[Exception] = []
    original_delete = store.delete

    def delete(keys: Iterable[str]) -> None:
        keys = list(keys)
        if a in keys:  # the next checkpoint is already pending while a is being deleted
            try:
                coord.acknowledge(pending, "u", {}, [a], 0, 0)
            except UsageError as exc:
                refused.append(exc)
        original_delete(keys)

    store.delete = delete  # type: ignore[method-assign]
    run_checkpoint(coord, {"t": [b]})
    pending = coord.trigger(["t", "u"])
    executor.run_all()
    assert len(refused) == 1 and "being deleted" in str(refused[0])
    assert a not in store.names()
    run_checkpoint(coord, {"t": [b], "u": []}, checkpoint_id=pending)
    assert retained_refs(coord) == {b}


def test_deletions_on_a_thread_pool_end_in_the_same_state(clock: FakeClock) -> None:
    store = RecordingStore()
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dstl-test-discard")
    try:
        coord = coordinator(store, clock, retained=2, executor=pool)
        log: list[str] = []
        for i in range(30):
            log = [upload(store, clock)] if i % 5 == 0 else [*log, upload(store, clock)]
            run_checkpoint(coord, {"t": log, "u": log[-1:]})
        coord.close()  # waits for the deletions handed to the pool
    finally:
        pool.shutdown(wait=True)
    assert coord.doomed() == (frozenset(), frozenset())
    assert store.names("dstl/") == retained_refs(coord)
    assert store.names("checkpoints/") == {m.key for m in coord.manifests()}


def test_orphan_collection_refuses_a_store_with_unknown_newer_checkpoints(
        store: RecordingStore, clock: FakeClock) -> None:
    writer = coordinator(store, clock)
    a = upload(store, created_ms=0)
    run_checkpoint(writer, {"t": [a]})
    run_checkpoint(writer, {"t": [a]})
    # A second coordinator that was constructed instead of recovered must not wipe the store.
    stranger = coordinator(store, clock)
    with pytest.raises(UsageError) as info:
        stranger.collect_orphans(min_age_s=0, now_ms=T0_MS)
    assert str(info.value) == (
        f"another query writes to this state_uri: {store.location} holds checkpoint 1 "
        f"({manifest_key(1, 1)}), which this query did not write (its latest is -1); nothing "
        "was deleted. Run one query per state_uri: stop the other query, or give this one a "
        "state_uri of its own (a CheckpointCoordinator built directly on a store with "
        "checkpoints is opened with CheckpointCoordinator.recover())")
    assert a in store.names() and len(store.names("checkpoints/")) == 2


def test_two_writers_of_one_checkpoint_id_name_the_other_query(store: RecordingStore,
                                                              clock: FakeClock) -> None:
    first = CheckpointCoordinator.recover(store, "job", clock=clock.monotonic,
                                          wall_clock=clock.wall)
    second = CheckpointCoordinator.recover(store, "job", clock=clock.monotonic,
                                           wall_clock=clock.wall)
    a = upload(store, created_ms=0)
    run_checkpoint(first, {"t": [a]}, checkpoint_id=4)
    cid = second.trigger(["t"], 4)
    with pytest.raises(CheckpointCommitError) as info:
        second.acknowledge(cid, "t", {}, [a], full_size=1, incremental_size=1)
    message = str(info.value)
    assert message.startswith(f"checkpoint 4 was not committed: manifest put {manifest_key(4, 1)} "
                              "failed (")
    assert message.endswith(
        "; another query writes to this state_uri: run one query per state_uri (stop the other "
        "query, or give this one a state_uri of its own). A CheckpointCoordinator built directly "
        "on a store with checkpoints is opened with CheckpointCoordinator.recover()")


def test_set_properties_commits_them_with_the_manifest_and_recover_reads_them(
        store: RecordingStore, clock: FakeClock) -> None:
    coord = coordinator(store, clock, retained=3)
    key = upload(store, clock)
    cid = coord.trigger(["t"])
    coord.set_properties(cid, {"watermark_ms": 10})
    coord.set_properties(cid, {"watermark_ms": 42})  # the last call wins
    with pytest.raises(UsageError, match="properties"):
        coord.set_properties(cid, {"bad name": 1})
    with pytest.raises(UsageError, match=r"not pending|pending"):
        coord.set_properties(cid + 1, {"watermark_ms": 1})
    done = coord.acknowledge(cid, "t", {"task": "t"}, [key], full_size=1, incremental_size=1)
    assert done is not None and done.manifest.properties == {"watermark_ms": 42}
    with pytest.raises(UsageError):
        coord.set_properties(cid, {"watermark_ms": 1})  # committed: no longer pending
    run_checkpoint(coord, {"t": [key]})  # a checkpoint without properties: a v2 manifest
    again = CheckpointCoordinator.recover(store, "job", retained=3, clock=clock.monotonic,
                                          wall_clock=clock.wall)
    assert [dict(m.properties) for m in again.manifests()] == [{"watermark_ms": 42}, {}]
