"""A seeded mini job and its oracle: what the crash and S3 fault suites run and check.

The job is what a task manager plus its driver do, in one process: ``n_backends`` keyed backends
(heap or LMDB; value, list and map states) on one :class:`dstl.ChangelogStorage`, and a
:class:`CheckpointCoordinator` that commits one manifest per checkpoint with retention (so
subsumed manifests and objects are deleted). Writes are random but deterministic from a seed;
every write is applied to the backends and to a dict *model* at the same time.

Journal (the acknowledgement journal, Jepsen's history): a JSON-lines file, each record appended
with one ``write`` and an ``fsync``:

- ``intent`` (checkpoint id, the whole model) — written after ``trigger`` (which writes nothing
  to the store) and before any backend is asked for its part, so every checkpoint that can exist
  in the store has its expected state in the journal;
- ``ack`` (checkpoint id) — written only after the commit returned, i.e. the checkpoint was
  acknowledged to the caller;
- ``start`` (recovered checkpoint id) and ``error`` (a checkpoint failed).

Oracle (:func:`check_store`): recover the coordinator from the store, then

- **no loss** (G1): the recovered checkpoint id is >= the last acknowledged one (a newer
  checkpoint whose commit landed but was never acknowledged is legal — Jepsen's ``:info``);
- **exact state** (G2/G3): every retained checkpoint, restored through ``restore_backend``, equals
  the model of exactly its id, key by key and state by state (a duplicated list element, a lost
  map entry or a stale value all show);
- **atomicity** (G3): every object a retained manifest names exists, and every manifest is for a
  checkpoint that was intended.

It returns a list of problems (empty = pass) instead of asserting, so the self-tests can show that
it reports a broken target.
"""

from __future__ import annotations

import copy
import json
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.checkpoint import CheckpointCommitError, CheckpointCoordinator, Completion
from materializer import (
    BackendOptions,
    ChangelogKeyedStateBackend,
    ChangelogStateBackendHandle,
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
)
from restore import restore_backend

__all__ = ["JOB_ID", "MP", "Journal", "JournalView", "MiniJob", "Model", "check_store",
           "read_back"]

JOB_ID = "crashjob"
MP = 32
KGS = KeyGroupRange(0, MP - 1)
KEYS = [f"k{i}" for i in range(16)]
MAP_KEYS = [f"f{i}" for i in range(5)]
MAX_LIST = 6
WAIT_S = 60.0
#: Commits a driver tries again after a failed manifest put.
COMMIT_ATTEMPTS = 3

#: backend id -> key -> [value or None, list, map]; absent keys hold no state.
Model = dict[str, dict[str, list[Any]]]

_VALUE = ValueStateDescriptor("v")
_LIST = ListStateDescriptor("l")
_MAP = MapStateDescriptor("m")


def backend_ids(n: int) -> list[str]:
    return [f"op-{i}" for i in range(n)]


# --------------------------------------------------------------------------- journal


