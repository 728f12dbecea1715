"""The operator inside the user's query: the commit protocol of ``op.transform(df)``.

Theory of operation
-------------------
``op.transform(df)`` returns a streaming DataFrame: the rows routed by key group in the JVM, the
state tasks in ``mapInArrow``, the processor's rows out. No code of DSTL runs on the driver
between Spark's micro-batches, so the tasks agree on a batch's input through the store, with
write-once objects under ``query/`` (``put`` of an existing key fails: the first writer wins and
everyone reads what it wrote):

- ``query/plans/<N>`` — **the plan of batch N**: its base (the batch whose state it starts
  from and that batch's per-partition handles), the retained checkpoint ids, its processing
  time and its watermark. Written by the first task of batch N to need it; a task of a batch
  that Spark runs again reads the same plan, so a re-run starts from the same base at the same
  times.
- ``query/results/<N>/p<partition>-<nonce>`` — **a result**: the report of one task attempt
  that committed its partition of batch N (:class:`~dstl.spark.report.TaskReport`, with the
  backend handle), written once its log is durable and before its first output row leaves.
- ``query/choices/<N>`` — **the choice for batch N**: one result per partition. Written by the
  first of the driver (when Spark reports batch N done) and the tasks of a later batch (when
  they plan): either is proof that Spark committed batch N, since Spark reports a batch after
  its commit log entry and starts batch N+1 only after committing N.
- ``query/initial/`` — the operator's ``initial_state``, staged by ``op.transform`` before
  the query's first batch, and named in that batch's plan (:mod:`dstl.spark.initial`).
- ``checkpoints/<N>-<attempt>.manifest`` — DSTL's checkpoint, written by the driver's
  :class:`~dstl.checkpoint.CheckpointCoordinator` from the choice (never by a task), with the
  watermark after N and N's processing time as properties; the reader and the CLI see it.

The base of batch N is the newest of: a batch below N with results or a choice, and a
checkpoint below N. Every state change of batch N is in results of N only, and a result is
chosen only once N is committed: a batch Spark re-runs (its sink did not commit) contributes
nothing until it commits, and then one attempt per partition (Spark's own stateful operators
rely on the same rule: a re-run of a batch computes what the first run did, given the same
input, base and times). A driver killed after Spark's commit and before the manifest leaves
the results behind; the next batch's tasks choose them and the next driver writes the manifest
(:func:`pending_choices`). The full protocol, its states and what each crash leaves: docs/spark.md
("Inside the query").
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from dstl.checkpoint.manifest import Manifest, decode_manifest
from dstl.errors import CorruptObjectError, ObjectExistsError, ObjectNotFoundError, UsageError
from dstl.layout import MANIFEST_PREFIX, parse_manifest_key
from dstl.spark.arrow_build import int64_list_row
from dstl.spark.initial import (
    INITIAL_PREFIX,
    StagedInitialState,
    initial_batches,
    not_staged,
    read_marker,
)
from dstl.spark.initial import MARKER_KEY as INITIAL_MARKER_KEY
from dstl.spark.report import TaskReport, TaskReportError
from dstl.spark.timing import next_watermark
from dstl.stores.base import BlobStore

__all__ = ["QUERY_PREFIX", "BatchPlan", "Choice", "batch_id_of_task", "choose", "forget_before",
           "pending_choices", "plan_batch", "plan_of", "run_in_query", "state_of_another_query",
           "write_result"]

T = TypeVar("T")

QUERY_PREFIX = "query/"
_PLANS = QUERY_PREFIX + "plans/"
_RESULTS = QUERY_PREFIX + "results/"
_CHOICES = QUERY_PREFIX + "choices/"
#: the local property Spark sets on every job of a streaming micro-batch
BATCH_ID_PROPERTY = "streaming.sql.batchId"
#: and the query's id (kept across restarts of the query)
QUERY_ID_PROPERTY = "sql.streaming.queryId"
#: the manifest properties of a batch's watermark after it and its processing time (written by
#: the operator, read back by a re-run and a restart)
WATERMARK_PROPERTY = "watermark_ms"
PROCESSING_TIME_PROPERTY = "processing_time_ms"
#: the largest object of the protocol read back (a plan or choice of many partitions)
_MAX_OBJECT_BYTES = 64 << 20


def _batch_key(prefix: str, batch: int) -> str:
    return f"{prefix}{batch:016x}"


def plan_key(batch: int) -> str:
    return _batch_key(_PLANS, batch) + ".json"


def choice_key(batch: int) -> str:
    return _batch_key(_CHOICES, batch) + ".json"


def results_prefix(batch: int) -> str:
    return _batch_key(_RESULTS, batch) + "/"


@dataclass(frozen=True)
class BatchPlan:
    """What every task of batch ``batch`` starts from (``query/plans/<batch>``)."""

    batch: int
    base: int  # the batch whose state it starts from (-1: empty state)
    handles: dict[int, str]  # partition -> backend handle (JSON) of the base
    retained: tuple[int, ...]
    processing_time_ms: int
    watermark_ms: int
    query_id: str = ""  # Spark's id of the query whose task wrote the plan
    #: the staged initial state the batch applies (only a first batch: no base), or None
    initial: StagedInitialState | None = None

    def to_json(self) -> bytes:
        obj: dict[str, Any] = {"batch": self.batch, "base": self.base,
                               "query_id": self.query_id,
                               "handles": {str(p): h for p, h in self.handles.items()},
                               "retained": list(self.retained),
                               "processing_time_ms": self.processing_time_ms,
                               "watermark_ms": self.watermark_ms}
        if self.initial is not None:
            obj["initial"] = self.initial.to_obj()
        return json.dumps(obj).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str) -> BatchPlan:
        obj = _json_object(data, key)
        initial = obj.get("initial")
        return cls(batch=_int(obj, "batch", key), base=_int(obj, "base", key, lo=-1),
                   handles=_handles(obj, key), retained=_ints(obj, "retained", key),
                   processing_time_ms=_int(obj, "processing_time_ms", key, lo=-1),
                   watermark_ms=_int(obj, "watermark_ms", key, lo=-1),
                   query_id=str(obj.get("query_id", "")),
                   initial=(None if initial is None
                            else StagedInitialState.from_obj(initial, key)))


@dataclass(frozen=True)
class Choice:
    """The committed result of batch ``batch``: one report per partition
    (``query/choices/<batch>``), and the times after it."""

    batch: int
    partitions: int
    reports: tuple[str, ...]  # TaskReport JSON, one per partition, in partition order
    processing_time_ms: int  # the batch's own
    watermark_ms: int  # the watermark after the batch (-1: none)

    def decoded(self) -> list[TaskReport]:
        return [TaskReport.from_json(r) for r in self.reports]

    def handles(self) -> dict[int, str]:
        return {r.partition: json.dumps(r.handle.to_json_obj()) for r in self.decoded()}

    def to_json(self) -> bytes:
        return json.dumps({"batch": self.batch, "partitions": self.partitions,
                           "reports": list(self.reports),
                           "processing_time_ms": self.processing_time_ms,
                           "watermark_ms": self.watermark_ms}).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str) -> Choice:
        obj = _json_object(data, key)
        reports = obj.get("reports")
        if not isinstance(reports, list) or not all(isinstance(r, str) for r in reports):
            raise CorruptObjectError(key, 0, "reports is not a list of strings")
        c = cls(batch=_int(obj, "batch", key), partitions=_int(obj, "partitions", key, lo=1),
                reports=tuple(reports),
                processing_time_ms=_int(obj, "processing_time_ms", key, lo=-1),
                watermark_ms=_int(obj, "watermark_ms", key, lo=-1))
        try:
            parts = sorted(r.partition for r in c.decoded())
        except TaskReportError as exc:
            raise CorruptObjectError(key, 0, f"a report does not decode: {exc}") from exc
        if parts != list(range(c.partitions)):
            raise CorruptObjectError(key, 0, f"reports of partitions {parts}, not one per "
                                             f"partition 0..{c.partitions - 1}")
        return c


def batch_id_of_task() -> tuple[int, str]:
    """The micro-batch and query id of the running Spark task (Spark's local properties).

    Raises:
        UsageError: the task is not part of a streaming micro-batch.
    """
    from pyspark import TaskContext

    ctx = TaskContext.get()
    raw = ctx.getLocalProperty(BATCH_ID_PROPERTY) if ctx is not None else None
    if ctx is None or raw is None:
        raise UsageError("op.transform(df) ran outside a streaming query (the task has no "
                         f"{BATCH_ID_PROPERTY!r} property): start it with writeStream, or "
                         "for a batch DataFrame call op.foreach_batch(df, batch_id)")
    return int(raw), ctx.getLocalProperty(QUERY_ID_PROPERTY) or ""


def state_of_another_query(batch: int, location: str, checkpoints: Iterable[int]
                           ) -> UsageError:
    """The error for a batch that comes at or before every checkpoint of its ``state_uri``: the
    state was not written by this query's history (another query's, or this query's before its
    Spark checkpoint was deleted), and continuing would read or overwrite it."""
    ids = sorted(checkpoints)
    shown = (", ".join(map(str, ids)) if len(ids) <= 6
             else f"{ids[0]}..{ids[-1]}, {len(ids)} checkpoints")
    return UsageError(
        f"batch {batch} cannot continue the state in {location}: every checkpoint there "
        f"({shown}) is at or after batch {batch}, so another query wrote it, or this query "
        "before its checkpointLocation was deleted or replaced; give this query a state_uri of "
        "its own, or restart it with the checkpointLocation that wrote this state")


def plan_batch(store: BlobStore, batch: int, partitions: int, *, delay_ms: int,
               event_time: bool, now_ms: int, query_id: str = "", operator: str = "",
               with_initial: bool = False) -> BatchPlan:
    """The plan of ``batch``: the stored one, else one made now and stored (first writer
    wins; see the module docstring). With ``with_initial`` (the operator has an
    ``initial_state``), a plan without a base takes the staged initial state
    (:mod:`dstl.spark.initial`).

    Raises:
        UsageError: every checkpoint of the store is at or after ``batch`` (the state belongs
            to another query), the newest batch ran only some partitions, or the operator has
            an initial state that is not staged.
    """
    stored = _read(store, plan_key(batch), BatchPlan.from_json)
    if stored is not None:
        return stored
    manifests = _manifest_ids(store)
    pending = [b for b in _pending_batches(store) if b < batch]
    below = [m for m in manifests if m < batch]
    base_time, base_wm = -1, (0 if event_time else -1)
    handles: dict[int, str] = {}
    base = -1
    if pending and (not below or max(pending) > max(below)):
        base = max(pending)
        choice = choose(store, base, partitions, delay_ms=delay_ms, event_time=event_time)
        assert choice is not None  # a pending batch has results or a choice
        handles, base_time, base_wm = choice.handles(), choice.processing_time_ms, \
            choice.watermark_ms
    elif below:
        base = max(below)
        m = _manifest(store, base)
        handles = {int(t.task_id[1:]): json.dumps(t.state) for t in m.tasks}
        base_time = _int_property(m, PROCESSING_TIME_PROPERTY, -1)
        if event_time:
            base_wm = _int_property(m, WATERMARK_PROPERTY, 0)
    elif manifests:
        raise state_of_another_query(batch, store.location, manifests)
    initial = None
    if with_initial and base < 0:
        initial = read_marker(store)
        if initial is None:
            raise not_staged(operator, batch, store.location)
    plan = BatchPlan(batch=batch, base=base, handles=handles,
                     retained=tuple(sorted(set(manifests) | ({base} if base >= 0 else set()))),
                     processing_time_ms=max(now_ms, base_time), watermark_ms=base_wm,
                     query_id=query_id, initial=initial)
    return _write_once(store, plan_key(batch), plan.to_json(), BatchPlan.from_json)


def choose(store: BlobStore, batch: int, partitions: int, *, delay_ms: int,
           event_time: bool) -> Choice | None:
    """The choice for ``batch`` (stored, else made from its results and stored); ``None``:
    no task of ``batch`` committed anything. Call only once Spark committed ``batch``.

    Raises:
        UsageError: results exist for some partitions only.
    """
    stored = _read(store, choice_key(batch), Choice.from_json)
    if stored is not None:
        return stored
    by_count: dict[int, dict[int, tuple[str, str]]] = {}
    for info in store.list(results_prefix(batch)):
        data = _get(store, info.key)
        obj = _json_object(data, info.key)
        count = _int(obj, "partitions", info.key, lo=1)
        text = obj.get("report")
        if not isinstance(text, str):
            raise CorruptObjectError(info.key, 0, "report is not a string")
        try:
            report = TaskReport.from_json(text)
        except TaskReportError as exc:
            raise CorruptObjectError(info.key, 0, f"the report does not decode: {exc}") from exc
        # per partition the first result by name: any committed attempt holds the same state
        by_count.setdefault(count, {}).setdefault(report.partition, (info.key, text))
    if not by_count:
        return None
    complete = [c for c, parts in by_count.items() if len(parts) == c]
    if not complete:
        c, parts = max(by_count.items())
        raise UsageError(f"batch {batch} of the state in {store.location} ran partitions "
                         f"{sorted(parts)} of {c} only: the query's sink must read the whole "
                         "DataFrame that op.transform returns (no limit or sample over it)")
    count = partitions if partitions in complete else max(complete)
    reports = tuple(text for _, (_, text) in sorted(by_count[count].items()))
    plan = _read(store, plan_key(batch), BatchPlan.from_json)
    if plan is None:
        raise CorruptObjectError(plan_key(batch), 0, f"batch {batch} has results but no plan")
    decoded = [TaskReport.from_json(r) for r in reports]
    seen = [r.max_event_time_ms for r in decoded if r.max_event_time_ms is not None]
    wm = (next_watermark(plan.watermark_ms, max(seen) if seen else None, delay_ms)
          if event_time else -1)
    choice = Choice(batch=batch, partitions=count, reports=reports,
                    processing_time_ms=plan.processing_time_ms, watermark_ms=wm)
    return _write_once(store, choice_key(batch), choice.to_json(), Choice.from_json)


def write_result(store: BlobStore, batch: int, partitions: int, report: TaskReport) -> None:
    """Store one task attempt's result of ``batch`` (a name of its own: never overwritten)."""
    key = (f"{results_prefix(batch)}p{report.partition:05d}-{time.time_ns():020d}-"
           f"{os.urandom(6).hex()}.json")
    store.put(key, json.dumps({"partitions": partitions,
                               "report": report.to_json()}).encode())


