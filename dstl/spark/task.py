"""Executor side of the Spark operator: what one ``mapInArrow`` task does.

Theory of operation
-------------------
:func:`run_partition` is the body of one task; :func:`run_partitions` that of a task running
several partitions (fewer task slots than partitions): each is acquired, processed,
checkpointed and reported on its own, as below, but steps 1-2 run for every partition of the
task before step 3 requests any checkpoint, so their logs go to the store in one persist
window (one segment with the agent, one wait) rather than one window each. Under the worker
runtime's lock (:mod:`dstl.spark.runtime`: one per worker process and operator) and the
partitions' lock files (``flock``: one attempt of a partition at a time on a host's table, even
a zombie attempt of a lost executor next to its re-run, with a ``local_dir`` shared by the
host's executors; a task takes its partitions' locks in ascending order) it

1. gets the partition's state at the base checkpoint (:func:`dstl.spark.slots.acquire`: hit,
   adopt, restore or new);
2. inside one write batch (with LMDB: one write transaction) fixes the TTL clock at the batch's
   processing time and purges the values of TTL states that expired by then
   (:mod:`materializer.ttl`: logged, found through the expiry index), delivers the partition's expired
   timers to ``handle_expired_timer`` in timestamp order (processing-time mode: timers at or
   before the batch's processing time; event-time mode: at or before its watermark; found
   through the timer index, :mod:`materializer.timers`, so even a partition without rows fires
   its timers), then groups the task's rows by key and calls ``handle_input_rows`` once per
   key; it also takes the largest event time of its rows for the driver's watermark;
3. checkpoints: ``snapshot(batch_id)`` waits only for the log of this batch to be durable. With
   LMDB the table marker of the checkpoint (:mod:`materializer.table_marker`) is written into
   the same transaction, which commits only once the log is durable;
4. records the batch id the partition's table now holds (the table batch-id file);

and then reports the commit to the executor agent, and yields its output rows plus one report
row (:class:`~dstl.spark.report.TaskReport`) carrying the backend handle for the driver's
coordinator. Any failure drops the partition's in-process backend and its batch-id file, so a
retry restores: state is never half-applied.

*Materialization.* With the executor agent (the default) and LMDB, the agent materializes the
partitions, from a read transaction, while workers keep writing: before it checkpoints, a task
installs the newest snapshot the agent took of its partition (if its log reaches the snapshot's
boundary), and after it commits, it registers the partition's new marker with the agent
(``committed``). The heap table, and every table with ``agent=False``, materializes in the task,
synchronously, when the backend's policy says it is due (:mod:`materializer.policy`; the task's
backends start nothing by themselves: ``auto_materialize=False``); with ``agent=False`` each task
also writes its own segment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dstl.errors import BackendFailedError, DstlError, ProcessorError, UsageError
from dstl.handle import ChangeSetRef
from dstl.spark.agent import AgentClient, PartitionSpec, StoreRef
from dstl.spark.agent.protocol import CommittedRequest, MaterializationRequest
from dstl.spark.config import OperatorConfig, TaskInput
from dstl.spark.grouping import RowsByKey
from dstl.spark.outputs import OutputRows
from dstl.spark.report import INITIAL_STATE_COLUMN, REPORT_COLUMN, SlotAccess, TaskReport
from dstl.spark.runtime import Slot, WorkerRuntime, runtime_for
from dstl.spark.slots import acquire
from dstl.spark.timing import EVENT_TIME_COLUMN, ExpiredTimerInfo, TimerValues
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from materializer.heap import release_free_memory

__all__ = ["committed_reports", "run_group", "run_partition", "run_partitions"]

#: How long a task waits for its checkpoint's log (and an in-task materialization) to be
#: durable; beyond it the task fails and Spark retries it.
_CHECKPOINT_TIMEOUT_S = 300.0
#: The agent answers materializer requests from memory; beyond this it is taken as hung.
_AGENT_QUICK_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class _BatchRun:
    """What processing and checkpointing one batch of a partition produced."""

    outputs: Any  # the output rows as an Arrow record batch (None: no rows)
    rows_out: int
    rows_in: int
    keys: int
    processed_at: float  # monotonic time the processor finished
    handle: ChangelogStateBackendHandle
    snapshot: SnapshotRef | None  # taken in the task or installed from the agent
    new_refs: list[ChangeSetRef]  # this batch's change sets
    max_event_time_ms: int | None = None
    timers_fired: int = 0
    ttl_purged: int = 0


def run_partition(cfg: OperatorConfig, task_input: TaskInput, batches: Iterable[Any],
                  partition: int | None = None) -> Iterator[Any]:
    """The body of one ``mapInArrow`` task (see the module docstring); ``partition`` defaults
    to the Spark task's partition id. Yields Arrow record batches: the output rows, then the
    report row."""
    check_version(task_input.driver_version)
    partition, attempt = _task_identity(partition)
    rt = runtime_for(cfg)
    counts = {"received": 0, "late": 0}
    rows = drop_late(batches, EVENT_TIME_COLUMN, task_input.watermark_ms, counts)
    # the runtime's lock: one task per worker at a time; the partition lock: one attempt of the
    # partition on this host's table at a time (a zombie attempt, a shared local_dir)
    with rt.lock, rt.partition_lock(partition):
        done = _run_group(rt, task_input, [(partition, rows)])
    yield from _reported(rt, cfg, attempt, done, counts["late"])


def drop_late(batches: Iterable[Any], event_column: str | None, watermark_ms: int,
              counts: dict[str, int], late: list[Any] | None = None) -> Iterator[Any]:
    """The task's record batches without the rows at or below the watermark (event time in
    ``event_column``; a row without one is kept; none without a watermark or the column); the
    rows received and dropped are added to ``counts["received"]`` and ``counts["late"]``, and
    the dropped rows to ``late`` (record batches) when it is given. The tasks drop late rows
    themselves so that a batch's figures count every row received."""
    import pyarrow.compute as pc

    for b in batches:
        counts["received"] += b.num_rows
        if event_column is None or watermark_ms < 0 or event_column not in b.schema.names:
            yield b
            continue
        col = b.column(event_column)
        on_time = pc.or_kleene(pc.is_null(col), pc.greater(col, watermark_ms))
        kept = b.filter(on_time)
        counts["late"] += b.num_rows - kept.num_rows
        if late is not None and kept.num_rows < b.num_rows:
            late.append(b.filter(pc.invert(on_time)))
        yield kept


