"""A worker's connection to the executor agent when the agent dies between two tasks.

Found by a full run (``test_spark_agent.py::test_agent_group_commits_kills_and_lifecycle``):
after the agent was SIGKILLed, Spark's retry reached a worker whose ``dstl-agent-client`` reader
thread had not yet seen its connection end; the worker reused its runtime, the task's first send
got "Broken pipe", and the job aborted after its second failure. The reader thread is made to lag
here on purpose, through a public seam: it runs the done-callbacks of the futures it resolves,
and one of ours blocks it while the agent is killed. The connection must still count as broken
(the kernel already says the agent's end is closed), and the next task must start a new agent
instead of failing.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from support.processors import Count

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.spark.agent import AgentClient, AgentUnavailableError, AgentUploadScheduler, ensure_agent
from dstl.spark.agent.protocol import PingRequest, ShutdownRequest
from dstl.spark.config import OperatorConfig, TaskInput
from dstl.spark.report import REPORT_COLUMN, TaskReport
from dstl.spark.runtime import close_runtime, runtime_of
from dstl.spark.task import run_partition
from materializer.options import BackendOptions

WAIT = 10.0
#: How long the blocked reader thread stays blocked at most (it is released at the end).
HOLD_S = 1.5


def _kill(pid: int) -> None:
    """SIGKILL the agent (a child of this process: ``ensure_agent`` started it here) and wait
    until the kernel has torn it down completely, so its sockets are closed.

    A zombie thread-group leader is not enough: under load the agent's other threads may still
    be exiting and its file table, with the sockets, still open (seen: ``/proc/<pid>/stat`` said
    ``Z`` while the connection was alive). ``waitpid`` reports the leader only once every thread
    has exited."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + WAIT
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # already reaped (subprocess reaps children it lost track of)
            if not os.path.exists(f"/proc/{pid}"):
                return
        assert time.monotonic() < deadline, f"agent {pid} survived SIGKILL"
        time.sleep(0.01)  # another process's exit: there is no event to wait on


class ReaderHold:
    """Blocks a client's reader thread: a persist through it, with a flush window long enough
    that the reply comes after our done-callback is attached, so the reader runs the callback."""

    def __init__(self, client: AgentClient, uri: str) -> None:
        options = DstlOptions(persist_delay_s=0.5)  # the agent keeps a storage per options
        self.storage = ChangelogStorage(uri, options=options, uploader=AgentUploadScheduler(
            client, uri, None, options))
        self.entered = threading.Event()
        self.release = threading.Event()
        self.thread_name = ""
        writer = self.storage.create_writer("hold", KeyGroupRange(0, 7))
        first = writer.next_sqn()
        writer.append(0, b"x")
        writer.persist(first, -1).add_done_callback(self._hold)
        assert self.entered.wait(WAIT), "the persist was never answered"
        assert self.thread_name == "dstl-agent-client", (
            f"the callback ran on {self.thread_name!r}: the reply came before it was attached")

    def _hold(self, _: Future[Any]) -> None:
        self.thread_name = threading.current_thread().name
        self.entered.set()
        self.release.wait(HOLD_S)

    def close(self) -> None:
        self.release.set()
        self.storage.close()


def test_a_dead_agent_is_seen_even_while_the_reader_thread_lags(tmp_path: Path) -> None:
    path = ensure_agent(str(tmp_path / "agent"), watch_pid=os.getpid())
    client = AgentClient(path)
    pid = int(client.metrics()["agent.pid"])
    hold = ReaderHold(client, str(tmp_path / "store"))
    try:
        assert not client.broken
        _kill(pid)
        # the reader thread is still inside our callback and has not read the end of stream
        assert client.broken
        with pytest.raises(AgentUnavailableError, match="connection lost"):
            client.request(PingRequest())
    finally:
        hold.close()
        client.close()


SCHEMA = pa.schema([("key", pa.string()), ("count", pa.int64()), (REPORT_COLUMN, pa.string())])


def _run(cfg: OperatorConfig, inp: TaskInput, keys: list[str]
         ) -> tuple[dict[str, int], TaskReport]:
    out: dict[str, int] = {}
    reports: list[TaskReport] = []
    for rb in run_partition(cfg, inp, iter([pa.RecordBatch.from_pydict({"key": keys})]), 0):
        for row in rb.to_pylist():
            if row[REPORT_COLUMN] is None:
                out[row["key"]] = row["count"]
            else:
                reports.append(TaskReport.from_json(row[REPORT_COLUMN]))
    assert len(reports) == 1
    return out, reports[0]


def test_the_next_task_starts_a_new_agent_when_the_old_one_died_unnoticed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flaky run, made deterministic: the agent dies between two tasks of a worker whose
    reader thread has not noticed; the second task reconnects (a new agent) and restores its
    partition from the base checkpoint through the new agent, instead of failing with a broken
    pipe."""
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path / "executor"))
    cfg = OperatorConfig(
        name="dead-agent", processor=Count, key_column="key", output_columns=("key", "count"),
        arrow_schema=SCHEMA, state_uri=str(tmp_path / "store"), storage_options=None,
        partitions=1, max_parallelism=8, table="heap",
        dstl_options=DstlOptions(persist_delay_s=0.0),
        backend_options=BackendOptions(materialization_interval_s=None,
                                       materialize_log_ratio=None),
        local_dir=str(tmp_path / "local"), agent=True)
    hold: ReaderHold | None = None
    new_agent: AgentClient | None = None
    try:
        out0, report0 = _run(cfg, TaskInput(0, -1), ["a", "b", "a"])
        assert out0 == {"a": 2, "b": 1} and report0.slot.access == "new"
        old = runtime_of(cfg)
        assert old is not None and old.agent is not None
        old_pid = int(old.agent.metrics()["agent.pid"])
        hold = ReaderHold(old.agent, cfg.state_uri)
        _kill(old_pid)
        out1, report1 = _run(cfg, TaskInput(1, 0, {0: report0.handle.to_json()}, (0,)), ["a"])
        assert out1 == {"a": 3}
        assert report1.slot.access == "restore"  # a new runtime: nothing of the old one kept
        rt = runtime_of(cfg)
        assert rt is not None and rt is not old and rt.agent is not None
        assert report1.agent_metrics is not None
        assert int(report1.agent_metrics["agent.pid"]) != old_pid
        new_agent = rt.agent
    finally:
        if hold is not None:
            hold.close()
        if new_agent is not None:
            new_agent.request(ShutdownRequest()).result(WAIT)
        close_runtime(cfg)
