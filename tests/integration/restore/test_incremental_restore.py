"""Incremental materialization: a restore from a full snapshot, the deltas written after it and
the log equals a dict model — every state kind, the heap and LMDB tables, rescaling 1->2, 2->1
and 4->3 — and the chain is bounded by the compaction rule (``max_snapshot_deltas``,
``max_delta_ratio``).

Each generation restores (or creates) ``p`` backends, checks every key of every state against
the model, then runs rounds of random writes (puts, adds, removes and clears, in two
namespaces), each followed by a checkpoint and a materialization, and ends with writes after the
last materialization (so the restore also replays a log tail). The seed is printed.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from itertools import pairwise
from typing import Any

import pytest

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for
from dstl.errors import (
    CorruptObjectError,
    MalformedHandleError,
    UnsupportedFormatError,
    UsageError,
)
from dstl.stores import MemoryBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle
from materializer.options import BackendOptions
from materializer.states import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from restore.restore import restore_backend

MP = 32
WAIT = 10.0
DEEP = os.environ.get("DSTL_DEEP") == "1"
KEYS = [f"k{i}" for i in range(300 if DEEP else 120)]
NAMESPACES = [None, "w1"]
OPTS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None,
                      incremental_snapshots=True, max_snapshot_deltas=3, max_delta_ratio=10.0)

#: (state, key, namespace) -> the value the state's read returns
Model = dict[tuple[str, str, Any], Any]


class _Mean:
    """An aggregate: (count, sum) accumulator, the mean as result."""

    def create_accumulator(self) -> Any:
        return [0, 0]

    def add(self, value: Any, accumulator: Any) -> Any:
        return [accumulator[0] + 1, accumulator[1] + value]

    def get_result(self, accumulator: Any) -> Any:
        return accumulator[1] / accumulator[0]

    def merge(self, a: Any, b: Any) -> Any:
        return [a[0] + b[0], a[1] + b[1]]


def _states(b: ChangelogKeyedStateBackend) -> dict[str, Any]:
    return {"v": b.get_state(ValueStateDescriptor("v")),
            "l": b.get_state(ListStateDescriptor("l")),
            "m": b.get_state(MapStateDescriptor("m")),
            "r": b.get_state(ReducingStateDescriptor("r", lambda a, c: a + c)),
            "a": b.get_state(AggregatingStateDescriptor("a", _Mean()))}


def _read(states: dict[str, Any], name: str) -> Any:
    s = states[name]
    if name == "l":
        return list(s.get() or []) or None
    if name == "m":
        return dict(s.items()) or None
    if name == "v":
        return s.value()
    return s.get()


@pytest.fixture
def storage() -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(store=MemoryBlobStore(), options=DstlOptions(persist_delay_s=0.0))
    yield s
    s.close()


def _owned(b: ChangelogKeyedStateBackend) -> list[str]:
    return [k for k in KEYS if key_group_for(k.encode(), MP) in b.key_groups]


def _check(backends: Sequence[ChangelogKeyedStateBackend], model: Model, where: str) -> None:
    for b in backends:
        states = _states(b)
        for k in _owned(b):
            b.set_current_key(k)
            for ns in NAMESPACES:
                b.set_current_namespace(ns)
                for name in states:
                    want = model.get((name, k, ns))
                    got = _read(states, name)
                    assert got == want, f"{where}: {name}[{k!r}, {ns!r}] in {b.operator_id}"
        b.set_current_namespace(None)


def _write(b: ChangelogKeyedStateBackend, model: Model, rng: random.Random, n: int) -> None:
    states = _states(b)
    keys = _owned(b)
    for _ in range(n):
        k, ns = rng.choice(keys), rng.choice(NAMESPACES)
        b.set_current_key(k)
        b.set_current_namespace(ns)
        name = rng.choice(list(states))
        s = states[name]
        slot = (name, k, ns)
        x = rng.randrange(100)
        if rng.random() < 0.15:   # clears and removals: tombstones in the next delta
            if name == "m" and model.get(slot):
                mk = rng.choice(sorted(model[slot]))
                s.remove(mk)
                del model[slot][mk]
                if not model[slot]:
                    del model[slot]
            else:
                s.clear()
                model.pop(slot, None)
                if name == "a":
                    model.pop(("a-acc", k, ns), None)
        elif name == "v":
            s.update(x)
            model[slot] = x
        elif name == "l":
            s.add(f"e{x}")
            model.setdefault(slot, []).append(f"e{x}")
        elif name == "m":
            s.put(f"m{x % 7}", x)
            model.setdefault(slot, {})[f"m{x % 7}"] = x
        elif name == "r":
            s.add(x)
            model[slot] = model.get(slot, 0) + x
        else:
            s.add(x)
            acc = model.get(("a-acc", k, ns), [0, 0])
            acc = [acc[0] + 1, acc[1] + x]
            model[("a-acc", k, ns)] = acc
            model[slot] = acc[1] / acc[0]
    b.set_current_namespace(None)


def _clean(model: Model) -> Model:
    return {s: v for s, v in model.items() if s[0] != "a-acc"}


def _generation(storage: ChangelogStorage, handles: list[ChangelogStateBackendHandle] | None,
                p: int, gen: int, model: Model, rng: random.Random, table: str,
                rounds: int) -> list[ChangelogStateBackendHandle]:
    backends: list[ChangelogKeyedStateBackend] = []
    out: list[ChangelogStateBackendHandle] = []
    try:
        for i in range(p):
            kgs = KeyGroupRange.of_operator(MP, p, i)
            if handles is None:
                b = ChangelogKeyedStateBackend(storage, f"op/p{i}", kgs, MP, table=table,
                                               options=OPTS)
            else:
                b = restore_backend(handles, storage, kgs, table=table, operator_id=f"op/p{i}",
                                    options=OPTS)
            backends.append(b)
        _check(backends, _clean(model), f"generation {gen} (p={p}, {table})")
        for i, b in enumerate(backends):
            cp = 100 * gen
            for _ in range(rounds):
                _write(b, model, rng, 60)
                cp += 1
                b.snapshot(cp).result(WAIT)
                b.notify_checkpoint_complete(cp)
                assert b.materialize_now(WAIT) is not None
            _write(b, model, rng, 40)   # a log tail after the last materialization
            cp += 1
            out.append(b.snapshot(cp).result(WAIT))
            b.notify_checkpoint_complete(cp)
            assert i < len(out)
        return out
    finally:
        for b in backends:
            b.close()


@pytest.mark.parametrize("rounds", [6, 3] if os.environ.get("DSTL_DEEP") == "1" else [6])
@pytest.mark.parametrize("table", ["heap", "lmdb"])
@pytest.mark.parametrize("sequence", [[1, 2], [2, 1], [4, 3]])
def test_restore_from_a_full_snapshot_and_deltas_equals_the_model(
        storage: ChangelogStorage, table: str, sequence: list[int], rounds: int) -> None:
    """Six rounds: the fifth materialization merges the three deltas into one that follows the
    full snapshot, and the sixth follows it; three (``DSTL_DEEP=1``): a full snapshot and two
    plain deltas."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    model: Model = {}
    handles: list[ChangelogStateBackendHandle] | None = None
    for gen, p in enumerate(sequence):
        handles = _generation(storage, handles, p, gen, model, rng, table, rounds=rounds)
        for h in handles:
            # a full snapshot and two deltas after it (the first materialization after a
            # restore is a full one); after six rounds the first delta is a merged one
            assert [r.delta for r in h.materialized] == [False, True, True], h.materialized
            ids = [r.materialization_id for r in h.materialized]
            assert ids == sorted(ids) and ids[-1] - ids[0] == rounds - 1
            assert ChangelogStateBackendHandle.from_json(h.to_json()) == h
    assert handles is not None
    # and onto one backend of the other table: same state
    other = "lmdb" if table == "heap" else "heap"
    b = restore_backend(handles, storage, KeyGroupRange(0, MP - 1), table=other,
                        operator_id="all", options=OPTS)
    try:
        _check([b], _clean(model), f"all key groups ({other})")
    finally:
        b.close()


