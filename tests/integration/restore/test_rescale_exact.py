"""Rescaling is exact whatever the sequence: every change set is applied once
per key group, whatever handles are passed; a restored backend keeps (and reports) only the part
of its restored handles it owns.

Each generation restores ``p`` backends from the previous generation's checkpoint (operator ids
``op/p<i>`` are reused, as the Spark operator does, so log ids repeat across generations), checks
every key against a model, writes a counter (value state) and a list entry per key, optionally
materializes some backends, and checkpoints.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator, Sequence

import pytest

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for
from dstl.errors import UsageError
from dstl.stores import MemoryBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle
from materializer.options import BackendOptions
from materializer.states import ListStateDescriptor, ValueStateDescriptor
from restore.restore import restore_backend

MP = 32
WAIT = 10.0
OPTS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
KEYS = [f"k{i}" for i in range(48)]
Model = dict[str, tuple[int, list[str]]]


@pytest.fixture
def storage() -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(store=MemoryBlobStore(), options=DstlOptions(persist_delay_s=0.0))
    yield s
    s.close()


def _kg(key: str) -> int:
    return key_group_for(key.encode(), MP)


def _states(b: ChangelogKeyedStateBackend) -> tuple[object, object]:
    return b.get_state(ValueStateDescriptor("count")), b.get_state(ListStateDescriptor("seen"))


def _check(backends: Sequence[ChangelogKeyedStateBackend], model: Model, where: str) -> None:
    for b in backends:
        count, seen = _states(b)
        for k in KEYS:
            if _kg(k) not in b.key_groups:
                continue
            b.set_current_key(k)
            want = model.get(k, (None, []))
            got = (count.value(), seen.get())  # type: ignore[attr-defined]
            assert got == (want[0], want[1]), f"{where}: key {k} (key group {_kg(k)}) in " \
                                              f"{b.operator_id} {b.key_groups}"


def _write(b: ChangelogKeyedStateBackend, model: Model, token: str) -> None:
    count, seen = _states(b)
    for k in KEYS:
        if _kg(k) not in b.key_groups:
            continue
        b.set_current_key(k)
        c = (count.value() or 0) + 1  # type: ignore[attr-defined]
        count.update(c)  # type: ignore[attr-defined]
        seen.add(token)  # type: ignore[attr-defined]
        model[k] = (c, [*model.get(k, (0, []))[1], token])


def _checkpoint(b: ChangelogKeyedStateBackend, cp: int) -> ChangelogStateBackendHandle:
    h = b.snapshot(cp).result(WAIT)
    b.notify_checkpoint_complete(cp)
    return h


def _generation(storage: ChangelogStorage, handles: list[ChangelogStateBackendHandle] | None,
                p: int, gen: int, model: Model, *, materialize: Sequence[int] = (),
                tables: str = "mixed") -> list[ChangelogStateBackendHandle]:
    """Restore (or create) ``p`` backends, check, write, maybe materialize, checkpoint, close."""
    backends = []
    try:
        for i in range(p):
            kgs = KeyGroupRange.of_operator(MP, p, i)
            table = tables if tables != "mixed" else ("heap", "lmdb")[(gen + i) % 2]
            if handles is None:
                b = ChangelogKeyedStateBackend(storage, f"op/p{i}", kgs, MP, table=table,
                                               options=OPTS)
            else:
                b = restore_backend(handles, storage, kgs, table=table, operator_id=f"op/p{i}",
                                    options=OPTS)
            backends.append(b)
        _check(backends, model, f"generation {gen} (p={p})")
        for i, b in enumerate(backends):
            _write(b, model, f"g{gen}a")
            if i in materialize:
                _checkpoint(b, 2 * gen)
                assert b.materialize_now(WAIT) is not None
                _write(b, model, f"g{gen}b")
        return [_checkpoint(b, 2 * gen + 1) for b in backends]
    finally:
        for b in backends:
            b.close()


def _run(storage: ChangelogStorage, sequence: Sequence[int], mats: str,
         tables: str = "mixed") -> Model:
    model: Model = {}
    handles = None
    for gen, p in enumerate(sequence):
        materialize = {"none": (), "first": (0,), "all": tuple(range(p)),
                       "odd": tuple(range(1, p, 2))}[mats]
        handles = _generation(storage, handles, p, gen, model, materialize=materialize,
                              tables=tables)
    # and once more onto a single backend: the merged state equals the model
    _generation(storage, handles, 1, len(sequence), model)
    return model


@pytest.mark.parametrize("table", ["heap", "lmdb"])
def test_one_two_one_before_any_materialization(storage: ChangelogStorage, table: str) -> None:
    """1 -> 2 -> 1 without a snapshot: a counter and a list come back with the first
    generation's change sets applied once, not twice."""
    model = _run(storage, [1, 2], "none", tables=table)
    assert all(v == (3, ["g0a", "g1a", "g2a"]) for v in model.values())


@pytest.mark.parametrize("sequence", [[1, 2, 1], [2, 3, 2], [1, 3, 2, 1], [8, 2], [1, 2, 4, 8],
                                      [3, 1, 3], [2, 1, 2, 1], [1, 8, 3]])
@pytest.mark.parametrize("mats", ["none", "first", "odd", "all"])
def test_rescale_sequences_match_the_model(storage: ChangelogStorage, sequence: list[int],
                                           mats: str) -> None:
    _run(storage, sequence, mats)