class Journal:
    """Append-only JSON lines; every record is one ``write`` followed by ``fsync``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, record: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(record, sort_keys=True) + "\n").encode())
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


@dataclass
class JournalView:
    """What a journal says: intended models per checkpoint id, acknowledgements, errors."""

    intents: dict[int, Model] = field(default_factory=dict)
    acked: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    starts: int = 0

    @property
    def last_acked(self) -> int | None:
        return max(self.acked) if self.acked else None

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> JournalView:
        view = cls()
        if not os.path.exists(path):
            return view
        with open(path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break  # a record cut by the kill never counted
                rec = json.loads(raw)
                if rec["t"] == "intent":
                    # a later intent for the same id replaces the earlier one: ids are reused
                    # only after a recovery that found no manifest for them
                    view.intents[rec["cp"]] = rec["model"]
                elif rec["t"] == "ack":
                    view.acked.append(rec["cp"])
                elif rec["t"] == "error":
                    view.errors.append(rec["error"])
                elif rec["t"] == "start":
                    view.starts += 1
        return view


# --------------------------------------------------------------------------- the job


#: Backend options of the incremental variant: chains of up to three deltas, whatever their size
#: (the job's states are small, so the default ratio would make most materializations full).
INCREMENTAL: dict[str, Any] = {"incremental_snapshots": True, "max_snapshot_deltas": 3,
                               "max_delta_ratio": 4.0}
#: Backend options of the full-snapshot variant (every materialization writes the whole table).
FULL: dict[str, Any] = {"incremental_snapshots": False}


@dataclass(frozen=True)
class JobConfig:
    table: str = "heap"
    n_backends: int = 3
    retained: int = 2
    writes_per_checkpoint: int = 12
    materialize_probability: float = 0.3
    options: DstlOptions = field(default_factory=lambda: DstlOptions(
        persist_delay_s=0.002, preemptive_persist_threshold_bytes=2048,
        upload_timeout_s=5.0, upload_retry_delay_s=0.05))
    backend_options: BackendOptions = field(default_factory=lambda: BackendOptions(
        materialization_interval_s=None, materialize_log_ratio=None, **FULL))


class MiniJob:
    """The job (see the module docstring). Open with :meth:`open`."""

    def __init__(self, storage: ChangelogStorage, coord: CheckpointCoordinator,
                 backends: dict[str, ChangelogKeyedStateBackend], model: Model,
                 config: JobConfig, journal: Journal | None) -> None:
        self.storage = storage
        self.coord = coord
        self.backends = backends
        self.model = model
        self.config = config
        self.journal = journal
        self.completed: list[int] = []
        self.deltas = 0

    @classmethod
    def open(cls, store: Any, config: JobConfig, *, intents: dict[int, Model],
             local_dir: str | None = None, journal: Journal | None = None) -> MiniJob:
        """Recover the coordinator from ``store`` and restore every backend from the newest
        checkpoint (or start empty); the model is the journal's model of that checkpoint."""
        storage = ChangelogStorage(store=store, options=config.options)
        try:
            coord = CheckpointCoordinator.recover(store, JOB_ID, retained=config.retained)
            latest = coord.latest()
            model: Model = {b: {} for b in backend_ids(config.n_backends)}
            if latest is not None:
                model = copy.deepcopy(intents[latest.checkpoint_id])
            backends = _open_backends(storage, latest, config, local_dir)
        except BaseException:
            storage.close()
            raise
        if journal is not None:
            journal.append({"t": "start", "recovered": latest.checkpoint_id if latest else None})
        return cls(storage, coord, backends, model, config, journal)

    # ------------------------------------------------------------------ writes

    def write(self, rng: random.Random, n: int | None = None) -> None:
        """``n`` random writes per backend, applied to the backend and to the model."""
        count = self.config.writes_per_checkpoint if n is None else n
        for bid, backend in self.backends.items():
            for _ in range(count):
                _random_write(backend, self.model[bid], rng)

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self, *, ack_early: bool = False, before_ack: Any = None) -> int:
        """Checkpoint every backend, commit the manifest, notify, journal the acknowledgement.

        ``ack_early`` (a deliberately broken job): the acknowledgement is journaled before the
        backends are asked for their parts, so before anything of the checkpoint is durable.
        """
        tasks = list(self.backends)
        cid = self.coord.trigger(tasks)
        if self.journal is not None:
            self.journal.append({"t": "intent", "cp": cid, "model": self.model})
            if ack_early:
                self.journal.append({"t": "ack", "cp": cid})
        try:
            futures = {bid: b.snapshot(cid) for bid, b in self.backends.items()}
            completion = None
            for bid, fut in futures.items():
                h = fut.result(WAIT_S)
                try:
                    completion = self.coord.acknowledge(cid, bid, h.to_json_obj(),
                                                        h.referenced_keys(), h.full_size,
                                                        h.incremental_size)
                except CheckpointCommitError:
                    completion = self._commit_again(cid)
        except BaseException as exc:
            if self.journal is not None:
                self.journal.append({"t": "error", "cp": cid,
                                     "error": f"{type(exc).__name__}: {exc}"})
            self._abort(cid, exc)
            raise
        assert completion is not None, "the last acknowledgement must commit"
        for b in self.backends.values():
            b.notify_checkpoint_complete(cid)
        for m in completion.subsumed:
            for b in self.backends.values():
                b.notify_checkpoint_subsumed(m.checkpoint_id)
        if before_ack is not None:
            before_ack(cid)
        if self.journal is not None and not ack_early:
            self.journal.append({"t": "ack", "cp": cid})
        self.completed.append(cid)
        return cid

    def _commit_again(self, cid: int) -> Completion:
        """What a driver does after a failed manifest put: commit again (a new attempt name)."""
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            try:
                return self.coord.complete(cid)
            except CheckpointCommitError:
                if attempt == COMMIT_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    def _abort(self, cid: int, exc: BaseException) -> None:
        if self.coord.pending_checkpoint_id == cid:
            self.coord.abort(cid, f"{type(exc).__name__}: {exc}")
        for b in self.backends.values():
            b.notify_checkpoint_aborted(cid)

    def materialize(self, rng: random.Random) -> int:
        """Materialize each backend with the configured probability; return how many ran
        (``deltas`` counts the incremental ones)."""
        done = 0
        for b in self.backends.values():
            if rng.random() < self.config.materialize_probability:
                ref = b.materialize_now(WAIT_S)
                if ref is not None:
                    done += 1
                    self.deltas += ref.delta
        return done

    def close(self) -> None:
        for b in self.backends.values():
            b.close()
        self.coord.close()
        self.storage.close()


