"""The executor agent's incremental materialization of LMDB partitions: deltas built from the
change sets the agent uploads, installed by the partition's backend, restored (with rescaling
1->2, 2->1, 4->3) to exactly the model; and the rules that make a materialization full instead (a table loaded
from a snapshot, a chain the checkpoint does not name, the compaction rule, change sets the agent
did not see).

One process plays both sides, as the agent and its workers do on an executor: a worker's batch
opens the partition's table (adopting it at the base, as ``dstl.spark.slots`` does), writes,
checkpoints, commits the marker and closes it; the agent is told the change sets that became
durable (their bodies read back from the store: the bytes the agent's persist receives), the
partition registers, and the agent materializes from a read-only open."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for
from dstl.segment import decode_record
from dstl.spark.agent import AgentMaterializer, PartitionSpec
from materializer import (
    BackendOptions,
    ChangelogKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    TableMarker,
    ValueStateDescriptor,
)
from materializer.delta_format import DELTA_VERSION
from materializer.file_snapshot import snapshot_version
from materializer.handles import ChangelogStateBackendHandle
from restore import restore_backend

MP = 16
KGS = KeyGroupRange(0, MP - 1)
OP = "op/p0"
STORE = "s"
NO_TIMER = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
KEYS = [f"k{i}" for i in range(60)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


Model = dict[str, dict[str, Any]]


class Executor:
    """A partition's table on one executor, its batches and the agent's materializer."""

    def __init__(self, tmp: Path, storage: ChangelogStorage, *, op: str = OP,
                 kgs: KeyGroupRange = KGS, **spec: Any) -> None:
        self.op, self.kgs = op, kgs
        self.keys = [k for k in KEYS if key_group_for(k.encode(), MP) in kgs]
        self.tmp = tmp
        self.storage = storage
        self.clock = Clock()
        self.agent = AgentMaterializer(clock=self.clock, start=False, uniform=lambda a, b: a)
        self.handle: ChangelogStateBackendHandle | None = None
        self.cp = 0
        self.spec_extra = {"incremental": True, "max_snapshot_deltas": 8,
                           "max_delta_ratio": 50.0, "max_delta_entries": 10_000, **spec}
        self.env = ""

    def _open(self, restore_from: ChangelogStateBackendHandle | None = None
              ) -> ChangelogKeyedStateBackend:
        local = str(self.tmp / f"local-{self.op.replace('/', '_')}")
        op, kgs = self.op, self.kgs
        if restore_from is not None:
            return restore_backend([restore_from], self.storage, kgs, table="lmdb",
                                   local_directory=local, operator_id=op, options=NO_TIMER,
                                   auto_materialize=False)
        if self.handle is None:
            return ChangelogKeyedStateBackend(self.storage, op, kgs, MP, table="lmdb",
                                              options=NO_TIMER, local_directory=local,
                                              clear_local=True, auto_materialize=False)
        b = ChangelogKeyedStateBackend(self.storage, op, kgs, MP, table="lmdb",
                                       options=NO_TIMER, local_directory=local,
                                       adopt_local=True, auto_materialize=False)
        h = self.handle
        b.install_restored(h.materialized, h.non_materialized, h.materialization_id)
        raw = b.tables.read_marker()
        assert raw is not None
        for sid, meta in TableMarker.from_bytes(raw).states.items():
            b.register_restored_state(meta, int(sid))
        return b

    def batch(self, model: Model, rng: random.Random, n: int = 12, *,
              restore: bool = False, note: bool = True, install: bool = True,
              offer: bool = True) -> ChangelogStateBackendHandle:
        """One task: open (adopt, or restore from the last checkpoint), install the agent's
        newest materialization, write ``n`` random updates, checkpoint, commit the marker,
        register (with the checkpoint's handle unless not ``offer``)."""
        b = self._open(self.handle if restore else None)
        try:
            self.env = b.tables.path
            v = b.get_state(ValueStateDescriptor("v"))
            lst = b.get_state(ListStateDescriptor("l"))
            mp = b.get_state(MapStateDescriptor("m"))
            first_sqn = b.writer.next_sqn()
            self.cp += 1
            with b.write_batch():
                for _ in range(n):
                    k = rng.choice(self.keys)
                    b.set_current_key(k)
                    row = model.setdefault(k, {})
                    op = rng.randrange(6)
                    if op == 0:
                        v.update(rng.randrange(1000))
                        row["v"] = v.value()
                    elif op == 1:
                        v.clear()
                        row.pop("v", None)
                    elif op == 2:
                        lst.add(rng.randrange(10))
                        row["l"] = lst.get()
                    elif op == 3:
                        mp.put(f"f{rng.randrange(4)}", rng.randrange(100))
                        row["m"] = dict(mp.items())
                    elif op == 4:
                        mp.remove(f"f{rng.randrange(4)}")
                        row["m"] = dict(mp.items())
                        if not row["m"]:
                            row.pop("m")
                    else:
                        lst.clear()
                        row.pop("l", None)
                latest = self.agent.latest(STORE, self.op).materialization
                if latest is not None and install:
                    b.install_materialization(latest.ref, latest.boundary, latest.chain)
                h = b.snapshot(self.cp).result(10)
                b.write_table_marker(h)
            b.notify_checkpoint_complete(self.cp)
            new = [r for r in b.last_delta.change_sets if r.sqn >= first_sqn] \
                if b.last_delta is not None else []
            marker = b.table_marker(h)
        finally:
            b.close()
        if note:
            bodies = [(self.op, r.key, r.offset, r.sqn, decode_record(
                self.storage.store.get_range(r.key, r.offset, r.length), key=r.key,
                offset=r.offset, log_id=self.op, sqn=r.sqn)) for r in new]
            self.agent.note_persisted(STORE, bodies)
        self.agent.register(STORE, self.storage.store, PartitionSpec(
            self.op, self.env, self.kgs, 10.0, None, 0, 1, 3, marker.boundary, marker.log_bytes,
            marker.snapshot_bytes, table_id=marker.table_id, checkpoint=h if offer else None,
            **self.spec_extra))
        self.handle = h
        return h

    def materialize(self) -> Any:
        self.clock.now += 10.0
        self.agent.request(STORE, self.op)
        assert self.agent.run_due() == 1
        return self.agent.latest(STORE, self.op).materialization

    def close(self) -> None:
        self.agent.close()


def _read(storage: ChangelogStorage, handles: list[ChangelogStateBackendHandle],
          kgs: KeyGroupRange, local: Path) -> Model:
    b = restore_backend(handles, storage, kgs, table="lmdb", local_directory=str(local),
                        operator_id=f"check-{local.name}", max_parallelism=MP)
    try:
        v = b.get_state(ValueStateDescriptor("v"))
        lst = b.get_state(ListStateDescriptor("l"))
        mp = b.get_state(MapStateDescriptor("m"))
        out: Model = {}
        for k in KEYS:
            if key_group_for(k.encode(), MP) not in kgs:
                continue
            b.set_current_key(k)
            row = {}
            if (x := v.value()) is not None:
                row["v"] = x
            if (x := lst.get()):
                row["l"] = x
            if not mp.is_empty():
                row["m"] = dict(mp.items())
            if row:
                out[k] = row
        return out
    finally:
        b.close()


def _expected(model: Model, kgs: KeyGroupRange) -> Model:
    return {k: r for k, r in model.items() if r and key_group_for(k.encode(), MP) in kgs}


def _kinds(storage: ChangelogStorage, h: ChangelogStateBackendHandle) -> list[str]:
    out = []
    for p in h.materialized:
        version = snapshot_version(storage.store.get_range(p.key, 0, 8))
        assert p.delta == (version == DELTA_VERSION), p
        out.append("d" if p.delta else "f")
    return out


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(str(tmp_path / "store"), options=DstlOptions(persist_delay_s=0.0))
    yield s
    s.close()


@pytest.mark.parametrize("seed", [1, 2])
def test_agent_deltas_restore_to_the_model_with_rescaling(storage: ChangelogStorage,
                                                          tmp_path: Path, seed: int) -> None:
    print("seed", seed)
    rng = random.Random(seed)
    ex = Executor(tmp_path, storage)
    model: Model = {}
    ex.batch(model, rng, 40)
    first = ex.materialize()
    assert not first.ref.delta and first.chain == ()
    kinds = []
    for i in range(6):
        ex.batch(model, rng)
        ex.batch(model, rng)
        m = ex.materialize()
        assert m.ref.delta, f"materialization {i + 2} is full"
        assert m.chain[0].key == first.ref.key
        h = ex.batch(model, rng)  # installs it
        kinds = _kinds(storage, h)
        assert kinds == ["f"] + ["d"] * (i + 1)
        assert _read(storage, [h], KGS, tmp_path / f"r{i}") == _expected(model, KGS)
    assert ex.agent.metrics()["materializer.deltas"] == 6
    # rescaling: 1 -> 2 from the chain and its log
    for j, sub in enumerate((KeyGroupRange(0, 6), KeyGroupRange(7, MP - 1))):
        assert _read(storage, [h], sub, tmp_path / f"half{j}") == _expected(model, sub)
    ex.close()


def test_change_sets_no_delta_needs_are_not_kept(storage: ChangelogStorage,
                                                 tmp_path: Path) -> None:
    """While the next materialization is full, a registration drops the change sets up to its
    boundary; once a full snapshot is taken, the change sets after it are kept for the delta."""
    rng = random.Random(5)
    ex = Executor(tmp_path, storage)
    model: Model = {}
    for _ in range(3):  # registered, nothing materialized yet: nothing kept
        ex.batch(model, rng, 40)
        assert ex.agent.metrics()["materializer.pendingBytes"] == 0
    assert not ex.materialize().ref.delta
    ex.batch(model, rng)
    ex.batch(model, rng)
    assert ex.agent.metrics()["materializer.pendingBytes"] > 0
    assert ex.materialize().ref.delta
    assert ex.agent.metrics()["materializer.pendingBytes"] == 0
    ex.batch(model, rng, note=False)  # a change set the agent did not see: the next is full
    full = ex.materialize()
    assert not full.ref.delta
    # the next batch names that full snapshot: the one after it is a delta on it, its entries
    # from the registered checkpoint's log (read from the store) and nothing kept before it
    ex.batch(model, rng)
    assert ex.agent.metrics()["materializer.pendingBytes"] == 0
    m = ex.materialize()
    assert m.ref.delta and m.chain == (full.ref,)
    ex.batch(model, rng)  # kept again after that delta
    assert ex.agent.metrics()["materializer.pendingBytes"] > 0
    assert ex.materialize().ref.delta
    h = ex.batch(model, rng)
    assert _read(storage, [h], KGS, tmp_path / "final") == _expected(model, KGS)
    ex.close()


def test_full_when_the_table_was_loaded_compaction_or_changes_unknown(
        storage: ChangelogStorage, tmp_path: Path) -> None:
    rng = random.Random(7)
    ex = Executor(tmp_path, storage, max_snapshot_deltas=2)
    model: Model = {}
    ex.batch(model, rng, 40)
    assert not ex.materialize().ref.delta
    ex.batch(model, rng)
    assert ex.materialize().ref.delta
    ex.batch(model, rng)
    assert ex.materialize().ref.delta
    ex.batch(model, rng)
    # two deltas follow the full snapshot: the compaction rule merges them into the next one
    m = ex.materialize()
    assert m.ref.delta and m.merged and len(m.chain) == 1
    ex.batch(model, rng)
    assert ex.materialize().ref.delta
    # the table is restored from the checkpoint (a re-run batch, the partition came back): a new
    # table_id, so the changes between the two cuts are not all in the change sets; without
    # the checkpoint's handle to start a chain from: full
    h = ex.batch(model, rng, restore=True, offer=False)
    assert ex.materialize().ref.delta is False
    # a change set the agent did not see (persisted elsewhere): the boundary is not in its list
    ex.batch(model, rng)
    assert ex.materialize().ref.delta
    ex.batch(model, rng, note=False)
    m = ex.materialize()
    assert not m.ref.delta
    # ... and the snapshot after that is chained only once the change sets are known again
    ex.batch(model, rng)
    m = ex.materialize()
    h = ex.batch(model, rng)
    assert _read(storage, [h], KGS, tmp_path / "final") == _expected(model, KGS)
    assert ex.agent.metrics()["materializer.full"] >= 3
    ex.close()


def test_a_delta_is_not_installed_on_another_chain(storage: ChangelogStorage,
                                                   tmp_path: Path) -> None:
    rng = random.Random(3)
    ex = Executor(tmp_path, storage)
    model: Model = {}
    ex.batch(model, rng, 40)
    full = ex.materialize()
    ex.batch(model, rng)
    ex.batch(model, rng)
    delta = ex.materialize()
    assert delta.ref.delta
    b = ChangelogKeyedStateBackend(storage, "other", KGS, MP, table="lmdb", options=NO_TIMER,
                                   local_directory=str(tmp_path / "other"))
    try:
        # a backend whose base is not the delta's chain does not install it, even though the
        # boundary is nowhere in its log either way; and a chain that is not the base is refused
        assert b.install_materialization(delta.ref, delta.boundary, delta.chain) is None
        assert b.install_materialization(delta.ref, delta.boundary, (full.ref,)) is None
    finally:
        b.close()
    # the partition's own backend skips one delta: the next one brings it along (its base is a
    # prefix of the chain)
    ex.batch(model, rng, install=False)
    ex.batch(model, rng, install=False)
    second = ex.materialize()
    assert second.ref.delta and second.chain == (full.ref, delta.ref)
    h = ex.batch(model, rng)
    assert [p.key for p in h.materialized] == [full.ref.key, delta.ref.key, second.ref.key]
    assert _read(storage, [h], KGS, tmp_path / "r") == _expected(model, KGS)
    ex.close()


@pytest.mark.parametrize(("before", "after"), [(2, 1), (4, 3)])
def test_agent_chains_of_several_partitions_restore_rescaled(
        storage: ChangelogStorage, tmp_path: Path, before: int, after: int) -> None:
    """Each of ``before`` partitions (one agent materializer each) writes a chain of a full
    snapshot and deltas and a log after it; the checkpoints restored into ``after`` partitions
    equal the model."""
    rng = random.Random(before * 10 + after)
    model: Model = {}
    handles = []
    for i in range(before):
        ex = Executor(tmp_path, storage, op=f"op/p{i}",
                      kgs=KeyGroupRange.of_operator(MP, before, i))
        ex.batch(model, rng, 30)
        assert not ex.materialize().ref.delta
        for _ in range(3):
            ex.batch(model, rng)
            assert ex.materialize().ref.delta
        ex.batch(model, rng)   # installs the last delta
        h = ex.batch(model, rng)   # and a log after the chain
        assert _kinds(storage, h) == ["f", "d", "d", "d"]
        handles.append(h)
        ex.close()
    for j in range(after):
        kgs = KeyGroupRange.of_operator(MP, after, j)
        assert _read(storage, handles, kgs, tmp_path / f"after-{j}") == _expected(model, kgs)


def _pieces_deleted_by_retention(handles: list[ChangelogStateBackendHandle], retain: int
                                 ) -> tuple[set[str], set[str]]:
    """Feed the checkpoints one by one to the retention planner (the coordinator's rule): the
    snapshot objects it deleted, and those the retained checkpoints reference."""
    from dstl.checkpoint.retention import CheckpointRefs, plan_retention

    retained: tuple[CheckpointRefs, ...] = ()
    deleted: set[str] = set()
    for h in handles:
        plan = plan_retention(retained, CheckpointRefs(h.checkpoint_id, 1,
                                                       frozenset(h.referenced_keys())),
                              retain=retain)
        deleted.update(k for k in plan.delete_objects if k.startswith("snapshots/"))
        retained = plan.retained
    kept = {k for r in retained for k in r.keys if k.startswith("snapshots/")}
    return deleted, kept


@pytest.mark.parametrize("seed", [11, 12] if os.environ.get("DSTL_DEEP") == "1" else [11])
def test_merged_deltas_bound_the_chain_and_restore_to_the_model(
        storage: ChangelogStorage, tmp_path: Path, seed: int) -> None:
    """With ``max_snapshot_deltas=3`` the fourth delta is a merged one that follows the full
    snapshot and replaces the deltas: every checkpoint names at most 1 + 3 pieces, restores
    (1 -> 2 included) equal the model, a checkpoint that still names the replaced deltas is
    followed by further deltas, and the replaced deltas are deleted exactly when no retained
    checkpoint names them."""
    print("seed", seed)
    rng = random.Random(seed)
    ex = Executor(tmp_path, storage, max_snapshot_deltas=3)
    model: Model = {}
    handles = [ex.batch(model, rng, 40)]
    full = ex.materialize()
    merges = 0
    for i in range(10):
        handles.append(ex.batch(model, rng, install=i % 4 != 2))  # sometimes not installed
        m = ex.materialize()
        assert m.ref.delta, f"materialization {i + 2} is full"
        assert m.chain[0] == full.ref and len(m.chain) <= 3
        if m.merged:
            merges += 1
            assert m.chain == (full.ref,)
        h = ex.batch(model, rng)
        handles.append(h)
        assert len(h.materialized) <= 4 and _kinds(storage, h)[0] == "f"
        assert _read(storage, [h], KGS, tmp_path / f"r{i}") == _expected(model, KGS)
    assert merges >= 2 and ex.agent.metrics()["materializer.merges"] == merges
    assert ex.agent.metrics()["materializer.full"] == 1
    for j, sub in enumerate((KeyGroupRange(0, 6), KeyGroupRange(7, MP - 1))):
        assert _read(storage, [handles[-1]], sub, tmp_path / f"half{j}") == _expected(model, sub)
    # deletion: a piece goes once no retained checkpoint names it, and never before
    named = {p.key for h in handles for p in h.materialized}
    deleted, kept = _pieces_deleted_by_retention(handles, retain=2)
    assert deleted == named - kept and full.ref.key in kept
    assert {p.key for p in handles[-1].materialized} <= kept
    ex.close()


def test_a_full_snapshot_once_the_deltas_reach_the_ratio(storage: ChangelogStorage,
                                                         tmp_path: Path) -> None:
    """The base is rewritten by bytes: deltas adding up to more than ``max_delta_ratio`` of the
    full snapshot make the next materialization full, whatever their count."""
    rng = random.Random(9)
    ex = Executor(tmp_path, storage, max_snapshot_deltas=100, max_delta_ratio=0.01)
    model: Model = {}
    ex.batch(model, rng, 40)
    first = ex.materialize()
    ex.batch(model, rng, 30)
    d = ex.materialize()
    assert d.ref.delta and d.ref.size > 0.01 * first.ref.size
    ex.batch(model, rng)
    m = ex.materialize()
    assert not m.ref.delta and m.ref.materialization_id > d.ref.materialization_id
    h = ex.batch(model, rng)
    assert _kinds(storage, h) == ["f"]
    ex.batch(model, rng)
    assert ex.materialize().ref.delta   # a new chain
    h = ex.batch(model, rng)
    assert _read(storage, [h], KGS, tmp_path / "r") == _expected(model, KGS)
    ex.close()


class _StoreDuring:
    """The store, calling ``hook`` once while a snapshot object is being uploaded (a task
    committing a batch while the agent's materialization is in flight)."""

    def __init__(self, store: Any, hook: Any) -> None:
        self._store, self.hook = store, hook

    def put(self, key: str, data: bytes) -> None:
        hook, self.hook = self.hook, None
        if hook is not None and key.startswith("snapshots/"):
            hook()
        self._store.put(key, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_batch_committed_during_a_materialization_keeps_the_next_delta(
        storage: ChangelogStorage, tmp_path: Path) -> None:
    """A registration that arrives while a full snapshot is being written does not drop the
    change sets after its cut: the next materialization is a delta."""
    rng = random.Random(21)
    ex = Executor(tmp_path, storage)
    model: Model = {}
    ex.batch(model, rng, 40)
    wrapped = _StoreDuring(storage.store, lambda: ex.batch(model, rng))
    p = ex.agent._parts[(STORE, ex.op)]
    p.store = wrapped  # type: ignore[assignment]
    first = ex.materialize()
    assert not first.ref.delta and wrapped.hook is None
    ex.batch(model, rng)
    m = ex.materialize()
    assert m.ref.delta and m.chain == (first.ref,)
    h = ex.batch(model, rng)
    assert _read(storage, [h], KGS, tmp_path / "r") == _expected(model, KGS)
    ex.close()


@pytest.mark.parametrize(("before", "after"), [(1, 2), (2, 1), (4, 3)])
def test_merged_chains_restore_rescaled(storage: ChangelogStorage, tmp_path: Path,
                                        before: int, after: int) -> None:
    """Chains with a merged delta (full snapshot, merged delta, deltas) of ``before``
    partitions restore into ``after`` partitions to exactly the model."""
    rng = random.Random(before * 100 + after)
    model: Model = {}
    handles = []
    for i in range(before):
        ex = Executor(tmp_path, storage, op=f"op/p{i}",
                      kgs=KeyGroupRange.of_operator(MP, before, i), max_snapshot_deltas=2)
        ex.batch(model, rng, 30)
        assert not ex.materialize().ref.delta
        merged = False
        for _ in range(4):
            ex.batch(model, rng)
            m = ex.materialize()
            assert m.ref.delta
            merged |= m.merged
        assert merged
        ex.batch(model, rng)   # installs the last delta
        h = ex.batch(model, rng)   # and a log after the chain
        assert _kinds(storage, h)[0] == "f" and len(h.materialized) <= 3
        handles.append(h)
        ex.close()
    for j in range(after):
        kgs = KeyGroupRange.of_operator(MP, after, j)
        assert _read(storage, handles, kgs, tmp_path / f"after-{j}") == _expected(model, kgs)


def _next_is_full_and_restores(ex: Executor, storage: ChangelogStorage, model: Model,
                               rng: random.Random, tmp_path: Path) -> None:
    """The next materialization is full (not a failure); the batch after installs it, and its
    checkpoint restores to the model."""
    m = ex.materialize()
    assert not m.ref.delta and ex.agent.metrics()["materializer.failed"] == 0
    h = ex.batch(model, rng)
    assert _kinds(storage, h) == ["f"]
    assert _read(storage, [h], ex.kgs, tmp_path / "r") == _expected(model, ex.kgs)


def test_a_merge_that_cannot_read_its_deltas_is_a_full_snapshot(storage: ChangelogStorage,
                                                                tmp_path: Path) -> None:
    """A delta of the chain missing from the store when a merge reads it back: the
    materialization is a full snapshot (not a failure), and the state restores from it."""
    rng = random.Random(31)
    ex = Executor(tmp_path, storage, max_snapshot_deltas=2)
    model: Model = {}
    ex.batch(model, rng, 40)
    ex.materialize()
    ex.batch(model, rng)
    gone = ex.materialize()
    ex.batch(model, rng)
    assert ex.materialize().ref.delta
    storage.store.delete([gone.ref.key])
    ex.batch(model, rng)
    _next_is_full_and_restores(ex, storage, model, rng, tmp_path)
    ex.close()


def test_a_delta_follows_a_full_snapshot_no_checkpoint_named_yet(storage: ChangelogStorage,
                                                                  tmp_path: Path) -> None:
    """The batch after the first full snapshot asked for it before it was written (its
    checkpoint names no snapshot): the next materialization is still a delta on that snapshot,
    and the batch after installs both."""
    rng = random.Random(41)
    ex = Executor(tmp_path, storage)
    model: Model = {}
    ex.batch(model, rng, 40)
    first = ex.materialize()
    ex.batch(model, rng, install=False)
    m = ex.materialize()
    assert m.ref.delta and m.chain == (first.ref,)
    h = ex.batch(model, rng)
    assert [p.key for p in h.materialized] == [first.ref.key, m.ref.key]
    assert _read(storage, [h], KGS, tmp_path / "r") == _expected(model, KGS)
    assert ex.agent.metrics()["materializer.full"] == 1
    ex.close()


def _restart_agent(ex: Executor) -> None:
    """The executor (its agent) restarted: a materializer that knows no partition."""
    ex.agent.close()
    ex.agent = AgentMaterializer(clock=ex.clock, start=False, uniform=lambda a, b: a)


@pytest.mark.parametrize("restart", [True, False])
def test_a_restored_table_continues_its_checkpoints_chain(storage: ChangelogStorage,
                                                          tmp_path: Path, restart: bool) -> None:
    """A partition restored from a checkpoint whose snapshot pieces are a full snapshot and a
    delta, with a log of two batches after them: by an agent that never saw it (the executor
    restarted) or by one whose chain the restore broke (the partition came back). The first
    materialization after the restore is a delta that follows the checkpoint's pieces and holds
    the entries of that log (read from the store) and of the batch after the restore; every
    checkpoint after restores to the model."""
    rng = random.Random(51)
    ex = Executor(tmp_path, storage)
    model: Model = {}
    ex.batch(model, rng, 40)
    full = ex.materialize()
    ex.batch(model, rng)
    delta = ex.materialize()
    ex.batch(model, rng)  # installs it
    ex.batch(model, rng)
    if restart:
        _restart_agent(ex)
    h = ex.batch(model, rng, restore=True)
    assert [p.key for p in h.materialized] == [full.ref.key, delta.ref.key]
    m = ex.materialize()
    assert m.ref.delta and m.chain == (full.ref, delta.ref)
    h = ex.batch(model, rng)
    assert _kinds(storage, h) == ["f", "d", "d"]
    assert _read(storage, [h], KGS, tmp_path / "r1") == _expected(model, KGS)
    ex.batch(model, rng)
    assert ex.materialize().ref.delta  # the chain goes on
    h = ex.batch(model, rng)
    assert _kinds(storage, h) == ["f", "d", "d", "d"]
    assert _read(storage, [h], KGS, tmp_path / "r2") == _expected(model, KGS)
    assert ex.agent.metrics()["materializer.full"] == (0 if restart else 1)
    for j, sub in enumerate((KeyGroupRange(0, 6), KeyGroupRange(7, MP - 1))):
        assert _read(storage, [h], sub, tmp_path / f"half{j}") == _expected(model, sub)
    ex.close()


def test_a_restored_table_is_snapshotted_in_full_when_its_checkpoint_cannot_seed_a_chain(
        storage: ChangelogStorage, tmp_path: Path) -> None:
    """No chain to continue: a checkpoint with no snapshot yet, or one whose log the agent
    cannot read back (a segment gone); the materialization is full, not a failure."""
    rng = random.Random(52)
    ex = Executor(tmp_path, storage)
    model: Model = {}
    ex.batch(model, rng, 40)
    ex.batch(model, rng)
    _restart_agent(ex)
    ex.batch(model, rng, restore=True)
    assert not ex.materialize().ref.delta  # nothing to follow
    ex.batch(model, rng)  # installs it
    before = ex.batch(model, rng)
    _restart_agent(ex)
    ex.batch(model, rng, restore=True)
    # the log before the restore is gone from the store (the restore read it already)
    storage.store.delete(sorted({r.key for lg in before.non_materialized
                                 for r in lg.change_sets}))
    _next_is_full_and_restores(ex, storage, model, rng, tmp_path)
    ex.close()


def test_a_restore_after_a_rescale_is_snapshotted_in_full(storage: ChangelogStorage,
                                                          tmp_path: Path) -> None:
    """Rescaled 1 -> 2: partition 0 keeps its name but restores half of the old partition's
    pieces (restricted to its key groups). No delta follows another partition's object: its
    first materialization is full, and its checkpoints restore to the model."""
    rng = random.Random(53)
    ex = Executor(tmp_path, storage)
    model: Model = {}
    ex.batch(model, rng, 40)
    ex.materialize()
    ex.batch(model, rng)  # installs it
    h = ex.batch(model, rng)
    ex.close()
    half = KeyGroupRange(0, 6)
    part = Executor(tmp_path, storage, kgs=half)
    part.handle, part.cp = h, ex.cp
    restored = part.batch(model, rng, restore=True)
    assert [p.key_groups for p in restored.materialized] == [half]
    _next_is_full_and_restores(part, storage, model, rng, tmp_path)
    part.close()
