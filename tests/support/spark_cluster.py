"""A real multi-executor Spark cluster on one machine, for tests and benchmarks.

Theory of operation
-------------------
``local-cluster[N,C,M]`` is Spark's own test master: the driver JVM starts a standalone master
and N standalone workers as threads, and each worker launches its executor as a **separate JVM
process** (``CoarseGrainedExecutorBackend``), exactly as a standalone worker on another machine
would. Each executor has its own block-manager directory (``SPARK_LOCAL_DIRS`` of its Python
workers), its own ``pyspark.daemon`` and Python workers, hence its own DSTL executor agent. A
killed executor JVM is reported by its worker, and the master starts a replacement executor;
its tasks are re-run elsewhere. That is everything the DSTL side of a cluster sees; what it
cannot show is a worker *machine* going away (the workers live in the driver JVM), which DSTL does
not see differently from an executor going away.

Two things make it work from a pip-installed pyspark:

- ``SPARK_HOME`` must point at a Spark distribution: the workers build the executor's class
  path from ``$SPARK_HOME/jars``. The installed ``pyspark`` package directory is one, but the
  workers also write the executors' stdout/stderr into ``$SPARK_HOME/work``; so
  :func:`private_spark_home` makes a directory of symlinks to the package's entries with a
  ``work`` of its own (nothing is written into the virtualenv, and the logs go away with it).
- The driver JVM must be started with that ``SPARK_HOME`` (the in-process workers read it from
  their environment), so :func:`new_cluster_session` first ends this process's py4j gateway
  JVM if an earlier session left one (PySpark keeps it for the life of the Python process), and
  :func:`drop_gateway` ends the cluster's own afterwards: later sessions start from a clean JVM.
- ``spark.local.dir`` points at a directory of the caller, so every executor directory (and so
  every agent directory) is under it, and :func:`processes_under` can find every process the
  cluster started: executors, daemons and workers run with their working directory in
  ``<spark home>/work/app-*/<executor id>``, and the agents (detached, reparented to init)
  inherit a worker's working directory and name their agent directory on their command line.

A standalone master and two workers as separate processes (:mod:`support.standalone`) cost
three more JVMs; the tests use them where the difference matters: workers on two hosts (Spark
launches a speculative copy only on another host) and a worker machine lost as a whole.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support.worker_path import start_session, worker_pythonpath

__all__ = ["Proc", "alive", "drop_gateway", "executor_pids", "kill", "new_cluster_session",
           "private_spark_home", "processes_under", "wait_gone"]


def private_spark_home(root: Path) -> Path:
    """``root/spark-home``: symlinks to the installed pyspark's entries (``jars``, ``bin`` …)
    and a ``work`` directory of its own."""
    import pyspark

    home = root / "spark-home"
    home.mkdir(parents=True, exist_ok=True)
    package = Path(pyspark.__file__).parent
    for entry in package.iterdir():
        link = home / entry.name
        if entry.name != "work" and not link.exists():
            link.symlink_to(entry)
    (home / "work").mkdir(exist_ok=True)
    return home


def new_cluster_session(name: str, root: Path, executors: int = 2, cores: int = 1,
                        memory_mb: int = 1024, conf: dict[str, str] | None = None) -> Any:
    """A SparkSession on ``local-cluster[executors, cores, memory_mb]`` whose Spark home and
    local directories are under ``root`` (see the module docstring).

    ``spark.locality.wait=0`` and no reduce-side locality: a task goes to whichever executor
    has a free core, so partitions move between executors from batch to batch, as they do on a
    busy cluster.
    """
    from pyspark.sql import SparkSession

    drop_gateway()
    home = private_spark_home(root)
    local = root / "local"
    local.mkdir(parents=True, exist_ok=True)
    os.environ["SPARK_HOME"] = str(home)
    # executors' Python workers must run this interpreter (the venv) and import the test modules
    # that define processors (cloudpickle ships classes by reference)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = worker_pythonpath()
    builder = (SparkSession.builder.master(f"local-cluster[{executors},{cores},{memory_mb}]")
               .appName(name))
    return start_session(builder, {"spark.local.dir": str(local), "spark.locality.wait": "0",
                                   "spark.shuffle.reduceLocality.enabled": "false"}
                         | (conf or {}))


def drop_gateway(timeout_s: float = 30.0) -> None:
    """End this process's py4j gateway JVM (the driver), if any, so the next session starts a
    new one. Call only with no active SparkContext."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    if gateway is None:
        return
    proc = getattr(gateway, "proc", None)
    with contextlib.suppress(Exception):  # the JVM may be gone already
        gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if proc is not None:
        proc.stdin.close()  # the gateway JVM exits when its stdin closes
        try:
            proc.wait(timeout_s)
        except Exception:
            proc.kill()
            proc.wait(timeout_s)


@dataclass(frozen=True)
class Proc:
    """A process found by :func:`processes_under`: its pid, start time (clock ticks since
    boot: with the pid, a process identity that pid reuse cannot fake) and what it is."""

    pid: int
    start: int
    kind: str  # "executor", "agent", "python" or "other"
    cmdline: str


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _kind(cmdline: str) -> str:
    if "CoarseGrainedExecutorBackend" in cmdline:
        return "executor"
    if "dstl.spark.agent" in cmdline:
        return "agent"
    if "python" in cmdline:
        return "python"
    return "other"


def processes_under(paths: Iterable[Path]) -> list[Proc]:
    """Live processes whose working directory or command line lies under one of ``paths``
    (this user's processes only: /proc hides the others' working directories)."""
    roots = [str(p.resolve()) for p in paths]
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(d / "cwd")
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            stat = _stat(int(d.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours
        if stat[0] == "Z":
            continue  # a zombie has exited; its parent has not reaped it yet
        if any(cwd.startswith(r) or r in cmdline for r in roots):
            found.append(Proc(int(d.name), int(stat[19]), _kind(cmdline), cmdline))
    return found


def executor_pids(paths: Iterable[Path]) -> set[int]:
    """The executor JVMs running under ``paths``."""
    return {p.pid for p in processes_under(paths) if p.kind == "executor"}


def alive(proc: Proc) -> bool:
    """Whether exactly this process (pid and start time) still runs (not a zombie)."""
    try:
        stat = _stat(proc.pid)
    except (OSError, ValueError, IndexError):
        return False
    return stat[0] != "Z" and int(stat[19]) == proc.start


def wait_gone(procs: Iterable[Proc], timeout_s: float = 30.0) -> list[Proc]:
    """Wait until none of ``procs`` runs; the ones still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    left = [p for p in procs if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)  # polling other processes' exits; there is no event to wait on
        left = [p for p in left if alive(p)]
    return left


def kill(procs: Iterable[Proc]) -> None:
    """SIGKILL what is left (a failed test's cleanup: never leave a cluster running)."""
    for p in procs:
        if alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