def _open_backends(storage: ChangelogStorage, latest: Any, config: JobConfig,
                   local_dir: str | None) -> dict[str, ChangelogKeyedStateBackend]:
    handles = {} if latest is None else {t.task_id: t.state for t in latest.tasks}
    out: dict[str, ChangelogKeyedStateBackend] = {}
    try:
        for bid in backend_ids(config.n_backends):
            if bid in handles:
                out[bid] = restore_backend(
                    [ChangelogStateBackendHandle.from_json_obj(handles[bid])], storage, KGS,
                    table=config.table, options=config.backend_options,
                    local_directory=local_dir)
            else:
                out[bid] = ChangelogKeyedStateBackend(
                    storage, bid, KGS, MP, table=config.table, options=config.backend_options,
                    local_directory=local_dir, clear_local=True)
    except BaseException:
        for b in out.values():
            b.close()
        raise
    return out


def _random_write(backend: ChangelogKeyedStateBackend, model: dict[str, list[Any]],
                  rng: random.Random) -> None:
    key = rng.choice(KEYS)
    value, items, mapping = model.get(key, [None, [], {}])
    op = rng.choices(["set", "unset", "add", "replace", "put", "remove", "clear"],
                     weights=[4, 1, 4, 1, 4, 2, 1])[0]
    x = rng.randrange(1_000_000)
    if op == "add" and len(items) >= MAX_LIST:
        op = "replace"  # keeps the journal's models small
    mk = rng.choice(MAP_KEYS)
    backend.set_current_key(key)
    val, lst, mp = backend.get_state(_VALUE), backend.get_state(_LIST), backend.get_state(_MAP)
    {"set": lambda: val.update(x), "unset": val.clear, "add": lambda: lst.add(x),
     "replace": lambda: lst.update([x]), "put": lambda: mp.put(mk, x),
     "remove": lambda: mp.remove(mk),
     "clear": lambda: (val.clear(), lst.clear(), mp.clear())}[op]()
    if op == "set":
        value = x
    elif op == "unset":
        value = None
    elif op == "add":
        items = [*items, x]
    elif op == "replace":
        items = [x]
    elif op == "put":
        mapping = {**mapping, mk: x}
    elif op == "remove":
        mapping = {k: v for k, v in mapping.items() if k != mk}
    else:
        value, items, mapping = None, [], {}
    if value is None and not items and not mapping:
        model.pop(key, None)
    else:
        model[key] = [value, items, mapping]


# --------------------------------------------------------------------------- the oracle


def read_back(backend: ChangelogKeyedStateBackend) -> dict[str, list[Any]]:
    """Every key's state in the model's shape."""
    out: dict[str, list[Any]] = {}
    val, lst, mp = (backend.get_state(_VALUE), backend.get_state(_LIST),
                    backend.get_state(_MAP))
    for key in KEYS:
        backend.set_current_key(key)
        entry = [val.value(), list(lst.get()), dict(mp.items())]
        if entry != [None, [], {}]:
            out[key] = entry
    return out


