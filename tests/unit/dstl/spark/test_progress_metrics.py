"""The operator's progress record and tracker, merged histograms, the agent log's
rotation, and the Prometheus exposition (parsed with prometheus_client's own parser)."""

from __future__ import annotations

import logging
import logging.handlers
import socket
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dstl.errors import ConfigError, ConfigTypeError
from dstl.metrics import MetricsRegistry, merged_snapshot
from dstl.spark.agent.__main__ import configure_logging
from dstl.spark.progress import ProgressTracker, progress_record
from dstl.spark.prometheus import MetricsSnapshot, PrometheusExporter, exposition


def _stats(batch_id: int = 7) -> dict[str, Any]:
    return {"batch_id": batch_id, "batch_seconds": 2.0, "job_seconds": 1.5,
            "task_commit_seconds": 0.25, "manifest_seconds": 0.125, "sink_seconds": 0.375,
            "restore_seconds": 0.5, "restore_seconds_total": 0.75, "rows_in": 40,
            "rows_out": 9, "segments": 2, "materializations": 1, "objects_written": 4,
            "bytes_written": 1234, "restores": 1, "deleted": 3, "agents": {11: {}, 12: {}}}


def _report(entries: int, disk: int, keys: int, internal: int = 0) -> Any:
    # one LMDB layout record in each table besides the states' records
    return SimpleNamespace(state_entries=entries, state_disk_bytes=disk, keys=keys,
                           state_memory_bytes=disk, state_rows=entries - 1 - internal,
                           internal_rows=internal)


def test_progress_record_has_sparks_shape_and_the_batch_figures() -> None:
    p = progress_record("count", 3, "lmdb", _stats(),
                        [_report(5, 4096, 2), _report(7, 8192, 3, internal=2)],
                        wall_start=1_700_000_000.25)
    assert p["batchId"] == 7 and p["name"] == "count"
    assert p["timestamp"] == "2023-11-14T22:13:20.250Z"
    assert p["numInputRows"] == 40 and p["numOutputRows"] == 9
    assert p["processedRowsPerSecond"] == 20.0
    assert p["durationMs"] == {"triggerExecution": 2000, "tasks": 1500, "taskCommit": 250,
                               "manifest": 125, "sink": 375, "restore": 500}
    (st,) = p["stateOperators"]
    # Spark's meaning: the user's state rows (5 - 1 + 7 - 1 - 2)
    assert (st["numRowsTotal"], st["numRowsUpdated"], st["diskBytes"]) == (8, 5, 12288)
    assert st["numStateStoreInstances"] == 3
    assert st["customMetrics"] == {"segments": 2, "objectsWritten": 4, "bytesWritten": 1234,
                                   "restores": 1, "restoreMs": 750, "materializations": 1,
                                   "deletedObjects": 3, "agents": 2, "timersFired": 0,
                                   "ttlPurged": 0, "lateRows": 0, "internalRows": 2,
                                   "tableRecords": 12}
    assert "eventTime" not in p
    with_wm = progress_record("count", 3, "lmdb", {**_stats(), "watermark_ms": 1500,
                                                    "timers_fired": 4, "ttl_purged": 7}, [],
                             wall_start=0.0)
    assert with_wm["eventTime"] == {"watermark": "1970-01-01T00:00:01.500Z"}
    assert with_wm["stateOperators"][0]["customMetrics"]["timersFired"] == 4
    assert with_wm["stateOperators"][0]["customMetrics"]["ttlPurged"] == 7


def test_tracker_is_bounded_and_a_raising_listener_is_logged_not_fatal(
        caplog: pytest.LogCaptureFixture) -> None:
    t = ProgressTracker(retained=3)
    assert t.last is None and t.recent == []
    seen: list[int] = []

    def bad(p: dict[str, Any]) -> None:
        raise RuntimeError("listener bug")

    t.add_listener(bad)
    t.add_listener(lambda p: seen.append(p["batchId"]))
    with caplog.at_level(logging.ERROR, logger="dstl.spark.progress"):
        for i in range(10):
            t.record({"batchId": i})
    assert seen == list(range(10))  # the raising listener did not stop the next one
    assert [p["batchId"] for p in t.recent] == [7, 8, 9]
    assert t.last == {"batchId": 9}
    assert sum("listener bug" in (r.exc_text or "") or "failed on batch" in r.getMessage()
               for r in caplog.records) == 10
    assert t.remove_listener(bad) and not t.remove_listener(bad)
    with pytest.raises(ConfigTypeError, match="listener"):
        t.add_listener("not callable")  # type: ignore[arg-type]


def test_merged_histograms_are_merged_from_samples_not_summed() -> None:
    a, b = MetricsRegistry("S."), MetricsRegistry("S.")
    for v in (1.0, 2.0, 3.0):
        a.histogram("lat").update(v)
    for v in (100.0,) * 7:
        b.histogram("lat").update(v)
    a.counter("n").inc(2)
    b.counter("n").inc(3)
    m = merged_snapshot([a, b])
    assert m["S.n"] == 5.0
    assert m["S.lat.count"] == 10.0
    assert m["S.lat.max"] == 100.0
    assert m["S.lat.p50"] == 100.0  # 7 of 10 samples are 100; a sum would say 102
    assert m["S.lat.mean"] == pytest.approx(706 / 10)
    assert merged_snapshot([]) == {}


