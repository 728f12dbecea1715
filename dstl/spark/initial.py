"""The ``initial_state`` of an operator inside the user's query (``op.transform(df)``).

Theory of operation
-------------------
Spark calls ``handleInitialState`` once per key in a query's first batch. Inside the query
DSTL cannot add the initial state to that batch's plan (Spark refuses a union of a streaming and
a batch DataFrame, and a stream-static join would only reach the keys the first batch happens
to have, and scan the initial state again in every batch), and no code of DSTL runs on the
driver between micro-batches. So the initial state is **staged** in the store before the query
starts, and the first batch's state tasks read their share of it:

1. ``op.transform(df)``, on the driver, finds no checkpoint and no result of any batch: it runs
   one batch job (:func:`stage`) over the ``initial_state`` DataFrame: each row's key cast to the
   input's key type, its key group computed in the JVM as the routing does, the row packed in a
   struct; routed by partition; each task writes one Arrow object per partition it holds under
   ``query/initial/<attempt>/`` (:func:`stage_rows`). The rows never pass the driver; the driver
   then writes **the marker** ``query/initial/staged.json`` (write-once, last): the objects and
   the key groups each holds. An interrupted staging leaves objects without a marker: the next
   ``transform`` deletes them and stages again.
2. The first task of the query's first batch (its plan has no base: no checkpoint, no result)
   copies the marker's object list into the batch's plan (``query/plans/<N>``, write-once), so a
   re-run of that batch (a retried task, a driver killed before Spark's commit) reads the same
   objects. Each task reads the objects that hold key groups of its partitions
   (:func:`initial_batches`; a rescale before the first commit reads across) and gives the rows
   to ``handle_initial_state`` before the batch's timers and input: the seeding is a state
   change of that batch and follows the batch's commit protocol (:mod:`dstl.spark.query`).
3. Once a checkpoint exists, no plan has an empty base again: the staged objects are deleted
   with the protocol's objects of committed batches (:func:`forget`).

``handle_initial_state`` emits no rows (Spark's ``handleInitialState`` returns nothing).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from dstl.errors import CorruptObjectError, ObjectExistsError, ObjectNotFoundError, UsageError
from dstl.keygroups import KeyGroupRange
from dstl.spark.arrow_build import to_array
from dstl.spark.report import INITIAL_STATE_COLUMN
from dstl.stores.base import BlobStore

__all__ = ["INITIAL_PREFIX", "KEY_GROUP_COLUMN", "MARKER_KEY", "STAGED_SCHEMA", "StagedInitialState",
           "StagedObject", "attempt_prefix", "forget", "initial_batches", "not_staged",
           "read_marker", "stage_rows", "write_marker"]

INITIAL_PREFIX = "query/initial/"
#: the marker: written last by the driver once every staged object is stored
MARKER_KEY = INITIAL_PREFIX + "staged.json"
#: the key group of an initial-state row, computed in the JVM (the routing's expression)
KEY_GROUP_COLUMN = "_dstl_kg"
#: the rows a staging task yields: one per object it wrote, with the object's key groups
STAGED_SCHEMA = "object string, kg_start int, kg_end int"
#: a staged object: one partition's rows of one staging task, an Arrow IPC stream
_OBJECT_SUFFIX = ".arrow"


@dataclass(frozen=True)
class StagedObject:
    """One staged object and the key groups its rows belong to (both ends inclusive)."""

    key: str
    start: int
    end: int


@dataclass(frozen=True)
class StagedInitialState:
    """The marker: every object of one staging, with its key groups."""

    objects: tuple[StagedObject, ...]

    def to_obj(self) -> list[list[Any]]:
        return [[o.key, o.start, o.end] for o in self.objects]

    @classmethod
    def from_obj(cls, obj: Any, key: str) -> StagedInitialState:
        if not isinstance(obj, list):
            raise CorruptObjectError(key, 0, "the staged objects are not a list")
        out = []
        for item in obj:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                    and item[0].startswith(INITIAL_PREFIX) and ".." not in item[0]
                    and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                            for v in item[1:])):
                raise CorruptObjectError(key, 0, f"a staged object is {item!r}, not "
                                                 f"[key under {INITIAL_PREFIX}, start, end]")
            out.append(StagedObject(item[0], item[1], item[2]))
        return cls(tuple(out))


def attempt_prefix() -> str:
    """A fresh staging attempt's folder (never a 16-hex-digit batch name)."""
    return f"{INITIAL_PREFIX}s-{time.time_ns():020d}-{os.urandom(4).hex()}/"