def check_same_query(plan: BatchPlan, query_id: str, operator: str, location: str) -> None:
    """Refuse a plan another streaming query wrote (Spark's query id persists across restarts).

    Raises:
        UsageError: two queries write to one state.
    """
    if plan.query_id and query_id and plan.query_id != query_id:
        raise UsageError(f"operator {operator!r}, batch {plan.batch}: another streaming query "
                         f"(id {plan.query_id}) writes to the state in {location}; each query "
                         "needs a state_uri of its own")


def plan_of(store: BlobStore, batch: int) -> BatchPlan | None:
    """The stored plan of ``batch``, if any."""
    return _read(store, plan_key(batch), BatchPlan.from_json)


def pending_choices(store: BlobStore, after: int) -> list[int]:
    """Batches above checkpoint ``after`` whose choice is stored (Spark committed them), in
    order: the driver writes their manifests."""
    return sorted(b for b in _ids(store, _CHOICES) if b > after)


def forget_before(store: BlobStore, batch: int) -> int:
    """Delete the protocol's objects of batches below ``batch`` (their checkpoints are
    written) and the staged initial state (a checkpoint exists: no batch starts without a
    base again); how many."""
    doomed = [info.key for info in store.list(QUERY_PREFIX)
              if ((b := _batch_of(info.key)) is not None and b < batch)
              or info.key.startswith(INITIAL_PREFIX)]
    # the staged initial state's marker last: a staging is never seen half deleted
    doomed.sort(key=lambda k: k == INITIAL_MARKER_KEY)
    store.delete(doomed)
    return len(doomed)