def _run_group(rt: WorkerRuntime, task_input: TaskInput,
               parts: list[tuple[int, Iterable[Any]]]) -> list[_Committed]:
    """Process the partitions one after another, then checkpoint them together: every
    checkpoint is requested once the last partition is processed and before the first is
    waited for, so their logs go to the store in one persist window (one segment, one wait)
    rather than one each; each partition commits once its own log is durable. Call with the
    runtime's lock and the partitions' locks held. A failure drops every partition that had
    not committed (its backend and batch-id file: a retry restores it) and rolls back the
    write batches still open; partitions that had committed keep their state at this batch,
    which a retry restores from the base like any re-run partition."""
    started: list[_Started] = []
    done: list[_Committed] = []
    current: int | None = None
    try:
        for partition, batches in parts:
            current = partition
            t0 = time.monotonic()
            slot, access = acquire(rt, partition, task_input)
            started.append(_start_batch(rt, partition, slot, access, t0, task_input, batches))
        current = None
        for s in started:  # every log on its way before the task waits for any
            _request_checkpoint(rt, s, task_input.batch_id)
        for s in started:
            run = _finish_batch(s)
            s.slot.checkpoint_id, s.slot.at = task_input.batch_id, run.handle
            if rt.cfg.table == "lmdb":
                rt.write_table_batch_id(s.partition, task_input.batch_id)
            done.append(_Committed(s, run, time.monotonic(), _table_stats(s.slot.backend)))
            s.rows.groups.clear()
    except BaseException as exc:
        failed = started[len(done):]
        try:
            for s in failed:
                s.abort(exc)
        finally:  # dropped even if a rollback fails
            for partition in (*(s.partition for s in failed),
                              *(() if current is None else (current,))):
                rt.drop(partition)
                rt.write_table_batch_id(partition, None)
        raise
    # the batch's rows, change records and LMDB pages are free now: back to the system, or
    # the worker keeps its largest batch's memory for its lifetime (materializer.heap)
    release_free_memory()
    return done