def _diff(expected: dict[str, list[Any]], got: dict[str, list[Any]]) -> str:
    keys = sorted(set(expected) | set(got))
    bad = [f"{k}: expected {expected.get(k)} got {got.get(k)}" for k in keys
           if expected.get(k) != got.get(k)]
    return f"{len(bad)} keys differ: " + "; ".join(bad[:4])


def check_store(store: Any, view: JournalView, config: JobConfig, *,
                local_dir: str | None = None) -> list[str]:
    """The oracle (module docstring); ``store`` is a direct (fault-free) view of the job's store.

    Returns:
        Problems found, each naming the checkpoint and what is wrong; empty when all holds.
    """
    problems: list[str] = []
    coord = CheckpointCoordinator.recover(store, JOB_ID, retained=config.retained)
    latest = coord.latest()
    acked = view.last_acked
    got = latest.checkpoint_id if latest is not None else None
    if acked is not None and (got is None or got < acked):
        problems.append(f"LOST: checkpoint {acked} was acknowledged but the store recovers "
                        f"{got}")
    storage = ChangelogStorage(store=_Unclosable(store), options=config.options)
    try:
        for m in coord.manifests():
            problems += _check_manifest(store, storage, m, view, config, local_dir)
    finally:
        coord.close()
        storage.close()
    return problems


def _check_manifest(store: Any, storage: ChangelogStorage, m: Any, view: JournalView,
                    config: JobConfig, local_dir: str | None) -> list[str]:
    cid = m.checkpoint_id
    missing = sorted(k for k in m.referenced_keys if store.head(k) is None)
    if missing:
        return [f"ATOMICITY: checkpoint {cid} ({m.key}) names missing objects {missing[:3]}"]
    model = view.intents.get(cid)
    if model is None:
        return [f"ATOMICITY: checkpoint {cid} ({m.key}) exists but was never intended"]
    problems = []
    for task in m.tasks:
        h = ChangelogStateBackendHandle.from_json_obj(task.state)
        b = restore_backend([h], storage, KGS, table=config.table,
                            options=config.backend_options, local_directory=local_dir)
        try:
            got = read_back(b)
        finally:
            b.close()
        want = model.get(task.task_id, {})
        if got != want:
            problems.append(f"MISMATCH: checkpoint {cid} backend {task.task_id}: "
                            f"{_diff(want, got)}")
    if sorted(t.task_id for t in m.tasks) != sorted(model):
        problems.append(f"MISMATCH: checkpoint {cid} has tasks "
                        f"{sorted(t.task_id for t in m.tasks)}, expected {sorted(model)}")
    return problems


class _Unclosable:
    """The checker's storage must not close the caller's store."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.location = inner.location

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def close(self) -> None:
        """The caller closes the store."""


def expected_objects(store: Any, config: JobConfig) -> set[str]:
    """Keys that must exist: the retained manifests and what they reference."""
    coord = CheckpointCoordinator.recover(store, JOB_ID, retained=config.retained)
    try:
        return {m.key for m in coord.manifests()} | {
            k for m in coord.manifests() for k in m.referenced_keys}
    finally:
        coord.close()


def all_objects(store: Any, prefixes: Sequence[str] = ("dstl/", "snapshots/", "checkpoints/")
                ) -> set[str]:
    return {i.key for p in prefixes for i in store.list(p)}


def check_objects(store: Any, config: JobConfig, *, may_linger: Iterable[str] = ()) -> list[str]:
    """G5/G6 on the store itself: exactly the retained manifests and the objects they name
    exist. ``may_linger``: keys whose write was held past the client's timeout and may land after
    their cleanup (reported separately by the caller); every other extra object is a duplicate
    or a leak."""
    expected = expected_objects(store, config)
    found = all_objects(store)
    allowed = set(may_linger)
    return ([f"UNEXPECTED OBJECT: {k} is named by no retained checkpoint"
             for k in sorted(found - expected - allowed)]
            + [f"MISSING OBJECT: {k}" for k in sorted(expected - found)])


def journal_path(work: str | os.PathLike[str]) -> Path:
    return Path(work) / "journal.jsonl"


def summarize(problems: Iterable[str]) -> str:
    return "\n".join(problems)
