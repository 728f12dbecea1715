"""DSTL state as Spark tables: ``spark.read.format("dstl")`` (a checkpoint's state, or with
``readChangeFeed`` the changes between two checkpoints) and ``spark.readStream.format(
"dstl_changes")`` (the change feed as a stream), on PySpark's Python Data Source API.

Theory of operation
-------------------
Both sources are thin: planning and reading are :mod:`dstl.reader`'s. Spark's shapes map onto
it the way FLIP-27 (seed 003) maps a source onto an enumerator and split readers:

- the **driver** plans — ``DataSourceReader.partitions()`` turns a checkpoint into state splits
  (one per backend handle, or per ``keyGroupsPerSplit`` slice of one; a pushed-down filter on
  ``key``/``key_bytes``/``key_group`` keeps only the key groups that can match);
  ``DataSourceStreamReader.latestOffset`` discovers new manifests and ``partitions(start, end)``
  turns the checkpoints in ``(start, end]`` into change splits, one per checkpoint and writer
  with new change sets — after a rescale the new writers simply appear as new splits;
- the **executors** read — ``read(partition)`` restores a state split read-only, or fetches a
  change split's change sets with ranged reads, and yields Arrow record batches
  (:mod:`dstl.reader.arrow`);
- the **position** is the checkpoint id (``{"checkpoint": id}``, ``-1`` = the empty state),
  which Spark's offset log checkpoints and commits. A restarted query re-plans exactly the range
  it had logged, and planning depends on the manifests alone, so every change is delivered once
  — as long as the range is still retained: a consumer that falls behind the job's retention
  gets :class:`~dstl.reader.ChangesLostError` naming the lost checkpoints
  (``onLostChanges=resumeFromOldest`` continues after the oldest retained one instead).

*Imports.* Spark plans a read in Python workers on the driver — one for ``load()`` (the source
and its schema), one for ``partitions()`` — and a new worker imports this module again when it
unpickles the source. What only a split's read needs (pyarrow, numpy, the column-wise reader,
the restore cache) is imported by the code that reads, on the executors: the driver's workers
import the options' checks, the catalog and the planner (``bench/state_reader_fixed.py``).

*Registration.* PySpark finds both sources in every session by itself, through the packages
:mod:`pyspark_dstl` and :mod:`pyspark_dstl_changes`, which import this module on first use.
:func:`dstl.spark.register` (``spark.dataSource.register`` of both classes) registers them in
one session and turns Spark's filter pushdown on; without that conf Spark refuses a reader that
implements ``pushFilters``, so the reader made where Spark pushes no filters has none
(:func:`_batch_reader`). :class:`~dstl.spark.DstlStatefulOperator` registers them when it
starts.

*DSTL's own states* (``$timers``, named with
:data:`~dstl.spark.processor.RESERVED_STATE_PREFIX`) are left out of both sources' rows unless
``internalStates`` is on; a backend's raw indexes are never shown (:mod:`dstl.reader`). Options
are listed in docs/spark.md ("Reading state").
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import TYPE_CHECKING, Any, Final

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, SupportsTriggerAvailableNow

from dstl.checks import check_mapping, check_str
from dstl.errors import ConfigError, DstlError, UsageError
from dstl.keygroups import MAX_PARALLELISM_LIMIT, key_group_for
from dstl.reader.checks import (
    TABLES,
    check_source_keys,
    source_bool,
    source_choice,
    source_int,
)
from dstl.reader.rows import CHANGE_DDL, STATE_DDL
from dstl.spark.processor import RESERVED_STATE_PREFIX
from dstl.stores import check_store_uri, parse_storage_options

if TYPE_CHECKING:
    from dstl.reader import ChangeSplit, CheckpointCatalog, StateSplit
    from restore.cache import LocalFileCache

__all__ = ["DstlChangesDataSource", "DstlStateDataSource", "SourceOptions"]

logger = logging.getLogger(__name__)

_TYPED_COLUMN = "typed_value"

#: Columns a row may leave null (a key that is not UTF-8 text, the default namespace, a state
#: that is no map, a change without a value): a user-specified schema may not declare them NOT NULL
_MAY_BE_NULL = frozenset({"key", "namespace", "user_key", "value", _TYPED_COLUMN})

#: Rows per Arrow batch handed to Spark (the row path's size too): the JVM turns 16 k-row batches
#: into rows with less CPU than 64 k or larger ones (bench: the floor source at 4 M rows)
_BATCH_ROWS = 16384


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class SourceOptions:
    """The options of both sources, validated on the driver (picklable: shipped to executors).

    See docs/spark.md for each option's meaning.
    """

    state_uri: str
    storage_options: dict[str, Any] | None
    operator: str | None
    checkpoint: int | None
    change_feed: bool
    start: int | None
    end: int | None
    key_groups_per_split: int | None
    table: str
    allow_pickle: bool
    cache: str
    value_type: str | None
    states: tuple[str, ...] | None
    internal_states: bool
    on_lost: str
    starting: str
    max_checkpoints_per_trigger: int | None

    @classmethod
    def parse(cls, options: Mapping[str, str], *, source: str = "dstl",
              stream: bool | None = None) -> SourceOptions:
        """Validate Spark's options (keys are case-insensitive) with :mod:`dstl.reader.checks`'
        rules: every option named, every value typed and in range, none the mode ignores.

        Args:
            options: Spark's options (``path`` is ``load``'s argument).
            source: ``"dstl"`` or ``"dstl_changes"`` (always a change feed).
            stream: a ``readStream``; ``None`` while Spark only asks for the schema.

        Raises:
            ConfigError: a missing path, an unknown option, one the mode ignores, or a
                malformed value (named, with what is expected).
        """
        o = {str(k).lower(): v for k, v in options.items()}
        owner = f"{source} source"
        feed = source == "dstl_changes" or source_bool(o, "readchangefeed", "readChangeFeed",
                                                       owner, False)
        if source == "dstl_changes" and not source_bool(o, "readchangefeed", "readChangeFeed",
                                                        owner, True):
            raise ConfigError("readChangeFeed", o["readchangefeed"], "true (or absent)",
                              owner=owner, fix="dstl_changes is the change feed; "
                                               "spark.read.format('dstl') reads state")
        check_source_keys(o, owner, stream=stream, change_feed=feed)
        internal = source_bool(o, "internalstates", "internalStates", owner, False)
        storage = _storage_options(o)
        path = o.get("path")
        if not path:
            raise ConfigError("path", path, "the job's state_uri: .load(state_uri)", owner=owner)
        start = source_int(o, "startcheckpoint", "startCheckpoint", owner, lo=-1)
        end = source_int(o, "endcheckpoint", "endCheckpoint", owner, lo=0)
        if start is not None and end is not None and start > end:
            raise ConfigError("startCheckpoint", start, f"at most endCheckpoint ({end})",
                              owner=owner, fix="the feed is (startCheckpoint, endCheckpoint]")
        return cls(
            state_uri=check_store_uri(path, storage, owner=owner, field="path"),
            storage_options=storage, operator=_name(o, "operator", owner),
            checkpoint=source_int(o, "checkpoint", "checkpoint", owner, lo=0),
            change_feed=feed, start=start, end=end,
            key_groups_per_split=source_int(o, "keygroupspersplit", "keyGroupsPerSplit", owner,
                                            lo=1, hi=MAX_PARALLELISM_LIMIT),
            table=source_choice(o, "table", "table", owner, TABLES),
            allow_pickle=source_bool(o, "allowpickle", "allowPickle", owner, False),
            cache=source_choice(o, "cache", "cache", owner, ("auto", "true", "false")),
            value_type=_value_type(o, owner),
            states=_states(o, owner, internal),
            internal_states=internal,
            on_lost=source_choice(o, "onlostchanges", "onLostChanges", owner,
                                  ("fail", "resumeFromOldest")),
            starting=_starting(o, owner),
            max_checkpoints_per_trigger=source_int(o, "maxcheckpointspertrigger",
                                                   "maxCheckpointsPerTrigger", owner, lo=1))

    def catalog(self) -> CheckpointCatalog:
        """The store's checkpoints, opened read-only (close ``catalog.store``)."""
        from dstl.reader.catalog import CheckpointCatalog
        from dstl.reader.store import open_read_only

        return CheckpointCatalog(open_read_only(self.state_uri, self.storage_options),
                                 job_id=self.operator)

    def schema(self, ddl: str) -> str:
        return f"{ddl}, {_TYPED_COLUMN} {self.value_type}" if self.value_type else ddl