def _agent(pid: int, p50: float) -> dict[str, float]:
    return {"agent.pid": float(pid), "agent.requests": 4.0,
            "agent.ChangelogStorage.numberOfUploadRequests": 9.0,
            **{f"agent.ChangelogStorage.uploadSizes.{k}": v for k, v in
               {"count": 3.0, "mean": p50, "p50": p50, "p99": 2 * p50, "max": 3 * p50}.items()},
            "agent.materializer.completed": 2.0, "agent.materializer.skipped": 1.0,
            "agent.materializer.lastDurationMs": 12.0}


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_exposition_parses_with_flink_names_and_one_series_per_agent() -> None:
    snap = MetricsSnapshot("count", {"numRecordsIn": 40.0}, {"lastBatchId": 7.0},
                           {"CheckpointCoordinator.numberOfCompletedCheckpoints": 3.0,
                            **{f"CheckpointCoordinator.checkpointDurationMs.{k}": 1.0
                               for k in ("count", "mean", "p50", "p99", "max")}},
                           {11: _agent(11, 10.0), 12: _agent(12, 1000.0)})
    fams = _families(exposition(snap))
    assert fams["dstl_operator_numRecordsIn"].samples[0].value == 40.0
    assert fams["dstl_operator_lastBatchId"].samples[0].labels == {"operator": "count"}
    assert fams["dstl_CheckpointCoordinator_numberOfCompletedCheckpoints"].samples[0].value == 3
    assert fams["dstl_CheckpointCoordinator_checkpointDurationMs"].type == "summary"
    up = fams["dstl_ChangelogStorage_numberOfUploadRequests"]
    assert {s.labels["agent"]: s.value for s in up.samples} == {"11": 9.0, "12": 9.0}
    sizes = fams["dstl_ChangelogStorage_uploadSizes"]
    assert sizes.type == "summary"
    p50 = {s.labels["agent"]: s.value for s in sizes.samples
           if s.labels.get("quantile") == "0.5"}
    assert p50 == {"11": 10.0, "12": 1000.0}  # per agent; never 1010
    counts = [s for s in sizes.samples if s.name.endswith("_count")]
    assert sorted(s.value for s in counts) == [3.0, 3.0]
    assert fams["dstl_ChangelogMaterialization_completedMaterialization"].samples[0].value == 2
    assert "dstl_ChangelogMaterialization_skipped" in fams
    assert "dstl_ChangelogMaterialization_lastDurationOfMaterialization" in fams
    assert "dstl_Agent_requests" in fams
    assert not any("pid" in n for n in fams)


def test_exporter_serves_http_and_refuses_a_taken_port() -> None:
    exp = PrometheusExporter("count", 0, host="127.0.0.1")
    try:
        exp.update(MetricsSnapshot("count", {"numRecordsIn": 5.0}))
        with urllib.request.urlopen(f"http://127.0.0.1:{exp.port}/metrics", timeout=10) as r:
            fams = _families(r.read().decode())
        assert fams["dstl_operator_numRecordsIn"].samples[0].value == 5.0
        with socket.socket() as s, pytest.raises(ConfigError, match="metrics_port"):
            s.bind(("127.0.0.1", 0))
            s.listen()
            PrometheusExporter("count", s.getsockname()[1], host="127.0.0.1")
    finally:
        exp.close()


def test_agent_log_rotates_at_the_configured_size(tmp_path: Path) -> None:
    root = logging.getLogger()
    level = root.level
    handler = configure_logging(str(tmp_path), {"DSTL_AGENT_LOG_MAX_BYTES": "4096",
                                                "DSTL_AGENT_LOG_BACKUPS": "2"})
    try:
        log = logging.getLogger("dstl.spark.agent.test")
        for i in range(400):
            log.info("line %d %s", i, "x" * 60)
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(level)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["agent.log", "agent.log.1", "agent.log.2"]
    assert all(p.stat().st_size <= 4096 for p in tmp_path.iterdir())
    assert "line 399" in (tmp_path / "agent.log").read_text()


@pytest.mark.parametrize(("name", "value"), [("DSTL_AGENT_LOG_MAX_BYTES", "10MiB"),
                                             ("DSTL_AGENT_LOG_MAX_BYTES", "100"),
                                             ("DSTL_AGENT_LOG_BACKUPS", "0")])
def test_agent_log_settings_are_checked(tmp_path: Path, name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        configure_logging(str(tmp_path), {name: value})
    assert not logging.getLogger().handlers or not any(
        isinstance(h, logging.handlers.RotatingFileHandler) for h in logging.getLogger().handlers)