def _reported(rt: WorkerRuntime, cfg: OperatorConfig, attempt: int,
              done: list[_Committed], late: int) -> Iterator[Any]:
    """Each committed partition registered with the executor agent, then its output rows and
    report row; the task's late rows are counted once, in its first partition's report."""
    for i, (outputs, report) in enumerate(committed_reports(rt, cfg, attempt, done)):
        if i == 0 and late:
            report = dataclasses.replace(report, rows_late=late)
        yield from _record_batches(cfg, outputs, report)


def committed_reports(rt: WorkerRuntime, cfg: OperatorConfig, attempt: int,
                      done: list[_Committed]) -> Iterator[tuple[Any, TaskReport]]:
    """Per committed partition, registered with the executor agent first: its output rows (an
    Arrow record batch with the report column, or ``None``) and its report."""
    for c in done:
        agent_metrics: dict[str, float] | None = None
        agent_log: tuple[str, ...] = ()
        if rt.agent is not None:
            agent_metrics, agent_log = _register_commit(rt.agent, cfg, c.started.slot.backend,
                                                        c.run.handle)
        yield c.run.outputs, _report(c.started.partition, attempt, c.started.access, c.run,
                                     c.started.started, c.committed_at, agent_metrics,
                                     agent_log, c.table)


def run_group(cfg: OperatorConfig, task_input: TaskInput, batches: Iterable[Any],
              tasks: int, task: int | None = None) -> tuple[WorkerRuntime, int,
                                                            list[_Committed]]:
    """Process and commit the partitions of one Spark task (``task`` defaults to the Spark
    task's partition id): partition ``task`` when ``tasks`` equals the partitions, else those
    ``p`` with ``p mod tasks == task``, as :func:`run_partition` and :func:`run_partitions`
    do. Returns the worker runtime, the task attempt and the committed partitions."""
    check_version(task_input.driver_version)
    if task is None:
        task = _task_identity(None)[0]
    attempt = _task_identity(task)[1]
    rt = runtime_for(cfg)
    if tasks == cfg.partitions:
        with rt.lock, rt.partition_lock(task):
            return rt, attempt, _run_group(rt, task_input, [(task, batches)])
    mine = range(task, cfg.partitions, tasks)
    rows = _split_by_partition(batches, mine)
    with rt.lock, contextlib.ExitStack() as locks:
        for partition in mine:  # ascending, as every task takes them: no lock-order deadlock
            locks.enter_context(rt.partition_lock(partition))
        return rt, attempt, _run_group(rt, task_input, [(p, rows[p]) for p in mine])


def run_partitions(cfg: OperatorConfig, task_input: TaskInput, batches: Iterable[Any],
                   tasks: int, task: int | None = None) -> Iterator[Any]:
    """The body of a Spark task that runs several partitions: those ``p`` with
    ``p mod tasks == task`` (``task`` defaults to the Spark task's partition id). Each is
    acquired, processed, checkpointed and reported as :func:`run_partition` does one, but the
    task holds all their locks, processes them one after another and then checkpoints them
    together (:func:`_run_group`: one persist window for all, not one each). The task's rows
    are split by their ``_dstl_pid`` column first, keeping each partition's rows in arrival
    order. A failure in one partition fails the task: Spark retries it whole, and the
    partitions that had committed restore from the base checkpoint like any retried partition
    (their reports of the failed attempt never reach the driver).

    Raises:
        UsageError: a row is routed to a partition that is not this task's (a routing bug:
            nothing is processed).
    """
    counts = {"received": 0, "late": 0}
    rows = drop_late(batches, EVENT_TIME_COLUMN, task_input.watermark_ms, counts)
    rt, attempt, done = run_group(cfg, task_input, rows, tasks, task)
    yield from _reported(rt, cfg, attempt, done, counts["late"])


