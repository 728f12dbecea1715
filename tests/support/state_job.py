"""A keyed job without Spark, with a dict model of its state and of every change, for the state
reader's tests: ``P`` backends (heap or LMDB) on one storage, a checkpoint coordinator writing
manifests like the Spark operator does (tasks ``p<N>``, backend handles as states), random
operations on every state kind, materializations, and rescaling.

The model is what a reader must reproduce: :attr:`MiniJob.model` is the state after the last
operation (checkpointed state = the model at the checkpoint), :attr:`MiniJob.changes` every
elementary change with the checkpoint it went into (the ops of :mod:`dstl.reader.rows`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from dstl.checkpoint import CheckpointCoordinator
from dstl.keygroups import KeyGroupRange, key_group_for
from dstl.storage import ChangelogStorage
from dstl.stores.base import BlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle
from materializer.states import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from restore.restore import restore_backend

#: The model's key: (state name, key, namespace).
Ident = tuple[str, str, Any]


class MeanAgg:
    """An AggregateFunction: the accumulator is [sum, count]."""

    def create_accumulator(self) -> list[int]:
        return [0, 0]

    def add(self, value: int, acc: list[int]) -> list[int]:
        return [acc[0] + value, acc[1] + 1]

    def get_result(self, acc: list[int]) -> float:
        return acc[0] / acc[1]

    def merge(self, a: list[int], b: list[int]) -> list[int]:
        return [a[0] + b[0], a[1] + b[1]]


def _sum(a: int, b: int) -> int:
    return a + b


@dataclass
class Change:
    """One elementary change as a reader reports it."""

    checkpoint: int
    key: str
    state: str
    namespace: Any
    op: str
    user_key: Any
    value: Any


@dataclass
class MiniJob:
    store: BlobStore
    partitions: int = 2
    max_parallelism: int = 16
    table: str = "heap"
    name: str = "job"
    retained: int = 3
    seed: int = 0
    model: dict[Ident, Any] = field(default_factory=dict)
    changes: list[Change] = field(default_factory=list)
    checkpoint_models: dict[int, dict[Ident, Any]] = field(default_factory=dict)
    next_checkpoint: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.storage = ChangelogStorage(store=_Borrowed(self.store))
        self.coordinator = CheckpointCoordinator(self.store, job_id=self.name,
                                                 retained=self.retained)
        self.backends: list[ChangelogKeyedStateBackend] = []
        self.states: list[dict[str, Any]] = []
        for p in range(self.partitions):
            self._install(p, ChangelogKeyedStateBackend(
                self.storage, self._op(p), self._range(p), self.max_parallelism,
                table=self.table, auto_materialize=False))

    # ------------------------------------------------------------------ layout

    def _op(self, p: int) -> str:
        return f"{self.name}/p{p}"

    def _range(self, p: int) -> KeyGroupRange:
        return KeyGroupRange.of_operator(self.max_parallelism, self.partitions, p)

    def partition_of(self, key: str) -> int:
        kg = key_group_for(key.encode("utf-8"), self.max_parallelism)
        return kg * self.partitions // self.max_parallelism

    def _install(self, p: int, backend: ChangelogKeyedStateBackend) -> None:
        states = {
            "count": backend.get_state(ValueStateDescriptor("count")),
            "events": backend.get_state(ListStateDescriptor("events")),
            "attrs": backend.get_state(MapStateDescriptor("attrs")),
            "total": backend.get_state(ReducingStateDescriptor("total", _sum)),
            "mean": backend.get_state(AggregatingStateDescriptor("mean", MeanAgg())),
            "window": backend.get_state(ValueStateDescriptor("window")),
        }
        if p < len(self.backends):
            self.backends[p], self.states[p] = backend, states
        else:
            self.backends.append(backend)
            self.states.append(states)

    # ------------------------------------------------------------------ operations

    def _record(self, key: str, state: str, ns: Any, op: str, user_key: Any = None,
                value: Any = None) -> None:
        self.changes.append(Change(self.next_checkpoint, key, state, ns, op, user_key, value))

    def step(self, key: str) -> None:
        """One random operation on one state of ``key``, applied to the job and the model."""
        p = self.partition_of(key)
        b, st = self.backends[p], self.states[p]
        b.set_current_key(key)
        b.set_current_namespace(None)
        getattr(self, f"_op_{self.rng.choice(_OPS)}")(key, b, st)

    def _op_count(self, key: str, b: Any, st: dict[str, Any]) -> None:
        if self.rng.random() < 0.1 and ("count", key, None) in self.model:
            st["count"].update(None)
            del self.model[("count", key, None)]
            self._record(key, "count", None, "clear")
            return
        v = (self.model.get(("count", key, None)) or 0) + 1
        st["count"].update(v)
        self.model[("count", key, None)] = v
        self._record(key, "count", None, "set", value=v)

    def _op_events(self, key: str, b: Any, st: dict[str, Any]) -> None:
        ident = ("events", key, None)
        r = self.rng.random()
        if r < 0.15:
            vals = [f"r{self.rng.randrange(9)}", {"n": self.rng.randrange(5)}]
            st["events"].update(vals)
            self.model[ident] = list(vals)
            self._record(key, "events", None, "set", value=vals)
        elif r < 0.3:
            vals = [self.rng.randrange(100), b"\x00\xff"]
            st["events"].add_all(vals)
            self.model.setdefault(ident, []).extend(vals)
            for v in vals:
                self._record(key, "events", None, "add", value=v)
        else:
            v = (self.rng.randrange(1000), "e")
            st["events"].add(v)
            self.model.setdefault(ident, []).append(v)
            self._record(key, "events", None, "add", value=v)

    def _op_attrs(self, key: str, b: Any, st: dict[str, Any]) -> None:
        ident = ("attrs", key, None)
        cur = self.model.get(ident, {})
        r = self.rng.random()
        if r < 0.25 and cur:
            k = self.rng.choice(sorted(cur))
            st["attrs"].remove(k)
            del cur[k]
            self._record(key, "attrs", None, "remove", user_key=k)
            if not cur:
                del self.model[ident]
            return
        if r < 0.4:
            d = {f"a{self.rng.randrange(4)}": self.rng.random(), "z": None}
            st["attrs"].put_all(d)
            for k, v in d.items():
                self._record(key, "attrs", None, "put", user_key=k, value=v)
        else:
            d = {f"a{self.rng.randrange(4)}": [self.rng.randrange(3)]}
            k, v = next(iter(d.items()))
            st["attrs"].put(k, v)
            self._record(key, "attrs", None, "put", user_key=k, value=v)
        cur.update(d)
        self.model[ident] = cur

    def _op_total(self, key: str, b: Any, st: dict[str, Any]) -> None:
        x = self.rng.randrange(1, 10)
        st["total"].add(x)
        v = self.model.get(("total", key, None), 0) + x if ("total", key, None) in self.model \
            else x
        self.model[("total", key, None)] = v
        self._record(key, "total", None, "set", value=v)

    def _op_mean(self, key: str, b: Any, st: dict[str, Any]) -> None:
        x = self.rng.randrange(10)
        st["mean"].add(x)
        acc = MeanAgg().add(x, self.model.get(("mean", key, None), [0, 0]))
        self.model[("mean", key, None)] = acc
        self._record(key, "mean", None, "set", value=acc)

    def _op_window(self, key: str, b: Any, st: dict[str, Any]) -> None:
        ns = ("w", self.rng.randrange(3))
        b.set_current_namespace(ns)
        v = self.rng.randrange(50)
        st["window"].update(v)
        self.model[("window", key, ns)] = v
        self._record(key, "window", ns, "set", value=v)
        b.set_current_namespace(None)

    def run(self, n: int, keys: int = 40) -> None:
        for _ in range(n):
            self.step(f"k{self.rng.randrange(keys)}")

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self) -> int:
        """Checkpoint every backend, commit a manifest, notify the backends; its id."""
        cid = self.next_checkpoint
        self.coordinator.trigger([f"p{i}" for i in range(len(self.backends))],
                                 checkpoint_id=cid)
        done = None
        for i, b in enumerate(self.backends):
            h = b.snapshot(cid).result(timeout=30)
            done = self.coordinator.acknowledge(cid, f"p{i}", h.to_json_obj(),
                                                h.referenced_keys(), h.full_size,
                                                h.incremental_size) or done
        assert done is not None
        for b in self.backends:
            b.notify_checkpoint_complete(cid)
            for s in done.subsumed:
                b.notify_checkpoint_subsumed(s.checkpoint_id)
        self.checkpoint_models[cid] = {k: _copy(v) for k, v in self.model.items()}
        self.next_checkpoint += 1
        return cid

    def materialize(self, p: int | None = None) -> None:
        for i, b in enumerate(self.backends):
            if p is None or p == i:
                assert b.materialize_now(timeout_s=30) is not None

    def rescale(self, partitions: int) -> None:
        """Restore the newest checkpoint into ``partitions`` backends (like a restarted job)."""
        latest = self.coordinator.latest()
        assert latest is not None
        handles = [ChangelogStateBackendHandle.from_json_obj(dict(t.state)) for t in latest.tasks]
        for b in self.backends:
            b.close()
        self.backends, self.states = [], []
        self.partitions = partitions
        for p in range(partitions):
            rng = self._range(p)
            mine = [h for h in handles if len(h.key_groups.intersection(rng))]
            self._install(p, restore_backend(mine, self.storage, rng, table=self.table,
                                             operator_id=self._op(p),
                                             max_parallelism=self.max_parallelism,
                                             auto_materialize=False))

    def close(self) -> None:
        for b in self.backends:
            b.close()
        self.coordinator.close()
        self.storage.close()


_OPS = ("count", "events", "attrs", "total", "mean", "window")


class _Borrowed:
    """The caller's store for the job's storage, which closes its store on close: the caller
    keeps reading after the job stops."""

    def __init__(self, store: BlobStore) -> None:
        self._store = store
        self.location = store.location

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def close(self) -> None:
        pass  # the caller closes the store


def _copy(v: Any) -> Any:
    if isinstance(v, list):
        return [_copy(x) for x in v]
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    return v


def replay(changes: Any, start: dict[Ident, Any] | None = None) -> dict[Ident, Any]:
    """Apply reader change rows (anything with key, state, namespace, op, user_key, value) to a
    copy of ``start``."""
    out = {k: _copy(v) for k, v in (start or {}).items()}
    for c in changes:
        ident = (c.state, c.key, c.namespace)
        if c.op == "set":
            out[ident] = _copy(c.value)
        elif c.op == "clear":
            out.pop(ident, None)
        elif c.op == "add":
            out.setdefault(ident, []).append(_copy(c.value))
        elif c.op == "put":
            out.setdefault(ident, {})[c.user_key] = _copy(c.value)
        elif c.op == "remove":
            m = out.get(ident, {})
            m.pop(c.user_key, None)
            if not m:
                out.pop(ident, None)
        else:
            raise AssertionError(f"unknown op {c.op}")
    return out


def state_of(rows: Any) -> dict[Ident, Any]:
    """The model form of reader state rows."""
    out: dict[Ident, Any] = {}
    for r in rows:
        ident = (r.state, r.key, r.namespace)
        if r.kind == "map":
            out.setdefault(ident, {})[r.user_key] = r.value
        else:
            assert ident not in out, f"two rows for {ident}"
            out[ident] = r.value
    return out