@pytest.mark.parametrize("table", ["heap", "lmdb"])
def test_the_chain_is_compacted_by_count_and_by_size(storage: ChangelogStorage,
                                                     table: str) -> None:
    """``max_snapshot_deltas`` deltas follow a full snapshot, then a merged delta that follows
    the full snapshot replaces them (the chain stays at most ``1 + max_snapshot_deltas`` pieces);
    deltas adding up to more than ``max_delta_ratio`` of the full snapshot make the next one
    full; more changed entries than ``max_delta_entries`` make the next materialization full."""
    rng = random.Random(7)
    model: Model = {}
    kgs = KeyGroupRange(0, MP - 1)
    b = ChangelogKeyedStateBackend(storage, "op", kgs, MP, table=table, options=OPTS)
    kinds = []
    pieces = []
    try:
        for cp in range(1, 10):
            _write(b, model, rng, 30)
            b.snapshot(cp).result(WAIT)
            b.notify_checkpoint_complete(cp)
            ref = b.materialize_now(WAIT)
            assert ref is not None
            kinds.append(ref.delta)
            pieces.append(len(b.snapshot(100 + cp).result(WAIT).materialized))
        last = b.snapshot(200).result(WAIT)
    finally:
        b.close()
    assert kinds == [False] + [True] * 8
    assert pieces == [1, 2, 3, 4, 2, 3, 4, 2, 3]
    b = restore_backend([last], storage, kgs, table=table, operator_id="op", options=OPTS)
    try:
        _check([b], _clean(model), f"merged chain ({table})")
    finally:
        b.close()
    model = {}
    small = OPTS.replace(max_delta_ratio=0.01)
    b = ChangelogKeyedStateBackend(storage, "op2", kgs, MP, table=table, options=small)
    kinds = []
    try:
        for cp in range(1, 5):
            _write(b, model, rng, 200 if cp == 1 else 30)
            b.snapshot(cp).result(WAIT)
            b.notify_checkpoint_complete(cp)
            ref = b.materialize_now(WAIT)
            assert ref is not None
            kinds.append(ref.delta)
            print(cp, ref)
    finally:
        b.close()
    # one delta is written (nothing to compare yet), then its size is over 1 % of the base
    assert kinds == [False, True, False, True]
    # more changed entries than max_delta_entries: not remembered, the next one is full
    few = OPTS.replace(max_delta_entries=20)
    b = ChangelogKeyedStateBackend(storage, "op3", kgs, MP, table=table, options=few)
    kinds = []
    try:
        v = b.get_state(ValueStateDescriptor("v"))
        for cp, n in enumerate([30, 10, 30, 10], start=1):
            for i in range(n):
                b.set_current_key(f"k{i}")
                v.update(cp)
            b.snapshot(cp).result(WAIT)
            b.notify_checkpoint_complete(cp)
            ref = b.materialize_now(WAIT)
            assert ref is not None
            kinds.append(ref.delta)
    finally:
        b.close()
    assert kinds == [False, True, False, True]