def _split_by_partition(batches: Iterable[Any], partitions: range) -> dict[int, list[Any]]:
    """The record batches of each partition in ``partitions`` (by ``_dstl_pid``), each
    partition's rows in their order of arrival (a stable sort)."""
    import pyarrow.compute as pc

    out: dict[int, list[Any]] = {p: [] for p in partitions}
    for batch in batches:
        if not batch.num_rows:
            continue
        pids = batch.column("_dstl_pid")
        if len(partitions) > 1:
            batch = batch.take(pc.sort_indices(pids))  # stable: arrival order per partition
            pids = batch.column("_dstl_pid")
        # in order of first appearance: the sorted order (a task of one partition does not
        # sort: all its rows are that partition's, or the first other value fails the task)
        counts = pc.value_counts(pids)
        offset = 0
        for pid, n in zip(counts.field("values").to_pylist(),
                          counts.field("counts").to_pylist()):
            if pid not in out:
                raise UsageError(f"a row routed to partition {pid} reached the task of "
                                 f"partitions {list(partitions)}; "
                                 "the driver and this executor disagree on the routing: run "
                                 "one DSTL version on both")
            out[pid].append(batch.slice(offset, n))
            offset += n
    return out


#: The start of the message of a task whose DSTL differs from the driver's (the driver finds it
#: in the failed job's error).
VERSION_MISMATCH = "DSTL version mismatch"


def check_version(driver_version: str) -> None:
    """Fail the task at once when this executor imports another DSTL than the driver runs: the
    task reports and handles they exchange are only defined within one version.

    Raises:
        UsageError: naming both versions, where this one was imported from, and the fix.
    """
    import dstl

    if driver_version and driver_version != dstl.__version__:
        raise UsageError(f"{VERSION_MISMATCH}: the driver runs DSTL {driver_version}, this "
                         f"executor's Python ({sys.executable}) imports DSTL {dstl.__version__} "
                         f"from {os.path.dirname(dstl.__file__ or '?')}; ship the driver's DSTL "
                         "to the executors (a packed virtualenv through --archives with "
                         "PYSPARK_PYTHON, or a container image: docs/deploy.md)")


def _task_identity(partition: int | None) -> tuple[int, int]:
    """``(partition, attempt)`` of the running Spark task (partition 0, attempt 0 outside
    Spark)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if partition is None:
        partition = ctx.partitionId() if ctx is not None else 0
    return partition, ctx.attemptNumber() if ctx is not None else 0


@dataclass
class _Started:
    """A partition's batch processed, its write batch still open, and (once
    :func:`_request_checkpoint` ran) its checkpoint requested: what :func:`_finish_batch` needs
    to commit it."""

    partition: int
    slot: Slot
    access: SlotAccess
    started: float  # monotonic time the task began the partition
    #: the write batch, open from the processing on (LMDB with the agent: until the marker is
    #: in it, once the log is durable; otherwise until the checkpoint is requested)
    open_batch: contextlib.ExitStack
    #: the checkpoint, once requested (:func:`_request_checkpoint`)
    pending: Future[ChangelogStateBackendHandle] | None
    write_marker: bool
    outputs: Any
    rows_out: int
    rows: _Rows
    processed_at: float
    snapshot: SnapshotRef | None
    first_sqn: int
    timers_fired: int
    ttl_purged: int

    def abort(self, exc: BaseException) -> None:
        """Roll back the write batch if it is still open (another partition failed)."""
        self.open_batch.__exit__(type(exc), exc, exc.__traceback__)


@dataclass(frozen=True)
class _Committed:
    """A partition whose batch committed, with the table's figures after the commit."""

    started: _Started
    run: _BatchRun
    committed_at: float
    table: dict[str, int]


