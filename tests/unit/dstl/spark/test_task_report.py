"""The task report a partition task returns to the driver: a JSON round trip, and every
malformed field a TaskReportError naming the field (the driver aborts the checkpoint on it)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dstl import KeyGroupRange
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.spark.report import SlotAccess, TaskReport, TaskReportError
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef

KGS = KeyGroupRange(0, 7)
SNAP = SnapshotRef("snapshots/op/p0/x", 2048, KGS, 3)
HANDLE = ChangelogStateBackendHandle(
    "op/p0", KGS, 5, 3, (SNAP,),
    (ChangelogHandle("op/p0", KGS, 10, 12, (ChangeSetRef(10, "dstl/a", 0, 40, 2, 30),
                                            ChangeSetRef(11, "dstl/b", 8, 50, 3, 44))),),
    90, 8)
REPORT = TaskReport(partition=2, attempt=1, pid=4321, handle=HANDLE,
                    slot=SlotAccess("restore", 0.25, 17, 9), rows_in=10, rows_out=4, keys=3,
                    process_seconds=0.5, commit_seconds=0.125, segment_keys=("dstl/a", "dstl/b"),
                    log_bytes=90, snapshot=SNAP, agent_metrics={"agent.pid": 77.0},
                    agent_log=("one", "two"), state_entries=12, state_rows=7, internal_rows=4)


def test_round_trip() -> None:
    got = TaskReport.from_json(REPORT.to_json())
    assert got == REPORT
    assert got.snapshot_bytes == 2048
    bare = TaskReport.from_json(json.dumps({**json.loads(REPORT.to_json()), "snapshot": None,
                                            "agent_metrics": None, "agent_log": []}))
    assert (bare.snapshot, bare.snapshot_bytes, bare.agent_metrics, bare.agent_log) == (
        None, 0, None, ())


def _with(**changes: Any) -> str:
    return json.dumps({**json.loads(REPORT.to_json()), **changes})


@pytest.mark.parametrize(("text", "match"), [
    ("not json", "not JSON"),
    ("[1, 2]", "a JSON list, not an object"),
    (_with(partition=-1), "'partition' is -1"),
    (_with(access="stolen"), "'access' is 'stolen', expected one of hit, adopt"),
    (_with(rows_in="10"), "'rows_in' is '10'"),
    (_with(rows_out=True), "'rows_out' is True"),
    (_with(process_seconds=-0.5), "'process_seconds' is -0.5, expected a number >= 0"),
    (_with(segment_keys=["dstl/a", 3]), "'segment_keys'.*a list of strings"),
    (_with(handle={"v": 2}), "'handle'.*a backend handle"),
    (_with(handle=[]), "'handle' is \\[\\], expected an object"),
    (_with(snapshot={"key": "x"}), "'snapshot'.*a snapshot reference"),
    (_with(agent_metrics={"agent.pid": "x"}), "'agent_metrics'.*an object of numbers"),
    (json.dumps({k: v for k, v in json.loads(REPORT.to_json()).items() if k != "log_bytes"}),
     "'log_bytes' is missing"),
])
def test_malformed_reports_name_the_field(text: str, match: str) -> None:
    with pytest.raises(TaskReportError, match=match) as err:
        TaskReport.from_json(text)
    assert "same DSTL version" in str(err.value)


def test_the_error_names_the_partition_once_known() -> None:
    with pytest.raises(TaskReportError) as err:
        TaskReport.from_json(_with(rows_in=None))
    assert err.value.where == "task report of partition 2"