def has_batches(store: BlobStore) -> bool:
    """Whether a batch is committed (it has a choice or a checkpoint): the query's state exists
    and an initial state is not applied again. Results alone are not: their batch may be run
    again by Spark, from its plan, which may name the staged initial state."""
    return bool(_manifest_ids(store)) or bool(_ids(store, _CHOICES))


# ---------------------------------------------------------------------------- store access


def _get(store: BlobStore, key: str) -> bytes:
    info = store.head(key)
    if info is not None and info.size > _MAX_OBJECT_BYTES:
        raise CorruptObjectError(key, 0, f"{info.size} bytes, more than {_MAX_OBJECT_BYTES}")
    return store.get(key)


def _read(store: BlobStore, key: str, decode: Callable[[bytes, str], T]) -> T | None:
    """The decoded object, ``None`` if there is none (one request: a ranged read one byte
    past the largest size accepted)."""
    try:
        data = store.get_range(key, 0, _MAX_OBJECT_BYTES + 1)
    except ObjectNotFoundError:
        return None
    if len(data) > _MAX_OBJECT_BYTES:
        raise CorruptObjectError(key, 0, f"more than {_MAX_OBJECT_BYTES} bytes")
    return decode(data, key)


def _write_once(store: BlobStore, key: str, data: bytes, decode: Callable[[bytes, str], T]
                ) -> T:
    """Store ``data`` under ``key`` unless another writer did first; what is stored."""
    try:
        store.put(key, data)
    except ObjectExistsError:
        pass  # another task won: what it wrote holds
    else:
        return decode(data, key)
    return decode(_get(store, key), key)