def _name(o: Mapping[str, str], name: str, owner: str, *, shown: str | None = None
          ) -> str | None:
    raw = o.get(name)
    return None if raw is None else check_str(raw, shown or name, owner)


def _value_type(o: Mapping[str, str], owner: str) -> str | None:
    """``valueType``: one Spark type in DDL (``bigint``, ``map<string,double>``). Spark parses
    it; checked here is that it is *one* type — a comma outside ``<>``/``()`` would add columns
    to the schema."""
    raw = _name(o, "valuetype", owner, shown="valueType")
    if raw is None:
        return None
    depth = 0
    for c in raw:
        depth += (c in "<(") - (c in ">)")
        if depth < 0 or (depth == 0 and c in ",;"):
            break
    else:
        if depth == 0:
            return raw
    raise ConfigError("valueType", raw, "one Spark SQL type, e.g. bigint, array<string>, "
                      "map<string,double>", owner=owner)


def _states(o: Mapping[str, str], owner: str, internal: bool) -> tuple[str, ...] | None:
    """``state``: comma-separated state names, each non-empty; DSTL's own states only with
    ``internalStates`` (without it, naming one is refused: it would give no rows)."""
    raw = o.get("state")
    if raw is None:
        return None
    names = tuple(s.strip() for s in str(raw).split(","))
    if not all(names):
        raise ConfigError("state", raw, "comma-separated state names, none empty", owner=owner)
    own = [n for n in names if _is_internal(n)]
    if own and not internal:
        raise ConfigError("state", raw, f"names of the job's states (names starting with "
                          f"{RESERVED_STATE_PREFIX!r}, like {own[0]!r}, are DSTL's own)",
                          owner=owner, fix='add .option("internalStates", "true") to read '
                                           "DSTL's own states")
    return names


