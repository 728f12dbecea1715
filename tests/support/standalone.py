"""A Spark standalone cluster as users run one: a master and workers as separate processes.

Theory of operation
-------------------
``bin/spark-class org.apache.spark.deploy.master.Master`` and ``...worker.Worker`` of the
installed pyspark, each a JVM of its own, on loopback: the master on 127.0.0.1 and each worker on
a loopback address of its own (127.0.0.1, 127.0.0.2, ...), so Spark sees as many hosts as
workers (a speculative copy of a task is never launched on the host of its first attempt, and
a worker's loss is a host's loss). Ports are chosen free just before the start; each worker
offers ``cores`` cores and ``memory_mb`` of memory; its executors run in ``<root>/worker-<i>``
(their logs, and their working directory, are there).

A process whose ready line (the master's "I have been elected leader", a worker's "Successfully
registered with master") does not come within :data:`START_TIMEOUT_S` fails the start with its
log in the message. Every process runs in a process group of its own (a worker's executors, their
Python daemons and workers are in the worker's group), so :meth:`StandaloneCluster.kill_worker`
takes a whole "machine" down at once, and :meth:`StandaloneCluster.stop` ends every process
under ``root`` (found with :func:`support.spark_cluster.processes_under`: DSTL's executor agents
leave their group, and go when their executor does).

``SPARK_HOME`` of the processes is a directory of symlinks to the installed package
(:func:`support.spark_cluster.private_spark_home`): nothing is written into the virtualenv.
The driver needs no ``SPARK_HOME``: :meth:`StandaloneCluster.session` connects a SparkSession of
this process to ``spark://127.0.0.1:<port>`` with the executors' Python set to this interpreter.

Fixture: ``standalone_cluster`` (module scope: one cluster per test module).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from support.spark_cluster import Proc, drop_gateway, kill, private_spark_home, processes_under
from support.spark_cluster import wait_gone as _wait_gone
from support.worker_path import start_session, worker_pythonpath

__all__ = ["StandaloneCluster", "Worker", "free_port", "standalone_cluster"]

#: A cold JVM starts in 5-30 s on two cores; at nice 19 beside other jobs it took over 120 s.
START_TIMEOUT_S = 300.0
#: The daemons' and executors' JVM flags: a C1-only JIT and the serial collector start faster
#: on two cores; the master and workers only schedule, the executors' work here is small.
DAEMON_JAVA_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (bound and released)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Worker:
    """One worker process: its host, its work directory and its log."""

    host: str
    directory: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0


@dataclass
class StandaloneCluster:
    """A master and ``len(hosts)`` workers (see the module docstring).

    Args:
        root: every file of the cluster goes below it (logs, work directories, local dirs).
        hosts: one loopback address per worker.
        cores: cores each worker offers.
        memory_mb: memory each worker offers its executors.
    """

    root: Path
    hosts: tuple[str, ...] = ("127.0.0.1", "127.0.0.2")
    cores: int = 1
    memory_mb: int = 1024
    workers: list[Worker] = field(default_factory=list)
    master_port: int = 0
    _master: subprocess.Popen[bytes] | None = None
    _home: Path | None = None

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.master_port}"

    def _env(self, local_ip: str) -> dict[str, str]:
        assert self._home is not None
        return {**os.environ, "SPARK_HOME": str(self._home),
                "SPARK_CONF_DIR": str(self.root / "conf"),
                "SPARK_LOCAL_IP": local_ip, "SPARK_DAEMON_MEMORY": "256m",
                "SPARK_DAEMON_JAVA_OPTS": DAEMON_JAVA_OPTS,
                "PYSPARK_PYTHON": sys.executable,
                "PYTHONPATH": worker_pythonpath()}

    def start(self) -> StandaloneCluster:
        """Start the master, then every worker; return once all workers registered.

        Raises:
            RuntimeError: a process exited or did not print its ready line in time (its log's
                tail is in the message); everything started is stopped first.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "conf").mkdir(exist_ok=True)
        self._home = private_spark_home(self.root)
        try:
            self._start_master()
            for i, host in enumerate(self.hosts):
                self.workers.append(Worker(host, self.root / f"worker-{i}",
                                           self.root / f"worker-{i}.log"))
                self.start_worker(i)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_master(self) -> None:
        log = self.root / "master.log"
        for _ in range(3):  # a port taken between free_port() and the bind: try another
            self.master_port = free_port()
            self._master = self._spawn(
                [MASTER_CLASS, "--host", "127.0.0.1", "--port", str(self.master_port),
                 "--webui-port", str(free_port())], self._env("127.0.0.1"), log)
            if _wait_for_line(self._master, log, "I have been elected leader",
                              START_TIMEOUT_S, bind_retry=True):
                return
        raise RuntimeError(f"the Spark master did not start:\n{_tail(log)}")

    def start_worker(self, index: int) -> None:
        """Start worker ``index`` (again, after :meth:`kill_worker`) on its host; return once
        it registered with the master.

        Raises:
            RuntimeError: it exited or did not register in time (its log in the message).
        """
        w = self.workers[index]
        w.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            w.port = free_port(w.host)
            offset = w.log.stat().st_size if w.log.exists() else 0
            w.proc = self._spawn(
                [WORKER_CLASS, "--host", w.host, "--port", str(w.port),
                 "--webui-port", str(free_port(w.host)), "--cores", str(self.cores),
                 "--memory", f"{self.memory_mb}m", "--work-dir", str(w.directory),
                 self.master_url], self._env(w.host), w.log)
            if _wait_for_line(w.proc, w.log, "Successfully registered with master",
                              START_TIMEOUT_S, bind_retry=True, offset=offset):
                return
        raise RuntimeError(f"Spark worker {index} on {w.host} did not start:\n{_tail(w.log)}")

    def _spawn(self, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        assert self._home is not None
        with open(log, "ab") as out:
            return subprocess.Popen([str(self._home / "bin" / "spark-class"), *args],
                                    stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=self.root, start_new_session=True)

    def session(self, name: str, conf: dict[str, str] | None = None) -> Any:
        """A SparkSession of this process on the cluster: one executor per worker (each
        ``cores`` cores, 512 MiB), the driver on 127.0.0.1, the executors' Python this
        interpreter with ``tests/`` and ``tests/integration/spark`` on its path (processors travel
        by reference)."""
        from pyspark.sql import SparkSession

        drop_gateway()  # the driver JVM starts with this process's environment
        os.environ["PYSPARK_PYTHON"] = sys.executable
        env = self._env("127.0.0.1")
        os.environ["PYTHONPATH"] = env["PYTHONPATH"]
        return start_session(SparkSession.builder.master(self.master_url).appName(name), {
            "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
            "spark.executor.memory": "512m", "spark.executor.cores": str(self.cores),
            "spark.executor.extraJavaOptions": DAEMON_JAVA_OPTS,
            "spark.executorEnv.PYTHONPATH": env["PYTHONPATH"], "spark.locality.wait": "0",
        } | (conf or {}))

    def wait_for_executors(self, spark: Any, n: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """Return once ``n`` executors registered with the driver of ``spark``.

        Raises:
            RuntimeError: fewer within ``timeout_s`` (the workers' logs in the message).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.executor_count(spark) >= n:
                return
            time.sleep(0.2)  # polling the driver's view; Spark offers no event to wait on
        raise RuntimeError(f"{self.executor_count(spark)} of {n} executors registered within "
                           f"{timeout_s:.0f} s:\n"
                           + "\n".join(_tail(w.log) for w in self.workers))

    @staticmethod
    def executor_count(spark: Any) -> int:
        """Executors the driver of ``spark`` knows (the driver itself not counted)."""
        status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus()
        return int(status.size()) - 1

    def worker_processes(self, index: int) -> list[Proc]:
        """Every live process of worker ``index``'s "machine": the worker JVM, its executors,
        their Python daemons and workers, DSTL's agents started there."""
        w = self.workers[index]
        found = processes_under([w.directory])
        if w.proc is not None and w.proc.poll() is None:
            found += [p for p in processes_under([self.root]) if p.pid == w.proc.pid]
        return found

    def kill_worker(self, index: int) -> list[Proc]:
        """SIGKILL worker ``index`` and every process of its "machine" at once, as a host
        that loses power; return what was killed."""
        w = self.workers[index]
        victims = self.worker_processes(index)
        assert w.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(w.proc.pid, signal.SIGKILL)
        kill(victims)
        w.proc.wait(30)
        return victims

    def processes(self) -> list[Proc]:
        """Every live process under the cluster's root (daemons, executors, Python, agents)."""
        return processes_under([self.root])

    def stop(self) -> list[Proc]:
        """Stop the workers and the master (SIGTERM, then SIGKILL after 30 s), then every
        process left under the root; return the processes that outlived the SIGTERM."""
        procs = [w.proc for w in self.workers if w.proc is not None] + \
            ([self._master] if self._master is not None else [])
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
        left = _wait_gone(self.processes(), 30.0)
        kill(left)
        return left


def _wait_for_line(proc: subprocess.Popen[bytes], log: Path, needle: str, timeout_s: float,
                   *, bind_retry: bool = False, offset: int = 0) -> bool:
    """Wait until ``log`` (from ``offset``) holds ``needle``. False if the process exited
    because its port was taken (``bind_retry``): the caller tries another port.

    Raises:
        RuntimeError: the process exited otherwise, or no such line within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_bytes()[offset:].decode("utf-8", "replace")
        if needle in text:
            return True
        if proc.poll() is not None:
            if bind_retry and "BindException" in text:
                return False
            raise RuntimeError(f"{log.stem} exited with {proc.returncode} before "
                               f"{needle!r}:\n{_tail(log)}")
        time.sleep(0.2)  # polling another process's log; there is no event to wait on
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"{log.stem}: no {needle!r} within {timeout_s:.0f} s:\n{_tail(log)}")


def _tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return f"({path} is missing)"
    text = path.read_text(errors="replace").splitlines()
    return f"--- {path} (last {lines} lines)\n" + "\n".join(text[-lines:])


@pytest.fixture(scope="module")
def standalone_cluster() -> Iterator[StandaloneCluster]:
    """A master and two workers (127.0.0.1 and 127.0.0.2, 1 core and 1 GiB each) for one
    test module; stopped at its end, and nothing of it may be left running."""
    root = Path(tempfile.mkdtemp(prefix="dstl-standalone-"))
    cluster = StandaloneCluster(root)
    try:
        yield cluster.start()
    finally:
        left = cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"processes outlived the cluster's stop: {left}"