def _batch_of(key: str) -> int | None:
    """The batch a protocol object belongs to (from its 16-hex-digit name)."""
    rest = key[len(QUERY_PREFIX):]
    part = rest.split("/", 2)
    if len(part) < 2:
        return None
    head = part[1][:16]
    try:
        return int(head, 16) if len(head) == 16 else None
    except ValueError:
        return None


def _ids(store: BlobStore, prefix: str) -> set[int]:
    out = set()
    for info in store.list(prefix):
        b = _batch_of(info.key)
        if b is not None:
            out.add(b)
    return out


def _pending_batches(store: BlobStore) -> set[int]:
    return _ids(store, _RESULTS) | _ids(store, _CHOICES)


def _manifest_ids(store: BlobStore) -> list[int]:
    ids = set()
    for info in store.list(MANIFEST_PREFIX):
        parsed = parse_manifest_key(info.key)
        if parsed is not None:
            ids.add(parsed[0])
    return sorted(ids)


def _manifest(store: BlobStore, checkpoint_id: int) -> Manifest:
    """The newest attempt of checkpoint ``checkpoint_id``."""
    keys = [info.key for info in store.list(MANIFEST_PREFIX)
            if (p := parse_manifest_key(info.key)) is not None and p[0] == checkpoint_id]
    key = max(keys, key=lambda k: parse_manifest_key(k) or (0, 0))
    return decode_manifest(_get(store, key), key)