def _start_batch(rt: WorkerRuntime, partition: int, slot: Slot, access: SlotAccess,
                 started: float, task_input: TaskInput, batches: Iterable[Any]) -> _Started:
    """Process the partition's rows (step 2), leaving its write batch open for
    :func:`_request_checkpoint`."""
    cfg = rt.cfg
    backend = slot.backend
    first_sqn = backend.writer.next_sqn()
    rows = _group_rows(batches, cfg.key_column)
    times = TimerValues(task_input.processing_time_ms, task_input.watermark_ms)
    outputs = OutputRows(_output_schema(cfg), f"{cfg.processor.__qualname__} of operator "
                         f"{cfg.name!r}", cfg.session_time_zone)
    call = ProcessorCall(cfg.processor.__qualname__, cfg.name, partition, task_input.batch_id)
    with contextlib.ExitStack() as batch:
        batch.enter_context(backend.write_batch())
        purged = _purge_expired(backend, task_input.processing_time_ms)
        _apply_initial_state(slot, rows.initial, times, call)
        fired = _fire_timers(slot, cfg.time_mode, times, outputs, call)
        _process(slot, rows.groups, times, outputs, call)
        # before the checkpoint: rows that do not fit the schema fail the batch uncommitted
        out_batch = _output_batch(cfg, outputs)
        open_batch = batch.pop_all()
    return _Started(partition, slot, access, started, open_batch, None, True, out_batch,
                    len(outputs), rows, time.monotonic(), None, first_sqn, fired, purged)


def _request_checkpoint(rt: WorkerRuntime, s: _Started, batch_id: int) -> None:
    """Request the partition's checkpoint (step 3) without waiting for its log to be durable.
    With the agent materializing (LMDB), the agent's newest snapshot is installed and the
    checkpoint requested inside the open write batch, which commits with the table marker once
    the log is durable (a read transaction sees both or neither); otherwise the write batch
    commits now, the task materializes if due, and the checkpoint is requested after."""
    cfg = rt.cfg
    backend = s.slot.backend
    if cfg.agent_materializes and rt.agent is not None:
        s.snapshot = _install_agent_snapshot(rt.agent, cfg, backend)
        s.pending = backend.snapshot(batch_id)
        return
    s.open_batch.close()  # commits the write batch
    s.snapshot = _materialize_if_due(s.slot)
    # LMDB: the marker lets another worker adopt the table without reads
    s.pending = backend.snapshot(batch_id)
    s.write_marker = cfg.table == "lmdb"


def _finish_batch(s: _Started) -> _BatchRun:
    """Wait for the partition's log to be durable, write the table marker and commit (the
    write batch, if still open: on an error it rolls back)."""
    backend = s.slot.backend
    assert s.pending is not None, "the checkpoint is requested before it is finished"
    with s.open_batch:
        handle = s.pending.result(timeout=_CHECKPOINT_TIMEOUT_S)
        if s.write_marker:
            backend.write_table_marker(handle)
    return _BatchRun(s.outputs, s.rows_out, s.rows.count, len(s.rows.groups), s.processed_at,
                     handle, s.snapshot, _refs_since(backend, s.first_sqn),
                     s.rows.max_event_time_ms, s.timers_fired, s.ttl_purged)


@dataclass
class _Rows:
    """The task's input: rows by key in arrival order, how many, the largest event time."""

    groups: RowsByKey
    count: int
    max_event_time_ms: int | None
    #: the ``initial_state`` rows by key (only in a query's first batch)
    initial: dict[Any, list[dict[str, Any]]] = field(default_factory=dict)


#: Columns the driver adds for routing and the watermark; processors never see them.
_INTERNAL_COLUMNS = ("_dstl_pid", EVENT_TIME_COLUMN, INITIAL_STATE_COLUMN)