def _is_internal(name: str) -> bool:
    """Whether ``name`` is one of DSTL's own states (the timer service's ``$timers``), which
    the sources leave out unless ``internalStates`` is on (a job cannot name a state so:
    :data:`~dstl.spark.processor.RESERVED_STATE_PREFIX`)."""
    return name.startswith(RESERVED_STATE_PREFIX)


def _starting(o: Mapping[str, str], owner: str) -> str:
    """``startingCheckpoint``: ``latest``, ``earliest`` or a checkpoint id (``-1``: the empty
    state, as ``earliest``)."""
    raw = o.get("startingcheckpoint")
    if raw is None or str(raw).lower() in ("latest", "earliest"):
        return "latest" if raw is None else str(raw).lower()
    try:
        return str(source_int(o, "startingcheckpoint", "startingCheckpoint", owner, lo=-1))
    except ConfigError:
        raise ConfigError("startingCheckpoint", raw, "latest, earliest or a checkpoint id in "
                          "[-1, 2**63-1]", owner=owner) from None


def _storage_options(o: Mapping[str, str]) -> dict[str, Any] | None:
    """``storageOptions`` (a JSON object) merged with ``storage.<key>`` options (dotted keys
    nest, JSON values parsed — the CLI's ``--storage-option`` rule)."""
    out: dict[str, Any] = {}
    raw = o.get("storageoptions")
    if raw:
        try:
            parsed = json.loads(raw)
        except ValueError as exc:
            raise ConfigError("storageOptions", "<given>", "a JSON object",
                              owner="dstl source") from exc
        out.update(check_mapping(parsed, "storageOptions", "dstl source") or {})
    items = [f"{k[len('storage.'):]}={v}" for k, v in o.items() if k.startswith("storage.")]
    # Spark lower-cases option keys: endpoint_url and friends are lower case already
    out.update(parse_storage_options(items) or {})
    return out or None


# --------------------------------------------------------------------------- filters


