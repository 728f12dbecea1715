"""The in-query commit protocol's store objects (``dstl.spark.query``) on a memory store: the
first writer of a plan or a choice wins and everyone reads it; the base of a batch; results of
several attempts and of two partition counts; and every stored object is untrusted input (a
malformed one is a CorruptObjectError naming it, a partial batch a UsageError)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from dstl import KeyGroupRange
from dstl.errors import CorruptObjectError, UsageError
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.spark import query
from dstl.spark.report import SlotAccess, TaskReport
from dstl.stores.memory import MemoryBlobStore
from materializer.handles import ChangelogStateBackendHandle


def _report(partition: int, partitions: int, seq: int, max_event: int | None = None
            ) -> TaskReport:
    kgs = KeyGroupRange.of_operator(8, partitions, partition)
    log = ChangelogHandle(f"op/p{partition}", kgs, seq, seq + 1,
                          (ChangeSetRef(seq, f"dstl/s{seq}", 0, 40, 1, 30),))
    handle = ChangelogStateBackendHandle(f"op/p{partition}", kgs, seq, 0, (), (log,), 40, 40)
    return TaskReport(partition=partition, attempt=0, pid=1, handle=handle,
                      slot=SlotAccess("new"), rows_in=1, rows_out=1, keys=1,
                      process_seconds=0.0, commit_seconds=0.0, segment_keys=(f"dstl/s{seq}",),
                      log_bytes=40, snapshot=None, agent_metrics=None, agent_log=(),
                      max_event_time_ms=max_event)


def _plan(store: MemoryBlobStore, batch: int, partitions: int = 2, now: int = 1000,
          event_time: bool = False) -> query.BatchPlan:
    return query.plan_batch(store, batch, partitions, delay_ms=100, event_time=event_time,
                            now_ms=now, query_id="q")


def test_the_first_plan_holds_for_every_task_and_every_re_run() -> None:
    store = MemoryBlobStore()
    first = _plan(store, 0, now=1000)
    again = _plan(store, 0, now=5000)  # another task, later (or the batch run again)
    assert first == again and first.base == -1 and first.processing_time_ms == 1000


def test_a_batch_starts_from_the_chosen_results_of_the_one_before() -> None:
    store = MemoryBlobStore()
    _plan(store, 0, event_time=True)
    for p in range(2):
        query.write_result(store, 0, 2, _report(p, 2, 10 + p, max_event=5000 + p))
    query.write_result(store, 0, 2, _report(0, 2, 90))  # a second attempt of partition 0
    plan = _plan(store, 1, now=900, event_time=True)
    assert plan.base == 0 and sorted(plan.handles) == [0, 1]
    assert plan.processing_time_ms == 1000  # never below the base's
    # batch 1 runs with the watermark after batch 0: its largest event time minus the delay
    assert plan.watermark_ms == 5001 - 100
    choice = query.choose(store, 0, 2, delay_ms=100, event_time=True)
    assert choice is not None and choice.watermark_ms == plan.watermark_ms
    # one attempt per partition (the first by name), the same for everyone who asks
    assert plan.handles == choice.handles()
    assert {json.loads(h)["checkpoint_id"] for h in plan.handles.values()} == {10, 11}
    assert query.pending_choices(store, -1) == [0]
    assert query.forget_before(store, 1) == 5  # plan 0, three results, choice 0
    assert query.pending_choices(store, -1) == []


def test_results_of_the_current_partition_count_are_chosen_after_a_rescale() -> None:
    store = MemoryBlobStore()
    _plan(store, 0)
    for p in range(2):
        query.write_result(store, 0, 2, _report(p, 2, 10 + p))
    for p in range(3):
        query.write_result(store, 0, 3, _report(p, 3, 20 + p))
    choice = query.choose(store, 0, 3, delay_ms=0, event_time=False)
    assert choice is not None and choice.partitions == 3


def test_a_batch_that_ran_some_partitions_only_is_refused() -> None:
    store = MemoryBlobStore()
    _plan(store, 0)
    query.write_result(store, 0, 2, _report(1, 2, 10))
    with pytest.raises(UsageError, match=r"ran partitions \[1\] of 2 only"):
        _plan(store, 1)


def test_state_of_another_query_is_refused() -> None:
    from dstl.checkpoint import CheckpointCoordinator

    store = MemoryBlobStore()
    coordinator = CheckpointCoordinator.recover(store, "op")
    cid = coordinator.trigger(["p0"], checkpoint_id=7)
    h = _report(0, 1, 1).handle
    coordinator.acknowledge(cid, "p0", h.to_json_obj(), h.referenced_keys(), 1, 1)
    coordinator.close()
    with pytest.raises(UsageError) as info:
        _plan(store, 3)
    assert str(info.value) == (
        f"batch 3 cannot continue the state in {store.location}: every checkpoint there (7) is "
        "at or after batch 3, so another query wrote it, or this query before its "
        "checkpointLocation was deleted or replaced; give this query a state_uri of its own, or "
        "restart it with the checkpointLocation that wrote this state")
    assert _plan(store, 8).base == 7


@pytest.mark.parametrize(("key", "data", "match"), [
    ("plans", b"{not json", "not JSON"),
    ("plans", b"[]", "not a JSON object"),
    ("plans", json.dumps({"batch": 1, "base": -2, "handles": {}, "retained": [],
                          "processing_time_ms": 0, "watermark_ms": 0}).encode(),
     "base is -2"),
    ("plans", json.dumps({"batch": 1, "base": 0, "handles": {"x": "h"}, "retained": [],
                          "processing_time_ms": 0, "watermark_ms": 0}).encode(),
     "handles is not"),
    ("choices", json.dumps({"batch": 0, "partitions": 2, "reports": [],
                            "processing_time_ms": 0, "watermark_ms": -1}).encode(),
     r"reports of partitions \[\], not one per partition"),
    ("choices", json.dumps({"batch": 0, "partitions": 1, "reports": ["{}"],
                            "processing_time_ms": 0, "watermark_ms": -1}).encode(),
     "a report does not decode"),
])
def test_malformed_protocol_objects_are_corrupt_objects(key: str, data: bytes,
                                                        match: str) -> None:
    store = MemoryBlobStore()
    name = query.plan_key(1) if key == "plans" else query.choice_key(0)
    store.put(name, data)
    if key == "choices":
        store.put(query.results_prefix(0) + "p00000-x.json", json.dumps(
            {"partitions": 1, "report": _report(0, 1, 1).to_json()}).encode())
    with pytest.raises(CorruptObjectError, match=match) as err:
        _plan(store, 1)
    assert name in str(err.value)


def test_a_malformed_result_is_a_corrupt_object() -> None:
    store = MemoryBlobStore()
    _plan(store, 0)
    bad = query.results_prefix(0) + "p00000-bad.json"
    store.put(bad, json.dumps({"partitions": 1, "report": "{}"}).encode())
    with pytest.raises(CorruptObjectError, match="the report does not decode") as err:
        _plan(store, 1)
    assert bad in str(err.value)


def test_a_plan_keeps_its_fields_through_the_store() -> None:
    plan = query.BatchPlan(batch=3, base=2, handles={0: "h0", 1: "h1"}, retained=(1, 2),
                           processing_time_ms=7, watermark_ms=-1, query_id="q")
    assert query.BatchPlan.from_json(plan.to_json(), "k") == plan
    assert dataclasses.replace(plan, query_id="") != plan


def test_a_plan_of_another_query_is_refused() -> None:
    store = MemoryBlobStore()
    plan = _plan(store, 0)  # query "q"
    query.check_same_query(plan, "q", "op", store.location)
    query.check_same_query(plan, "", "op", store.location)  # outside a query's task: no id
    with pytest.raises(UsageError, match=r"another streaming query \(id q\) writes to the state"):
        query.check_same_query(plan, "other", "op", store.location)


def test_the_operator_refuses_the_state_of_another_query_with_the_same_message(
        tmp_path: Path) -> None:
    from dstl.checkpoint import CheckpointCoordinator
    from dstl.spark import DstlStatefulOperator, StatefulProcessor
    from dstl.spark.batch_base import BatchTime

    class Nothing(StatefulProcessor):
        def handle_input_rows(self, key: Any, rows: Any) -> Any:
            yield from ()

    store = MemoryBlobStore()
    coordinator = CheckpointCoordinator.recover(store, "op")
    h = _report(0, 1, 1).handle
    for cid in (0, 1):
        coordinator.trigger(["p0"], checkpoint_id=cid)
        coordinator.acknowledge(cid, "p0", h.to_json_obj(), h.referenced_keys(), 1, 1)
    op = DstlStatefulOperator(name="op", processor=Nothing, key_column="key",
                              output_schema="key string", state_uri=str(tmp_path / "state"),
                              partitions=1, sink=lambda df, batch: None)
    batch_time = BatchTime(op.time, op.state_uri, lambda: 0)  # what the operator's batch uses
    with pytest.raises(UsageError) as info:
        batch_time.task_input(coordinator, 0)
    assert str(info.value) == query.state_of_another_query(0, str(tmp_path / "state"),
                                                           (0, 1)).args[0]
    assert str(info.value).startswith(f"batch 0 cannot continue the state in {tmp_path}/state: "
                                       "every checkpoint there (0, 1) is at or after batch 0")
    coordinator.close()