def _group_rows(batches: Iterable[Any], key_column: str) -> _Rows:
    import pyarrow.compute as pc

    out = _Rows(RowsByKey((), key_column), 0, None)
    kept: list[Any] = []
    for batch in batches:
        internal = [c for c in _INTERNAL_COLUMNS if c in batch.schema.names]
        if EVENT_TIME_COLUMN in internal and batch.num_rows:
            m = pc.max(batch.column(EVENT_TIME_COLUMN)).as_py()
            if m is not None and (out.max_event_time_ms is None or m > out.max_event_time_ms):
                out.max_event_time_ms = int(m)
        if INITIAL_STATE_COLUMN in internal:
            batch = _take_initial_state(batch, key_column, out.initial)
        kept.append(batch.drop_columns(internal) if internal else batch)
        out.count += batch.num_rows
    out.groups = RowsByKey(kept, key_column)
    return out


def _take_initial_state(batch: Any, key_column: str,
                        initial: dict[Any, list[dict[str, Any]]]) -> Any:
    """Move the batch's ``initial_state`` rows (their struct column is set) to ``initial``;
    the input rows that remain."""
    import pyarrow.compute as pc

    col = batch.column(INITIAL_STATE_COLUMN)
    is_init = pc.is_valid(col)
    if not pc.any(is_init).as_py():
        return batch
    for key, row in zip(batch.column(key_column).filter(is_init).to_pylist(),
                        col.filter(is_init).to_pylist()):
        initial.setdefault(key, []).append(row)
    return batch.filter(pc.invert(is_init))


@dataclass(frozen=True)
class ProcessorCall:
    """Where the processor runs, for the error that wraps an exception it raises."""

    processor: str
    operator: str
    partition: int
    batch_id: int

    def error(self, exc: Exception, method: str, key: Any) -> ProcessorError:
        """The :class:`ProcessorError` for ``exc``, raised by ``method`` for ``key``."""
        return ProcessorError.of(exc, processor=self.processor, operator=self.operator,
                                 method=method, key=key, partition=self.partition,
                                 batch_id=self.batch_id)


def _apply_initial_state(slot: Slot, initial: dict[Any, list[dict[str, Any]]],
                         times: TimerValues, call: ProcessorCall) -> None:
    """Give each ``initial_state`` row to ``handle_initial_state`` with its key's state in
    scope (before the batch's timers and input)."""
    handle = slot.handle
    for key, states in initial.items():
        slot.backend.set_current_key(_backend_key(key))
        if handle is not None:
            handle.set_key(key)
        try:
            for state in states:
                emitted: object = slot.processor.handle_initial_state(  # type: ignore[func-returns-value]
                    key, state, times)
                if emitted is not None:
                    # e.g. a generator: its body would never run, the seeding silently lost
                    raise UsageError(f"{call.processor}.handle_initial_state returned "
                                     f"{type(emitted).__name__} for key {key!r} (operator "
                                     f"{call.operator!r}): it sets the key's state and returns "
                                     "None, as Spark's handleInitialState does; emit rows from "
                                     "handle_input_rows or a timer")
        except DstlError:
            raise
        except Exception as exc:
            raise call.error(exc, "handle_initial_state", key) from exc
        finally:
            if handle is not None:
                handle.clear_key()


def _purge_expired(backend: ChangelogKeyedStateBackend, processing_time_ms: int) -> int:
    """Fix the TTL clock at the batch's processing time (the wall clock if unknown) and purge
    what expired by then (:mod:`materializer.ttl`); how many values were purged."""
    backend.set_ttl_time(processing_time_ms if processing_time_ms >= 0 else None)
    return backend.purge_expired()


def _backend_key(key: Any) -> Any:
    """The backend's key of a key column value (integers are keyed by their decimal string)."""
    return key if isinstance(key, (str, bytes)) else str(key)