def read_marker(store: BlobStore) -> StagedInitialState | None:
    """The marker of the staged initial state, if there is one.

    Raises:
        CorruptObjectError: it does not decode.
    """
    try:
        data = store.get(MARKER_KEY)
    except ObjectNotFoundError:
        return None
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptObjectError(MARKER_KEY, 0, f"not JSON: {exc}") from exc
    return StagedInitialState.from_obj(obj, MARKER_KEY)


def write_marker(store: BlobStore, staged: StagedInitialState) -> StagedInitialState:
    """Write the marker unless another driver did first; the marker that holds."""
    try:
        store.put(MARKER_KEY, json.dumps(staged.to_obj()).encode())
    except ObjectExistsError:
        held = read_marker(store)
        assert held is not None
        return held
    return staged


def forget(store: BlobStore) -> int:
    """Delete every staged object and the marker (no batch needs them once a checkpoint
    exists, nor once a staging was interrupted before its marker); how many."""
    doomed = [info.key for info in store.list(INITIAL_PREFIX)]
    # the marker last: a staging is never seen half deleted
    doomed.sort(key=lambda k: k == MARKER_KEY)
    store.delete(doomed)
    return len(doomed)


def stage_rows(store: BlobStore, prefix: str, batches: Iterable[Any], max_parallelism: int,
               partitions: int) -> Iterator[Any]:
    """The body of one staging task: its rows (key, ``INITIAL_STATE_COLUMN``,
    ``KEY_GROUP_COLUMN``) grouped by partition, one object per partition under ``prefix``;
    yields one row per object written (its key and key groups)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    by_partition: dict[int, list[Any]] = {}
    for batch in batches:
        if not batch.num_rows:
            continue
        kg = batch.column(KEY_GROUP_COLUMN)
        pids = pc.divide(pc.multiply(kg.cast(pa.int64()), partitions), max_parallelism)
        for pid in pc.unique(pids).to_pylist():
            by_partition.setdefault(int(pid), []).append(batch.filter(pc.equal(pids, pid)))
    keys, starts, ends = [], [], []
    for pid, parts in sorted(by_partition.items()):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, parts[0].schema) as writer:
            for part in parts:
                writer.write_batch(part)
        key = f"{prefix}p{pid:05d}-{time.time_ns():020d}-{os.urandom(4).hex()}{_OBJECT_SUFFIX}"
        store.put(key, sink.getvalue().to_pybytes())
        groups = KeyGroupRange.of_operator(max_parallelism, partitions, pid)
        keys.append(key)
        starts.append(groups.start)
        ends.append(groups.end)
    if keys:
        yield pa.RecordBatch.from_arrays([to_array(keys, pa.string()),
                                          to_array(starts, pa.int32()),
                                          to_array(ends, pa.int32())],
                                         names=["object", "kg_start", "kg_end"])


def initial_batches(store: BlobStore, staged: StagedInitialState, key_column: str,
                    owned: dict[int, KeyGroupRange]) -> Iterator[Any]:
    """The staged rows of the partitions ``owned`` (partition -> its key groups), as record
    batches of the key, ``INITIAL_STATE_COLUMN`` and the partition (``_dstl_pid``) that the
    state tasks read as they read routed input.

    Raises:
        CorruptObjectError: a staged object does not decode or lacks a column.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    for obj in staged.objects:
        pids = [pid for pid, groups in sorted(owned.items())
                if not (obj.end < groups.start or obj.start > groups.end)]
        if not pids:
            continue
        data = store.get(obj.key)
        try:
            table = pa.ipc.open_stream(data).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            raise CorruptObjectError(obj.key, 0, f"not an Arrow stream: {exc}") from exc
        missing = {key_column, INITIAL_STATE_COLUMN, KEY_GROUP_COLUMN} - set(table.column_names)
        if missing:
            raise CorruptObjectError(obj.key, 0, f"columns {sorted(missing)} missing")
        kg = table.column(KEY_GROUP_COLUMN)
        for pid in pids:
            groups = owned[pid]
            mine = table.filter(pc.and_(pc.greater_equal(kg, groups.start),
                                        pc.less_equal(kg, groups.end)))
            if not mine.num_rows:
                continue
            out = mine.select([key_column, INITIAL_STATE_COLUMN]).append_column(
                "_dstl_pid", to_array([pid] * mine.num_rows, pa.int32()))
            yield from out.to_batches()


def not_staged(operator: str, batch: int, location: str) -> UsageError:
    """The error of a first batch whose operator has an initial state that was never staged."""
    return UsageError(f"operator {operator!r}, batch {batch}: the operator has an initial_state "
                      f"but none is staged in {location}; op.transform(df) stages it before the "
                      "query starts: build the query with op.transform (or df.transform(op)) "
                      "in this driver")