def _int_property(m: Manifest, name: str, default: int) -> int:
    v = m.properties.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise CorruptObjectError(m.key, 0, f"properties.{name} is {v!r}, not an integer")
    return v


def _json_object(data: bytes, key: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptObjectError(key, 0, f"not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise CorruptObjectError(key, 0, "not a JSON object")
    return obj


def _int(obj: dict[str, Any], name: str, key: str, lo: int = 0) -> int:
    v = obj.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise CorruptObjectError(key, 0, f"{name} is {v!r}, not an integer >= {lo}")
    return v


def _ints(obj: dict[str, Any], name: str, key: str) -> tuple[int, ...]:
    v = obj.get(name)
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                          for i in v):
        raise CorruptObjectError(key, 0, f"{name} is not a list of integers")
    return tuple(v)


def _handles(obj: dict[str, Any], key: str) -> dict[int, str]:
    v = obj.get("handles")
    if not isinstance(v, dict) or not all(isinstance(p, str) and p.isdigit()
                                          and isinstance(h, str) for p, h in v.items()):
        raise CorruptObjectError(key, 0, "handles is not an object of partition -> handle")
    return {int(p): h for p, h in v.items()}


#: The per-batch figures each state task adds to its query's observed metrics (Spark's
#: ``Dataset.observe``): name -> (aggregate, what it is). They reach ``query.lastProgress[
#: "observedMetrics"]["dstl.<operator>"]`` and every ``StreamingQueryListener``.
METRICS: dict[str, tuple[str, str]] = {
    "numInputRows": ("sum", "rows the state tasks received, late rows included"),
    "numLateRows": ("sum", "rows at or below the watermark (kept from the processor; with "
                           "late_rows='side_output' in the output's late column)"),
    "numOutputRows": ("sum", "rows the processor emitted"),
    "numUpdatedKeys": ("sum", "keys the processor was called for"),
    "numRowsTotal": ("sum", "rows of the user's states after the batch (as Spark's "
                            "numRowsTotal; DSTL's own timer and TTL index rows not included)"),
    "numStateEntries": ("sum", "records of the partitions' tables after the batch (DSTL's own "
                               "states and LMDB's layout records included)"),
    "stateDiskBytes": ("sum", "bytes of the partitions' tables on disk"),
    "numRestores": ("sum", "partitions restored from the store (moved, replaced, rescaled)"),
    "restoreMs": ("max", "the slowest restore"),
    "commitMs": ("max", "the slowest partition's wait for its log to be durable"),
    "bytesWritten": ("sum", "log and snapshot bytes the batch wrote to the store"),
    "numSegments": ("sum", "segment objects the partitions' changes went to"),
    "numMaterializations": ("sum", "snapshots installed"),
    "numTimersFired": ("sum", "timers delivered to handle_expired_timer"),
    "numTtlPurged": ("sum", "values expired by TTL"),
}
#: the one column of the metrics rows: a list of int64, the :data:`METRICS` in their order (null
#: on output rows, where it costs a validity bit and a list offset, not a column per metric)
METRICS_COLUMN = "_dstl_metrics"


def _metric_values(report: TaskReport, received: int, late: int) -> dict[str, int]:
    return {"numInputRows": received, "numLateRows": late, "numOutputRows": report.rows_out,
            "numUpdatedKeys": report.keys, "numRowsTotal": report.state_rows,
            "numStateEntries": report.state_entries,
            "stateDiskBytes": report.state_disk_bytes,
            "numRestores": int(report.slot.access in ("restore", "rescale")),
            "restoreMs": int(report.slot.restore_seconds * 1000),
            "commitMs": int(report.commit_seconds * 1000),
            "bytesWritten": report.log_bytes + report.snapshot_bytes,
            "numSegments": len(report.segment_keys),
            "numMaterializations": int(report.snapshot is not None),
            "numTimersFired": report.timers_fired, "numTtlPurged": report.ttl_purged}


def run_in_query(cfg: Any, tasks: int, delay_ms: int, event_time: bool, driver_version: str,
                 batches: Iterator[Any], late_field: Any = None,
                 with_initial: bool = False) -> Iterator[Any]:
    """The body of one state task inside the user's query (``op.transform``): plan the batch
    (:func:`plan_batch`), run and commit its partitions as a ``foreach_batch`` task does
    (:func:`dstl.spark.task.run_group`) — a first batch with the staged initial state
    (``with_initial``: :mod:`dstl.spark.initial`) — store each partition's result, then yield
    its output rows (the metric columns null) and one metrics row (the output columns null).
    With ``late_field`` (an Arrow field of a struct of the input's columns:
    ``late_rows="side_output"``) the rows at or below the watermark follow, each in that struct
    column (the output columns null)."""
    import pyarrow as pa

    from dstl.spark.config import TaskInput
    from dstl.spark.runtime import runtime_for
    from dstl.spark.task import check_version, committed_reports, drop_late, run_group
    from dstl.spark.timing import EVENT_TIME_COLUMN

    check_version(driver_version)
    batch, query_id = batch_id_of_task()
    store = runtime_for(cfg).storage.store
    plan = plan_batch(store, batch, cfg.partitions, delay_ms=delay_ms, event_time=event_time,
                      now_ms=int(time.time() * 1000), query_id=query_id, operator=cfg.name,
                      with_initial=with_initial)
    check_same_query(plan, query_id, cfg.name, store.location)
    task_input = TaskInput(batch_id=batch, base_checkpoint=plan.base,
                           base_handles=plan.handles, retained=plan.retained,
                           processing_time_ms=plan.processing_time_ms,
                           watermark_ms=plan.watermark_ms, driver_version=driver_version)
    counts = {"received": 0, "late": 0}
    late_type = late_field.type if late_field is not None else None
    late: list[Any] | None = [] if late_field is not None else None
    rows: Iterator[Any] = drop_late(iter(batches), EVENT_TIME_COLUMN if event_time else None,
                                    plan.watermark_ms, counts, late)
    task = _task_partition()
    if plan.initial is not None:
        mine = [task] if tasks == cfg.partitions else list(range(task, cfg.partitions, tasks))
        seeds = initial_batches(store, plan.initial, cfg.key_column,
                                {p: cfg.key_groups(p) for p in mine})
        rows = itertools.chain(seeds, rows)
    rt, attempt, done = run_group(cfg, task_input, rows, tasks, task)
    names = list(cfg.output_columns)
    late_fields = [late_field] if late_field is not None else []
    metrics_type = pa.list_(pa.int64())
    schema = pa.schema([*[cfg.arrow_schema.field(n) for n in names], *late_fields,
                        pa.field(METRICS_COLUMN, metrics_type)])
    no_late = [pa.nulls(1, late_type)] if late_type is not None else []
    for i, (outputs, report) in enumerate(committed_reports(rt, cfg, attempt, done)):
        write_result(store, batch, cfg.partitions, report)
        if outputs is not None and outputs.num_rows:
            n = outputs.num_rows
            yield pa.RecordBatch.from_arrays(
                [outputs.column(c) for c in names]
                + ([pa.nulls(n, late_type)] if late_type is not None else [])
                + [pa.nulls(n, metrics_type)], schema=schema)
        # the task's rows received and dropped late are counted once, with its first partition
        values = _metric_values(report, counts["received"] if i == 0 else 0,
                                counts["late"] if i == 0 else 0)
        yield pa.RecordBatch.from_arrays(
            [pa.nulls(1, schema.field(c).type) for c in names] + no_late
            + [int64_list_row([values[m] for m in METRICS])], schema=schema)
    for part in late or ():
        # after every result is stored, as the output rows: they leave with the batch's commit
        n = part.num_rows
        yield pa.RecordBatch.from_arrays(
            [pa.nulls(n, schema.field(c).type) for c in names]
            + [late_struct(part, late_type)] + [pa.nulls(n, metrics_type)], schema=schema)


def late_struct(batch: Any, late_type: Any) -> Any:
    """The rows of ``batch`` (input columns and DSTL's own) as ``late_type``, a struct of the
    input's columns (each cast to the type Spark expects back: e.g. timestamps as UTC)."""
    import pyarrow as pa

    arrays = [batch.column(f.name).cast(f.type) for f in late_type]
    return pa.StructArray.from_arrays(arrays, fields=list(late_type))


def _task_partition() -> int:
    """The running Spark task's partition id (0 outside Spark)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return ctx.partitionId() if ctx is not None else 0