def test_a_failed_delta_makes_the_next_materialization_full(storage: ChangelogStorage) -> None:
    """The changes of a delta that did not land are in no piece: the next one is a full
    snapshot, and a restore of it equals the model."""
    rng = random.Random(11)
    model: Model = {}
    kgs = KeyGroupRange(0, MP - 1)
    b = ChangelogKeyedStateBackend(storage, "op", kgs, MP, table="lmdb", options=OPTS)
    store = storage.store
    try:
        _write(b, model, rng, 80)
        b.snapshot(1).result(WAIT)
        b.notify_checkpoint_complete(1)
        assert b.materialize_now(WAIT) is not None
        _write(b, model, rng, 80)
        b.snapshot(2).result(WAIT)
        b.notify_checkpoint_complete(2)
        put = store.put

        def refuse(key: str, data: bytes) -> None:
            raise PermissionError(f"refused {key}")

        store.put = refuse  # type: ignore[method-assign]
        try:
            with pytest.raises(Exception, match="refused"):
                b.materialize_now(WAIT)
        finally:
            store.put = put  # type: ignore[method-assign]
        _write(b, model, rng, 20)
        b.snapshot(3).result(WAIT)
        b.notify_checkpoint_complete(3)
        ref = b.materialize_now(WAIT)
        assert ref is not None and not ref.delta
        _write(b, model, rng, 20)
        h = b.snapshot(4).result(WAIT)
        b.notify_checkpoint_complete(4)
    finally:
        b.close()
    r = restore_backend([h], storage, kgs, table="heap", options=OPTS)
    try:
        _check([r], _clean(model), "after a failed delta")
    finally:
        r.close()