@dataclass
class _Pushed:
    """What pushed-down filters allow; every one is applied exactly by the reader."""

    keys: frozenset[bytes] | None = None
    key_groups: frozenset[int] | None = None
    states: frozenset[str] | None = None
    partitions: frozenset[str] | None = None
    bounds: list[tuple[str, int]] = field(default_factory=list)
    #: DSTL's own states are read too (``internalStates``)
    internal: bool = False

    @classmethod
    def of(cls, opts: SourceOptions) -> _Pushed:
        """What the options alone allow (``state``, ``internalStates``)."""
        return cls(states=frozenset(opts.states) if opts.states else None,
                   internal=opts.internal_states)

    @staticmethod
    def _narrow(cur: frozenset[Any] | None, new: frozenset[Any]) -> frozenset[Any]:
        return new if cur is None else cur & new

    def take(self, f: Filter) -> bool:
        """Record ``f`` if it can be pushed; whether it was."""
        attribute: tuple[str, ...] = tuple(getattr(f, "attribute", ()))
        col = attribute[0] if len(attribute) == 1 else None
        if isinstance(f, (EqualTo, In)):
            values = (f.value,) if isinstance(f, EqualTo) else tuple(f.value)
            if col in ("key", "key_bytes"):
                if not all(isinstance(v, (str, bytes, bytearray)) for v in values):
                    return False
                from dstl.reader.read import key_bytes_of

                self.keys = self._narrow(self.keys, key_bytes_of(
                    [bytes(v) if isinstance(v, bytearray) else v for v in values]))
                return True
            if col == "key_group" and all(isinstance(v, int) for v in values):
                self.key_groups = self._narrow(self.key_groups, frozenset(values))
                return True
            if col in ("state", "partition") and all(isinstance(v, str) for v in values):
                name = "states" if col == "state" else "partitions"
                setattr(self, name, self._narrow(getattr(self, name), frozenset(values)))
                return True
        if col == "key_group" and isinstance(
                f, (GreaterThan, GreaterThanOrEqual, LessThan, LessThanOrEqual)) \
                and isinstance(f.value, int):
            self.bounds.append((type(f).__name__, f.value))
            return True
        return False

    def wanted_key_groups(self, max_parallelism: int) -> frozenset[int] | None:
        """The key groups a row can be in, or ``None`` for all."""
        kgs = self.key_groups
        if self.keys is not None:
            kgs = self._narrow(kgs, frozenset(key_group_for(k, max_parallelism)
                                              for k in self.keys))
        if self.bounds:
            lo, hi = 0, MAX_PARALLELISM_LIMIT - 1
            for op, v in self.bounds:
                if op == "GreaterThan":
                    lo = max(lo, v + 1)
                elif op == "GreaterThanOrEqual":
                    lo = max(lo, v)
                elif op == "LessThan":
                    hi = min(hi, v - 1)
                else:
                    hi = min(hi, v)
            kgs = self._narrow(kgs, frozenset(range(max(lo, 0), min(hi, max_parallelism - 1)
                                                    + 1)))
        return kgs

    @property
    def narrows_key_groups(self) -> bool:
        return self.keys is not None or self.key_groups is not None or bool(self.bounds)

    @property
    def read_states(self) -> frozenset[str] | None:
        """The states a split reader is asked for (``None``: all of them)."""
        if self.states is None or self.internal:
            return self.states
        return frozenset(s for s in self.states if not _is_internal(s))

    @property
    def hides_rows(self) -> bool:
        """Whether rows of DSTL's own states must be left out of what a split reader gives
        (it is asked for every state, and ``internalStates`` is off)."""
        return self.states is None and not self.internal

    def accept(self, partition: str, key_bytes: bytes, state: str) -> bool:
        return ((self.keys is None or key_bytes in self.keys)
                and (self.states is None or state in self.states)
                and (self.internal or not _is_internal(state))
                and (self.partitions is None or partition in self.partitions))


# --------------------------------------------------------------------------- reading


_CACHE: dict[int, LocalFileCache] = {}

#: The reader cache's directory name: ``<prefix><pid>-<random>`` under the executor's local dir.
READER_CACHE_PREFIX = "dstl-reader-cache-"


def _process_cache() -> LocalFileCache:
    """One restore cache per (executor worker) process; objects that do not fit its budget are
    read with ranged reads. Its directory is an own directory (:mod:`materializer.local_dirs`)
    under the executor's local directory, removed at exit; a Python worker usually ends with
    ``os._exit`` (no ``atexit``), so a new one first removes those of processes that are gone."""
    from materializer.local_dirs import OwnDirectory, executor_local_dir
    from restore.cache import LocalFileCache

    pid = os.getpid()
    cache = _CACHE.get(pid)
    if cache is None or cache.closed:
        own = OwnDirectory.create(READER_CACHE_PREFIX, executor_local_dir())
        cache = LocalFileCache(own.path, idle_ttl_s=120.0, max_bytes=2 << 30, on_full="direct")
        _CACHE[pid] = cache

        def _close() -> None:
            cache.close()
            own.remove()

        atexit.register(_close)
    return cache