@pytest.mark.parametrize("copies", [2, 3])
def test_the_same_handles_passed_several_times_apply_once(storage: ChangelogStorage,
                                                          copies: int) -> None:
    model: Model = {}
    handles = _generation(storage, None, 2, 0, model)
    handles = _generation(storage, handles, 3, 1, model, materialize=(1,))
    before = dict(model)
    # one part, its JSON passed several times
    r = restore_backend([handles[0].to_json()] * copies, storage, handles[0].key_groups,
                        operator_id="part", options=OPTS)
    try:
        _check([r], model, "one part")
    finally:
        r.close()
    # every part several times, shuffled
    rng = random.Random(copies)
    many = handles * copies
    rng.shuffle(many)
    print(f"handle order: {[h.operator_id for h in many]}")
    _generation(storage, many, 1, 2, model)
    assert model != before


def test_a_restored_backend_keeps_only_its_part(storage: ChangelogStorage) -> None:
    model: Model = {}
    handles = _generation(storage, None, 1, 0, model, materialize=(0,))
    halves = _generation(storage, handles, 2, 1, model)
    for h in halves:
        assert h.materialized and h.non_materialized
        for ref in h.materialized:
            assert ref.key_groups.intersection(h.key_groups) == ref.key_groups, ref
        for log in h.non_materialized:
            own = log.replay_key_groups
            assert own.intersection(h.key_groups) == own, log
    # each half names the old snapshot restricted to its own half; together they cover it
    assert {r.key for r in halves[0].materialized} == {r.key for r in halves[1].materialized}
    # the restricted form survives its JSON
    for h in halves:
        assert ChangelogStateBackendHandle.from_json(h.to_json()) == h
    # a restore of one key group reads nothing that the backend does not own
    one = KeyGroupRange(3, 3)
    b = restore_backend(halves, storage, one, operator_id="one", options=OPTS)
    try:
        h = _checkpoint(b, 99)
        assert all(r.key_groups == one for r in h.materialized)
        assert all(log.replay_key_groups == one for log in h.non_materialized)
    finally:
        b.close()


def test_handles_written_before_trimming_still_restore_exactly(storage: ChangelogStorage
                                                               ) -> None:
    """A handle that names the whole restored log: the backend handle's own range is what a
    restore applies from it."""
    model: Model = {}
    handles = _generation(storage, None, 1, 0, model, materialize=(0,))
    old_snapshots = {r.key for h in handles for r in h.materialized}
    halves = _generation(storage, handles, 2, 1, model, materialize=(1,))
    untrimmed = [dataclasses.replace(
        h, non_materialized=tuple(dataclasses.replace(log, restrict=None)
                                  for log in h.non_materialized),
        materialized=tuple(dataclasses.replace(r, key_groups=KeyGroupRange(0, MP - 1))
                           if r.key in old_snapshots else r for r in h.materialized))
        for h in halves]
    assert untrimmed != halves
    assert any(r.key in old_snapshots for h in untrimmed for r in h.materialized)
    _generation(storage, untrimmed, 1, 2, model)


def test_two_checkpoints_of_one_backend_restore_the_newer(storage: ChangelogStorage) -> None:
    model: Model = {}
    b = ChangelogKeyedStateBackend(storage, "op/p0", KeyGroupRange(0, MP - 1), MP, options=OPTS)
    try:
        _write(b, model, "x")
        h1 = _checkpoint(b, 1)
        _write(b, model, "y")
        h2 = _checkpoint(b, 2)
    finally:
        b.close()
    for handles in ([h1, h2], [h2, h1], [h1, h2, h1]):
        _generation(storage, handles, 2, 5, dict(model))
    # once a materialization lies between them, the two histories disagree: refused
    b = restore_backend([h2], storage, KeyGroupRange(0, MP - 1), operator_id="op/p0",
                        options=OPTS)
    try:
        _write(b, model, "z")
        _checkpoint(b, 3)
        assert b.materialize_now(WAIT) is not None
        _write(b, model, "w")
        h4 = _checkpoint(b, 4)
    finally:
        b.close()
    with pytest.raises(UsageError, match="disagree"):
        restore_backend([h2, h4], storage, KeyGroupRange(0, MP - 1), operator_id="op/p0")


def test_handles_of_other_backends_over_the_same_key_groups_are_refused(
        storage: ChangelogStorage) -> None:
    a = _generation(storage, None, 2, 0, {})
    b = [dataclasses.replace(h, operator_id="other") for h in _generation(storage, None, 2, 1, {})]
    with pytest.raises(UsageError, match="disagree"):
        restore_backend([a[0], b[0]], storage, KeyGroupRange(0, MP - 1), operator_id="x")
    # disjoint ranges of two operators merge (that is what a rescale does)
    r = restore_backend([a[0], b[1]], storage, KeyGroupRange(0, MP - 1), operator_id="x",
                        options=OPTS)
    r.close()


def test_an_empty_handle_restores_an_empty_range(storage: ChangelogStorage) -> None:
    model: Model = {}
    b = ChangelogKeyedStateBackend(storage, "op/p0", KeyGroupRange(0, MP - 1), MP, options=OPTS)
    try:
        empty = _checkpoint(b, 1)
    finally:
        b.close()
    assert not empty.materialized and not empty.non_materialized
    _generation(storage, [empty, empty], 2, 1, model)
    assert model  # the restored backends wrote; their handles merge back
