"""A Python worker's DSTL runtime: per worker process and operator, the storage, the restore
cache, the executor agent connection, and the partitions this worker served.

Theory of operation
-------------------
A Python worker keeps module-level objects between tasks, but a partition does not stick to a
worker (reference: spark_state.md §4). So each worker process holds one :class:`WorkerRuntime`
per operator (:func:`runtime_for`), built on the first task and kept until the process exits,
is forked (never reused across a fork), or loses its agent (the runtime is closed and built
again; its partitions restore from their last checkpoint).

A :class:`Slot` is one partition this worker served: its backend, its processor, and the
checkpoint the backend's state is at. With LMDB the partition's table is on the executor's disk
and shared by all its workers, so the runtime also keeps, per partition, the *table batch-id
file* ``<operator dir>/p<N>.batch-id``: the batch id (= checkpoint id) whose commit the on-disk
table holds, written with ``os.replace`` after each task and removed when a task fails. Together
with the table marker (which attempt of that batch) it tells a worker whether the table is at
the base checkpoint (:mod:`dstl.spark.slots`).

With the executor agent (``agent=True``), the runtime's storage uploads through the agent
(:class:`~dstl.spark.agent.AgentUploadScheduler`) and restores read through the agent's cache
(:class:`~dstl.spark.agent.AgentCache`); without it, the storage has its own scheduler and the
process its own :class:`~restore.cache.LocalFileCache` in ``<operator dir>/cache-<pid>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from dstl.layout import operator_dir
from dstl.spark.agent import (
    AgentCache,
    AgentClient,
    AgentUploadScheduler,
    ensure_agent,
    executor_pid,
)
from dstl.spark.agent.spawn import agent_dir
from dstl.spark.config import OperatorConfig
from dstl.spark.processor import StatefulProcessor, StatefulProcessorHandle
from dstl.spark.worker_gc import freeze_imports
from dstl.storage import ChangelogStorage
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle
from materializer.local_dirs import executor_local_dir
from restore.cache import LocalFileCache

__all__ = ["Slot", "WorkerRuntime", "close_runtime", "runtime_for", "runtime_of", "runtimes"]

logger = logging.getLogger(__name__)


@dataclass
class Slot:
    """A partition this worker serves.

    Attributes:
        backend: the partition's backend.
        processor: the user's processor instance, initialised on ``backend``.
        checkpoint_id: the checkpoint (batch id) the backend's state is at.
        handle: the processor's handle (the task sets its current key; it owns the timers).
        timer_values_arg: the processor's ``handle_input_rows`` takes ``timer_values``.
        at: the backend handle of that checkpoint as this slot made or restored it (``None``:
            unknown, e.g. after a rescale). A batch id alone cannot tell two attempts of one
            batch apart (a re-run on another worker, Spark's speculative copy): the slot is
            current only if the driver's base handle is this one.
    """

    backend: ChangelogKeyedStateBackend
    processor: StatefulProcessor
    checkpoint_id: int
    handle: StatefulProcessorHandle | None = None
    timer_values_arg: bool = True
    at: ChangelogStateBackendHandle | None = None

    def close(self) -> None:
        """Close the processor (its optional hook), then the backend, even if the hook fails."""
        try:
            close = getattr(self.processor, "close", None)  # duck-typed processors may lack it
            if close is not None:
                close()
        finally:
            self.backend.close()


class WorkerRuntime:
    """Per worker process and operator: storage, cache, agent client, and the partitions served
    here (see the module docstring)."""

    def __init__(self, cfg: OperatorConfig) -> None:
        self.cfg = cfg
        self.pid = os.getpid()
        executor_dir = executor_local_dir()
        self.agent: AgentClient | None = None
        uploader = None
        if cfg.agent:
            from dstl.spark import daemon

            directory = agent_dir(executor_dir)
            # started by the DSTL daemon before it forked this worker: wait for that one
            path = ensure_agent(directory, executor_pid(),
                                started_elsewhere=daemon.agent_starting(directory))
            self.agent = AgentClient(path)
            uploader = AgentUploadScheduler(self.agent, cfg.state_uri, cfg.storage_options,
                                            cfg.dstl_options)
        self.storage = ChangelogStorage(cfg.state_uri, options=cfg.dstl_options,
                                        storage_options=cfg.storage_options, uploader=uploader)
        #: ``<local_dir>/dstl/<operator>``: the partitions' tables and batch-id files
        self.operator_dir = os.path.join(cfg.local_dir or executor_dir, "dstl",
                                         operator_dir(cfg.name))
        os.makedirs(self.operator_dir, exist_ok=True)
        self.cache: AgentCache | LocalFileCache
        if self.agent is not None:
            # the executor's one cache lives in the agent: an object is downloaded once per
            # executor, and a killed worker leaves no files and no leases behind
            self.cache = AgentCache(self.agent, cfg.state_uri, cfg.storage_options,
                                    cfg.dstl_options)
        else:
            self.cache = LocalFileCache(os.path.join(self.operator_dir, f"cache-{self.pid}"))
        self.slots: dict[int, Slot] = {}
        self.lock = threading.Lock()

    def table_batch_id_path(self, partition: int) -> str:
        """``<operator dir>/p<N>.batch-id``: the batch id the partition's on-disk table holds."""
        return os.path.join(self.operator_dir, f"p{partition}.batch-id")

    def read_table_batch_id(self, partition: int) -> int | None:
        """The batch id the partition's on-disk table holds (``None``: unknown)."""
        try:
            with open(self.table_batch_id_path(partition)) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def write_table_batch_id(self, partition: int, batch_id: int | None) -> None:
        """Record the batch id the partition's table holds now (``None``: unknown, remove)."""
        path = self.table_batch_id_path(partition)
        if batch_id is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(str(batch_id))
        os.replace(tmp, path)

    @contextlib.contextmanager
    def partition_lock(self, partition: int) -> Iterator[None]:
        """Hold ``<operator dir>/p<N>.lock`` (``flock``) while a task uses the partition's table.

        Two attempts of one partition may run at once: a zombie task of an executor the driver
        gave up on keeps running while Spark re-runs it elsewhere, and with a ``local_dir``
        shared by the executors of a host both see one table. Without the lock the second
        attempt adopts the table at the base, the first commits its changes into it, and the
        second applies its own on top (counts doubled). With it, the second waits, then finds
        the table past its base (the batch-id file and the marker say so) and restores.
        The kernel releases the lock of a killed process.
        """
        path = os.path.join(self.operator_dir, f"p{partition}.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def drop(self, partition: int) -> None:
        """Forget the partition's slot (closing its backend); the next task gets it again."""
        slot = self.slots.pop(partition, None)
        if slot is not None:
            slot.close()

    def close(self) -> None:
        for partition in list(self.slots):
            self.drop(partition)
        self.storage.close()
        self.cache.close()
        if self.agent is not None:
            self.agent.close()


_RUNTIMES: dict[tuple[str, str], WorkerRuntime] = {}
_RUNTIMES_LOCK = threading.Lock()


def _key(cfg: OperatorConfig) -> tuple[str, str]:
    return (cfg.state_uri, cfg.name)


def runtime_for(cfg: OperatorConfig) -> WorkerRuntime:
    """This process's runtime of the operator, built on first use, after a fork, and after the
    executor agent was lost — also when the agent died after the previous task and the client's
    reader thread has not noticed yet (:attr:`AgentClient.broken` asks the kernel), so a task
    never starts on a dead connection."""
    freeze_imports()  # before this process builds anything of its own (dstl.spark.worker_gc)
    key = _key(cfg)
    with _RUNTIMES_LOCK:
        rt = _RUNTIMES.get(key)
        if rt is not None and rt.pid == os.getpid() and rt.agent is not None and rt.agent.broken:
            # the agent died: this process's writers can no longer upload; start over (the
            # partitions restore from their last checkpoint)
            logger.warning("executor agent connection lost; resetting DSTL runtime %s", key)
            rt.close()
            rt = None
        if rt is not None and rt.pid == os.getpid() and not _same_operator(rt.cfg, cfg):
            # the query restarted with other settings (e.g. `partitions`: a rescale) or another
            # processor on the same Python workers, or another operator of the same name and
            # store runs: backends and processors of the old one must not serve the new one
            logger.info("operator %s changed its configuration; resetting DSTL runtime %s",
                        cfg.name, key)
            rt.close()
            rt = None
        if rt is None or rt.pid != os.getpid():  # never reuse across fork
            rt = _RUNTIMES[key] = WorkerRuntime(cfg)
        return rt


def _same_operator(a: OperatorConfig, b: OperatorConfig) -> bool:
    """Whether a runtime built for ``a`` serves ``b``: every setting equal, and the same
    processor — by ``processor_id``, not by the class object, which cloudpickle may ship as a
    new (equal) class with every task. Without ids (a config built by hand) the class's module
    and name decide. A runtime kept across another processor would hand its partitions to
    instances of the old class."""
    if not all(getattr(a, f.name) == getattr(b, f.name)
               for f in dataclasses.fields(a) if f.name != "processor"):
        return False
    if a.processor_id or b.processor_id:
        return True  # the ids were compared above
    return bool((a.processor.__module__, a.processor.__qualname__)
                == (b.processor.__module__, b.processor.__qualname__))


def runtime_of(cfg: OperatorConfig) -> WorkerRuntime | None:
    """This process's runtime of the operator, if one was built here."""
    with _RUNTIMES_LOCK:
        rt = _RUNTIMES.get(_key(cfg))
    return rt if rt is not None and rt.pid == os.getpid() else None


def runtimes() -> list[WorkerRuntime]:
    """This process's runtimes, one per operator it ran."""
    with _RUNTIMES_LOCK:
        return [rt for rt in _RUNTIMES.values() if rt.pid == os.getpid()]


def close_runtime(cfg: OperatorConfig) -> None:
    """Close and forget this process's runtime of the operator (if any)."""
    with _RUNTIMES_LOCK:
        rt = _RUNTIMES.pop(_key(cfg), None)
    if rt is not None and rt.pid == os.getpid():
        rt.close()
