"""The initial state staged for a query's first batch (``dstl.spark.initial``) on a memory
store: each row reaches exactly the partition that owns its key group, with the partition count
of the staging and with another (a rescale before the first commit); the marker is written once;
the first batch's plan names it and a re-plan reads the same; a plan with a base does not; the
staged objects go with the protocol's objects once a checkpoint is written; every stored object
is untrusted input."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from dstl import KeyGroupRange, key_group_for
from dstl.errors import CorruptObjectError, UsageError
from dstl.spark import initial, query
from dstl.spark.report import INITIAL_STATE_COLUMN
from dstl.stores.memory import MemoryBlobStore

MAX_P = 16
KEYS = [f"k{i}" for i in range(40)]


def _routed(partitions: int) -> list[pa.RecordBatch]:
    """The staging job's input as its tasks see it: key, packed row, key group, partition; two
    record batches, one row of k3 twice."""
    rows = [(k, {"key": k, "start": i}) for i, k in enumerate(KEYS)] + [("k3", {"key": "k3",
                                                                               "start": 99})]
    kgs = [key_group_for(k.encode(), MAX_P) for k, _ in rows]
    batch = pa.RecordBatch.from_arrays(
        [pa.array([k for k, _ in rows]), pa.array([r for _, r in rows]),
         pa.array(kgs, pa.int32()), pa.array([kg * partitions // MAX_P for kg in kgs],
                                             pa.int32())],
        names=["key", INITIAL_STATE_COLUMN, initial.KEY_GROUP_COLUMN, "_dstl_pid"])
    return [batch.slice(0, 20), batch.slice(20)]


def _stage(store: MemoryBlobStore, partitions: int) -> initial.StagedInitialState:
    prefix = initial.attempt_prefix()
    out = [r for b in initial.stage_rows(store, prefix, iter(_routed(partitions)), MAX_P,
                                         partitions) for r in b.to_pylist()]
    return initial.write_marker(store, initial.StagedInitialState(tuple(
        initial.StagedObject(r["object"], r["kg_start"], r["kg_end"]) for r in out)))


def _seen(store: MemoryBlobStore, staged: initial.StagedInitialState, partitions: int
          ) -> Counter[tuple[int, str, int]]:
    """(partition, key, start) of every row each partition's task reads."""
    out: Counter[tuple[int, str, int]] = Counter()
    for p in range(partitions):
        owned = {p: KeyGroupRange.of_operator(MAX_P, partitions, p)}
        for b in initial.initial_batches(store, staged, "key", owned):
            for r in b.to_pylist():
                assert r["_dstl_pid"] == p
                out[(p, r["key"], r[INITIAL_STATE_COLUMN]["start"])] += 1
    return out


def _want(partitions: int) -> Counter[tuple[int, str, int]]:
    rows = [(k, i) for i, k in enumerate(KEYS)] + [("k3", 99)]
    return Counter((key_group_for(k.encode(), MAX_P) * partitions // MAX_P, k, s)
                   for k, s in rows)


@pytest.mark.parametrize("read_with", [4, 3, 1, 5])
def test_each_row_reaches_the_partition_of_its_key_group(read_with: int) -> None:
    store = MemoryBlobStore()
    staged = _stage(store, 4)
    assert 1 <= len(staged.objects) <= 4
    assert _seen(store, staged, read_with) == _want(read_with)


def test_the_marker_is_written_once_and_the_first_plan_names_it() -> None:
    store = MemoryBlobStore()
    with pytest.raises(UsageError, match="operator 'ops', batch 0: the operator has an "
                                         "initial_state but none is staged"):
        query.plan_batch(store, 0, 2, delay_ms=0, event_time=False, now_ms=1, operator="ops",
                         with_initial=True)
    staged = _stage(store, 2)
    other = _stage(store, 2)  # a second driver staging at the same time: the first marker holds
    assert other == staged == initial.read_marker(store)
    plan = query.plan_batch(store, 0, 2, delay_ms=0, event_time=False, now_ms=1,
                            with_initial=True)
    assert plan.initial == staged
    # the plan is the batch's: a re-run reads it back as it was
    assert query.plan_of(store, 0) == plan
    # a plan with a base never applies the initial state again
    for p in range(2):
        query.write_result(store, 0, 2, _report(p))
    # results alone: batch 0 may still run again from its plan, which names the staged state
    assert not query.has_batches(store)
    assert query.plan_batch(store, 1, 2, delay_ms=0, event_time=False, now_ms=1,
                            with_initial=True).initial is None
    assert query.has_batches(store)  # batch 1's planning chose batch 0: it is committed
    # a checkpoint written: the staged objects and the marker go with the protocol's objects
    query.forget_before(store, 1)
    assert not list(store.list(initial.INITIAL_PREFIX))


def test_a_plan_without_an_initial_state_names_none() -> None:
    store = MemoryBlobStore()
    _stage(store, 2)
    plan = query.plan_batch(store, 0, 2, delay_ms=0, event_time=False, now_ms=1)
    assert plan.initial is None and not query.has_batches(store)


@pytest.mark.parametrize("marker", [
    b"not json", b"{}", json.dumps([["../escape", 0, 1]]).encode(),
    json.dumps([["query/initial/x", -1, 1]]).encode(),
    json.dumps([["query/initial/x", 0]]).encode(),
])
def test_a_bad_marker_is_a_corrupt_object(marker: bytes) -> None:
    store = MemoryBlobStore()
    store.put(initial.MARKER_KEY, marker)
    with pytest.raises(CorruptObjectError, match=r"staged\.json"):
        initial.read_marker(store)


def test_a_bad_staged_object_is_a_corrupt_object() -> None:
    store = MemoryBlobStore()
    key = initial.INITIAL_PREFIX + "s-1/p00000-1.arrow"
    store.put(key, b"half an object")
    staged = initial.StagedInitialState((initial.StagedObject(key, 0, MAX_P - 1),))
    with pytest.raises(CorruptObjectError, match=r"p00000-1\.arrow.*not an Arrow stream"):
        list(initial.initial_batches(store, staged, "key", {0: KeyGroupRange(0, MAX_P - 1)}))
    sink = pa.BufferOutputStream()
    batch = pa.RecordBatch.from_arrays([pa.array(["a"])], names=["key"])
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    store.put(key + "2", sink.getvalue().to_pybytes())
    staged = initial.StagedInitialState((initial.StagedObject(key + "2", 0, MAX_P - 1),))
    with pytest.raises(CorruptObjectError, match="missing"):
        list(initial.initial_batches(store, staged, "key", {0: KeyGroupRange(0, MAX_P - 1)}))


def _report(partition: int) -> Any:
    from dstl.handle import ChangelogHandle, ChangeSetRef
    from dstl.spark.report import SlotAccess, TaskReport
    from materializer.handles import ChangelogStateBackendHandle

    kgs = KeyGroupRange.of_operator(MAX_P, 2, partition)
    log = ChangelogHandle(f"op/p{partition}", kgs, 0, 1, (ChangeSetRef(0, "dstl/s", 0, 40, 1,
                                                                       30),))
    handle = ChangelogStateBackendHandle(f"op/p{partition}", kgs, 0, 0, (), (log,), 40, 40)
    return TaskReport(partition=partition, attempt=0, pid=1, handle=handle,
                      slot=SlotAccess("new"), rows_in=1, rows_out=1, keys=1,
                      process_seconds=0.0, commit_seconds=0.0, segment_keys=("dstl/s",),
                      log_bytes=40, snapshot=None, agent_metrics=None, agent_log=())