# --------------------------------------------------------------------------- forged pieces


def _chain(storage: ChangelogStorage, table: str) -> tuple[ChangelogStateBackendHandle, Model]:
    """A checkpoint naming a full snapshot and two deltas, and its model."""
    rng = random.Random(3)
    model: Model = {}
    b = ChangelogKeyedStateBackend(storage, "op", KeyGroupRange(0, MP - 1), MP, table=table,
                                   options=OPTS)
    try:
        for cp in range(1, 4):
            _write(b, model, rng, 60)
            b.snapshot(cp).result(WAIT)
            b.notify_checkpoint_complete(cp)
            assert b.materialize_now(WAIT) is not None
        h = b.snapshot(4).result(WAIT)
        b.notify_checkpoint_complete(4)
    finally:
        b.close()
    assert [r.delta for r in h.materialized] == [False, True, True]
    return h, model


def _restore(storage: ChangelogStorage, h: ChangelogStateBackendHandle | str, table: str
             ) -> None:
    r = restore_backend([h], storage, KeyGroupRange(0, MP - 1), table=table, options=OPTS)
    r.close()


def _replace_object(storage: ChangelogStorage, key: str, data: bytes) -> None:
    storage.store.delete([key])
    storage.store.put(key, data)


@pytest.mark.parametrize("table", ["heap", "lmdb"])
def test_forged_or_truncated_deltas_fail_restore_typed_naming_the_object(
        storage: ChangelogStorage, table: str) -> None:
    """A delta object replaced in the store (truncated, a byte flipped, or forged with valid
    checksums: following another materialization, of another max parallelism, a full snapshot
    under a delta's name, a delta under a full snapshot's) fails the restore and the column
    reader with a ``CorruptObjectError`` naming it; the untouched chain restores the model."""
    import dataclasses

    from materializer.delta_format import DeltaMeta, decode_delta, encode_delta
    h, model = _chain(storage, table)
    base, d1, d2 = h.materialized
    original = storage.store.get(d2.key)
    meta, blocks = decode_delta(original, key=d2.key)

    def forged(**changes: Any) -> bytes:
        return encode_delta(dataclasses.replace(meta, **changes), sorted(blocks.items()))

    cases = {
        "truncated": original[:len(original) // 2],
        "a flipped byte": original[:40] + bytes([original[40] ^ 1]) + original[41:],
        "follows another piece": forged(follows=base.materialization_id),
        "another materialization": forged(materialization_id=meta.materialization_id + 1),
        "another max parallelism": encode_delta(
            DeltaMeta(KeyGroupRange(0, MP - 1), 2 * MP, meta.operator_id,
                      meta.materialization_id, meta.follows, meta.up_to, meta.states), []),
        "a full snapshot": storage.store.get(base.key),
    }
    from dstl.reader import StateSplit
    from dstl.reader.columns import read_state_batches
    split = StateSplit(4, "op", h.to_json(), (0, MP - 1))
    for name, data in cases.items():
        _replace_object(storage, d2.key, data)
        with pytest.raises(CorruptObjectError) as info:
            _restore(storage, h, table)
        assert info.value.key == d2.key, name
        # the column reader (the Spark state source) reads the chain as a restore does
        with pytest.raises(CorruptObjectError) as info:
            for _ in read_state_batches(storage.store, split):
                pass
        assert info.value.key == d2.key, f"column reader: {name}"
    _replace_object(storage, d2.key, original)
    assert sum(b.num_rows for b in read_state_batches(storage.store, split)) > 0
    # a handle that calls the full snapshot a delta, or a delta a full snapshot, or that puts a
    # delta before its full snapshot
    as_delta = dataclasses.replace(h, materialized=(dataclasses.replace(base, delta=True),
                                                    d1, d2))
    with pytest.raises((CorruptObjectError, UsageError)):
        _restore(storage, as_delta, table)
    as_full = dataclasses.replace(h, materialized=(base, dataclasses.replace(d1, delta=False),
                                                   d2))
    with pytest.raises(UsageError, match="several snapshots"):
        _restore(storage, as_full, table)
    reordered = dataclasses.replace(h, materialized=(d1, base, d2))
    with pytest.raises(UsageError, match="delta without the full snapshot"):
        _restore(storage, reordered, table)
    skipped = dataclasses.replace(h, materialized=(base, d2))
    with pytest.raises(CorruptObjectError, match="follows materialization"):
        _restore(storage, skipped, table)
    bad_json = h.to_json().replace('"delta":true', '"delta":1', 1)
    with pytest.raises(MalformedHandleError, match="delta"):
        _restore(storage, bad_json, table)
    r = restore_backend([h], storage, KeyGroupRange(0, MP - 1), table=table, options=OPTS)
    try:
        _check([r], _clean(model), "the untouched chain")
    finally:
        r.close()


def test_the_state_reader_reads_a_chain_with_deltas(storage: ChangelogStorage) -> None:
    """The row state reader reads a checkpoint of a full snapshot and deltas (the pieces in
    order, tombstones removing entries) and equals the model — with and without a log after
    the chain; the streaming path, which cannot undo what it yielded, refuses a delta typed;
    the column reader gives the row reader's rows for every checkpoint, and the change feed
    between two checkpoints turns the first's values into the second's."""
    from dstl.checkpoint import CheckpointCoordinator
    from dstl.reader import (
        CheckpointCatalog,
        from_json,
        plan_state_splits,
        read_changes,
        read_state,
        task_states,
    )
    from dstl.reader.columns import read_state_batches
    from dstl.reader.image import stream_snapshots
    from dstl.reader.store import ReadOnlyBlobStore

    store = storage.store
    coord = CheckpointCoordinator(store, job_id="job", retained=3)
    b = ChangelogKeyedStateBackend(storage, "op", KeyGroupRange(0, MP - 1), MP, table="lmdb",
                                   options=OPTS)
    rng = random.Random(13)
    model: Model = {}
    models: dict[int, Model] = {}
    handles: dict[int, ChangelogStateBackendHandle] = {}

    def checkpoint() -> int:
        cid = coord.trigger(["op"])
        h = b.snapshot(cid).result(WAIT)
        assert coord.acknowledge(cid, "op", h.to_json_obj(), h.referenced_keys(), h.full_size,
                                 h.incremental_size) is not None
        b.notify_checkpoint_complete(cid)
        handles[cid], models[cid] = h, {k: (dict(v) if isinstance(v, dict) else
                                              list(v) if isinstance(v, list) else v)
                                         for k, v in model.items()}
        return cid

    try:
        for _ in range(3):
            _write(b, model, rng, 60)
            checkpoint()
            b.materialize_now(WAIT)
        at_chain = checkpoint()           # the chain alone, no log after it
        _write(b, model, rng, 30)
        with_log = checkpoint()           # the chain and a log
    finally:
        b.close()
        coord.close()
    assert [r.delta for r in handles[at_chain].materialized] == [False, True, True]
    assert not any(h.change_sets for h in handles[at_chain].non_materialized)
    catalog = CheckpointCatalog(ReadOnlyBlobStore(store), job_id="job")
    for cid in (at_chain, with_log):
        got: Model = {}
        for row in read_state(catalog, cid):
            slot = ({"value": "v", "list": "l", "map": "m", "reducing": "r",
                     "aggregating": "a"}[row.kind], row.key, row.namespace)
            if row.kind == "map":
                got.setdefault(slot, {})[row.user_key] = row.value
            elif row.kind == "aggregating":
                got[slot] = row.value[1] / row.value[0]    # the accumulator, as stored
            else:
                got[slot] = row.value
        assert got == _clean(models[cid]), f"checkpoint {cid}"
    entries = stream_snapshots(store, handles[at_chain].materialized, KeyGroupRange(0, MP - 1),
                               False)
    with pytest.raises(UnsupportedFormatError) as info:
        for _ in entries:
            pass
    assert info.value.key == handles[at_chain].materialized[1].key
    # the column reader (the Spark state source) reads the same rows as the row reader, in every
    # retained checkpoint
    retained = sorted(c for c in handles if c >= at_chain - 1)
    for cid in retained:
        rows = sorted((r.state, r.key_group, r.key_bytes, repr(r.namespace), repr(r.user_key),
                       repr(r.value)) for r in read_state(catalog, cid))
        cols = []
        for split in plan_state_splits(cid, task_states(catalog.manifest(cid))):
            for batch in read_state_batches(store, split):
                d = batch.to_pydict()
                for i in range(batch.num_rows):
                    row = {k: d[k][i] for k in d}
                    cols.append((row["state"], row["key_group"], row["key_bytes"],
                                 *(repr(None if row[c] is None else from_json(row[c]))
                                   for c in ("namespace", "user_key", "value"))))
        assert sorted(cols) == rows, f"checkpoint {cid}"
    # the change feed from one checkpoint to the next turns the first's value state into the
    # next's, across the deltas (their changes come back as state differences)
    for a, z in pairwise(retained):
        vs = {k: v for k, v in models[a].items() if k[0] == "v"}
        for row in read_changes(catalog, a, z):
            if row.state != "v":
                continue
            slot = ("v", row.key, row.namespace)
            if row.op == "clear":
                vs.pop(slot, None)
            else:
                vs[slot] = row.value
        assert vs == {k: v for k, v in _clean(models[z]).items() if k[0] == "v"}, (a, z)


# --------------------------------------------------------------------------- retention


@pytest.mark.parametrize("retained", [1, 3])
def test_pieces_are_deleted_exactly_when_no_retained_checkpoint_names_them(
        retained: int) -> None:
    """A full snapshot is shared by every checkpoint of its chain and deleted by the
    coordinator's retention once no retained checkpoint names it — not before (every retained
    checkpoint restores to its model), and not later (after each completion the store's
    snapshot objects are exactly the pieces the retained checkpoints name)."""
    import copy

    from dstl.checkpoint import CheckpointCoordinator

    store = MemoryBlobStore()
    storage = ChangelogStorage(store=store, options=DstlOptions(persist_delay_s=0.0))
    coord = CheckpointCoordinator(store, job_id="job", retained=retained)
    kgs = KeyGroupRange(0, MP - 1)
    b = ChangelogKeyedStateBackend(storage, "op", kgs, MP, table="lmdb", options=OPTS)
    rng = random.Random(5)
    model: Model = {}
    models: dict[int, Model] = {}
    handles: dict[int, ChangelogStateBackendHandle] = {}
    shared = 0
    try:
        for _ in range(14):
            _write(b, model, rng, 25)
            cid = coord.trigger(["op"])
            h = b.snapshot(cid).result(WAIT)
            completion = coord.acknowledge(cid, "op", h.to_json_obj(), h.referenced_keys(),
                                           h.full_size, h.incremental_size)
            assert completion is not None
            b.notify_checkpoint_complete(cid)
            for m in completion.subsumed:
                b.notify_checkpoint_subsumed(m.checkpoint_id)
            coord.run_deletions()
            handles[cid], models[cid] = h, copy.deepcopy(model)
            kept = [m.checkpoint_id for m in coord.manifests()]
            named = {r.key for c in kept for r in handles[c].materialized}
            stored = {o.key for o in store.list("snapshots/")}
            assert stored == named, f"after checkpoint {cid} (retained {kept})"
            if cid - 1 in handles:   # pieces the previous (maybe subsumed) checkpoint named
                shared += len({r.key for r in h.materialized}
                              & {r.key for r in handles[cid - 1].materialized})
            b.materialize_now(WAIT)
        for c in kept:
            r = restore_backend([handles[c]], storage, kgs, table="heap", options=OPTS,
                                operator_id=f"check{c}")
            try:
                _check([r], _clean(models[c]), f"retained checkpoint {c}")
            finally:
                r.close()
    finally:
        b.close()
        coord.close()
        storage.close()
    assert shared > 0, "no piece was shared by two checkpoints"


def test_verify_checks_deltas_as_a_restore_does() -> None:
    """``dstl verify`` (``verify_checkpoint``) reads a checkpoint of a full snapshot and its
    deltas, and names a delta that is damaged, forged (a key in another key group, valid
    checksums) or not what the checkpoint calls it."""
    from dstl.checkpoint import CheckpointCoordinator
    from dstl.reader import CheckpointCatalog, verify_checkpoint
    from dstl.reader.store import ReadOnlyBlobStore
    from materializer.delta_format import decode_delta, encode_delta

    store = MemoryBlobStore()
    storage = ChangelogStorage(store=store, options=DstlOptions(persist_delay_s=0.0))
    coord = CheckpointCoordinator(store, job_id="job", retained=2)
    b = ChangelogKeyedStateBackend(storage, "op", KeyGroupRange(0, MP - 1), MP, table="lmdb",
                                   options=OPTS)
    rng = random.Random(9)
    model: Model = {}
    try:
        for _ in range(4):
            _write(b, model, rng, 40)
            cid = coord.trigger(["op"])
            h = b.snapshot(cid).result(WAIT)
            assert coord.acknowledge(cid, "op", h.to_json_obj(), h.referenced_keys(),
                                     h.full_size, h.incremental_size) is not None
            b.notify_checkpoint_complete(cid)
            b.materialize_now(WAIT)
    finally:
        b.close()
        coord.close()
        storage.close()
    assert [r.delta for r in h.materialized] == [False, True, True]
    catalog = CheckpointCatalog(ReadOnlyBlobStore(store), job_id="job")
    assert verify_checkpoint(catalog).ok
    base, _, d2 = h.materialized
    original = store.get(d2.key)
    meta, blocks = decode_delta(original, key=d2.key)
    kg, entries = next(iter(sorted(blocks.items())))
    moved = {kg + 1 if kg + 1 < MP else kg - 1: entries}   # keys in another key group
    forged = encode_delta(meta, sorted(moved.items()))
    cases = {"flipped": (original[:50] + bytes([original[50] ^ 4]) + original[51:], "checksum"),
             "forged": (forged, "belongs to key group"),
             "a full snapshot": (store.get(base.key), "names a delta")}
    for name, (data, says) in cases.items():
        store.delete([d2.key])
        store.put(d2.key, data)
        report = verify_checkpoint(catalog)
        assert [p.key for p in report.problems] == [d2.key], name
        assert isinstance(report.problems[0].error, CorruptObjectError), name
        assert says in str(report.problems[0].error), (name, str(report.problems[0].error))


def test_inspect_describes_a_delta_and_refuses_a_forged_one(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``dstl inspect`` of the golden delta prints its metadata, entries and tombstones; a
    forged delta (an entry out of order, valid checksums) exits 1 naming the file."""
    from pathlib import Path

    from dstl.cli import main
    from materializer.delta_format import decode_delta
    from materializer.snapshot_format import SnapshotEncoder
    golden = Path(__file__).resolve().parents[2] / "data" / "format" / "v3" / "delta_small.bin"
    assert main(["inspect", str(golden)]) == 0
    out = capsys.readouterr().out
    assert "delta (snapshot v3)" in out and "(2 tombstones)" in out and '"follows": 4' in out
    meta, blocks = decode_delta(golden.read_bytes())
    kg, entries = max(blocks.items(), key=lambda kv: len(kv[1]))
    assert len(entries) >= 2
    enc = SnapshotEncoder(meta.key_groups, meta.to_bytes(), version=3)
    forged = enc.start() + enc.add_key_group(kg, list(reversed(entries))) + enc.finish()
    path = tmp_path / "forged.snap"
    path.write_bytes(forged)
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert "forged.snap" in err and "ascending" in err