def _fire_timers(slot: Slot, time_mode: str, times: TimerValues, outputs: OutputRows,
                 call: ProcessorCall) -> int:
    """Deliver the partition's expired timers, in timestamp order, each with its key's state in
    scope; their rows go to ``outputs``; returns how many fired."""
    handle = slot.handle
    service = handle.timer_service if handle is not None else None
    now = times.current_processing_time_ms if time_mode == "processing_time" \
        else times.current_watermark_ms
    if service is None or handle is None or now < 0:
        return 0
    fired = 0
    for timer in service.due(now):
        slot.backend.set_current_key(_backend_key(timer.key))
        if not service.consume(timer):
            continue  # a handler that ran before deleted it
        handle.set_key(timer.key)
        try:
            outputs.extend(timer.key, slot.processor.handle_expired_timer(
                timer.key, times, ExpiredTimerInfo(timer.timestamp_ms)))
        except DstlError:
            raise
        except Exception as exc:
            raise call.error(exc, "handle_expired_timer", timer.key) from exc
        finally:
            handle.clear_key()
        fired += 1
    return fired


def _process(slot: Slot, groups: RowsByKey, times: TimerValues,
             outputs: OutputRows, call: ProcessorCall) -> None:
    """Call the processor once per key, with the backend's current key set to it; its rows go
    to ``outputs``. An exception the processor raises (DSTL's own errors aside) becomes a
    :class:`~dstl.errors.ProcessorError` naming ``call`` and the key, caused by it."""
    handle, with_times = slot.handle, slot.timer_values_arg
    for key, rows in groups.items():
        slot.backend.set_current_key(_backend_key(key))
        if handle is not None:
            handle.set_key(key)
        try:
            if with_times:
                outputs.extend(key, slot.processor.handle_input_rows(key, iter(rows), times))
            else:
                outputs.extend(key, slot.processor.handle_input_rows(key, iter(rows)))  # type: ignore[call-arg]
        except DstlError:
            raise
        except Exception as exc:
            raise call.error(exc, "handle_input_rows", key) from exc
        finally:
            if handle is not None:
                handle.clear_key()


def _output_schema(cfg: OperatorConfig) -> Any:
    """The Arrow schema of the output columns (without the report column)."""
    return cfg.arrow_schema.remove(cfg.arrow_schema.get_field_index(REPORT_COLUMN))


def _output_batch(cfg: OperatorConfig, outputs: OutputRows) -> Any:
    """The output rows as a record batch (report column null), or None without rows."""
    if not len(outputs):
        return None
    return outputs.to_batch(cfg.arrow_schema, {REPORT_COLUMN: [None] * len(outputs)})


def _refs_since(backend: ChangelogKeyedStateBackend, first_sqn: int) -> list[ChangeSetRef]:
    """The change sets of the last checkpoint from ``first_sqn`` on (this batch's)."""
    delta = backend.last_delta
    return [r for r in (delta.change_sets if delta is not None else ()) if r.sqn >= first_sqn]


# --------------------------------------------------------------------------- materialization


def _materialize_if_due(slot: Slot) -> SnapshotRef | None:
    """Materialize in the task when the backend's policy says it is due (heap, or
    ``agent=False``; the task's backends are polled, they start nothing by themselves); the new
    snapshot, if any."""
    if not slot.backend.materialization.due():
        return None
    return slot.backend.materialize_now(timeout_s=_CHECKPOINT_TIMEOUT_S)


def _store_ref(cfg: OperatorConfig) -> StoreRef:
    return StoreRef(cfg.state_uri, cfg.storage_options, cfg.dstl_options)


def _install_agent_snapshot(agent: AgentClient, cfg: OperatorConfig,
                            backend: ChangelogKeyedStateBackend) -> SnapshotRef | None:
    """Install the newest snapshot the agent took of this partition, if the backend's log reaches
    it; returns it when installed.

    Raises:
        BackendFailedError: the agent's materializations of this partition failed too often.
    """
    reply = agent.call(MaterializationRequest(_store_ref(cfg), backend.operator_id),
                       _AGENT_QUICK_TIMEOUT_S)
    if reply.failed:
        raise BackendFailedError(f"backend {backend.operator_id!r} failed: the executor agent's "
                                 f"materializations of it failed more than max_failures="
                                 f"{cfg.backend_options.max_failures} times in a row (last: "
                                 f"{reply.failed}); see the agent's log, fix the cause and "
                                 "restart the query")
    if reply.snapshot is None:
        return None
    return backend.install_materialization(reply.snapshot.ref, reply.snapshot.boundary,
                                           reply.snapshot.chain)


