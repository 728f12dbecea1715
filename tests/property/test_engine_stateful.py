"""The whole engine against a dict model (reliability matrix R11/R10).

Rules: put, delete, clear (of a whole key's state), checkpoint, complete, subsume, materialize
(in full, or incremental: deltas after a full snapshot), crash-and-restore from ANY retained
checkpoint (heap or LMDB, possibly a different table than before). Invariants: the live backend equals the model; every object named by a retained
checkpoint exists (G5); a restore equals the model at that checkpoint (G2/G3).
"""

from __future__ import annotations

from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.stores import MemoryBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle
from materializer.options import BackendOptions
from materializer.states import ListStateDescriptor, ValueStateDescriptor
from restore.restore import restore_backend

MP = 16
KGS = KeyGroupRange(0, MP - 1)
KEYS = st.sampled_from([f"k{i}" for i in range(12)])
WAIT = 10.0
RETAINED = 2


class EngineMachine(RuleBasedStateMachine):
    @initialize(table=st.sampled_from(["heap", "lmdb"]),
                preemptive=st.sampled_from([64, 1 << 20]), incremental=st.booleans())
    def start(self, table: str, preemptive: int, incremental: bool) -> None:
        self.store = MemoryBlobStore()
        self.storage = ChangelogStorage(store=self.store, options=DstlOptions(
            persist_delay_s=0.0, preemptive_persist_threshold_bytes=preemptive))
        # incremental: chains of up to three deltas after a full snapshot, whatever their size
        self.opts = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None,
                                   incremental_snapshots=incremental, max_snapshot_deltas=3,
                                   max_delta_ratio=100.0)
        self.backend = ChangelogKeyedStateBackend(self.storage, "op", KGS, MP, table=table,
                                                  options=self.opts)
        self.model: dict[str, tuple[Any, list[int]]] = {}
        self.cp = 0
        self.pending: tuple[int, ChangelogStateBackendHandle, dict[str, Any]] | None = None
        self.retained: list[tuple[int, ChangelogStateBackendHandle, dict[str, Any]]] = []

    def _states(self) -> tuple[Any, Any]:
        b = self.backend
        return b.get_state(ValueStateDescriptor("v")), b.get_state(ListStateDescriptor("l"))

    @rule(k=KEYS, v=st.integers(0, 1000))
    def put(self, k: str, v: int) -> None:
        val, lst = self._states()
        self.backend.set_current_key(k)
        val.update(v)
        lst.add(v)
        old = self.model.get(k, (None, []))
        self.model[k] = (v, [*old[1], v])

    @rule(k=KEYS)
    def delete(self, k: str) -> None:
        val, _ = self._states()
        self.backend.set_current_key(k)
        val.clear()
        if k in self.model:
            self.model[k] = (None, self.model[k][1])

    @rule(k=KEYS)
    def clear(self, k: str) -> None:
        val, lst = self._states()
        self.backend.set_current_key(k)
        val.clear()
        lst.clear()
        self.model.pop(k, None)

    @precondition(lambda self: self.pending is None)
    @rule()
    def checkpoint(self) -> None:
        self.cp += 1
        h = self.backend.snapshot(self.cp).result(WAIT)
        self.pending = (self.cp, h, {k: (v[0], list(v[1])) for k, v in self.model.items()})

    @precondition(lambda self: self.pending is not None)
    @rule(complete=st.booleans())
    def finish_checkpoint(self, complete: bool) -> None:
        assert self.pending is not None
        cp, h, snap = self.pending
        self.pending = None
        if not complete:
            self.backend.notify_checkpoint_aborted(cp)
            return
        self.backend.notify_checkpoint_complete(cp)
        self.retained.append((cp, h, snap))
        while len(self.retained) > RETAINED:
            old_cp, _, _ = self.retained.pop(0)
            self.backend.notify_checkpoint_subsumed(old_cp)

    @precondition(lambda self: self.pending is None)
    @rule()
    def checkpoint_then_materialize(self) -> None:
        """A completed checkpoint and a materialization in one step (what a job does each
        interval): the sequences that build chains of deltas."""
        self.checkpoint()
        self.finish_checkpoint(True)
        self.materialize()

    @rule()
    def materialize(self) -> None:
        ref = self.backend.materialize_now(WAIT)
        event("materialize skipped" if ref is None
              else "materialized a delta" if ref.delta else "materialized in full")

    @precondition(lambda self: self.retained)
    @rule(which=st.integers(0, RETAINED - 1), table=st.sampled_from(["heap", "lmdb"]))
    def crash_and_restore(self, which: int, table: str) -> None:
        cp, h, snap = self.retained[min(which, len(self.retained) - 1)]
        # a crash: the process's storage and backend vanish without a clean close
        self.backend.close()
        self.storage.close()
        self.storage = ChangelogStorage(store=self.store, options=DstlOptions(
            persist_delay_s=0.0))
        self.backend = restore_backend([h.to_json()], self.storage, KGS, table=table,
                                       options=self.opts)
        self.model = {k: (v[0], list(v[1])) for k, v in snap.items()}
        # checkpoints after the restored one are gone with the failover
        self.retained = [r for r in self.retained if r[0] <= cp]
        self.pending = None
        deltas = sum(r.delta for r in h.materialized)
        event(f"restored ({'with' if h.materialized else 'without'} snapshot"
              f"{' and deltas' if deltas else ''}, {table})")

    @invariant()
    def table_equals_model(self) -> None:
        if not hasattr(self, "backend"):
            return
        val, lst = self._states()
        for i in range(12):
            k = f"k{i}"
            self.backend.set_current_key(k)
            v, items = self.model.get(k, (None, []))
            assert val.value() == v, (k, val.value(), v)
            assert lst.get() == items, (k, lst.get(), items)

    @invariant()
    def retained_checkpoints_are_complete(self) -> None:
        if not hasattr(self, "backend"):
            return
        self.storage._discard.submit(lambda: None).result(WAIT)
        for cp, h, _ in self.retained:
            for key in h.referenced_keys():
                assert self.store.head(key) is not None, f"checkpoint {cp} lost {key}"

    def teardown(self) -> None:
        if hasattr(self, "backend"):
            self.backend.close()
            self.storage.close()


TestEngine = EngineMachine.TestCase