@dataclass(frozen=True)
class _Output:
    """The columns a read yields: all of the source's (``columns is None``), or those of a
    user-specified schema (``spark.read.schema(...)``), in its order and spelling."""

    typed: tuple[str, Any] | None
    #: the source's column of each output column (``None``: the source's schema as it is)
    columns: tuple[str, ...] | None = None
    #: the user-specified schema (a Spark ``StructType``) when ``columns`` is set
    schema: Any = None

    @classmethod
    def of(cls, opts: SourceOptions, schema: Any, ddl: str) -> _Output:
        """The output for the schema Spark hands the reader: the source's own (``schema()``)
        or the user's, which may name any of the source's columns, in any order, each with the
        source's type (``typed_value``: any type, as ``valueType``).

        Raises:
            ConfigError: a column the source does not have, one of another type, one that may
                be null declared NOT NULL, a column named twice, or no column (each named,
                with the source's columns).
        """
        own = _columns(ddl)
        names = tuple(schema.fieldNames())
        shown = schema.simpleString()
        listed = ", ".join(f"{n} {t}" for n, t in own.items())
        expected = f"columns of the source's schema ({listed}, {_TYPED_COLUMN} <any type>)"

        def refuse(fix: str) -> ConfigError:
            return ConfigError("schema", shown, expected, owner="dstl source", fix=fix)

        if not names:
            raise refuse("name at least one column, or give no schema")
        by_lower = {n.lower(): n for n in (*own, _TYPED_COLUMN)}
        columns: list[str] = []
        typed: tuple[str, Any] | None = None
        for f in schema.fields:
            col = by_lower.get(f.name.lower())
            if col is None:
                raise refuse(f"the source has no column {f.name!r}")
            if col in columns:
                raise refuse(f"column {f.name!r} is named twice")
            if not f.nullable and col in _MAY_BE_NULL:
                raise refuse(f"column {f.name!r} can be null (docs/spark.md): declare it "
                             "without NOT NULL (Spark trusts NOT NULL: a null there would "
                             "read as a value or drop out of a filter)")
            if col == _TYPED_COLUMN:
                from pyspark.sql.pandas.types import to_arrow_type

                try:
                    typed = _TYPED_COLUMN, to_arrow_type(f.dataType)
                except (TypeError, ValueError) as exc:  # PySparkTypeError: no Arrow type
                    raise refuse(f"column {f.name!r} is {f.dataType.simpleString()}, which "
                                 f"Spark does not convert from Arrow ({exc}): declare a type "
                                 "it does (e.g. bigint, string, array<...>)") from exc
            elif f.dataType.simpleString() != own[col]:
                raise refuse(f"column {f.name!r} is {own[col]} in the source, not "
                             f"{f.dataType.simpleString()}: declare it {own[col]} (cast after "
                             "reading)")
            columns.append(col)
        if tuple(columns) == names == (*own, *((_TYPED_COLUMN,) if opts.value_type else ())):
            return cls(typed)  # the source's own schema
        return cls(typed, tuple(columns), schema)

    def project(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches`` (of the source's columns) as the output's columns."""
        if self.columns is None:
            yield from batches
            return
        import pyarrow as pa
        from pyspark.sql.pandas.types import to_arrow_schema

        out = to_arrow_schema(self.schema, timezone="UTC")
        for b in batches:
            yield pa.RecordBatch.from_arrays([b.column(c) for c in self.columns], schema=out)


def _columns(ddl: str) -> dict[str, str]:
    """``{name: Spark type}`` of one of the sources' DDLs (:data:`STATE_DDL`,
    :data:`CHANGE_DDL`: ``name type`` pairs, simple types)."""
    return dict(pair.split(" ", 1) for pair in ddl.split(", "))


@dataclass(frozen=True)
class _Split(InputPartition):
    """One split as Spark's input partition (pickled to the executor that reads it)."""

    split: StateSplit | ChangeSplit
    cached: bool


def _read(opts: SourceOptions, pushed: _Pushed, output: _Output,
          partition: InputPartition) -> Iterator[Any]:
    """The Arrow batches of one split, of ``output``'s columns (runs on an executor)."""
    from dstl.spark.worker_gc import freeze_imports

    freeze_imports()  # once per worker, before the read builds anything (dstl.spark.worker_gc)
    return output.project(_read_split(opts, pushed, output, partition))


def _read_split(opts: SourceOptions, pushed: _Pushed, output: _Output,
                partition: InputPartition) -> Iterator[Any]:
    """The Arrow batches of one split: the source's columns (only ``output``'s, or all)."""
    from dstl.reader.arrow import CHANGE_SCHEMA, STATE_SCHEMA, batches
    from dstl.reader.changes import read_change_split
    from dstl.reader.columns import read_state_batches
    from dstl.reader.plan import StateSplit
    from dstl.reader.state import read_state_split
    from dstl.reader.store import open_read_only

    if not isinstance(partition, _Split):
        # Spark reads a source that planned no split (every partition filtered out, an empty
        # change range) through one ``InputPartition(None)`` of its own: no rows
        if getattr(partition, "value", object()) is not None:
            raise UsageError(f"dstl source: asked to read {partition!r}, which is not one of "
                             "the splits it planned (an InputPartition from another source?)")
        return
    part = partition
    cache = _process_cache() if part.cached else None
    store = open_read_only(opts.state_uri, opts.storage_options)
    try:
        rows: Iterator[Any]
        if isinstance(part.split, StateSplit) and opts.table == "heap":
            # column-wise (dstl.reader.columns): the same rows, without Python per row, and
            # only the columns the output has
            yield from read_state_batches(store, part.split, cache=cache,
                                          allow_pickle=opts.allow_pickle, keys=pushed.keys,
                                          states=pushed.read_states, columns=output.columns,
                                          typed=output.typed, batch_rows=_BATCH_ROWS,
                                          exclude_states=_is_internal if pushed.hides_rows
                                          else None)
            return
        if isinstance(part.split, StateSplit):
            rows = read_state_split(store, part.split, cache=cache, table=opts.table,
                                    allow_pickle=opts.allow_pickle, keys=pushed.keys,
                                    states=pushed.read_states)
            if pushed.hides_rows:
                rows = (r for r in rows if not _is_internal(r.state))
            schema = STATE_SCHEMA
        else:
            rows = (r for r in read_change_split(store, part.split, cache=cache,
                                                 allow_pickle=opts.allow_pickle)
                    if pushed.accept(r.partition, r.key_bytes, r.state))
            schema = CHANGE_SCHEMA
        yield from batches(rows, schema, typed=output.typed)
    finally:
        store.close()


def _use_cache(opts: SourceOptions) -> bool:
    # A whole handle per split reads each object once anyway: exact ranged reads fetch less.
    # Slices of a handle share its objects: one download per executor through the cache.
    return opts.cache == "true" or (opts.cache == "auto" and opts.key_groups_per_split is not None)


class _StateReader(DataSourceReader):
    """A checkpoint's state (no ``pushFilters``: :func:`_batch_reader`)."""

    def __init__(self, opts: SourceOptions, schema: Any) -> None:
        self.opts = opts
        self.pushed = _Pushed.of(opts)
        self.output = _Output.of(opts, schema, STATE_DDL)

    def partitions(self) -> Sequence[InputPartition]:
        from dstl.reader.catalog import task_states
        from dstl.reader.plan import plan_state_splits

        catalog = self.opts.catalog()
        try:
            manifest = catalog.manifest(self.opts.checkpoint)
            tasks = [t for t in task_states(manifest)
                     if self.pushed.partitions is None or t.task_id in self.pushed.partitions]
            mp = tasks[0].handle.max_parallelism if tasks else 1
            splits = plan_state_splits(manifest.checkpoint_id, tasks,
                                       key_groups=self.pushed.wanted_key_groups(mp),
                                       max_key_groups=self.opts.key_groups_per_split)
        finally:
            catalog.store.close()
        logger.info("dstl source: checkpoint %d of %s, %d splits", manifest.checkpoint_id,
                    self.opts.state_uri, len(splits))
        cached = _use_cache(self.opts)
        return [_Split(s, cached) for s in splits]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(self.opts, self.pushed, self.output, partition)


class _ChangeReader(DataSourceReader):
    """The batch change feed: ``startCheckpoint`` (exclusive; absent: the empty state) to
    ``endCheckpoint`` (absent: the newest)."""

    def __init__(self, opts: SourceOptions, schema: Any) -> None:
        self.opts = opts
        self.pushed = _Pushed.of(opts)
        self.output = _Output.of(opts, schema, CHANGE_DDL)

    def partitions(self) -> Sequence[InputPartition]:
        return _change_partitions(self.opts, self.pushed, self.opts.start, self.opts.end)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(self.opts, self.pushed, self.output, partition)


class _PushFilters:
    """``pushFilters`` of the batch readers: every filter :meth:`_Pushed.take` records is
    applied exactly by the read; the others Spark evaluates after it."""

    pushed: _Pushed

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        for f in filters:
            if not self.pushed.take(f):
                yield f


class _PushingStateReader(_PushFilters, _StateReader):
    pass


class _PushingChangeReader(_PushFilters, _ChangeReader):
    pass


#: The file of Spark's Python worker that plans a batch read without pushing filters (in
#: pyspark/sql/worker/; filters go to ``data_source_pushdown_filters.py``, which plans the read
#: too): it never calls ``pushFilters``, and it refuses a reader that implements it unless
#: spark.sql.python.filterPushdown.enabled is on.
_PLANS_WITHOUT_FILTERS: Final = "plan_data_source_read.py"


def _batch_reader(opts: SourceOptions, schema: Any) -> DataSourceReader:
    """The batch reader of ``opts``: one that takes pushed-down filters, except when Spark's
    step that pushes none makes it.

    Spark pushes filters to a Python source only with ``spark.sql.python.filterPushdown.enabled``
    (off by default) and, with it off, refuses a reader whose class implements ``pushFilters``
    (pyspark/sql/worker/plan_data_source_read.py). A source Spark found by itself
    (:mod:`pyspark_dstl`) runs in sessions where nobody turned it on; there the plan step gets
    a reader without ``pushFilters`` and Spark applies every filter itself (the same rows, all
    key groups read). :func:`dstl.spark.register` turns the conf on.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if os.path.basename(frame.f_code.co_filename) == _PLANS_WITHOUT_FILTERS:
            return _ChangeReader(opts, schema) if opts.change_feed else _StateReader(opts, schema)
        frame = frame.f_back
    if opts.change_feed:
        return _PushingChangeReader(opts, schema)
    return _PushingStateReader(opts, schema)


def _change_partitions(opts: SourceOptions, pushed: _Pushed, start: int | None,
                       end: int | None) -> list[InputPartition]:
    from dstl.reader.changes import OnLost, plan_change_range

    catalog = opts.catalog()
    try:
        on_lost: OnLost = "oldest" if opts.on_lost == "resumeFromOldest" else "fail"
        plan = plan_change_range(catalog, start, end, on_lost=on_lost,
                                 lost_option='.option("onLostChanges", "resumeFromOldest")')
    finally:
        catalog.store.close()
    if plan.lost is not None:
        logger.warning("dstl change feed of %s: checkpoint %d is no longer retained; the "
                       "changes of checkpoints %d..%d are lost, resuming after %d",
                       opts.state_uri, plan.lost[0], plan.lost[0] + 1, plan.lost[1],
                       plan.lost[1])
    splits: list[ChangeSplit] = [s for s in plan.splits
                                 if pushed.partitions is None or s.task_id in pushed.partitions]
    kgs = pushed.wanted_key_groups(plan.max_parallelism) if pushed.narrows_key_groups else None
    if kgs is not None:
        narrowed = []
        for s in splits:
            only = tuple(sorted(k for k in kgs if s.key_groups[0] <= k <= s.key_groups[1]))
            if only:
                narrowed.append(replace(s, only=only))
        splits = narrowed
    cached = _use_cache(opts)
    return [_Split(s, cached) for s in splits]


# --------------------------------------------------------------------------- streaming


class _ChangeStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """The change feed as a stream: offsets are checkpoint ids."""

    def __init__(self, opts: SourceOptions, schema: Any) -> None:
        self.opts = opts
        self.pushed = _Pushed.of(opts)
        self.output = _Output.of(opts, schema, CHANGE_DDL)
        self.target: int | None = None  # availableNow: the newest checkpoint when it started

    def _ids(self) -> list[int]:
        catalog = self.opts.catalog()
        try:
            return catalog.ids()
        finally:
            catalog.store.close()

    def initialOffset(self) -> dict[str, int]:
        s = self.opts.starting.lower()
        if s == "earliest":
            return {"checkpoint": -1}
        if s == "latest":
            ids = self._ids()
            return {"checkpoint": ids[-1] if ids else -1}
        return {"checkpoint": int(s)}  # checked by SourceOptions.parse

    def prepareForTriggerAvailableNow(self) -> None:
        ids = self._ids()
        self.target = ids[-1] if ids else -1

    def latestOffset(self, start: dict[str, int] | None = None,
                     limit: Any = None) -> dict[str, int]:
        begin = int(start["checkpoint"]) if start else -1
        ids = [c for c in self._ids() if c > begin]
        if self.target is not None:
            ids = [c for c in ids if c <= self.target]
        cap = self.opts.max_checkpoints_per_trigger
        if cap is not None and not isinstance(limit, ReadAllAvailable):
            ids = ids[:cap]
        return {"checkpoint": ids[-1] if ids else begin}

    def reportLatestOffset(self) -> dict[str, int]:
        ids = self._ids()
        return {"checkpoint": ids[-1] if ids else -1}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        a, b = int(start["checkpoint"]), int(end["checkpoint"])
        if b <= a:
            return []
        return _change_partitions(self.opts, self.pushed, a if a >= 0 else None, b)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(self.opts, self.pushed, self.output, partition)

    def commit(self, end: dict[str, int]) -> None:
        logger.debug("dstl change feed of %s committed up to checkpoint %s",
                     self.opts.state_uri, end.get("checkpoint"))


class _RefusedStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A stream DSTL refuses (``readStream.format("dstl")``, a bad option): every call raises
    the refusal, ``stop`` does nothing.

    PySpark's stream runner creates the reader inside ``try: ... finally: reader.stop()``; a
    ``streamReader`` that raised would leave ``reader`` unbound, and the ``UnboundLocalError`` of
    ``stop()`` would become the error Spark shows, with DSTL's only as its context. This reader
    is created, and the runner's first call on it raises DSTL's error itself.
    """

    def __init__(self, error: DstlError) -> None:
        self.error = error

    def initialOffset(self) -> dict[str, int]:
        raise self.error

    def prepareForTriggerAvailableNow(self) -> None:
        raise self.error

    def latestOffset(self, start: dict[str, int] | None = None,
                     limit: Any = None) -> dict[str, int]:
        raise self.error

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        raise self.error

    def read(self, partition: InputPartition) -> Iterator[Any]:
        raise self.error

    def commit(self, end: dict[str, int]) -> None:
        raise self.error

    def stop(self) -> None:
        """Nothing was opened."""


def _stream_reader(make: Callable[[], DataSourceStreamReader]) -> DataSourceStreamReader:
    """``make()``, or a reader that raises its error from the runner's first call."""
    try:
        return make()
    except DstlError as exc:
        return _RefusedStreamReader(exc)


# --------------------------------------------------------------------------- the sources


class DstlStateDataSource(DataSource):
    """``spark.read.format("dstl").load(state_uri)``: a checkpoint's state, or with
    ``readChangeFeed`` the changes between checkpoints."""

    @classmethod
    def name(cls) -> str:
        return "dstl"

    def schema(self) -> str:
        opts = SourceOptions.parse(self.options)
        return opts.schema(CHANGE_DDL if opts.change_feed else STATE_DDL)

    def reader(self, schema: Any) -> DataSourceReader:
        return _batch_reader(SourceOptions.parse(self.options, stream=False), schema)

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return _RefusedStreamReader(ConfigError(
            "format", "dstl", "dstl_changes for a stream", owner="readStream",
            fix='spark.readStream.format("dstl_changes") streams the change feed; '
                'spark.read.format("dstl") reads state or a batch change feed'))


class DstlChangesDataSource(DataSource):
    """``spark.readStream.format("dstl_changes").load(state_uri)``: the change feed as a stream
    (``spark.read.format("dstl_changes")`` reads it as a batch, like ``readChangeFeed``)."""

    @classmethod
    def name(cls) -> str:
        return "dstl_changes"

    def schema(self) -> str:
        return SourceOptions.parse(self.options, source="dstl_changes").schema(CHANGE_DDL)

    def reader(self, schema: Any) -> DataSourceReader:
        return _batch_reader(SourceOptions.parse(self.options, source="dstl_changes",
                                                 stream=False), schema)

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return _stream_reader(lambda: _ChangeStreamReader(
            SourceOptions.parse(self.options, source="dstl_changes", stream=True), schema))