def _register_commit(agent: AgentClient, cfg: OperatorConfig, backend: ChangelogKeyedStateBackend,
                     handle: ChangelogStateBackendHandle
                     ) -> tuple[dict[str, float], tuple[str, ...]]:
    """Tell the agent the partition's table is committed (for LMDB it schedules the partition's
    next materialization); returns the agent's metrics and last log lines."""
    spec: PartitionSpec | None = None
    if cfg.agent_materializes:
        bo = cfg.backend_options
        marker = backend.table_marker(handle)
        spec = PartitionSpec(
            backend.operator_id, backend.tables.path, backend.key_groups,
            bo.materialization_interval_s, bo.materialize_log_ratio, bo.materialize_min_log_bytes,
            bo.zstd_level, bo.max_failures, marker.boundary, marker.log_bytes,
            marker.snapshot_bytes, bo.max_snapshot_block_bytes, bo.lmdb_snapshot_format,
            bo.incremental_snapshots, bo.max_snapshot_deltas, bo.max_delta_ratio,
            bo.max_delta_entries, marker.table_id,
            handle if bo.incremental_snapshots else None)
    reply = agent.call(CommittedRequest(_store_ref(cfg), spec), _AGENT_QUICK_TIMEOUT_S)
    return reply.metrics, reply.log_tail


# --------------------------------------------------------------------------- report


def _report(partition: int, attempt: int, access: SlotAccess, run: _BatchRun, started: float,
            committed_at: float, agent_metrics: dict[str, float] | None,
            agent_log: tuple[str, ...], table: dict[str, int]) -> TaskReport:
    return TaskReport(
        partition=partition, attempt=attempt, pid=os.getpid(), handle=run.handle, slot=access,
        rows_in=run.rows_in, rows_out=run.rows_out, keys=run.keys,
        process_seconds=run.processed_at - started,
        commit_seconds=committed_at - run.processed_at,
        # the segments this task's change sets went to (shared with other tasks under the agent)
        segment_keys=tuple(sorted({r.key for r in run.new_refs})),
        log_bytes=sum(r.length for r in run.new_refs), snapshot=run.snapshot,
        agent_metrics=agent_metrics, agent_log=agent_log,
        max_event_time_ms=run.max_event_time_ms, timers_fired=run.timers_fired,
        ttl_purged=run.ttl_purged,
        state_entries=table["entries"], state_disk_bytes=table["disk_bytes"],
        state_memory_bytes=table["memory_bytes"], state_rows=table["rows"],
        internal_rows=table["internal_rows"])


def _table_stats(backend: ChangelogKeyedStateBackend) -> dict[str, int]:
    """The partition table's figures for the driver's progress record, as committed: the
    records (``entries``, O(1) on LMDB), the user's state rows among them (``rows``: without
    the LMDB layout records and DSTL's own states, whose records LMDB counts by a scan:
    O(timers and TTL index entries)), and the bytes (a fixed-size sample on the heap)."""
    tables = backend.tables
    stats: dict[str, int] = dict(tables.stats())
    internal = sum(tables.count_state(sid) for sid in backend.internal_state_ids())
    stats["internal_rows"] = internal
    stats["rows"] = stats["entries"] - tables.fixed_records() - internal
    return stats


def _record_batches(cfg: OperatorConfig, outputs: Any, report: TaskReport) -> Iterator[Any]:
    """The output rows (report column null; built and checked before the checkpoint), then
    the report row (every other column null)."""
    import pyarrow as pa

    from dstl.spark.arrow_build import to_array

    names = list(cfg.output_columns)
    if outputs is not None:
        yield outputs
    schema = cfg.arrow_schema
    yield pa.RecordBatch.from_arrays(
        [pa.nulls(1, schema.field(n).type) for n in names]
        + [to_array([report.to_json()], schema.field(REPORT_COLUMN).type)], schema=schema)
