"""``query.stop()`` during a batch ends it cleanly: no ``StackOverflowError`` or other error in the
JVM's log, no Arrow leak report, the query ends as stopped (no exception), no process left behind,
and the next start in a fresh session restores exactly (counts equal a model).

The scenario runs in its own process (``stop_scenario.py``) so that the JVM it starts writes its
whole log to a file this test reads, and so that every process it starts carries the scenario's
directory in its environment. Before the fix, the query thread died in Spark's stop test
(``StreamExecution.PROXY_ERROR``) with a ``StackOverflowError``: see
:mod:`dstl.spark.stopping`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]

HERE = Path(__file__).resolve().parent
#: Lines of the JVM's log that a clean stop must not have.
_BAD = ("StackOverflowError", "Exception in thread", "Memory was leaked", "leak", " ERROR ",
        "Query terminated with error")


def _processes_with(marker: str) -> list[tuple[int, str]]:
    """This user's processes whose environment or command line contains ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:  # gone meanwhile, or another user's
            continue
        if marker.encode() in env or marker in cmd:
            found.append((int(name), cmd[:200]))
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _run_scenario(tmp: Path, table: str, agent: bool) -> tuple[dict[str, Any], str]:
    log = tmp / "scenario.log"
    with open(log, "wb") as out:
        proc = subprocess.run([sys.executable, str(HERE / "stop_scenario.py"), str(tmp), table,
                               "1" if agent else "0"], stdout=out, stderr=subprocess.STDOUT,
                              timeout=900, check=False)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, f"scenario failed ({proc.returncode}):\n{text[-6000:]}"
    return json.loads((tmp / "result.json").read_text()), text


@pytest.mark.parametrize("table,agent", [
    ("lmdb", True),
    pytest.param("heap", False, marks=pytest.mark.skipif(
        not os.environ.get("DSTL_DEEP"), reason="DSTL_DEEP=1: the heap without the agent "
                                                "(each scenario takes 1-2 min)")),
])
def test_stop_during_a_batch_is_clean_and_restart_is_exact(tmp_path: Path, table: str,
                                                          agent: bool) -> None:
    result, log = _run_scenario(tmp_path, table, agent)
    bad = [line for line in log.splitlines() if any(b in line for b in _BAD)]
    assert not bad, "the JVM's log has errors:\n" + "\n".join(bad[:20])
    tasks, sink = result["stops"]
    # the first query.stop() came while batch 1's tasks ran, the second inside batch 1's sink (re-run)
    assert tasks["batches_done"] == [0] and tasks["running_pids"], tasks
    assert sink["batches_done"] == [], sink  # batch 1 did not finish: its sink was interrupted
    # Spark killed the workers of the interrupted tasks (they do not run on after the stop)
    assert tasks["workers_gone_after"] is not None, tasks
    for stop in (tasks, sink):
        assert stop["exception"] is None and stop["active"] is False, stop
    # the re-runs: batch 1 again (after both stops), then the rest; nothing lost or doubled
    assert result["final_exception"] is None
    assert result["final_batches"] == [1, 2, 3, 4, 5], result["final_batches"]
    assert result["latest"] == result["expected"]
    # no process of the scenario is left (JVM, Python workers, executor agent)
    deadline = time.monotonic() + 30
    while ((left := _processes_with(str(tmp_path))) or _alive(result["jvm_pid"])) \
            and time.monotonic() < deadline:
        time.sleep(0.2)  # processes exit asynchronously after their parent; nothing to wait on
    assert not left, f"processes left behind: {left}"
    assert not _alive(result["jvm_pid"]), "the scenario's JVM still runs"
